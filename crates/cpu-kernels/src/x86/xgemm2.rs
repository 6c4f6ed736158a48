//! Exact tiles on the AVX2 level: the 32-element types' prompt products on the GEMM panel in
//! the decode path's float order, as `xgemm.rs` does on AVX-512, eight tokens a register.
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
use crate::decode::*;
use crate::driver::{Job, Panel, TileView};
use crate::shared::SharedMut;
use quiver_quant::as_blocks;
use std::arch::x86_64::*;

/// Tokens a register holds.
const L8: usize = 8;

/// Whether the AVX2 exact tiles take a type: the 32-element ones.
pub(crate) fn takes(ty: quiver_gguf::GgmlType) -> bool {
    use quiver_gguf::GgmlType as G;
    matches!(
        ty,
        G::Q4_0 | G::Q4_1 | G::Q5_0 | G::Q5_1 | G::Q8_0 | G::IQ4_NL
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
            _ => {}
        }
    }
}

/// One row unpacked: values (signed but for Q4_1/Q5_1), their magnitudes (the signed ones),
/// `d` and `m` per block.
struct Row {
    u: Vec<u8>,
    ua: Vec<u8>,
    d: Vec<f32>,
    m: Vec<f32>,
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
    let mut row = Row {
        u: vec![0; cols],
        ua: vec![0; if T::M_FIELD { 0 } else { cols }],
        d: vec![0.0; nb],
        m: vec![0.0; nb],
    };
    let mut res = [0f32; L8];
    for r in r0..r1 {
        // SAFETY: forwarded from the caller; row r < r1 has nb blocks in w.
        unsafe { unpack_row::<T>(&w[r * nb..(r + 1) * nb], &mut row) };
        for h in 0..tv.tpad / L8 {
            // SAFETY: forwarded; the tile's slices hold tpad lanes of every group and block,
            // and h < tpad / 8.
            unsafe { pass::<T>(&row, nb, &tv, h, &mut res) };
            let lanes = tv.nt.saturating_sub(L8 * h).min(L8);
            for (l, &x) in res.iter().enumerate().take(lanes) {
                // SAFETY: this task owns rows r0..r1 of this tile's tokens.
                unsafe { out.write((tv.t0 + L8 * h + l) * job.rows + r, x) };
            }
        }
    }
}

/// The row from its blocks.
#[inline(always)]
unsafe fn unpack_row<T: Legacy>(blocks: &[T::B], row: &mut Row) {
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
unsafe fn pass<T: Legacy>(row: &Row, nb: usize, tv: &TileView<'_>, h: usize, res: &mut [f32; L8]) {
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
