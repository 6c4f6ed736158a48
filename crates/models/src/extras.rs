//! The parts of the decoder only some architectures have: FFN blocks of experts (Qwen3-MoE's,
//! and Gemma 4's beside a dense MLP), Gemma 4's per-layer embeddings (PLE) and its per-layer
//! output scale, and the check that the backend has the ops these need.

use crate::decoder::{Experts, Ffn};
use crate::{weight, Hparams, ModelError, Result, State};
use quiver_backend::{
    Activation, Backend, BackendError, ExtraOp, MoeParams, MoeScratch, MoeWeights, Step,
};
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// Gemma 4's per-layer embedding inputs: a table of `n_layer · n_embd_per_layer` per token
/// and a projection of the embedding to the same width, normed per layer's slice.
pub struct PleInput<B: Backend> {
    pub tok_embd: B::Weight,
    pub model_proj: B::Weight,
    pub proj_norm: B::Weight,
}

/// One layer's PLE block: gelu(x·gateᵀ) · (the layer's input slice), projected back and
/// normed, added to the residual.
pub struct PleLayer<B: Backend> {
    pub gate: B::Weight,
    pub proj: B::Weight,
    pub post_norm: B::Weight,
}

/// The step buffers of PLE.
pub struct PleBufs<B: Backend> {
    /// [n, n_layer · ple]: the token table's rows, then every layer's input.
    pub tok: B::Buf,
    pub all: B::Buf,
    /// [n, ple]: the gate's product, the layer's slice, their product.
    pub g: B::Buf,
    pub slice: B::Buf,
    pub a: B::Buf,
}

/// The ops beyond the core that `hp` needs, checked against the backend before any weight
/// loads.
pub(crate) fn check_ops<B: Backend>(b: &B, hp: &Hparams) -> Result<()> {
    let mut need = Vec::new();
    if hp.delta_net.is_some() {
        need.extend([ExtraOp::DeltaNet, ExtraOp::Scale]);
    }
    if hp.q_gate {
        need.extend([ExtraOp::CopyCols, ExtraOp::SigmoidMul]);
    }
    if hp.v_norm {
        need.push(ExtraOp::RmsNormPlain);
    }
    if hp.layers.iter().enumerate().any(|(i, l)| l.kv_from != i) {
        need.push(ExtraOp::RopeQ);
    }
    if hp.n_embd_per_layer > 0 {
        need.extend([ExtraOp::Scale, ExtraOp::CopyCols]);
    }
    if hp.arch == "gemma4" {
        // `layer_output_scale`
        need.push(ExtraOp::Scale);
    }
    if hp.moe.is_some_and(|m| m.router_given) {
        need.extend([
            ExtraOp::RmsNormPlain,
            ExtraOp::Scale,
            ExtraOp::MulCols,
            ExtraOp::MoeExtras,
        ]);
    }
    match need.into_iter().find(|&op| !b.supports(op)) {
        Some(op) => Err(BackendError::MissingOp {
            op,
            backend: b.name(),
            arch: hp.arch.clone(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Layer `i`'s per-tensor weight scales: q, k, v (one scale for a fused `attn_qkv`) and the
/// attention output in every architecture, the dense FFN's where the architecture's graph in
/// llama.cpp takes them (`Hparams::ffn_weight_scales`).
pub(crate) fn weight_scales<B: Backend>(
    b: &B,
    f: &GgufFile,
    hp: &Hparams,
    i: usize,
) -> Result<crate::decoder::Scales> {
    let one = |s: &str| -> Result<Option<f32>> {
        let name = format!("blk.{i}.{s}.scale");
        let Some(t) = f.tensor(&name) else {
            return Ok(None);
        };
        if t.ty != quiver_gguf::GgmlType::F32 || t.n_elements != 1 {
            return Err(ModelError::BadHparam {
                key: name,
                detail: format!(
                    "a weight scale must be one f32, not {:?} {:?}",
                    t.ty, t.shape
                ),
            });
        }
        let v = f.tensor_data(t);
        Ok(Some(f32::from_le_bytes([v[0], v[1], v[2], v[3]])))
    };
    let mut sc = crate::decoder::Scales::default();
    if f.tensor(&format!("blk.{i}.attn_qkv.weight")).is_some() {
        let s = one("attn_qkv")?;
        (sc.q, sc.k, sc.v) = (s, s, s);
    } else {
        (sc.q, sc.k, sc.v) = (one("attn_q")?, one("attn_k")?, one("attn_v")?);
    }
    sc.o = one("attn_output")?;
    if hp.ffn_weight_scales {
        (sc.gate, sc.up, sc.down) = (one("ffn_gate")?, one("ffn_up")?, one("ffn_down")?);
    }
    if sc != crate::decoder::Scales::default() && !b.supports(ExtraOp::Scale) {
        return Err(BackendError::MissingOp {
            op: ExtraOp::Scale,
            backend: b.name(),
            arch: hp.arch.clone(),
        }
        .into());
    }
    Ok(sc)
}

/// Layer `i`'s FFN: dense, experts (every layer of an MoE model but Gemma 4's), or Gemma 4's
/// dense MLP beside experts (the layers that have a router).
pub(crate) fn load_ffn<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    hp: &Hparams,
    i: usize,
    ff: u64,
    tp: &crate::tp::Tp,
) -> Result<Ffn<B>> {
    let d = hp.n_embd as u64;
    let w = |s: &str, shape: &[u64]| weight(b, f, &format!("blk.{i}.{s}.weight"), shape);
    let has = |s: &str| f.tensor(&format!("blk.{i}.{s}")).is_some();
    let experts = |m: &MoeParams| -> Result<Experts<B>> {
        let (ne, fe) = (m.n_expert as u64, m.n_ff as u64);
        let fused = has("ffn_gate_up_exps.weight") && !has("ffn_gate_exps.weight");
        if fused && !b.supports(ExtraOp::MoeGateUpFused) {
            return Err(BackendError::MissingOp {
                op: ExtraOp::MoeGateUpFused,
                backend: b.name(),
                arch: hp.arch.clone(),
            }
            .into());
        }
        // Per-expert scales of the products, where the file has them (llama.cpp's graphs of
        // our MoE architectures all take them).
        let scale = |part: &str| -> Result<Option<B::Weight>> {
            let name = format!("blk.{i}.{part}.scale");
            match f.tensor(&name) {
                Some(_) => Ok(Some(weight(b, f, &name, &[ne])?)),
                None => Ok(None),
            }
        };
        // A fused product's scale (`ffn_up_exps.scale`, as llama.cpp takes it) multiplies both
        // halves.
        let (gate_scale, up_scale) = if fused {
            (scale("ffn_up_exps")?, scale("ffn_up_exps")?)
        } else {
            (scale("ffn_gate_exps")?, scale("ffn_up_exps")?)
        };
        if (gate_scale.is_some() || up_scale.is_some()) && !b.supports(ExtraOp::MoeProductScales) {
            return Err(BackendError::MissingOp {
                op: ExtraOp::MoeProductScales,
                backend: b.name(),
                arch: hp.arch.clone(),
            }
            .into());
        }
        let shared = match hp.shared_expert_ff as u64 {
            0 => None,
            sf => {
                let sc = |s: &str| crate::qwen35::scale_of(f, &format!("blk.{i}.{s}.scale"));
                Some(crate::decoder::SharedExpert {
                    gate: w("ffn_gate_shexp", &[sf, d])?,
                    up: w("ffn_up_shexp", &[sf, d])?,
                    down: w("ffn_down_shexp", &[d, sf])?,
                    gate_inp: w("ffn_gate_inp_shexp", &[d])?,
                    scales: [
                        sc("ffn_gate_shexp")?,
                        sc("ffn_up_shexp")?,
                        sc("ffn_down_shexp")?,
                    ],
                })
            }
        };
        // A rank's share of every expert's width (`tp`): the gate's and up's rows, down's
        // columns; or its run of whole experts (`m.held`); the router whole.
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        if m.held.1 < m.n_expert {
            let (e0, nh) = (m.held.0 as u64, m.held.1 as u64);
            let run = |s: &str, rows: u64, cols: u64| {
                crate::weight_rows(b, f, &n(s), &[ne, rows, cols], e0, nh)
            };
            return Ok(Experts {
                router: w("ffn_gate_inp", &[ne, d])?,
                gate: match fused {
                    true => run("ffn_gate_up_exps", 2 * fe, d)?,
                    false => run("ffn_gate_exps", fe, d)?,
                },
                up: match fused {
                    true => None,
                    false => Some(run("ffn_up_exps", fe, d)?),
                },
                down: run("ffn_down_exps", d, fe)?,
                down_scale: scale("ffn_down_exps")?,
                gate_scale,
                up_scale,
                shared,
            });
        }
        Ok(Experts {
            router: w("ffn_gate_inp", &[ne, d])?,
            gate: if fused {
                tp.expert_rows(b, f, &n("ffn_gate_up_exps"), &[ne, 2 * fe, d], 2)?
            } else {
                tp.expert_rows(b, f, &n("ffn_gate_exps"), &[ne, fe, d], 1)?
            },
            up: if fused {
                None
            } else {
                Some(tp.expert_rows(b, f, &n("ffn_up_exps"), &[ne, fe, d], 1)?)
            },
            down: tp.expert_cols(b, f, &n("ffn_down_exps"), &[ne, d, fe])?,
            down_scale: scale("ffn_down_exps")?,
            gate_scale,
            up_scale,
            shared,
        })
    };
    let dense = || -> Result<[B::Weight; 3]> {
        if hp.fused_gate_up {
            // Phi-3: one tensor of 2·n_ff rows, the gate's rows first.
            let shape = [2 * ff, d];
            let name = format!("blk.{i}.ffn_up.weight");
            return Ok([
                tp.rows(b, f, &name, &shape, 0, ff)?,
                tp.rows(b, f, &name, &shape, ff, ff)?,
                tp.cols(b, f, &format!("blk.{i}.ffn_down.weight"), &[d, ff])?,
            ]);
        }
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        Ok([
            tp.rows(b, f, &n("ffn_gate"), &[ff, d], 0, ff)?,
            tp.rows(b, f, &n("ffn_up"), &[ff, d], 0, ff)?,
            tp.cols(b, f, &n("ffn_down"), &[d, ff])?,
        ])
    };
    match &hp.moe {
        Some(m) if !m.router_given => Ok(Ffn::Moe(experts(m)?)),
        Some(m) if has("ffn_gate_inp.weight") => {
            let [gate, up, down] = dense()?;
            Ok(Ffn::DenseAndExperts {
                gate,
                up,
                down,
                post_norm_1: w("post_ffw_norm_1", &[d])?,
                pre_norm_2: w("pre_ffw_norm_2", &[d])?,
                post_norm_2: w("post_ffw_norm_2", &[d])?,
                router_scale: weight(b, f, &format!("blk.{i}.ffn_gate_inp.scale"), &[d])?,
                experts: experts(m)?,
            })
        }
        None if hp.v_norm && has("ffn_gate_inp.weight") => Err(ModelError::BadHparam {
            key: format!("{}.expert_count", hp.arch),
            detail: format!("missing, but layer {i} has experts (blk.{i}.ffn_gate_inp.weight)"),
        }),
        _ => {
            let [gate, up, down] = dense()?;
            Ok(Ffn::Dense { gate, up, down })
        }
    }
}

pub(crate) fn load_ple_input<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    hp: &Hparams,
) -> Result<Option<PleInput<B>>> {
    let ple = hp.n_embd_per_layer as u64;
    if ple == 0 {
        return Ok(None);
    }
    let (d, all) = (hp.n_embd as u64, hp.n_layer as u64 * ple);
    Ok(Some(PleInput {
        tok_embd: weight(
            b,
            f,
            "per_layer_token_embd.weight",
            &[hp.n_vocab as u64, all],
        )?,
        model_proj: weight(b, f, "per_layer_model_proj.weight", &[all, d])?,
        proj_norm: weight(b, f, "per_layer_proj_norm.weight", &[ple])?,
    }))
}

pub(crate) fn load_ple_layer<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    hp: &Hparams,
    i: usize,
) -> Result<Option<PleLayer<B>>> {
    let ple = hp.n_embd_per_layer as u64;
    if ple == 0 {
        return Ok(None);
    }
    let d = hp.n_embd as u64;
    let w = |s: &str, shape: &[u64]| weight(b, f, &format!("blk.{i}.{s}.weight"), shape);
    Ok(Some(PleLayer {
        gate: w("inp_gate", &[ple, d])?,
        proj: w("proj", &[d, ple])?,
        post_norm: w("post_norm", &[d])?,
    }))
}

/// Layer `i`'s `layer_output_scale` (one f32, f16 or bf16 value), where the file has it.
pub(crate) fn out_scale(f: &GgufFile, hp: &Hparams, i: usize) -> Result<Option<f32>> {
    if hp.arch != "gemma4" {
        return Ok(None);
    }
    let name = format!("blk.{i}.layer_output_scale.weight");
    let Some(t) = f.tensor(&name) else {
        return Ok(None);
    };
    if t.shape != [1] {
        return Err(ModelError::WrongShape {
            name,
            got: t.shape.clone(),
            expected: vec![1],
        });
    }
    let b = f.tensor_data(t);
    use quiver_gguf::GgmlType as T;
    let v = match t.ty {
        T::F32 if b.len() >= 4 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        T::F16 if b.len() >= 2 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        T::BF16 if b.len() >= 2 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        ty => {
            return Err(ModelError::BadHparam {
                key: name,
                detail: format!("type {ty}: expected f32, f16 or bf16"),
            })
        }
    };
    Ok(Some(v))
}

/// Every layer's PLE input for the step, from the scaled embedding in `s.x`: the token
/// table's rows · √ple plus the projection of the embedding / √n_embd, normed per layer
/// slice, the sum / √2 (llama.cpp's order of ops).
pub(crate) fn ple_inputs<B: Backend>(
    b: &B,
    s: &mut State<B>,
    step: &Step<B::StepCtx>,
    ple: &PleInput<B>,
    hp: &Hparams,
) -> Result<()> {
    let n = step.rows;
    let (w, l) = (hp.n_embd_per_layer, hp.n_layer);
    let all = n * l * w;
    let p = s.ple.as_mut().expect("PLE models' states have PLE buffers");
    b.embed(step, &ple.tok_embd, (w as f32).sqrt(), &mut p.tok)?;
    b.matmul(&ple.model_proj, &s.x, n, &mut p.all)?;
    b.scale(&mut p.all, 1.0 / (hp.n_embd as f32).sqrt(), all)?;
    b.rms_norm_inplace(&mut p.all, &ple.proj_norm, hp.rms_eps, n * l)?;
    b.add(&mut p.all, &p.tok, all)?;
    b.scale(&mut p.all, 1.0 / 2f32.sqrt(), all)?;
    Ok(())
}

/// Layer `i`'s PLE block over the residual `s.x`; its output lands in `s.o` (the caller adds
/// it).
pub(crate) fn ple_layer<B: Backend>(
    b: &B,
    s: &mut State<B>,
    n: usize,
    i: usize,
    pl: &PleLayer<B>,
    hp: &Hparams,
) -> Result<()> {
    let (w, l) = (hp.n_embd_per_layer, hp.n_layer);
    let p = s.ple.as_mut().expect("PLE models' states have PLE buffers");
    b.matmul(&pl.gate, &s.x, n, &mut p.g)?;
    b.copy_cols(&p.all, l * w, i * w, w, n, &mut p.slice)?;
    b.glu(Activation::GeGlu, &p.g, &p.slice, n * w, &mut p.a)?;
    b.matmul(&pl.proj, &p.a, n, &mut s.xn)?;
    b.rms_norm(&s.xn, &pl.post_norm, hp.rms_eps, n, &mut s.o)?;
    Ok(())
}

/// The experts over `s.xn` into `s.o` (router logits already in the scratch when
/// `p.router_given`).
pub(crate) fn experts<B: Backend>(
    b: &B,
    s: &mut State<B>,
    n: usize,
    e: &Experts<B>,
    p: &MoeParams,
) -> Result<()> {
    let [logits, routes, xs, g, u, act, ys] = &mut s.moe[..] else {
        unreachable!("seven MoE scratch buffers")
    };
    b.moe(
        &s.xn,
        n,
        MoeWeights {
            router: &e.router,
            gate: &e.gate,
            up: e.up.as_ref().unwrap_or(&e.gate),
            down: &e.down,
            down_scale: e.down_scale.as_ref(),
            gate_scale: e.gate_scale.as_ref(),
            up_scale: e.up_scale.as_ref(),
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
    if let Some(sh) = &e.shared {
        shared_expert(b, s, n, sh)?;
    }
    Ok(())
}

/// Adds the shared expert's gated output to the experts' (`s.o`), over the normed `s.xn`.
fn shared_expert<B: Backend>(
    b: &B,
    s: &mut State<B>,
    n: usize,
    sh: &crate::decoder::SharedExpert<B>,
) -> Result<()> {
    let d = b.weight_rows(&sh.down);
    let ff = b.weight_rows(&sh.gate);
    b.matmul(&sh.gate, &s.xn, n, &mut s.gate)?;
    b.matmul(&sh.up, &s.xn, n, &mut s.up)?;
    let [sg, su, sd] = sh.scales;
    for (scale, out) in [(sg, &mut s.gate), (su, &mut s.up)] {
        if let Some(c) = scale {
            b.scale(out, c, n * ff)?;
        }
    }
    b.glu(Activation::SwiGlu, &s.gate, &s.up, n * ff, &mut s.act)?;
    let [y, g] = &mut s.aux[..] else {
        unreachable!("two aux buffers beside a shared expert")
    };
    b.matmul(&sh.down, &s.act, n, y)?;
    if let Some(c) = sd {
        b.scale(y, c, n * d)?;
    }
    b.matmul(&sh.gate_inp, &s.xn, n, g)?;
    b.sigmoid_mul(y, g, n, d, true)?;
    b.add(&mut s.o, y, n * d)?;
    Ok(())
}

/// Gemma 4's MoE block over the residual `s.x` (its ffn_norm in `s.xn`), into `s.o`:
/// post_norm_1(dense MLP) + post_norm_2(experts(pre_norm_2(x))), the router over
/// rms(x) / √n_embd · router_scale.
pub(crate) fn dense_and_experts<B: Backend>(
    b: &B,
    s: &mut State<B>,
    n: usize,
    ffn: &Ffn<B>,
    hp: &Hparams,
) -> Result<()> {
    let Ffn::DenseAndExperts {
        gate,
        up,
        down,
        post_norm_1,
        pre_norm_2,
        post_norm_2,
        router_scale,
        experts: e,
    } = ffn
    else {
        unreachable!("called on Gemma 4's MoE blocks")
    };
    let p = hp.moe.as_ref().expect("MoE layers come with MoE hparams");
    let (d, eps) = (hp.n_embd, hp.rms_eps);
    b.matmul_glu(
        hp.act,
        gate,
        up,
        &s.xn,
        n,
        [&mut s.gate, &mut s.up],
        &mut s.act,
    )?;
    b.matmul(down, &s.act, n, &mut s.o)?;
    let [mlp, r] = &mut s.aux[..] else {
        unreachable!("two auxiliary buffers")
    };
    b.rms_norm(&s.o, post_norm_1, eps, n, mlp)?;
    b.rms_norm(&s.x, pre_norm_2, eps, n, &mut s.xn)?;
    b.rms_norm_plain(&s.x, d, eps, n, r)?;
    b.scale(r, 1.0 / (d as f32).sqrt(), n * d)?;
    b.mul_cols(r, router_scale, n)?;
    b.matmul(&e.router, r, n, &mut s.moe[0])?;
    experts(b, s, n, e, p)?;
    let [mlp, r] = &mut s.aux[..] else {
        unreachable!("two auxiliary buffers")
    };
    b.rms_norm(&s.o, post_norm_2, eps, n, r)?;
    b.add(r, mlp, n * d)?;
    std::mem::swap(&mut s.o, r);
    Ok(())
}
