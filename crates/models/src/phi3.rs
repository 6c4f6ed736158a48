//! `phi3`: Phi-3 / Phi-3.5 / Phi-4 dense models. Fused QKV (`attn_qkv`), gate and up fused in
//! `ffn_up` (the gate's rows first), rope on split halves, q scaled before attention. The
//! files' sliding window is ignored, as llama.cpp ignores it. LongRoPE (the 128k variants and
//! Phi-3.5/Phi-4-mini): `rope_factors_short` up to the original context, `rope_factors_long`
//! past it (`Model::for_context`), and `rope.scaling.attn_factor` on the rotation.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::SwiGlu)?;
    hp.fused_gate_up = true;
    hp.scale_q = true;
    let pairs = hp.rope.n_dims / 2;
    if let Some(short) = r.factors("rope_factors_short.weight", pairs)? {
        hp.rope.freq_factors = Some(short);
    }
    hp.rope_long = r.factors("rope_factors_long.weight", pairs)?;
    Ok(hp)
}
