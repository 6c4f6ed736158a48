//! Hopper's warpgroup products over the GGUF blocks (kernels/wmm.cu, sm_90a): prompt rows on
//! wgmma, over activations rounded and permuted for it (`f32_permute`, ops.cu), in tiles of 64
//! or 128 weight rows × 64 to 256 tokens (a token's results are the same bits in any tile);
//! their launch shapes, shared memory and tensor maps.

use crate::qmm::MAX_SMEM;
use crate::weights::CudaWeight;
use crate::{registry, CudaBackend};
use cudarc::driver::sys as ds;
use quiver_backend::Result;
use quiver_gguf::GgmlType;

/// The tiles (weight rows, tokens), largest first. A block has 2 · rows consumer threads and a
/// producer warp (a warpgroup past 128 tokens: [`wmm_threads`]).
pub const WMM_TILES: [(usize, usize); 5] =
    [(128, 256), (128, 192), (128, 128), (128, 64), (64, 64)];
/// The weight rows of an experts' product's tile (kernels/wmm.cu `wmm_g`; its tokens: the
/// grouped tiles of 64, [`crate::qmm::QMM_BN`]).
pub(crate) const WMM_G_ROWS: usize = 128;
/// The share of the multiprocessors a tile's blocks must cover to be taken.
const FILL: f64 = 0.75;
/// A block's fixed cost in tokens (the dequantization its fragments take, which a tile's tokens
/// share), for the waves' cost of [`wmm_tile`] (sm_90: 128 × 256 tiles took 224 blocks of the
/// 8B's gate/up, two waves, 5% faster overall than 448 of 128 × 128).
const BLOCK_TOKENS: usize = 32;
/// wmm's kernels of the weight type tagged `w` (registry.rs `quant_kernels`): (name without the
/// type's suffix, template expression), a product per tile and the experts' products.
pub(crate) fn wmm_kernels(w: &str) -> Vec<(String, String)> {
    let mut l: Vec<(String, String)> = WMM_TILES
        .iter()
        .map(|(bm, bn)| (format!("wmm{bm}x{bn}"), format!("wmm<{w}, {bm}, {bn}>")))
        .collect();
    l.push(("wmm_g".into(), format!("wmm_g<{w}, {WMM_G_ROWS}>")));
    l
}

/// Columns of a stage (kernels/qmm.cu `QMM_BK`): the permuted activations' rows are whole
/// stages.
pub(crate) const WMM_BK: usize = 128;

/// Whether compute capability `arch` runs wmm (wgmma: sm_90 only).
pub fn wmm_arch(arch: u32) -> bool {
    arch == 90
}

/// Columns of a permuted activation row for a weight of `cols` columns.
pub(crate) fn permuted_cols(cols: usize) -> usize {
    cols.div_ceil(WMM_BK) * WMM_BK
}

/// Whether wmm can take a weight whose rows hold `row_bytes` bytes: its tensor map steps whole
/// 16-byte units from row to row, so rows of 8-byte units are read in pairs ([`wmm_pairs`]).
pub fn wmm_fits(row_bytes: usize) -> bool {
    row_bytes.is_multiple_of(8)
}

/// Whether wmm reads a weight's rows in pairs (kernels/wmm.cu `pairs`): rows of 8-byte units,
/// such as Q6_K's 22,680 bytes at 27,648 columns. The weight's memory then holds a row past an
/// odd count of rows, so that the last pair is whole ([`CudaBackend::matrix_weight`]).
pub(crate) fn wmm_pairs(row_bytes: usize) -> bool {
    !row_bytes.is_multiple_of(16)
}

/// A tensor map (CUtensorMap; kernels/wmm.cu `TMap`): 128 bytes, 64-byte aligned.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub(crate) struct TMap([u64; 16]);

/// A tiled tensor map over `dims` (innermost first) of `ty` elements at `ptr`, with the byte
/// strides of the outer dimensions, boxes of `bx`, zeros outside, the boxes' rows in shared
/// memory as `swizzle` lays them.
pub(crate) fn tensor_map(
    ty: ds::CUtensorMapDataType,
    ptr: u64,
    dims: &[u64],
    strides: &[u64],
    bx: &[u32],
    swizzle: ds::CUtensorMapSwizzle,
) -> Result<TMap> {
    let mut m = TMap([0; 16]);
    let ones = [1u32; 5];
    // SAFETY: the arrays hold `dims.len()` (strides: one fewer) entries, as the rank says;
    // `m` is 64-byte aligned and 128 bytes.
    let r = unsafe {
        ds::cuTensorMapEncodeTiled(
            &mut m as *mut TMap as *mut ds::CUtensorMap,
            ty,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            bx.as_ptr(),
            ones.as_ptr(),
            ds::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            ds::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            ds::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != ds::CUresult::CUDA_SUCCESS {
        return Err(quiver_backend::BackendError::Device(format!(
            "cuTensorMapEncodeTiled: {r:?} (dims {dims:?}, strides {strides:?}, box {bx:?})"
        )));
    }
    Ok(m)
}

/// wmm's dynamic shared memory for a weight of type `kernel` and a tile of `bn` tokens
/// (kernels/wmm.cu `WmmSmem`): stages of activations and weight windows, 4 deep where they fit,
/// and 64 bytes of barriers.
fn wmm_smem(kernel: &str, bm: usize, bn: usize) -> usize {
    let (win, _) = registry::qmm_window(kernel).expect("every CUDA weight type has a qmm window");
    let stage = bn * WMM_BK * 2 + bm * win;
    let nst = (2..=4)
        .rev()
        .find(|s| s * stage + 64 <= MAX_SMEM)
        .unwrap_or(2);
    nst * stage + 64
}

/// Threads of a block of tile (`bm`, `bn`) (kernels/wmm.cu `WmmSmem::PT`).
fn wmm_threads(bm: usize, bn: usize) -> u32 {
    (2 * bm + if bn > 128 { 128 } else { 32 }) as u32
}

/// Whether two stages of tile (`bm`, `bn`) fit a block's shared memory for weights of type
/// `kernel` (f32's windows do not at 256 tokens).
fn wmm_tile_fits(kernel: &str, (bm, bn): (usize, usize)) -> bool {
    wmm_smem(kernel, bm, bn) <= MAX_SMEM
}

/// The tile (an index of [`WMM_TILES`]) of a product of `rows` weight rows of type `kernel` over
/// `n` tokens on `sms` multiprocessors. Of the 128-row tiles that fit and whose blocks fill the
/// device, the cheapest in waves (a multiprocessor's blocks one after another, each costing its
/// tokens and [`BLOCK_TOKENS`]; the larger on a tie): 160 blocks of 128 × 128 on 132
/// multiprocessors are two waves, the second a fifth full, where 120 of 128 × 192 are one. With
/// none, the smallest tile.
pub(crate) fn wmm_tile(kernel: &str, rows: usize, n: usize, sms: usize) -> usize {
    let blocks = |(bm, bn): (usize, usize)| rows.div_ceil(bm) * n.div_ceil(bn);
    let cost = |t: (usize, usize)| blocks(t).div_ceil(sms) * (t.1 + BLOCK_TOKENS);
    (0..WMM_TILES.len())
        .filter(|&i| {
            let t = WMM_TILES[i];
            t.0 == 128 && wmm_tile_fits(kernel, t) && blocks(t) as f64 >= FILL * sms as f64
        })
        .min_by_key(|&i| (cost(WMM_TILES[i]), i))
        .unwrap_or(WMM_TILES.len() - 1)
}

impl CudaBackend {
    /// `n` rows of f32 activations at `x` (`cols` wide) as wmm reads them for weights of type
    /// `ty`: f16 on the type's int8 grid ([`crate::act_grid`]), permuted, in scratch
    /// (ops.cu `f32_permute`).
    pub(crate) fn permute_act(&self, x: u64, n: usize, cols: usize, ty: GgmlType) -> Result<u64> {
        let colsp = permuted_cols(cols);
        let xp = self.scratch_ptr(|s| &mut s.xperm, n * colsp * 2, "permuted activations")?;
        self.permute_to(x, n, cols, ty, xp)?;
        Ok(xp)
    }

    /// [`permute_act`](Self::permute_act) into `xp` (`n` · [`permuted_cols`] halves).
    pub(crate) fn permute_to(
        &self,
        x: u64,
        n: usize,
        cols: usize,
        ty: GgmlType,
        xp: u64,
    ) -> Result<()> {
        let colsp = permuted_cols(cols);
        let grid = crate::act_grid(ty)
            .filter(|b| cols.is_multiple_of(*b))
            .unwrap_or(0);
        self.launch(
            "ops",
            "f32_permute",
            (colsp.div_ceil(256) as u32, n.div_ceil(32) as u32, 1),
            (256, 1, 1),
            args![
                x,
                xp,
                n as i32,
                cols as i32,
                colsp as i32,
                n as i32,
                grid as i32
            ],
        )
    }

    /// y[n, w.rows] = x · Wᵀ on wmm, x permuted (`permute_act`), in the tile [`wmm_tile`]
    /// picks.
    pub(crate) fn wmm(&self, w: &CudaWeight, xp: u64, n: usize, y: u64) -> Result<()> {
        // A tile pinned by the tests where the type's stages fit it.
        let t = self
            .cfg
            .wmm_tile
            .filter(|&t| wmm_tile_fits(w.kernel, WMM_TILES[t]))
            .unwrap_or_else(|| wmm_tile(w.kernel, w.rows, n, self.dev.info.sms as usize));
        let (bm, bn) = WMM_TILES[t];
        let (xm, wm, pairs) = self.wmm_maps(w, xp, n, bm, bn)?;
        self.launch_smem(
            &w.names.module,
            &w.names.wmm[t],
            (n.div_ceil(bn) as u32, w.rows.div_ceil(bm) as u32, 1),
            (wmm_threads(bm, bn), 1, 1),
            wmm_smem(w.kernel, bm, bn) as u32,
            args![
                xm,
                wm,
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                y,
                n as i32,
                pairs as i32
            ],
        )
    }

    /// The activations' (`n` tokens permuted at `xp`) and the weights' tensor maps of a product
    /// of `w` in tiles of `bm` rows × `bn` tokens, and whether the rows go in pairs.
    fn wmm_maps(
        &self,
        w: &CudaWeight,
        xp: u64,
        n: usize,
        bm: usize,
        bn: usize,
    ) -> Result<(TMap, TMap, bool)> {
        let (win, _) =
            registry::qmm_window(w.kernel).expect("every CUDA weight type has a qmm window");
        // The activations: a row of 2·n 8-byte units (the n tokens' 16-byte pieces c) per piece
        // c (f32_permute's layout); a box is a stage's tile, BN tokens' pieces in one run of the
        // row (whole lines for the L2, not one request per piece).
        let pieces = permuted_cols(w.cols) / 8;
        let xm = tensor_map(
            ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT64,
            xp,
            &[2 * n as u64, pieces as u64],
            &[n as u64 * 16],
            // (a tile past 128 tokens takes two boxes, a half each: a box's rows are at most 256
            // units)
            &[2 * if bn > 128 { bn / 2 } else { bn } as u32, 16],
            ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )?;
        // The weights: rows of 4-byte units; a box is a stage's windows of the tile's rows (of
        // its even or its odd rows, the map's rows being pairs of rows).
        let pairs = wmm_pairs(w.row_bytes);
        let k = if pairs { 2 } else { 1 };
        let wm = tensor_map(
            ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
            w.data.ptr,
            &[(k * w.row_bytes) as u64 / 4, w.rows.div_ceil(k) as u64],
            &[(k * w.row_bytes) as u64],
            &[win as u32 / 4, (bm / k) as u32],
            ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )?;
        Ok((xm, wm, pairs))
    }

    /// The experts' products on wmm (kernels/wmm.cu `wmm_g`): y[p, r] = x[p] · W[e·expert_rows +
    /// row_off + r] for the pairs p of each expert e (rows off[e]..off[e+1] of the permuted
    /// activations at `xp`, `pairs` of them), `rows` rows an expert, in the tiles of 64 that
    /// `tiles` lists (at most `max_tiles`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn wmm_grouped(
        &self,
        w: &CudaWeight,
        row_off: usize,
        rows: usize,
        expert_rows: usize,
        xp: u64,
        pairs: usize,
        y: u64,
        (off, tiles, max_tiles): (u64, u64, usize),
    ) -> Result<()> {
        let (bm, bn) = (WMM_G_ROWS, crate::qmm::QMM_BN);
        let (xm, wm, in_pairs) = self.wmm_maps(w, xp, pairs, bm, bn)?;
        self.launch_smem(
            &w.names.module,
            &w.names.wmm_g,
            (max_tiles as u32, rows.div_ceil(bm) as u32, 1),
            (wmm_threads(bm, bn), 1, 1),
            wmm_smem(w.kernel, bm, bn) as u32,
            args![
                xm,
                wm,
                w.data.ptr,
                w.row_bytes as i64,
                expert_rows as i64,
                row_off as i32,
                rows as i32,
                w.cols as i32,
                y,
                off,
                tiles,
                in_pairs as i32
            ],
        )
    }

    /// Whether the experts' products of `w` (`expert_rows` rows an expert, from row `row_off`)
    /// can run on wmm: sm_90, rows wmm's map steps, and in pairs whole pairs an expert.
    pub(crate) fn wmm_grouped_fits(
        &self,
        w: &CudaWeight,
        expert_rows: usize,
        row_off: usize,
    ) -> bool {
        wmm_arch(self.dev.info.arch)
            && wmm_fits(w.row_bytes)
            && (!wmm_pairs(w.row_bytes)
                || (expert_rows.is_multiple_of(2) && row_off.is_multiple_of(2)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fill_the_device_in_the_fewest_waves() {
        // The 8B's 4096-row products over 512 tokens: 128 blocks of 128 × 128 on 132 SMs.
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 4096, 512, 132)], (128, 128));
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 14336, 512, 132)], (128, 256));
        // SmolLM2's 576 rows: 72 blocks of 64 × 64, the most there are.
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 576, 512, 132)], (64, 64));
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 2048, 512, 132)], (128, 64));
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 4096, 1, 132)], (64, 64));
        // f32's windows: two stages of 256 tokens do not fit.
        assert_eq!(WMM_TILES[wmm_tile("f32", 14336, 512, 132)], (128, 128));
        // The 32B's 5,120-row products: 120 blocks of 128 × 192 (one wave), not 160 of 128 × 128.
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 5120, 512, 132)], (128, 192));
        // 300 tokens of the 8B: no 128-token tile fills the device.
        assert_eq!(WMM_TILES[wmm_tile("q4_k", 4096, 300, 132)], (128, 64));
    }
}
