//! Prefill micro-kernels and float-weight blocks for x86.
//!
//! The GEMM micro-kernels take decoded weight rows (`Dec`) and a token tile of the panel
//! (quants of 16 tokens side by side per 4 columns) and keep tokens across SIMD lanes: per
//! group of 4 columns, each row's 4 weight bytes are broadcast to all lanes and multiplied
//! with the 16 tokens' 4 activation bytes in one `vpdpbusd` (AVX-512) or
//! `maddubs`+`madd` per 8 tokens (AVX2). After each sub-block the integer sums are
//! converted and scaled: `acc += s * a0 * dot + m * a1` (vectors over tokens, scalars per
//! row), so no horizontal reductions are needed.
//!
//! Safety requirement of every function: the CPU supports AVX2 + FMA + F16C, plus AVX-512
//! F/BW/VL/VNNI for the `*512` functions; they run inlined into `super`'s entry points.

use super::kern::hsum;
use crate::act::LANES;
use crate::driver::{Acc, Dec, FloatW, TileIn, KC};
use crate::portable::float_elem;
use std::arch::x86_64::*;

/// Rows per AVX-512 micro-kernel call.
pub(crate) const R512: usize = 2;
/// Rows per AVX2 micro-kernel call.
pub(crate) const R256: usize = 2;

/// The 4 weight bytes of row `i` at column group `kg`, as an i32.
#[inline(always)]
fn wword(dec: &Dec, i: usize, kg: usize) -> i32 {
    let v = &dec.vals[i.min(dec.vals.len() - 1)];
    let c = (4 * kg).min(v.len() - 4);
    i32::from_le_bytes([v[c], v[c + 1], v[c + 2], v[c + 3]])
}

/// AVX-512 tile: `kc` columns, all token vectors of the tile.
#[inline(always)]
pub(crate) unsafe fn tile512<const SUB: usize, const WIDE: bool>(
    dec: &Dec,
    row0: usize,
    kc: usize,
    t: &TileIn<'_>,
    acc: &mut Acc,
) {
    let nv = t.tpad / LANES;
    let mut v0 = 0;
    while v0 < nv {
        let tv = (nv - v0).min(4);
        // SAFETY: forwarded from the caller.
        unsafe {
            match tv {
                4 => tile512_tv::<SUB, WIDE, 4>(dec, row0, kc, t, acc, v0),
                3 => tile512_tv::<SUB, WIDE, 3>(dec, row0, kc, t, acc, v0),
                2 => tile512_tv::<SUB, WIDE, 2>(dec, row0, kc, t, acc, v0),
                _ => tile512_tv::<SUB, WIDE, 1>(dec, row0, kc, t, acc, v0),
            }
        }
        v0 += tv;
    }
}

#[inline(always)]
unsafe fn tile512_tv<const SUB: usize, const WIDE: bool, const TV: usize>(
    dec: &Dec,
    row0: usize,
    kc: usize,
    t: &TileIn<'_>,
    acc: &mut Acc,
    v0: usize,
) {
    let tpad = t.tpad;
    let nsub = kc / SUB;
    // Every load below is at index < (kc / 4) * tpad (quants) or nsub * tpad (scales).
    if t.q.len() < kc / 4 * tpad
        || t.a0.len() < nsub * tpad
        || t.a1.len() < nsub * tpad
        || LANES * (v0 + TV) > tpad
        || row0 + R512 > acc.len()
        || kc > KC
    {
        return;
    }
    // SAFETY: AVX-512 per the module contract; loads are in bounds by the check above
    // (token vector v0 + v < tpad / 16, column group < kc / 4, sub-block < nsub), and the
    // accumulator rows hold 64 >= 16 (v0 + TV) floats.
    unsafe {
        let mut f = [[_mm512_setzero_ps(); TV]; R512];
        for (i, f) in f.iter_mut().enumerate() {
            for (v, f) in f.iter_mut().enumerate() {
                *f = _mm512_loadu_ps(acc[row0 + i].as_ptr().add(LANES * (v0 + v)));
            }
        }
        let q = t.q.as_ptr().add(LANES * v0);
        for j in 0..nsub {
            let mut ia = [[_mm512_setzero_si512(); TV]; R512];
            for g in 0..SUB / 4 {
                let kg = j * SUB / 4 + g;
                let mut av = [_mm512_setzero_si512(); TV];
                for (v, a) in av.iter_mut().enumerate() {
                    *a = _mm512_loadu_si512(q.add(kg * tpad + LANES * v).cast());
                }
                for (i, ia) in ia.iter_mut().enumerate() {
                    let mut wb = _mm512_set1_epi32(wword(dec, row0 + i, kg));
                    if WIDE {
                        // Signed weights become unsigned w + 128; `m` absorbs the -128 s.
                        wb = _mm512_xor_si512(wb, _mm512_set1_epi8(-128));
                    }
                    for (a, av) in ia.iter_mut().zip(av) {
                        *a = _mm512_dpbusd_epi32(*a, wb, av);
                    }
                }
            }
            let a0 = t.a0.as_ptr().add(j * tpad + LANES * v0);
            let a1 = t.a1.as_ptr().add(j * tpad + LANES * v0);
            for i in 0..R512 {
                let s = dec.s[row0 + i][j];
                let m = if WIDE {
                    dec.m[row0 + i][j] - 128.0 * s
                } else {
                    dec.m[row0 + i][j]
                };
                let (sb, mb) = (_mm512_set1_ps(s), _mm512_set1_ps(m));
                for v in 0..TV {
                    let x0 = _mm512_loadu_ps(a0.add(LANES * v));
                    let x1 = _mm512_loadu_ps(a1.add(LANES * v));
                    let r = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(ia[i][v]),
                        _mm512_mul_ps(x0, sb),
                        f[i][v],
                    );
                    f[i][v] = _mm512_fmadd_ps(x1, mb, r);
                }
            }
        }
        for (i, f) in f.iter().enumerate() {
            for (v, f) in f.iter().enumerate() {
                _mm512_storeu_ps(acc[row0 + i].as_mut_ptr().add(LANES * (v0 + v)), *f);
            }
        }
    }
}

/// AVX2 tile: one token vector (16 tokens, two registers) at a time.
#[inline(always)]
pub(crate) unsafe fn tile256<const SUB: usize, const WIDE: bool>(
    dec: &Dec,
    row0: usize,
    kc: usize,
    t: &TileIn<'_>,
    acc: &mut Acc,
) {
    let tpad = t.tpad;
    let nsub = kc / SUB;
    if t.q.len() < kc / 4 * tpad
        || t.a0.len() < nsub * tpad
        || t.a1.len() < nsub * tpad
        || row0 + R256 > acc.len()
        || kc > KC
    {
        return;
    }
    // SAFETY: AVX2 per the module contract; in bounds as in `tile512_tv` (token vector
    // v < tpad / 16).
    unsafe {
        let ones = _mm256_set1_epi16(1);
        for v in 0..tpad / LANES {
            let mut f = [[_mm256_setzero_ps(); 2]; R256];
            for (i, f) in f.iter_mut().enumerate() {
                for (h, f) in f.iter_mut().enumerate() {
                    *f = _mm256_loadu_ps(acc[row0 + i].as_ptr().add(LANES * v + 8 * h));
                }
            }
            let q = t.q.as_ptr().add(LANES * v);
            for j in 0..nsub {
                let mut ia = [[_mm256_setzero_si256(); 2]; R256];
                for g in 0..SUB / 4 {
                    let kg = j * SUB / 4 + g;
                    let av = [
                        _mm256_loadu_si256(q.add(kg * tpad).cast()),
                        _mm256_loadu_si256(q.add(kg * tpad + 8).cast()),
                    ];
                    for (i, ia) in ia.iter_mut().enumerate() {
                        let wb = _mm256_set1_epi32(wword(dec, row0 + i, kg));
                        for (a, av) in ia.iter_mut().zip(av) {
                            let p = if WIDE {
                                _mm256_maddubs_epi16(_mm256_abs_epi8(wb), _mm256_sign_epi8(av, wb))
                            } else {
                                _mm256_maddubs_epi16(wb, av)
                            };
                            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(p, ones));
                        }
                    }
                }
                let a0 = t.a0.as_ptr().add(j * tpad + LANES * v);
                let a1 = t.a1.as_ptr().add(j * tpad + LANES * v);
                for i in 0..R256 {
                    let (sb, mb) = (
                        _mm256_set1_ps(dec.s[row0 + i][j]),
                        _mm256_set1_ps(dec.m[row0 + i][j]),
                    );
                    for h in 0..2 {
                        let x0 = _mm256_loadu_ps(a0.add(8 * h));
                        let x1 = _mm256_loadu_ps(a1.add(8 * h));
                        let r = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(ia[i][h]),
                            _mm256_mul_ps(x0, sb),
                            f[i][h],
                        );
                        f[i][h] = _mm256_fmadd_ps(x1, mb, r);
                    }
                }
            }
            for (i, f) in f.iter().enumerate() {
                for (h, f) in f.iter().enumerate() {
                    _mm256_storeu_ps(acc[row0 + i].as_mut_ptr().add(LANES * v + 8 * h), *f);
                }
            }
        }
    }
}

/// 8 weights from element `c` of a float row as f32.
#[inline(always)]
unsafe fn load8<F: FloatW>(w: *const u8, c: usize) -> __m256 {
    // SAFETY: AVX2 + F16C per the module contract; the caller keeps c + 8 <= cols.
    unsafe {
        match F::ID {
            0 => _mm256_loadu_ps(w.add(4 * c).cast()),
            1 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * c).cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * c).cast())),
                16,
            )),
        }
    }
}

/// 16 weights from element `c` of a float row as f32.
#[inline(always)]
unsafe fn load16<F: FloatW>(w: *const u8, c: usize) -> __m512 {
    // SAFETY: AVX-512 F per the module contract; the caller keeps c + 16 <= cols.
    unsafe {
        match F::ID {
            0 => _mm512_loadu_ps(w.add(4 * c).cast()),
            1 => _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * c).cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(2 * c).cast())),
                16,
            )),
        }
    }
}

/// The scalar tail `c0..cols` of a float block.
#[inline(always)]
fn float_tail<F: FloatW, const NT: usize>(
    w: [&[u8]; 4],
    x: [&[f32]; NT],
    c0: usize,
    cols: usize,
    out: &mut [[f32; NT]; 4],
) {
    for c in c0..cols {
        for (o, w) in out.iter_mut().zip(w) {
            let wv = float_elem::<F>(w, c);
            for (o, x) in o.iter_mut().zip(x) {
                *o += wv * x[c];
            }
        }
    }
}

fn float_lengths_ok<F: FloatW, const NT: usize>(
    w: [&[u8]; 4],
    x: [&[f32]; NT],
    cols: usize,
) -> bool {
    w.iter().all(|w| w.len() >= cols * F::BYTES) && x.iter().all(|x| x.len() >= cols)
}

/// AVX2 float block: tokens two at a time, so that 8 accumulators, 4 weight vectors and
/// one activation vector fit the 16 registers.
#[inline(always)]
pub(crate) unsafe fn float_block256<F: FloatW, const NT: usize>(
    w: [&[u8]; 4],
    x: [&[f32]; NT],
    cols: usize,
) -> [[f32; NT]; 4] {
    let mut out = [[0f32; NT]; 4];
    if !float_lengths_ok::<F, NT>(w, x, cols) {
        return out;
    }
    if F::ID == 0 {
        // f32 weights in AVX-512's order (float_block512), token by token: the same bits as
        // that level's, and as llama.cpp's AVX-512 build gives.
        for (j, x) in x.into_iter().enumerate() {
            // SAFETY: as below.
            let v = unsafe { float_pass256_as512::<F>(w, x, cols) };
            for i in 0..4 {
                out[i][j] = v[i];
            }
        }
        return out;
    }
    let mut j = 0;
    while j < NT {
        // SAFETY: forwarded from the caller; lengths checked above.
        if j + 2 <= NT {
            let v = unsafe { float_pass256::<F, 2>(w, [x[j], x[j + 1]], cols) };
            for i in 0..4 {
                out[i][j] = v[i][0];
                out[i][j + 1] = v[i][1];
            }
            j += 2;
        } else {
            // SAFETY: as above.
            let v = unsafe { float_pass256::<F, 1>(w, [x[j]], cols) };
            for i in 0..4 {
                out[i][j] = v[i][0];
            }
            j += 1;
        }
    }
    out
}

#[inline(always)]
unsafe fn float_pass256<F: FloatW, const NT: usize>(
    w: [&[u8]; 4],
    x: [&[f32]; NT],
    cols: usize,
) -> [[f32; NT]; 4] {
    let mut out = [[0f32; NT]; 4];
    let end = cols / 8 * 8;
    // SAFETY: per the module contract; the caller checked that rows hold cols elements, and
    // c + 8 <= end <= cols.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NT]; 4];
        let mut c = 0;
        while c < end {
            let wv = [
                load8::<F>(w[0].as_ptr(), c),
                load8::<F>(w[1].as_ptr(), c),
                load8::<F>(w[2].as_ptr(), c),
                load8::<F>(w[3].as_ptr(), c),
            ];
            for j in 0..NT {
                let xv = _mm256_loadu_ps(x[j].as_ptr().add(c));
                for i in 0..4 {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
            c += 8;
        }
        for i in 0..4 {
            for j in 0..NT {
                out[i][j] = hsum(acc[i][j]);
            }
        }
    }
    float_tail::<F, NT>(w, x, end, cols, &mut out);
    out
}

/// One token's products with 4 rows in `float_block512`'s order: 16-lane sums (two 8-lane
/// halves) over whole 16-column chunks, reduced as `_mm512_reduce_add_ps` does (the halves, then
/// the 128-bit halves, then lanes 0 + 2 and 1 + 3, then those), then the scalar tail.
#[inline(always)]
unsafe fn float_pass256_as512<F: FloatW>(w: [&[u8]; 4], x: &[f32], cols: usize) -> [f32; 4] {
    let mut out = [[0f32; 1]; 4];
    let end = cols / 16 * 16;
    // SAFETY: per the module contract; the caller checked that rows hold cols elements, and
    // c + 16 <= end <= cols.
    unsafe {
        let (mut lo, mut hi) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
        let mut c = 0;
        while c < end {
            let xl = _mm256_loadu_ps(x.as_ptr().add(c));
            for i in 0..4 {
                lo[i] = _mm256_fmadd_ps(load8::<F>(w[i].as_ptr(), c), xl, lo[i]);
            }
            let xh = _mm256_loadu_ps(x.as_ptr().add(c + 8));
            for i in 0..4 {
                hi[i] = _mm256_fmadd_ps(load8::<F>(w[i].as_ptr(), c + 8), xh, hi[i]);
            }
            c += 16;
        }
        for i in 0..4 {
            let s8 = _mm256_add_ps(lo[i], hi[i]);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            out[i][0] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)));
        }
    }
    float_tail::<F, 1>(w, [x], end, cols, &mut out);
    out.map(|o| o[0])
}

#[inline(always)]
pub(crate) unsafe fn float_block512<F: FloatW, const NT: usize>(
    w: [&[u8]; 4],
    x: [&[f32]; NT],
    cols: usize,
) -> [[f32; NT]; 4] {
    let mut out = [[0f32; NT]; 4];
    if !float_lengths_ok::<F, NT>(w, x, cols) {
        return out;
    }
    let end = cols / 16 * 16;
    // SAFETY: per the module contract; rows hold cols elements and c + 16 <= end <= cols.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NT]; 4];
        let mut c = 0;
        while c < end {
            let wv = [
                load16::<F>(w[0].as_ptr(), c),
                load16::<F>(w[1].as_ptr(), c),
                load16::<F>(w[2].as_ptr(), c),
                load16::<F>(w[3].as_ptr(), c),
            ];
            for j in 0..NT {
                let xv = _mm512_loadu_ps(x[j].as_ptr().add(c));
                for i in 0..4 {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
            c += 16;
        }
        for i in 0..4 {
            for j in 0..NT {
                out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
    }
    float_tail::<F, NT>(w, x, end, cols, &mut out);
    out
}
