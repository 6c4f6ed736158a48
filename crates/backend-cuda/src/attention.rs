//! Attention's dispatch: the tensor-core flash kernel (kernels/attn.cu) for prefill-shaped
//! steps over an f16 cache, the kernels of kvq.rs otherwise. The fast path only: the parity
//! mode's is in src/exact.rs.

use crate::batch::CudaStep;
use crate::memory::{CudaBuf, CudaKv};
use crate::{check, CudaBackend};
use quiver_backend::{AttnParams, Result, Step};

/// Head dims the attention kernels are built for (the flash kernels: up to 256).
pub(crate) const HEAD_DIMS: &[usize] = &[64, 96, 128, 256, 512];

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
    /// The fast path's attention over the step's `n` > 0 rows (shapes checked by the caller):
    /// decode-sized steps on the KV-group kernel, prompts over an f16 cache on the flash
    /// kernel, the rest on the split-K kernel per head (kvq.rs).
    pub(crate) fn attention_fast(
        &self,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        if self.use_kvd(st, kv, a) {
            return self.attention_kvd(st, q, kv, a, out, None);
        }
        let hd = a.head_dim;
        match st.ctx.tiles {
            Some((tiles, n_tiles))
                if !kv.packed() && (hd < 256 || (hd == 256 && self.cfg.flash_256)) =>
            {
                // A mixed step's decode rows on the KV-group kernel, as in decode steps; the
                // flash kernel then takes the prompt rows' tiles only.
                let n_tiles = match st.ctx.decode_rows {
                    Some(d) if self.kvd_takes(d.count, a) => {
                        self.attention_kvd(st, q, kv, a, out, Some((d.list, d.count)))?;
                        d.prompt_tiles
                    }
                    _ => n_tiles,
                };
                // Head dim 256 runs 32 query rows per block: two blocks per 64-token tile.
                let (name, parts) = match hd {
                    64 => ("flash_attention_64", 1),
                    96 => ("flash_attention_96", 1),
                    128 => ("flash_attention_128", 1),
                    _ => ("flash_attention_256", 2),
                };
                self.launch(
                    "attn",
                    name,
                    (n_tiles as u32, a.n_head as u32, parts),
                    (128, 1, 1),
                    args![
                        q.ptr(),
                        kv.k.ptr,
                        kv.v.ptr,
                        out.ptr(),
                        tiles,
                        st.ctx.view,
                        a.n_head as i32,
                        a.n_head_kv as i32,
                        a.scale,
                        a.window.map(|w| w as i32).unwrap_or(0),
                        a.softcap.unwrap_or(0.0)
                    ],
                )
            }
            _ => self.attention_kvq(st, q, kv, a, out),
        }
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
