//! Hopper's warpgroup products over the GGUF blocks (kernels/wmm.cu, sm_90a): prompt rows on
//! wgmma, over activations permuted for it (`f16_permute`, ops.cu), in tiles of 64 or 128
//! weight rows × 64 or 128 tokens (a token's results are the same bits in any tile); their
//! launch shapes and shared memory.

use crate::launch::grid1;
use crate::weights::CudaWeight;
use crate::{registry, CudaBackend};
use quiver_backend::Result;

/// The tiles (weight rows, tokens), largest first: the launcher takes the first whose blocks
/// cover [`FILL`] of the multiprocessors, else the last. A block has 2 · rows + 32 threads.
pub(crate) const WMM_TILES: [(usize, usize); 3] = [(128, 128), (128, 64), (64, 64)];
/// The share of the multiprocessors a tile's blocks must cover to be taken.
const FILL: f64 = 0.75;
/// Columns of a stage (kernels/qmm.cu `QMM_BK`): the permuted activations' rows are whole
/// stages.
pub(crate) const WMM_BK: usize = 128;
/// Shared memory a block may take (H100/H200: 227 KiB).
const MAX_SMEM: usize = 227 * 1024;

/// Whether compute capability `arch` runs wmm (wgmma: sm_90 only).
pub fn wmm_arch(arch: u32) -> bool {
    arch == 90
}

/// Columns of a permuted activation row for a weight of `cols` columns.
pub(crate) fn permuted_cols(cols: usize) -> usize {
    cols.div_ceil(WMM_BK) * WMM_BK
}

/// Tokens of the permuted activations' layout for `n` tokens: whole tiles, so that every tile's
/// copies stay inside it (kernels/ops.cu `f16_permute`).
pub(crate) fn permuted_tokens(n: usize) -> usize {
    n.div_ceil(128) * 128
}

/// Bytes a weight's device copy holds past its end: wmm's bulk copies take a row's whole window
/// (kernels/qmm.cu `QWin`), up to 3 blocks of 32 values and 30 bytes of alignment past the row
/// (F32's 128-byte blocks the most).
pub(crate) const WEIGHT_SLACK: usize = 512;

/// wmm's dynamic shared memory for a weight of type `kernel` and a tile of `bn` tokens
/// (kernels/wmm.cu `WmmSmem`): stages of activations and weight windows, 4 deep where they fit,
/// and 64 bytes of barriers.
fn wmm_smem(kernel: &str, bm: usize, bn: usize) -> usize {
    let (win, _) = registry::qmm_window(kernel).expect("every CUDA weight type has a qmm window");
    let stage = bn * WMM_BK * 2 + bm * win;
    let nst = (2..=4).rev().find(|s| s * stage + 64 <= MAX_SMEM).unwrap_or(2);
    nst * stage + 64
}

/// The tile (an index of [`WMM_TILES`]) of a product of `rows` weight rows over `n` tokens on
/// `sms` multiprocessors.
pub(crate) fn wmm_tile(rows: usize, n: usize, sms: usize) -> usize {
    let blocks = |(bm, bn): (usize, usize)| rows.div_ceil(bm) * n.div_ceil(bn);
    WMM_TILES
        .iter()
        .position(|&t| blocks(t) as f64 >= FILL * sms as f64)
        .unwrap_or(WMM_TILES.len() - 1)
}

impl CudaBackend {
    /// `n` rows of f16 activations at `xh` (`cols` wide) permuted for wmm, in scratch.
    pub(crate) fn permute_act(&self, xh: u64, n: usize, cols: usize) -> Result<u64> {
        let (colsp, np) = (permuted_cols(cols), permuted_tokens(n));
        let xp = self.scratch_ptr(|s| &mut s.xperm, np * colsp * 2, "permuted activations")?;
        let pieces = n * colsp / 8;
        self.launch(
            "ops",
            "f16_permute",
            (grid1(pieces, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![xh, xp, n as i32, cols as i32, colsp as i32, np as i32],
        )?;
        Ok(xp)
    }

    /// y[n, w.rows] = x · Wᵀ on wmm, x permuted (`permute_act`), in the tile [`wmm_tile`]
    /// picks.
    pub(crate) fn wmm(&self, w: &CudaWeight, xp: u64, n: usize, y: u64) -> Result<()> {
        let t = wmm_tile(w.rows, n, self.dev.info.sms as usize);
        let (bm, bn) = WMM_TILES[t];
        self.launch_smem(
            &w.names.module,
            &w.names.wmm[t],
            (n.div_ceil(bn) as u32, w.rows.div_ceil(bm) as u32, 1),
            (2 * bm as u32 + 32, 1, 1),
            wmm_smem(w.kernel, bm, bn) as u32,
            args![
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                xp,
                permuted_tokens(n) as i32,
                y,
                n as i32
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fill_the_device_largest_first() {
        // The 8B's 4096-row products over 512 tokens: 128 blocks of 128 × 128 on 132 SMs.
        assert_eq!(WMM_TILES[wmm_tile(4096, 512, 132)], (128, 128));
        assert_eq!(WMM_TILES[wmm_tile(14336, 512, 132)], (128, 128));
        // SmolLM2's 576 rows: 72 blocks of 64 × 64, the most there are.
        assert_eq!(WMM_TILES[wmm_tile(576, 512, 132)], (64, 64));
        assert_eq!(WMM_TILES[wmm_tile(2048, 512, 132)], (128, 64));
        assert_eq!(WMM_TILES[wmm_tile(4096, 1, 132)], (64, 64));
    }
}
