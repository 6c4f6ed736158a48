//! The logits read back as ids (ops.cu `argmax_rows`, `topk_rows`): greedy decoding and top-k
//! sampling copy a few values per row instead of the row. Comparisons only, so the parity mode
//! runs them too; so does constrained decoding's masking (`mask_rows`).

use crate::memory::CudaBuf;
use crate::{check, CudaBackend};
use quiver_backend::{BackendError, Result};

/// `argmax_rows` takes blocks of at least this many columns of a row, at most `ARGMAX_BLOCKS`
/// of them (a vocabulary of 128k: 32 blocks of 4k, where one block of 1,024 threads took 16.5
/// µs on an H100, Nsight Compute).
const ARGMAX_CHUNK: usize = 4096;
const ARGMAX_BLOCKS: usize = 32;

/// Bytes of `argmax_rows`' partials and counters for `rows` rows.
pub(crate) fn argmax_bytes(rows: usize) -> usize {
    rows * (ARGMAX_BLOCKS * 8 + 4)
}

impl CudaBackend {
    /// The `k` largest values of each row as (index, value), best first (`Backend::top_k`).
    pub(crate) fn top_k_rows(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        check("top_k", rows * cols <= x.len && k >= 1, || {
            format!("{rows}×{cols} > {} or k = {k}", x.len)
        })?;
        if rows == 0 {
            out.clear();
            return Ok(());
        }
        let n = rows * k;
        let ids = self.scratch_ptr(|s| &mut s.top_ids, n * 4, "top-k ids")?;
        let vals = self.scratch_ptr(|s| &mut s.top_vals, n * 4, "top-k values")?;
        self.launch(
            "ops",
            "topk_rows",
            (rows as u32, 1, 1),
            (1024, 1, 1),
            args![x.ptr(), ids, vals, cols as i32, k as i32],
        )?;
        let mut st = self.top_host.lock().unwrap();
        let (hi, hv) = &mut *st;
        hi.resize(n, 0);
        hv.resize(n, 0.0);
        self.dev.dtoh(hi, ids).map_err(BackendError::Device)?;
        self.dev.dtoh(hv, vals).map_err(BackendError::Device)?;
        out.clear();
        out.extend(hi.iter().copied().zip(hv.iter().copied()));
        Ok(())
    }

    /// `argmax_rows`' partials ([rows, ARGMAX_BLOCKS] values, then indices) and per-row
    /// counters, made zeroed (the last block of a row leaves its counter at zero).
    pub(crate) fn argmax_parts(&self, rows: usize) -> Result<(u64, u64)> {
        let (a, len) =
            self.zeroed_scratch(|s| &mut s.amax, argmax_bytes(rows), "argmax partials")?;
        // The counters after the partials of as many rows as the buffer holds.
        let held = len / (ARGMAX_BLOCKS * 8 + 4);
        Ok((a, a + (held * ARGMAX_BLOCKS * 8) as u64))
    }

    /// The index of the largest value of each row, the first on ties (`Backend::argmax`).
    pub(crate) fn argmax_rows(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        check("argmax", rows * cols <= x.len, || {
            format!("{rows}×{cols} > {}", x.len)
        })?;
        if rows == 0 {
            out.clear();
            return Ok(());
        }
        let ids = self.scratch_ptr(|s| &mut s.ids, rows * 4, "argmax ids")?;
        // Blocks of at least ARGMAX_CHUNK columns (whole float4s), at most ARGMAX_BLOCKS a row.
        let p = cols.div_ceil(ARGMAX_CHUNK).clamp(1, ARGMAX_BLOCKS);
        let chunk = cols.div_ceil(p).div_ceil(4) * 4;
        let (part, count) = if p > 1 {
            self.argmax_parts(rows)?
        } else {
            (0, 0)
        };
        self.launch(
            "ops",
            "argmax_rows",
            (rows as u32, p as u32, 1),
            (256, 1, 1),
            args![x.ptr(), ids, cols as i32, chunk as i32, part, count],
        )?;
        out.resize(rows, 0);
        self.dev.dtoh(out, ids).map_err(BackendError::Device)
    }

    /// Constrained decoding's masks (`Backend::mask_rows`): the rows and bits go up in one
    /// copy, one launch refuses the columns.
    pub(crate) fn mask_logit_rows(
        &self,
        x: &CudaBuf,
        cols: usize,
        masks: &[(usize, &[u32])],
    ) -> Result<()> {
        if masks.is_empty() {
            return Ok(());
        }
        let words = cols.div_ceil(32);
        for &(row, _) in masks {
            check("mask_rows", (row + 1) * cols <= x.len, || {
                format!("row {row} of {cols} past {}", x.len)
            })?;
        }
        let mut host = vec![0u32; masks.len() * (words + 1)];
        let (rows, bits) = host.split_at_mut(masks.len());
        for (m, &(row, b)) in masks.iter().enumerate() {
            rows[m] = row as u32;
            let n = b.len().min(words);
            bits[m * words..][..n].copy_from_slice(&b[..n]);
        }
        let dev = self.scratch_ptr(|s| &mut s.masks, host.len() * 4, "token masks")?;
        self.dev
            .htod_async(dev, &host)
            .map_err(BackendError::Device)?;
        self.launch(
            "ops",
            "mask_rows",
            (cols.div_ceil(256) as u32, masks.len() as u32, 1),
            (256, 1, 1),
            args![
                x.ptr(),
                dev + masks.len() as u64 * 4,
                dev,
                words as i32,
                cols as i32
            ],
        )
    }
}

/// Bytes of the mask scratch for `rows` masks of `cols` columns.
pub(crate) fn mask_bytes(rows: usize, cols: usize) -> usize {
    rows * (cols.div_ceil(32) + 1) * 4
}
