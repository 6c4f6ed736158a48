//! CPU attention: online softmax per (token, head) over the sequence's cached K/V (values
//! held f16-rounded, as llama.cpp's default f16 cache holds them), no scratch allocation;
//! (token, head) pairs are spread over the thread pool.
//!
//! Each (token, head) runs as llama.cpp's one-row CPU flash attention does, operation for
//! operation (quiver reproduces its floats, docs/ARCHITECTURE.md): q·k in the f16 dot's
//! AVX-512 order, the running sum and the p·v update as fused multiply-adds, and the p·v
//! accumulator rounded to f16 after every key as llama.cpp keeps it with an f16 cache.
//! Single-sequence steps of 64+ rows keep q and the accumulator in f32 and take the weights
//! from ggml's vectorised e^x instead, as llama.cpp's tiled attention for such batches does
//! (not its tiling: close, not exact);
//! `QUIVER_CPU_ATTN_F32=1` keeps the accumulator in f32 everywhere.

use half::slice::HalfFloatSliceExt;

use quiver_backend::{AttnParams, Batch};
use quiver_cpu_kernels::ThreadPool;

/// Largest head dimension the stack accumulator holds.
pub const MAX_HEAD_DIM: usize = 512;

/// Raw output pointer shared by the tasks; each task writes only its own (token, head) row.
struct Out(*mut f32);
// SAFETY: tasks write disjoint ranges `[(t·nh + h)·hd, +hd)` (one task per (t, h)), and the
// slice is not read until `pool.run` returns.
unsafe impl Sync for Out {}

/// q·k in the order of ggml's f16 dot product on AVX-512 (`ggml_vec_dot_f16`), which llama.cpp's
/// CPU attention uses: per 64 elements, four 16-lane partial sums; then sums 0+2 and 1+3, their
/// sum, and the 16 lanes reduced as `_mm512_reduce_add_ps` does (halves, quarters, then pairs);
/// a tail past the last 64 is added in f64. In the row-by-row form both inputs hold f16
/// values, so each product is exact in f32 and only the order of the additions matters (an FMA
/// would round alike).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [[0f32; 16]; 4];
    let (ca, cb) = (a.chunks_exact(64), b.chunks_exact(64));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for (j, sj) in s.iter_mut().enumerate() {
            for (l, v) in sj.iter_mut().enumerate() {
                *v += x[16 * j + l] * y[16 * j + l];
            }
        }
    }
    let mut sum = dot_reduce(&s) as f64;
    for (x, y) in ra.iter().zip(rb) {
        sum += (x * y) as f64;
    }
    sum as f32
}

/// The reduction of [`dot`]'s four 16-lane partial sums: 0+2 and 1+3, their sum, then the 16
/// lanes as `_mm512_reduce_add_ps` reduces them.
#[inline(always)]
fn dot_reduce(s: &[[f32; 16]; 4]) -> f32 {
    let mut x0 = [0f32; 16];
    for l in 0..16 {
        x0[l] = (s[0][l] + s[2][l]) + (s[1][l] + s[3][l]);
    }
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = x0[i] + x0[8 + i];
    }
    let t6 = [t3[0] + t3[4], t3[1] + t3[5], t3[2] + t3[6], t3[3] + t3[7]];
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// Whether a single-sequence step of `n` query rows takes llama.cpp's tiled attention (64+
/// rows), which keeps q and the p·v accumulator in f32; below that it works row by row with q
/// in f16 and an f16 accumulator, which quiver reproduces exactly. Batch-invariant runs (the
/// server) always take the row-by-row form.
pub fn tiled(n: usize) -> bool {
    n >= 64 && !quiver_cpu_kernels::batch_invariant()
}

/// Whether the accumulator is rounded to f16 (the default) or kept in f32.
pub fn f16_accumulator() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| std::env::var("QUIVER_CPU_ATTN_F32").map_or(true, |v| v != "1"))
}

/// Rounds every element of `x` to f16 (vectorised conversions).
#[inline]
fn round_f16(x: &mut [f32], tmp: &mut [half::f16]) {
    let tmp = &mut tmp[..x.len()];
    tmp.convert_from_f32_slice(x);
    tmp.convert_to_f32_slice(x);
}

/// The per-key operations of one (token, head) task; [`softmax_keys`] runs the online softmax
/// over them once for every implementation. Each computes the same floats: the dot products in
/// [`dot`]'s order (products rounded, then added), the updates as fused multiply-adds, the
/// accumulator rounded to f16 after each update when `r16`.
trait Keys {
    /// q·k with one K row.
    fn dot(&mut self, k: &[half::f16]) -> f32;
    /// acc ← acc · r.
    fn rescale(&mut self, r: f32);
    /// acc ← v · w + acc.
    fn mad(&mut self, v: &[half::f16], w: f32);
    /// row ← acc · inv.
    fn finish(&mut self, row: &mut [f32], inv: f32);
}

/// The online softmax of task `i` (token `i / n_head`, head `i % n_head`) over its visible
/// keys, in ggml's order of operations (llama.cpp parity): the scale divided by the soft-cap
/// first, the running sum and the p·v update fused multiply-adds; steps of 64+ rows
/// (`tiled`) take the weights from ggml's vectorised e^x, as llama.cpp's tiled attention does.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax_keys<K: Keys>(
    ks: &mut K,
    i: usize,
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    tiled: bool,
    row: &mut [f32],
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let kv_dim = a.n_head_kv * hd;
    let (t, h) = (i / nh, i % nh);
    let s = batch.seq_of[t] as usize;
    let pos = batch.positions[t] as usize;
    let first = a.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
    let koff = (h / (nh / a.n_head_kv)) * hd;
    let scale = if a.scale_q { 1.0 } else { a.scale };
    let scale = a.softcap.map_or(scale, |c| scale / c);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    for p in first..=pos {
        let slot = batch.slot(s, p);
        let mut sc = ks.dot(&k_cache[slot * kv_dim + koff..][..hd]) * scale;
        if let Some(c) = a.softcap {
            sc = c * sc.tanh();
        }
        let w = if sc > m {
            let r = (m - sc).exp();
            m = sc;
            sum = sum.mul_add(r, 1.0);
            ks.rescale(r);
            1.0
        } else {
            let w = if tiled {
                crate::act_fn::ggml_expf(sc - m)
            } else {
                (sc - m).exp()
            };
            sum += w;
            w
        };
        ks.mad(&v_cache[slot * kv_dim + koff..][..hd], w);
    }
    ks.finish(row, 1.0 / sum);
}

/// Plain Rust: rows widened into a buffer, then [`dot`] and the element loops.
struct Generic<'a> {
    q: &'a [f32],
    r16: bool,
    acc: [f32; MAX_HEAD_DIM],
    row32: [f32; MAX_HEAD_DIM],
    tmp: [half::f16; MAX_HEAD_DIM],
}

impl Generic<'_> {
    fn round(&mut self) {
        if self.r16 {
            let hd = self.q.len();
            round_f16(&mut self.acc[..hd], &mut self.tmp);
        }
    }
}

impl Keys for Generic<'_> {
    fn dot(&mut self, k: &[half::f16]) -> f32 {
        let hd = self.q.len();
        k.convert_to_f32_slice(&mut self.row32[..hd]);
        dot(self.q, &self.row32[..hd])
    }
    fn rescale(&mut self, r: f32) {
        let hd = self.q.len();
        self.acc[..hd].iter_mut().for_each(|x| *x *= r);
        self.round();
    }
    fn mad(&mut self, v: &[half::f16], w: f32) {
        let hd = self.q.len();
        v.convert_to_f32_slice(&mut self.row32[..hd]);
        for (x, &v) in self.acc[..hd].iter_mut().zip(self.row32.iter()) {
            *x = v.mul_add(w, *x);
        }
        self.round();
    }
    fn finish(&mut self, row: &mut [f32], inv: f32) {
        for (r, x) in row.iter_mut().zip(self.acc.iter()) {
            *r = x * inv;
        }
    }
}

/// AVX2 + F16C: the rows read as f16 and widened 8 at a time in registers, the rounding in the
/// same pass as the update. Only constructed where the CPU has AVX2, FMA and F16C, and only
/// run inside [`task_avx2`] (its methods are inlined there, with those features enabled).
#[cfg(target_arch = "x86_64")]
struct F16c<'a> {
    q: &'a [f32],
    r16: bool,
    acc: [f32; MAX_HEAD_DIM],
}

#[cfg(target_arch = "x86_64")]
impl F16c<'_> {
    /// acc ← v · w + acc (`v` Some) or acc · w, each rounded to f16 when `r16`.
    #[inline(always)]
    fn update(&mut self, v: Option<&[half::f16]>, w: f32) {
        use std::arch::x86_64::*;
        let n = self.q.len();
        let full = n / 8 * 8;
        // SAFETY: AVX, FMA and F16C per the type's contract; loads and stores of 8 elements
        // below `full` <= the lengths of `acc` and `v` (a row of `n`).
        unsafe {
            let wv = _mm256_set1_ps(w);
            let pa = self.acc.as_mut_ptr();
            let mut i = 0;
            while i < full {
                let x = _mm256_loadu_ps(pa.add(i));
                let mut y = match v {
                    Some(v) => _mm256_fmadd_ps(
                        _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i)),
                        wv,
                        x,
                    ),
                    None => _mm256_mul_ps(x, wv),
                };
                if self.r16 {
                    y = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
                }
                _mm256_storeu_ps(pa.add(i), y);
                i += 8;
            }
        }
        for j in full..n {
            let mut y = match v {
                Some(v) => v[j].to_f32().mul_add(w, self.acc[j]),
                None => self.acc[j] * w,
            };
            if self.r16 {
                y = half::f16::from_f32(y).to_f32();
            }
            self.acc[j] = y;
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Keys for F16c<'_> {
    #[inline(always)]
    fn dot(&mut self, b: &[half::f16]) -> f32 {
        use std::arch::x86_64::*;
        let a = self.q;
        let n = a.len().min(b.len());
        let full = n / 64 * 64;
        let mut s = [[0f32; 16]; 4];
        // SAFETY: AVX and F16C per the type's contract; every load reads 8 elements below
        // `full` <= the length of both slices.
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
            for (j, sj) in s.iter_mut().enumerate() {
                _mm256_storeu_ps(sj.as_mut_ptr(), v[2 * j]);
                _mm256_storeu_ps(sj.as_mut_ptr().add(8), v[2 * j + 1]);
            }
        }
        let mut sum = dot_reduce(&s) as f64;
        for i in full..n {
            sum += (a[i] * b[i].to_f32()) as f64;
        }
        sum as f32
    }
    #[inline(always)]
    fn rescale(&mut self, r: f32) {
        self.update(None, r);
    }
    #[inline(always)]
    fn mad(&mut self, v: &[half::f16], w: f32) {
        self.update(Some(v), w);
    }
    #[inline(always)]
    fn finish(&mut self, row: &mut [f32], inv: f32) {
        for (r, x) in row.iter_mut().zip(self.acc.iter()) {
            *r = x * inv;
        }
    }
}

/// AVX-512 for head dims of `16 NV` (64, 128, 256): q and the accumulator live in `NV`
/// 16-lane registers for the whole task; a 64-element chunk of the dot is one register per
/// partial sum, as ggml's AVX-512 f16 dot keeps them. Only constructed where the CPU has
/// AVX-512 F and F16C (+ AVX2, FMA), and only run inside [`task_avx512`].
#[cfg(target_arch = "x86_64")]
struct Zmm<const NV: usize> {
    q: [std::arch::x86_64::__m512; NV],
    acc: [std::arch::x86_64::__m512; NV],
    r16: bool,
}

#[cfg(target_arch = "x86_64")]
impl<const NV: usize> Zmm<NV> {
    #[inline(always)]
    fn round(&mut self, x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        if !self.r16 {
            return x;
        }
        // SAFETY: AVX-512 F per the type's contract.
        unsafe { _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)) }
    }
}

#[cfg(target_arch = "x86_64")]
impl<const NV: usize> Keys for Zmm<NV> {
    #[inline(always)]
    fn dot(&mut self, k: &[half::f16]) -> f32 {
        use std::arch::x86_64::*;
        assert!(k.len() >= 16 * NV && NV % 4 == 0);
        let mut s = [[0f32; 16]; 4];
        // SAFETY: AVX-512 F per the type's contract; 16 NV elements of `k` are read.
        unsafe {
            let mut v = [_mm512_setzero_ps(); 4];
            for c in 0..NV / 4 {
                for (j, vj) in v.iter_mut().enumerate() {
                    let y = _mm512_cvtph_ps(_mm256_loadu_si256(
                        k.as_ptr().add(64 * c + 16 * j) as *const __m256i
                    ));
                    *vj = _mm512_add_ps(*vj, _mm512_mul_ps(self.q[4 * c + j], y));
                }
            }
            for (sj, vj) in s.iter_mut().zip(v) {
                _mm512_storeu_ps(sj.as_mut_ptr(), vj);
            }
        }
        dot_reduce(&s)
    }
    #[inline(always)]
    fn rescale(&mut self, r: f32) {
        use std::arch::x86_64::*;
        for i in 0..NV {
            // SAFETY: AVX-512 F per the type's contract.
            let x = unsafe { _mm512_mul_ps(self.acc[i], _mm512_set1_ps(r)) };
            self.acc[i] = self.round(x);
        }
    }
    #[inline(always)]
    fn mad(&mut self, v: &[half::f16], w: f32) {
        use std::arch::x86_64::*;
        assert!(v.len() >= 16 * NV);
        for i in 0..NV {
            // SAFETY: AVX-512 F per the type's contract; 16 elements of `v` at 16 i.
            let x = unsafe {
                _mm512_fmadd_ps(
                    _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(16 * i) as *const __m256i)),
                    _mm512_set1_ps(w),
                    self.acc[i],
                )
            };
            self.acc[i] = self.round(x);
        }
    }
    #[inline(always)]
    fn finish(&mut self, row: &mut [f32], inv: f32) {
        use std::arch::x86_64::*;
        assert!(row.len() >= 16 * NV);
        for i in 0..NV {
            // SAFETY: AVX-512 F per the type's contract; 16 elements of `row` at 16 i.
            unsafe {
                _mm512_storeu_ps(
                    row.as_mut_ptr().add(16 * i),
                    _mm512_mul_ps(self.acc[i], _mm512_set1_ps(inv)),
                )
            };
        }
    }
}

/// One task on the generic implementation.
#[allow(clippy::too_many_arguments)]
fn task_generic(
    i: usize,
    q: &[f32],
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
    row: &mut [f32],
) {
    let hd = a.head_dim;
    let mut ks = Generic {
        q: &q[i * hd..][..hd],
        r16,
        acc: [0f32; MAX_HEAD_DIM],
        row32: [0f32; MAX_HEAD_DIM],
        tmp: [half::f16::ZERO; MAX_HEAD_DIM],
    };
    softmax_keys(&mut ks, i, k, v, b, a, tiled, row);
}

/// One task on [`F16c`], compiled for AVX2 + FMA + F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn task_avx2(
    i: usize,
    q: &[f32],
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
    row: &mut [f32],
) {
    let hd = a.head_dim;
    let mut ks = F16c {
        q: &q[i * hd..][..hd],
        r16,
        acc: [0f32; MAX_HEAD_DIM],
    };
    softmax_keys(&mut ks, i, k, v, b, a, tiled, row);
}

/// One task on [`Zmm`], compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2, FMA and F16C; `a.head_dim == 16 NV`, NV a multiple
/// of 4.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn task_avx512<const NV: usize>(
    i: usize,
    q: &[f32],
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
    row: &mut [f32],
) {
    use std::arch::x86_64::*;
    let qh = &q[i * 16 * NV..][..16 * NV];
    let mut ks = Zmm::<NV> {
        // SAFETY: AVX-512 F per this function's contract; 16 elements of `qh` at 16 j.
        q: std::array::from_fn(|j| unsafe { _mm512_loadu_ps(qh.as_ptr().add(16 * j)) }),
        acc: [_mm512_setzero_ps(); NV],
        r16,
    };
    softmax_keys(&mut ks, i, k, v, b, a, tiled, row);
}

pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *F.get_or_init(|| {
            let allowed = std::env::var("QUIVER_CPU_SIMD").map_or(true, |v| v != "portable");
            allowed
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the AVX-512 tasks may run: the CPU kernels' AVX-512 level is active (it implies
/// AVX-512 F and the AVX2 level's features).
fn has_avx512() -> bool {
    quiver_cpu_kernels::SimdLevel::active() == quiver_cpu_kernels::SimdLevel::Avx512
}

pub fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let n_tasks = batch.n_tokens() * nh;
    assert!(hd <= MAX_HEAD_DIM && out.len() >= n_tasks * hd);
    let o = &Out(out.as_mut_ptr());
    let tiled = tiled(batch.n_tokens());
    let r16 = f16_accumulator() && !tiled;
    let avx2 = has_avx2();
    let zmm = has_avx512() && avx2 && matches!(hd, 64 | 128 | 256);
    let task = |i: usize| {
        // SAFETY: row i is written by this task only (see `Out`), and lies inside `out`
        // (checked by the assert above).
        let row = unsafe { std::slice::from_raw_parts_mut(o.0.add(i * hd), hd) };
        #[cfg(target_arch = "x86_64")]
        if zmm {
            // SAFETY: `zmm` is true only on the AVX-512 level (with AVX2, FMA and F16C) and
            // for head dims 16·NV.
            unsafe {
                match hd {
                    64 => task_avx512::<4>(i, q, k_cache, v_cache, batch, a, r16, tiled, row),
                    128 => task_avx512::<8>(i, q, k_cache, v_cache, batch, a, r16, tiled, row),
                    _ => task_avx512::<16>(i, q, k_cache, v_cache, batch, a, r16, tiled, row),
                }
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `avx2` is true only when AVX2, FMA and F16C were detected.
            unsafe { task_avx2(i, q, k_cache, v_cache, batch, a, r16, tiled, row) };
            return;
        }
        task_generic(i, q, k_cache, v_cache, batch, a, r16, tiled, row);
    };
    pool.run(n_tasks, &task);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 and AVX-512 paths (rows read as f16 in registers, fused updates; q and the
    /// accumulator in registers on AVX-512) compute the generic loops' floats bit for bit: head
    /// dims with and without a tail past 64, the f16 and the f32 accumulator, the tiled step's
    /// weights, a window and soft-capping.
    #[test]
    fn the_simd_paths_equal_the_generic_loops_bit_for_bit() {
        if !has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C");
            return;
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        let mut checked_512 = 0;
        for (hd, window, softcap) in [
            (64, None, None),
            (128, Some(7), None),
            (256, None, Some(30.0)),
            (80, None, None),
        ] {
            let (nh, nkv, n) = (4usize, 2usize, 19usize);
            let a = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                scale_q: false,
                window,
                softcap,
            };
            let batch = Batch::single(&vec![1; n], 0, &[2, 0], 16, vec![]);
            let kv_dim = nkv * hd;
            let slots = 48;
            let k: Vec<half::f16> = (0..slots * kv_dim)
                .map(|_| half::f16::from_f32(rnd()))
                .collect();
            let v: Vec<half::f16> = (0..slots * kv_dim)
                .map(|_| half::f16::from_f32(rnd()))
                .collect();
            let q: Vec<f32> = (0..n * nh * hd)
                .map(|_| half::f16::from_f32(rnd() * 3.0).to_f32())
                .collect();
            for (r16, tiled) in [(true, false), (false, false), (false, true)] {
                for i in 0..n * nh {
                    let (mut want, mut got) = (vec![0f32; hd], vec![0f32; hd]);
                    task_generic(i, &q, &k, &v, &batch, &a, r16, tiled, &mut want);
                    // SAFETY: has_avx2 checked AVX2, FMA and F16C.
                    unsafe { task_avx2(i, &q, &k, &v, &batch, &a, r16, tiled, &mut got) };
                    let mut paths = vec![("avx2", got)];
                    if has_avx512() && hd % 64 == 0 {
                        let mut g = vec![0f32; hd];
                        // SAFETY: the AVX-512 level is active; hd is 16 NV.
                        unsafe {
                            match hd {
                                64 => {
                                    task_avx512::<4>(i, &q, &k, &v, &batch, &a, r16, tiled, &mut g)
                                }
                                128 => {
                                    task_avx512::<8>(i, &q, &k, &v, &batch, &a, r16, tiled, &mut g)
                                }
                                _ => {
                                    task_avx512::<16>(i, &q, &k, &v, &batch, &a, r16, tiled, &mut g)
                                }
                            }
                        }
                        paths.push(("avx512", g));
                        checked_512 += 1;
                    }
                    for (name, got) in paths {
                        for (d, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{name}: hd {hd}, task {i}, dim {d}, r16 {r16}, tiled {tiled}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        if !has_avx512() {
            eprintln!("AVX-512 path SKIPPED: the AVX-512 level is not active");
        } else {
            assert!(checked_512 > 0);
        }
    }
}
