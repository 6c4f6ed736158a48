//! Exact tiles: prompt products on the GEMM panel, each output in the decode path's order
//! (AVX-512): the 32-element types and Q2_K to Q6_K (below).
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
use crate::driver::{Job, Panel, TileView};
use crate::shared::SharedMut;
use quiver_quant::{as_blocks, QK_K};
use std::arch::x86_64::*;

/// Rows per pass: each keeps 8 accumulators of 16 tokens (24 of the 32 registers).
const R: usize = 3;

/// Whether exact tiles take a type: the 32-element ones and Q2_K to Q6_K.
pub(crate) fn takes(ty: quiver_gguf::GgmlType) -> bool {
    use quiver_gguf::GgmlType as G;
    matches!(
        ty,
        G::Q4_0
            | G::Q4_1
            | G::Q5_0
            | G::Q5_1
            | G::Q8_0
            | G::IQ4_NL
            | G::Q2_K
            | G::Q3_K
            | G::Q4_K
            | G::Q5_K
            | G::Q6_K
    )
}

/// Rows `r0..r1` of token tile `tile`, for the types [`takes`] names; other types write
/// nothing.
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
            G::Q2_K => xgemm_k::<TQ2K>(job, p, tile, r0, r1, out),
            G::Q3_K => xgemm_k::<TQ3K>(job, p, tile, r0, r1, out),
            G::Q4_K => xgemm_k::<TQ4K>(job, p, tile, r0, r1, out),
            G::Q5_K => xgemm_k::<TQ5K>(job, p, tile, r0, r1, out),
            G::Q6_K => xgemm_k::<TQ6K>(job, p, tile, r0, r1, out),
            _ => {}
        }
    }
}

/// The most rows a pass takes (its results' rows).
const RMAX: usize = 4;

/// Eight lane sums of 16 tokens each added in ggml's `hsum` order (lanes j and j + 4, then
/// (0 + 2) and (1 + 3), then their sum), token by token.
#[inline(always)]
unsafe fn hsum8(a: &[__m512; 8]) -> __m512 {
    // SAFETY: AVX-512 F per the module contract.
    unsafe {
        let s0 = _mm512_add_ps(a[0], a[4]);
        let s1 = _mm512_add_ps(a[1], a[5]);
        let s2 = _mm512_add_ps(a[2], a[6]);
        let s3 = _mm512_add_ps(a[3], a[7]);
        _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3))
    }
}

/// Results `res[i]` of rows `r + i` for the tile's tokens `t..t + W` into `out` ([tokens,
/// rows]), the tile's real tokens only.
#[inline(always)]
pub(super) fn write_out<const W: usize>(
    out: &SharedMut<'_, f32>,
    rows: usize,
    tv: &TileView<'_>,
    t: usize,
    r: usize,
    res: &[[f32; W]],
) {
    let lanes = tv.nt.saturating_sub(t).min(W);
    for (i, res) in res.iter().enumerate() {
        for (l, &x) in res.iter().enumerate().take(lanes) {
            // SAFETY: the calling task owns these rows of this tile's tokens.
            unsafe { out.write((tv.t0 + t + l) * rows + r + i, x) };
        }
    }
}

/// Unpacked 32-element rows: values (here unsigned, wide types `v ^ 0x80`; on AVX2 signed but
/// for Q4_1/Q5_1, with their magnitudes in `ua`), `d` and `m` per block; and for the types
/// without an offset field the tile's `M_MUL · Σa` per panel word.
#[derive(Default)]
pub(super) struct Rows {
    pub u: Vec<u8>,
    pub ua: Vec<u8>,
    pub d: Vec<f32>,
    pub m: Vec<f32>,
    pub c: Vec<i32>,
}

/// The tiles' buffers, kept per thread from call to call (`KEPT.take()` … `KEPT.set(..)`):
/// a product allocates only when it is wider than any before on its thread (served decode
/// steps of 16+ rows take the tiles too).
#[derive(Default)]
pub(super) struct Kept {
    pub rows: Rows,
    pub krows: KRows,
    /// The tile's quant sums (K-quants).
    pub sums: Vec<i32>,
}

thread_local! {
    pub(super) static KEPT: std::cell::Cell<Kept> = std::cell::Cell::new(Kept::default());
}

/// `v` holding at least `n` values (grown, never shrunk: the caller writes what it reads).
pub(super) fn fit<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// `M_MUL · Σa` of each word of the tile's quants: the lane sums of the signed values
/// `u + M_MUL` start there.
#[inline(always)]
unsafe fn offsets<T: Legacy>(q: &[u32], c: &mut Vec<i32>) {
    fit(c, q.len());
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
    let (q, a0, a1, tpad) = (tv.q, tv.a0, tv.a1, tv.tpad);
    let mut kept = KEPT.take();
    let rows = &mut kept.rows;
    fit(&mut rows.u, R * cols);
    fit(&mut rows.d, R * nb);
    fit(&mut rows.m, R * nb);
    if !T::M_FIELD {
        // SAFETY: forwarded from the caller.
        unsafe { offsets::<T>(q, &mut rows.c) };
    }
    let mut res = [[0f32; LANES]; RMAX];
    let mut r = r0;
    while r < r1 {
        let nr = R.min(r1 - r);
        for i in 0..nr {
            // SAFETY: forwarded from the caller; row r + i < r1 has nb blocks in w.
            unsafe { unpack_row::<T>(&w[(r + i) * nb..(r + i + 1) * nb], i, rows) };
        }
        for v in 0..tpad / LANES {
            // SAFETY: forwarded; the panel slices hold tpad lanes of every group and block,
            // and v < tpad / 16.
            unsafe {
                match nr {
                    3 => pass::<T, 3>(rows, nb, q, a0, a1, tpad, v, &mut res),
                    2 => pass::<T, 2>(rows, nb, q, a0, a1, tpad, v, &mut res),
                    _ => pass::<T, 1>(rows, nb, q, a0, a1, tpad, v, &mut res),
                }
            }
            write_out(out, job.rows, &tv, LANES * v, r, &res[..nr]);
        }
        r += nr;
    }
    KEPT.set(kept);
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
    res: &mut [[f32; LANES]; RMAX],
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
            _mm512_storeu_ps(res[i].as_mut_ptr(), _mm512_add_ps(hsum8(&acc[i]), ms[i]));
        }
    }
}

// The K-quants whose decode product ends in whole-block or lane sums (Q4_K as llama.cpp's
// repacked kernel, Q6_K as `ggml_vec_dot_q6_K_q8_K`, Q2_K, Q3_K and Q5_K as the AVX-512 decode
// path's sixteen lanes, `kern::dot_k512`): per group of 4 columns a
// row's broadcast bytes times 16 tokens' quants (`vpmaddubsw`) scaled by the group's integer
// sub-block scale (`vpdpwssd`) into the lane's integer sum, the correction from the tile's
// quant sums per 16 columns; then per super-block the decode path's float steps.

/// Unpacked K-quant rows: values (256 a super-block), and per super-block the i16 scale of
/// each 16 columns as an i32 pair, the correction coefficients of each two 16s as an i16
/// pair, `d` and `cd`.
#[derive(Default)]
pub(super) struct KRows {
    pub u: Vec<u8>,
    pub sc: Vec<i32>,
    pub corr: Vec<i32>,
    pub d: Vec<f32>,
    pub cd: Vec<f32>,
}

impl KRows {
    /// Room for `rows` rows of `nb` super-blocks.
    pub fn fit(&mut self, rows: usize, nb: usize) {
        fit(&mut self.u, rows * QK_K * nb);
        fit(&mut self.sc, rows * 16 * nb);
        fit(&mut self.corr, rows * 8 * nb);
        fit(&mut self.d, rows * nb);
        fit(&mut self.cd, rows * nb);
    }
}

/// Two i16 in one i32 word, `lo` first.
fn pair16(lo: i8, hi: i8) -> i32 {
    (lo as i16 as u16 as u32 | (hi as i16 as u16 as u32) << 16) as i32
}

#[inline(always)]
unsafe fn xgemm_k<T: KQuant>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (cols, nb) = (job.cols, job.cols / QK_K);
    let (Some(w), Some(tv)) = (as_blocks::<T::B>(job.w), p.tile_view(tile)) else {
        return;
    };
    if T::WIDE || p.shape.sub != T::SUB || w.len() < r1 * nb {
        return;
    }
    let (q, a0, tpad) = (tv.q, tv.a0, tv.tpad);
    let mut kept = KEPT.take();
    let (rows, sums) = (&mut kept.krows, &mut kept.sums);
    // SAFETY: forwarded from the caller.
    unsafe { quant_sums(q, cols, tpad, sums) };
    rows.fit(KR, nb);
    let mut res = [[0f32; LANES]; RMAX];
    let q6 = T::GGML == GGML_Q6K;
    let lanes16 = T::GGML == GGML_LANES;
    let step = if q6 {
        2
    } else if lanes16 {
        1
    } else {
        KR
    };
    let mut r = r0;
    while r < r1 {
        let nr = step.min(r1 - r);
        for i in 0..nr {
            let blocks = &w[(r + i) * nb..(r + i + 1) * nb];
            // SAFETY: forwarded from the caller.
            unsafe { unpack_k::<T>(blocks, i, rows) };
        }
        for v in 0..tpad / LANES {
            // SAFETY: forwarded; the panel slices hold tpad lanes of every group and
            // sub-block, `sums` one word per 32 columns and lane, and v < tpad / 16.
            unsafe {
                match (q6, nr) {
                    _ if lanes16 => pass_k16::<T>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (true, 2) => pass_k::<T, true, 2>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (true, _) => pass_k::<T, true, 1>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (false, 4) => pass_k::<T, false, 4>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (false, 3) => pass_k::<T, false, 3>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (false, 2) => pass_k::<T, false, 2>(rows, nb, q, a0, sums, tpad, v, &mut res),
                    (false, _) => pass_k::<T, false, 1>(rows, nb, q, a0, sums, tpad, v, &mut res),
                }
            }
            write_out(out, job.rows, &tv, LANES * v, r, &res[..nr]);
        }
        r += nr;
    }
    KEPT.set(kept);
}

/// Rows per K-quant pass (Q4_K; Q6_K takes 2: eight lane sums a row).
const KR: usize = 4;

/// The tile's quant sums per 16 columns, two a word (i16: the 16s `2j` and `2j + 1`), as
/// `[cols / 32][tpad]`: the activation's `bsums` pairs, for the correction.
#[inline(always)]
unsafe fn quant_sums(q: &[u32], cols: usize, tpad: usize, s: &mut Vec<i32>) {
    fit(s, cols / 32 * tpad);
    // SAFETY: AVX-512 F/BW/VNNI per the module contract; words (8 j + g) tpad + 16 v + 16
    // <= cols / 4 · tpad, sums j tpad + 16 v + 16 <= cols / 32 · tpad.
    unsafe {
        let ones = _mm512_set1_epi8(1);
        let lo16 = _mm512_set1_epi32(0xffff);
        for j in 0..cols / 32 {
            for v in 0..tpad / LANES {
                let mut h = [_mm512_setzero_si512(); 2];
                for (k, h) in h.iter_mut().enumerate() {
                    for g in 0..4 {
                        let at = (8 * j + 4 * k + g) * tpad + LANES * v;
                        let av = _mm512_loadu_si512(q.as_ptr().add(at).cast());
                        *h = _mm512_dpbusd_epi32(*h, ones, av);
                    }
                }
                let word =
                    _mm512_or_si512(_mm512_and_si512(h[0], lo16), _mm512_slli_epi32::<16>(h[1]));
                _mm512_storeu_si512(s.as_mut_ptr().add(j * tpad + LANES * v).cast(), word);
            }
        }
    }
}

/// Row `i` of `rows` from its super-blocks.
#[inline(always)]
pub(super) unsafe fn unpack_k<T: KQuant>(blocks: &[T::B], i: usize, rows: &mut KRows) {
    let nb = blocks.len();
    for (b, blk) in blocks.iter().enumerate() {
        // SAFETY: forwarded from the caller; 256 bytes at 256 (i nb + b).
        unsafe {
            super::kern::dec_k::<T>(
                blk,
                &mut rows.u[QK_K * (i * nb + b)..QK_K * (i * nb + b + 1)],
            )
        };
        let k = T::scales::<F16c>(blk);
        for j in 0..16 {
            rows.sc[16 * (i * nb + b) + j] = pair16(k.sc[j], k.sc[j]);
        }
        for j in 0..8 {
            rows.corr[8 * (i * nb + b) + j] = pair16(k.corr[2 * j], k.corr[2 * j + 1]);
        }
        rows.d[i * nb + b] = k.d;
        rows.cd[i * nb + b] = k.cd;
    }
}

/// `N` K-quant rows against token vector `v`: Q4_K (`Q6` false) one integer sum and one
/// correction a super-block, fused into two accumulators, `acc + accm`; Q6_K eight lane
/// sums less 32 times their corrections, fused into eight, then `hsum`.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn pass_k<T: KQuant, const Q6: bool, const N: usize>(
    rows: &KRows,
    nb: usize,
    q: &[u32],
    a0: &[f32],
    sums: &[i32],
    tpad: usize,
    v: usize,
    res: &mut [[f32; LANES]; RMAX],
) {
    let cols = QK_K * nb;
    let per = QK_K / T::SUB;
    // SAFETY: AVX-512 F/BW/VNNI per the module contract. Loads: quant words at
    // kg tpad + 16 v + 16 <= cols / 4 · tpad, scales at (per b) tpad + 16 v + 16 <= cols / SUB
    // · tpad, sums at (8 b + k) tpad + 16 v + 16 <= cols / 32 · tpad, weight words at
    // i cols + 4 kg + 4 <= N cols.
    unsafe {
        let (q, a0, sums) = (
            q.as_ptr().add(LANES * v),
            a0.as_ptr().add(LANES * v),
            sums.as_ptr().add(LANES * v),
        );
        let u = rows.u.as_ptr();
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 8]; N];
        let mut accm = [_mm512_setzero_ps(); N];
        // Q6_K's eight float sums a row live in memory (read once a super-block): the
        // registers hold the integer ones.
        let mut mem = [[[0f32; LANES]; 8]; N];
        for b in 0..nb {
            let da = _mm512_loadu_ps(a0.add(per * b * tpad));
            let mut lanes = [[zero; 8]; N];
            if !Q6 {
                // Q4_K: one scale a 32 columns, one sum a super-block: the 32's products
                // chained by `vpdpbusd`, then scaled.
                for s in 0..8 {
                    let mut t = [zero; N];
                    for g in 0..8 {
                        let kg = 64 * b + 8 * s + g;
                        let av = _mm512_loadu_si512(q.add(kg * tpad).cast());
                        for i in 0..N {
                            let word = u.add(i * cols + 4 * kg).cast::<i32>().read_unaligned();
                            t[i] = _mm512_dpbusd_epi32(t[i], _mm512_set1_epi32(word), av);
                        }
                    }
                    for i in 0..N {
                        let sc = _mm512_set1_epi32(rows.sc[16 * (i * nb + b) + 2 * s] & 0xffff);
                        lanes[i][0] = _mm512_add_epi32(lanes[i][0], _mm512_mullo_epi32(t[i], sc));
                    }
                }
            }
            for j in (0..16).filter(|_| Q6) {
                let mut scv = [zero; N];
                for i in 0..N {
                    scv[i] = _mm512_set1_epi32(rows.sc[16 * (i * nb + b) + j]);
                }
                for g in 0..4 {
                    let kg = 64 * b + 4 * j + g;
                    let av = _mm512_loadu_si512(q.add(kg * tpad).cast());
                    let l = if Q6 { (4 * j + g) % 8 } else { 0 };
                    for i in 0..N {
                        let word = u.add(i * cols + 4 * kg).cast::<i32>().read_unaligned();
                        let p16 = _mm512_maddubs_epi16(_mm512_set1_epi32(word), av);
                        lanes[i][l] = _mm512_dpwssd_epi32(lanes[i][l], p16, scv[i]);
                    }
                }
            }
            for i in 0..N {
                let at = i * nb + b;
                let kd = _mm512_mul_ps(_mm512_set1_ps(rows.d[at]), da);
                if Q6 {
                    for k in 0..8 {
                        let s = _mm512_loadu_si512(sums.add((8 * b + k) * tpad).cast());
                        let c =
                            _mm512_dpwssd_epi32(zero, s, _mm512_set1_epi32(rows.corr[8 * at + k]));
                        let l = _mm512_sub_epi32(lanes[i][k], _mm512_slli_epi32::<5>(c));
                        let m = mem[i][k].as_mut_ptr();
                        _mm512_storeu_ps(
                            m,
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), kd, _mm512_loadu_ps(m)),
                        );
                    }
                } else {
                    let mut c = zero;
                    for k in 0..8 {
                        let s = _mm512_loadu_si512(sums.add((8 * b + k) * tpad).cast());
                        c = _mm512_dpwssd_epi32(c, s, _mm512_set1_epi32(rows.corr[8 * at + k]));
                    }
                    let kcd = _mm512_mul_ps(_mm512_set1_ps(rows.cd[at]), da);
                    acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[i][0]), kd, acc[i][0]);
                    accm[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), kcd, accm[i]);
                }
            }
        }
        for i in 0..N {
            let r = if Q6 {
                hsum8(&mem[i].map(|m| _mm512_loadu_ps(m.as_ptr())))
            } else {
                _mm512_add_ps(acc[i][0], accm[i])
            };
            _mm512_storeu_ps(res[i].as_mut_ptr(), r);
        }
    }
}

/// One K-quant row of [`GGML_LANES`] (Q2_K, Q3_K, Q5_K) against token vector `v`, as the
/// AVX-512 decode path (`kern::dot_k512`) sums it: per super-block sixteen integer lane sums
/// (lane `l` the 4 columns of word `16 p + l` of each 64 columns `p`: the even 32's for
/// `l < 8`, the odd one's above; each word's products times its 16's scale), each converted
/// and fused into its float lane with `d · d_a`; the correction's eight lanes fused with
/// `cd · d_a`; then the sixteen lanes added in `_mm512_reduce_add_ps`'s order ([`reduce16`])
/// plus the eight in `hsum`'s.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pass_k16<T: KQuant>(
    rows: &KRows,
    nb: usize,
    q: &[u32],
    a0: &[f32],
    sums: &[i32],
    tpad: usize,
    v: usize,
    res: &mut [[f32; LANES]; RMAX],
) {
    let per = QK_K / T::SUB;
    // SAFETY: AVX-512 F/BW/VNNI per the module contract. Loads: quant words at
    // kg tpad + 16 v + 16 <= cols / 4 · tpad, scales at (per b) tpad + 16 v + 16 <= cols / SUB
    // · tpad, sums at (8 b + k) tpad + 16 v + 16 <= cols / 32 · tpad, weight words at
    // 4 kg + 4 <= cols (row 0 of `rows`).
    unsafe {
        let (q, a0, sums) = (
            q.as_ptr().add(LANES * v),
            a0.as_ptr().add(LANES * v),
            sums.as_ptr().add(LANES * v),
        );
        let u = rows.u.as_ptr();
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut accm = [_mm512_setzero_ps(); 8];
        for b in 0..nb {
            let da = _mm512_loadu_ps(a0.add(per * b * tpad));
            let kd = _mm512_mul_ps(_mm512_set1_ps(rows.d[b]), da);
            let kcd = _mm512_mul_ps(_mm512_set1_ps(rows.cd[b]), da);
            for (l, acc) in acc.iter_mut().enumerate() {
                let mut isum = zero;
                for p in 0..4 {
                    let kg = 64 * b + 16 * p + l;
                    let av = _mm512_loadu_si512(q.add(kg * tpad).cast());
                    let word = u.add(4 * kg).cast::<i32>().read_unaligned();
                    // The 16 of these columns: of the 32 2 p (lanes below 8) or 2 p + 1, its
                    // first half for the lanes l % 8 < 4.
                    let half = 2 * (2 * p + l / 8) + (l % 8) / 4;
                    let sc = _mm512_set1_epi32(rows.sc[16 * b + half]);
                    let p16 = _mm512_maddubs_epi16(_mm512_set1_epi32(word), av);
                    isum = _mm512_dpwssd_epi32(isum, p16, sc);
                }
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), kd, *acc);
            }
            for (k, accm) in accm.iter_mut().enumerate() {
                let s = _mm512_loadu_si512(sums.add((8 * b + k) * tpad).cast());
                let c = _mm512_dpwssd_epi32(zero, s, _mm512_set1_epi32(rows.corr[8 * b + k]));
                *accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), kcd, *accm);
            }
        }
        _mm512_storeu_ps(
            res[0].as_mut_ptr(),
            _mm512_add_ps(reduce16(&acc), hsum8(&accm)),
        );
    }
}

/// Sixteen lane sums of 16 tokens each added token by token in `_mm512_reduce_add_ps`'s
/// order: lanes `i` and `i + 8`, then `+ 4`, `+ 2`, `+ 1` (the halving tree; a test holds it).
#[inline(always)]
unsafe fn reduce16(a: &[__m512; 16]) -> __m512 {
    // SAFETY: AVX-512 F per the module contract.
    unsafe {
        let t8: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 8]));
        let t4: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(t8[i], t8[i + 4]));
        let t2: [__m512; 2] = std::array::from_fn(|i| _mm512_add_ps(t4[i], t4[i + 2]));
        _mm512_add_ps(t2[0], t2[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`reduce16`] adds a token's sixteen lanes as `_mm512_reduce_add_ps` adds a register's
    /// (the decode path's last step), on values whose sum depends on the order.
    #[test]
    fn reduce16_is_mm512_reduce_add_ps() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn check(seed: u64) -> (f32, f32, f32) {
            let mut x = seed;
            let mut vals = [0f32; 16];
            for v in vals.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let e = (x >> 58) as i32 - 32; // exponents over a wide range
                *v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi(e / 2);
            }
            // SAFETY: AVX-512 F is present; 16 floats.
            unsafe {
                let want = _mm512_reduce_add_ps(_mm512_loadu_ps(vals.as_ptr()));
                let lanes: [__m512; 16] = std::array::from_fn(|l| _mm512_set1_ps(vals[l]));
                let got = _mm512_cvtss_f32(reduce16(&lanes));
                (want, got, vals.iter().sum())
            }
        }
        let mut other_orders = 0;
        for seed in 1..2000u64 {
            // SAFETY: AVX-512 F checked above.
            let (want, got, sequential) = unsafe { check(seed * 0x9e37_79b9) };
            assert_eq!(
                want.to_bits(),
                got.to_bits(),
                "seed {seed}: {want} vs {got}"
            );
            other_orders += usize::from(sequential.to_bits() != want.to_bits());
        }
        // The values tell orders apart: a left-to-right sum differs often.
        assert!(
            other_orders > 100,
            "{other_orders} of 1999 differ from the sequential sum"
        );
    }
}
