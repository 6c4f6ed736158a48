//! RMSNorm, with the residual add fused (ops.cu `rms_norm`), and the plain residual add
//! (`add`). The parity mode's norm is in src/exact.rs.

use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::Result;

/// One norm: `out = rms_norm(x) · w` over `rows` rows of `w.cols`, or with `residual`:
/// `residual += x` first and the norm is taken of the sum; with `gate`: out = silu(gate) · the
/// norm. `out` may be `x`. Pointers with the lengths of their buffers.
pub(crate) struct Norm<'a> {
    pub(crate) residual: Option<(u64, usize)>,
    pub(crate) x: (u64, usize),
    pub(crate) w: &'a CudaWeight,
    pub(crate) eps: f32,
    pub(crate) rows: usize,
    pub(crate) out: (u64, usize),
    pub(crate) gate: Option<(u64, usize)>,
}

impl<'a> Norm<'a> {
    /// `rms_norm`'s: `out = rms_norm(x) · w` (`out` may be `x`: `rms_norm_inplace`).
    pub(crate) fn of(x: &CudaBuf, w: &'a CudaWeight, eps: f32, rows: usize, out: &CudaBuf) -> Self {
        Norm {
            residual: None,
            x: (x.ptr(), x.len),
            w,
            eps,
            rows,
            out: (out.ptr(), out.len),
            gate: None,
        }
    }

    /// `add_rms_norm`'s: `residual += x`, then the norm of the sum.
    pub(crate) fn with_residual(
        residual: &CudaBuf,
        x: &CudaBuf,
        w: &'a CudaWeight,
        eps: f32,
        rows: usize,
        out: &CudaBuf,
    ) -> Self {
        Norm {
            residual: Some((residual.ptr(), residual.len)),
            ..Norm::of(x, w, eps, rows, out)
        }
    }

    /// `rms_norm_gated`'s: the norm times silu(gate).
    pub(crate) fn gated(self, gate: &CudaBuf) -> Self {
        Norm {
            gate: Some((gate.ptr(), gate.len)),
            ..self
        }
    }

    /// The shapes, in every mode.
    pub(crate) fn check(&self) -> Result<()> {
        let (rows, cols) = (self.rows, self.w.cols);
        let n = rows * cols;
        let (x_len, out_len) = (self.x.1, self.out.1);
        let ok = x_len >= n
            && out_len >= n
            && self.residual.is_none_or(|(_, l)| l >= n)
            && self.gate.is_none_or(|(_, l)| l >= n)
            && cols.is_multiple_of(4);
        check("rms_norm", ok, || {
            format!("{rows}×{cols} over buffers of {x_len} / {out_len}")
        })
    }

    /// The residual pointer the kernels take (0: none).
    pub(crate) fn residual_ptr(&self) -> u64 {
        self.residual.map(|(p, _)| p).unwrap_or(0)
    }
}

impl CudaBackend {
    /// The fast path's norm over `rows` > 0 rows (shapes checked by the caller).
    pub(crate) fn norm_fast(&self, n: &Norm) -> Result<()> {
        let cols = n.w.cols;
        self.launch(
            "ops",
            "rms_norm",
            (n.rows as u32, 1, 1),
            (norm_threads(cols), 1, 1),
            args![
                n.residual_ptr(),
                n.x.0,
                n.w.data.ptr,
                n.out.0,
                n.rows as i32,
                cols as i32,
                n.eps,
                n.gate.map(|(p, _)| p).unwrap_or(0)
            ],
        )
    }

    /// a[i] += b[i] for `n` elements (shapes checked by the caller; exact in f32, so the
    /// parity mode runs it too).
    pub(crate) fn add_bias_kernel(&self, x: u64, bias: u64, n: usize, cols: usize) -> Result<()> {
        self.launch(
            "ops",
            "add_bias",
            (grid1(n, 256, 4096), 1, 1),
            (256, 1, 1),
            args![x, bias, n as i64, cols as i32],
        )
    }

    pub(crate) fn add_kernel(&self, a: u64, b: u64, n: usize) -> Result<()> {
        self.launch(
            "ops",
            "add",
            (grid1(n, 256, 4096), 1, 1),
            (256, 1, 1),
            args![a, b, n as i64],
        )
    }
}

/// Threads of the one block per row of the norm kernel: one float4 per thread up to 256
/// threads (a row of 4096 is four loads per thread).
pub(crate) fn norm_threads(cols: usize) -> u32 {
    (cols / 4).div_ceil(32).clamp(1, 8) as u32 * 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_blocks_take_one_float4_per_thread_up_to_256_threads() {
        assert_eq!(norm_threads(4096), 256);
        assert_eq!(norm_threads(640), 160);
        assert_eq!(norm_threads(256), 64);
        assert_eq!(norm_threads(64), 32);
        assert_eq!(norm_threads(4), 32);
    }
}
