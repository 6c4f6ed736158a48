//! Gated activations (ops.cu `glu`: SwiGLU, GeGLU) and soft-capping. The fast path only: the
//! parity mode's glu is in src/exact.rs.

use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::products::act_code;
use crate::CudaBackend;
use quiver_backend::{Activation, Result};

impl CudaBackend {
    /// out = act(gate) · up over `n` elements at device addresses (shapes checked by the
    /// caller).
    pub(crate) fn glu_fast(
        &self,
        act: Activation,
        gate: u64,
        up: u64,
        n: usize,
        out: u64,
    ) -> Result<()> {
        self.glu_code(act_code(act), gate, up, n, out)
    }

    /// The glu kernel by its act code (common.cuh `glu_fn`: a clamped SwiGLU's limit too).
    pub(crate) fn glu_code(&self, act: i32, gate: u64, up: u64, n: usize, out: u64) -> Result<()> {
        self.launch(
            "ops",
            "glu",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![gate, up, out, n as i64, act],
        )
    }

    /// x = cap · tanh(x / cap) over `n` elements (shapes checked by the caller; the parity
    /// mode runs it too).
    pub(crate) fn softcap_kernel(&self, x: &mut CudaBuf, cap: f32, n: usize) -> Result<()> {
        self.launch(
            "ops",
            "softcap",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![x.ptr(), n as i64, cap],
        )
    }
}

/// common.cuh `glu_fn`'s act code of the clamped SwiGLU: the limit's f32 bits (a positive
/// normal float, whose bits exceed the plain activations' codes 0 and 1).
pub(crate) fn clamp_code(limit: f32) -> Result<i32> {
    crate::check("swiglu_clamp", limit.is_normal() && limit > 0.0, || {
        format!("SwiGLU limit {limit}")
    })?;
    Ok(limit.to_bits() as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limit's code lies past the plain activations' codes (glu_fn tells them apart by it);
    /// no limit that is not a positive normal float has one.
    #[test]
    fn a_clamp_limit_codes_past_the_plain_activations() {
        for limit in [f32::MIN_POSITIVE, 1e-6, 7.0, 1e30] {
            let c = clamp_code(limit).unwrap();
            assert!(c > act_code(Activation::GeGlu), "{limit}");
            assert_eq!(f32::from_bits(c as u32), limit);
        }
        for limit in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-40] {
            assert!(clamp_code(limit).is_err(), "{limit}");
        }
    }
}
