//! DeepSeek-V4's element-wise ops on the GPU (kernels/dsv4.cu): the hyper-connections' block
//! input and output, the streams' expansion, the clamped SwiGLU. Each row's floats are the
//! reference's (`quiver_backend::dsv4`) whatever else the step holds. The attention over the
//! per-sequence state, the grouped product and the MoE routing are not on the GPU yet:
//! `supports(ExtraOp::Dsv4)` stays false and such models are refused at load.

use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::dsv4::HcParams;
use quiver_backend::Result;
use quiver_gguf::GgmlType;

/// Streams the kernels hold per token (kernels/dsv4.cu `HC_MAX`).
const HC_MAX: usize = 8;

/// Whether `w` is an f32 vector of `n` values.
fn f32_vector(w: &CudaWeight, n: usize) -> bool {
    w.ty == GgmlType::F32 && w.rows * w.cols == n && (w.rows == 1 || w.cols == 1)
}

impl CudaBackend {
    pub(crate) fn hc_expand_kernel(
        &self,
        x: &CudaBuf,
        p: &HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * p.hc * p.d;
        check("hc_expand", x.len >= rows * p.d && out.len >= n, || {
            format!("{rows} rows of {} streams of {}", p.hc, p.d)
        })?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_expand",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![x.ptr(), out.ptr(), rows as i64, p.hc as i32, p.d as i32],
        )
    }

    pub(crate) fn swiglu_clamp_kernel(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        limit: f32,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check(
            "swiglu_clamp",
            gate.len >= n && up.len >= n && out.len >= n,
            || format!("{n} values over {} / {} / {}", gate.len, up.len, out.len),
        )?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "swiglu_clamp",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![gate.ptr(), up.ptr(), out.ptr(), n as i64, limit],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_pre_kernel(
        &self,
        x: &CudaBuf,
        mixes: &CudaBuf,
        scale: &CudaWeight,
        base: &CudaWeight,
        p: &HcParams,
        head: bool,
        rows: usize,
        out: &mut CudaBuf,
        pc: &mut CudaBuf,
    ) -> Result<()> {
        let md = if head { p.hc } else { p.mix_dim() };
        check(
            "hc_pre",
            (1..=HC_MAX).contains(&p.hc)
                && p.iters >= 1
                && x.len >= rows * p.hc * p.d
                && mixes.len >= rows * md
                && f32_vector(base, md)
                && f32_vector(scale, if head { 1 } else { 3 })
                && out.len >= rows * p.d
                && (head || pc.len >= rows * p.pc_dim()),
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_pre",
            (rows as u32, 1, 1),
            (256, 1, 1),
            args![
                x.ptr(),
                mixes.ptr(),
                scale.data.ptr,
                base.data.ptr,
                out.ptr(),
                pc.ptr(),
                p.hc as i32,
                p.d as i32,
                p.eps,
                p.iters as i32,
                head as i32
            ],
        )
    }

    pub(crate) fn hc_post_kernel(
        &self,
        y: &CudaBuf,
        residual: &CudaBuf,
        pc: &CudaBuf,
        p: &HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * p.hc * p.d;
        check(
            "hc_post",
            y.len >= rows * p.d && residual.len >= n && pc.len >= rows * p.pc_dim() && out.len >= n,
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_post",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![
                y.ptr(),
                residual.ptr(),
                pc.ptr(),
                out.ptr(),
                rows as i64,
                p.hc as i32,
                p.d as i32
            ],
        )
    }
}
