//! Parity of every matmul path (type x SIMD level x decode/prefill) with the scalar
//! reference: weights quantized with `quiver_quant::quantize` and dequantized with
//! `quiver_quant::dequantize`, dot products in f64.
//!
//! Two references per case:
//! - `exact`: activations quantized and dequantized as the path does it
//!   (`activation_roundtrip`). The kernel must then agree to float rounding: products are
//!   formed in f32 (`d_w * d_a * integer dot`) and summed in f32 over at most a few thousand
//!   columns, so the relative L2 error is ~1e-7..1e-6; the bound is 2e-5.
//! - `true`: the f32 activations themselves. The 8-bit activation quantization adds uniform
//!   rounding noise of at most d/2 per element with `d = max|x| / 127` per 32 (or 256)
//!   elements; for Gaussian-like activations that is about 0.3-0.6 % relative noise on each
//!   product and so on each output, measured here at about 0.5 % (0.6 % for the blocks of
//!   256). A case with a handful of outputs is a small sample of that noise (4 outputs can
//!   show 2-3x the mean), so the bound 1e-2 applies to the error pooled over all cases of a
//!   type and level; each single case with at least 64 outputs has to stay under 5e-2. Float weights take no
//!   activation quantization: 1e-5 everywhere.
//!
//! Every output starts as NaN, so an element the kernel skips fails the check.

use quiver_cpu_kernels::{
    activation_kind, activation_offset_terms, activation_roundtrip, matmul_with_level, GgmlType,
    Scratch, SimdLevel, ThreadPool,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly Gaussian, never exactly zero.
    fn normal(&mut self) -> f32 {
        let v = (0..4).map(|_| self.uniform()).sum::<f32>() * 0.87;
        if v == 0.0 {
            1e-3
        } else {
            v
        }
    }
}

pub const TYPES: [GgmlType; 15] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .into_iter()
        .filter(|&l| l <= SimdLevel::detected())
        .collect()
}

/// Random weights `[rows, cols]` with per-row scales varying over two orders of magnitude
/// and an offset on some rows (so mins/offset terms matter), quantized to `ty`.
fn weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut f = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let scale = 0.05 * 10f32.powf(rng.uniform());
        let offset = if r % 3 == 0 {
            0.5 * scale * rng.uniform()
        } else {
            0.0
        };
        f.extend((0..cols).map(|_| scale * rng.normal() + offset));
    }
    let mut q = Vec::new();
    quiver_quant::quantize(ty, &f, &mut q).unwrap();
    let mut deq = vec![0f32; rows * cols];
    quiver_quant::dequantize(ty, &q, &mut deq).unwrap();
    (q, deq)
}

fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let (w, x) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            out[t * rows + r] = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    out
}

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g as f64 - w) * (g as f64 - w);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
}

/// Squared error and squared norm, pooled over cases, per level.
#[derive(Default, Clone, Copy)]
struct Pool2 {
    num: f64,
    den: f64,
}

fn sq(got: &[f32], want: &[f64]) -> Pool2 {
    let mut p = Pool2::default();
    for (&g, &w) in got.iter().zip(want) {
        p.num += (g as f64 - w) * (g as f64 - w);
        p.den += w * w;
    }
    p
}

/// Runs one case at every level; returns the worst exact error and adds the errors against
/// the f32-activation reference into `pooled` (indexed like `levels()`).
fn check(
    case: &Case,
    pool: &ThreadPool,
    scratch: &mut Scratch,
    seed: u64,
    pooled: &mut [Pool2],
) -> f64 {
    let Case { ty, rows, cols, n } = *case;
    let mut rng = Rng(seed | 1);
    let (wq, wf) = weights(&mut rng, ty, rows, cols);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
    let kind = activation_kind(ty, n);
    let xq: Vec<f32> = x
        .chunks_exact(cols)
        .flat_map(|row| activation_roundtrip(kind, row))
        .collect();
    // Exact: dequantized weights times the activations as quantized, plus the f16 rounding of
    // the offset sums Q4_1/Q5_1 products use (ggml's q8_1).
    let mut want_exact = reference(&wf, &xq, rows, cols, n);
    if kind == 0 {
        let extra = activation_offset_terms(ty, &wq, rows, cols, &x, n);
        want_exact.iter_mut().zip(&extra).for_each(|(w, e)| *w += e);
    }
    let want_true = reference(&wf, &x, rows, cols, n);
    let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let (b_exact, b_case) = if float { (1e-5, 1e-5) } else { (2e-5, 5e-2) };
    let mut worst = 0f64;
    for (li, level) in levels().into_iter().enumerate() {
        let mut out = vec![f32::NAN; n * rows];
        matmul_with_level(level, pool, ty, &wq, rows, cols, &x, n, &mut out, scratch).unwrap();
        let (e1, e2) = (rel_l2(&out, &want_exact), rel_l2(&out, &want_true));
        let what = format!(
            "{ty} {rows}x{cols} n={n} {} ({} threads)",
            level.name(),
            pool.n_threads()
        );
        assert!(
            e1 < b_exact,
            "{what}: error vs the quantized-activation reference {e1:.3e} >= {b_exact:e}"
        );
        // A few outputs are too small a sample of the quantization noise for a bound (one
        // output near zero makes the relative error of 3 outputs anything).
        if n * rows >= 64 {
            assert!(
                e2 < b_case,
                "{what}: error vs the f32-activation reference {e2:.3e} >= {b_case:e}"
            );
        }
        let p = sq(&out, &want_true);
        pooled[li].num += p.num;
        pooled[li].den += p.den;
        worst = worst.max(e1);
    }
    worst
}

fn run_type(ty: GgmlType) {
    let pools = [ThreadPool::new(2).unwrap(), ThreadPool::new(3).unwrap()];
    let mut scratch = Scratch::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ ty as u64;
    let mut worst = 0f64;
    let mut pooled = vec![Pool2::default(); levels().len()];
    let mut shapes = vec![(37, 512), (13, 2304), (4, 256)];
    if ty.block_size() == 32 {
        // Odd block counts (a tail after the pairs and quads of blocks), and a short row.
        shapes.extend([(7, 800), (3, 96)]);
    }
    if ty.block_size() == 1 {
        shapes.push((5, 45));
    }
    for (rows, cols) in shapes {
        // 1..=3, 5, 7 (and 8 below the crossover of most types): decode path in groups of up
        // to 4 tokens; 8 is the prefill path with a mostly empty tile for Q5_0; 17, 64, 70:
        // prefill with partial and multiple tiles.
        for n in [1, 2, 3, 5, 7, 8, 17, 64, 70] {
            for pool in &pools {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                worst = worst.max(check(
                    &Case { ty, rows, cols, n },
                    pool,
                    &mut scratch,
                    seed,
                    &mut pooled,
                ));
            }
        }
    }
    let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let bound = if float { 1e-5 } else { 1e-2 };
    for (level, p) in levels().into_iter().zip(&pooled) {
        let e = (p.num / p.den).sqrt();
        eprintln!(
            "{ty} {}: worst exact error {worst:.2e}, pooled error vs f32 activations {e:.2e}",
            level.name()
        );
        assert!(
            e < bound,
            "{ty} {}: pooled error vs f32 activations {e:.3e} >= {bound:e}",
            level.name()
        );
    }
}

macro_rules! type_tests {
    ($($name:ident => $ty:ident),* $(,)?) => {
        $(#[test] fn $name() { run_type(GgmlType::$ty); })*
    };
}

type_tests! {
    parity_q4_0 => Q4_0, parity_q4_1 => Q4_1, parity_q5_0 => Q5_0, parity_q5_1 => Q5_1,
    parity_q8_0 => Q8_0, parity_q2_k => Q2_K, parity_q3_k => Q3_K, parity_q4_k => Q4_K,
    parity_q5_k => Q5_K, parity_q6_k => Q6_K, parity_iq4_nl => IQ4_NL, parity_iq4_xs => IQ4_XS,
    parity_f16 => F16, parity_bf16 => BF16, parity_f32 => F32,
}

/// The checker itself can fail: a result computed from other weights is far off.
#[test]
fn checker_rejects_a_wrong_result() {
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::new();
    let mut rng = Rng(7);
    let (rows, cols, n) = (16, 256, 3);
    let (wq, _) = weights(&mut rng, GgmlType::Q4_K, rows, cols);
    let (_, other) = weights(&mut rng, GgmlType::Q4_K, rows, cols);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
    let mut out = vec![0f32; n * rows];
    matmul_with_level(
        SimdLevel::detected(),
        &pool,
        GgmlType::Q4_K,
        &wq,
        rows,
        cols,
        &x,
        n,
        &mut out,
        &mut scratch,
    )
    .unwrap();
    assert!(rel_l2(&out, &reference(&other, &x, rows, cols, n)) > 0.5);
    let mut skipped = out.clone();
    skipped[5] = f32::NAN;
    assert!(rel_l2(&skipped, &reference(&other, &x, rows, cols, n)).is_infinite());
}
