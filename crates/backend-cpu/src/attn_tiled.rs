//! Tiled prompt attention over the f16 cache, for the steps of 64+ rows of single-sequence
//! commands (`Numerics::Fast`, [`crate::attn::tiled`]), which llama.cpp also runs tiled and
//! which need not reproduce its floats bit for bit.
//!
//! A task takes a run of up to [`QT`] consecutive tokens of one sequence and a part of a KV
//! group. Keys go by tiles of [`KT`]. A tile's K and V rows are widened to f32 once for all the
//! task's rows. Each row then takes the tile in one go: scores as a small product (K held
//! transposed, so the products of 8 keys are one vector operation), the online softmax once per
//! tile (max, ggml's e^x, one rescale), and p·V accumulated in f32.
//!
//! The row-by-row form ([`crate::attn`]) runs each key through a dot product with its own
//! reduction, a scalar e^x and a rescale of the accumulator. At 2,048 cached tokens it took
//! ~118 cycles per (key, head).

use crate::act_fn::ggml_expf;
use crate::attn::{has_avx2, heads_per_task, Out, MAX_HEAD_DIM};
use quiver_backend::{AttnParams, Batch};
use quiver_cpu_kernels::ThreadPool;
use std::ops::Range;

/// Query tokens per task.
const QT: usize = 16;
/// Keys per tile.
const KT: usize = 32;

/// A task's buffers, per thread: the tile's keys (transposed) and values in f32, and each
/// row's accumulator, running maximum and sum.
#[derive(Default)]
struct Scratch {
    kt: Vec<f32>,
    vt: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    sum: Vec<f32>,
}

/// Attention of every (token, head) of `batch` over the f16 cache, tiled.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
) {
    thread_local! {
        static RUNS: std::cell::RefCell<Vec<Range<usize>>> = Default::default();
        static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
    }
    let (hd, nh) = (a.head_dim, a.n_head);
    let g = heads_per_task(a, batch.n_tokens(), pool.n_threads());
    assert!(hd <= MAX_HEAD_DIM && out.len() >= batch.n_tokens() * nh * hd && q.len() >= out.len());
    let avx2 = has_avx2();
    RUNS.with_borrow_mut(|runs| {
        runs.clear();
        runs.extend(batch.seqs.iter().flat_map(|s| {
            (s.start..s.start + s.len)
                .step_by(QT)
                .map(move |t| t..(t + QT).min(s.start + s.len))
        }));
        let o = &Out(out.as_mut_ptr());
        let task = |i: usize| {
            let (run, h0) = (runs[i / (nh / g)].clone(), (i % (nh / g)) * g);
            SCRATCH.with_borrow_mut(|sc| {
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: `avx2` is true only when AVX2, FMA and F16C were detected.
                    unsafe { task_avx2(sc, q, k_cache, v_cache, batch, a, run.clone(), h0, g) };
                } else {
                    task_body::<false>(sc, q, k_cache, v_cache, batch, a, run.clone(), h0, g);
                }
                #[cfg(not(target_arch = "x86_64"))]
                task_body::<false>(sc, q, k_cache, v_cache, batch, a, run.clone(), h0, g);
                for (i, t) in run.enumerate() {
                    for j in 0..g {
                        let r = i * g + j;
                        let inv = 1.0 / sc.sum[r];
                        // SAFETY: the row of head h0 + j of token t is written by this task
                        // only (each (token, head) belongs to one run and one group part),
                        // inside `out` (the assert above).
                        let row = unsafe {
                            std::slice::from_raw_parts_mut(o.0.add((t * nh + h0 + j) * hd), hd)
                        };
                        for (y, x) in row.iter_mut().zip(&sc.acc[r * hd..][..hd]) {
                            *y = x * inv;
                        }
                    }
                }
            });
        };
        pool.run(runs.len() * (nh / g), &task);
    });
}

/// [`task_body`] compiled for AVX2 + FMA + F16C, its rows on [`row_avx2`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn task_avx2(
    sc: &mut Scratch,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    run: Range<usize>,
    h0: usize,
    g: usize,
) {
    task_body::<true>(sc, q, k_cache, v_cache, batch, a, run, h0, g)
}

/// What a row needs of its tile: the keys it sees (tile positions `lo..=hi`), the scale
/// and soft-cap.
struct Tile<'a> {
    kt: &'a [f32],
    vt: &'a [f32],
    lo: usize,
    hi: usize,
    scale: f32,
    softcap: Option<f32>,
}

/// One row's running state: maximum, sum, accumulator.
struct Row<'a> {
    m: &'a mut f32,
    sum: &'a mut f32,
    acc: &'a mut [f32],
}

impl Row<'_> {
    /// A tile's maximum `mx` seen: where it is above the running maximum, that becomes `mx`
    /// and the sum and accumulator are rescaled by e^(old − mx) (0 for the first).
    #[inline(always)]
    fn raise(&mut self, mx: f32) {
        if mx > *self.m {
            let rr = if *self.m == f32::NEG_INFINITY {
                0.0
            } else {
                ggml_expf(*self.m - mx)
            };
            *self.m = mx;
            *self.sum *= rr;
            self.acc.iter_mut().for_each(|x| *x *= rr);
        }
    }
}

/// One task: heads `h0..h0 + g` of the tokens of `run`, their accumulators left in `sc`.
/// `AVX`: rows on [`row_avx2`] (the caller runs with AVX2, FMA and F16C enabled).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn task_body<const AVX: bool>(
    sc: &mut Scratch,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    run: Range<usize>,
    h0: usize,
    g: usize,
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let kv_dim = a.n_head_kv * hd;
    let koff = (h0 / (nh / a.n_head_kv)) * hd;
    let rows = run.len() * g;
    let s = batch.seq_of[run.start] as usize;
    let scale = if a.scale_q { 1.0 } else { a.scale };
    let scale = a.softcap.map_or(scale, |c| scale / c);
    let span = |t: usize| {
        let pos = batch.positions[t] as usize;
        (
            a.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize)),
            pos,
        )
    };
    let lo = run.clone().map(|t| span(t).0).min().unwrap_or(0);
    let hi = run.clone().map(|t| span(t).1).max().unwrap_or(0);
    sc.kt.resize(KT * hd, 0.0);
    sc.vt.resize(KT * hd, 0.0);
    sc.acc.clear();
    sc.acc.resize(rows * hd, 0.0);
    sc.m.clear();
    sc.m.resize(rows, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(rows, 0.0);
    let Scratch {
        kt,
        vt,
        acc,
        m,
        sum,
    } = sc;
    let avx = AVX && hd.is_multiple_of(8) && a.softcap.is_none();
    for k0 in (lo..=hi).step_by(KT) {
        let n = KT.min(hi + 1 - k0);
        for kk in 0..KT {
            if kk < n {
                let slot = batch.slot(s, k0 + kk);
                let (kr, vr) = (
                    &k_cache[slot * kv_dim + koff..][..hd],
                    &v_cache[slot * kv_dim + koff..][..hd],
                );
                for d in 0..hd {
                    kt[d * KT + kk] = kr[d].to_f32();
                }
                for (x, y) in vt[kk * hd..][..hd].iter_mut().zip(vr) {
                    *x = y.to_f32();
                }
            } else {
                for d in 0..hd {
                    kt[d * KT + kk] = 0.0;
                }
            }
        }
        for (i, t) in run.clone().enumerate() {
            let (first, pos) = span(t);
            if k0 > pos || k0 + n <= first {
                continue;
            }
            let tile = Tile {
                kt,
                vt,
                lo: first.saturating_sub(k0),
                hi: (pos - k0).min(n - 1),
                scale,
                softcap: a.softcap,
            };
            for j in 0..g {
                let r = i * g + j;
                let qrow = &q[(t * nh + h0 + j) * hd..][..hd];
                let row = Row {
                    m: &mut m[r],
                    sum: &mut sum[r],
                    acc: &mut acc[r * hd..][..hd],
                };
                #[cfg(target_arch = "x86_64")]
                if avx {
                    // SAFETY: AVX, AVX2, FMA per `AVX`'s contract; hd is a multiple of 8.
                    unsafe { row_avx2(qrow, &tile, row) };
                    continue;
                }
                row_generic(qrow, &tile, row);
            }
        }
    }
}

/// A row's step over a tile, in plain Rust.
fn row_generic(qrow: &[f32], t: &Tile, mut r: Row) {
    let hd = qrow.len();
    let mut sv = [0f32; KT];
    for (d, &qd) in qrow.iter().enumerate() {
        for (x, &k) in sv.iter_mut().zip(&t.kt[d * KT..][..KT]) {
            *x += qd * k;
        }
    }
    let mut mx = f32::NEG_INFINITY;
    for (kk, x) in sv.iter_mut().enumerate() {
        let mut y = *x * t.scale;
        if let Some(c) = t.softcap {
            y = c * y.tanh();
        }
        *x = if kk >= t.lo && kk <= t.hi {
            y
        } else {
            f32::NEG_INFINITY
        };
        mx = mx.max(*x);
    }
    if mx == f32::NEG_INFINITY {
        return;
    }
    r.raise(mx);
    for (kk, x) in sv.iter().enumerate() {
        if *x == f32::NEG_INFINITY {
            continue;
        }
        let p = ggml_expf(*x - *r.m);
        *r.sum += p;
        for (y, &v) in r.acc.iter_mut().zip(&t.vt[kk * hd..][..hd]) {
            *y += v * p;
        }
    }
}

/// ggml's e^x ([`ggml_expf`]) on 8 lanes: the same constants and fused multiply-adds; e^−∞
/// is 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |b: u32| _mm256_set1_ps(f32::from_bits(b));
    let r = _mm256_set1_ps(12_582_912.0);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm256_sub_ps(z, r);
    let nn = _mm256_sub_ps(_mm256_setzero_ps(), n);
    let b = _mm256_fmadd_ps(nn, c(0x35bf_be8e), _mm256_fmadd_ps(nn, c(0x3f31_7200), x));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
    );
    let ni = _mm256_cvtps_epi32(n);
    let e = _mm256_min_epi32(
        _mm256_max_epi32(ni, _mm256_set1_epi32(-126)),
        _mm256_set1_epi32(127),
    );
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        e,
        _mm256_set1_epi32(127),
    )));
    let res = _mm256_mul_ps(j, scale);
    let big = _mm256_castsi256_ps(_mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127)));
    let small = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ni));
    _mm256_andnot_ps(
        small,
        _mm256_blendv_ps(res, _mm256_set1_ps(f32::INFINITY), big),
    )
}

/// A row's step over a tile with AVX2 + FMA: the 32 scores in four registers, the weights by
/// [`exp8`], the accumulator updated 64 values at a time from registers.
///
/// # Safety
/// AVX2 and FMA; `qrow.len()` a multiple of 8; no soft-cap.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_avx2(qrow: &[f32], t: &Tile, mut r: Row) {
    use std::arch::x86_64::*;
    let hd = qrow.len();
    let kt = t.kt.as_ptr();
    let mut s = [_mm256_setzero_ps(); KT / 8];
    for (d, &qd) in qrow.iter().enumerate() {
        let qv = _mm256_set1_ps(qd);
        for (c, sc) in s.iter_mut().enumerate() {
            *sc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt.add(d * KT + 8 * c)), *sc);
        }
    }
    let (lo, hi) = (
        _mm256_set1_epi32(t.lo as i32 - 1),
        _mm256_set1_epi32(t.hi as i32 + 1),
    );
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut mx = ninf;
    for (c, sc) in s.iter_mut().enumerate() {
        let kk = _mm256_add_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(8 * c as i32),
        );
        let seen = _mm256_and_si256(_mm256_cmpgt_epi32(kk, lo), _mm256_cmpgt_epi32(hi, kk));
        *sc = _mm256_blendv_ps(
            ninf,
            _mm256_mul_ps(*sc, _mm256_set1_ps(t.scale)),
            _mm256_castsi256_ps(seen),
        );
        mx = _mm256_max_ps(mx, *sc);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let mx = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    if mx == f32::NEG_INFINITY {
        return;
    }
    r.raise(mx);
    let mv = _mm256_set1_ps(*r.m);
    let mut p = [0f32; KT];
    let mut ps = _mm256_setzero_ps();
    for (c, sc) in s.iter().enumerate() {
        let w = exp8(_mm256_sub_ps(*sc, mv));
        ps = _mm256_add_ps(ps, w);
        _mm256_storeu_ps(p.as_mut_ptr().add(8 * c), w);
    }
    let p4 = _mm_add_ps(_mm256_castps256_ps128(ps), _mm256_extractf128_ps::<1>(ps));
    let p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
    *r.sum += _mm_cvtss_f32(_mm_add_ss(p2, _mm_movehdup_ps(p2)));
    // p·V: 64 accumulator values at a time held in registers over the tile's keys.
    let (vt, acc) = (t.vt.as_ptr(), r.acc.as_mut_ptr());
    let mut d0 = 0;
    while d0 + 64 <= hd {
        pv_block::<8>(acc.add(d0), vt.add(d0), hd, &p, t.lo, t.hi);
        d0 += 64;
    }
    while d0 < hd {
        pv_block::<1>(acc.add(d0), vt.add(d0), hd, &p, t.lo, t.hi);
        d0 += 8;
    }
}

/// acc[..8W] += Σ p[kk] · vt[kk][..8W] over keys lo..=hi (rows of `hd`), in registers.
///
/// # Safety
/// AVX and FMA; `acc` and every `vt` row hold 8W values from the pointers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pv_block<const W: usize>(
    acc: *mut f32,
    vt: *const f32,
    hd: usize,
    p: &[f32; KT],
    lo: usize,
    hi: usize,
) {
    use std::arch::x86_64::*;
    let mut av = [_mm256_setzero_ps(); W];
    for (i, x) in av.iter_mut().enumerate() {
        *x = _mm256_loadu_ps(acc.add(8 * i));
    }
    for (k, &pk) in p[lo..=hi].iter().enumerate() {
        let pv = _mm256_set1_ps(pk);
        let vrow = vt.add((lo + k) * hd);
        for (i, x) in av.iter_mut().enumerate() {
            *x = _mm256_fmadd_ps(_mm256_loadu_ps(vrow.add(8 * i)), pv, *x);
        }
    }
    for (i, x) in av.iter().enumerate() {
        _mm256_storeu_ps(acc.add(8 * i), *x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attn::test_inputs::{case, rng, Case};
    use quiver_backend::testing::rel_err;

    /// The tiled form against the row-by-row form with the same weights (f32 accumulator,
    /// ggml's e^x): heads dims with and without a tail, a window, soft-capping, a cached prefix
    /// and runs that cross key tiles; within float rounding of each other.
    #[test]
    fn tiled_matches_row_by_row() {
        let pool = ThreadPool::new(2).unwrap();
        let mut rnd = rng();
        for (hd, window, softcap, start) in [
            (64, None, None, 0),
            (128, Some(37), None, 21),
            (256, None, Some(30.0), 40),
            (80, None, None, 3),
        ] {
            let n = 70;
            let blocks = [3, 0, 5, 1, 4, 2, 6, 7];
            let Case { a, batch, k, v, q } =
                case(&mut rnd, hd, window, softcap, n, start, &blocks, 128, false);
            let len = n * a.n_head * hd;
            let mut want = vec![0f32; len];
            crate::attn::run(&pool, &q, &k, &v, &batch, &a, &mut want, 1, false, true);
            let mut got = vec![f32::NAN; len];
            attention(&pool, &q, &k, &v, &batch, &a, &mut got);
            let rel = rel_err(&got, &want);
            assert!(
                rel < 1e-5,
                "hd {hd}, window {window:?}: relative L2 {rel:e}"
            );
        }
    }
}
