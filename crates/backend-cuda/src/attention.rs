//! Attention's dispatch: the tensor-core flash kernel (kernels/flash.cu, in each cache type
//! pair's kvq module) for prefill-shaped steps, the kernels of kvq.rs otherwise. The fast path only: the parity
//! mode's is in src/exact.rs.

use crate::batch::CudaStep;
use crate::memory::{CudaBuf, CudaKv};
use crate::plan::{self, Attention, FLASH_HEAD_DIMS};
use crate::wmm::{tensor_map, TMap};
use crate::{check, CudaBackend};
use cudarc::driver::sys as ds;
use quiver_backend::{AttnParams, Result, Step};

/// Head dims the attention kernels are built for.
pub(crate) const HEAD_DIMS: &[usize] = &[64, 96, 128, 256, 512];
const FLASH_ATTENTION: [&str; 4] = [
    "flash_attention_64",
    "flash_attention_96",
    "flash_attention_128",
    "flash_attention_256",
];
const FWG_ATTENTION: [&str; 4] = [
    "fwg_attention_64",
    "fwg_attention_96",
    "fwg_attention_128",
    "fwg_attention_256",
];
const FLASH_MERGE: [&str; 4] = [
    "flash_merge_64",
    "flash_merge_96",
    "flash_merge_128",
    "flash_merge_256",
];
/// Most bytes of flash partials one launch writes (rows over several key ranges).
const FLASH_PART_BYTES: usize = 64 << 20;

/// The flash kernel's key ranges (kernels/flash.cu): fixed, so a row's ranges, and its bits,
/// depend on its own keys only; a row over fewer keys is never split. A deep prompt's tiles
/// run their ranges in parallel. On the H200 (8B, pp512 after 16k tokens) ranges of 2,048 and
/// of 4,096 keys ran f16 at the same speed (4,117 and 4,111 t/s: the kernel is bound per
/// multiprocessor, not by the blocks in flight) and tq8 9% slower with 2,048 (each block
/// rotates its rows' q and loads the levels).
pub(crate) const FLASH_RANGE_KEYS: usize = 4096;

/// The shapes attention takes (head dims of [`HEAD_DIMS`]), in either mode.
pub(crate) fn check_attention(
    q: &CudaBuf,
    kv: &CudaKv,
    a: &AttnParams,
    n: usize,
    out: &CudaBuf,
) -> Result<()> {
    let hd = a.head_dim;
    check("attention", HEAD_DIMS.contains(&hd), || {
        format!("head dim {hd} (built: {HEAD_DIMS:?})")
    })?;
    check(
        "attention",
        a.n_head.is_multiple_of(a.n_head_kv.max(1)) && a.n_head_kv * hd == kv.kv_dim,
        || "head counts".into(),
    )?;
    check(
        "attention",
        q.len >= n * a.n_head * hd && out.len >= n * a.n_head * hd,
        || "buffers too small".into(),
    )
}

impl CudaBackend {
    /// The fast path's attention over the step's `n` > 0 rows (shapes checked by the caller),
    /// on the kernel table's family (plan.rs `attention`): steps with prompt tiles on the
    /// flash kernel (any cache type; their decode rows on the KV-group kernel), the others on
    /// the KV-group kernel, or the split-K kernel per head for head dims it lacks (and for
    /// every step with fixed `attention_splits`: tests).
    pub(crate) fn attention_fast(
        &self,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        if self.cfg.attention_splits.is_some() {
            return self.attention_kvq(st, q, kv, a, out);
        }
        let family = plan::attention(a.head_dim, st.ctx.tiles.is_some());
        match (family, st.ctx.tiles) {
            (Attention::Flash, Some((tiles, n_tiles))) => {
                // A mixed step's decode rows on the KV-group kernel, as in decode steps; the
                // flash kernel then takes the prompt rows' tiles only.
                let n_tiles = match st.ctx.decode_rows {
                    Some(d)
                        if d.count > 0 && plan::attention(a.head_dim, false) == Attention::Kvd =>
                    {
                        self.attention_kvd(st, q, kv, a, out, Some((d.list, d.count)))?;
                        d.prompt_tiles
                    }
                    _ => n_tiles,
                };
                self.attention_flash(q, kv, a, out, st, (tiles, n_tiles))
            }
            (Attention::Kvd, _) => self.attention_kvd(st, q, kv, a, out, None),
            _ => self.attention_kvq(st, q, kv, a, out),
        }
    }

    /// The flash kernel over `tiles` (device address, count) and, where rows span several key
    /// ranges, flash_merge: launches of as many tiles as [`FLASH_PART_BYTES`] of partials hold.
    #[allow(clippy::too_many_arguments)]
    fn attention_flash(
        &self,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
        st: &Step<CudaStep>,
        (tiles, n_tiles): (u64, usize),
    ) -> Result<()> {
        let hd = a.head_dim;
        let max_kv = st.batch.seqs.iter().map(|s| s.kv_len).max().unwrap_or(0);
        let i = FLASH_HEAD_DIMS.iter().position(|&d| d == hd).unwrap_or(0);
        // Head dim 256 runs 32 query rows per block: two blocks per 64-token tile.
        let parts = if hd == 256 { 2 } else { 1 };
        let rk = FLASH_RANGE_KEYS;
        let n_ranges = max_kv.div_ceil(rk).max(1);
        let per_tile = 64 * a.n_head * n_ranges * (hd + 2) * 4;
        let (group, part) = if n_ranges > 1 {
            let group = (FLASH_PART_BYTES / per_tile).clamp(1, n_tiles.max(1));
            let p = self.scratch_ptr(|s| &mut s.part, group * per_tile, "attention partials")?;
            (group, p)
        } else {
            (n_tiles.max(1), 0)
        };
        let window = a.window.map(|w| w as i32).unwrap_or(0);
        let wgmma = plan::flash_on_wgmma(self.dev.info.arch, kv.types);
        // fwg's producer brings whole tiles of an f16 cache by the tensor memory accelerator:
        // boxes of one cache block's keys × 64 halves of one KV head, 128-byte swizzled (fwg.cu
        // FwgLayout); the other types' it decodes.
        let maps = if wgmma && !kv.packed() && hd.is_multiple_of(64) {
            let map = |ptr| {
                tensor_map(
                    ds::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                    ptr,
                    &[hd as u64, a.n_head_kv as u64, kv.n_slots as u64],
                    &[hd as u64 * 2, kv.kv_dim as u64 * 2],
                    &[64, 1, quiver_backend::KV_BLOCK_SIZE as u32],
                    ds::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                )
            };
            (map(kv.k.ptr)?, map(kv.v.ptr)?)
        } else {
            (TMap::default(), TMap::default())
        };
        for t0 in (0..n_tiles).step_by(group) {
            let c = (n_tiles - t0).min(group);
            let tl = tiles + 16 * t0 as u64;
            if wgmma {
                // A KV group's heads in blocks of 128 rows (fwg.cu): ceil(G / 2) per KV head.
                let g = a.n_head / a.n_head_kv.max(1);
                self.launch_smem(
                    &kv.module,
                    FWG_ATTENTION[i],
                    (
                        c as u32,
                        (a.n_head_kv * g.div_ceil(2)) as u32,
                        n_ranges as u32,
                    ),
                    (384, 1, 1),
                    plan::fwg_smem(hd, kv.types) as u32,
                    args![
                        maps.0,
                        maps.1,
                        q.ptr(),
                        kv.k.ptr,
                        kv.v.ptr,
                        out.ptr(),
                        part,
                        tl,
                        st.ctx.view,
                        kv.tq,
                        a.n_head as i32,
                        a.n_head_kv as i32,
                        a.scale,
                        window,
                        a.softcap.unwrap_or(0.0),
                        rk as i32,
                        n_ranges as i32
                    ],
                )?;
            } else {
                self.launch(
                    &kv.module,
                    FLASH_ATTENTION[i],
                    (c as u32, a.n_head as u32, (parts * n_ranges) as u32),
                    (128, 1, 1),
                    args![
                        q.ptr(),
                        kv.k.ptr,
                        kv.v.ptr,
                        out.ptr(),
                        part,
                        tl,
                        st.ctx.view,
                        kv.tq,
                        a.n_head as i32,
                        a.n_head_kv as i32,
                        a.scale,
                        window,
                        a.softcap.unwrap_or(0.0),
                        rk as i32,
                        n_ranges as i32
                    ],
                )?;
            }
            if n_ranges > 1 {
                self.launch(
                    &kv.module,
                    FLASH_MERGE[i],
                    (a.n_head as u32, c as u32, 64),
                    (hd as u32, 1, 1),
                    args![
                        part,
                        out.ptr(),
                        tl,
                        st.ctx.view,
                        kv.tq,
                        a.n_head as i32,
                        window,
                        rk as i32,
                        n_ranges as i32
                    ],
                )?;
            }
        }
        Ok(())
    }

    pub(crate) fn n_split(&self, rows: usize, n_head: usize, n_slots: usize) -> usize {
        self.cfg
            .attention_splits
            .unwrap_or_else(|| attention_splits(rows * n_head, self.dev.info.sms as usize, n_slots))
    }
}

/// How many key ranges the split-K attention kernel cuts each (token, head) into: enough
/// blocks of 4 warps for about 16 per multiprocessor (each warp walks its keys one at a time, so
/// short walks on many warps hide the memory latency), each range at least 32 keys of the
/// `n_slots` the cache holds. Fixed by the shapes alone, so a captured graph stays valid.
pub(crate) fn attention_splits(blocks: usize, sms: usize, n_slots: usize) -> usize {
    let target = 16 * sms;
    target
        .div_ceil(blocks.max(1))
        .clamp(1, n_slots.div_ceil(32).clamp(1, 64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_splits_fill_the_device_and_keep_ranges_of_32_keys() {
        // One token, 32 heads on 132 SMs: 66 ranges, but no more than the cache's 32-key runs.
        assert_eq!(attention_splits(32, 132, 4096), 64);
        assert_eq!(attention_splits(32, 132, 640), 20);
        assert_eq!(attention_splits(32, 132, 16), 1);
        // 64 tokens × 32 heads nearly fill the device: two ranges; 128 tokens: one.
        assert_eq!(attention_splits(2048, 132, 4096), 2);
        assert_eq!(attention_splits(4096, 132, 4096), 1);
        assert_eq!(attention_splits(0, 132, 4096), 64);
    }
}
