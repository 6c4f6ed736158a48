//! Decode-path dot products and GEMM decoders for x86, generic over `V`: `false` = AVX2
//! (`maddubs` + `madd`), `true` = AVX-512 VNNI on 256-bit registers (`vpdpbusd`,
//! `vpdpwssd`). Everything is `#[inline(always)]` and runs inside a `#[target_feature]`
//! entry point of `super`; the safety requirement of each function is that the CPU supports
//! AVX2 + FMA + F16C, plus AVX-512 F/BW/VL/VNNI when `V`.

use super::unpack::load32;
use crate::act::{Quant, A256, A32};
use crate::decode::{Half, KQuant, Legacy, GGML_Q4K, GGML_Q6K};
use quiver_quant::QK_K;
use std::arch::x86_64::*;

/// f16 to f32 with F16C's `vcvtph2ps`.
///
/// Only used as the `Half` of the x86 kernels, which run only inside `#[target_feature]`
/// entry points that enable F16C (both x86 levels require it), on CPUs that have it.
pub(crate) struct F16c;

impl Half for F16c {
    #[inline(always)]
    fn f32(bits: [u8; 2]) -> f32 {
        // SAFETY: F16C is available wherever this type is used (see the type's doc).
        unsafe {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes(bits) as i32
            )))
        }
    }
}

/// AVX2 activation quantization.
pub(crate) struct AvxQuant;

impl Quant for AvxQuant {
    #[inline(always)]
    unsafe fn amax(x: &[f32]) -> f32 {
        // SAFETY: AVX2 per the trait contract; each load reads 8 of x's elements.
        unsafe {
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let mut m = _mm256_setzero_ps();
            for c in x.chunks_exact(8) {
                m = _mm256_max_ps(m, _mm256_and_ps(abs, _mm256_loadu_ps(c.as_ptr())));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
        }
    }

    #[inline(always)]
    unsafe fn quant32(x: &[f32; 32], id: f32, q: &mut [i8; 32]) -> [i32; 2] {
        // SAFETY: AVX2 per the trait contract; x and q are 32 elements. `vcvtps2dq` rounds
        // to nearest even under the default MXCSR, as `round_ties_even`; the values fit i8,
        // so the saturating packs are exact.
        unsafe {
            let vid = _mm256_set1_ps(id);
            let p = x.as_ptr();
            let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), vid));
            let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8)), vid));
            let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(16)), vid));
            let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(24)), vid));
            // Packing interleaves the 128-bit lanes; the permute restores element order.
            let b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), b);
            [
                hsum_i32(_mm256_add_epi32(i0, i1)),
                hsum_i32(_mm256_add_epi32(i2, i3)),
            ]
        }
    }
}

/// Horizontal sum of 8 i32.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    // SAFETY: AVX2 per the module contract.
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}

/// `acc + sum of 4 adjacent u8 x i8 products` per i32 lane (`u` unsigned bytes of at most
/// 127 on AVX2, where `maddubs` would otherwise saturate).
#[inline(always)]
pub(crate) unsafe fn dot_u8i8<const V: bool>(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    // SAFETY: AVX2 (+ VNNI when V) per the module contract.
    unsafe {
        if V {
            _mm256_dpbusd_epi32(acc, u, s)
        } else {
            let p = _mm256_maddubs_epi16(u, s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
}

/// Signed x signed bytes: `|w| * (a with w's sign)`; `a` must not hold -128.
#[inline(always)]
pub(crate) unsafe fn dot_i8i8<const V: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    // SAFETY: as above.
    unsafe { dot_u8i8::<V>(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(a, w)) }
}

/// `acc + p16 * sc` with pairs of i16 products summed into i32 lanes.
#[inline(always)]
unsafe fn madd_acc<const V: bool>(acc: __m256i, p16: __m256i, sc: __m256i) -> __m256i {
    // SAFETY: as above.
    unsafe {
        if V {
            _mm256_dpwssd_epi32(acc, p16, sc)
        } else {
            _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc))
        }
    }
}

/// Horizontal sum of 8 floats.
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX per the module contract.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// The integer dot product of one block with 32 activation quants, as 8 i32 partial sums.
#[inline(always)]
unsafe fn block_dot<const V: bool, T: Legacy>(b: &T::B, q: &[i8]) -> __m256i {
    debug_assert!(q.len() >= 32);
    // SAFETY: per the module contract; the caller passes at least 32 quants.
    unsafe {
        let u = T::unpack::<V>(b);
        let a = load32(q.as_ptr().cast());
        let z = _mm256_setzero_si256();
        if T::WIDE {
            dot_i8i8::<V>(z, u, a)
        } else {
            signed_lanes::<V, T>(dot_u8i8::<V>(z, u, a), a)
        }
    }
}

/// For the types stored unsigned with an offset `M_MUL · d` (Q4_0, Q5_0): the lane sums of the
/// signed values `v + M_MUL` (ggml's `q − 8`, `q − 16`) from those of the unsigned ones,
/// `p + M_MUL · Σa` per lane, so that the float steps see ggml's integers; others unchanged.
#[inline(always)]
unsafe fn signed_lanes<const V: bool, T: Legacy>(p: __m256i, a: __m256i) -> __m256i {
    // SAFETY: AVX2 (+ VNNI when V) per the module contract.
    unsafe {
        if T::WIDE || T::M_FIELD {
            return p;
        }
        let asum = dot_u8i8::<V>(_mm256_setzero_si256(), _mm256_set1_epi8(1), a);
        _mm256_add_epi32(
            p,
            _mm256_mullo_epi32(asum, _mm256_set1_epi32(T::M_MUL as i32)),
        )
    }
}

/// One block's contribution: `acc + d da dot`, and `m s` into `msum`.
#[inline(always)]
unsafe fn legacy_step<const V: bool, T: Legacy>(
    w: &T::B,
    a: &A32<'_>,
    i: usize,
    acc: __m256,
    msum: &mut f32,
) -> __m256 {
    // SAFETY: per the module contract; the caller keeps i < the block count of `a`.
    unsafe {
        let p = _mm256_cvtepi32_ps(block_dot::<V, T>(w, &a.q[32 * i..]));
        let (d, m) = T::dm::<F16c>(w);
        if T::M_FIELD {
            *msum = m.mul_add(a.ds[2 * i + 1], *msum);
        }
        _mm256_fmadd_ps(p, _mm256_set1_ps(d * a.ds[2 * i]), acc)
    }
}

/// The values of blocks `i` and `i + 1` in one 512-bit register (wide types read as
/// `v ^ 0x80` unsigned), and their f16 scales (plus the f16 after each, the min of
/// Q4_1/Q5_1) converted with one `vcvtph2ps`: `[d0, m0, d1, m1]`, with `m = M_MUL d` where
/// the type has no min field.
#[inline(always)]
unsafe fn legacy_pair_weights<T: Legacy>(b0: &T::B, b1: &T::B) -> (__m512i, __m128) {
    // SAFETY: AVX-512 F/BW + F16C per the module contract (only the avx512 level calls
    // this); every block type here has at least 4 bytes.
    unsafe {
        let mut u = T::unpack2(b0, b1);
        if T::WIDE {
            u = _mm512_xor_si512(u, _mm512_set1_epi8(-128));
        }
        let w0 = (b0 as *const T::B).cast::<i32>().read_unaligned();
        let w1 = (b1 as *const T::B).cast::<i32>().read_unaligned();
        let mut f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(w0), w1, 1));
        if !T::M_FIELD {
            f = _mm_mul_ps(
                _mm_permute_ps(f, 0b10_10_00_00),
                _mm_setr_ps(1.0, T::M_MUL, 1.0, T::M_MUL),
            );
        }
        (u, f)
    }
}

/// One token's part of a block pair: the 64 quants at `32 i` times `u` (one `vpdpbusd` for
/// both blocks), then block `i`'s eight lane sums and block `i + 1`'s fused into `acc` one
/// after the other, scaled by `f`'s `d` times the activation's (ggml's order for one block at
/// a time). With `m_field` (Q4_1, Q5_1) the offset terms `m · s` are fused into `msum` in the
/// same order; otherwise the lane sums are made those of the signed values first (`u` holds
/// `v − m_mul`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn legacy_pair_token(
    m_field: bool,
    m_mul: i32,
    u: __m512i,
    f: __m128,
    a: &A32<'_>,
    i: usize,
    acc: __m256,
    msum: &mut f32,
) -> __m256 {
    // SAFETY: AVX-512 F/BW/VNNI per the module contract; the caller keeps blocks i and
    // i + 1 within `a` (64 quants at 32 i, 4 scales at 2 i).
    unsafe {
        let q = _mm512_loadu_si512(a.q.as_ptr().add(32 * i).cast());
        let mut dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
        // [d0 da0, m0 s0, d1 da1, m1 s1]: the scale products are exact (f16 times f16).
        let ds = _mm_loadu_ps(a.ds.as_ptr().add(2 * i));
        if m_field {
            let (m, s) = (_mm_movehdup_ps(f), _mm_movehdup_ps(ds));
            *msum = _mm_cvtss_f32(_mm_fmadd_ss(m, s, _mm_set_ss(*msum)));
            let (m, s) = (_mm_movehl_ps(m, m), _mm_movehl_ps(s, s));
            *msum = _mm_cvtss_f32(_mm_fmadd_ss(m, s, _mm_set_ss(*msum)));
        } else {
            // Signed lane sums (ggml's integers): the unsigned values' plus M_MUL · Σa.
            let asum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
            dot = _mm512_add_epi32(dot, _mm512_mullo_epi32(asum, _mm512_set1_epi32(m_mul)));
        }
        let p = _mm_mul_ps(f, ds);
        let dot = _mm512_cvtepi32_ps(dot);
        let acc = _mm256_fmadd_ps(_mm512_castps512_ps256(dot), _mm256_broadcastss_ps(p), acc);
        _mm256_fmadd_ps(
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(dot))),
            _mm256_broadcastss_ps(_mm_movehl_ps(p, p)),
            acc,
        )
    }
}

/// One row of 32-element blocks against the A32 activations of `NT` tokens on the AVX-512
/// level: two blocks per 512-bit register, unpacked once for all tokens. Per token the float
/// operations are ggml's (`ggml_vec_dot_q4_1_q8_1` and its siblings on AVX2): one 8-lane
/// accumulator fed one block at a time, the offset terms fused into one sum, then
/// `hsum + sum`; so they are also [`dot_legacy_multi`]'s.
#[inline(always)]
pub(crate) unsafe fn dot_legacy512<T: Legacy, const NT: usize>(
    w: &[T::B],
    a: &[A32<'_>; NT],
) -> [f32; NT] {
    let mut n = w.len();
    for a in a {
        n = n.min(a.len());
    }
    // SAFETY: per the module contract (AVX-512 level); pairs start below n - 1 and the tail
    // block is below n.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut msum = [0f32; NT];
        let mut i = 0;
        while i + 2 <= n {
            let (u, f) = legacy_pair_weights::<T>(&w[i], &w[i + 1]);
            for t in 0..NT {
                acc[t] = legacy_pair_token(
                    T::M_FIELD,
                    T::M_MUL as i32,
                    u,
                    f,
                    &a[t],
                    i,
                    acc[t],
                    &mut msum[t],
                );
            }
            i += 2;
        }
        let mut out = [0f32; NT];
        for t in 0..NT {
            if i < n {
                acc[t] = legacy_step::<true, T>(&w[i], &a[t], i, acc[t], &mut msum[t]);
            }
            out[t] = hsum(acc[t]) + msum[t];
        }
        out
    }
}

/// `NT` (1..=4) tokens at once against one row: each block is unpacked and its scales
/// converted once for all tokens. Per token the float operations are those of one token
/// alone, in ggml's order (one accumulator fed block by block, the offset terms fused into
/// one sum), so a token's result does not depend on `NT` or on the other tokens (batch
/// invariance) and equals llama.cpp's for the same quants.
#[inline(always)]
pub(crate) unsafe fn dot_legacy_multi<const V: bool, T: Legacy, const NT: usize>(
    w: &[T::B],
    a: &[A32<'_>; NT],
) -> [f32; NT] {
    let mut n = w.len();
    for a in a {
        n = n.min(a.len());
    }
    // SAFETY: per the module contract; every activation load reads 32 quants at 32 i with
    // i < n.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut msum = [0f32; NT];
        let z = _mm256_setzero_si256();
        for (i, b) in w.iter().enumerate().take(n) {
            let u = T::unpack::<V>(b);
            let (d, m) = T::dm::<F16c>(b);
            for t in 0..NT {
                let q = load32(a[t].q.as_ptr().add(32 * i).cast());
                let p = if T::WIDE {
                    dot_i8i8::<V>(z, u, q)
                } else {
                    signed_lanes::<V, T>(dot_u8i8::<V>(z, u, q), q)
                };
                if T::M_FIELD {
                    msum[t] = m.mul_add(a[t].ds[2 * i + 1], msum[t]);
                }
                acc[t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(p),
                    _mm256_set1_ps(d * a[t].ds[2 * i]),
                    acc[t],
                );
            }
        }
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = hsum(acc[t]) + msum[t];
        }
        out
    }
}

/// Picks i16 element `g` of each 128-bit half.
const PICK: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut g = 0;
    while g < 8 {
        let mut i = 0;
        while i < 8 {
            t[g][2 * i] = 2 * g as u8;
            t[g][2 * i + 1] = 2 * g as u8 + 1;
            i += 1;
        }
        g += 1;
    }
    t
};

/// One row of K-quant super-blocks against the A256 activations of `NT` tokens: per
/// super-block, products of each 16 elements are scaled by their integer sub-block scale in
/// i32, then converted once. Weights are unpacked once for all tokens.
#[inline(always)]
pub(crate) unsafe fn dot_k<const V: bool, T: KQuant, const NT: usize>(
    w: &[T::B],
    a: &[&[A256]; NT],
    tiled: bool,
) -> [f32; NT] {
    let mut n = w.len();
    for a in a {
        n = n.min(a.len());
    }
    // SAFETY: per the module contract; all loads are within the 256-byte `qs`, the 16-byte
    // scale arrays and the 32-byte `bsums` of blocks below n.
    unsafe {
        let (mut acc, mut accm) = ([_mm256_setzero_ps(); NT], [_mm256_setzero_ps(); NT]);
        for (bi, b) in w.iter().enumerate().take(n) {
            // i16 scales: even sub-blocks in the low half, odd in the high half, so that one
            // in-lane shuffle gives group g's two halves their scales.
            let (sc, corr, kd, kcd) = T::scales_x86(b);
            let mut isum = [_mm256_setzero_si256(); NT];
            for p in 0..QK_K / 64 {
                let g = T::pair(b, p);
                for (h, g) in g.into_iter().enumerate() {
                    let pick = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                        PICK[2 * p + h].as_ptr().cast(),
                    ));
                    let scv = _mm256_shuffle_epi8(sc, pick);
                    let ga = if T::WIDE { _mm256_abs_epi8(g) } else { g };
                    for t in 0..NT {
                        let q = load32(a[t][bi].qs.as_ptr().add(64 * p + 32 * h).cast());
                        let p16 = if T::WIDE {
                            _mm256_maddubs_epi16(ga, _mm256_sign_epi8(q, g))
                        } else {
                            _mm256_maddubs_epi16(g, q)
                        };
                        isum[t] = madd_acc::<V>(isum[t], p16, scv);
                    }
                }
            }
            for t in 0..NT {
                k_block::<T>(
                    isum[t],
                    corr,
                    kd,
                    kcd,
                    &a[t][bi],
                    tiled,
                    &mut acc[t],
                    &mut accm[t],
                );
            }
        }
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = k_result::<T>(acc[t], accm[t], tiled);
        }
        out
    }
}

/// The K-quant decode product in the rounding `form` asks for (`crate::decode::FORM_*`), on
/// 256-bit registers (`V`: with VNNI) or, for `W512`, the AVX-512 level's kernel.
#[inline(always)]
pub(crate) unsafe fn dot_k_form<const W512: bool, T: KQuant, const NT: usize>(
    w: &[T::B],
    a: &[&[A256]; NT],
    form: u8,
) -> [f32; NT] {
    use crate::decode::{FORM_GEMM4, FORM_TILED};
    // SAFETY: forwarded; `W512` only from the AVX-512 level.
    unsafe {
        if form == FORM_GEMM4 {
            dot_q4k_gemm4::<W512, T, NT>(w, a)
        } else if W512 {
            dot_k512::<T, NT>(w, a, form == FORM_TILED)
        } else {
            dot_k::<false, T, NT>(w, a, form == FORM_TILED)
        }
    }
}

/// Q4_K rows as llama.cpp's repacked GEMM sums them for a group of four tokens: per 64
/// elements (two sub-blocks) the whole integer sum and the whole correction, each fused into
/// its own scalar accumulator; the result is their difference (cf. [`GGML_Q4K`], which fuses
/// per 256).
#[inline(always)]
pub(crate) unsafe fn dot_q4k_gemm4<const V: bool, T: KQuant, const NT: usize>(
    w: &[T::B],
    a: &[&[A256]; NT],
) -> [f32; NT] {
    let mut n = w.len();
    for a in a {
        n = n.min(a.len());
    }
    // SAFETY: per the module contract; loads as in `dot_k`.
    unsafe {
        let (mut acc, mut accm) = ([0f32; NT], [0f32; NT]);
        for (bi, b) in w.iter().enumerate().take(n) {
            let (sc, corr, kd, kcd) = T::scales_x86(b);
            let mut m = [[0i32; 8]; NT];
            for t in 0..NT {
                let c = _mm256_madd_epi16(_mm256_loadu_si256(a[t][bi].bsums.as_ptr().cast()), corr);
                _mm256_storeu_si256(m[t].as_mut_ptr().cast(), c);
            }
            for p in 0..QK_K / 64 {
                let g = T::pair(b, p);
                let mut isum = [_mm256_setzero_si256(); NT];
                for (h, g) in g.into_iter().enumerate() {
                    let pick = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                        PICK[2 * p + h].as_ptr().cast(),
                    ));
                    let scv = _mm256_shuffle_epi8(sc, pick);
                    for t in 0..NT {
                        let q = load32(a[t][bi].qs.as_ptr().add(64 * p + 32 * h).cast());
                        isum[t] = madd_acc::<V>(isum[t], _mm256_maddubs_epi16(g, q), scv);
                    }
                }
                for t in 0..NT {
                    let d = a[t][bi].d;
                    let mp = (m[t][2 * p] + m[t][2 * p + 1]) as f32;
                    acc[t] = (hsum_i32(isum[t]) as f32).mul_add(kd * d, acc[t]);
                    accm[t] = mp.mul_add(kcd * d, accm[t]);
                }
            }
        }
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = acc[t] + accm[t];
        }
        out
    }
}

/// One super-block's lane sums `isum` (and the correction from `corr` and the activation's
/// `bsums`) fused into the accumulators, as [`KQuant::GGML`] says, or with `tiled` as
/// llama.cpp's tiled kernel does ([`crate::decode::FORM_TILED`], lane 0 of `acc`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn k_block<T: KQuant>(
    isum: __m256i,
    corr: __m256i,
    kd: f32,
    kcd: f32,
    at: &A256,
    tiled: bool,
    acc: &mut __m256,
    accm: &mut __m256,
) {
    // SAFETY: AVX2 + FMA per the module contract; `bsums` is 16 i16.
    unsafe {
        let c = || _mm256_madd_epi16(_mm256_loadu_si256(at.bsums.as_ptr().cast()), corr);
        if tiled {
            let r = if T::GGML == GGML_Q6K {
                // Q6_K's −32 · Σ sc · bsum belongs to the integer sum.
                hsum_i32(_mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(c()))) as f32 * kd
            } else {
                // `kcd` is −dmin: ggml's `r − dmin · S2`, fused.
                kcd.mul_add(hsum_i32(c()) as f32, hsum_i32(isum) as f32 * kd)
            };
            // GCC contracts ggml's `buf + r · d_a` into one fused multiply-add.
            *acc = _mm256_set1_ps(r.mul_add(at.d, _mm256_cvtss_f32(*acc)));
            return;
        }
        match T::GGML {
            GGML_Q6K => {
                // Q6_K's correction is −32 · Σ sc · bsum: integers, as ggml subtracts them.
                let isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(c()));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(kd * at.d), *acc);
            }
            GGML_Q4K => {
                // Scalar chains in lane 0: the super-block's whole sums.
                let (i, m) = (hsum_i32(isum) as f32, hsum_i32(c()) as f32);
                *acc = _mm256_set1_ps(i.mul_add(kd * at.d, _mm256_cvtss_f32(*acc)));
                *accm = _mm256_set1_ps(m.mul_add(kcd * at.d, _mm256_cvtss_f32(*accm)));
            }
            _ => {
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(kd * at.d), *acc);
                if T::HAS_CORR {
                    *accm =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(c()), _mm256_set1_ps(kcd * at.d), *accm);
                }
            }
        }
    }
}

/// The dot product from [`k_block`]'s accumulators.
#[inline(always)]
unsafe fn k_result<T: KQuant>(acc: __m256, accm: __m256, tiled: bool) -> f32 {
    // SAFETY: AVX per the module contract.
    unsafe {
        if tiled {
            return _mm256_cvtss_f32(acc);
        }
        match T::GGML {
            GGML_Q6K => hsum(acc),
            // ggml's `acc − acc_min`; `kcd` carries the minus sign, so this is `acc + accm`.
            GGML_Q4K => _mm256_cvtss_f32(acc) + _mm256_cvtss_f32(accm),
            _ => hsum(_mm256_add_ps(acc, accm)),
        }
    }
}

/// Picks i16 element `2p` in the low two 128-bit lanes and `2p + 1` in the high two.
const PICK512: [[u8; 64]; 4] = {
    let mut t = [[0u8; 64]; 4];
    let mut p = 0;
    while p < 4 {
        let mut i = 0;
        while i < 32 {
            let g = if i < 16 { 2 * p } else { 2 * p + 1 };
            t[p][2 * i] = 2 * g as u8;
            t[p][2 * i + 1] = 2 * g as u8 + 1;
            i += 1;
        }
        p += 1;
    }
    t
};

/// [`dot_k`] on the AVX-512 level for `NT` (1..=4) tokens: each pair of 32-element groups
/// (64 elements) is one 512-bit register, so products, scaling and accumulation take one
/// instruction per 64 elements. Weights are unpacked once for all tokens; per token the
/// operations do not depend on `NT` (batch invariance).
#[inline(always)]
pub(crate) unsafe fn dot_k512<T: KQuant, const NT: usize>(
    w: &[T::B],
    a: &[&[A256]; NT],
    tiled: bool,
) -> [f32; NT] {
    let mut n = w.len();
    for a in a {
        n = n.min(a.len());
    }
    // SAFETY: AVX-512 F/BW/VNNI per the module contract (only the avx512 level calls this);
    // loads are within the 256-byte `qs` and 32-byte `bsums` of blocks below n, and the
    // 64-byte pick tables.
    unsafe {
        let (mut acc, mut accm) = ([_mm512_setzero_ps(); NT], [_mm256_setzero_ps(); NT]);
        let mut acc8 = [_mm256_setzero_ps(); NT];
        for (bi, b) in w.iter().enumerate().take(n) {
            let (sc, corr, kd, kcd) = T::scales_x86(b);
            // [even | odd | even | odd]: lanes 0-1 then 2-3 pick group 2p's and 2p+1's halves.
            let sc = _mm512_inserti64x4(_mm512_castsi256_si512(sc), sc, 1);
            let mut isum = [_mm512_setzero_si512(); NT];
            for (p, pick) in PICK512.iter().enumerate() {
                let [g0, g1] = T::pair(b, p);
                let g = _mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1);
                let scv = _mm512_shuffle_epi8(sc, _mm512_loadu_si512(pick.as_ptr().cast()));
                let (ga, neg) = if T::WIDE {
                    (_mm512_abs_epi8(g), _mm512_movepi8_mask(g))
                } else {
                    (g, 0)
                };
                for t in 0..NT {
                    let q = _mm512_loadu_si512(a[t][bi].qs.as_ptr().add(64 * p).cast());
                    let p16 = if T::WIDE {
                        _mm512_maddubs_epi16(
                            ga,
                            _mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q),
                        )
                    } else {
                        _mm512_maddubs_epi16(g, q)
                    };
                    isum[t] = _mm512_dpwssd_epi32(isum[t], p16, scv);
                }
            }
            for t in 0..NT {
                let at = &a[t][bi];
                if T::GGML != crate::decode::GGML_LANES || tiled {
                    // ggml's lanes: the even and odd groups' lane sums added as integers.
                    let i8 = _mm256_add_epi32(
                        _mm512_castsi512_si256(isum[t]),
                        _mm512_extracti64x4_epi64::<1>(isum[t]),
                    );
                    k_block::<T>(i8, corr, kd, kcd, at, tiled, &mut acc8[t], &mut accm[t]);
                    continue;
                }
                acc[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(isum[t]),
                    _mm512_set1_ps(kd * at.d),
                    acc[t],
                );
                if T::HAS_CORR {
                    let c = _mm256_madd_epi16(_mm256_loadu_si256(at.bsums.as_ptr().cast()), corr);
                    accm[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(kcd * at.d), accm[t]);
                }
            }
        }
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = if T::GGML != crate::decode::GGML_LANES || tiled {
                k_result::<T>(acc8[t], accm[t], tiled)
            } else {
                _mm512_reduce_add_ps(acc[t]) + hsum(accm[t])
            };
        }
        out
    }
}

/// Decodes a 32-element block into `vals[..32]`.
#[inline(always)]
pub(crate) unsafe fn dec_legacy<const V: bool, T: Legacy>(b: &T::B, vals: &mut [u8]) -> (f32, f32) {
    if vals.len() >= 32 {
        // SAFETY: per the module contract; 32 bytes are writable.
        unsafe { _mm256_storeu_si256(vals.as_mut_ptr().cast(), T::unpack::<V>(b)) };
    }
    T::dm::<F16c>(b)
}

/// Decodes a super-block into `vals[..256]`.
#[inline(always)]
pub(crate) unsafe fn dec_k<T: KQuant>(b: &T::B, vals: &mut [u8]) {
    if vals.len() >= QK_K {
        for p in 0..QK_K / 64 {
            // SAFETY: per the module contract; 64 p + 64 <= 256 bytes are writable.
            unsafe {
                let g = T::pair(b, p);
                _mm256_storeu_si256(vals.as_mut_ptr().add(64 * p).cast(), g[0]);
                _mm256_storeu_si256(vals.as_mut_ptr().add(64 * p + 32).cast(), g[1]);
            }
        }
    }
}
