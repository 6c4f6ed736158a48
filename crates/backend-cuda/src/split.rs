//! Split-K qmm products (kernels/qmm.cu with grid z, kernels/ops.cu `sum_splits`): how many
//! parts a product takes.

use crate::products::{QMM_BM, QMM_BN};

/// The split-K products' partials at most (a step's largest split product: 8B gate·up at 64
/// tokens, 2 × 64 × 14336 floats, is 7 MiB); a split that would need more takes fewer parts.
pub(crate) const QSPLIT_BYTES: usize = 16 << 20;

/// Parts of a qmm product over `n` tokens of a `rows` × `cols` weight on `sms`
/// multiprocessors: enough for ~2 blocks per multiprocessor where the tiles alone give fewer,
/// each part at least 2 chunks of 256 columns, the partials within [`QSPLIT_BYTES`].
pub(crate) fn qmm_splits(n: usize, rows: usize, cols: usize, sms: usize) -> usize {
    let tiles = n.div_ceil(QMM_BN) * rows.div_ceil(QMM_BM);
    let chunks = cols.div_ceil(256);
    let by_room = QSPLIT_BYTES / (n * rows * 4).max(1);
    (2 * sms)
        .div_ceil(tiles)
        .min(chunks / 2)
        .min(by_room)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::qmm_splits;

    #[test]
    fn qmm_splits_fill_the_device_only_where_the_tiles_do_not() {
        // The 8B shape on 132 multiprocessors at 64 tokens: k / v (16 tiles) in 8 parts of 2
        // chunks, down (64 tiles, 56 chunks) in 5, gate (224 tiles) in 2.
        assert_eq!(qmm_splits(64, 1024, 4096, 132), 8);
        assert_eq!(qmm_splits(64, 4096, 14336, 132), 5);
        assert_eq!(qmm_splits(64, 14336, 4096, 132), 2);
        // A prompt of 512 fills it: no split; nor a row of fewer than 4 chunks.
        assert_eq!(qmm_splits(512, 14336, 4096, 132), 1);
        assert_eq!(qmm_splits(64, 64, 768, 132), 1);
        // The partials stay within their scratch: 128 tokens of 131072 rows take one part.
        assert_eq!(qmm_splits(128, 131072, 8192, 132), 1);
        assert!(qmm_splits(64, 16384, 65536, 132) * 64 * 16384 * 4 <= super::QSPLIT_BYTES);
    }
}
