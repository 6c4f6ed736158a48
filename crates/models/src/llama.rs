//! `llama`: Llama 2/3, SmolLM2, Mistral-style models. Rope on adjacent pairs, SwiGLU.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    Reader::new(f)?.base(RopeMode::Normal, Activation::SwiGlu)
}
