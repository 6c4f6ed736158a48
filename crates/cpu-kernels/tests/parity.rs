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

mod common;

use common::{check, levels, reference, rel_l2, weights, Case, Pool2, Rng};
use quiver_cpu_kernels::{matmul_with_level, GgmlType, Scratch, SimdLevel, ThreadPool};

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
