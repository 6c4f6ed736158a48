//! `qwen35` and `qwen35moe` (Qwen 3.5): gated-delta-net layers (linear attention over a
//! per-sequence recurrent state, [`quiver_backend::delta_net`]) interleaved with full-attention
//! layers whose q projection carries a sigmoid output gate (q/k RMSNorm per head, partial
//! rope). Each layer's FFN input is normed by `post_attention_norm`; `qwen35moe`'s FFN is a
//! mixture of experts beside a shared expert with a sigmoid gate of its own.
//!
//! As llama.cpp reads the file: the rope is its interleaved M-RoPE, which for text positions
//! (the same position in the t, h and w sections) is the split-halves rope over
//! `rope.dimension_count` dims; a sections key that leaves pairs to the fourth section (which
//! text positions leave unrotated) is refused. Recurrent layers come from
//! `attention.recurrent_layers`, else every layer but each `full_attention_interval`-th
//! (default 4). Multi-token-prediction layers (`nextn_predict_layers`, the last blocks) are
//! not run.

use crate::decoder::Layer;
use crate::hparams::{Hparams, Reader};
use crate::{weight, ModelError, Result, State};
use quiver_backend::{
    Activation, Backend, DeltaNetParams, DeltaNetWeights, Gating, RopeMode, Step,
};
use quiver_gguf::GgufFile;
use std::sync::Arc;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::SwiGlu)?;
    hp.rms_eps = r
        .f32("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| r.bad("attention.layer_norm_rms_epsilon", "missing"))?;
    hp.qk_norm = true;
    hp.ffn_weight_scales = true;
    hp.q_gate = true;
    check_sections(&r, hp.rope.n_dims)?;
    let n_all = hp.n_layer;
    let nextn = r.u("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= n_all {
        return Err(r.bad("nextn_predict_layers", format!("{nextn} of {n_all} blocks")));
    }
    let recurrent = recurrent_layers(&r, n_all, nextn)?;
    hp.n_layer = n_all - nextn;
    hp.layers.truncate(hp.n_layer);
    hp.swa_layers.truncate(hp.n_layer);
    for (l, rec) in hp.layers.iter_mut().zip(&recurrent) {
        l.recurrent = *rec;
    }
    let inner = r.req("ssm.inner_size")?;
    let n_v = r.req("ssm.time_step_rank")?;
    if inner % n_v != 0 {
        return Err(r.bad(
            "ssm.inner_size",
            format!("{inner} is not a multiple of time_step_rank {n_v}"),
        ));
    }
    let p = DeltaNetParams {
        n_k_heads: r.req("ssm.group_count")?,
        n_v_heads: n_v,
        head_k: r.req("ssm.state_size")?,
        head_v: inner / n_v,
        conv_kernel: r.req("ssm.conv_kernel")?,
        eps: hp.rms_eps,
    };
    p.check().map_err(|e| r.bad("ssm.state_size", e))?;
    hp.delta_net = Some(p);
    if hp.arch == "qwen35moe" {
        hp.moe = Some(r.moe(hp.n_ff, Gating::Softmax, true, Activation::SwiGlu)?);
        hp.shared_expert_ff = r
            .u("expert_shared_feed_forward_length")?
            .filter(|&v| v > 0)
            .unwrap_or(hp.n_ff);
    }
    Ok(hp)
}

/// Which of the first `n_all - nextn` blocks are recurrent.
fn recurrent_layers(r: &Reader, n_all: usize, nextn: usize) -> Result<Vec<bool>> {
    let key = "attention.recurrent_layers";
    if let Some(quiver_gguf::Value::Array(a)) = r.f.get(&format!("{}.{key}", r.arch)) {
        let v: Vec<bool> = match a {
            quiver_gguf::Array::Bool(v) => v.clone(),
            quiver_gguf::Array::U8(v) => v.iter().map(|&x| x != 0).collect(),
            quiver_gguf::Array::I8(v) => v.iter().map(|&x| x != 0).collect(),
            quiver_gguf::Array::U32(v) => v.iter().map(|&x| x != 0).collect(),
            quiver_gguf::Array::I32(v) => v.iter().map(|&x| x != 0).collect(),
            _ => return Err(r.bad(key, "is an array of something other than flags")),
        };
        if v.len() != n_all {
            return Err(r.bad(key, format!("has {} entries for {n_all} layers", v.len())));
        }
        return Ok(v[..n_all - nextn].to_vec());
    }
    let interval = r.u("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(r.bad("full_attention_interval", "is 0"));
    }
    Ok((0..n_all - nextn)
        .map(|i| (i + 1) % interval != 0)
        .collect())
}

/// The interleaved M-RoPE of text positions is the split-halves rope as long as every rotated
/// pair falls in the t, h or w section (llama.cpp's sector rule); a pair of the fourth section
/// would not turn for text positions, which quiver's rope does not do.
fn check_sections(r: &Reader, n_dims: usize) -> Result<()> {
    let key = "rope.dimension_sections";
    let s: Vec<usize> = match r.f.get(&format!("{}.{key}", r.arch)) {
        Some(quiver_gguf::Value::Array(quiver_gguf::Array::U32(v))) => {
            v.iter().map(|&x| x as usize).collect()
        }
        Some(quiver_gguf::Value::Array(quiver_gguf::Array::I32(v))) => {
            v.iter().map(|&x| x.max(0) as usize).collect()
        }
        Some(_) => return Err(r.bad(key, "is not an array of counts")),
        None => return Err(r.bad(key, "missing")),
    };
    let mut sec = [0usize; 4];
    for (d, v) in sec.iter_mut().zip(&s) {
        *d = *v;
    }
    let total: usize = sec.iter().sum();
    if sec[0] + sec[1] + sec[2] == 0 || total > n_dims {
        return Err(r.bad(key, format!("{s:?} for {n_dims} rotated dims")));
    }
    for pair in 0..n_dims / 2 {
        let sector = pair % total;
        let thw = (sector.is_multiple_of(3) && sector < 3 * sec[0])
            || (sector % 3 == 1 && sector < 3 * sec[1])
            || (sector % 3 == 2 && sector < 3 * sec[2]);
        if !thw {
            return Err(r.bad(
                key,
                format!("{s:?} leaves rope pair {pair} unrotated for text (not supported)"),
            ));
        }
    }
    Ok(())
}

/// One gated-delta-net layer's own weights (its in-projection is `Layer::wq`, its output
/// projection `Layer::wo`).
pub struct LinearAttn<B: Backend> {
    /// The output gate's projection (`attn_gate`, [value_dim, n_embd]).
    pub z: B::Weight,
    pub alpha: B::Weight,
    pub beta: B::Weight,
    /// `ssm_conv1d` as one vector, channel after channel.
    pub conv: B::Weight,
    pub dt_bias: B::Weight,
    pub a: B::Weight,
    /// The per-head RMSNorm of the rule's output (`ssm_norm`, [head_v]).
    pub norm: B::Weight,
    /// Per-tensor scales: in-projection, gate, α, β, output.
    pub scales: [Option<f32>; 5],
    /// The layer's slot array in `State::rs`.
    pub rs: usize,
}

/// The step buffers of the hybrid layers.
pub struct HybridBufs<B: Backend> {
    /// [n, 2 · q_dim]: the gated attention's q-and-gate product.
    pub qg: B::Buf,
    /// [n, q_dim]: its gate.
    pub gate: B::Buf,
    /// [n, channels]: the in-projection, convolved in place.
    pub qkv: B::Buf,
    /// [n, value_dim]: the output gate's product, the rule's output, the gated norm's.
    pub z: B::Buf,
    pub core: B::Buf,
    pub gated: B::Buf,
    /// [n, n_v_heads]
    pub alpha: B::Buf,
    pub beta: B::Buf,
}

impl<B: Backend> HybridBufs<B> {
    pub(crate) fn floats(hp: &Hparams, n: usize) -> usize {
        let p = hp.delta_net.expect("hybrid hparams");
        let (qd, _, _) = hp.max_dims();
        n * (3 * qd + p.channels() + 3 * p.value_dim() + 2 * p.n_v_heads)
    }

    pub(crate) fn new(b: &B, hp: &Hparams, n: usize) -> Result<Self> {
        let p = hp.delta_net.expect("hybrid hparams");
        let (qd, _, _) = hp.max_dims();
        Ok(HybridBufs {
            qg: b.buf(n * 2 * qd)?,
            gate: b.buf(n * qd)?,
            qkv: b.buf(n * p.channels())?,
            z: b.buf(n * p.value_dim())?,
            core: b.buf(n * p.value_dim())?,
            gated: b.buf(n * p.value_dim())?,
            alpha: b.buf(n * p.n_v_heads)?,
            beta: b.buf(n * p.n_v_heads)?,
        })
    }
}

/// A per-tensor scale (`blk.N.NAME.scale`, one f32), where the file has one.
pub(crate) fn scale_of(f: &GgufFile, name: &str) -> Result<Option<f32>> {
    let Some(t) = f.tensor(name) else {
        return Ok(None);
    };
    if t.ty != quiver_gguf::GgmlType::F32 || t.n_elements != 1 {
        return Err(ModelError::BadHparam {
            key: name.into(),
            detail: format!(
                "a weight scale must be one f32, not {:?} {:?}",
                t.ty, t.shape
            ),
        });
    }
    let v = f.tensor_data(t);
    Ok(Some(f32::from_le_bytes([v[0], v[1], v[2], v[3]])))
}

/// Loads recurrent layer `i`'s in-projection, output projection and own weights; `rs` is its
/// index among the recurrent layers.
pub(crate) fn load_linear<B: Backend>(
    b: &B,
    f: &Arc<GgufFile>,
    hp: &Hparams,
    i: usize,
    rs: usize,
) -> Result<(B::Weight, B::Weight, LinearAttn<B>)> {
    let p = hp.delta_net.expect("hybrid hparams");
    let d = hp.n_embd as u64;
    let (c, vd, hv) = (
        p.channels() as u64,
        p.value_dim() as u64,
        p.n_v_heads as u64,
    );
    let n = |s: &str| format!("blk.{i}.{s}.weight");
    let w = |name: &str, shape: &[u64]| weight(b, f, name, shape);
    if f.tensor(&n("attn_qkv")).is_none() {
        return Err(ModelError::MissingTensor {
            name: n("attn_qkv"),
        });
    }
    // The kernel as one vector: [channels, taps] in the file.
    let conv_name = n("ssm_conv1d");
    let k = p.conv_kernel as u64;
    let t = f
        .tensor(&conv_name)
        .ok_or_else(|| ModelError::MissingTensor {
            name: conv_name.clone(),
        })?;
    if t.shape != [c, k] {
        return Err(ModelError::WrongShape {
            name: conv_name,
            got: t.shape.clone(),
            expected: vec![c, k],
        });
    }
    let idx = f
        .tensors
        .iter()
        .position(|x| x.name == conv_name)
        .unwrap_or(0);
    let conv = b.weight(
        &conv_name,
        t.ty,
        &[c * k],
        quiver_backend::WeightBytes::whole(f.clone(), idx),
    )?;
    let sc = |s: &str| scale_of(f, &format!("blk.{i}.{s}.scale"));
    let lin = LinearAttn {
        z: w(&n("attn_gate"), &[vd, d])?,
        alpha: w(&n("ssm_alpha"), &[hv, d])?,
        beta: w(&n("ssm_beta"), &[hv, d])?,
        conv,
        dt_bias: w(&format!("blk.{i}.ssm_dt.bias"), &[hv])?,
        a: w(&format!("blk.{i}.ssm_a"), &[hv])?,
        norm: w(&n("ssm_norm"), &[p.head_v as u64])?,
        scales: [
            sc("attn_qkv")?,
            sc("attn_gate")?,
            sc("ssm_alpha")?,
            sc("ssm_beta")?,
            sc("ssm_out")?,
        ],
        rs,
    };
    Ok((
        w(&n("attn_qkv"), &[c, d])?,
        w(&n("ssm_out"), &[d, vd])?,
        lin,
    ))
}

/// A gated-delta-net layer over the normed input `s.xn`: its output (before the residual)
/// into `s.o`.
pub(crate) fn linear<B: Backend>(
    b: &mut B,
    s: &mut State<B>,
    step: &Step<B::StepCtx>,
    l: &Layer<B>,
    lin: &LinearAttn<B>,
    hp: &Hparams,
) -> Result<()> {
    let n = step.rows;
    let p = hp.delta_net.expect("hybrid hparams");
    let hy = s.hy.as_mut().expect("hybrid buffers");
    let (c, vd, hv) = (p.channels(), p.value_dim(), p.n_v_heads);
    b.matmul_many(
        &[&l.wq, &lin.z, &lin.alpha, &lin.beta],
        &s.xn,
        n,
        &mut [&mut hy.qkv, &mut hy.z, &mut hy.alpha, &mut hy.beta],
    )?;
    let [s_qkv, s_z, s_a, s_b, s_o] = lin.scales;
    for (scale, buf, len) in [
        (s_qkv, &mut hy.qkv, n * c),
        (s_z, &mut hy.z, n * vd),
        (s_a, &mut hy.alpha, n * hv),
        (s_b, &mut hy.beta, n * hv),
    ] {
        if let Some(x) = scale {
            b.scale(buf, x, len)?;
        }
    }
    b.delta_net(
        step,
        &p,
        DeltaNetWeights {
            conv: &lin.conv,
            dt_bias: &lin.dt_bias,
            a: &lin.a,
        },
        &mut hy.qkv,
        &hy.alpha,
        &hy.beta,
        &mut s.rs[lin.rs],
        s.snap.get_mut(lin.rs).map(|buf| quiver_backend::Snapshots {
            buf,
            planes: s.snap_planes,
        }),
        &mut hy.core,
    )?;
    // The gated norm: rms_norm(o) per head · silu(z).
    b.rms_norm_gated(
        &mut hy.core,
        &lin.norm,
        hp.rms_eps,
        n * hv,
        p.head_v,
        &hy.z,
        &mut hy.gated,
    )?;
    b.matmul(&l.wo, &hy.gated, n, &mut s.o)?;
    if let Some(x) = s_o {
        b.scale(&mut s.o, x, n * hp.n_embd)?;
    }
    Ok(())
}
