//! CPU attention: online softmax per (token, head) over the sequence's cached K/V (values
//! held f16-rounded, as llama.cpp's default f16 cache holds them), accumulators in a per-thread
//! scratch grown once; (token, head) pairs — or (token, KV group) for prompt steps — are spread
//! over the thread pool.
//!
//! Each (token, head) runs as llama.cpp's one-row CPU flash attention does, operation for
//! operation (quiver reproduces its floats, docs/ARCHITECTURE.md): q·k in the f16 dot's
//! AVX-512 order, the running sum and the p·v update as fused multiply-adds, and the p·v
//! accumulator rounded to f16 after every key as llama.cpp keeps it with an f16 cache.
//! With `Numerics::Fast` (single sequence), steps of 64+ rows run tiled instead
//! (`attn_tiled.rs`: query runs × key tiles, f32 accumulator, ggml's e^x), as llama.cpp's tiled
//! attention for such batches does (not its tiling: close, not exact; the row-by-row form
//! with those weights, `run(.., tiled = true)`, is its test's reference).

use half::slice::HalfFloatSliceExt;

use quiver_backend::{AttnParams, Batch};
use quiver_cpu_kernels::{Numerics, SimdLevel, ThreadPool};

/// Largest head dimension the stack accumulator holds.
pub const MAX_HEAD_DIM: usize = 512;

/// Raw output pointer shared by the tasks; each task writes only its own (token, head) row.
pub(crate) struct Out(pub(crate) *mut f32);
// SAFETY: tasks write disjoint ranges `[(t·nh + h)·hd, +hd)` (one task per (t, h)), and the
// slice is not read until `pool.run` returns.
unsafe impl Sync for Out {}

/// Whether a step of `n` query rows takes llama.cpp's tiled attention: with
/// [`Numerics::Fast`] (single sequence), from 64 rows, as llama.cpp does; that form keeps q and
/// the p·v accumulator in f32. Below that it works row by row with q in f16 and an f16
/// accumulator, which quiver reproduces exactly. [`Numerics::BatchInvariant`] (the server)
/// always takes the row-by-row form.
pub fn tiled(n: usize, numerics: Numerics) -> bool {
    n >= 64 && !numerics.is_batch_invariant()
}

/// The per-key operations of a task over `G` heads that share a KV head (their queries and
/// accumulators side by side, head `j` at `j · head_dim`); [`softmax_group`] runs the online
/// softmax over them once for every implementation. Each computes the same floats: the dot
/// products in `numerics::f16_dot`'s order (products rounded, then added), the updates as fused
/// multiply-adds, the accumulator rounded to f16 after each update when `r16`.
pub(crate) trait Keys {
    /// q_j·k with one K row.
    fn dot(&mut self, j: usize, k: &[half::f16]) -> f32;
    /// acc_j ← acc_j · r.
    fn rescale(&mut self, j: usize, r: f32);
    /// acc_j ← v · w + acc_j.
    fn mad(&mut self, j: usize, v: &[half::f16], w: f32);
    /// row ← acc_j · inv.
    fn finish(&mut self, j: usize, row: &mut [f32], inv: f32);
}

/// The online softmax of `g` consecutive heads from `h0` (one KV group, or part of one) of
/// token `t` over their visible keys, head by head in ggml's order of operations (llama.cpp
/// parity): the scale divided by the soft-cap first, the running sum and the p·v update fused
/// multiply-adds; steps of 64+ rows (`tiled`) take the weights from ggml's vectorised e^x, as
/// llama.cpp's tiled attention does. Each key's K and V rows are read once for all `g` heads;
/// each head's operations are those it takes alone. `rows`: the `g` output rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_group<K: Keys>(
    ks: &mut K,
    t: usize,
    h0: usize,
    g: usize,
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    tiled: bool,
    rows: &mut [f32],
) {
    let hd = a.head_dim;
    let kv_dim = a.n_head_kv * hd;
    let s = batch.seq_of[t] as usize;
    let pos = batch.positions[t] as usize;
    let first = a.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
    let koff = (h0 / (a.n_head / a.n_head_kv)) * hd;
    let scale = if a.scale_q { 1.0 } else { a.scale };
    let scale = a.softcap.map_or(scale, |c| scale / c);
    let (mut m, mut sum) = ([f32::NEG_INFINITY; MAX_GROUP], [0f32; MAX_GROUP]);
    for p in first..=pos {
        let slot = batch.slot(s, p);
        let krow = &k_cache[slot * kv_dim + koff..][..hd];
        let vrow = &v_cache[slot * kv_dim + koff..][..hd];
        for j in 0..g {
            let mut sc = ks.dot(j, krow) * scale;
            if let Some(c) = a.softcap {
                sc = c * sc.tanh();
            }
            let w = if sc > m[j] {
                let r = (m[j] - sc).exp();
                m[j] = sc;
                sum[j] = sum[j].mul_add(r, 1.0);
                ks.rescale(j, r);
                1.0
            } else {
                let w = if tiled {
                    crate::act_fn::ggml_expf(sc - m[j])
                } else {
                    (sc - m[j]).exp()
                };
                sum[j] += w;
                w
            };
            ks.mad(j, vrow, w);
        }
    }
    for (j, row) in rows.chunks_exact_mut(hd).take(g).enumerate() {
        ks.finish(j, row, 1.0 / sum[j]);
    }
}

/// Heads one task takes at most (a KV group is cut into parts of at most this many).
const MAX_GROUP: usize = 8;

/// Plain Rust: rows widened into a buffer, then `numerics::f16_dot` and the element loops.
struct Generic<'a> {
    q: &'a [f32],
    acc: &'a mut [f32],
    row32: &'a mut [f32],
    hd: usize,
    r16: bool,
}

impl Generic<'_> {
    fn round(&mut self, j: usize) {
        if self.r16 {
            for x in &mut self.acc[j * self.hd..][..self.hd] {
                *x = half::f16::from_f32(*x).to_f32();
            }
        }
    }
}

impl Keys for Generic<'_> {
    fn dot(&mut self, j: usize, k: &[half::f16]) -> f32 {
        k.convert_to_f32_slice(self.row32);
        quiver_backend::numerics::f16_dot(&self.q[j * self.hd..][..self.hd], self.row32)
    }
    fn rescale(&mut self, j: usize, r: f32) {
        self.acc[j * self.hd..][..self.hd]
            .iter_mut()
            .for_each(|x| *x *= r);
        self.round(j);
    }
    fn mad(&mut self, j: usize, v: &[half::f16], w: f32) {
        v.convert_to_f32_slice(self.row32);
        for (x, &v) in self.acc[j * self.hd..][..self.hd]
            .iter_mut()
            .zip(self.row32.iter())
        {
            *x = v.mul_add(w, *x);
        }
        self.round(j);
    }
    fn finish(&mut self, j: usize, row: &mut [f32], inv: f32) {
        for (r, x) in row.iter_mut().zip(&self.acc[j * self.hd..][..self.hd]) {
            *r = x * inv;
        }
    }
}

/// The f16 path's register work at one width: AVX2's 8 lanes ([`Avx2`]) or AVX-512's 16
/// (attn_avx512.rs), the same floats.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Lanes {
    /// `acc ← v · w + acc` (MAD) or `acc · w`, each element rounded to f16 when R16, over the
    /// elements of whole registers; returns how many that was (the caller does the rest).
    ///
    /// # Safety
    /// The CPU has the width's features (the caller runs with them enabled); with MAD,
    /// `v.len() >= acc.len()`.
    unsafe fn update<const MAD: bool, const R16: bool>(
        acc: &mut [f32],
        v: &[half::f16],
        w: f32,
    ) -> usize;
    /// Σ a·b over the first `full` elements (a multiple of 64 within both), in
    /// `numerics::f16_dot`'s order: four 16-lane sums over the 64-element steps, then
    /// (s0 + s2) + (s1 + s3) lane by lane, then its halves, quarters and pairs.
    ///
    /// # Safety
    /// As [`Lanes::update`].
    unsafe fn dot64(a: &[f32], b: &[half::f16], full: usize) -> f32;
}

/// AVX2 + F16C: 8 lanes.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    #[inline(always)]
    unsafe fn update<const MAD: bool, const R16: bool>(
        acc: &mut [f32],
        v: &[half::f16],
        w: f32,
    ) -> usize {
        use std::arch::x86_64::*;
        let full = acc.len() / 8 * 8;
        // SAFETY: the features per the contract; loads and stores of 8 elements below `full`
        // <= the lengths of `acc` and (with MAD) `v`.
        unsafe {
            let wv = _mm256_set1_ps(w);
            let pa = acc.as_mut_ptr();
            let mut i = 0;
            while i < full {
                let x = _mm256_loadu_ps(pa.add(i));
                let mut y = if MAD {
                    let h = _mm_loadu_si128(v.as_ptr().add(i) as *const __m128i);
                    _mm256_fmadd_ps(_mm256_cvtph_ps(h), wv, x)
                } else {
                    _mm256_mul_ps(x, wv)
                };
                if R16 {
                    y = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
                }
                _mm256_storeu_ps(pa.add(i), y);
                i += 8;
            }
        }
        full
    }
    #[inline(always)]
    unsafe fn dot64(a: &[f32], b: &[half::f16], full: usize) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: the features per the contract; every load reads 8 elements below `full`.
        unsafe {
            let mut v = [_mm256_setzero_ps(); 8];
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut c = 0;
            while c < full {
                for (k, vk) in v.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(pa.add(c + 8 * k));
                    let y = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(c + 8 * k) as *const __m128i));
                    *vk = _mm256_add_ps(*vk, _mm256_mul_ps(x, y));
                }
                c += 64;
            }
            // The four 16-lane sums are (v0, v1), (v2, v3), (v4, v5), (v6, v7).
            let lo = _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6]));
            let hi = _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7]));
            quarter_sums(_mm256_add_ps(lo, hi))
        }
    }
}

/// The last steps of [`Lanes::dot64`]'s order: t3's halves, quarters and pairs.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn quarter_sums(t3: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: AVX per the contract.
    unsafe {
        let t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps::<1>(t3));
        let u = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
        _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
    }
}

/// The rows read as f16 and widened in registers of width `W`, the rounding in the same pass
/// as the update. Only constructed where the CPU has the width's features, and only run inside
/// [`task_f16`] (its methods are inlined there, with those features enabled).
#[cfg(target_arch = "x86_64")]
pub(crate) struct F16c<'a, W: Lanes> {
    pub(crate) q: &'a [f32],
    pub(crate) acc: &'a mut [f32],
    pub(crate) hd: usize,
    pub(crate) r16: bool,
    pub(crate) lanes: std::marker::PhantomData<W>,
}

#[cfg(target_arch = "x86_64")]
impl<W: Lanes> F16c<'_, W> {
    /// acc_j ← v · w + acc_j (`v` Some) or acc_j · w, each rounded to f16 when `r16`.
    #[inline(always)]
    fn update(&mut self, j: usize, v: Option<&[half::f16]>, w: f32) {
        let acc = &mut self.acc[j * self.hd..][..self.hd];
        // One loop per case: no flag tested per element.
        match (v, self.r16) {
            (Some(v), true) => update_row::<W, true, true>(acc, v, w),
            (Some(v), false) => update_row::<W, true, false>(acc, v, w),
            (None, true) => update_row::<W, false, true>(acc, &[], w),
            (None, false) => update_row::<W, false, false>(acc, &[], w),
        }
    }
}

/// [`Lanes::update`] over whole registers, then the rest one by one (a fused multiply-add and
/// a rounding to nearest each, as in the registers).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn update_row<W: Lanes, const MAD: bool, const R16: bool>(
    acc: &mut [f32],
    v: &[half::f16],
    w: f32,
) {
    let n = acc.len();
    assert!(!MAD || v.len() >= n);
    // SAFETY: the width's features per [`F16c`]'s contract; `v` checked above.
    let full = unsafe { W::update::<MAD, R16>(acc, v, w) };
    for i in full..n {
        let mut y = if MAD {
            v[i].to_f32().mul_add(w, acc[i])
        } else {
            acc[i] * w
        };
        if R16 {
            y = half::f16::from_f32(y).to_f32();
        }
        acc[i] = y;
    }
}

#[cfg(target_arch = "x86_64")]
impl<W: Lanes> Keys for F16c<'_, W> {
    #[inline(always)]
    fn dot(&mut self, j: usize, b: &[half::f16]) -> f32 {
        let a = &self.q[j * self.hd..][..self.hd];
        let n = a.len().min(b.len());
        let full = n / 64 * 64;
        // SAFETY: the width's features per the type's contract; `full` within both slices.
        let reduced = unsafe { W::dot64(a, b, full) };
        let mut sum = reduced as f64;
        for i in full..n {
            sum += (a[i] * b[i].to_f32()) as f64;
        }
        sum as f32
    }
    #[inline(always)]
    fn rescale(&mut self, j: usize, r: f32) {
        self.update(j, None, r);
    }
    #[inline(always)]
    fn mad(&mut self, j: usize, v: &[half::f16], w: f32) {
        self.update(j, Some(v), w);
    }
    #[inline(always)]
    fn finish(&mut self, j: usize, row: &mut [f32], inv: f32) {
        for (r, x) in row.iter_mut().zip(&self.acc[j * self.hd..][..self.hd]) {
            *r = x * inv;
        }
    }
}

thread_local! {
    /// Per thread: the accumulators (and the generic path's widened row) of one task.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch holding at least `n` zeros.
#[inline(always)]
pub(crate) fn with_zeros<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n {
            s.resize(n, 0.0);
        }
        let z = &mut s[..n];
        z.fill(0.0);
        f(z)
    })
}

/// A task: heads `h0..h0 + g` of token `t`; `q` and `rows` are theirs (`g · head_dim` each).
pub(crate) struct Task<'a> {
    pub(crate) t: usize,
    pub(crate) h0: usize,
    pub(crate) g: usize,
    pub(crate) q: &'a [f32],
    pub(crate) rows: &'a mut [f32],
}

/// One task on the generic implementation.
#[allow(clippy::too_many_arguments)]
fn task_generic(
    task: Task<'_>,
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
) {
    let hd = a.head_dim;
    with_zeros(task.g * hd + hd, |z| {
        let (acc, row32) = z.split_at_mut(task.g * hd);
        let mut ks = Generic {
            q: task.q,
            acc,
            row32,
            hd,
            r16,
        };
        softmax_group(
            &mut ks, task.t, task.h0, task.g, k, v, b, a, tiled, task.rows,
        );
    })
}

/// One task on [`F16c`] of width `W` over the zeroed accumulators `acc`, inlined into each
/// width's `target_feature` function (whose closure around it inherits the features; a
/// closure made here would not, and the intrinsics would become calls).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn task_f16<W: Lanes>(
    task: Task<'_>,
    acc: &mut [f32],
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
) {
    let mut ks = F16c::<W> {
        q: task.q,
        acc,
        hd: a.head_dim,
        r16,
        lanes: std::marker::PhantomData,
    };
    softmax_group(
        &mut ks, task.t, task.h0, task.g, k, v, b, a, tiled, task.rows,
    );
}

/// One task on [`F16c`] with AVX2 + FMA + F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn task_avx2(
    task: Task<'_>,
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
) {
    with_zeros(task.g * a.head_dim, |acc| {
        task_f16::<Avx2>(task, acc, k, v, b, a, r16, tiled)
    })
}

/// Whether the AVX2 + FMA + F16C paths of this crate (attention, rope, GLU) may run: the
/// kernels' SIMD level ([`SimdLevel::active`], which reads `QUIVER_CPU_SIMD`) is AVX2 or more
/// (that level implies all three features).
pub(crate) fn has_avx2() -> bool {
    cfg!(target_arch = "x86_64") && SimdLevel::active() >= SimdLevel::Avx2
}

/// Heads per task: a whole KV group (cut to at most [`MAX_GROUP`]) when the step has enough
/// (token, KV head) pairs to keep `threads` busy, so each K/V row is read once for the group;
/// else one head per task. The floats are the same either way (per head, the same operations).
pub(crate) fn heads_per_task(a: &AttnParams, n_tokens: usize, threads: usize) -> usize {
    let group = a.n_head / a.n_head_kv.max(1);
    if n_tokens * a.n_head_kv < 4 * threads {
        return 1;
    }
    (1..=group.min(MAX_GROUP))
        .rev()
        .find(|g| group.is_multiple_of(*g))
        .unwrap_or(1)
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    numerics: Numerics,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
) {
    let tiled = tiled(batch.n_tokens(), numerics);
    if tiled {
        crate::attn_tiled::attention(pool, q, k_cache, v_cache, batch, a, out);
        return;
    }
    let g = heads_per_task(a, batch.n_tokens(), pool.n_threads());
    run(pool, q, k_cache, v_cache, batch, a, out, g, true, false);
}

/// Query tokens one task of [`attention_packed`] takes (each key decoded once for them all).
const PACKED_TOKENS: usize = 16;

/// Attention over a cache of any other element types (`quiver_backend::kvcodec`): the scalar
/// [`kvcodec::attend`](quiver_backend::kvcodec::attend) per (run of up to 16 consecutive
/// tokens of one sequence, part of a KV group), spread over the pool; each key's records are
/// decoded once per task, never the whole cache. Batch invariant (`attend` is).
#[allow(clippy::too_many_arguments)]
pub fn attention_packed(
    pool: &ThreadPool,
    q: &[f32],
    k: quiver_backend::kvcodec::KvRows,
    v: quiver_backend::kvcodec::KvRows,
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
) {
    thread_local! {
        /// The caller's runs of tokens (kept, so that a step allocates nothing once warm).
        static RUNS: std::cell::RefCell<Vec<std::ops::Range<usize>>> = Default::default();
    }
    let (hd, nh) = (a.head_dim, a.n_head);
    let g = heads_per_task(a, batch.n_tokens(), pool.n_threads());
    assert!(out.len() >= batch.n_tokens() * nh * hd && q.len() >= out.len());
    RUNS.with_borrow_mut(|runs| {
        // Runs of consecutive tokens of one sequence.
        runs.clear();
        runs.extend(batch.seqs.iter().flat_map(|s| {
            (s.start..s.start + s.len)
                .step_by(PACKED_TOKENS)
                .map(move |t| t..(t + PACKED_TOKENS).min(s.start + s.len))
        }));
        run_packed(pool, q, k, v, batch, a, out, g, runs);
    });
}

/// [`attention_packed`]'s tasks: one per (run, part of a KV group).
#[allow(clippy::too_many_arguments)]
fn run_packed(
    pool: &ThreadPool,
    q: &[f32],
    k: quiver_backend::kvcodec::KvRows,
    v: quiver_backend::kvcodec::KvRows,
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
    g: usize,
    runs: &[std::ops::Range<usize>],
) {
    use quiver_backend::kvcodec::{attend, AttendScratch};
    thread_local! {
        static SCRATCH: std::cell::RefCell<AttendScratch> = Default::default();
    }
    let (hd, nh) = (a.head_dim, a.n_head);
    let o = &Out(out.as_mut_ptr());
    let task = |i: usize| {
        let (run, h0) = (runs[i / (nh / g)].clone(), (i % (nh / g)) * g);
        SCRATCH.with_borrow_mut(|sc| {
            attend(q, k, v, batch, a, run.clone(), h0, g, sc);
            for (i, t) in run.enumerate() {
                // SAFETY: the rows of heads h0..h0 + g of token t are written by this task
                // only (each (token, head) belongs to one run and one group part), inside
                // `out` (checked by `attention_packed`).
                let rows =
                    unsafe { std::slice::from_raw_parts_mut(o.0.add((t * nh + h0) * hd), g * hd) };
                for (j, r) in rows.chunks_exact_mut(hd).enumerate() {
                    r.copy_from_slice(sc.row(i, j, g, hd));
                }
            }
        });
    };
    pool.run(runs.len() * (nh / g), &task);
}

/// [`attention`] with `g` heads per task (`g` divides the KV group size, at most
/// [`MAX_GROUP`]), the accumulator rounded to f16 when `r16`, the weights of `tiled` steps.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
    g: usize,
    r16: bool,
    tiled: bool,
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    assert!((1..=MAX_GROUP).contains(&g) && (nh / a.n_head_kv).is_multiple_of(g));
    let n_tasks = batch.n_tokens() * nh / g;
    assert!(hd <= MAX_HEAD_DIM && out.len() >= n_tasks * g * hd && q.len() >= out.len());
    let o = &Out(out.as_mut_ptr());
    let level = SimdLevel::active();
    let task = |i: usize| {
        let (t, h0) = (i / (nh / g), (i % (nh / g)) * g);
        let at = (t * nh + h0) * hd;
        // SAFETY: the rows of heads h0..h0 + g of token t are written by this task only (see
        // `Out`), and lie inside `out` (checked by the assert above).
        let rows = unsafe { std::slice::from_raw_parts_mut(o.0.add(at), g * hd) };
        let task = Task {
            t,
            h0,
            g,
            q: &q[at..at + g * hd],
            rows,
        };
        #[cfg(target_arch = "x86_64")]
        match level {
            // SAFETY: the AVX-512 level implies AVX-512F, AVX2, FMA and F16C.
            SimdLevel::Avx512 => unsafe {
                crate::attn_avx512::task(task, k_cache, v_cache, batch, a, r16, tiled)
            },
            // SAFETY: the AVX2 level implies AVX2, FMA and F16C (`has_avx2`).
            SimdLevel::Avx2 => unsafe { task_avx2(task, k_cache, v_cache, batch, a, r16, tiled) },
            SimdLevel::Portable => task_generic(task, k_cache, v_cache, batch, a, r16, tiled),
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = level;
            task_generic(task, k_cache, v_cache, batch, a, r16, tiled);
        }
    };
    pool.run(n_tasks, &task);
}

/// Random attention inputs of the tests here and in `attn_tiled.rs`.
#[cfg(test)]
pub(crate) mod test_inputs {
    use quiver_backend::{AttnParams, Batch};

    /// Uniform values in [−2, 2) from a fixed xorshift seed.
    pub fn rng() -> impl FnMut() -> f32 {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        }
    }

    pub struct Case {
        pub a: AttnParams,
        pub batch: Batch,
        pub k: Vec<half::f16>,
        pub v: Vec<half::f16>,
        pub q: Vec<f32>,
    }

    /// 8 query heads over 2 KV heads of `hd`; `n` tokens of one sequence from position
    /// `start`, its blocks of 16 `blocks`; a cache of `slots` rows; q three times the range,
    /// rounded to f16 values where `q16`.
    #[allow(clippy::too_many_arguments)]
    pub fn case(
        rnd: &mut impl FnMut() -> f32,
        hd: usize,
        window: Option<u32>,
        softcap: Option<f32>,
        n: usize,
        start: usize,
        blocks: &[u32],
        slots: usize,
        q16: bool,
    ) -> Case {
        let (nh, nkv) = (8usize, 2usize);
        let a = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            scale_q: false,
            window,
            softcap,
        };
        let batch = Batch::single(&vec![1; n], start, blocks, 16, vec![]);
        let mut f16s =
            |m: usize| -> Vec<half::f16> { (0..m).map(|_| half::f16::from_f32(rnd())).collect() };
        let (k, v) = (f16s(slots * nkv * hd), f16s(slots * nkv * hd));
        let q = (0..n * nh * hd)
            .map(|_| {
                let x = rnd() * 3.0;
                if q16 {
                    half::f16::from_f32(x).to_f32()
                } else {
                    x
                }
            })
            .collect();
        Case { a, batch, k, v, q }
    }
}

#[cfg(test)]
mod tests {
    use super::test_inputs::{case, rng, Case};
    use super::*;

    /// Every implementation and task shape computes the same floats, bit for bit: the AVX2 path
    /// (rows read as f16 in registers, fused updates) against the generic loops, one head per
    /// task against whole KV groups, with head dims with and without a tail past 64, the f16
    /// and the f32 accumulator, the tiled step's weights, a window and soft-capping.
    #[test]
    fn every_path_and_grouping_gives_the_same_bits() {
        let pool = ThreadPool::new(2).unwrap();
        let mut rnd = rng();
        for (hd, window, softcap) in [
            (64, None, None),
            (128, Some(7), None),
            (256, None, Some(30.0)),
            (80, None, None),
        ] {
            let n = 19;
            let Case { a, batch, k, v, q } =
                case(&mut rnd, hd, window, softcap, n, 0, &[2, 0], 48, true);
            let nh = a.n_head;
            for (r16, tiled) in [(true, false), (false, false), (false, true)] {
                // The reference: generic loops, one head per task.
                let mut want = vec![0f32; n * nh * hd];
                for i in 0..n * nh {
                    let (t, h) = (i / nh, i % nh);
                    let task = Task {
                        t,
                        h0: h,
                        g: 1,
                        q: &q[i * hd..][..hd],
                        rows: &mut want[i * hd..][..hd],
                    };
                    task_generic(task, &k, &v, &batch, &a, r16, tiled);
                }
                for g in [1, 2, 4] {
                    let mut got = vec![0f32; n * nh * hd];
                    run(&pool, &q, &k, &v, &batch, &a, &mut got, g, r16, tiled);
                    for (e, (x, y)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "hd {hd}, {g} heads per task, element {e}, r16 {r16}, tiled {tiled}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

impl crate::CpuBackend {
    /// q after rope: the cache holds f16 (as llama.cpp's default cache does); q meets it in
    /// f16 (in f32 for llama.cpp's tiled attention, see `attn::tiled`), scaled first where the
    /// model says so (`scale_q`; attention then multiplies by 1).
    pub(crate) fn finish_q(&self, n: usize, q: &mut [f32], a: &quiver_backend::AttnParams) {
        let s = if a.scale_q { a.scale } else { 1.0 };
        let f16_q = !tiled(n, self.numerics());
        q[..n * a.n_head * a.head_dim].iter_mut().for_each(|v| {
            *v *= s;
            if f16_q {
                *v = half::f16::from_f32(*v).to_f32();
            }
        });
    }
}
