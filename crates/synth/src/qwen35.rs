//! Qwen 3.5 (`qwen35`, `qwen35moe`): gated-delta-net layers with a full-attention layer every
//! `full_attn_interval`-th, as llama.cpp's loader names and shapes their tensors.

use crate::mix::{FileType, Role};
use crate::{Planned, Preset, BASE, TINY};
use quiver_gguf::{GgufWriter, Value};

const CONV_KERNEL: u64 = 4;

/// Qwen 3.5 0.8B (its smallest; [`PRESETS`] has it with its multi-token-prediction
/// block), from memory of its Hugging Face config (not checked against a file): llama.cpp
/// confirms 24 layers of 1024 (its 0.8B type); 8 query heads of 256 over 2 KV heads, a quarter
/// of each rotated, a full-attention layer every fourth, 16 key and 16 value heads of 128 in
/// the delta net, an FFN of 3584, the vocabulary of 248320 and the rope base of 10⁷ are as
/// remembered.
pub(crate) const QWEN35_0_8B: Preset = Preset {
    name: "qwen3.5-0.8b",
    arch: "qwen35",
    n_vocab: 248320,
    n_embd: 1024,
    n_layer: 24,
    n_head: 8,
    n_head_kv: 2,
    n_ff: 3584,
    n_ctx: 262144,
    rope_base: 10_000_000.0,
    head_dim: 256,
    n_rot: 64,
    ssm_heads: (16, 16, 128),
    full_attn_interval: 4,
    tied: true,
    rms_eps: 1e-6,
    ..BASE
};

/// Three delta-net layers (more value heads than key heads) and one full-attention layer
/// (q gate, half the head rotated); [`PRESETS`] has it with a multi-token-prediction block.
pub(crate) const TINY_QWEN35: Preset = Preset {
    name: "tiny-qwen35",
    arch: "qwen35",
    head_dim: 64,
    n_rot: 32,
    ssm_heads: (2, 4, 32),
    full_attn_interval: 4,
    ..TINY
};

/// [`TINY_QWEN35`] with experts beside a shared expert (and, in [`PRESETS`], with a
/// multi-token-prediction block).
pub(crate) const TINY_QWEN35MOE: Preset = Preset {
    name: "tiny-qwen35moe",
    arch: "qwen35moe",
    head_dim: 64,
    n_rot: 32,
    ssm_heads: (2, 4, 32),
    full_attn_interval: 2,
    n_expert: 8,
    n_expert_used: 2,
    n_ff_exp: 128,
    n_ff_shexp: 192,
    ..TINY
};

/// Qwen 3.5 models with a multi-token-prediction block (`--spec-type mtp`): Qwen3.5-0.8B's
/// shape (`qwen3.5-0.8b` with its block) and the tiny parity models.
pub(crate) const PRESETS: &[Preset] = &[
    Preset {
        name: "qwen3.5-0.8b-mtp",
        nextn: 1,
        ..QWEN35_0_8B
    },
    // tiny-qwen35 with a multi-token-prediction block (`--spec-type mtp`).
    Preset {
        name: "tiny-qwen35-mtp",
        nextn: 1,
        ..TINY_QWEN35
    },
    Preset {
        name: "tiny-qwen35moe-mtp",
        nextn: 1,
        ..TINY_QWEN35MOE
    },
];

fn recurrent(p: &Preset, i: u64) -> bool {
    i < p.n_layer && !(i + 1).is_multiple_of(p.full_attn_interval.max(1))
}

pub(crate) fn plan(p: &Preset) -> Vec<Planned> {
    let t = |name: String, role, shape: &[u64]| Planned {
        name,
        role,
        shape: shape.to_vec(),
    };
    let (d, hd) = (p.n_embd, p.head_dim);
    let (qd, kvd) = (p.n_head * hd, p.n_head_kv * hd);
    let (nk, nv, hs) = p.ssm_heads;
    let (kd, vd) = (nk * hs, nv * hs);
    let c = 2 * kd + vd;
    let mut v = vec![t(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        &[p.n_vocab, d],
    )];
    for i in 0..p.n_layer + p.nextn {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        if i >= p.n_layer {
            v.extend(crate::mtp_input(i, d));
        }
        v.push(t(b("attn_norm"), Role::Vector, &[d]));
        if recurrent(p, i) {
            v.push(t(b("attn_qkv"), Role::AttnQkv, &[c, d]));
            v.push(t(b("attn_gate"), Role::AttnQ, &[vd, d]));
            // Small or convolution tensors stay F32 (a row of 4 taps has no block size).
            v.push(t(b("ssm_conv1d"), Role::Router, &[c, CONV_KERNEL]));
            v.push(t(format!("blk.{i}.ssm_dt.bias"), Role::Vector, &[nv]));
            v.push(t(format!("blk.{i}.ssm_a"), Role::Vector, &[nv]));
            v.push(t(b("ssm_alpha"), Role::Router, &[nv, d]));
            v.push(t(b("ssm_beta"), Role::Router, &[nv, d]));
            v.push(t(b("ssm_norm"), Role::Vector, &[hs]));
            v.push(t(b("ssm_out"), Role::AttnOutput, &[d, vd]));
        } else {
            v.push(t(b("attn_q"), Role::AttnQ, &[2 * qd, d]));
            v.push(t(b("attn_k"), Role::AttnK, &[kvd, d]));
            v.push(t(b("attn_v"), Role::AttnV, &[kvd, d]));
            v.push(t(b("attn_q_norm"), Role::Vector, &[hd]));
            v.push(t(b("attn_k_norm"), Role::Vector, &[hd]));
            v.push(t(b("attn_output"), Role::AttnOutput, &[d, qd]));
        }
        v.push(t(b("post_attention_norm"), Role::Vector, &[d]));
        if p.n_expert > 0 {
            let (ne, fe, sf) = (p.n_expert, p.n_ff_exp, p.n_ff_shexp);
            v.push(t(b("ffn_gate_inp"), Role::Router, &[ne, d]));
            v.push(t(b("ffn_gate_exps"), Role::FfnGate, &[ne, fe, d]));
            v.push(t(b("ffn_up_exps"), Role::FfnUp, &[ne, fe, d]));
            v.push(t(b("ffn_down_exps"), Role::FfnDown, &[ne, d, fe]));
            if sf > 0 {
                v.push(t(b("ffn_gate_inp_shexp"), Role::Router, &[d]));
                v.push(t(b("ffn_gate_shexp"), Role::FfnGate, &[sf, d]));
                v.push(t(b("ffn_up_shexp"), Role::FfnUp, &[sf, d]));
                v.push(t(b("ffn_down_shexp"), Role::FfnDown, &[d, sf]));
            }
        } else {
            v.push(t(b("ffn_gate"), Role::FfnGate, &[p.n_ff, d]));
            v.push(t(b("ffn_up"), Role::FfnUp, &[p.n_ff, d]));
            v.push(t(b("ffn_down"), Role::FfnDown, &[d, p.n_ff]));
        }
    }
    v.push(t("output_norm.weight".into(), Role::Vector, &[d]));
    if !p.tied {
        v.push(t("output.weight".into(), Role::Output, &[p.n_vocab, d]));
    }
    v
}

pub(crate) fn metadata(w: &mut GgufWriter, p: &Preset, ft: FileType) {
    crate::metadata_common(w, p, ft);
    let k = |s: &str| format!("{}.{s}", p.arch);
    let (nk, nv, hs) = p.ssm_heads;
    w.set(k("feed_forward_length"), Value::U32(p.n_ff as u32));
    w.set(k("attention.head_count_kv"), Value::U32(p.n_head_kv as u32));
    w.set(k("attention.key_length"), Value::U32(p.head_dim as u32));
    w.set(k("attention.value_length"), Value::U32(p.head_dim as u32));
    let n_rot = if p.n_rot > 0 { p.n_rot } else { p.head_dim };
    w.set(k("rope.dimension_count"), Value::U32(n_rot as u32));
    // The interleaved M-RoPE's t, h, w sections over the rotated pairs, as the models have
    // them ([11, 11, 10] of 32 pairs).
    let pairs = (n_rot / 2) as u32;
    let t = pairs.div_ceil(3);
    let h = (pairs - t).div_ceil(2);
    let sections = [t, h, pairs - t - h, 0];
    w.set(
        k("rope.dimension_sections"),
        Value::Array(quiver_gguf::Array::U32(sections.to_vec())),
    );
    w.set(
        k("full_attention_interval"),
        Value::U32(p.full_attn_interval as u32),
    );
    if p.nextn > 0 {
        w.set(k("block_count"), Value::U32((p.n_layer + p.nextn) as u32));
        w.set(k("nextn_predict_layers"), Value::U32(p.nextn as u32));
    }
    w.set(k("ssm.conv_kernel"), Value::U32(CONV_KERNEL as u32));
    w.set(k("ssm.state_size"), Value::U32(hs as u32));
    w.set(k("ssm.group_count"), Value::U32(nk as u32));
    w.set(k("ssm.time_step_rank"), Value::U32(nv as u32));
    w.set(k("ssm.inner_size"), Value::U32((nv * hs) as u32));
    if p.n_expert > 0 {
        w.set(k("expert_count"), Value::U32(p.n_expert as u32));
        w.set(k("expert_used_count"), Value::U32(p.n_expert_used as u32));
        w.set(
            k("expert_feed_forward_length"),
            Value::U32(p.n_ff_exp as u32),
        );
        if p.n_ff_shexp > 0 {
            w.set(
                k("expert_shared_feed_forward_length"),
                Value::U32(p.n_ff_shexp as u32),
            );
        }
    }
}

/// `ssm_a` (−exp(A_log)): decays of −0.5 to −2 over the heads; the gate's bias
/// (`ssm_dt.bias`) −1 to 1.
pub(crate) fn fixed_values(p: &Preset, name: &str) -> Option<Vec<f32>> {
    if p.ssm_heads.0 == 0 {
        return None;
    }
    let nv = p.ssm_heads.1 as usize;
    if name.ends_with(".ssm_a") {
        return Some((0..nv).map(|h| -0.5 - 1.5 * (h % 4) as f32 / 3.0).collect());
    }
    if name.ends_with(".ssm_dt.bias") {
        return Some((0..nv).map(|h| -1.0 + 2.0 * (h % 5) as f32 / 4.0).collect());
    }
    None
}
