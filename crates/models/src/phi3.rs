//! `phi3`: Phi-3 / Phi-3.5 / Phi-4 dense models. Fused QKV (`attn_qkv`), gate and up fused in
//! `ffn_up` (the gate's rows first), rope on split halves, q scaled before attention. The
//! files' sliding window is ignored, as llama.cpp ignores it. LongRoPE (the 128k variants'
//! `rope_factors_long/short`) is not supported yet: such a file is refused at load.

use crate::hparams::{Hparams, Reader};
use crate::Result;
use quiver_backend::{Activation, RopeMode};
use quiver_gguf::GgufFile;

pub fn hparams(f: &GgufFile) -> Result<Hparams> {
    let r = Reader::new(f)?;
    let mut hp = r.base(RopeMode::Neox, Activation::SwiGlu)?;
    hp.fused_gate_up = true;
    hp.scale_q = true;
    if f.tensor("rope_factors_long.weight").is_some()
        || f.tensor("rope_factors_short.weight").is_some()
    {
        return Err(r.bad(
            "rope.scaling.type",
            "LongRoPE (rope_factors_long/short) is not supported yet",
        ));
    }
    Ok(hp)
}
