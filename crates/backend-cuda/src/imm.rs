//! The int8 tensor-core products in the exact-sum order (kernels/imm.cu, immw.cu): imm (split
//! over whole 256-column chunks, each tile's last part adding the parts' 64-bit totals; Q4_K's
//! and Q6_K's on Hopper's wgmma fed by the tensor memory accelerator, immw) and its decode form
//! imv (8 or 16 tokens a launch); their launch shapes and shared memory.

use crate::qmm::{QMM_BM, QMM_BN, QMM_NST, QMM_THREADS};
use crate::weights::CudaWeight;
use crate::wmm::tensor_map;
use crate::{registry, CudaBackend};
use cudarc::driver::sys as ds;
use quiver_backend::Result;

/// Tokens per imv launch (kernels/imm.cu: up to two n8 tiles).
const IMV_TOKENS: usize = 16;
/// An int8 activation tile's token row in bytes (kernels/qmm.cu `IMM_XLD`).
const IMM_XLD_BYTES: usize = 144;
/// Stages in flight of imm on wgmma (kernels/immw.cu `IMW_NST`).
const IMW_NST: usize = 3;

/// Dynamic shared memory of immw (kernels/immw.cu) for weights of kernel suffix `kernel`: per
/// stage (a super-block) the tokens' 256 int8 activations and d, the rows' blocks (Q4_K: 144
/// bytes by a tensor copy, and the tokens' 32-sums split; Q6_K: qmm's windows of 240) and a
/// barrier.
fn immw_smem(kernel: &str) -> usize {
    let (rows, sums) = if kernel == "q6_k" {
        (240, 0)
    } else {
        (144, 16)
    };
    IMW_NST * (QMM_BN * (256 + sums + 4) + QMM_BM * rows + 8)
}

/// Row groups of 16 an `imv_g` block takes (kernels/imm.cu `imv_g<T, NT, RW, XS>`): 64 rows a
/// block, each group over half the columns. Measured on the H200 (8 layers of Qwen3-30B-A3B
/// Q4_K_M, S_TG at 16 / 64 sequences): 1 group 5,104 / 13,734 t/s, 4 groups 5,885 / 16,257, 8
/// groups (a warp over all the columns of its rows) 5,733 / 16,101.
pub(crate) const IMV_G_RW: usize = 4;

/// Dynamic shared memory of `imv_g` of `nt` n8 tiles for weights of type `kernel` and `cols`
/// columns: imv's, and for the K-quants the tile's activations and per-16 sums staged (rows of
/// cols + 16 bytes; imm.cu `imvk_impl`).
fn imv_g_smem(kernel: &str, cols: usize, nt: usize) -> usize {
    let winc = registry::qmm_window(kernel)
        .expect("every CUDA weight type has a qmm window")
        .1;
    let staged = if registry::int8_activations(kernel) == Some(256) {
        8 * nt * (cols + 16) + 8 * nt * cols / 4
    } else {
        0
    };
    imv_smem(winc, nt) + staged
}

/// Whether `imv_g` of `nt` n8 tiles fits the device's shared memory for `w` (very wide experts
/// of the K-quants do not: their pairs take moeqc, the same bits).
pub(crate) fn imv_g_fits(w: &CudaWeight, nt: usize) -> bool {
    imv_g_smem(w.kernel, w.cols, nt) <= crate::qmm::MAX_SMEM
}

/// imv's shared memory for a chunk window of `winc` bytes: two chunk copies per warp, then each
/// warp's sums (16 rows × 8·nt tokens of i64).
fn imv_smem(winc: usize, nt: usize) -> usize {
    8 * 2 * 16 * winc + 8 * 128 * nt * 8
}

/// Dynamic shared memory of the imm kernel and of the imv kernel of `nt` n8 tiles for `w`: per
/// stage the int8 activations, their scales (32-blocks: 4 (d, s) pairs per token; the K-quants:
/// the 32-sums split and one d per token) and the weights' windows.
fn imm_smem(w: &CudaWeight, nt: usize) -> (usize, usize) {
    let (win, winc) =
        registry::qmm_window(w.kernel).expect("every CUDA weight type has a qmm window");
    let scales = if registry::int8_activations(w.kernel) == Some(256) {
        5 * QMM_BN * 4
    } else {
        // (d, s) of 4 blocks per token.
        4 * QMM_BN * 8
    };
    let imm = QMM_NST * (QMM_BN * IMM_XLD_BYTES + scales + QMM_BM * win);
    (imm, imv_smem(winc, nt))
}

/// imm's grid (and immw's): tiles of 64 tokens × 64 rows, `splits` parts of the columns.
fn imm_grid(w: &CudaWeight, n: usize, splits: usize) -> (u32, u32, u32) {
    (
        n.div_ceil(QMM_BN) as u32,
        w.rows.div_ceil(QMM_BM) as u32,
        splits as u32,
    )
}

impl CudaBackend {
    /// y[n, w.rows] = x · Wᵀ over the int8 activations `(q, d, s)` (quants, scales, per-16 sums)
    /// on imm.
    pub(crate) fn imm(
        &self,
        w: &CudaWeight,
        (q, d, s): (u64, u64, u64),
        n: usize,
        y: u64,
    ) -> Result<()> {
        let (splits, part, cnt) = self.exact_splits(w, n)?;
        if registry::imm_wgmma(w.kernel, self.dev.info.arch) {
            return self.immw(w, (q, d, s), n, y, (splits, part, cnt));
        }
        self.launch_smem(
            &w.names.module,
            &w.names.imm,
            imm_grid(w, n, splits),
            (QMM_THREADS, 1, 1),
            imm_smem(w, 1).0 as u32,
            args![
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                q,
                d,
                s,
                y,
                n as i32,
                part,
                cnt
            ],
        )
    }

    /// imm on wgmma (kernels/immw.cu `immw`) in `splits` parts, over int8 activations in its
    /// tiles (`quantize_act_as`): the tensor maps of the activations (a row of 8-byte units per
    /// piece of 16 values, the n tokens' pieces; a box is a stage's 16 pieces of 64 tokens, in
    /// wgmma's canonical layout) and of the weights (rows of 4-byte units: a box is a
    /// super-block's blocks of 64 rows).
    fn immw(
        &self,
        w: &CudaWeight,
        (q, d, s): (u64, u64, u64),
        n: usize,
        y: u64,
        (splits, part, cnt): (usize, u64, u64),
    ) -> Result<()> {
        let (block, _) = registry::block_layout(w.kernel).expect("a block type");
        let none = ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
        let xm = tensor_map(
            ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT64,
            q,
            &[2 * n as u64, (w.cols / 16) as u64],
            &[n as u64 * 16],
            &[2 * QMM_BN as u32, 16],
            none,
        )?;
        // (Q6_K's rows, of any alignment, go by cp.async: the activations' map stands in.)
        let wm = if w.row_bytes.is_multiple_of(16) && block.is_multiple_of(16) {
            tensor_map(
                ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
                w.data.ptr,
                &[w.row_bytes as u64 / 4, w.rows as u64],
                &[w.row_bytes as u64],
                &[block as u32 / 4, QMM_BM as u32],
                none,
            )?
        } else {
            xm
        };
        self.launch_smem(
            &w.names.module,
            &w.names.immw,
            imm_grid(w, n, splits),
            (QMM_THREADS, 1, 1),
            immw_smem(w.kernel) as u32,
            args![
                xm,
                wm,
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                d,
                s,
                y,
                n as i32,
                part,
                cnt
            ],
        )
    }

    /// The experts' products on imv (kernels/imm.cu `imv_g`): for each `(base, y)` of `outs`
    /// (one, or gate and up in one launch), y[p, r] = x[p] · W[r + e·expert_rows] (rows from
    /// `base`) for the pairs p of each expert e, over the int8 activations of the pairs sorted
    /// by expert (`quantize_act`); `off`, `tiles`: ops.cu moe_group's offsets and tile list of
    /// 8·`nt` pairs a tile (`nt` n8 tiles, 1 or 2), at most `max_tiles` long.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn imv_grouped(
        &self,
        w: &CudaWeight,
        outs: &[(u64, u64)],
        expert_rows: usize,
        rows: usize,
        (q, d, s): (u64, u64, u64),
        (off, tiles, max_tiles): (u64, u64, usize),
        nt: usize,
    ) -> Result<()> {
        let nb = rows.div_ceil(16 * IMV_G_RW);
        let (first, second) = (outs[0], *outs.last().expect("an output"));
        self.launch_smem(
            &w.names.module,
            &w.names.imv_g[nt - 1],
            ((nb * outs.len()) as u32, max_tiles as u32, 1),
            (256, 1, 1),
            imv_g_smem(w.kernel, w.cols, nt) as u32,
            args![
                first.0,
                second.0,
                w.row_bytes as i64,
                expert_rows as i64,
                rows as i32,
                w.cols as i32,
                q,
                d,
                s,
                first.1,
                second.1,
                nb as i32,
                off,
                tiles
            ],
        )
    }

    /// imm's decode form: launches of up to [`IMV_TOKENS`] tokens.
    pub(crate) fn imv(
        &self,
        w: &CudaWeight,
        (q, d, s): (u64, u64, u64),
        n: usize,
        y: u64,
    ) -> Result<()> {
        // Bytes of one token's scales: (d, d·Σq) per 32, or d per 256.
        let d_row = if s == 0 {
            w.cols / 32 * 8
        } else {
            w.cols / 256 * 4
        };
        for t in (0..n).step_by(IMV_TOKENS) {
            let nt = (n - t).min(IMV_TOKENS);
            // One or two n8 tiles.
            let k = usize::from(nt > 8);
            self.launch_smem(
                &w.names.module,
                &w.names.imv[k],
                (w.rows.div_ceil(16) as u32, 1, 1),
                (256, 1, 1),
                imm_smem(w, 1 << k).1 as u32,
                args![
                    w.data.ptr,
                    w.row_bytes as i64,
                    w.rows as i32,
                    w.cols as i32,
                    q + (t * w.cols) as u64,
                    d + (t * d_row) as u64,
                    if s == 0 {
                        0
                    } else {
                        s + (t * w.cols / 4) as u64
                    },
                    y + (t * w.rows * 4) as u64,
                    nt as i32
                ],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imv_g_fits_shared_memory_up_to_wide_k_quant_experts() {
        let fits =
            |k: &str, cols: usize, nt: usize| imv_g_smem(k, cols, nt) <= crate::qmm::MAX_SMEM;
        // Qwen3-30B-A3B's experts (2048 wide; down 768) in either tile; DeepSeek-V3's 7168.
        for k in ["q4_k", "q6_k", "q4_0", "q8_0"] {
            assert!(fits(k, 2048, 2) && fits(k, 768, 2), "{k}");
        }
        assert!(fits("q6_k", 7168, 2));
        // The K-quants stage their activations: past ~7.5k columns two tiles no longer fit.
        assert!(!fits("q6_k", 8192, 2));
        assert!(fits("q6_k", 8192, 1));
        // The 32-blocks read them from L2: any width.
        assert!(fits("q8_0", 16384, 2));
    }
}
