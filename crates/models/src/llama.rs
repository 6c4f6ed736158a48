//! `llama`: Llama 2/3, SmolLM2, Mistral-style models; `mistral3` (Ministral 3 / Mistral Small
//! 3.x text models) is the same decoder. Rope on adjacent pairs, SwiGLU; q/k/v/o biases where
//! the file has them. Mistral 3's Llama-4-style attention temperature scaling is refused at load
//! until it is supported.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    if r.arch == "mistral3" {
        if let Some(t) = r.f32("attention.temperature_scale")? {
            if t != 0.0 {
                return Err(r.bad(
                    "attention.temperature_scale",
                    format!("{t}: attention temperature scaling is not supported yet"),
                ));
            }
        }
        if r.u("expert_count")?.unwrap_or(0) > 0 {
            return Err(r.bad(
                "expert_count",
                "Mistral 3 mixture-of-experts files are not supported yet",
            ));
        }
    }
    r.base(RopeMode::Normal, Activation::SwiGlu)
}
