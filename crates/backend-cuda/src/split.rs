//! Split-K products: a product whose tiles leave multiprocessors idle is split over whole
//! 256-column chunks (kernels/qmm.cu and imm.cu take their part from grid z). qmm's parts are
//! floats that a second kernel adds in order (`sum_splits`: not batch invariant, never in the
//! invariant mode); imm's are the exact-sum order's 64-bit integers, which the last part of
//! each tile to finish adds and turns into floats (imm.cu `imm_store`): the same bits however
//! the columns are split, so imm splits in every mode.

use crate::launch::grid1;
use crate::qmm::{QMM_BM, QMM_BN};
use crate::weights::CudaWeight;
use crate::CudaBackend;
use quiver_backend::Numerics;
use quiver_backend::Result;

/// The split-K products' partials at most (a step's largest split product: 8B gate·up at 64
/// tokens, 2 × 64 × 14336 floats, is 7 MiB); a split that would need more takes fewer parts.
pub(crate) const QSPLIT_BYTES: usize = 16 << 20;

/// Parts of a product over `n` tokens of a `rows` × `cols` weight on `sms` multiprocessors:
/// qmm's (float parts) enough for ~2 blocks per multiprocessor where the tiles alone give
/// fewer (rounded up), each part at least 2 chunks of 256 columns, the partials within
/// [`QSPLIT_BYTES`]; imm's (64-bit parts, added by each tile's last part) as many as fit 2
/// blocks per multiprocessor (rounded down: 8B Q4_K_M at 64 / 128 sequences 4,081 / 4,808
/// t/s rounded up, 4,677 / 5,004 down, on the H200), each part at least 2 chunks, or
/// one in rows of fewer than 8 (a small model's products: SmolLM2's q/k/v at 64 tokens in 3
/// parts, not 1).
pub(crate) fn qmm_splits(n: usize, rows: usize, cols: usize, sms: usize, parts: Parts) -> usize {
    let tiles = n.div_ceil(QMM_BN) * rows.div_ceil(QMM_BM);
    let chunks = cols.div_ceil(256);
    match parts {
        Parts::Float => (2 * sms)
            .div_ceil(tiles)
            .min(chunks / 2)
            .min(QSPLIT_BYTES / (n * rows * 4).max(1)),
        Parts::Exact => (2 * sms / tiles).min(if chunks < 8 { chunks } else { chunks / 2 }),
    }
    .max(1)
}

/// A split product's partial sums: floats (qmm) or the exact-sum order's integers (imm).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parts {
    Float,
    Exact,
}

impl CudaBackend {
    /// True when products may split over their columns: qmm with [`Numerics::Fast`] (the
    /// kernel table's `Qmm { split: true }`), imm in every mode (its parts are integers).
    pub(crate) fn split_on(&self, parts: Parts) -> bool {
        parts == Parts::Exact || self.cfg.numerics == Numerics::Fast
    }

    /// True when qmm's partials' scratch is needed (reserved at load).
    pub(crate) fn split_scratch(&self) -> bool {
        self.split_on(Parts::Float)
    }

    /// imm's parts for `w` over `n` tokens, and when split its partials and tile counters.
    pub(crate) fn exact_splits(&self, w: &CudaWeight, n: usize) -> Result<(usize, u64, u64)> {
        match self.splits(w, n, Parts::Exact) {
            1 => Ok((1, 0, 0)),
            s => {
                let (part, cnt) = self.exact_parts()?;
                Ok((s, part, cnt))
            }
        }
    }

    /// imm's split partials (one i64 per output of a tile and part) and tile counters, the
    /// counters made zeroed (at load when `int8_mma`; the last part of each tile leaves its
    /// counter at zero). A split product has at most 2·sms parts × tiles (`qmm_splits`' Exact
    /// rule), so at most one tile per multiprocessor: room for that many tiles' partials, one
    /// counter per multiprocessor.
    pub(crate) fn exact_parts(&self) -> Result<(u64, u64)> {
        let sms = self.dev.info.sms as usize;
        let (parts, counters) = (2 * sms * QMM_BM * QMM_BN * 8, sms * 4);
        let a = self.scratch_ptr(|s| &mut s.epart, parts, "split partials")?;
        let (c, _) = self.zeroed_scratch(|s| &mut s.ecnt, counters, "split counters")?;
        Ok((a, c))
    }

    /// Parts of a product of `w` over `n` tokens (1: not split).
    pub(crate) fn splits(&self, w: &CudaWeight, n: usize, parts: Parts) -> usize {
        if !self.split_on(parts) {
            return 1;
        }
        qmm_splits(n, w.rows, w.cols, self.dev.info.sms as usize, parts)
    }

    /// Where a qmm product of `splits` parts writes: y itself, or the partials' scratch.
    pub(crate) fn split_out(&self, splits: usize, n: usize, rows: usize, y: u64) -> Result<u64> {
        if splits <= 1 {
            return Ok(y);
        }
        self.scratch_ptr(|s| &mut s.qpart, splits * n * rows * 4, "product partials")
    }

    /// y = the sum of qmm's `splits` partials at `out`, in order (nothing when not split).
    pub(crate) fn split_sum(
        &self,
        splits: usize,
        n: usize,
        rows: usize,
        out: u64,
        y: u64,
    ) -> Result<()> {
        if splits <= 1 {
            return Ok(());
        }
        let len = n * rows;
        self.launch(
            "ops",
            "sum_splits",
            (grid1(len, 256, 4096), 1, 1),
            (256, 1, 1),
            args![out, splits as i32, len as i64, y],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{qmm_splits, Parts};
    const F: Parts = Parts::Float;
    const E: Parts = Parts::Exact;

    #[test]
    fn qmm_splits_fill_the_device_only_where_the_tiles_do_not() {
        // The 8B shape on 132 multiprocessors at 64 tokens: k / v (16 tiles) in 8 parts of 2
        // chunks, down (64 tiles, 56 chunks) in 5, gate (224 tiles) in 2.
        assert_eq!(qmm_splits(64, 1024, 4096, 132, F), 8);
        assert_eq!(qmm_splits(64, 4096, 14336, 132, F), 5);
        assert_eq!(qmm_splits(64, 14336, 4096, 132, F), 2);
        // imm's parts within two blocks per multiprocessor: down in 4, gate whole.
        assert_eq!(qmm_splits(64, 1024, 4096, 132, E), 8);
        assert_eq!(qmm_splits(64, 4096, 14336, 132, E), 4);
        assert_eq!(qmm_splits(64, 14336, 4096, 132, E), 1);
        // A prompt of 512 fills it: no split; nor a row of fewer than 4 chunks.
        assert_eq!(qmm_splits(512, 14336, 4096, 132, F), 1);
        assert_eq!(qmm_splits(64, 64, 768, 132, F), 1);
        // imm's parts may be one chunk: SmolLM2's q/k/v (960 × 576) and down (576 × 1536).
        assert_eq!(qmm_splits(64, 960, 576, 132, E), 3);
        assert_eq!(qmm_splits(64, 576, 1536, 132, E), 6);
        // The partials stay within their scratch: 128 tokens of 131072 rows take one part;
        // imm's within exact_parts' room of 2·sms tiles.
        assert_eq!(qmm_splits(128, 131072, 8192, 132, F), 1);
        assert!(qmm_splits(64, 16384, 65536, 132, F) * 64 * 16384 * 4 <= super::QSPLIT_BYTES);
        for (n, rows, cols) in [(64usize, 960usize, 576), (128, 4096, 14336), (9, 64, 65536)] {
            let tiles = n.div_ceil(super::QMM_BN) * rows.div_ceil(super::QMM_BM);
            assert!(qmm_splits(n, rows, cols, 132, E) * tiles <= 2 * 132);
        }
    }
}
