//! Exact tiles on the AVX2 level: the 32-element types' and Q4_K's prompt products on the GEMM
//! panel in the decode path's float order, as `xgemm.rs` does on AVX-512, eight tokens a
//! register (Q4_K: below).
//!
//! Per 4-column group a row's broadcast bytes times 8 tokens' quants (`vpmaddubsw`, then
//! `vpmaddwd` by ones) give the decode path's i32 lane `j` for each token: Q4_1/Q5_1's unsigned
//! values times `a`; the signed ones (Q4_0's `q − 8`, Q5_0's `q − 16`, Q8_0, IQ4_NL) as `|w|`
//! times `a` signed as `w` (ggml's `sign` trick: no `vpmaddubsw` saturation); then, lane by
//! lane and block by block, the decode path's conversion and fused multiply-add, and its `hsum`.
//!
//! Safety requirement of every function: the CPU supports AVX2 + FMA + F16C; they run inlined
//! into `super`'s entry point.

use super::kern::F16c;
use super::xgemm::{fit, unpack_k, write_out, KRows, Rows, KEPT};
use crate::decode::*;
use crate::driver::{Job, Panel, TileView};
use crate::shared::SharedMut;
use quiver_quant::{as_blocks, QK_K};
use std::arch::x86_64::*;

/// Tokens a register holds.
const L8: usize = 8;

/// Whether the AVX2 exact tiles take a type: the 32-element ones.
pub(crate) fn takes(ty: quiver_gguf::GgmlType) -> bool {
    use quiver_gguf::GgmlType as G;
    matches!(
        ty,
        G::Q4_0 | G::Q4_1 | G::Q5_0 | G::Q5_1 | G::Q8_0 | G::IQ4_NL | G::Q4_K
    )
}

/// Rows `r0..r1` of token tile `tile` (types [`takes`] names; others write nothing).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[inline(always)]
pub(crate) unsafe fn xgemm_rows(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    use quiver_gguf::GgmlType as G;
    // SAFETY: forwarded from the caller.
    unsafe {
        match job.ty {
            G::Q4_0 => xgemm::<TQ4_0>(job, p, tile, r0, r1, out),
            G::Q4_1 => xgemm::<TQ4_1>(job, p, tile, r0, r1, out),
            G::Q5_0 => xgemm::<TQ5_0>(job, p, tile, r0, r1, out),
            G::Q5_1 => xgemm::<TQ5_1>(job, p, tile, r0, r1, out),
            G::Q8_0 => xgemm::<TQ8_0>(job, p, tile, r0, r1, out),
            G::IQ4_NL => xgemm::<TIq4Nl>(job, p, tile, r0, r1, out),
            G::Q4_K => xgemm_q4k(job, p, tile, r0, r1, out),
            _ => {}
        }
    }
}

#[inline(always)]
unsafe fn xgemm<T: Legacy>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (cols, nb) = (job.cols, job.cols / 32);
    let (Some(w), Some(tv)) = (as_blocks::<T::B>(job.w), p.tile_view(tile)) else {
        return;
    };
    if p.shape.sub != 32 || w.len() < r1 * nb {
        return;
    }
    let mut kept = KEPT.take();
    let row = &mut kept.rows;
    fit(&mut row.u, cols);
    fit(&mut row.ua, cols);
    fit(&mut row.d, nb);
    fit(&mut row.m, nb);
    let mut res = [0f32; L8];
    for r in r0..r1 {
        // SAFETY: forwarded from the caller; row r < r1 has nb blocks in w.
        unsafe { unpack_row::<T>(&w[r * nb..(r + 1) * nb], row) };
        for h in 0..tv.tpad / L8 {
            // SAFETY: forwarded; the tile's slices hold tpad lanes of every group and block,
            // and h < tpad / 8.
            unsafe { pass::<T>(row, nb, &tv, h, &mut res) };
            write_out(out, job.rows, &tv, L8 * h, r, &[res]);
        }
    }
    KEPT.set(kept);
}

/// The row from its blocks.
#[inline(always)]
unsafe fn unpack_row<T: Legacy>(blocks: &[T::B], row: &mut Rows) {
    for (b, blk) in blocks.iter().enumerate() {
        // SAFETY: AVX2 per the module contract; 32 bytes at 32 b < 32 nb.
        unsafe {
            let mut v = T::unpack::<false>(blk);
            if !T::WIDE && !T::M_FIELD {
                // ggml's signed values (q − 8, q − 16).
                v = _mm256_add_epi8(v, _mm256_set1_epi8(T::M_MUL as i32 as i8));
            }
            _mm256_storeu_si256(row.u.as_mut_ptr().add(32 * b).cast(), v);
            if !T::M_FIELD {
                _mm256_storeu_si256(row.ua.as_mut_ptr().add(32 * b).cast(), _mm256_abs_epi8(v));
            }
        }
        let (d, m) = T::dm::<F16c>(blk);
        row.d[b] = d;
        row.m[b] = m;
    }
}

/// The row against tokens `8 h..8 h + 8` of the tile: their 8 results into `res`.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn pass<T: Legacy>(row: &Rows, nb: usize, tv: &TileView<'_>, h: usize, res: &mut [f32; L8]) {
    let tpad = tv.tpad;
    // SAFETY: AVX2 + FMA per the module contract. Loads: quant words at (8 b + g) tpad + 8 h
    // + 8 <= cols / 4 · tpad (the tile's slices), scales at b tpad + 8 h + 8 <= nb tpad,
    // weight words at 32 b + 4 g + 4 <= cols.
    unsafe {
        let (q, a0, a1) = (
            tv.q.as_ptr().add(L8 * h),
            tv.a0.as_ptr().add(L8 * h),
            tv.a1.as_ptr().add(L8 * h),
        );
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut ms = _mm256_setzero_ps();
        for b in 0..nb {
            let sc = _mm256_mul_ps(_mm256_set1_ps(row.d[b]), _mm256_loadu_ps(a0.add(b * tpad)));
            if T::M_FIELD {
                ms = _mm256_fmadd_ps(
                    _mm256_set1_ps(row.m[b]),
                    _mm256_loadu_ps(a1.add(b * tpad)),
                    ms,
                );
            }
            for g in 0..8 {
                let at = (8 * b + g) * tpad;
                let av = _mm256_loadu_si256(q.add(at).cast());
                let word = |v: &[u8]| {
                    v.as_ptr()
                        .add(32 * b + 4 * g)
                        .cast::<i32>()
                        .read_unaligned()
                };
                let s = if T::M_FIELD {
                    let p16 = _mm256_maddubs_epi16(_mm256_set1_epi32(word(&row.u)), av);
                    _mm256_madd_epi16(p16, ones)
                } else {
                    let wb = _mm256_set1_epi32(word(&row.u));
                    let p16 = _mm256_maddubs_epi16(
                        _mm256_set1_epi32(word(&row.ua)),
                        _mm256_sign_epi8(av, wb),
                    );
                    _mm256_madd_epi16(p16, ones)
                };
                acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[g]);
            }
        }
        // hsum's order: lanes j and j + 4, then (0 + 2) and (1 + 3), then their sum.
        let s0 = _mm256_add_ps(acc[0], acc[4]);
        let s1 = _mm256_add_ps(acc[1], acc[5]);
        let s2 = _mm256_add_ps(acc[2], acc[6]);
        let s3 = _mm256_add_ps(acc[3], acc[7]);
        let hs = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
        _mm256_storeu_ps(res.as_mut_ptr(), _mm256_add_ps(hs, ms));
    }
}

/// Rows per Q4_K pass.
const KR2: usize = 3;

/// Q4_K on exact tiles (llama.cpp's repacked order, as `xgemm.rs` has it): per 32 columns the
/// 8 groups' `vpmaddubsw` + `vpmaddwd` sums, scaled by the 32's scale into one integer sum a
/// super-block; the correction from the tile's quant sums; then the two fused multiply-adds.
#[inline(always)]
unsafe fn xgemm_q4k(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (cols, nb) = (job.cols, job.cols / QK_K);
    let (Some(w), Some(tv)) = (as_blocks::<<TQ4K as KQuant>::B>(job.w), p.tile_view(tile)) else {
        return;
    };
    if p.shape.sub != 32 || w.len() < r1 * nb {
        return;
    }
    let mut kept = KEPT.take();
    let (rows, sums) = (&mut kept.krows, &mut kept.sums);
    // SAFETY: forwarded from the caller.
    unsafe { quant_sums(tv.q, cols, tv.tpad, sums) };
    rows.fit(KR2, nb);
    let mut res = [[0f32; L8]; KR2];
    let mut r = r0;
    while r < r1 {
        let nr = KR2.min(r1 - r);
        for i in 0..nr {
            // SAFETY: forwarded from the caller (`unpack_k` needs AVX2 only).
            unsafe { unpack_k::<TQ4K>(&w[(r + i) * nb..(r + i + 1) * nb], i, rows) };
        }
        for h in 0..tv.tpad / L8 {
            // SAFETY: forwarded; the tile's slices hold tpad lanes of every group and 32,
            // `sums` one word per 32 columns and lane, h < tpad / 8.
            unsafe {
                match nr {
                    3 => pass_q4k::<3>(rows, nb, &tv, sums, h, &mut res),
                    2 => pass_q4k::<2>(rows, nb, &tv, sums, h, &mut res),
                    _ => pass_q4k::<1>(rows, nb, &tv, sums, h, &mut res),
                }
            }
            write_out(out, job.rows, &tv, L8 * h, r, &res[..nr]);
        }
        r += nr;
    }
    KEPT.set(kept);
}

/// The tile's quant sums per 16 columns, two a word (i16), as `[cols / 32][tpad]`.
#[inline(always)]
unsafe fn quant_sums(q: &[u32], cols: usize, tpad: usize, s: &mut Vec<i32>) {
    fit(s, cols / 32 * tpad);
    // SAFETY: AVX2 per the module contract; words (8 j + g) tpad + 8 h + 8 <= cols / 4 · tpad,
    // sums j tpad + 8 h + 8 <= cols / 32 · tpad.
    unsafe {
        let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
        let lo16 = _mm256_set1_epi32(0xffff);
        for j in 0..cols / 32 {
            for h in 0..tpad / L8 {
                let mut half = [_mm256_setzero_si256(); 2];
                for (k, x) in half.iter_mut().enumerate() {
                    for g in 0..4 {
                        let at = (8 * j + 4 * k + g) * tpad + L8 * h;
                        let av = _mm256_loadu_si256(q.as_ptr().add(at).cast());
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, av), ones16);
                        *x = _mm256_add_epi32(*x, p);
                    }
                }
                let word = _mm256_or_si256(
                    _mm256_and_si256(half[0], lo16),
                    _mm256_slli_epi32::<16>(half[1]),
                );
                _mm256_storeu_si256(s.as_mut_ptr().add(j * tpad + L8 * h).cast(), word);
            }
        }
    }
}

/// `N` Q4_K rows against tokens `8 h..8 h + 8`: `res[i]` their results.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn pass_q4k<const N: usize>(
    rows: &KRows,
    nb: usize,
    tv: &TileView<'_>,
    sums: &[i32],
    h: usize,
    res: &mut [[f32; L8]; KR2],
) {
    let (tpad, cols) = (tv.tpad, QK_K * nb);
    // SAFETY: AVX2 + FMA per the module contract. Loads: quant words at kg tpad + 8 h + 8 <=
    // cols / 4 · tpad, scales at 8 b tpad + 8 h + 8 <= cols / 32 · tpad, sums at (8 b + k) tpad
    // + 8 h + 8 <= cols / 32 · tpad, weight words at i cols + 4 kg + 4 <= N cols.
    unsafe {
        let (q, a0, sums) = (
            tv.q.as_ptr().add(L8 * h),
            tv.a0.as_ptr().add(L8 * h),
            sums.as_ptr().add(L8 * h),
        );
        let u = rows.u.as_ptr();
        let ones = _mm256_set1_epi16(1);
        let zero = _mm256_setzero_si256();
        let mut acc = [_mm256_setzero_ps(); N];
        let mut accm = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let mut isum = [zero; N];
            for s in 0..8 {
                let mut t = [zero; N];
                for g in 0..8 {
                    let kg = 64 * b + 8 * s + g;
                    let av = _mm256_loadu_si256(q.add(kg * tpad).cast());
                    for i in 0..N {
                        let word = u.add(i * cols + 4 * kg).cast::<i32>().read_unaligned();
                        let p16 = _mm256_maddubs_epi16(_mm256_set1_epi32(word), av);
                        t[i] = _mm256_add_epi32(t[i], _mm256_madd_epi16(p16, ones));
                    }
                }
                for i in 0..N {
                    let sc = _mm256_set1_epi32(rows.sc[16 * (i * nb + b) + 2 * s] & 0xffff);
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(t[i], sc));
                }
            }
            let da = _mm256_loadu_ps(a0.add(8 * b * tpad));
            for i in 0..N {
                let at = i * nb + b;
                let mut c = zero;
                for k in 0..8 {
                    let s = _mm256_loadu_si256(sums.add((8 * b + k) * tpad).cast());
                    let corr = _mm256_set1_epi32(rows.corr[8 * at + k]);
                    c = _mm256_add_epi32(c, _mm256_madd_epi16(s, corr));
                }
                let kd = _mm256_mul_ps(_mm256_set1_ps(rows.d[at]), da);
                let kcd = _mm256_mul_ps(_mm256_set1_ps(rows.cd[at]), da);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), kd, acc[i]);
                accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), kcd, accm[i]);
            }
        }
        for i in 0..N {
            _mm256_storeu_ps(res[i].as_mut_ptr(), _mm256_add_ps(acc[i], accm[i]));
        }
    }
}
