//! RMSNorm, with the residual add fused (ops.cu `rms_norm`), and the plain residual add
//! (`add`). The parity mode's norm is in src/exact.rs.
//!
//! A norm's output is usually the next product's input, which the int8 products quantize
//! first (`quantize_act_as`): the norm kernel can write that int8 copy itself, bit for bit the
//! quantizer's, one launch fewer. Which copy (block size, Q4_1/Q5_1's sums, imm's tiling) the
//! product reads is the product's business, so the norm learns it: `quantize_act_as` asks
//! [`norm_made`](CudaBackend::norm_made) first, which, when x is the output of the norm launched
//! just before (no launch between), records the form under the norm's weight and row count
//! and, if the norm made that form, hands out its copy. A step's first run (eager, before its
//! graph is captured) teaches the form; the form never changes a bit of the results.

use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::Result;
use quiver_gguf::GgmlType;
use std::sync::atomic::Ordering;

/// An int8 copy of activations as `quantize_act_as` makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ActForm {
    /// 32 (`quantize_a32`) or 256 (`quantize_a256`).
    pub(crate) block: u16,
    /// Blocks of 32: the offset sums of Q4_1/Q5_1 (q8_1).
    pub(crate) q8_1: bool,
    /// Blocks of 256: on imm's wgmma tiles.
    pub(crate) tiled: bool,
}

impl ActForm {
    pub(crate) fn new(block: usize, ty: GgmlType, tiled: bool) -> Self {
        let q8_1 = block == 32 && matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
        ActForm {
            block: block as u16,
            q8_1,
            tiled: block == 256 && tiled,
        }
    }

    /// Whether the norm kernel can make this form of rows of `cols`.
    fn fits(self, cols: usize) -> bool {
        cols.is_multiple_of(self.block as usize)
    }
}

/// The last norm launched: its output, its weight, the form it made, and the launch count
/// after it.
#[derive(Clone, Copy)]
pub(crate) struct NormOut {
    out: u64,
    rows: usize,
    cols: usize,
    w: u64,
    made: Option<(ActForm, (u64, u64, u64))>,
    launches: u64,
}

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
    /// The fast path's norm over `rows` > 0 rows (shapes checked by the caller), with the int8
    /// copy of its output that the product after it read last time.
    pub(crate) fn norm_fast(&self, n: &Norm) -> Result<()> {
        let cols = n.w.cols;
        let form = self
            .norm_forms
            .lock()
            .unwrap()
            .get(&(n.w.data.ptr, n.rows))
            .copied();
        let made = match form.filter(|f| f.fits(cols)) {
            Some(f) => Some((f, self.act_scratch(n.rows, cols, f.block as usize)?)),
            None => None,
        };
        let ((q, d, s), block, q8_1, tn) = match made {
            Some((f, q)) => (
                q,
                f.block as i32,
                i32::from(f.q8_1),
                if f.tiled { n.rows as i32 } else { 0 },
            ),
            None => ((0, 0, 0), 0, 0, 0),
        };
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
                n.gate.map(|(p, _)| p).unwrap_or(0),
                q,
                d,
                s,
                block,
                q8_1,
                tn
            ],
        )?;
        *self.norm_out.lock().unwrap() = Some(NormOut {
            out: n.out.0,
            rows: n.rows,
            cols,
            w: n.w.data.ptr,
            made,
            launches: self.launches.load(Ordering::Relaxed),
        });
        Ok(())
    }

    /// The int8 copy of `n` rows of `cols` at `x` in `form`, if the norm launched just before
    /// wrote x and made it (and the form the product wants learnt for that norm either way).
    pub(crate) fn norm_made(
        &self,
        x: u64,
        n: usize,
        cols: usize,
        form: ActForm,
    ) -> Result<Option<(u64, u64, u64)>> {
        let Some(last) = self.norm_out.lock().unwrap().take() else {
            return Ok(None);
        };
        if last.out != x
            || last.rows != n
            || last.cols != cols
            || last.launches != self.launches.load(Ordering::Relaxed)
        {
            return Ok(None);
        }
        let mut forms = self.norm_forms.lock().unwrap();
        if forms.get(&(last.w, n)) != Some(&form) {
            forms.insert((last.w, n), form);
        }
        drop(forms);
        match last.made {
            Some((f, q)) if f == form && self.act_scratch(n, cols, f.block as usize)? == q => {
                Ok(Some(q))
            }
            _ => Ok(None),
        }
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

/// Threads of the one block per row of the norm kernel: 8 columns a thread in passes of up to
/// 512 threads (ops.cu `rms_norm`: a row of 4,096 in one pass, read once).
pub(crate) fn norm_threads(cols: usize) -> u32 {
    cols.div_ceil(256).clamp(1, 16) as u32 * 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_blocks_take_8_columns_a_thread_up_to_512_threads() {
        assert_eq!(norm_threads(4096), 512);
        assert_eq!(norm_threads(8192), 512);
        assert_eq!(norm_threads(640), 96);
        assert_eq!(norm_threads(576), 96);
        assert_eq!(norm_threads(256), 32);
        assert_eq!(norm_threads(4), 32);
    }
}
