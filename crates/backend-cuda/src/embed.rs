//! Token embedding: each token's row of the table dequantized and scaled (quant.cu
//! `embed_T`). The fast path only: the parity mode's gather is in src/exact.rs.

use crate::batch::CudaStep;
use crate::memory::CudaBuf;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::{Result, Step};

/// The shapes `embed` takes over the step's `n` rows, in either mode.
pub(crate) fn check_embed(table: &CudaWeight, n: usize, out: &CudaBuf) -> Result<()> {
    check("embed", out.len >= n * table.cols, || {
        format!("out holds {} < {n}×{}", out.len, table.cols)
    })
}

impl CudaBackend {
    /// Launches `module`'s gather `name` over the step's tokens: the fast path's kernel
    /// (`embed_T`), or the parity mode's (`x_embed_T`), which takes the same arguments. The
    /// table holds the vocabulary's rows `first..` (0 for a whole table).
    pub(crate) fn launch_embed(
        &self,
        st: &Step<CudaStep>,
        (module, name): (&str, &str),
        table: &CudaWeight,
        first: usize,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.launch(
            module,
            name,
            (st.rows.max(1) as u32, 1, 1),
            (128, 1, 1),
            args![
                table.data.ptr,
                st.ctx.view.tokens,
                out.ptr(),
                table.cols as i32,
                table.row_bytes as i64,
                scale,
                first as i64,
                table.rows as i64
            ],
        )
    }

    /// The fast path's embedding of a table holding rows `first..` (shapes checked by the
    /// caller).
    pub(crate) fn embed_fast(
        &self,
        st: &Step<CudaStep>,
        table: &CudaWeight,
        first: usize,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let names = (table.names.module.as_str(), table.names.embed.as_str());
        self.launch_embed(st, names, table, first, scale, out)
    }
}
