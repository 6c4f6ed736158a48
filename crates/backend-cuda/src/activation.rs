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
