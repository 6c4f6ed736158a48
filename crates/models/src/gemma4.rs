//! `gemma4`: sliding-window and global layers as an explicit per-layer pattern, each kind with
//! its own head dim (`key_length_swa` / `key_length`), KV heads, rope base and rotated dims
//! (the global layers' "proportional" rope is `rope_freqs.weight` holding 1e30 for the
//! unrotated pairs); q, k and v norms (v without weight); attention scale 1; norms after
//! attention and after the FFN; GeGLU; embeddings scaled by √n_embd; final logits
//! soft-capped (30 unless the file says). Optional: the last `shared_kv_layers` layers attend
//! over an earlier layer's cache and write none; global layers without `attn_v` use k's
//! product as v; per-layer embeddings (PLE); a scalar per layer on its output; experts
//! beside a dense MLP (26B-A4B) with a router over its own input and per-expert scales.
//! As llama.cpp's `gemma4` reads them (`src/models/gemma4.cpp`).

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, Gating, MoeParams, RopeMode};
use quiver_gguf::GgufFile;

/// llama.cpp's defaults where the file is silent.
const DEFAULT_SWA_BASE: f32 = 10000.0;
const DEFAULT_FINAL_SOFTCAP: f32 = 30.0;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::GeGlu)?;
    let n = hp.n_layer;
    hp.rms_eps = r
        .f32("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| r.bad("attention.layer_norm_rms_epsilon", "missing"))?;
    hp.embed_scale = (hp.n_embd as f32).sqrt();
    hp.qk_norm = true;
    hp.v_norm = true;
    hp.post_norms = true;
    hp.attn_scale = 1.0;
    hp.scale_q = false;
    hp.sliding_window = Some(r.req("attention.sliding_window")? as u32);
    if !matches!(
        f.get(&format!("{}.attention.sliding_window_pattern", r.arch)),
        Some(quiver_gguf::Value::Array(_))
    ) {
        return Err(r.bad(
            "attention.sliding_window_pattern",
            "missing (an array of one boolean per layer)",
        ));
    }
    hp.swa_layers = r.swa_layers(n, 0)?;
    // Head dims: key_length for the global layers (`base` read it), key_length_swa for the
    // sliding ones; values as wide as keys.
    let hd_full = hp.head_dim;
    let hd_swa = r.req("attention.key_length_swa")?;
    for (k, want) in [
        ("attention.value_length", hd_full),
        ("attention.value_length_swa", hd_swa),
    ] {
        match r.u(k)? {
            Some(v) if v != want => {
                return Err(r.bad(
                    k,
                    format!("{v}: gemma4 needs values as wide as keys ({want})"),
                ))
            }
            _ => {}
        }
    }
    // Rope: global layers as `base` read it (freq_base, dimension_count, rope_freqs.weight);
    // sliding layers their own base and dims, no frequency factors.
    let mut local = hp.rope.clone();
    local.base = r.f32("rope.freq_base_swa")?.unwrap_or(DEFAULT_SWA_BASE);
    local.n_dims = r.u("rope.dimension_count_swa")?.unwrap_or(hp.rope.n_dims);
    local.freq_scale = 1.0;
    local.llama3 = None;
    local.freq_factors = None;
    if local.n_dims > hd_swa || local.n_dims % 2 != 0 {
        return Err(r.bad(
            "rope.dimension_count_swa",
            format!("{} for sliding-window heads of {hd_swa}", local.n_dims),
        ));
    }
    if let Some(ff) = &hp.rope.freq_factors {
        if ff.len() != hd_full / 2 {
            return Err(crate::ModelError::WrongShape {
                name: "rope_freqs.weight".into(),
                got: vec![ff.len() as u64],
                expected: vec![hd_full as u64 / 2],
            });
        }
    }
    hp.rope_local = Some(local);
    // Shared KV: layer i ≥ n - shared reads the cache of the last sliding (or global) layer
    // before them, as llama.cpp's KV cache maps them (the two layers before must be one
    // sliding, one global).
    let shared = r.u("attention.shared_kv_layers")?.unwrap_or(0);
    if shared > 0 {
        let first = n.checked_sub(shared).filter(|&s| s >= 2).ok_or_else(|| {
            r.bad(
                "attention.shared_kv_layers",
                format!("{shared} of {n} layers leaves fewer than two with a cache"),
            )
        })?;
        if !hp.swa_layers[first - 2] || hp.swa_layers[first - 1] {
            return Err(r.bad(
                "attention.shared_kv_layers",
                format!(
                    "layers {} and {} (the caches the shared layers read) must be one \
                     sliding-window, one global",
                    first - 2,
                    first - 1
                ),
            ));
        }
        for i in first..n {
            hp.layers[i].kv_from = first - if hp.swa_layers[i] { 2 } else { 1 };
        }
    }
    for (i, l) in hp.layers.iter_mut().enumerate() {
        l.head_dim = if hp.swa_layers[i] { hd_swa } else { hd_full };
    }
    for i in 0..n {
        let from = hp.layers[i].kv_from;
        if hp.layers[from].kv_dim() != hp.layers[i].kv_dim() {
            return Err(r.bad(
                "attention.shared_kv_layers",
                format!("layer {i} reads layer {from}'s cache, of another shape"),
            ));
        }
    }
    hp.head_dim = hd_full.max(hd_swa);
    hp.final_softcap = match r.f32("final_logit_softcapping")? {
        Some(0.0) => None,
        Some(c) => Some(c),
        None => Some(DEFAULT_FINAL_SOFTCAP),
    };
    hp.n_embd_per_layer = r
        .u("embedding_length_per_layer_input")?
        .ok_or_else(|| r.bad("embedding_length_per_layer_input", "missing"))?;
    if r.u("expert_count")?.unwrap_or(0) > 0 {
        let mut m: MoeParams = r.moe(hp.n_ff, Gating::Softmax, true, Activation::GeGlu)?;
        // llama.cpp passes a weight scale of 1 for gemma4, whatever the file says.
        m.scale = 1.0;
        m.router_given = true;
        hp.moe = Some(m);
    }
    Ok(hp)
}
