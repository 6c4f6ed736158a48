//! `gemma3`: interleaved sliding-window layers (five local, one global, unless the file's
//! pattern says), head dim 256, QK norm, GeGLU, norms after attention and after the FFN,
//! embeddings scaled by √n_embd, rope on split halves with a local base of 10 000 unless
//! `rope.freq_base_swa` says. No attention soft-capping; final soft-capping only where the
//! file gives a non-zero cap. q scaled by 1/√(n_embd/n_head) for the 27B shape (62 layers),
//! else 1/√head_dim. As llama.cpp's `gemma3` loader reads them.

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
    if hp.n_layer == 62 {
        hp.attn_scale = 1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt();
    }
    hp.sliding_window = r
        .u("attention.sliding_window")?
        .filter(|&w| w > 0)
        .map(|w| w as u32);
    let mut local = hp.rope.clone();
    local.base = LOCAL_ROPE_BASE;
    if hp.sliding_window.is_some() {
        hp.swa_layers = r.swa_layers(hp.n_layer, SWA_PATTERN)?;
        if let Some(base) = r.f32("rope.freq_base_swa")? {
            local.base = base;
        }
    }
    // Scaling (for long-context variants) applies to the global layers only.
    local.freq_scale = 1.0;
    local.llama3 = None;
    hp.rope_local = Some(local);
    hp.final_softcap = r.f32("final_logit_softcapping")?.filter(|&c| c != 0.0);
    Ok(hp)
}
