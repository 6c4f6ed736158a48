//! AVX2 unpacking of each block type into bytes, 32 elements per register, in the value
//! convention of `crate::decode` (narrow types unsigned, wide types signed).
//!
//! Every function here is `#[inline(always)]` and needs AVX2: it is only called from code
//! inlined into an `#[target_feature(enable = "avx2,...")]` entry point.

use crate::decode::{k4_scales_mins, Half, KQuant};
use crate::x86::kern::F16c;
use quiver_quant::{
    BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, KVALUES_IQ4NL,
};
use std::arch::x86_64::*;

/// Loads 16 bytes.
///
/// # Safety
/// AVX2; `p` points at 16 readable bytes.
#[inline(always)]
unsafe fn load16(p: *const u8) -> __m128i {
    // SAFETY: readable per the caller; unaligned load.
    unsafe { _mm_loadu_si128(p.cast()) }
}

/// Loads 32 bytes.
///
/// # Safety
/// AVX2; `p` points at 32 readable bytes.
#[inline(always)]
pub(crate) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: readable per the caller; unaligned load.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// `(v >> n) & mask` on bytes, `n` a run-time count below 8.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn shr_mask(v: __m256i, n: usize, mask: i8) -> __m256i {
    // SAFETY: AVX2 per the caller. A 16-bit shift moves bits across byte boundaries only
    // into positions the mask clears.
    unsafe {
        _mm256_and_si256(
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32)),
            _mm256_set1_epi8(mask),
        )
    }
}

/// `((v >> n) & mask) << up` on bytes (`up` moves the field to its place in the value).
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn field(v: __m256i, n: usize, mask: i8, up: i32) -> __m256i {
    // SAFETY: AVX2 per the caller; the masked field shifted by `up` stays inside its byte.
    unsafe { _mm256_sll_epi16(shr_mask(v, n, mask), _mm_cvtsi32_si128(up)) }
}

/// Bytes 0..16 low nibbles, then bytes 0..16 high nibbles: elements 0..32 of a 4-bit block.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: AVX2 per the caller; `qs` is 16 bytes.
    unsafe { nibbles_at(qs.as_ptr()) }
}

/// [`nibbles`] of the 16 bytes at `p`.
///
/// # Safety
/// AVX2; `p` points at 16 readable bytes.
#[inline(always)]
unsafe fn nibbles_at(p: *const u8) -> __m256i {
    // SAFETY: AVX2 and readable per the caller.
    unsafe {
        let x = load16(p);
        _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(x, 4), x),
            _mm256_set1_epi8(0x0f),
        )
    }
}

/// 0x10 in byte `j` where bit `j` of `qh` is set.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn fifth_bits(qh: [u8; 4]) -> __m256i {
    // SAFETY: AVX2 per the caller.
    unsafe {
        let v = _mm256_set1_epi32(u32::from_le_bytes(qh) as i32);
        // Byte j takes source byte j / 8 (the u32 is in every dword, so in both lanes).
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let b = _mm256_shuffle_epi8(v, spread);
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// `nib` with 0x10 added in byte `j` where bit `j` of `qh` is set: with AVX-512 the bits
/// are a byte mask for one masked add.
///
/// # Safety
/// AVX2, and AVX-512 BW/VL when `V`.
#[inline(always)]
unsafe fn with_fifth_bits<const V: bool>(nib: __m256i, qh: [u8; 4]) -> __m256i {
    // SAFETY: per the caller.
    unsafe {
        if V {
            _mm256_mask_add_epi8(nib, u32::from_le_bytes(qh), nib, _mm256_set1_epi8(0x10))
        } else {
            _mm256_or_si256(nib, fifth_bits(qh))
        }
    }
}

/// The IQ4_NL codebook lookup of 4-bit indices.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn codebook(idx: __m256i) -> __m256i {
    // SAFETY: AVX2 per the caller; the table is 16 bytes.
    unsafe {
        let t = _mm256_broadcastsi128_si256(load16(KVALUES_IQ4NL.as_ptr().cast()));
        _mm256_shuffle_epi8(t, idx)
    }
}

/// # Safety
/// AVX2 (all unpackers below).
#[inline(always)]
pub(crate) unsafe fn q4_0<const V: bool>(b: &BlockQ4_0) -> __m256i {
    // SAFETY: AVX2 per the caller.
    unsafe { nibbles(&b.qs) }
}

#[inline(always)]
pub(crate) unsafe fn q4_1<const V: bool>(b: &BlockQ4_1) -> __m256i {
    // SAFETY: AVX2 per the caller.
    unsafe { nibbles(&b.qs) }
}

#[inline(always)]
pub(crate) unsafe fn q5_0<const V: bool>(b: &BlockQ5_0) -> __m256i {
    // SAFETY: AVX2 (and AVX-512 BW/VL when V) per the caller.
    unsafe { with_fifth_bits::<V>(nibbles(&b.qs), b.qh) }
}

#[inline(always)]
pub(crate) unsafe fn q5_1<const V: bool>(b: &BlockQ5_1) -> __m256i {
    // SAFETY: AVX2 (and AVX-512 BW/VL when V) per the caller.
    unsafe { with_fifth_bits::<V>(nibbles(&b.qs), b.qh) }
}

#[inline(always)]
pub(crate) unsafe fn q8_0<const V: bool>(b: &BlockQ8_0) -> __m256i {
    // SAFETY: AVX2 per the caller; `qs` is 32 bytes.
    unsafe { load32(b.qs.as_ptr()) }
}

#[inline(always)]
pub(crate) unsafe fn iq4_nl<const V: bool>(b: &BlockIq4Nl) -> __m256i {
    // SAFETY: AVX2 per the caller.
    unsafe { codebook(nibbles(&b.qs)) }
}

/// Q2_K elements `64 p ..`: 2-bit fields `2 (p % 2)` and `2 (p % 2) + 1` of the half `p / 2`.
#[inline(always)]
pub(crate) unsafe fn q2_k(b: &BlockQ2K, p: usize) -> [__m256i; 2] {
    let (n, j) = (p / 2 % 2, 2 * (p % 2));
    // SAFETY: AVX2 per the caller; `32 n + 32 <= 64`.
    unsafe {
        let q = load32(b.qs.as_ptr().add(32 * n));
        [shr_mask(q, 2 * j, 3), shr_mask(q, 2 * j + 2, 3)]
    }
}

#[inline(always)]
pub(crate) unsafe fn q3_k(b: &BlockQ3K, p: usize) -> [__m256i; 2] {
    let (n, j) = (p / 2 % 2, 2 * (p % 2));
    // SAFETY: AVX2 per the caller; offsets within the 64-byte `qs`, 32-byte `hmask`.
    unsafe {
        let q = load32(b.qs.as_ptr().add(32 * n));
        let h = load32(b.hmask.as_ptr());
        [
            _mm256_or_si256(shr_mask(q, 2 * j, 3), field(h, 4 * n + j, 1, 2)),
            _mm256_or_si256(shr_mask(q, 2 * j + 2, 3), field(h, 4 * n + j + 1, 1, 2)),
        ]
    }
}

#[inline(always)]
pub(crate) unsafe fn q4_k(b: &BlockQ4K, p: usize) -> [__m256i; 2] {
    // SAFETY: AVX2 per the caller; `32 (p % 4) + 32 <= 128`.
    unsafe {
        let q = load32(b.qs.as_ptr().add(32 * (p % 4)));
        [
            _mm256_and_si256(q, _mm256_set1_epi8(0x0f)),
            shr_mask(q, 4, 0x0f),
        ]
    }
}

#[inline(always)]
pub(crate) unsafe fn q5_k(b: &BlockQ5K, p: usize) -> [__m256i; 2] {
    let p = p % 4;
    // SAFETY: AVX2 per the caller; in-bounds as in `q4_k`, `qh` is 32 bytes.
    unsafe {
        let q = load32(b.qs.as_ptr().add(32 * p));
        let h = load32(b.qh.as_ptr());
        [
            _mm256_or_si256(
                _mm256_and_si256(q, _mm256_set1_epi8(0x0f)),
                field(h, 2 * p, 1, 4),
            ),
            _mm256_or_si256(shr_mask(q, 4, 0x0f), field(h, 2 * p + 1, 1, 4)),
        ]
    }
}

/// Q6_K elements `64 p ..`: half `n = p / 2`, groups `k = 2 (p % 2)` and `k + 1`.
#[inline(always)]
pub(crate) unsafe fn q6_k(b: &BlockQ6K, p: usize) -> [__m256i; 2] {
    let (n, odd) = (p / 2 % 2, p % 2);
    // SAFETY: AVX2 per the caller; `64 n + 64 <= 128` (ql), `32 n + 32 <= 64` (qh).
    unsafe {
        let ql0 = load32(b.ql.as_ptr().add(64 * n));
        let ql1 = load32(b.ql.as_ptr().add(64 * n + 32));
        let qh = load32(b.qh.as_ptr().add(32 * n));
        [
            _mm256_or_si256(shr_mask(ql0, 4 * odd, 0x0f), field(qh, 4 * odd, 3, 4)),
            _mm256_or_si256(shr_mask(ql1, 4 * odd, 0x0f), field(qh, 4 * odd + 2, 3, 4)),
        ]
    }
}

#[inline(always)]
pub(crate) unsafe fn iq4_xs(b: &BlockIq4Xs, p: usize) -> [__m256i; 2] {
    let p = p % 4;
    // SAFETY: AVX2 per the caller; `32 p + 32 <= 128`.
    unsafe {
        let q = b.qs.as_ptr().add(32 * p);
        [codebook(nibbles_at(q)), codebook(nibbles_at(q.add(16)))]
    }
}

/// Two 4-bit blocks in element order: `[lo a, hi a, lo b, hi b]` (16 bytes each).
///
/// # Safety
/// AVX-512 F/BW; `a` and `b` point at 16 readable bytes.
#[inline(always)]
unsafe fn nibbles_x2(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: per the caller.
    unsafe {
        let y = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(a)), load16(b), 1);
        let z = _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1);
        // [a, b, a >> 4, b >> 4] -> [a, a >> 4, b, b >> 4]
        let z = _mm512_shuffle_i64x2(z, z, 0b11_01_10_00);
        _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
    }
}

/// # Safety
/// AVX-512 F/BW (all `_x2` unpackers).
#[inline(always)]
pub(crate) unsafe fn q4_0_x2(a: &BlockQ4_0, b: &BlockQ4_0) -> __m512i {
    // SAFETY: per the caller; `qs` is 16 bytes.
    unsafe { nibbles_x2(a.qs.as_ptr(), b.qs.as_ptr()) }
}

#[inline(always)]
pub(crate) unsafe fn q4_1_x2(a: &BlockQ4_1, b: &BlockQ4_1) -> __m512i {
    // SAFETY: per the caller; `qs` is 16 bytes.
    unsafe { nibbles_x2(a.qs.as_ptr(), b.qs.as_ptr()) }
}

/// 0x10 added where the fifth bit is set: the two `qh` words are the byte mask.
#[inline(always)]
unsafe fn fifth_x2(z: __m512i, qa: [u8; 4], qb: [u8; 4]) -> __m512i {
    let k = u32::from_le_bytes(qa) as u64 | (u32::from_le_bytes(qb) as u64) << 32;
    // SAFETY: AVX-512 BW per the caller.
    unsafe { _mm512_mask_add_epi8(z, k, z, _mm512_set1_epi8(0x10)) }
}

#[inline(always)]
pub(crate) unsafe fn q5_0_x2(a: &BlockQ5_0, b: &BlockQ5_0) -> __m512i {
    // SAFETY: per the caller; `qs` is 16 bytes.
    unsafe { fifth_x2(nibbles_x2(a.qs.as_ptr(), b.qs.as_ptr()), a.qh, b.qh) }
}

#[inline(always)]
pub(crate) unsafe fn q5_1_x2(a: &BlockQ5_1, b: &BlockQ5_1) -> __m512i {
    // SAFETY: per the caller; `qs` is 16 bytes.
    unsafe { fifth_x2(nibbles_x2(a.qs.as_ptr(), b.qs.as_ptr()), a.qh, b.qh) }
}

#[inline(always)]
pub(crate) unsafe fn q8_0_x2(a: &BlockQ8_0, b: &BlockQ8_0) -> __m512i {
    // SAFETY: per the caller; `qs` is 32 bytes.
    unsafe {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(load32(a.qs.as_ptr())),
            load32(b.qs.as_ptr()),
            1,
        )
    }
}

#[inline(always)]
pub(crate) unsafe fn iq4_nl_x2(a: &BlockIq4Nl, b: &BlockIq4Nl) -> __m512i {
    // SAFETY: per the caller; `qs` is 16 bytes, the table 16.
    unsafe {
        let t = _mm512_broadcast_i32x4(load16(KVALUES_IQ4NL.as_ptr().cast()));
        _mm512_shuffle_epi8(t, nibbles_x2(a.qs.as_ptr(), b.qs.as_ptr()))
    }
}

/// Even-indexed bytes, then odd-indexed.
const EVEN_ODD: [u8; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15];

/// `KQuant::scales_x86` from the portable `scales`.
///
/// # Safety
/// AVX2 + F16C.
#[inline(always)]
pub(crate) unsafe fn k_scales_generic<T: KQuant + ?Sized>(
    b: &T::B,
) -> (__m256i, __m256i, f32, f32) {
    let k = T::scales::<F16c>(b);
    // SAFETY: AVX2 per the caller; the arrays are 16 bytes.
    unsafe {
        let eo = _mm_loadu_si128(EVEN_ODD.as_ptr().cast());
        let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128(k.sc.as_ptr().cast()), eo));
        let corr = _mm256_cvtepi8_epi16(_mm_loadu_si128(k.corr.as_ptr().cast()));
        (sc, corr, k.d, k.cd)
    }
}

/// Q4_K/Q5_K: 8 scales (one per 32, so both halves of a group share it) and 8 mins.
///
/// # Safety
/// AVX2 + F16C.
#[inline(always)]
unsafe fn k4_scales_x86(
    scales: &[u8; 12],
    d: [u8; 2],
    dmin: [u8; 2],
) -> (__m256i, __m256i, f32, f32) {
    let (sc, mn) = k4_scales_mins(scales);
    // SAFETY: AVX2 per the caller.
    unsafe {
        let sc = _mm_cvtsi64_si128(i64::from_le_bytes(sc));
        let mn = _mm_cvtsi64_si128(i64::from_le_bytes(mn));
        // Even and odd halves of group g both use scale g.
        let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc));
        let corr = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));
        (sc16, corr, F16c::f32(d), -F16c::f32(dmin))
    }
}

#[inline(always)]
pub(crate) unsafe fn q4_k_scales(b: &BlockQ4K) -> (__m256i, __m256i, f32, f32) {
    // SAFETY: forwarded from the caller.
    unsafe { k4_scales_x86(&b.scales, b.d, b.dmin) }
}

#[inline(always)]
pub(crate) unsafe fn q5_k_scales(b: &BlockQ5K) -> (__m256i, __m256i, f32, f32) {
    // SAFETY: forwarded from the caller.
    unsafe { k4_scales_x86(&b.scales, b.d, b.dmin) }
}

/// Q6_K: 16 signed 8-bit scales; the correction is -32 d scale.
#[inline(always)]
pub(crate) unsafe fn q6_k_scales(b: &BlockQ6K) -> (__m256i, __m256i, f32, f32) {
    // SAFETY: AVX2 per the caller; `scales` is 16 bytes.
    unsafe {
        let raw = _mm_loadu_si128(b.scales.as_ptr().cast());
        let eo = _mm_loadu_si128(EVEN_ODD.as_ptr().cast());
        let d = F16c::f32(b.d);
        (
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(raw, eo)),
            _mm256_cvtepi8_epi16(raw),
            d,
            -32.0 * d,
        )
    }
}
