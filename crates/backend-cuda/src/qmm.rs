//! The f16 tensor-core products over the GGUF blocks (kernels/qmm.cu): qmm (64 tokens × 64
//! rows a block, split over the columns when its tiles do not fill the device), its decode form
//! qmv (the same bits, up to 8 tokens a launch) and the experts' grouped form; their launch
//! shapes and shared memory.

use crate::split::Parts;
use crate::weights::CudaWeight;
use crate::{registry, CudaBackend};
use quiver_backend::Result;

/// Tokens and weight rows of a qmm tile (kernels/qmm.cu `QMM_BN`, `QMM_BM`), threads of its
/// block.
pub(crate) const QMM_BN: usize = 64;
pub(crate) const QMM_BM: usize = 64;
pub(crate) const QMM_THREADS: u32 = 128;
/// Tokens per qmv launch (kernels/qmm.cu: one n8 tile).
const QMV_TOKENS: usize = 8;
/// Stages in flight (kernels/qmm.cu `QMM_NST`) and a staged activation row in bytes
/// (`QMM_XLD` halves).
pub(crate) const QMM_NST: usize = 3;
const QMM_XLD_BYTES: usize = 144 * 2;
/// Shared memory a block may take (H100/H200: 227 KiB); a weight whose qmv block would need
/// more (rows of more than ~32k–64k columns) is not batch invariant.
pub(crate) const MAX_SMEM: usize = 227 * 1024;
/// Warps of a qmv block (kernels/qmm.cu `QMV_WARPS`): 8, or 4 for a chunk window over 384 bytes.
fn qmv_warps(winc: usize) -> usize {
    if winc > 384 {
        4
    } else {
        8
    }
}
/// Dynamic shared memory of the qmm and qmv kernels for `w`, and qmv's threads per block.
pub(crate) fn qmm_smem(w: &CudaWeight) -> (usize, usize, u32) {
    let (qmm, qmv, warps) = qmm_smem_of(w.kernel, w.cols);
    (qmm, qmv, 32 * warps as u32)
}
/// Whether qmv's shared memory fits the device for a weight of type `kernel` and `cols`
/// columns (the kernel table's `WeightKey::qmv_fits`).
pub(crate) fn qmv_fits(kernel: &str, cols: usize) -> bool {
    qmm_smem_of(kernel, cols).1 <= MAX_SMEM
}

/// [`qmm_smem`] of a weight of type `kernel` and `cols` columns, qmv's warps last.
fn qmm_smem_of(kernel: &str, cols: usize) -> (usize, usize, usize) {
    let (win, winc) =
        registry::qmm_window(kernel).expect("every CUDA weight type has a qmm window");
    let qmm = QMM_NST * (QMM_BN * QMM_XLD_BYTES + QMM_BM * win);
    let warps = qmv_warps(winc);
    // Two chunk copies per warp, then the chunk sums: 16 rows × 8 tokens per 256 columns.
    let qmv = warps * 2 * 16 * winc + cols.div_ceil(256) * 512;
    (qmm, qmv, warps)
}

impl CudaBackend {
    /// y[n, w.rows] = xh[n, w.cols] (f16) · Wᵀ on qmm, split over the columns when `split`.
    pub(crate) fn qmm(&self, w: &CudaWeight, xh: u64, n: usize, y: u64, split: bool) -> Result<()> {
        let splits = if split {
            self.splits(w, n, Parts::Float)
        } else {
            1
        };
        let out = self.split_out(splits, n, w.rows, y)?;
        self.launch_smem(
            &w.names.module,
            &w.names.qmm,
            (
                n.div_ceil(QMM_BN) as u32,
                w.rows.div_ceil(QMM_BM) as u32,
                splits as u32,
            ),
            (QMM_THREADS, 1, 1),
            qmm_smem(w).0 as u32,
            args![
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                xh,
                out,
                n as i32
            ],
        )?;
        self.split_sum(splits, n, w.rows, out, y)
    }

    /// qmm's decode form: launches of up to [`QMV_TOKENS`] tokens.
    pub(crate) fn qmv(&self, w: &CudaWeight, xh: u64, n: usize, y: u64) -> Result<()> {
        let (_, smem, threads) = qmm_smem(w);
        for t in (0..n).step_by(QMV_TOKENS) {
            let nt = (n - t).min(QMV_TOKENS);
            self.launch_smem(
                &w.names.module,
                &w.names.qmv,
                (w.rows.div_ceil(16) as u32, 1, 1),
                (threads, 1, 1),
                smem as u32,
                args![
                    w.data.ptr,
                    w.row_bytes as i64,
                    w.rows as i32,
                    w.cols as i32,
                    xh + (t * w.cols * 2) as u64,
                    y + (t * w.rows * 4) as u64,
                    nt as i32
                ],
            )?;
        }
        Ok(())
    }

    /// The experts' grouped product (MoE prompts, `moe_qmm`): for every tile of the list at
    /// `tiles` (kernels/ops.cu `moe_group`), 64 sorted pairs of one expert, y = xh · that
    /// expert's `rows` × `w.cols` weights (kernels/qmm.cu `qmm_g_T`), expert e's at row
    /// e · `expert_rows` from `base` (in `w`'s buffer); at most `max_tiles`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qmm_grouped(
        &self,
        w: &CudaWeight,
        base: u64,
        expert_rows: usize,
        rows: usize,
        xh: u64,
        y: u64,
        off: u64,
        tiles: u64,
        max_tiles: usize,
    ) -> Result<()> {
        self.launch_smem(
            &w.names.module,
            &w.names.qmm_g,
            (max_tiles as u32, rows.div_ceil(QMM_BM) as u32, 1),
            (QMM_THREADS, 1, 1),
            qmm_smem(w).0 as u32,
            args![
                base,
                w.row_bytes as i64,
                expert_rows as i64,
                rows as i32,
                w.cols as i32,
                xh,
                y,
                off,
                tiles
            ],
        )
    }
}
