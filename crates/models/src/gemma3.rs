//! `gemma3`: interleaved sliding-window layers (five local, one global), head dim 256, QK norm,
//! GeGLU, norms after attention and after the FFN, embeddings scaled by √n_embd, rope on split
//! halves with a local base of 10 000.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

/// Every sixth layer attends globally.
const SWA_PATTERN: usize = 6;
const LOCAL_ROPE_BASE: f32 = 10000.0;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::GeGlu)?;
    hp.rms_eps = r.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    hp.embed_scale = (hp.n_embd as f32).sqrt();
    hp.qk_norm = true;
    // llama.cpp scales Gemma's q before attention (then q meets the f16 cache scaled).
    hp.scale_q = true;
    hp.post_norms = true;
    hp.sliding_window = r.u("attention.sliding_window")?.map(|w| w as u32);
    if hp.sliding_window.is_some() {
        hp.swa_layers = r.swa_layers(hp.n_layer, SWA_PATTERN)?;
    }
    let mut local = hp.rope.clone();
    local.base = LOCAL_ROPE_BASE;
    // Scaling (for long-context variants) applies to the global layers only.
    local.freq_scale = 1.0;
    local.llama3 = None;
    hp.rope_local = Some(local);
    hp.final_softcap = r.f32("final_logit_softcapping")?;
    hp.attn_softcap = r.f32("attn_logit_softcapping")?;
    Ok(hp)
}
