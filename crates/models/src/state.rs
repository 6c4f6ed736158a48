//! The buffers a forward step writes, allocated once per model instance.

use crate::{Model, Result};
use quiver_backend::Backend;

/// Everything a forward step writes: the KV cache and the activation workspace, allocated
/// once for at most `max_tokens` tokens and `max_logits` logits rows per step.
pub struct State<B: Backend> {
    /// Unique per state: names these buffers to the backend (captured steps are per state).
    pub id: u64,
    pub kv: Vec<B::Kv>,
    pub n_slots: usize,
    pub max_tokens: usize,
    pub max_logits: usize,
    pub(crate) x: B::Buf,    // [n, n_embd] residual stream
    pub(crate) xn: B::Buf,   // [n, n_embd] normed (after a step: the output norm's)
    pub(crate) q: B::Buf,    // [n, n_head · head_dim]
    pub(crate) k: B::Buf,    // [n, n_head_kv · head_dim]
    pub(crate) v: B::Buf,    // [n, n_head_kv · head_dim]
    pub(crate) attn: B::Buf, // [n, n_head · head_dim]
    pub(crate) o: B::Buf,    // [n, n_embd]
    pub(crate) gate: B::Buf, // [n, n_ff]
    pub(crate) up: B::Buf,   // [n, n_ff]
    pub(crate) act: B::Buf,  // [n, n_ff]
    /// The MoE layers' scratch (`MoeParams::scratch_floats`), where the model has them.
    pub(crate) moe: Vec<B::Buf>,
    /// Two more [n, n_embd] buffers for Gemma 4's MoE blocks (none elsewhere).
    pub(crate) aux: Vec<B::Buf>,
    /// Gemma 4's per-layer embedding buffers, where the model has them.
    pub(crate) ple: Option<crate::extras::PleBufs<B>>,
    /// The hybrid layers' step buffers (Qwen 3.5), where the model has them.
    pub(crate) hy: Option<crate::qwen35::HybridBufs<B>>,
    /// DeepSeek-V4's step buffers, where the model is one.
    pub(crate) ds: Option<crate::deepseek4::Bufs<B>>,
    /// A draft head's step buffers (EAGLE-3, a multi-token-prediction block), where the model
    /// is one.
    pub(crate) ea: Option<crate::eagle3::Bufs<B>>,
    /// The hidden states a step keeps for an EAGLE-3 head ([`State::capture_layers`]).
    cap: Option<Capture<B>>,
    /// The recurrent state of each gated-delta-net layer: `n_seq_states` slots of
    /// `DeltaNetParams::state_floats` (Qwen 3.5; none elsewhere).
    pub rs: Vec<B::Buf>,
    /// Sequences the recurrent state holds at once (`SeqSpan::state_slot` below this).
    pub n_seq_states: usize,
    /// Per recurrent layer, the states each kept slot holds for a rollback
    /// ([`quiver_backend::Snapshots`], [`State::keep_states`]); empty without.
    pub(crate) snap: Vec<B::Buf>,
    /// Kept states per kept slot (0: none).
    pub snap_planes: usize,
    /// Kept slots: the sequences of one step that may keep states (`SeqSpan::kept_slot`).
    pub snap_slots: usize,
    /// [max_logits, n_vocab] after a step
    pub logits: B::Buf,
}

/// Which layers' inputs a step keeps, side by side per token.
struct Capture<B: Backend> {
    layers: Vec<usize>,
    /// [max_tokens, layers.len() · n_embd]
    feat: B::Buf,
}

impl<B: Backend> State<B> {
    /// After a step: every token's final hidden state, `[n, n_embd]`, normed by the model's
    /// output norm (what the output matrix multiplies; what embeddings pool).
    pub fn hidden(&self) -> &B::Buf {
        &self.xn
    }

    /// After a step: every token's hidden state as a multi-token-prediction block reads it,
    /// `[n, Hparams::stream_width]`: [`State::hidden`], or DeepSeek-V4's hc streams before the
    /// head mixes them (llama.cpp's `h_nextn`).
    pub fn head_hidden(&self) -> &B::Buf {
        match &self.ds {
            Some(ds) => ds.streams(),
            None => &self.xn,
        }
    }

    /// Makes every later step keep the input of each of `layers` (a layer count: the final
    /// pre-norm state) for each token, side by side ([`State::features`]): what an EAGLE-3
    /// head reads. The model's width is `n_embd`.
    pub fn capture_layers(&mut self, b: &B, layers: &[usize], n_embd: usize) -> Result<()> {
        self.cap = Some(Capture {
            layers: layers.to_vec(),
            feat: b.buf(self.max_tokens * layers.len() * n_embd)?,
        });
        Ok(())
    }

    /// Makes later steps keep, for up to `slots` sequences a step (those whose span names a
    /// `SeqSpan::kept_slot`: the speculating ones), the recurrent state after each of their
    /// last `planes` rows but one (Qwen 3.5's delta-net layers: [`quiver_backend::Snapshots`]),
    /// or what their last `planes` rows overwrite in DeepSeek-V4's rings
    /// ([`quiver_backend::dsv4::Kept`]), so that [`State::rewind`] can return them to any of
    /// those rows: what speculative decoding needs to drop rejected proposals. Memory checked.
    pub fn keep_states(
        &mut self,
        b: &B,
        hp: &crate::Hparams,
        planes: usize,
        slots: usize,
    ) -> Result<()> {
        if !hp.has_seq_state() {
            return Ok(());
        }
        self.snap.clear();
        (self.snap_planes, self.snap_slots) = (0, 0);
        if planes == 0 || slots == 0 {
            return Ok(());
        }
        // Per layer buffer: whole states (the delta net's), or DeepSeek-V4's ring rows.
        let per_layer: Vec<usize> = match (&hp.dsv4, hp.delta_net) {
            (Some(ds), _) => (0..self.rs.len())
                .map(|i| quiver_backend::dsv4::kept_floats(&ds.shape(hp, i, 1)))
                .collect(),
            (None, Some(p)) => vec![p.state_floats(); self.rs.len()],
            (None, None) => Vec::new(),
        };
        let n = slots * planes;
        let need = per_layer.iter().map(|&f| (f * n) as u64 * 4).sum::<u64>();
        if let Some(available) = b.memory_available() {
            if need > available {
                return Err(quiver_backend::BackendError::OutOfMemory {
                    what: format!(
                        "what {planes} rows change in the per-sequence state, for {slots} speculating sequences (speculative decoding's rollback)"
                    ),
                    need,
                    available,
                    device: b.name(),
                    hint: ": lower --draft-max",
                }
                .into());
            }
        }
        self.snap = per_layer
            .iter()
            .map(|&f| b.buf(f * n))
            .collect::<std::result::Result<_, _>>()?;
        (self.snap_planes, self.snap_slots) = (planes, slots);
        // New buffers: steps captured before them are not this state's any more.
        self.id = next_id();
        Ok(())
    }

    /// Returns state slot `slot` to its state after row `row` of its last step's span of
    /// `len` rows from position `start`, which kept slot `kept_slot` held (the kept states:
    /// [`quiver_backend::Snapshots`], or
    /// DeepSeek-V4's kept ring rows, [`quiver_backend::dsv4::Kept`]): a verification whose
    /// proposals were not all accepted goes back to the row of its last accepted token.
    /// Nothing to do for the last row; a row the state did not keep is an error.
    #[allow(clippy::too_many_arguments)]
    pub fn rewind(
        &mut self,
        b: &B,
        hp: &crate::Hparams,
        slot: usize,
        kept_slot: usize,
        start: usize,
        len: usize,
        row: usize,
    ) -> Result<()> {
        if row + 1 >= len {
            return Ok(());
        }
        let planes = self.snap_planes;
        if len - 1 - row > planes {
            return Err(crate::ModelError::Rollback {
                back: len - 1 - row,
                planes,
            });
        }
        if let Some(ds) = &hp.dsv4 {
            let n_ctx = self.ds.as_ref().map_or(1, |d| d.n_ctx);
            for (i, (rs, kept)) in self.rs.iter_mut().zip(&self.snap).enumerate() {
                let shape = ds.shape(hp, i, n_ctx);
                b.dsv4_rewind(&shape, rs, kept, planes, slot, kept_slot, start, len, row)?;
            }
            return Ok(());
        }
        let Some(p) = hp.delta_net else {
            return Ok(());
        };
        // Row `row`'s plane (`Snapshots::plane_of`), in range: checked above.
        let j = row + 1 + planes - len;
        let per = p.state_floats();
        for (rs, snap) in self.rs.iter_mut().zip(&self.snap) {
            b.copy_range(snap, (kept_slot * planes + j) * per, rs, slot * per, per)?;
        }
        Ok(())
    }

    /// After a step with [`State::capture_layers`]: [rows, layers · n_embd].
    pub fn features(&self) -> Option<&B::Buf> {
        self.cap.as_ref().map(|c| &c.feat)
    }

    /// At layer `i`'s start (the residual stream `x` is its input): keeps x where captured.
    pub(crate) fn capture(&mut self, b: &B, i: usize, n: usize, d: usize) -> Result<()> {
        if let Some(c) = self.cap.as_mut() {
            let cols = c.layers.len() * d;
            for (k, _) in c.layers.iter().enumerate().filter(|(_, &l)| l == i) {
                b.put_cols(&self.x, d, n, &mut c.feat, cols, k * d)?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Model<B> {
    pub fn state(
        &self,
        b: &B,
        n_slots: usize,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<State<B>> {
        self.state_with_seqs(b, n_slots, max_tokens, max_logits, self.max_seqs)
    }

    /// [`Model::state`] with recurrent state for `n_seqs` sequences at once (models with
    /// recurrent layers; others ignore it).
    pub fn state_with_seqs(
        &self,
        b: &B,
        n_slots: usize,
        max_tokens: usize,
        max_logits: usize,
        n_seqs: usize,
    ) -> Result<State<B>> {
        let hp = &self.hp;
        let n = max_tokens;
        let (qd, kvd, max_ff) = hp.max_dims();
        let spec = hp.kv_spec(n_slots, self.kv_types);
        let moe: Vec<usize> = match &hp.moe {
            Some(p) => p.scratch_floats(n, hp.n_embd).to_vec(),
            None => Vec::new(),
        };
        // Dense layers' FFN buffers (a model of MoE layers only has none).
        let ff = if hp.has_dense_ffn() { max_ff } else { 0 };
        // The shared expert runs through the dense FFN's buffers.
        let ff = ff.max(hp.shared_expert_ff);
        let n_aux = if hp.moe.is_some_and(|m| m.router_given) || hp.shared_expert_ff > 0 {
            2
        } else {
            0
        };
        let ple = hp.n_embd_per_layer;
        let ple_all = hp.n_layer * ple;
        // Everything below, checked before any of it is allocated.
        let kv = spec.bytes();
        let floats = (n as u64)
            .saturating_mul(
                ((3 + n_aux) * hp.n_embd + 2 * qd + 2 * kvd + 3 * ff + 2 * ple_all + 3 * ple)
                    as u64,
            )
            .saturating_add((max_logits as u64).saturating_mul(hp.n_vocab as u64))
            .saturating_add(moe.iter().map(|&m| m as u64).sum::<u64>());
        let mut attention: Vec<(usize, usize)> =
            hp.layers.iter().map(|l| (l.n_head, l.head_dim)).collect();
        attention.sort_unstable();
        attention.dedup();
        let ws = quiver_backend::WorkspaceSpec {
            // (A DeepSeek-V4 block's eh_proj multiplies each of a row's hc streams.)
            max_tokens: if hp.mtp {
                n * hp.stream_width() / hp.n_embd
            } else {
                n
            },
            max_logits,
            // (An EAGLE-3 head's attention reads twice its width, its fc three target widths; a
            // multi-token-prediction block's eh_proj twice its width.)
            max_product_cols: hp
                .n_embd
                .max(ff)
                .max(qd)
                .max(ple_all)
                .max(hp.stream_width())
                .max(match &hp.eagle3 {
                    Some(e) => (2 * hp.n_embd).max(3 * e.n_embd_tgt),
                    None if hp.mtp => 2 * hp.n_embd,
                    None => 0,
                }),
            n_embd: hp.n_embd,
            n_vocab: hp.n_vocab,
            attention,
            n_slots,
        };
        // The hybrid layers' step buffers and every sequence slot's recurrent state.
        let n_seq_states = n_seqs.max(1);
        let hy_floats = match hp.delta_net {
            Some(_) => crate::qwen35::HybridBufs::<B>::floats(hp, n) as u64,
            None => 0,
        };
        // DeepSeek-V4's per-sequence state holds as many positions as a sequence can reach.
        let ds_ctx = n_slots.min(self.seq_ctx.unwrap_or(n_slots)).max(1);
        let ds_floats = match hp.dsv4 {
            Some(_) => crate::deepseek4::Bufs::<B>::floats(hp, n, ds_ctx) as u64,
            None => 0,
        };
        let ds_bytes = hp.dsv4.as_ref().map_or(0, |ds| ds.state_bytes(hp, ds_ctx));
        let rs_bytes = (hp.state_bytes_per_seq() + ds_bytes).saturating_mul(n_seq_states as u64);
        let head = hp.eagle3.is_some() || hp.mtp;
        let ea_floats = match head {
            true => crate::eagle3::Bufs::<B>::floats(hp, n) as u64,
            false => 0,
        };
        let floats = (floats.saturating_add(hy_floats))
            .saturating_add(ds_floats)
            .saturating_add(ea_floats);
        let need = kv
            .saturating_add(rs_bytes)
            .saturating_add(floats.saturating_mul(4))
            .saturating_add(b.workspace_bytes(&ws));
        if let Some(available) = b.memory_available() {
            if need > available {
                return Err(quiver_backend::BackendError::OutOfMemory {
                    what: format!(
                        "the KV cache for {n_slots} positions{}, and the buffers for {n} tokens per step",
                        if rs_bytes > 0 {
                            format!(", the recurrent state of {n_seq_states} sequences")
                        } else {
                            String::new()
                        }
                    ),
                    need,
                    available,
                    device: b.name(),
                    hint: ": lower the context (--ctx-size, --kv-blocks, --kv-mem) or the batch size (--batch-size)",
                }
                .into());
            }
        }
        b.reserve_workspace(&ws)?;
        Ok(State {
            id: next_id(),
            kv: (0..spec.layers.len())
                .map(|i| b.kv(&spec, i))
                .collect::<std::result::Result<_, _>>()?,
            n_slots,
            max_tokens,
            max_logits,
            x: b.buf(n * hp.n_embd)?,
            xn: b.buf(n * hp.n_embd)?,
            q: b.buf(n * qd)?,
            k: b.buf(n * kvd)?,
            v: b.buf(n * kvd)?,
            attn: b.buf(n * qd)?,
            o: b.buf(n * hp.n_embd)?,
            gate: b.buf((n * ff).max(1))?,
            up: b.buf((n * ff).max(1))?,
            act: b.buf((n * ff).max(1))?,
            moe: moe
                .iter()
                .map(|&m| b.buf(m))
                .collect::<std::result::Result<_, _>>()?,
            aux: (0..n_aux)
                .map(|_| b.buf(n * hp.n_embd))
                .collect::<std::result::Result<_, _>>()?,
            ple: match ple {
                0 => None,
                _ => Some(crate::extras::PleBufs {
                    tok: b.buf(n * ple_all)?,
                    all: b.buf(n * ple_all)?,
                    g: b.buf(n * ple)?,
                    slice: b.buf(n * ple)?,
                    a: b.buf(n * ple)?,
                }),
            },
            hy: match hp.delta_net {
                Some(_) => Some(crate::qwen35::HybridBufs::new(b, hp, n)?),
                None => None,
            },
            ds: match hp.dsv4 {
                Some(_) => Some(crate::deepseek4::Bufs::new(b, hp, n, ds_ctx)?),
                None => None,
            },
            ea: match head {
                true => Some(crate::eagle3::Bufs::new(b, hp, n)?),
                false => None,
            },
            cap: None,
            rs: match (hp.delta_net, &hp.dsv4) {
                (Some(p), _) => (0..hp.n_recurrent())
                    .map(|_| b.buf(n_seq_states * p.state_floats()))
                    .collect::<std::result::Result<_, _>>()?,
                (None, Some(ds)) => (0..hp.n_layer)
                    .map(|i| b.buf(n_seq_states * ds.shape(hp, i, ds_ctx).state_floats()))
                    .collect::<std::result::Result<_, _>>()?,
                (None, None) => Vec::new(),
            },
            n_seq_states,
            snap: Vec::new(),
            snap_planes: 0,
            snap_slots: 0,
            logits: b.buf(max_logits * hp.n_vocab)?,
        })
    }
}

/// A state's id, unique in the process.
fn next_id() -> u64 {
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
