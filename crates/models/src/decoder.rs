//! The decoder-only transformer forward every architecture shares, over a flat batch.

use crate::{weight, Hparams, ModelError, Result, State};
use quiver_backend::{AttnParams, Backend, Batch, RopeParams, Step};
use quiver_gguf::GgufFile;
use std::sync::Arc;

pub struct Layer<B: Backend> {
    pub attn_norm: B::Weight,
    pub wq: B::Weight,
    /// None: the layer reads another layer's cache and writes none (`kv`).
    pub wk: Option<B::Weight>,
    /// None (with `wk`): v is k's product (Gemma 4's global layers without `attn_v`).
    pub wv: Option<B::Weight>,
    pub wo: B::Weight,
    /// Product biases (Qwen2's q/k/v), where the file has them.
    pub bq: Option<B::Weight>,
    pub bk: Option<B::Weight>,
    pub bv: Option<B::Weight>,
    pub bo: Option<B::Weight>,
    pub q_norm: Option<B::Weight>,
    pub k_norm: Option<B::Weight>,
    pub post_attn_norm: Option<B::Weight>,
    pub ffn_norm: B::Weight,
    pub ffn: Ffn<B>,
    pub post_ffw_norm: Option<B::Weight>,
    pub attn: AttnParams,
    pub rope: RopeParams,
    /// The cache (index into `State::kv`) the layer attends over.
    pub kv: usize,
    /// Gemma 4's per-layer embedding block, where the model has one.
    pub ple: Option<crate::extras::PleLayer<B>>,
    /// Multiplies the layer's output (Gemma 4's `layer_output_scale`).
    pub out_scale: Option<f32>,
    pub scales: Scales,
    /// A gated-delta-net layer's own weights (Qwen 3.5); `wq` is then its in-projection and
    /// `wo` its output projection, and the layer has no attention.
    pub linear: Option<crate::qwen35::LinearAttn<B>>,
    /// `wo` and the FFN's down in column parts, used in their place (the unsharded reference
    /// of tensor-parallel ranks, `crate::tp`).
    pub reduce_parts: Option<crate::ReduceParts<B>>,
}

/// Per-tensor weight scales (`blk.N.attn_q.scale`, … holding one f32): the product's output
/// times the scale, before its bias, as llama.cpp's graph applies them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Scales {
    pub q: Option<f32>,
    pub k: Option<f32>,
    pub v: Option<f32>,
    pub o: Option<f32>,
    pub gate: Option<f32>,
    pub up: Option<f32>,
    pub down: Option<f32>,
}

/// A layer's feed-forward block.
pub enum Ffn<B: Backend> {
    /// act(x·gateᵀ) · (x·upᵀ), then down.
    Dense {
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
    /// A mixture of experts (`Hparams::moe`).
    Moe(Experts<B>),
    /// Gemma 4: a dense MLP and experts side by side, each normed on the way in and out, the
    /// router reading the unweighted-normed input times `router_scale` / √n_embd.
    DenseAndExperts {
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
        post_norm_1: B::Weight,
        pre_norm_2: B::Weight,
        post_norm_2: B::Weight,
        router_scale: B::Weight,
        experts: Experts<B>,
    },
}

/// A layer's experts: router [n_expert, n_embd] and the experts stacked as the GGUF's 3-D
/// tensors hold them, and the per-expert scales of each product where the file has them.
pub struct Experts<B: Backend> {
    pub router: B::Weight,
    /// The gate experts, or (with `up` None) the gate and up experts in one tensor of 2·n_ff
    /// rows per expert, the gate's first (`ffn_gate_up_exps`).
    pub gate: B::Weight,
    pub up: Option<B::Weight>,
    pub down: B::Weight,
    pub down_scale: Option<B::Weight>,
    pub gate_scale: Option<B::Weight>,
    pub up_scale: Option<B::Weight>,
    /// The shared expert beside the routed ones (Qwen 3.5 MoE).
    pub shared: Option<SharedExpert<B>>,
}

/// A shared expert: a SwiGLU FFN every token runs, its output times σ(x · `gate_inp`).
pub struct SharedExpert<B: Backend> {
    pub gate: B::Weight,
    pub up: B::Weight,
    pub down: B::Weight,
    /// [n_embd]: the shared expert's gate (`ffn_gate_inp_shexp`).
    pub gate_inp: B::Weight,
    /// Per-tensor scales of gate, up, down.
    pub scales: [Option<f32>; 3],
}

pub struct Model<B: Backend> {
    pub hp: Hparams,
    pub tok_embd: B::Weight,
    pub output_norm: B::Weight,
    /// None: the output projection is tied to the token embedding.
    pub output: Option<B::Weight>,
    pub output_b: Option<B::Weight>,
    pub layers: Vec<Layer<B>>,
    /// Gemma 4's per-layer embedding inputs, where the model has them.
    pub ple: Option<crate::extras::PleInput<B>>,
    /// The KV cache's element types ([`Model::set_kv_types`]; f16 by default).
    pub kv_types: quiver_backend::KvTypes,
    /// DeepSeek-V4's weights (its layers replace `layers`, which it leaves empty).
    pub dsv4: Option<crate::deepseek4::Dsv4<B>>,
    /// An EAGLE-3 draft head's weights beside its one layer.
    pub eagle3: Option<crate::eagle3::Eagle3<B>>,
    /// A multi-token-prediction block's input stage (`crate::mtp`: the block is layer 0).
    pub mtp: Option<crate::mtp::Mtp<B>>,
    /// The positions one sequence may reach, where a state's size depends on it
    /// (DeepSeek-V4's compressed KV); None: as many as the state's KV slots.
    pub seq_ctx: Option<usize>,
    /// Sequences a state made after this holds recurrent state for (models with recurrent
    /// layers; [`Model::set_max_seqs`], 1 by default).
    pub max_seqs: usize,
}

/// Loads the model `hp` describes; `tp` says which part of each layer (`hp` is then the
/// rank's, `Hparams::shard`).
pub(crate) fn load<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    mut hp: Hparams,
    tp: crate::tp::Tp,
) -> Result<Model<B>> {
    // An expert-parallel split (`Hparams::shard`: (0, count)): rank r holds the r-th run.
    if let Some(m) = hp.moe.as_mut().filter(|m| m.held.1 < m.n_expert) {
        m.held.0 = tp.shard.rank * m.held.1;
    }
    if hp.dsv4.is_some() {
        let d = hp.n_embd as u64;
        let v = hp.n_vocab as u64;
        let ds = crate::deepseek4::load(b, f, &hp)?;
        return Ok(Model {
            tok_embd: weight(b, f, "token_embd.weight", &[v, d])?,
            output_norm: weight(b, f, "output_norm.weight", &[d])?,
            output: Some(weight(b, f, "output.weight", &[v, d])?),
            output_b: None,
            layers: Vec::new(),
            ple: None,
            dsv4: Some(ds),
            eagle3: None,
            mtp: None,
            seq_ctx: None,
            hp,
            kv_types: quiver_backend::KvTypes::default(),
            max_seqs: 1,
        });
    }
    crate::extras::check_ops(b, &hp)?;
    let d = hp.n_embd as u64;
    let w = |name: &str, shape: &[u64]| weight(b, f, name, shape);
    let opt = |name: &str, shape: &[u64], want: bool| -> Result<Option<B::Weight>> {
        if want {
            w(name, shape).map(Some)
        } else {
            Ok(None)
        }
    };
    // Present in the file: optional tensors (biases) load when they are there.
    let has = |name: &str| f.tensor(name).is_some();
    let mut layers = Vec::with_capacity(hp.n_layer);
    let mut n_recurrent = 0;
    for i in 0..hp.n_layer {
        let lh = &hp.layers[i];
        let (hd, ff) = (lh.head_dim as u64, lh.n_ff as u64);
        let (qd, kvd) = (lh.q_dim() as u64, lh.kv_dim() as u64);
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        // (q, k and v's split with their rows.)
        let bias = |s: &str, len: u64, split: bool| {
            let name = format!("blk.{i}.{s}.bias");
            match (has(&name), split) {
                (false, _) => Ok(None),
                (true, true) => tp.vector(b, f, &name, len).map(Some),
                (true, false) => w(&name, &[len]).map(Some),
            }
        };
        // The rank's rows of a whole tensor.
        let rows = |name: &str, r: u64| tp.rows(b, f, name, &[r, d], 0, r);
        let swa = hp.swa_layers[i];
        let rope = if swa {
            hp.rope_local.clone().unwrap_or_else(|| hp.rope.clone())
        } else {
            hp.rope.clone()
        };
        let own_kv = lh.kv_from == i;
        // Qwen 3.5's gated attention: q and its gate in one product.
        let qg = if hp.q_gate { 2 * qd } else { qd };
        let mut linear = None;
        let (wq, wk, wv) = if lh.recurrent {
            let (wq, wo, lin) = crate::qwen35::load_linear(b, f, &hp, i, n_recurrent)?;
            n_recurrent += 1;
            linear = Some((lin, wo));
            (wq, None, None)
        } else if has(&n("attn_qkv")) {
            // (Qwen 3.5: q and its gate first, as one part.)
            let shape = [qg + 2 * kvd, d];
            let part = |first, rows| tp.rows(b, f, &n("attn_qkv"), &shape, first, rows);
            (
                part(0, qg)?,
                Some(part(qg, kvd)?),
                Some(part(qg + kvd, kvd)?),
            )
        } else if !own_kv {
            (rows(&n("attn_q"), qd)?, None, None)
        } else {
            // Gemma 4's global layers may have no v (then v is k's product).
            let v_optional = hp.v_norm && !swa;
            let wv = !v_optional || has(&n("attn_v"));
            (
                rows(&n("attn_q"), qg)?,
                Some(rows(&n("attn_k"), kvd)?),
                wv.then(|| rows(&n("attn_v"), kvd)).transpose()?,
            )
        };
        let ffn = crate::extras::load_ffn(b, f, &hp, i, ff, &tp)?;
        let (linear, wo) = match linear {
            Some((lin, wo)) => (Some(lin), wo),
            None => (None, tp.cols(b, f, &n("attn_output"), &[d, qd])?),
        };
        let reduce_parts = match (
            tp.col_parts(b, f, &n("attn_output"), &[d, qd])?,
            tp.col_parts(b, f, &n("ffn_down"), &[d, ff])?,
        ) {
            (Some(wo), Some(down)) => Some(crate::ReduceParts { wo, down }),
            _ => None,
        };
        let ffn_norm = if hp.q_gate {
            "post_attention_norm"
        } else {
            "ffn_norm"
        };
        layers.push(Layer {
            attn_norm: w(&n("attn_norm"), &[d])?,
            wq,
            wk,
            wv,
            wo,
            bq: bias("attn_q", qg, true)?,
            bk: bias("attn_k", kvd, true)?,
            bv: bias("attn_v", kvd, true)?,
            bo: bias("attn_output", d, false)?,
            q_norm: opt(&n("attn_q_norm"), &[hd], hp.qk_norm && !lh.recurrent)?,
            k_norm: opt(
                &n("attn_k_norm"),
                &[hd],
                hp.qk_norm && own_kv && !lh.recurrent,
            )?,
            post_attn_norm: opt(&n("post_attention_norm"), &[d], hp.post_norms)?,
            ffn_norm: w(&n(ffn_norm), &[d])?,
            ffn,
            post_ffw_norm: opt(&n("post_ffw_norm"), &[d], hp.post_norms)?,
            attn: AttnParams {
                n_head: lh.n_head,
                n_head_kv: lh.n_head_kv,
                head_dim: lh.head_dim,
                scale: hp.attn_scale,
                scale_q: hp.scale_q,
                window: if swa { hp.sliding_window } else { None },
                softcap: hp.attn_softcap,
            },
            rope,
            kv: hp.kv_index(i),
            ple: crate::extras::load_ple_layer(b, f, &hp, i)?,
            out_scale: crate::extras::out_scale(f, &hp, i)?,
            scales: crate::extras::weight_scales(b, f, &hp, i)?,
            linear,
            reduce_parts,
        });
    }
    // Embedding and head split by vocabulary where the ranks divide it (`crate::tp`).
    let v = hp.n_vocab as u64;
    let split = tp.vocab_rows(v);
    let part = |name: &str, rows: u64| tp.rows(b, f, name, &[rows, d], 0, rows);
    let tok_embd = match split {
        Some(r) if b.supports(quiver_backend::ExtraOp::EmbedPart) => part("token_embd.weight", r)?,
        _ => w("token_embd.weight", &[v, d])?,
    };
    let tied = !has("output.weight");
    let output = match split {
        // (A tied head is the embedding's rows, the rank's where the embedding is split.)
        Some(_) if tied && b.weight_rows(&tok_embd) < hp.n_vocab => None,
        Some(r) if tied => Some(part("token_embd.weight", r)?),
        Some(r) => Some(part("output.weight", r)?),
        None if tied => None,
        None => Some(w("output.weight", &[v, d])?),
    };
    Ok(Model {
        output_norm: w("output_norm.weight", &[d])?,
        output_b: opt("output.bias", &[hp.n_vocab as u64], has("output.bias"))?,
        tok_embd,
        output,
        layers,
        ple: crate::extras::load_ple_input(b, f, &hp)?,
        dsv4: None,
        eagle3: None,
        mtp: None,
        seq_ctx: None,
        hp,
        kv_types: quiver_backend::KvTypes::default(),
        max_seqs: 1,
    })
}

impl<B: Backend> Model<B> {
    /// Sets what depends on the context a sequence may reach: LongRoPE's long factors past the
    /// original context, as llama.cpp chooses them by its per-sequence context.
    /// Chooses the KV cache's element types for the states made after this; an error names
    /// the first layer whose heads a type cannot store.
    pub fn set_kv_types(&mut self, kv: quiver_backend::KvTypes) -> Result<()> {
        if self.hp.dsv4.is_some() && kv != quiver_backend::KvTypes::default() {
            return Err(ModelError::UnsupportedKv(format!(
                "deepseek4 keeps its window and compressed KV as f16-rounded values in its own state: KV type {kv} is not supported (f16 only)"
            )));
        }
        self.hp
            .kv_spec(0, kv)
            .check()
            .map_err(ModelError::UnsupportedKv)?;
        self.kv_types = kv;
        Ok(())
    }

    /// Sets how many sequences a state made after this holds at once: the slots of the
    /// recurrent state (`SeqSpan::state_slot`) of models with recurrent layers.
    pub fn set_max_seqs(&mut self, n: usize) {
        self.max_seqs = n.max(1);
    }

    pub fn for_context(&mut self, n_ctx_seq: usize) {
        if let Some(long) = &self.hp.rope_long {
            if n_ctx_seq > self.hp.n_ctx_orig {
                for l in &mut self.layers {
                    l.rope.freq_factors = Some(long.clone());
                }
            }
        }
    }

    /// One forward step over a flat batch. Logits of `batch.logits` rows land in
    /// `state.logits` as `[batch.logits.len(), n_vocab]`.
    pub fn forward(&self, b: &mut B, s: &mut State<B>, batch: &Batch) -> Result<()> {
        let n = batch.n_tokens();
        if n > s.max_tokens {
            return Err(ModelError::BatchTooLarge {
                got: n,
                max: s.max_tokens,
            });
        }
        if batch.logits.len() > s.max_logits {
            return Err(ModelError::TooManyLogits {
                got: batch.logits.len(),
                max: s.max_logits,
            });
        }
        batch
            .validate(s.n_slots)
            .map_err(|d| quiver_backend::BackendError::Shape {
                op: "forward",
                detail: d,
            })?;
        let step = b.begin_step(batch, s.id, s.max_tokens, s.max_logits)?;
        if step.replayed {
            return Ok(());
        }
        let r = self.ops(b, s, &step);
        if !b.end_step(r.is_ok())? {
            // A capture that failed recorded the ops without running them: run them now.
            let r = self.ops(b, s, &step);
            b.end_step(r.is_ok())?;
            return r;
        }
        r
    }

    /// The ops of one step over `step.rows` token rows.
    fn ops(&self, b: &mut B, s: &mut State<B>, step: &Step<B::StepCtx>) -> Result<()> {
        if let Some(w) = &self.dsv4 {
            return crate::deepseek4::forward(b, self, w, s, step);
        }
        if let Some(e) = &self.eagle3 {
            return crate::eagle3::forward(b, self, e, s, step);
        }
        let n = step.rows;
        let hp = &self.hp;
        let dump = Dump::new();
        let d = hp.n_embd;
        let eps = hp.rms_eps;
        match &self.mtp {
            Some(w) => crate::mtp::input(b, self, w, s, step)?,
            None => crate::tp::embed(b, self, step, &mut s.x)?,
        }
        if let Some(ple) = &self.ple {
            crate::extras::ple_inputs(b, s, step, ple, hp)?;
        }
        b.rms_norm(&s.x, &self.layers[0].attn_norm, eps, n, &mut s.xn)?;
        for (i, l) in self.layers.iter().enumerate() {
            s.capture(b, i, n, d)?;
            dump.put(b, "attn_norm", i, &s.xn, n * d);
            if let Some(lin) = &l.linear {
                crate::qwen35::linear(b, s, step, l, lin, hp)?;
            } else {
                self.attention(b, s, step, i, l, &dump)?;
            }
            let sc = &l.scales;
            dump.put(b, "attn_out", i, &s.o, n * d);
            if let Some(pn) = &l.post_attn_norm {
                b.rms_norm(&s.o, pn, eps, n, &mut s.xn)?;
                std::mem::swap(&mut s.o, &mut s.xn);
            }
            b.add_rms_norm(&mut s.x, &s.o, &l.ffn_norm, eps, n, &mut s.xn)?;
            dump.put(b, "ffn_inp", i, &s.x, n * d);
            dump.put(b, "ffn_norm", i, &s.xn, n * d);
            match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    let ff = hp.layers[i].n_ff;
                    if sc.gate.is_some() || sc.up.is_some() {
                        // The gate's scale comes before the activation.
                        b.matmul(gate, &s.xn, n, &mut s.gate)?;
                        b.matmul(up, &s.xn, n, &mut s.up)?;
                        for (scale, out) in [(sc.gate, &mut s.gate), (sc.up, &mut s.up)] {
                            if let Some(c) = scale {
                                b.scale(out, c, n * ff)?;
                            }
                        }
                        b.glu(hp.act, &s.gate, &s.up, n * ff, &mut s.act)?;
                    } else {
                        b.matmul_glu(
                            hp.act,
                            gate,
                            up,
                            &s.xn,
                            n,
                            [&mut s.gate, &mut s.up],
                            &mut s.act,
                        )?;
                    }
                    dump.put(b, "ffn_act", i, &s.act, n * ff);
                    // (s.gate and s.xn are free: scratch of the reference's parts.)
                    let parts = l.reduce_parts.as_ref().map(|p| &p.down[..]);
                    let scratch = [&mut s.gate, &mut s.xn];
                    crate::tp::reduced_matmul(b, down, parts, &s.act, ff, n, scratch, &mut s.o)?;
                    if let Some(c) = sc.down {
                        b.scale(&mut s.o, c, n * d)?;
                    }
                }
                Ffn::Moe(e) => {
                    let p = hp.moe.as_ref().expect("MoE layers come with MoE hparams");
                    crate::extras::experts(b, s, n, e, p)?;
                    // A rank's experts cover its share of their width: the sum over the ranks.
                    b.all_reduce(&mut s.o, n * d)?;
                }
                Ffn::DenseAndExperts { .. } => {
                    crate::extras::dense_and_experts(b, s, n, &l.ffn, hp)?;
                }
            }
            dump.put(b, "ffn_out", i, &s.o, n * d);
            if let Some(pn) = &l.post_ffw_norm {
                b.rms_norm(&s.o, pn, eps, n, &mut s.xn)?;
                std::mem::swap(&mut s.o, &mut s.xn);
            }
            if let Some(pl) = &l.ple {
                b.add(&mut s.x, &s.o, n * d)?;
                crate::extras::ple_layer(b, s, n, i, pl, hp)?;
            }
            let next_norm = self
                .layers
                .get(i + 1)
                .map(|l| &l.attn_norm)
                .unwrap_or(&self.output_norm);
            match l.out_scale {
                None => b.add_rms_norm(&mut s.x, &s.o, next_norm, eps, n, &mut s.xn)?,
                Some(c) => {
                    b.add(&mut s.x, &s.o, n * d)?;
                    b.scale(&mut s.x, c, n * d)?;
                    b.rms_norm(&s.x, next_norm, eps, n, &mut s.xn)?;
                }
            }
            dump.put(b, "l_out", i, &s.x, n * d);
        }
        s.capture(b, self.layers.len(), n, d)?;
        dump.put(b, "result_norm", usize::MAX, &s.xn, n * d);
        let out = self.output.as_ref().unwrap_or(&self.tok_embd);
        b.matmul_logits(step, out, &s.xn, &mut s.logits)?;
        let part = b.weight_rows(out);
        if part < hp.n_vocab {
            // A rank's part of a head split by vocabulary (`crate::tp`).
            b.all_gather_cols(&mut s.logits, step.logit_rows, part)?;
        }
        if let Some(bias) = &self.output_b {
            b.add_bias(&mut s.logits, bias, step.logit_rows)?;
        }
        dump.put(
            b,
            "result_output",
            usize::MAX,
            &s.logits,
            step.logit_rows * hp.n_vocab,
        );
        if let Some(cap) = hp.final_softcap {
            b.softcap(&mut s.logits, cap, step.logit_rows * hp.n_vocab)?;
        }
        Ok(())
    }

    /// Layer `i`'s attention over the normed input `s.xn`: its output (before the residual)
    /// into `s.o`.
    fn attention(
        &self,
        b: &mut B,
        s: &mut State<B>,
        step: &Step<B::StepCtx>,
        i: usize,
        l: &Layer<B>,
        dump: &Dump,
    ) -> Result<()> {
        let n = step.rows;
        let hp = &self.hp;
        let (d, eps) = (hp.n_embd, hp.rms_eps);
        let a = &l.attn;
        let (qd, kvd) = (a.n_head * a.head_dim, a.n_head_kv * a.head_dim);
        // Qwen 3.5: q and its gate in one product, split per head below.
        let mut qg = match (hp.q_gate, s.hy.as_mut()) {
            (true, Some(hy)) => Some(hy),
            _ => None,
        };
        let (q_out, q_len) = match qg.as_mut() {
            Some(hy) => (&mut hy.qg, 2 * n * qd),
            None => (&mut s.q, n * qd),
        };
        match (&l.wk, &l.wv) {
            (Some(wk), wv) => b.matmul_many(
                &[&l.wq, wk, wv.as_ref().unwrap_or(wk)],
                &s.xn,
                n,
                &mut [q_out, &mut s.k, &mut s.v],
            )?,
            (None, _) => b.matmul(&l.wq, &s.xn, n, q_out)?,
        }
        let sc = &l.scales;
        for (scale, bias, out, len) in [
            (sc.q, &l.bq, q_out, q_len),
            (sc.k, &l.bk, &mut s.k, n * kvd),
            (sc.v, &l.bv, &mut s.v, n * kvd),
        ] {
            if let Some(c) = scale {
                b.scale(out, c, len)?;
            }
            if let Some(bias) = bias {
                b.add_bias(out, bias, n)?;
            }
        }
        if let Some(hy) = qg.as_mut() {
            let hd = a.head_dim;
            b.copy_cols(&hy.qg, 2 * hd, 0, hd, n * a.n_head, &mut s.q)?;
            b.copy_cols(&hy.qg, 2 * hd, hd, hd, n * a.n_head, &mut hy.gate)?;
        }
        // q and k normed per head in the rope op where both norms are there (one launch on
        // CUDA), else here.
        let fused = match (&l.q_norm, &l.k_norm) {
            (Some(qn), Some(kn)) if l.wk.is_some() => Some((qn, kn, eps)),
            _ => None,
        };
        if fused.is_none() {
            if let Some(qn) = &l.q_norm {
                b.rms_norm_inplace(&mut s.q, qn, eps, n * a.n_head)?;
            }
            if let Some(kn) = &l.k_norm {
                b.rms_norm_inplace(&mut s.k, kn, eps, n * a.n_head_kv)?;
            }
        }
        if l.wk.is_some() {
            // V normed without weight (Gemma 4) into the attention buffer, free till then.
            let v = if hp.v_norm {
                b.rms_norm_plain(&s.v, a.head_dim, eps, n * a.n_head_kv, &mut s.attn)?;
                &s.attn
            } else {
                &s.v
            };
            dump.put(b, "Vcur", i, v, n * kvd);
            let kv = &mut s.kv[l.kv];
            match fused {
                Some(norms) => {
                    b.qk_norm_rope_kv_write(step, &mut s.q, &mut s.k, v, norms, &l.rope, a, kv)?
                }
                None => b.rope_kv_write(step, &mut s.q, &mut s.k, v, &l.rope, a, kv)?,
            }
            dump.put(b, "Kcur", i, &s.k, n * kvd);
        } else {
            b.rope_q(step, &mut s.q, &l.rope, a)?;
        }
        dump.put(b, "Qcur_f16", i, &s.q, n * qd);
        b.attention(step, &s.q, &s.kv[l.kv], a, &mut s.attn)?;
        dump.put(b, "kqv_out", i, &s.attn, n * qd);
        if let Some(hy) = qg.as_ref() {
            b.sigmoid_mul(&mut s.attn, &hy.gate, n, qd, false)?;
        }
        // (s.q and s.xn are free: scratch of the reference's parts.)
        let parts = l.reduce_parts.as_ref().map(|p| &p.wo[..]);
        let scratch = [&mut s.q, &mut s.xn];
        crate::tp::reduced_matmul(b, &l.wo, parts, &s.attn, qd, n, scratch, &mut s.o)?;
        if let Some(c) = sc.o {
            b.scale(&mut s.o, c, n * d)?;
        }
        if let Some(bias) = &l.bo {
            b.add_bias(&mut s.o, bias, n)?;
        }
        Ok(())
    }
}

/// `QUIVER_DUMP_DIR`: every step writes its intermediate tensors there as raw little-endian f32,
/// `s{step}_{tensor}-{layer}.bin` (`s{step}_{tensor}.bin` after the last layer), named as
/// llama.cpp's graph names them, for comparing the two op by op (`tools/parity/`). It reads
/// device buffers mid-step: with CUDA, run with `QUIVER_CUDA_GRAPHS=0`.
pub(crate) struct Dump {
    dir: Option<&'static str>,
    step: usize,
}

impl Dump {
    pub(crate) fn new() -> Dump {
        static DIR: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        static STEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = DIR
            .get_or_init(|| {
                let d = std::env::var("QUIVER_DUMP_DIR").ok()?;
                // Made if missing (a dump into a folder that is not there wrote nothing).
                if let Err(e) = std::fs::create_dir_all(&d) {
                    eprintln!("QUIVER_DUMP_DIR: {d}: {e}");
                }
                Some(d)
            })
            .as_deref();
        let step = match dir {
            Some(_) => STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            None => 0,
        };
        Dump { dir, step }
    }

    pub(crate) fn put<B: Backend>(
        &self,
        b: &B,
        name: &str,
        layer: usize,
        buf: &B::Buf,
        len: usize,
    ) {
        let Some(d) = self.dir else { return };
        let file = match layer {
            usize::MAX => format!("{d}/s{}_{name}.bin", self.step),
            i => format!("{d}/s{}_{name}-{i}.bin", self.step),
        };
        let mut v = Vec::new();
        let r = b
            .read(buf, len, &mut v)
            .map_err(|e| e.to_string())
            .and_then(|_| {
                let bytes: Vec<u8> = v[..len].iter().flat_map(|f| f.to_le_bytes()).collect();
                std::fs::write(&file, bytes).map_err(|e| e.to_string())
            });
        if let Err(e) = r {
            eprintln!("QUIVER_DUMP_DIR: {file}: {e}");
        }
    }
}
