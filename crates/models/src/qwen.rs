//! `qwen2` (Qwen 2 / 2.5: q/k/v biases), `qwen3` (per-head q/k RMSNorm, head dim from
//! `attention.key_length`) and `qwen3moe` (Qwen3's attention, every FFN a mixture of experts:
//! softmax router, top-k weights divided by their sum). Rope on split halves, SwiGLU. The
//! biases load wherever the file has them (the decoder's optional tensors).

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, Gating, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::SwiGlu)?;
    hp.rms_eps = r.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    match hp.arch.as_str() {
        "qwen3" => {
            hp.qk_norm = true;
            hp.ffn_weight_scales = true;
        }
        "qwen3moe" => {
            hp.qk_norm = true;
            hp.ffn_weight_scales = true;
            hp.moe = Some(r.moe(hp.n_ff, Gating::Softmax, true, Activation::SwiGlu)?);
        }
        _ => {}
    }
    Ok(hp)
}
