//! Shared by the matmul parity tests: random weights and activations, the f64 reference, and
//! one checked case at every SIMD level (see `parity.rs` for the bounds and why).

#![allow(dead_code)]

use quiver_cpu_kernels::{
    activation_kind, activation_offset_terms, activation_roundtrip, matmul_with_level, GgmlType,
    Scratch, SimdLevel, ThreadPool,
};

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly Gaussian, never exactly zero.
    pub fn normal(&mut self) -> f32 {
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

pub fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .into_iter()
        .filter(|&l| l <= SimdLevel::detected())
        .collect()
}

/// Random weights `[rows, cols]` with per-row scales varying over two orders of magnitude
/// and an offset on some rows (so mins/offset terms matter), quantized to `ty`.
pub fn weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
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

pub fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let (w, x) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            out[t * rows + r] = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    out
}

pub fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
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

pub struct Case {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
}

/// Squared error and squared norm, pooled over cases, per level.
#[derive(Default, Clone, Copy)]
pub struct Pool2 {
    pub num: f64,
    pub den: f64,
}

pub fn sq(got: &[f32], want: &[f64]) -> Pool2 {
    let mut p = Pool2::default();
    for (&g, &w) in got.iter().zip(want) {
        p.num += (g as f64 - w) * (g as f64 - w);
        p.den += w * w;
    }
    p
}

/// Runs one case at every level; returns the worst exact error and adds the errors against
/// the f32-activation reference into `pooled` (indexed like `levels()`).
pub fn check(
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
