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

/// [`dot`] with `b` read as f16 and widened 8 at a time in registers: the same products and
/// additions in the same order (no widened copy of the row).
///
/// # Safety
/// The CPU must support AVX, F16C (the caller runs with them enabled).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_f16c(a: &[f32], b: &[half::f16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let full = n / 64 * 64;
    // SAFETY: every load reads 8 elements below `full` <= the length of both slices.
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
        let mut s = [[0f32; 16]; 4];
        for (j, sj) in s.iter_mut().enumerate() {
            _mm256_storeu_ps(sj.as_mut_ptr(), v[2 * j]);
            _mm256_storeu_ps(sj.as_mut_ptr().add(8), v[2 * j + 1]);
        }
        let mut sum = dot_reduce(&s) as f64;
        for i in full..n {
            sum += (a[i] * b[i].to_f32()) as f64;
        }
        sum as f32
    }
}

/// `acc = acc · r` (`v` None) or `acc = v · w + acc` fused (`v` an f16 row, `w` the weight),
/// each element then rounded to f16 when `r16`: the operations of `task_body`'s generic loops,
/// 8 at a time with the row widened in registers.
///
/// # Safety
/// The CPU must support AVX, FMA and F16C (the caller runs with them enabled).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn update_f16c(acc: &mut [f32], v: Option<&[half::f16]>, w: f32, r16: bool) {
    use std::arch::x86_64::*;
    let n = acc.len();
    let full = n / 8 * 8;
    // SAFETY: loads and stores of 8 elements below `full` <= the lengths of `acc` and `v`.
    unsafe {
        let wv = _mm256_set1_ps(w);
        let pa = acc.as_mut_ptr();
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
            if r16 {
                y = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
            }
            _mm256_storeu_ps(pa.add(i), y);
            i += 8;
        }
        for j in full..n {
            let mut y = match v {
                Some(v) => v[j].to_f32().mul_add(w, acc[j]),
                None => acc[j] * w,
            };
            if r16 {
                y = half::f16::from_f32(y).to_f32();
            }
            acc[j] = y;
        }
    }
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

/// One (token, head) task: online softmax over the visible keys, written to `row`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn task_body(
    i: usize,
    q: &[f32],
    k_cache: &[half::f16],
    v_cache: &[half::f16],
    batch: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
    f16c: bool,
    row: &mut [f32],
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let kv_dim = a.n_head_kv * hd;
    let group = nh / a.n_head_kv;
    let (t, h) = (i / nh, i % nh);
    let s = batch.seq_of[t] as usize;
    let pos = batch.positions[t] as usize;
    let first = a.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
    let qh = &q[i * hd..][..hd];
    let koff = (h / group) * hd;
    let mut acc = [0f32; MAX_HEAD_DIM];
    let acc = &mut acc[..hd];
    let mut tmp = [half::f16::ZERO; MAX_HEAD_DIM];
    // One K or V row widened to f32.
    let mut row32 = [0f32; MAX_HEAD_DIM];
    let row32 = &mut row32[..hd];
    let widen = |src: &[half::f16], dst: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if f16c {
            // SAFETY: `f16c` is true only when the CPU has F16C and AVX (checked at dispatch).
            unsafe { widen_f16c(src, dst) };
            return;
        }
        src.convert_to_f32_slice(dst);
    };
    let mut round = |acc: &mut [f32]| {
        if !r16 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if f16c {
            // SAFETY: `f16c` is true only when the CPU has F16C and AVX (checked at dispatch).
            unsafe { round_f16_f16c(acc) };
            return;
        }
        round_f16(acc, &mut tmp);
    };
    // ggml's order of operations (llama.cpp parity): the scale divided by the soft-cap first,
    // the running sum and the p·v update fused multiply-adds.
    let scale = if a.scale_q { 1.0 } else { a.scale };
    let scale = a.softcap.map_or(scale, |c| scale / c);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    #[cfg(target_arch = "x86_64")]
    if f16c {
        // The same operations as the loop below, on rows read as f16 (no widened copies).
        for p in first..=pos {
            let slot = batch.slot(s, p);
            let krow = &k_cache[slot * kv_dim + koff..][..hd];
            // SAFETY: `f16c` is true only when the CPU has AVX2, FMA and F16C (checked at
            // dispatch), and this body then runs inside `task_avx2`.
            let mut sc = unsafe { dot_f16c(qh, krow) } * scale;
            if let Some(c) = a.softcap {
                sc = c * sc.tanh();
            }
            let w = if sc > m {
                let r = (m - sc).exp();
                m = sc;
                sum = sum.mul_add(r, 1.0);
                // SAFETY: as above.
                unsafe { update_f16c(acc, None, r, r16) };
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
            let vrow = &v_cache[slot * kv_dim + koff..][..hd];
            // SAFETY: as above.
            unsafe { update_f16c(acc, Some(vrow), w, r16) };
        }
        let inv = 1.0 / sum;
        for (r, x) in row.iter_mut().zip(acc.iter()) {
            *r = x * inv;
        }
        return;
    }
    for p in first..=pos {
        let slot = batch.slot(s, p);
        widen(&k_cache[slot * kv_dim + koff..][..hd], row32);
        let mut sc = dot(qh, row32) * scale;
        if let Some(c) = a.softcap {
            sc = c * sc.tanh();
        }
        let w = if sc > m {
            let r = (m - sc).exp();
            m = sc;
            sum = sum.mul_add(r, 1.0);
            acc.iter_mut().for_each(|x| *x *= r);
            round(acc);
            1.0
        } else {
            // llama.cpp's tiled attention takes a tile's weights from its vectorised e^x.
            let w = if tiled {
                crate::act_fn::ggml_expf(sc - m)
            } else {
                (sc - m).exp()
            };
            sum += w;
            w
        };
        widen(&v_cache[slot * kv_dim + koff..][..hd], row32);
        for (x, &v) in acc.iter_mut().zip(row32.iter()) {
            *x = v.mul_add(w, *x);
        }
        round(acc);
    }
    let inv = 1.0 / sum;
    for (r, x) in row.iter_mut().zip(acc.iter()) {
        *r = x * inv;
    }
}

/// f32 → f16 → f32 of every element, 8 at a time with F16C (round to nearest even, as the
/// scalar conversion does).
///
/// # Safety
/// The CPU must support AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn round_f16_f16c(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 f32; unaligned loads and stores.
        unsafe {
            let v = _mm256_loadu_ps(c.as_ptr());
            let hv = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(hv));
        }
    }
    for v in chunks.into_remainder() {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// f16 → f32, 8 at a time with F16C.
///
/// # Safety
/// The CPU must support AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 elements from i lie inside both slices; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for j in i..n {
        dst[j] = src[j].to_f32();
    }
}

/// `task_body` compiled for AVX2 + FMA, so that its loops vectorise 8 wide.
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
    task_body(i, q, k, v, b, a, r16, tiled, true, row)
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
    let task = |i: usize| {
        // SAFETY: row i is written by this task only (see `Out`), and lies inside `out`
        // (checked by the assert above).
        let row = unsafe { std::slice::from_raw_parts_mut(o.0.add(i * hd), hd) };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `avx2` is true only when AVX2, FMA and F16C were detected.
            unsafe { task_avx2(i, q, k_cache, v_cache, batch, a, r16, tiled, row) };
            return;
        }
        task_body(i, q, k_cache, v_cache, batch, a, r16, tiled, false, row);
    };
    pool.run(n_tasks, &task);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 path (rows read as f16 in registers, fused updates) computes the generic loops'
    /// floats bit for bit: head dims with and without a tail past 64, the f16 and the f32
    /// accumulator, the tiled step's weights, a window and soft-capping.
    #[test]
    fn the_f16c_path_equals_the_generic_loops_bit_for_bit() {
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
                    task_body(i, &q, &k, &v, &batch, &a, r16, tiled, false, &mut want);
                    // SAFETY: has_avx2 checked AVX2, FMA and F16C.
                    unsafe { task_avx2(i, &q, &k, &v, &batch, &a, r16, tiled, &mut got) };
                    for (d, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "hd {hd}, task {i}, dim {d}, r16 {r16}, tiled {tiled}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
