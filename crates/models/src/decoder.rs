//! The decoder-only transformer forward every architecture shares, over a flat batch.

use crate::{weight, weight_rows, Hparams, ModelError, Result, State};
use quiver_backend::{AttnParams, Backend, Batch, MoeScratch, MoeWeights, RopeParams, Step};
use quiver_gguf::GgufFile;
use std::sync::Arc;

pub struct Layer<B: Backend> {
    pub attn_norm: B::Weight,
    pub wq: B::Weight,
    pub wk: B::Weight,
    pub wv: B::Weight,
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
}

/// A layer's feed-forward block.
pub enum Ffn<B: Backend> {
    /// act(x·gateᵀ) · (x·upᵀ), then down.
    Dense {
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
    /// A mixture of experts (`Hparams::moe`): router [n_expert, n_embd] and the experts
    /// stacked as the GGUF's 3-D tensors hold them.
    Moe {
        router: B::Weight,
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
}

pub struct Model<B: Backend> {
    pub hp: Hparams,
    pub tok_embd: B::Weight,
    pub output_norm: B::Weight,
    /// None: the output projection is tied to the token embedding.
    pub output: Option<B::Weight>,
    pub output_b: Option<B::Weight>,
    pub layers: Vec<Layer<B>>,
}

pub(crate) fn load<B: Backend>(b: &B, f: &Arc<GgufFile>, hp: Hparams) -> Result<Model<B>> {
    let (d, hd) = (hp.n_embd as u64, hp.head_dim as u64);
    let (nh, nkv, ff) = (hp.n_head as u64, hp.n_head_kv as u64, hp.n_ff as u64);
    let (qd, kvd) = (nh * hd, nkv * hd);
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
    for i in 0..hp.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let bias = |s: &str, len: u64| {
            opt(
                &format!("blk.{i}.{s}.bias"),
                &[len],
                has(&format!("blk.{i}.{s}.bias")),
            )
        };
        let swa = hp.swa_layers[i];
        let rope = if swa {
            hp.rope_local.clone().unwrap_or_else(|| hp.rope.clone())
        } else {
            hp.rope.clone()
        };
        let (wq, wk, wv) = if has(&n("attn_qkv")) {
            let shape = [qd + 2 * kvd, d];
            let part = |first, rows| weight_rows(b, f, &n("attn_qkv"), &shape, first, rows);
            (part(0, qd)?, part(qd, kvd)?, part(qd + kvd, kvd)?)
        } else {
            (
                w(&n("attn_q"), &[qd, d])?,
                w(&n("attn_k"), &[kvd, d])?,
                w(&n("attn_v"), &[kvd, d])?,
            )
        };
        let ffn = match &hp.moe {
            Some(m) => {
                let (ne, fe) = (m.n_expert as u64, m.n_ff as u64);
                Ffn::Moe {
                    router: w(&n("ffn_gate_inp"), &[ne, d])?,
                    gate: w(&n("ffn_gate_exps"), &[ne, fe, d])?,
                    up: w(&n("ffn_up_exps"), &[ne, fe, d])?,
                    down: w(&n("ffn_down_exps"), &[ne, d, fe])?,
                }
            }
            None if hp.fused_gate_up => {
                // Phi-3: one tensor of 2·n_ff rows, the gate's rows first.
                let shape = [2 * ff, d];
                Ffn::Dense {
                    gate: weight_rows(b, f, &n("ffn_up"), &shape, 0, ff)?,
                    up: weight_rows(b, f, &n("ffn_up"), &shape, ff, ff)?,
                    down: w(&n("ffn_down"), &[d, ff])?,
                }
            }
            None => Ffn::Dense {
                gate: w(&n("ffn_gate"), &[ff, d])?,
                up: w(&n("ffn_up"), &[ff, d])?,
                down: w(&n("ffn_down"), &[d, ff])?,
            },
        };
        layers.push(Layer {
            attn_norm: w(&n("attn_norm"), &[d])?,
            wq,
            wk,
            wv,
            wo: w(&n("attn_output"), &[d, qd])?,
            bq: bias("attn_q", qd)?,
            bk: bias("attn_k", kvd)?,
            bv: bias("attn_v", kvd)?,
            bo: bias("attn_output", d)?,
            q_norm: opt(&n("attn_q_norm"), &[hd], hp.qk_norm)?,
            k_norm: opt(&n("attn_k_norm"), &[hd], hp.qk_norm)?,
            post_attn_norm: opt(&n("post_attention_norm"), &[d], hp.post_norms)?,
            ffn_norm: w(&n("ffn_norm"), &[d])?,
            ffn,
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
    let output = if has("output.weight") {
        Some(w("output.weight", &[hp.n_vocab as u64, d])?)
    } else {
        None
    };
    Ok(Model {
        output_norm: w("output_norm.weight", &[d])?,
        output_b: opt("output.bias", &[hp.n_vocab as u64], has("output.bias"))?,
        tok_embd,
        output,
        layers,
        hp,
    })
}

impl<B: Backend> Model<B> {
    /// Sets what depends on the context a sequence may reach: LongRoPE's long factors past the
    /// original context, as llama.cpp chooses them by its per-sequence context.
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
            for (bias, out) in [(&l.bq, &mut s.q), (&l.bk, &mut s.k), (&l.bv, &mut s.v)] {
                if let Some(bias) = bias {
                    b.add_bias(out, bias, n)?;
                }
            }
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
            if let Some(bias) = &l.bo {
                b.add_bias(&mut s.o, bias, n)?;
            }
            dump.put(b, "attn_out", i, &s.o, n * hp.n_embd);
            if let Some(pn) = &l.post_attn_norm {
                b.rms_norm(&s.o, pn, eps, n, &mut s.xn)?;
                std::mem::swap(&mut s.o, &mut s.xn);
            }
            b.add_rms_norm(&mut s.x, &s.o, &l.ffn_norm, eps, n, &mut s.xn)?;
            dump.put(b, "ffn_inp", i, &s.x, n * hp.n_embd);
            dump.put(b, "ffn_norm", i, &s.xn, n * hp.n_embd);
            match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    b.matmul_glu(
                        hp.act,
                        gate,
                        up,
                        &s.xn,
                        n,
                        [&mut s.gate, &mut s.up],
                        &mut s.act,
                    )?;
                    dump.put(b, "ffn_act", i, &s.act, n * hp.n_ff);
                    b.matmul(down, &s.act, n, &mut s.o)?;
                }
                Ffn::Moe {
                    router,
                    gate,
                    up,
                    down,
                } => {
                    let p = hp.moe.as_ref().expect("MoE layers come with MoE hparams");
                    let [logits, routes, xs, g, u, act, ys] = &mut s.moe[..] else {
                        unreachable!("seven MoE scratch buffers")
                    };
                    b.moe(
                        &s.xn,
                        n,
                        MoeWeights {
                            router,
                            gate,
                            up,
                            down,
                        },
                        p,
                        MoeScratch {
                            logits,
                            routes,
                            xs,
                            gate: g,
                            up: u,
                            act,
                            ys,
                        },
                        &mut s.o,
                    )?;
                }
            }
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
