//! Exact tiles: the 32-element types' prompt products on the GEMM panel, each output in the
//! decode path's order (AVX-512).
//!
//! The decode path ([`super::kern::dot_legacy512`], ggml's `ggml_vec_dot_q*_q8_*`) sums a row
//! and a token per block as eight i32 lanes, lane `j` the products of columns `4j..4j + 4`,
//! converts them and fuses them into eight float lanes (`acc += lanes · d · d_a`), the offset
//! terms `m · s` into one scalar, and ends with `hsum(acc) + msum`. The panel holds the same
//! quants with tokens across the lanes, one 4-column group a word: one `vpdpbusd` of a row's
//! broadcast 4-byte group with a panel vector is that lane `j` for 16 tokens at once. So here
//! each row keeps eight float vectors (one per lane `j`) of 16 tokens and follows the decode
//! path's float steps exactly, lane by lane: the same bits for every token, whatever else
//! shares the step (batch invariance), and about a third of the decode path's instructions
//! (the weights are unpacked once for 16 to 64 tokens, an activation word serves [`R`] rows).
//!
//! Safety requirement of every function: the CPU supports AVX2 + FMA + F16C and AVX-512
//! F/BW/VL/VNNI; they run inlined into `super`'s entry point.

use super::kern::F16c;
use crate::act::LANES;
use crate::decode::*;
use crate::driver::{Job, Panel};
use crate::shared::SharedMut;
use quiver_quant::as_blocks;
use std::arch::x86_64::*;

/// Rows per pass: each keeps 8 accumulators of 16 tokens (24 of the 32 registers).
const R: usize = 3;

/// Rows `r0..r1` of token tile `tile`, every type of [`crate::decode::Legacy`]; other types
/// write nothing (the caller only asks for these).
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C).
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

/// Unpacked rows: values as unsigned bytes (wide types `v ^ 0x80`), `d` and `m` per block;
/// and for the types without an offset field the tile's `M_MUL · Σa` per panel word.
struct Rows {
    u: Vec<u8>,
    d: Vec<f32>,
    m: Vec<f32>,
    c: Vec<i32>,
}

/// `M_MUL · Σa` of each word of the tile's quants: the lane sums of the signed values
/// `u + M_MUL` start there.
#[inline(always)]
unsafe fn offsets<T: Legacy>(q: &[u32]) -> Vec<i32> {
    let mut c = vec![0i32; q.len()];
    // |M_MUL| as a byte (8, 16, 128).
    let kx = _mm512_set1_epi8((-T::M_MUL) as i32 as u8 as i8);
    // SAFETY: AVX-512 F/VNNI per the module contract; 16 words at k < q.len() - 15.
    unsafe {
        let zero = _mm512_setzero_si512();
        for k in (0..q.len() - q.len() % LANES).step_by(LANES) {
            let av = _mm512_loadu_si512(q.as_ptr().add(k).cast());
            let v = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, kx, av));
            _mm512_storeu_si512(c.as_mut_ptr().add(k).cast(), v);
        }
    }
    c
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
    let Some(w) = as_blocks::<T::B>(job.w) else {
        return;
    };
    let shape = &p.shape;
    let (t0, nt, tpad) = shape.tile(tile);
    let (qo, so) = (shape.q_offset(tile), shape.s_offset(tile));
    let (cols, nb) = (job.cols, job.cols / 32);
    let (q_len, s_len) = (tpad * cols / 4, tpad * nb);
    if shape.sub != 32
        || w.len() < r1 * nb
        || p.q.len() < qo + q_len
        || p.a0.len() < so + s_len
        || p.a1.len() < so + s_len
    {
        return;
    }
    let (q, a0, a1) = (
        &p.q[qo..qo + q_len],
        &p.a0[so..so + s_len],
        &p.a1[so..so + s_len],
    );
    let mut rows = Rows {
        u: vec![0; R * cols],
        d: vec![0.0; R * nb],
        m: vec![0.0; R * nb],
        c: Vec::new(),
    };
    if !T::M_FIELD {
        // SAFETY: forwarded from the caller.
        rows.c = unsafe { offsets::<T>(q) };
    }
    let mut res = [[0f32; LANES]; R];
    let mut r = r0;
    while r < r1 {
        let nr = R.min(r1 - r);
        for i in 0..nr {
            // SAFETY: forwarded from the caller; row r + i < r1 has nb blocks in w.
            unsafe { unpack_row::<T>(&w[(r + i) * nb..(r + i + 1) * nb], i, &mut rows) };
        }
        for v in 0..tpad / LANES {
            // SAFETY: forwarded; the panel slices hold tpad lanes of every group and block,
            // and v < tpad / 16.
            unsafe {
                match nr {
                    3 => pass::<T, 3>(&rows, nb, q, a0, a1, tpad, v, &mut res),
                    2 => pass::<T, 2>(&rows, nb, q, a0, a1, tpad, v, &mut res),
                    _ => pass::<T, 1>(&rows, nb, q, a0, a1, tpad, v, &mut res),
                }
            }
            let lanes = (nt - LANES * v).min(LANES);
            for (i, res) in res.iter().enumerate().take(nr) {
                for (l, &x) in res.iter().enumerate().take(lanes) {
                    // SAFETY: this task owns rows r0..r1 of this tile's tokens.
                    unsafe { out.write((t0 + LANES * v + l) * job.rows + r + i, x) };
                }
            }
        }
        r += nr;
    }
}

/// Row `i` of `rows` from its blocks.
#[inline(always)]
unsafe fn unpack_row<T: Legacy>(blocks: &[T::B], i: usize, rows: &mut Rows) {
    let nb = blocks.len();
    let u = &mut rows.u[i * 32 * nb..(i + 1) * 32 * nb];
    let flip = if T::WIDE { -128i8 } else { 0 };
    // SAFETY: AVX-512 BW per the module contract; each store writes 64 (or 32) bytes at
    // 32 b < 32 nb.
    unsafe {
        let mut b = 0;
        while b + 2 <= nb {
            let v = _mm512_xor_si512(
                T::unpack2(&blocks[b], &blocks[b + 1]),
                _mm512_set1_epi8(flip),
            );
            _mm512_storeu_si512(u.as_mut_ptr().add(32 * b).cast(), v);
            b += 2;
        }
        if b < nb {
            let v = _mm256_xor_si256(T::unpack::<true>(&blocks[b]), _mm256_set1_epi8(flip));
            _mm256_storeu_si256(u.as_mut_ptr().add(32 * b).cast(), v);
        }
    }
    for (b, blk) in blocks.iter().enumerate() {
        let (d, m) = T::dm::<F16c>(blk);
        rows.d[i * nb + b] = d;
        rows.m[i * nb + b] = m;
    }
}

/// `N` rows against token vector `v` (16 tokens) of the tile: `res[i]` the 16 results of
/// row `i`.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn pass<T: Legacy, const N: usize>(
    rows: &Rows,
    nb: usize,
    q: &[u32],
    a0: &[f32],
    a1: &[f32],
    tpad: usize,
    v: usize,
    res: &mut [[f32; LANES]; R],
) {
    let cols = 32 * nb;
    // SAFETY: AVX-512 F/BW/VNNI per the module contract. Loads: quant words at
    // (8 b + g) tpad + 16 v + 16 <= cols / 4 · tpad, scales at b tpad + 16 v + 16 <= nb tpad
    // (the caller's slices), weight words at i cols + 32 b + 4 g + 4 <= N cols.
    unsafe {
        let (q, a0, a1) = (
            q.as_ptr().add(LANES * v),
            a0.as_ptr().add(LANES * v),
            a1.as_ptr().add(LANES * v),
        );
        let u = rows.u.as_ptr();
        let c0 = rows.c.as_ptr().add(LANES * v);
        let mut acc = [[_mm512_setzero_ps(); 8]; N];
        let mut ms = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let x0 = _mm512_loadu_ps(a0.add(b * tpad));
            let mut sc = [_mm512_setzero_ps(); N];
            for (i, sc) in sc.iter_mut().enumerate() {
                // d · d_a: exact (two f16 values), as the decode path's one product.
                *sc = _mm512_mul_ps(_mm512_set1_ps(rows.d[i * nb + b]), x0);
            }
            if T::M_FIELD {
                let x1 = _mm512_loadu_ps(a1.add(b * tpad));
                for (i, ms) in ms.iter_mut().enumerate() {
                    *ms = _mm512_fmadd_ps(_mm512_set1_ps(rows.m[i * nb + b]), x1, *ms);
                }
            }
            for g in 0..8 {
                let av = _mm512_loadu_si512(q.add((8 * b + g) * tpad).cast());
                // The lane sums of the signed values start from M_MUL · Σa.
                let c = if T::M_FIELD {
                    _mm512_setzero_si512()
                } else {
                    _mm512_loadu_si512(c0.add((8 * b + g) * tpad).cast())
                };
                for i in 0..N {
                    let word = u
                        .add(i * cols + 32 * b + 4 * g)
                        .cast::<i32>()
                        .read_unaligned();
                    let s = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(word), av);
                    acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc[i], acc[i][g]);
                }
            }
        }
        for i in 0..N {
            // hsum's order: lanes j and j + 4, then (0 + 2) and (1 + 3), then their sum.
            let a = &acc[i];
            let s0 = _mm512_add_ps(a[0], a[4]);
            let s1 = _mm512_add_ps(a[1], a[5]);
            let s2 = _mm512_add_ps(a[2], a[6]);
            let s3 = _mm512_add_ps(a[3], a[7]);
            let h = _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
            _mm512_storeu_ps(res[i].as_mut_ptr(), _mm512_add_ps(h, ms[i]));
        }
    }
}
