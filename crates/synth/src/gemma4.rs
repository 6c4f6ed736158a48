//! The `gemma4` presets' tensors and keys, as llama.cpp's `gemma4` loader reads them
//! (`src/models/gemma4.cpp`) and its converter writes them (`conversion/gemma.py`).

use crate::{metadata_common, FileType, Planned, Preset, Role};
use quiver_gguf::{Array, GgufWriter, Value};

/// The share of the global layers' rotated dims ("proportional" rope, partial factor 0.25).
const GLOBAL_ROPE_FRACTION: f64 = 0.25;
const SWA_ROPE_BASE: f32 = 10000.0;
const FINAL_SOFTCAP: f32 = 30.0;

/// Whether layer `i` uses the sliding window: all but every `swa_period`-th.
fn is_swa(p: &Preset, i: u64) -> bool {
    p.swa_period == 0 || i % p.swa_period != p.swa_period - 1
}

/// (head dim, KV heads, FFN width, has its own KV) of layer `i`.
fn layer(p: &Preset, i: u64) -> (u64, u64, u64, bool) {
    let swa = is_swa(p, i);
    let hd = if swa { p.head_dim_swa } else { p.head_dim };
    let kv = match (swa, p.n_head_kv_global) {
        (false, g) if g > 0 => g,
        _ => p.n_head_kv,
    };
    let own = i < p.n_layer - p.n_kv_shared;
    let ff = if !own && p.double_wide_shared {
        2 * p.n_ff
    } else {
        p.n_ff
    };
    (hd, kv, ff, own)
}

pub(crate) fn plan(p: &Preset) -> Vec<Planned> {
    let t = |name: String, role, shape: &[u64]| Planned {
        name,
        role,
        shape: shape.to_vec(),
    };
    let d = p.n_embd;
    let ple = p.n_embd_per_layer;
    let mut v = vec![t(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        &[p.n_vocab, d],
    )];
    if ple > 0 {
        let all = p.n_layer * ple;
        v.push(t(
            "per_layer_token_embd.weight".into(),
            Role::FfnUp,
            &[p.n_vocab, all],
        ));
        v.push(t(
            "per_layer_model_proj.weight".into(),
            Role::FfnUp,
            &[all, d],
        ));
        v.push(t("per_layer_proj_norm.weight".into(), Role::Vector, &[ple]));
    }
    v.push(t(
        "rope_freqs.weight".into(),
        Role::Vector,
        &[p.head_dim / 2],
    ));
    for i in 0..p.n_layer {
        let (hd, nkv, ff, own) = layer(p, i);
        let (qd, kvd) = (p.n_head * hd, nkv * hd);
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(t(b("attn_norm"), Role::Vector, &[d]));
        v.push(t(b("attn_q"), Role::AttnQ, &[qd, d]));
        if own {
            v.push(t(b("attn_k"), Role::AttnK, &[kvd, d]));
            if !p.k_eq_v || is_swa(p, i) {
                v.push(t(b("attn_v"), Role::AttnV, &[kvd, d]));
            }
        }
        v.push(t(b("attn_q_norm"), Role::Vector, &[hd]));
        if own {
            v.push(t(b("attn_k_norm"), Role::Vector, &[hd]));
        }
        v.push(t(b("attn_output"), Role::AttnOutput, &[d, qd]));
        v.push(t(b("post_attention_norm"), Role::Vector, &[d]));
        v.push(t(b("ffn_norm"), Role::Vector, &[d]));
        v.push(t(b("ffn_gate"), Role::FfnGate, &[ff, d]));
        v.push(t(b("ffn_up"), Role::FfnUp, &[ff, d]));
        v.push(t(b("ffn_down"), Role::FfnDown, &[d, ff]));
        v.push(t(b("post_ffw_norm"), Role::Vector, &[d]));
        if p.n_expert > 0 {
            let (ne, fe) = (p.n_expert, p.n_ff_exp);
            v.push(t(b("ffn_gate_inp"), Role::Router, &[ne, d]));
            v.push(t(format!("blk.{i}.ffn_gate_inp.scale"), Role::Vector, &[d]));
            v.push(t(b("pre_ffw_norm_2"), Role::Vector, &[d]));
            v.push(t(b("post_ffw_norm_1"), Role::Vector, &[d]));
            v.push(t(b("post_ffw_norm_2"), Role::Vector, &[d]));
            v.push(t(b("ffn_gate_exps"), Role::FfnGate, &[ne, fe, d]));
            v.push(t(b("ffn_up_exps"), Role::FfnUp, &[ne, fe, d]));
            v.push(t(b("ffn_down_exps"), Role::FfnDown, &[ne, d, fe]));
            v.push(t(
                format!("blk.{i}.ffn_down_exps.scale"),
                Role::Vector,
                &[ne],
            ));
        }
        if ple > 0 {
            v.push(t(b("inp_gate"), Role::FfnGate, &[ple, d]));
            v.push(t(b("proj"), Role::FfnUp, &[d, ple]));
            v.push(t(b("post_norm"), Role::Vector, &[d]));
        }
        v.push(t(b("layer_output_scale"), Role::Vector, &[1]));
    }
    v.push(t("output_norm.weight".into(), Role::Vector, &[p.n_embd]));
    if !p.tied {
        v.push(t("output.weight".into(), Role::Output, &[p.n_vocab, d]));
    }
    v
}

pub(crate) fn metadata(w: &mut GgufWriter, p: &Preset, ft: FileType) {
    metadata_common(w, p, ft);
    let k = |s: &str| format!("gemma4.{s}");
    let layers: Vec<_> = (0..p.n_layer).map(|i| layer(p, i)).collect();
    let per_layer = |f: fn(&(u64, u64, u64, bool)) -> u64| {
        let v: Vec<u32> = layers.iter().map(|l| f(l) as u32).collect();
        if v.iter().all(|&x| x == v[0]) {
            Value::U32(v[0])
        } else {
            Value::Array(Array::U32(v))
        }
    };
    w.set(k("feed_forward_length"), per_layer(|l| l.2));
    w.set(k("attention.head_count_kv"), per_layer(|l| l.1));
    w.set(k("attention.key_length"), Value::U32(p.head_dim as u32));
    w.set(k("attention.value_length"), Value::U32(p.head_dim as u32));
    w.set(
        k("attention.key_length_swa"),
        Value::U32(p.head_dim_swa as u32),
    );
    w.set(
        k("attention.value_length_swa"),
        Value::U32(p.head_dim_swa as u32),
    );
    w.set(k("rope.dimension_count"), Value::U32(p.head_dim as u32));
    w.set(
        k("rope.dimension_count_swa"),
        Value::U32(p.head_dim_swa as u32),
    );
    w.set(k("rope.freq_base_swa"), Value::F32(SWA_ROPE_BASE));
    w.set(
        k("attention.sliding_window"),
        Value::U32(p.sliding_window as u32),
    );
    w.set(
        k("attention.sliding_window_pattern"),
        Value::Array(Array::Bool((0..p.n_layer).map(|i| is_swa(p, i)).collect())),
    );
    w.set(
        k("attention.shared_kv_layers"),
        Value::U32(p.n_kv_shared as u32),
    );
    w.set(
        k("embedding_length_per_layer_input"),
        Value::U32(p.n_embd_per_layer as u32),
    );
    w.set(k("final_logit_softcapping"), Value::F32(FINAL_SOFTCAP));
    if p.n_expert > 0 {
        w.set(k("expert_count"), Value::U32(p.n_expert as u32));
        w.set(k("expert_used_count"), Value::U32(p.n_expert_used as u32));
        w.set(
            k("expert_feed_forward_length"),
            Value::U32(p.n_ff_exp as u32),
        );
    }
}

/// Tensors whose values are not random: the global layers' rope frequency factors (1 for the
/// rotated pairs, 1e30 for the others, as the converter writes them).
pub(crate) fn fixed_values(p: &Preset, name: &str) -> Option<Vec<f32>> {
    if p.arch != "gemma4" || name != "rope_freqs.weight" {
        return None;
    }
    let pairs = (p.head_dim / 2) as usize;
    let rotated = (p.head_dim as f64 * GLOBAL_ROPE_FRACTION / 2.0) as usize;
    Some(
        (0..pairs)
            .map(|i| if i < rotated { 1.0 } else { 1e30 })
            .collect(),
    )
}
