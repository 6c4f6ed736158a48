//! The decoder-only transformer forward shared by llama and gemma3, over a flat batch.

use crate::{weight, Hparams, ModelError, Result};
use quiver_backend::{AttnParams, Backend, Batch, KvType, RopeParams, Step};
use quiver_gguf::GgufFile;
use std::sync::Arc;

pub struct Layer<B: Backend> {
    pub attn_norm: B::Weight,
    pub wq: B::Weight,
    pub wk: B::Weight,
    pub wv: B::Weight,
    pub wo: B::Weight,
    pub q_norm: Option<B::Weight>,
    pub k_norm: Option<B::Weight>,
    pub post_attn_norm: Option<B::Weight>,
    pub ffn_norm: B::Weight,
    pub gate: B::Weight,
    pub up: B::Weight,
    pub down: B::Weight,
    pub post_ffw_norm: Option<B::Weight>,
    pub attn: AttnParams,
    pub rope: RopeParams,
}

pub struct Model<B: Backend> {
    pub hp: Hparams,
    pub tok_embd: B::Weight,
    pub output_norm: B::Weight,
    /// None: the output projection is tied to the token embedding.
    pub output: Option<B::Weight>,
    pub layers: Vec<Layer<B>>,
}

pub(crate) fn load<B: Backend>(b: &B, f: &Arc<GgufFile>, hp: Hparams) -> Result<Model<B>> {
    let (d, hd) = (hp.n_embd as u64, hp.head_dim as u64);
    let (nh, nkv, ff) = (hp.n_head as u64, hp.n_head_kv as u64, hp.n_ff as u64);
    let w = |name: &str, shape: &[u64]| weight(b, f, name, shape);
    let opt = |name: &str, shape: &[u64], want: bool| -> Result<Option<B::Weight>> {
        if want {
            w(name, shape).map(Some)
        } else {
            Ok(None)
        }
    };
    let mut layers = Vec::with_capacity(hp.n_layer);
    for i in 0..hp.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let swa = hp.swa_layers[i];
        let rope = if swa {
            hp.rope_local.clone().unwrap_or_else(|| hp.rope.clone())
        } else {
            hp.rope.clone()
        };
        layers.push(Layer {
            attn_norm: w(&n("attn_norm"), &[d])?,
            wq: w(&n("attn_q"), &[nh * hd, d])?,
            wk: w(&n("attn_k"), &[nkv * hd, d])?,
            wv: w(&n("attn_v"), &[nkv * hd, d])?,
            wo: w(&n("attn_output"), &[d, nh * hd])?,
            q_norm: opt(&n("attn_q_norm"), &[hd], hp.qk_norm)?,
            k_norm: opt(&n("attn_k_norm"), &[hd], hp.qk_norm)?,
            post_attn_norm: opt(&n("post_attention_norm"), &[d], hp.post_norms)?,
            ffn_norm: w(&n("ffn_norm"), &[d])?,
            gate: w(&n("ffn_gate"), &[ff, d])?,
            up: w(&n("ffn_up"), &[ff, d])?,
            down: w(&n("ffn_down"), &[d, ff])?,
            post_ffw_norm: opt(&n("post_ffw_norm"), &[d], hp.post_norms)?,
            attn: AttnParams {
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                scale: hp.attn_scale,
                scale_q: hp.scale_q,
                window: if swa { hp.sliding_window } else { None },
                softcap: hp.attn_softcap,
            },
            rope,
        });
    }
    let tok_embd = w("token_embd.weight", &[hp.n_vocab as u64, d])?;
    let output = if f.tensor("output.weight").is_some() {
        Some(w("output.weight", &[hp.n_vocab as u64, d])?)
    } else {
        None
    };
    Ok(Model {
        output_norm: w("output_norm.weight", &[d])?,
        tok_embd,
        output,
        layers,
        hp,
    })
}

/// Everything a forward step writes: the KV cache and the activation workspace, allocated
/// once for at most `max_tokens` tokens and `max_logits` logits rows per step.
pub struct State<B: Backend> {
    /// Unique per state: names these buffers to the backend (captured steps are per state).
    pub id: u64,
    pub kv: Vec<B::Kv>,
    pub n_slots: usize,
    pub max_tokens: usize,
    pub max_logits: usize,
    x: B::Buf,    // [n, n_embd] residual stream
    xn: B::Buf,   // [n, n_embd] normed
    q: B::Buf,    // [n, n_head · head_dim]
    k: B::Buf,    // [n, n_head_kv · head_dim]
    v: B::Buf,    // [n, n_head_kv · head_dim]
    attn: B::Buf, // [n, n_head · head_dim]
    o: B::Buf,    // [n, n_embd]
    gate: B::Buf, // [n, n_ff]
    up: B::Buf,   // [n, n_ff]
    act: B::Buf,  // [n, n_ff]
    /// [max_logits, n_vocab] after a step
    pub logits: B::Buf,
}

impl<B: Backend> Model<B> {
    pub fn state(
        &self,
        b: &B,
        n_slots: usize,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<State<B>> {
        let hp = &self.hp;
        let n = max_tokens;
        let (qd, kvd) = (hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim);
        let spec = hp.kv_spec(n_slots, KvType::F16);
        // Everything below, checked before any of it is allocated.
        let kv = spec.bytes();
        let floats = (n as u64)
            .saturating_mul((3 * hp.n_embd + 2 * qd + 2 * kvd + 3 * hp.n_ff) as u64)
            .saturating_add((max_logits as u64).saturating_mul(hp.n_vocab as u64));
        let mut attention: Vec<(usize, usize)> = vec![(hp.n_head, hp.head_dim)];
        attention.dedup();
        let ws = quiver_backend::WorkspaceSpec {
            max_tokens: n,
            max_logits,
            max_product_cols: hp.n_embd.max(hp.n_ff).max(qd),
            n_embd: hp.n_embd,
            n_vocab: hp.n_vocab,
            attention,
            n_slots,
        };
        let need = kv
            .saturating_add(floats.saturating_mul(4))
            .saturating_add(b.workspace_bytes(&ws));
        if let Some(available) = b.memory_available() {
            if need > available {
                return Err(quiver_backend::BackendError::OutOfMemory {
                    what: format!(
                        "the KV cache for {n_slots} positions and the buffers for {n} tokens per step"
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
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(State {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            kv: (0..hp.n_layer)
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
            gate: b.buf(n * hp.n_ff)?,
            up: b.buf(n * hp.n_ff)?,
            act: b.buf(n * hp.n_ff)?,
            logits: b.buf(max_logits * hp.n_vocab)?,
        })
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
        let n = step.rows;
        let hp = &self.hp;
        let dump = Dump::new();
        let (qd, kvd) = (hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim);
        let eps = hp.rms_eps;
        b.embed(step, &self.tok_embd, hp.embed_scale, &mut s.x)?;
        b.rms_norm(&s.x, &self.layers[0].attn_norm, eps, n, &mut s.xn)?;
        for (i, l) in self.layers.iter().enumerate() {
            dump.put(b, "attn_norm", i, &s.xn, n * hp.n_embd);
            b.matmul_qkv(
                [&l.wq, &l.wk, &l.wv],
                &s.xn,
                n,
                [&mut s.q, &mut s.k, &mut s.v],
            )?;
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                b.rms_norm_inplace(&mut s.q, qn, eps, n * hp.n_head)?;
                b.rms_norm_inplace(&mut s.k, kn, eps, n * hp.n_head_kv)?;
            }
            dump.put(b, "Vcur", i, &s.v, n * kvd);
            b.rope_kv_write(
                step,
                &mut s.q,
                &mut s.k,
                &s.v,
                &l.rope,
                &l.attn,
                &mut s.kv[i],
            )?;
            dump.put(b, "Qcur_f16", i, &s.q, n * qd);
            dump.put(b, "Kcur", i, &s.k, n * kvd);
            b.attention(step, &s.q, &s.kv[i], &l.attn, &mut s.attn)?;
            dump.put(b, "kqv_out", i, &s.attn, n * qd);
            b.matmul(&l.wo, &s.attn, n, &mut s.o)?;
            dump.put(b, "attn_out", i, &s.o, n * hp.n_embd);
            if let Some(pn) = &l.post_attn_norm {
                b.rms_norm(&s.o, pn, eps, n, &mut s.xn)?;
                std::mem::swap(&mut s.o, &mut s.xn);
            }
            b.add_rms_norm(&mut s.x, &s.o, &l.ffn_norm, eps, n, &mut s.xn)?;
            dump.put(b, "ffn_inp", i, &s.x, n * hp.n_embd);
            dump.put(b, "ffn_norm", i, &s.xn, n * hp.n_embd);
            b.matmul_glu(
                hp.act,
                &l.gate,
                &l.up,
                &s.xn,
                n,
                [&mut s.gate, &mut s.up],
                &mut s.act,
            )?;
            dump.put(b, "ffn_act", i, &s.act, n * hp.n_ff);
            b.matmul(&l.down, &s.act, n, &mut s.o)?;
            dump.put(b, "ffn_out", i, &s.o, n * hp.n_embd);
            if let Some(pn) = &l.post_ffw_norm {
                b.rms_norm(&s.o, pn, eps, n, &mut s.xn)?;
                std::mem::swap(&mut s.o, &mut s.xn);
            }
            let next_norm = self
                .layers
                .get(i + 1)
                .map(|l| &l.attn_norm)
                .unwrap_or(&self.output_norm);
            b.add_rms_norm(&mut s.x, &s.o, next_norm, eps, n, &mut s.xn)?;
            dump.put(b, "l_out", i, &s.x, n * hp.n_embd);
        }
        dump.put(b, "result_norm", usize::MAX, &s.xn, n * hp.n_embd);
        let out = self.output.as_ref().unwrap_or(&self.tok_embd);
        b.matmul_logits(step, out, &s.xn, &mut s.logits)?;
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
}

/// `QUIVER_DUMP_DIR`: every step writes its intermediate tensors there as raw little-endian f32,
/// `s{step}_{tensor}-{layer}.bin` (`s{step}_{tensor}.bin` after the last layer), named as
/// llama.cpp's graph names them, for comparing the two op by op (`tools/parity/`). It reads
/// device buffers mid-step: with CUDA, run with `QUIVER_CUDA_GRAPHS=0`.
struct Dump {
    dir: Option<&'static str>,
    step: usize,
}

impl Dump {
    fn new() -> Dump {
        static DIR: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        static STEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = DIR
            .get_or_init(|| std::env::var("QUIVER_DUMP_DIR").ok())
            .as_deref();
        let step = match dir {
            Some(_) => STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            None => 0,
        };
        Dump { dir, step }
    }

    fn put<B: Backend>(&self, b: &B, name: &str, layer: usize, buf: &B::Buf, len: usize) {
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
