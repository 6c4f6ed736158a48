//! `deepseek4` (DeepSeek-V4), as llama.cpp's `src/models/deepseek4.cpp` reads and runs it:
//! hc residual streams mixed by hyper-connections (Sinkhorn-normalised), attention of one KV
//! head over a raw sliding window plus a compressed KV (per layer ratio 0, 4 or 128; ratio 4
//! with the lightning indexer's top-k), rope on the tail of each head, q through a low-rank
//! projection, the output through grouped low-rank products, and MoE layers (sqrt-softplus
//! scores with a selection bias, or hash routing for the first `hash_layer_count` layers;
//! clamped SwiGLU) beside a shared expert. The ops are [`quiver_backend::dsv4`]'s.
//!
//! Per-sequence state: every layer keeps, per sequence slot (`SeqSpan::state_slot`, as
//! Qwen 3.5's recurrent state), the raw window's keys, the compressor's rings, and the
//! compressed rows of up to `n_ctx` positions ([`quiver_backend::dsv4::AttnShape`]); the paged
//! KV cache is not used (every layer counts as `LayerHp::recurrent`). Like the recurrent
//! state, it cannot be shared between sequences: prefix hits and preemption recompute from
//! position 0 (the scheduler's `recurrent` policy); speculative decoding keeps what a step's
//! last rows overwrite and rolls rejected proposals back (`State::keep_states`).
//!
//! The multi-token-prediction blocks (`nextn_predict_layers`, the last blocks, where the file
//! has their tensors) are counted out of the trunk; the first runs as a draft head
//! (`crate::mtp`; `mtp_input` is its input stage). Image inputs are not run.

use crate::hparams::Reader;
use crate::{Hparams, ModelError, Result, State};
use quiver_backend::dsv4::{AttnShape, AttnWeights, HcParams};
use quiver_backend::{
    Activation, Backend, ExtraOp, Gating, MoeScratch, MoeWeights, RopeMode, RopeParams, Step,
    WeightBytes,
};
use quiver_gguf::{GgmlType, GgufFile};
use std::sync::Arc;

/// DeepSeek-V4's own hyperparameters (`Hparams::dsv4`).
#[derive(Clone, Debug, PartialEq)]
pub struct Dsv4Hp {
    pub q_lora: usize,
    pub hc: HcParams,
    pub o_groups: usize,
    pub o_lora: usize,
    /// Per block (the trunk's, then the multi-token-prediction blocks'): 0, 4 or 128.
    pub ratios: Vec<usize>,
    pub n_swa: usize,
    pub n_rot: usize,
    /// The raw layers' rope, and the compressed layers' (q, kv, compressed rows, indexer).
    pub rope_raw: RopeParams,
    pub rope_comp: RopeParams,
    pub ix_heads: usize,
    pub ix_dim: usize,
    pub ix_top_k: usize,
    pub hash_layers: usize,
    /// Per block, the SwiGLU limits of the experts and the shared expert (≤ 1e-6: none).
    pub clamp_exp: Vec<f32>,
    pub clamp_shexp: Vec<f32>,
    /// Width of the shared expert (expert width × shared count).
    pub n_ff_shared: usize,
    /// Multi-token-prediction blocks after the trunk (not run by the trunk).
    pub nextn: usize,
    /// Raw ring rows beyond the window ([`AttnShape::spare`]): a multi-token-prediction
    /// block's run as a draft head (`crate::mtp`), 0 in the trunk.
    pub spare: usize,
}

impl Dsv4Hp {
    /// Layer `i`'s attention shape for states of `n_ctx` positions per sequence.
    pub fn shape(&self, hp: &Hparams, i: usize, n_ctx: usize) -> AttnShape {
        let ratio = self.ratios[i];
        AttnShape {
            n_head: hp.n_head,
            head_dim: hp.head_dim,
            n_rot: self.n_rot,
            n_swa: self.n_swa,
            spare: self.spare,
            ratio,
            rope: if ratio == 0 {
                self.rope_raw.clone()
            } else {
                self.rope_comp.clone()
            },
            comp_rope: self.rope_comp.clone(),
            rms_eps: hp.rms_eps,
            ix_heads: self.ix_heads,
            ix_dim: self.ix_dim,
            ix_top_k: self.ix_top_k,
            n_ctx,
        }
    }

    /// Bytes of one sequence's state over every layer for `n_ctx` positions.
    pub fn state_bytes(&self, hp: &Hparams, n_ctx: usize) -> u64 {
        (0..hp.n_layer)
            .map(|i| 4 * self.shape(hp, i, n_ctx).state_floats() as u64)
            .sum()
    }

    /// Bytes one sequence keeps per row a rollback may undo (`quiver_backend::dsv4::Kept`),
    /// over the layers.
    pub fn kept_bytes(&self, hp: &Hparams) -> u64 {
        (0..hp.n_layer)
            .map(|i| 4 * quiver_backend::dsv4::kept_floats(&self.shape(hp, i, 1)) as u64)
            .sum()
    }
}

fn f32_per_layer(r: &Reader, k: &str, n: usize) -> Result<Option<Vec<f32>>> {
    match r.f.get(&format!("{}.{k}", r.arch)) {
        None => Ok(None),
        Some(quiver_gguf::Value::Array(quiver_gguf::Array::F32(v))) => {
            if v.len() < n {
                return Err(r.bad(k, format!("has {} entries for {n} layers", v.len())));
            }
            Ok(Some(v[..n].to_vec()))
        }
        Some(_) => match r.f32(k)? {
            Some(x) => Ok(Some(vec![x; n])),
            None => Err(r.bad(k, "is neither a number nor an array of f32")),
        },
    }
}

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Normal, Activation::SwiGlu)?;
    let req_f = |k: &str| -> Result<f32> { r.f32(k)?.ok_or_else(|| r.bad(k, "missing")) };
    hp.rms_eps = req_f("attention.layer_norm_rms_epsilon")?;
    let n_all = hp.n_layer;
    let mut nextn = r.u("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= n_all {
        return Err(r.bad("nextn_predict_layers", format!("{nextn} of {n_all} blocks")));
    }
    // As llama.cpp: MTP blocks count only where the file has their tensors.
    if nextn > 0
        && f.tensor(&format!("blk.{}.nextn.eh_proj.weight", n_all - nextn))
            .is_none()
    {
        nextn = 0;
    }
    let n = n_all - nextn;
    hp.n_layer = n;
    hp.layers.truncate(n);
    hp.swa_layers = vec![true; n];
    if hp.n_head_kv != 1 {
        return Err(r.bad(
            "attention.head_count_kv",
            format!("{} (one KV head expected)", hp.n_head_kv),
        ));
    }
    for l in &mut hp.layers {
        // No paged KV: each layer's state is per sequence.
        l.recurrent = true;
    }
    let hc = r.req("hyper_connection.count")?;
    if hc != 4 {
        return Err(r.bad(
            "hyper_connection.count",
            format!("{hc} (llama.cpp runs 4 only)"),
        ));
    }
    let hcp = HcParams {
        hc,
        d: hp.n_embd,
        eps: req_f("hyper_connection.epsilon")?,
        iters: r.req("hyper_connection.sinkhorn_iterations")?,
    };
    let gating = r.u("expert_gating_func")?;
    if gating != Some(4) {
        return Err(r.bad(
            "expert_gating_func",
            format!("{gating:?} (only sqrt-softplus, 4, is supported)"),
        ));
    }
    let ratios = match r.f.get(&format!("{}.attention.compress_ratios", r.arch)) {
        Some(quiver_gguf::Value::Array(quiver_gguf::Array::U32(v))) => {
            v.iter().map(|&x| x as usize).collect()
        }
        Some(quiver_gguf::Value::Array(quiver_gguf::Array::I32(v)))
            if v.iter().all(|&x| x >= 0) =>
        {
            v.iter().map(|&x| x as usize).collect::<Vec<_>>()
        }
        Some(_) => return Err(r.bad("attention.compress_ratios", "is not an array of counts")),
        None => return Err(r.bad("attention.compress_ratios", "missing")),
    };
    if ratios.len() < n_all {
        return Err(r.bad(
            "attention.compress_ratios",
            format!("has {} entries for {n_all} blocks", ratios.len()),
        ));
    }
    if let Some(x) = ratios[..n_all].iter().find(|&&x| !matches!(x, 0 | 4 | 128)) {
        return Err(r.bad(
            "attention.compress_ratios",
            format!("holds {x} (0, 4 and 128 only)"),
        ));
    }
    let n_rot = hp.rope.n_dims;
    let (ix_heads, ix_dim) = (
        r.req("attention.indexer.head_count")?,
        r.req("attention.indexer.key_length")?,
    );
    if ix_dim < n_rot || n_rot == 0 {
        return Err(r.bad(
            "rope.dimension_count",
            format!("{n_rot} for indexer heads of {ix_dim}"),
        ));
    }
    let o_groups = r.req("attention.output_group_count")?;
    if hp.n_head % o_groups != 0 {
        return Err(r.bad(
            "attention.output_group_count",
            format!("{o_groups} does not divide {} heads", hp.n_head),
        ));
    }
    // The raw layers' rope is plain; the compressed layers' has the file's scaling at their
    // own base, its attention factor cancelling YaRN's magnitude scale (as llama.cpp's).
    let rope_raw = RopeParams::plain(RopeMode::Normal, n_rot, hp.rope.base);
    if hp.rope.llama3.is_some() || hp.rope.freq_factors.is_some() {
        return Err(r.bad(
            "rope.scaling.type",
            "llama3 scaling or rope factors (not supported for deepseek4)",
        ));
    }
    let mut rope_comp = RopeParams::plain(
        RopeMode::Normal,
        n_rot,
        req_f("attention.compress_rope_freq_base")?,
    );
    rope_comp.freq_scale = hp.rope.freq_scale;
    rope_comp.yarn = hp.rope.yarn;
    if rope_comp.yarn.is_some_and(|y| y.ext_factor != 0.0) {
        rope_comp.attn_factor = 1.0 / (1.0 + 0.1 * (1.0 / rope_comp.freq_scale).ln());
    }
    // llama.cpp would route within expert groups where the file has more than one.
    if let Some(g) = r.u("expert_group_count")?.filter(|&g| g > 1) {
        return Err(r.bad(
            "expert_group_count",
            format!("{g} (group-limited routing is not supported)"),
        ));
    }
    let mut moe = r.moe(hp.n_ff, Gating::Softmax, true, Activation::SwiGlu)?;
    moe.n_ff = r
        .per_layer("expert_feed_forward_length", n_all)?
        .and_then(|v| v.first().copied())
        .filter(|&v| v > 0)
        .ok_or_else(|| r.bad("expert_feed_forward_length", "missing or 0"))?;
    moe.norm =
        r.f.get_bool(&format!("{}.expert_weights_norm", r.arch))?
            .ok_or_else(|| r.bad("expert_weights_norm", "missing"))?;
    moe.scale = req_f("expert_weights_scale")?;
    let n_shared = r.req("expert_shared_count")?;
    let clamp_exp = f32_per_layer(&r, "swiglu_clamp_exp", n_all)?
        .ok_or_else(|| r.bad("swiglu_clamp_exp", "missing"))?;
    let clamp_shexp =
        f32_per_layer(&r, "swiglu_clamp_shexp", n_all)?.unwrap_or_else(|| clamp_exp.clone());
    hp.shared_expert_ff = moe.n_ff * n_shared;
    hp.moe = Some(moe);
    hp.dsv4 = Some(Dsv4Hp {
        q_lora: r.req("attention.q_lora_rank")?,
        hc: hcp,
        o_groups,
        o_lora: r.req("attention.output_lora_rank")?,
        ratios: ratios[..n_all].to_vec(),
        n_swa: r.req("attention.sliding_window")?,
        n_rot,
        rope_raw,
        rope_comp,
        ix_heads,
        ix_dim,
        ix_top_k: r.req("attention.indexer.top_k")?,
        hash_layers: r.u("hash_layer_count")?.unwrap_or(0),
        clamp_exp,
        clamp_shexp,
        n_ff_shared: hp.shared_expert_ff,
        nextn,
        spare: 0,
    });
    Ok(hp)
}

/// One layer's weights.
pub struct Dsv4Layer<B: Backend> {
    pub attn_norm: B::Weight,
    pub sinks: B::Weight,
    pub wq_a: B::Weight,
    pub q_a_norm: B::Weight,
    pub wq_b: B::Weight,
    pub wkv: B::Weight,
    pub kv_norm: B::Weight,
    /// Per group, [o_lora, n_head·head_dim / groups] (rows of one tensor).
    pub wo_a: Vec<B::Weight>,
    pub wo_b: B::Weight,
    /// fn, base, scale of the attention's and the FFN's hyper-connections.
    pub hc_attn: [B::Weight; 3],
    pub hc_ffn: [B::Weight; 3],
    /// The compressor: value and score products, ape (flat), norm (ratio > 0).
    pub comp: Option<[B::Weight; 4]>,
    /// The indexer: q product, head weights, its compressor's value, score, ape, norm.
    pub ix: Option<[B::Weight; 6]>,
    pub ffn_norm: B::Weight,
    pub router: B::Weight,
    pub gate_exps: B::Weight,
    pub up_exps: B::Weight,
    pub down_exps: B::Weight,
    pub bias: Option<B::Weight>,
    /// `ffn_gate_tid2eid` [n_vocab, n_used] as f32 (the hash-routed layers).
    pub hash: Option<B::Buf>,
    pub sh_gate: B::Weight,
    pub sh_up: B::Weight,
    pub sh_down: B::Weight,
}

/// The model's weights beyond `Model`'s embedding, output norm and output.
pub struct Dsv4<B: Backend> {
    pub layers: Vec<Dsv4Layer<B>>,
    pub head: [B::Weight; 3],
}

/// A weight loaded flat (as one vector of all its elements), after checking its shape.
fn flat<B: Backend>(b: &B, f: &Arc<GgufFile>, name: &str, shape: &[u64]) -> Result<B::Weight> {
    let idx = f
        .tensors
        .iter()
        .position(|t| t.name == name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
    let t = &f.tensors[idx];
    if t.shape != shape {
        return Err(ModelError::WrongShape {
            name: name.into(),
            got: t.shape.clone(),
            expected: shape.to_vec(),
        });
    }
    Ok(b.weight(
        name,
        t.ty,
        &[t.n_elements],
        WeightBytes::whole(f.clone(), idx),
    )?)
}

pub(crate) fn load<B: Backend>(b: &B, f: &Arc<GgufFile>, hp: &Hparams) -> Result<Dsv4<B>> {
    let ds = hp.dsv4.as_ref().expect("deepseek4 hparams");
    if !b.supports(ExtraOp::Dsv4) || !b.supports(ExtraOp::RmsNormPlain) {
        return Err(quiver_backend::BackendError::MissingOp {
            op: ExtraOp::Dsv4,
            backend: b.name(),
            arch: hp.arch.clone(),
        }
        .into());
    }
    let moe = hp.moe.expect("deepseek4 MoE");
    let (d, hd, nh) = (hp.n_embd as u64, hp.head_dim as u64, hp.n_head as u64);
    let (ql, hc) = (ds.q_lora as u64, ds.hc.hc as u64);
    let (g, ol) = (ds.o_groups as u64, ds.o_lora as u64);
    let (ih, id) = (ds.ix_heads as u64, ds.ix_dim as u64);
    let (ne, ff, sf) = (moe.n_expert as u64, moe.n_ff as u64, ds.n_ff_shared as u64);
    let mix = ds.hc.mix_dim() as u64;
    let w = |name: &str, shape: &[u64]| crate::weight(b, f, name, shape);
    let layer = |i: usize| -> Result<Dsv4Layer<B>> {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let ratio = ds.ratios[i] as u64;
        let hcw = |s: &str| -> Result<[B::Weight; 3]> {
            Ok([
                w(&n(&format!("hc_{s}_fn")), &[mix, hc * d])?,
                w(&n(&format!("hc_{s}_base")), &[mix])?,
                w(&n(&format!("hc_{s}_scale")), &[3])?,
            ])
        };
        // attn_output_a as llama.cpp takes it: [groups, o_lora, group dim] or the 2-D form.
        let wo_a_name = n("attn_output_a");
        let gd = nh * hd / g;
        let wo_a_shape = match f.tensor(&wo_a_name) {
            Some(t) if t.shape.len() == 2 => vec![g * ol, gd],
            _ => vec![g, ol, gd],
        };
        let comp = if ratio > 0 {
            let coff = if ratio == 4 { 2 } else { 1 };
            Some([
                w(&n("attn_compressor_kv"), &[coff * hd, d])?,
                w(&n("attn_compressor_gate"), &[coff * hd, d])?,
                flat(b, f, &n("attn_compressor_ape"), &[ratio, coff * hd])?,
                w(&n("attn_compressor_norm"), &[hd])?,
            ])
        } else {
            None
        };
        let ix = if ratio == 4 {
            Some([
                w(&n("indexer.attn_q_b"), &[ih * id, ql])?,
                w(&n("indexer.proj"), &[ih, d])?,
                w(&n("indexer_compressor_kv"), &[2 * id, d])?,
                w(&n("indexer_compressor_gate"), &[2 * id, d])?,
                flat(b, f, &n("indexer_compressor_ape"), &[4, 2 * id])?,
                w(&n("indexer_compressor_norm"), &[id])?,
            ])
        } else {
            None
        };
        let (bias, hash) = if i < ds.hash_layers {
            let ids = hash_table(f, i, hp, moe.n_used)?;
            let ids: Vec<f32> = ids.iter().map(|&e| e as f32).collect();
            let mut buf = b.buf(ids.len())?;
            b.write(&mut buf, &ids)?;
            (None, Some(buf))
        } else {
            (Some(w(&format!("blk.{i}.exp_probs_b.bias"), &[ne])?), None)
        };
        Ok(Dsv4Layer {
            attn_norm: w(&n("attn_norm"), &[d])?,
            sinks: w(&n("attn_sinks"), &[nh])?,
            wq_a: w(&n("attn_q_a"), &[ql, d])?,
            q_a_norm: w(&n("attn_q_a_norm"), &[ql])?,
            wq_b: w(&n("attn_q_b"), &[nh * hd, ql])?,
            wkv: w(&n("attn_kv"), &[hd, d])?,
            kv_norm: w(&n("attn_kv_a_norm"), &[hd])?,
            wo_a: {
                // Each group's rows of the one tensor.
                let (t, ty) = crate::find(f, &wo_a_name, &wo_a_shape)?;
                let rb = ty.row_bytes(gd).unwrap_or(0) as usize * ol as usize;
                (0..g as usize)
                    .map(|k| {
                        let bytes = WeightBytes {
                            range: Some((k * rb, rb)),
                            ..WeightBytes::whole(f.clone(), t)
                        };
                        Ok(b.weight(&wo_a_name, ty, &[ol, gd], bytes)?)
                    })
                    .collect::<Result<Vec<_>>>()?
            },
            wo_b: w(&n("attn_output_b"), &[d, g * ol])?,
            hc_attn: hcw("attn")?,
            hc_ffn: hcw("ffn")?,
            comp,
            ix,
            ffn_norm: w(&n("ffn_norm"), &[d])?,
            router: w(&n("ffn_gate_inp"), &[ne, d])?,
            gate_exps: w(&n("ffn_gate_exps"), &[ne, ff, d])?,
            up_exps: w(&n("ffn_up_exps"), &[ne, ff, d])?,
            down_exps: w(&n("ffn_down_exps"), &[ne, d, ff])?,
            bias,
            hash,
            sh_gate: w(&n("ffn_gate_shexp"), &[sf, d])?,
            sh_up: w(&n("ffn_up_shexp"), &[sf, d])?,
            sh_down: w(&n("ffn_down_shexp"), &[d, sf])?,
        })
    };
    let layers = (0..hp.n_layer).map(layer).collect::<Result<Vec<_>>>()?;
    Ok(Dsv4 {
        layers,
        head: [
            w("output_hc_fn.weight", &[hc, hc * d])?,
            w("output_hc_base.weight", &[hc])?,
            w("output_hc_scale.weight", &[1])?,
        ],
    })
}

/// Layer i's `ffn_gate_tid2eid` ([n_vocab, n_used] expert ids), checked.
fn hash_table(f: &GgufFile, i: usize, hp: &Hparams, n_used: usize) -> Result<Vec<i32>> {
    let name = format!("blk.{i}.ffn_gate_tid2eid.weight");
    let t = f
        .tensor(&name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.clone() })?;
    let shape = [hp.n_vocab as u64, n_used as u64];
    if t.shape != shape || t.ty != GgmlType::I32 {
        return Err(ModelError::WrongShape {
            name,
            got: t.shape.clone(),
            expected: shape.to_vec(),
        });
    }
    let v: Vec<i32> = f
        .tensor_data(t)
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let ne = hp.moe.map_or(0, |m| m.n_expert) as i32;
    if let Some(e) = v.iter().find(|&&e| e < 0 || e >= ne) {
        return Err(ModelError::BadHparam {
            key: name,
            detail: format!("expert id {e} of {ne} experts"),
        });
    }
    Ok(v)
}

/// The step buffers, and the context the state's slots hold.
pub struct Bufs<B: Backend> {
    pub n_ctx: usize,
    h: B::Buf,
    h2: B::Buf,
    flat: B::Buf,
    mixes: B::Buf,
    pc: B::Buf,
    qr: B::Buf,
    ckv: B::Buf,
    csc: B::Buf,
    ikv: B::Buf,
    isc: B::Buf,
    iq: B::Buf,
    iw: B::Buf,
    oa: B::Buf,
    sh: B::Buf,
    /// The attention's and the grouped product's scratch (one at a time).
    scratch: B::Buf,
}

impl<B: Backend> Bufs<B> {
    /// The hc streams after a step's last block (before the head mixes them).
    pub(crate) fn streams(&self) -> &B::Buf {
        &self.h
    }

    fn dims(hp: &Hparams) -> [usize; 14] {
        let ds = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let hcd = ds.hc.hc * hp.n_embd;
        [
            hcd,
            hcd,
            hcd,
            ds.hc.mix_dim(),
            ds.hc.pc_dim(),
            ds.q_lora,
            2 * hp.head_dim,
            2 * hp.head_dim,
            2 * ds.ix_dim,
            2 * ds.ix_dim,
            ds.ix_heads * ds.ix_dim,
            ds.ix_heads,
            ds.o_groups * ds.o_lora,
            hp.n_embd,
        ]
    }

    /// The scratch's floats: the widest layer's attention, or the grouped product.
    fn scratch_floats(hp: &Hparams, n: usize, n_ctx: usize) -> usize {
        let ds = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let grouped = quiver_backend::dsv4::grouped_scratch_floats(
            n,
            ds.o_groups,
            hp.n_head * hp.head_dim / ds.o_groups.max(1),
            ds.o_lora,
        );
        (0..hp.n_layer)
            .map(|i| quiver_backend::dsv4::attention_scratch_floats(&ds.shape(hp, i, n_ctx), n))
            .fold(grouped, usize::max)
    }

    pub(crate) fn floats(hp: &Hparams, n: usize, n_ctx: usize) -> usize {
        n * Self::dims(hp).iter().sum::<usize>() + Self::scratch_floats(hp, n, n_ctx)
    }

    pub(crate) fn new(b: &B, hp: &Hparams, n: usize, n_ctx: usize) -> Result<Self> {
        let [a, c, e, g, h, i, j, k, l, m, o, p, q, r] = Self::dims(hp).map(|x| n * x.max(1));
        Ok(Bufs {
            scratch: b.buf(Self::scratch_floats(hp, n, n_ctx).max(1))?,
            n_ctx,
            h: b.buf(a)?,
            h2: b.buf(c)?,
            flat: b.buf(e)?,
            mixes: b.buf(g)?,
            pc: b.buf(h)?,
            qr: b.buf(i)?,
            ckv: b.buf(j)?,
            csc: b.buf(k)?,
            ikv: b.buf(l)?,
            isc: b.buf(m)?,
            iq: b.buf(o)?,
            iw: b.buf(p)?,
            oa: b.buf(q)?,
            sh: b.buf(r)?,
        })
    }
}

/// The ops of one step.
pub(crate) fn forward<B: Backend>(
    b: &mut B,
    m: &crate::Model<B>,
    w: &Dsv4<B>,
    s: &mut State<B>,
    step: &Step<B::StepCtx>,
) -> Result<()> {
    let hp = &m.hp;
    let ds = hp.dsv4.as_ref().expect("deepseek4 hparams");
    let moe = hp.moe.expect("deepseek4 MoE");
    let n = step.rows;
    let (d, eps, hcp) = (hp.n_embd, hp.rms_eps, ds.hc);
    let hcd = hcp.hc * d;
    let mut bf = s.ds.take().expect("deepseek4 buffers");
    // QUIVER_DUMP_DIR: the tensors llama.cpp's graph names alike (tools/parity/).
    let dump = crate::decoder::Dump::new();
    // A block's (or the head's) input from the streams by its mixes' weights.
    let hc_in =
        |b: &B, [f, base, scale]: &[B::Weight; 3], head, bf: &mut Bufs<B>, x: &mut B::Buf| {
            b.hc_mix_pre(
                &bf.h,
                f,
                eps,
                scale,
                base,
                &hcp,
                head,
                n,
                &mut bf.flat,
                &mut bf.mixes,
                x,
                &mut bf.pc,
            )
        };
    let r = (|| -> Result<()> {
        match &m.mtp {
            Some(w) => mtp_input(b, m, w, s, &mut bf, step)?,
            None => {
                b.embed(step, &m.tok_embd, 1.0, &mut s.x)?;
                b.hc_expand(&s.x, &hcp, n, &mut bf.h)?;
            }
        }
        for (i, l) in w.layers.iter().enumerate() {
            // Attention.
            hc_in(b, &l.hc_attn, false, &mut bf, &mut s.x)?;
            dump.put(b, "hc_attn_pre", i, &s.x, n * d);
            b.rms_norm(&s.x, &l.attn_norm, eps, n, &mut s.xn)?;
            dump.put(b, "attn_norm", i, &s.xn, n * d);
            // The products of xn: q_a, kv, the compressor's kv and gate, the indexer's kv and
            // gate (a backend may share one copy of xn and run several in one launch).
            // (Arrays, not vectors: a step allocates nothing.)
            let (xn, qr, k) = (&s.xn, &mut bf.qr, &mut s.k);
            match (&l.comp, &l.ix) {
                (Some([ckv, cg, ..]), Some([_, _, ikv, ig, ..])) => b.matmul_many(
                    &[&l.wq_a, &l.wkv, ckv, cg, ikv, ig],
                    xn,
                    n,
                    &mut [qr, k, &mut bf.ckv, &mut bf.csc, &mut bf.ikv, &mut bf.isc],
                )?,
                (Some([ckv, cg, ..]), None) => b.matmul_many(
                    &[&l.wq_a, &l.wkv, ckv, cg],
                    xn,
                    n,
                    &mut [qr, k, &mut bf.ckv, &mut bf.csc],
                )?,
                (None, Some([_, _, ikv, ig, ..])) => b.matmul_many(
                    &[&l.wq_a, &l.wkv, ikv, ig],
                    xn,
                    n,
                    &mut [qr, k, &mut bf.ikv, &mut bf.isc],
                )?,
                (None, None) => b.matmul_many(&[&l.wq_a, &l.wkv], xn, n, &mut [qr, k])?,
            }
            dump.put(b, "qr", i, &bf.qr, n * ds.q_lora);
            b.rms_norm_inplace(&mut bf.qr, &l.q_a_norm, eps, n)?;
            dump.put(b, "qr_norm", i, &bf.qr, n * ds.q_lora);
            b.matmul(&l.wq_b, &bf.qr, n, &mut s.attn)?;
            b.rms_norm_plain(&s.attn, hp.head_dim, eps, n * hp.n_head, &mut s.q)?;
            b.rms_norm_inplace(&mut s.k, &l.kv_norm, eps, n)?;
            dump.put(b, "kv_norm", i, &s.k, n * hp.head_dim);
            if let Some([q_b, proj, _, _, _, _]) = &l.ix {
                b.matmul(q_b, &bf.qr, n, &mut bf.iq)?;
                b.matmul(proj, &s.xn, n, &mut bf.iw)?;
            }
            let shape = ds.shape(hp, i, bf.n_ctx);
            let has_c = l.comp.is_some();
            let has_i = l.ix.is_some();
            b.dsv4_attention(
                step,
                &shape,
                AttnWeights {
                    sinks: &l.sinks,
                    ape: l.comp.as_ref().map(|c| &c[2]),
                    norm: l.comp.as_ref().map(|c| &c[3]),
                    ix_ape: l.ix.as_ref().map(|c| &c[4]),
                    ix_norm: l.ix.as_ref().map(|c| &c[5]),
                },
                quiver_backend::dsv4::AttnInputs {
                    q: &s.q,
                    kv: &s.k,
                    comp_kv: has_c.then_some(&bf.ckv),
                    comp_score: has_c.then_some(&bf.csc),
                    ix_q: has_i.then_some(&bf.iq),
                    ix_w: has_i.then_some(&bf.iw),
                    ix_kv: has_i.then_some(&bf.ikv),
                    ix_score: has_i.then_some(&bf.isc),
                },
                &mut s.rs[i],
                s.snap.get_mut(i).map(|buf| quiver_backend::Snapshots {
                    buf,
                    planes: s.snap_planes,
                }),
                &mut bf.scratch,
                &mut s.attn,
            )?;
            b.matmul_grouped(&l.wo_a, &s.attn, n, &mut bf.oa, &mut bf.scratch)?;
            dump.put(b, "attn_derope", i, &s.attn, n * hp.n_head * hp.head_dim);
            b.matmul(&l.wo_b, &bf.oa, n, &mut s.o)?;
            dump.put(b, "attn_out", i, &s.o, n * d);
            b.hc_post(&s.o, &bf.h, &bf.pc, &hcp, n, &mut bf.h2)?;
            std::mem::swap(&mut bf.h, &mut bf.h2);
            dump.put(b, "hc_attn_post", i, &bf.h, n * hcd);
            // FFN.
            hc_in(b, &l.hc_ffn, false, &mut bf, &mut s.x)?;
            dump.put(b, "hc_ffn_pre", i, &s.x, n * d);
            b.rms_norm(&s.x, &l.ffn_norm, eps, n, &mut s.xn)?;
            let limit = |x: f32| if x > 1e-6 { x } else { 0.0 };
            let [lg, rt, xs, g, u, a, ys] = &mut s.moe[..] else {
                return Err(ModelError::BadHparam {
                    key: "deepseek4".into(),
                    detail: "MoE scratch".into(),
                });
            };
            b.moe_dsv4(
                step,
                &s.xn,
                MoeWeights {
                    router: &l.router,
                    gate: &l.gate_exps,
                    up: &l.up_exps,
                    down: &l.down_exps,
                    down_scale: None,
                    gate_scale: None,
                    up_scale: None,
                },
                &moe,
                l.bias.as_ref(),
                l.hash.as_ref(),
                limit(ds.clamp_exp[i]),
                MoeScratch {
                    logits: lg,
                    routes: rt,
                    xs,
                    gate: g,
                    up: u,
                    act: a,
                    ys,
                },
                &mut s.o,
            )?;
            dump.put(b, "ffn_moe_out", i, &s.o, n * d);
            let (gate, up, scratch) = (&l.sh_gate, &l.sh_up, [&mut s.gate, &mut s.up]);
            match limit(ds.clamp_shexp[i]) {
                0.0 => b.matmul_glu(Activation::SwiGlu, gate, up, &s.xn, n, scratch, &mut s.act)?,
                x => b.matmul_glu_clamp(x, gate, up, &s.xn, n, scratch, &mut s.act)?,
            }
            b.matmul(&l.sh_down, &s.act, n, &mut bf.sh)?;
            dump.put(b, "ffn_shexp", i, &bf.sh, n * d);
            b.add(&mut s.o, &bf.sh, n * d)?;
            b.hc_post(&s.o, &bf.h, &bf.pc, &hcp, n, &mut bf.h2)?;
            std::mem::swap(&mut bf.h, &mut bf.h2);
            dump.put(b, "l_last", i, &bf.h, n * hcd);
        }
        // The head: the streams mixed by their own weights, then the output norm.
        hc_in(b, &w.head, true, &mut bf, &mut s.x)?;
        b.rms_norm(&s.x, &m.output_norm, eps, n, &mut s.xn)?;
        let out = m.output.as_ref().unwrap_or(&m.tok_embd);
        b.matmul_logits(step, out, &s.xn, &mut s.logits)?;
        Ok(())
    })();
    s.ds = Some(bf);
    r
}

/// A multi-token-prediction block's input, as llama.cpp's `graph_mtp`: each of the target's hc
/// streams of the row's previous position (the head's g rows, `Model::head_input`) normed by
/// hnorm beside the row's token's embedding normed by enorm, projected by eh_proj: the
/// block's streams.
fn mtp_input<B: Backend>(
    b: &mut B,
    m: &crate::Model<B>,
    w: &crate::mtp::Mtp<B>,
    s: &mut State<B>,
    bf: &mut Bufs<B>,
    step: &Step<B::StepCtx>,
) -> Result<()> {
    let (n, hp) = (step.rows, &m.hp);
    let (d, eps) = (hp.n_embd, hp.rms_eps);
    let hcp = hp.dsv4.as_ref().expect("deepseek4 hparams").hc;
    let rows = n * hcp.hc;
    let ea = s.ea.as_mut().expect("a draft head's state");
    b.embed(step, &m.tok_embd, 1.0, &mut s.x)?;
    b.rms_norm(&s.x, &w.enorm, eps, n, &mut s.xn)?;
    b.hc_expand(&s.xn, &hcp, n, &mut bf.h2)?;
    b.rms_norm(&ea.g, &w.hnorm, eps, rows, &mut bf.flat)?;
    b.put_cols(&bf.h2, d, rows, &mut ea.cat, 2 * d, 0)?;
    b.put_cols(&bf.flat, d, rows, &mut ea.cat, 2 * d, d)?;
    b.matmul(&w.eh_proj, &ea.cat, rows, &mut bf.h)?;
    Ok(())
}
