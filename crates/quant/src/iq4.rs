//! 4-bit non-linear quants: IQ4_NL (32-element blocks) and IQ4_XS (256-element super-blocks
//! with 6-bit sub-block scales). Each 4-bit index selects a value of [`KVALUES_IQ4NL`].
//!
//! Nibble order within each 32 elements: byte `j` holds element `j` (low nibble) and `j + 16`
//! (high nibble). The quantizer is ggml's `quantize_row_iq4_nl_impl` best-scale search with
//! 7 tries each way and no importance matrix (what `quantize_iq4_nl` / `quantize_iq4_xs` do
//! for `llama-quantize` without an imatrix), reproduced bit for bit.

use crate::k_quants::QK_K;
use crate::k_search::{nearest_int, GROUP_MAX_EPS};
use crate::{f16_to_f32, f32_to_f16, impl_block, GgmlType};

pub const QK4_NL: usize = 32;

/// The IQ4_NL codebook (shared by IQ4_XS).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Tries of the scale search on each side of the initial guess.
const NTRY: i32 = 7;

/// `x = d * KVALUES_IQ4NL[q]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIq4Nl {
    pub d: [u8; 2],
    pub qs: [u8; QK4_NL / 2],
}

/// `x = d * (ls[s] - 32) * KVALUES_IQ4NL[q]` for sub-block `s` of 32; `ls` is 6 bits: low 4
/// in nibble `s % 2` of `scales_l[s / 2]`, high 2 in bits `2s` of the little-endian u16
/// `scales_h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIq4Xs {
    pub d: [u8; 2],
    pub scales_h: [u8; 2],
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

impl_block!(BlockIq4Nl, GgmlType::IQ4_NL, QK4_NL, 18);
impl_block!(BlockIq4Xs, GgmlType::IQ4_XS, QK_K, 136);

/// Decodes 32 elements from 16 bytes with scale `d`.
#[inline(always)]
fn decode32(d: f32, qs: &[u8], y: &mut [f32]) {
    let (lo, hi) = y.split_at_mut(16);
    for j in 0..16 {
        lo[j] = d * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f32;
        hi[j] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

pub fn dequantize_iq4_nl(blocks: &[BlockIq4Nl], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK4_NL)) {
        decode32(f16_to_f32(b.d), &b.qs, y);
    }
}

/// The 6-bit scale (0..64) of sub-block `ib` of an IQ4_XS block.
#[inline(always)]
pub fn iq4_xs_scale(b: &BlockIq4Xs, ib: usize) -> i32 {
    let h = u16::from_le_bytes(b.scales_h);
    let low = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf;
    let high = ((h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32
}

pub fn dequantize_iq4_xs(blocks: &[BlockIq4Xs], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for (ib, (y, qs)) in y
            .chunks_exact_mut(32)
            .zip(b.qs.chunks_exact(16))
            .enumerate()
        {
            let dl = d * (iq4_xs_scale(b, ib) - 32) as f32;
            decode32(dl, qs, y);
        }
    }
}

/// Index of the codebook value nearest to `x`; a tie goes to the larger value (as in ggml).
#[inline(always)]
fn best_index(x: f32) -> u8 {
    let v = &KVALUES_IQ4NL;
    if x <= v[0] as f32 {
        return 0;
    }
    if x >= v[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (v[hi - 1] as f32) < (v[hi] as f32) - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// Best scale for one group of 32 (weights `x^2`), searched over `2 NTRY + 1` candidates
/// around the scale that maps the largest magnitude to the codebook's end -127.
fn best_scale(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let v0 = KVALUES_IQ4NL[0] as f32;
    // Weighted sums of the fit x ≈ d * q for the quants chosen at inverse scale `id`.
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = KVALUES_IQ4NL[best_index(id * v) as usize] as f32;
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let (sumqx, sumq2) = sums(1.0 / (-max / v0));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let id = (itry + KVALUES_IQ4NL[0] as i32) as f32 / max;
        let (sumqx, sumq2) = sums(id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Packs 32 indices in the IQ4 nibble order.
fn pack32(l: &[u8], out: &mut Vec<u8>) {
    for j in 0..16 {
        out.push(l[j] | (l[j + 16] << 4));
    }
}

pub fn quantize_block_iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    let d = best_scale(x);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut l = [0u8; QK4_NL];
    for (l, &v) in l.iter_mut().zip(x) {
        *l = best_index(id * v);
    }
    out.extend_from_slice(&f32_to_f16(d));
    pack32(&l, out);
}

pub fn quantize_block_iq4_xs(x: &[f32], out: &mut Vec<u8>) {
    let mut scales = [0f32; QK_K / 32];
    let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
    for (s, xb) in scales.iter_mut().zip(x.chunks_exact(32)) {
        *s = best_scale(xb);
        if s.abs() > amax_scale {
            amax_scale = s.abs();
            max_scale = *s;
        }
    }
    let d = -max_scale / 32.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    let mut scales_l = [0u8; QK_K / 64];
    let mut l = [0u8; QK_K];
    for (ib, (lb, xb)) in l.chunks_exact_mut(32).zip(x.chunks_exact(32)).enumerate() {
        let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for (l, &v) in lb.iter_mut().zip(xb) {
            *l = best_index(idl * v);
        }
        let ls = (ls + 32) as u8;
        scales_l[ib / 2] |= (ls & 0xf) << (4 * (ib % 2));
        scales_h |= ((ls >> 4) as u16) << (2 * ib);
    }
    out.extend_from_slice(&f32_to_f16(d));
    out.extend_from_slice(&scales_h.to_le_bytes());
    out.extend_from_slice(&scales_l);
    for chunk in l.chunks_exact(32) {
        pack32(chunk, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_index_picks_the_nearest_codebook_value() {
        assert_eq!(best_index(-1000.0), 0);
        assert_eq!(best_index(1000.0), 15);
        assert_eq!(best_index(0.0), 8);
        assert_eq!(best_index(-5.0), 7);
        assert_eq!(best_index(88.0), 14);
        // Exactly half way between -10 and 1 goes up.
        assert_eq!(best_index(-4.5), 8);
    }
}
