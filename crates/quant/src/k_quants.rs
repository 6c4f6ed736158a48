//! K-quants: 256-element super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K) — layouts and
//! dequantization. The reference quantizers live in `k_search`.
//!
//! Element order, shared by the 2/3/6-bit types: the super-block is two halves of 128; in
//! half `n`, element `128n + 32j + l` (j = 0..4, l = 0..32) sits in bits `2j..2j+2` of
//! `qs[32n + l]`. Q4_K/Q5_K use four chunks of 64: element `64j + l` is the low nibble of
//! `qs[32j + l]` and element `64j + 32 + l` its high nibble.

use crate::{f16_to_f32, impl_block, GgmlType};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of the packed 6-bit scales and mins of Q4_K/Q5_K (and of Q3_K's 6-bit scales).
pub const K_SCALE_SIZE: usize = 12;

/// `x = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4)`, q 2 bits, 16 sub-blocks of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ2K {
    /// Low nibble: scale, high nibble: min, per sub-block of 16.
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

/// `x = d * (scale[s] - 32) * (q - 4 * !hbit)`, q 2 bits plus a high bit, 16 sub-blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ3K {
    /// High bit of element `32b + l` in bit `b` of `hmask[l]`.
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    /// 16 six-bit scales: see [`q3_k_scales`].
    pub scales: [u8; K_SCALE_SIZE],
    pub d: [u8; 2],
}

/// `x = d * sc[s] * q - dmin * m[s]`, q 4 bits, 8 sub-blocks of 32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// 8 six-bit scales and 8 six-bit mins: see [`get_scale_min_k4`].
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// As Q4_K with a fifth bit: element `64j + l` has it in bit `2j`, element `64j + 32 + l`
/// in bit `2j + 1`, of `qh[l]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// `x = d * scales[s] * (q - 32)`, q 6 bits (4 in `ql`, 2 in `qh`), 16 signed 8-bit scales.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    /// i8 scales.
    pub scales: [u8; QK_K / 16],
    pub d: [u8; 2],
}

/// `x = d * q` with an f32 scale; `bsums` (16 little-endian i16) are the sums of each group
/// of 16 quants, used by dot products.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8K {
    /// f32 scale, little-endian.
    pub d: [u8; 4],
    pub qs: [u8; QK_K],
    pub bsums: [u8; QK_K / 16 * 2],
}

impl_block!(BlockQ2K, GgmlType::Q2_K, QK_K, 84);
impl_block!(BlockQ3K, GgmlType::Q3_K, QK_K, 110);
impl_block!(BlockQ4K, GgmlType::Q4_K, QK_K, 144);
impl_block!(BlockQ5K, GgmlType::Q5_K, QK_K, 176);
impl_block!(BlockQ6K, GgmlType::Q6_K, QK_K, 210);
impl_block!(BlockQ8K, GgmlType::Q8_K, QK_K, 292);

/// Scale and min (6 bits each) of sub-block `j` (0..8) of Q4_K/Q5_K. Sub-blocks 0..4 keep
/// them in the low 6 bits of bytes `j` and `j + 4`; sub-blocks 4..8 keep the low 4 bits in
/// byte `j + 4` (scale low nibble, min high nibble) and the top 2 bits in the top bits of
/// bytes `j - 4` (scale) and `j` (min).
#[inline(always)]
pub fn get_scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 signed scales of a Q3_K block (6-bit values minus 32). Scale `j` has its low 4
/// bits in the low (j < 8) or high (j >= 8) nibble of byte `j % 8` and its top 2 bits in
/// bits `2 (j / 4)` of byte `8 + j % 4`.
#[inline(always)]
pub fn q3_k_scales(s: &[u8; K_SCALE_SIZE]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

pub fn dequantize_q2_k(blocks: &[BlockQ2K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        for (n, (y, qs)) in y
            .chunks_exact_mut(128)
            .zip(b.qs.chunks_exact(32))
            .enumerate()
        {
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let shift = 2 * j;
                for (h, y) in y.chunks_exact_mut(16).enumerate() {
                    let sc = b.scales[8 * n + 2 * j + h];
                    let dl = d * (sc & 0xf) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    for (y, &q) in y.iter_mut().zip(&qs[16 * h..16 * h + 16]) {
                        *y = dl * ((q >> shift) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q3_k(blocks: &[BlockQ3K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let scales = q3_k_scales(&b.scales);
        for (n, (y, qs)) in y
            .chunks_exact_mut(128)
            .zip(b.qs.chunks_exact(32))
            .enumerate()
        {
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let shift = 2 * j;
                let hbit = 4 * n + j;
                for (h, y) in y.chunks_exact_mut(16).enumerate() {
                    let dl = d * scales[8 * n + 2 * j + h] as f32;
                    let qs = &qs[16 * h..16 * h + 16];
                    let hm = &b.hmask[16 * h..16 * h + 16];
                    for l in 0..16 {
                        let low = ((qs[l] >> shift) & 3) as i32;
                        let sub = if (hm[l] >> hbit) & 1 == 1 { 0 } else { 4 };
                        y[l] = dl * (low - sub) as f32;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q4_k(blocks: &[BlockQ4K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        for (j, (y, qs)) in y
            .chunks_exact_mut(64)
            .zip(b.qs.chunks_exact(32))
            .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = y.split_at_mut(32);
            for l in 0..32 {
                lo[l] = d1 * (qs[l] & 0xf) as f32 - m1;
                hi[l] = d2 * (qs[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5_k(blocks: &[BlockQ5K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        for (j, (y, qs)) in y
            .chunks_exact_mut(64)
            .zip(b.qs.chunks_exact(32))
            .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = y.split_at_mut(32);
            for l in 0..32 {
                let h1 = ((b.qh[l] >> (2 * j)) & 1) << 4;
                let h2 = ((b.qh[l] >> (2 * j + 1)) & 1) << 4;
                lo[l] = d1 * ((qs[l] & 0xf) | h1) as f32 - m1;
                hi[l] = d2 * ((qs[l] >> 4) | h2) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q6_k(blocks: &[BlockQ6K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for n in 0..2 {
            let y = &mut y[128 * n..128 * n + 128];
            let ql = &b.ql[64 * n..64 * n + 64];
            let qh = &b.qh[32 * n..32 * n + 32];
            let sc = &b.scales[8 * n..8 * n + 8];
            // Element 32k + l (k = 0..4): low nibble from ql[l + 32 (k & 1)] (high nibble for
            // k >= 2), top two bits from bits 2k of qh[l].
            for k in 0..4 {
                let nib_shift = 4 * (k / 2);
                let ql = &ql[32 * (k % 2)..32 * (k % 2) + 32];
                for h in 0..2 {
                    let dl = d * (sc[2 * k + h] as i8) as f32;
                    for l in 16 * h..16 * h + 16 {
                        let q = ((ql[l] >> nib_shift) & 0xf) | (((qh[l] >> (2 * k)) & 3) << 4);
                        y[32 * k + l] = dl * (q as i32 - 32) as f32;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q8_k(blocks: &[BlockQ8K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes(b.d);
        for (y, &q) in y.iter_mut().zip(b.qs.iter()) {
            *y = d * (q as i8) as f32;
        }
    }
}
