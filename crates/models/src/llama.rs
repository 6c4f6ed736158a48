//! `llama`: Llama 2/3, SmolLM2, Mistral-style models; `mistral3` (Ministral 3 / Mistral Small
//! 3.x text models) is the same decoder. Rope on adjacent pairs, SwiGLU; q/k/v/o biases where
//! the file has them. Mistral 3 adds YaRN (`hparams`) and Llama-4-style attention temperature
//! (q scaled by ln(⌊pos / n_ctx_orig⌋ + 1)·t + 1 after the rope). Either may be a mixture
//! of experts (`expert_count` > 0, every layer): as llama.cpp's `llama` and `mistral3`.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, Gating, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Normal, Activation::SwiGlu)?;
    hp.ffn_weight_scales = true;
    if r.u("expert_count")?.unwrap_or(0) > 0 {
        // Mixtral-style experts: softmax router, the top-k weights divided by their sum,
        // unscaled; each expert as wide as `feed_forward_length` (llama.cpp's llama and
        // mistral3 read no `expert_feed_forward_length`).
        let mut m = r.moe(hp.n_ff, Gating::Softmax, true, Activation::SwiGlu)?;
        m.n_ff = hp.n_ff;
        hp.moe = Some(m);
    }
    if r.arch == "mistral3" {
        if let Some(t) = r.f32("attention.temperature_scale")?.filter(|&t| t != 0.0) {
            // Llama-4-style temperature over the rope's original context (llama.cpp's
            // n_ctx_orig_yarn).
            let floor = r
                .u("rope.scaling.original_context_length")?
                .or(r.u("context_length")?)
                .unwrap_or(0);
            if floor == 0 {
                return Err(r.bad(
                    "rope.scaling.original_context_length",
                    "attention temperature scaling needs the original context",
                ));
            }
            hp.rope.q_temp = Some((t, floor as f32));
        }
    }
    Ok(hp)
}
