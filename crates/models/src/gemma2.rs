//! `gemma2`: alternating sliding-window (even layers) and global layers, attention and final
//! logit soft-capping (50 and 30 unless the file says), norms after attention and after the
//! FFN, GeGLU, embeddings scaled by √n_embd, q scaled before attention (by 1/√(n_embd/n_head)
//! for the 27B shape, as the reference implementation does, else 1/√head_dim).

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

const SWA_PERIOD: usize = 2;
const DEFAULT_WINDOW: u32 = 4096;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::GeGlu)?;
    hp.rms_eps = r.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    hp.embed_scale = (hp.n_embd as f32).sqrt();
    hp.scale_q = true;
    hp.post_norms = true;
    if hp.n_layer == 46 {
        hp.attn_scale = 1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt();
    }
    hp.sliding_window = Some(
        r.u("attention.sliding_window")?
            .map(|w| w as u32)
            .unwrap_or(DEFAULT_WINDOW),
    );
    hp.swa_layers = r.swa_layers(hp.n_layer, SWA_PERIOD)?;
    if let Some(base) = r.f32("rope.freq_base_swa")? {
        let mut local = hp.rope.clone();
        local.base = base;
        hp.rope_local = Some(local);
    }
    hp.attn_softcap = Some(r.f32("attn_logit_softcapping")?.unwrap_or(50.0));
    hp.final_softcap = Some(r.f32("final_logit_softcapping")?.unwrap_or(30.0));
    Ok(hp)
}
