//! The ops only some architectures use (`Backend::supports`, Gemma 4): scale, a norm without
//! weight, per-column multiply, a column range copied out, and rope on q alone (a layer that
//! reads another layer's cache). The fast path only: the parity mode has none of them and says
//! so at load (`supports` is false there).

use crate::batch::CudaStep;
use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::norm::norm_threads;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::{AttnParams, Result, RopeParams, Step};
use quiver_gguf::GgmlType;

impl CudaBackend {
    pub(crate) fn scale_kernel(&self, x: &mut CudaBuf, s: f32, n: usize) -> Result<()> {
        check("scale", x.len >= n, || format!("{n} > {}", x.len))?;
        self.launch(
            "ops",
            "scale",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![x.ptr(), n as i64, s],
        )
    }

    pub(crate) fn rms_norm_plain_kernel(
        &self,
        x: &CudaBuf,
        cols: usize,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * cols;
        check(
            "rms_norm_plain",
            x.len >= n && out.len >= n && cols > 0 && cols.is_multiple_of(4),
            || format!("{rows}×{cols} over buffers of {} / {}", x.len, out.len),
        )?;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "rms_norm",
            (rows as u32, 1, 1),
            (norm_threads(cols), 1, 1),
            args![
                0u64,
                x.ptr(),
                0u64,
                out.ptr(),
                rows as i32,
                cols as i32,
                eps,
                0u64,
                0u64,
                0u64,
                0u64,
                0i32,
                0i32,
                0i32
            ],
        )
    }

    pub(crate) fn mul_cols_kernel(
        &self,
        x: &mut CudaBuf,
        w: &CudaWeight,
        rows: usize,
    ) -> Result<()> {
        let cols = w.rows * w.cols;
        check(
            "mul_cols",
            w.ty == GgmlType::F32 && (w.rows == 1 || w.cols == 1) && x.len >= rows * cols,
            || format!("{rows} rows of a {} vector of {cols} over {}", w.ty, x.len),
        )?;
        let n = rows * cols;
        self.launch(
            "ops",
            "mul_cols",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![x.ptr(), w.data.ptr, n as i64, cols as i32],
        )
    }

    pub(crate) fn copy_cols_kernel(
        &self,
        src: &CudaBuf,
        src_cols: usize,
        first: usize,
        width: usize,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check(
            "copy_cols",
            first + width <= src_cols && src.len >= rows * src_cols && out.len >= rows * width,
            || format!("columns {first}..{} of {rows}×{src_cols}", first + width),
        )?;
        let n = rows * width;
        self.launch(
            "ops",
            "copy_cols",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![
                src.ptr(),
                out.ptr(),
                n as i64,
                src_cols as i32,
                first as i32,
                width as i32
            ],
        )
    }

    pub(crate) fn copy_range_kernel(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        check(
            "copy_range",
            src_at + n <= src.len && dst_at + n <= dst.len,
            || {
                format!(
                    "{n} values from {src_at} of {} to {dst_at} of {}",
                    src.len, dst.len
                )
            },
        )?;
        self.launch(
            "ops",
            "copy_range",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![
                src.ptr() + 4 * src_at as u64,
                dst.ptr() + 4 * dst_at as u64,
                n as i64
            ],
        )
    }

    pub(crate) fn put_cols_kernel(
        &self,
        src: &CudaBuf,
        width: usize,
        rows: usize,
        out: &mut CudaBuf,
        out_cols: usize,
        at: usize,
    ) -> Result<()> {
        check(
            "put_cols",
            at + width <= out_cols && src.len >= rows * width && out.len >= rows * out_cols,
            || format!("columns {at}..{} of {rows}×{out_cols}", at + width),
        )?;
        let n = rows * width;
        self.launch(
            "ops",
            "put_cols",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![
                src.ptr(),
                out.ptr(),
                n as i64,
                width as i32,
                out_cols as i32,
                at as i32
            ],
        )
    }

    /// The q half of `rope_kv_write`: the same kernel over the q heads only, no cache.
    pub(crate) fn rope_q_kernel(
        &self,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
    ) -> Result<()> {
        let n = st.rows;
        check(
            "rope_q",
            q.len >= n * a.n_head * a.head_dim
                && rope.n_dims <= a.head_dim
                && rope.n_dims.is_multiple_of(2),
            || format!("{} rotated dims of {}, {n} tokens", rope.n_dims, a.head_dim),
        )?;
        // The q heads only: no k, v or cache behind them.
        let q = q.ptr();
        self.rope_launch(st, [q, q, q, 0, 0], a.n_head, rope, a, None)
    }
}
