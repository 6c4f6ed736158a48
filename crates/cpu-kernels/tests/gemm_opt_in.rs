//! The GEMM (prefill) path is off by default (it is not batch invariant, see
//! `gemm_min_tokens`); `QUIVER_CPU_GEMM_MIN_TOKENS` turns it on. This binary sets it to 9
//! before the first matmul (one test only, so no other test reads the variable first) and
//! checks that path against the scalar reference with the panel's activation quantization,
//! at every SIMD level, for every quantized type.

use quiver_cpu_kernels::{
    activation_kind, activation_offset_terms, activation_roundtrip, gemm_min_tokens,
    matmul_with_level, GgmlType, Scratch, SimdLevel, ThreadPool,
};

const TYPES: [GgmlType; 12] = [
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
];

#[test]
fn gemm_path_when_opted_in_matches_the_reference() {
    std::env::set_var("QUIVER_CPU_GEMM_MIN_TOKENS", "9");
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::new();
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut uni = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    for ty in TYPES {
        assert_eq!(gemm_min_tokens(ty), 9);
        let (rows, cols) = (37, 768);
        let wf: Vec<f32> = (0..rows * cols).map(|_| 0.05 * uni()).collect();
        let mut w = Vec::new();
        quiver_quant::quantize(ty, &wf, &mut w).unwrap();
        let mut deq = vec![0f32; rows * cols];
        quiver_quant::dequantize(ty, &w, &mut deq).unwrap();
        for n in [9, 17, 64, 70] {
            // The panel holds the decode path's activations: per 32 (per 256 for K-quants).
            let kind = activation_kind(ty, n);
            assert_eq!(kind, activation_kind(ty, 1));
            let x: Vec<f32> = (0..n * cols).map(|_| uni()).collect();
            let xq: Vec<f32> = x
                .chunks_exact(cols)
                .flat_map(|r| activation_roundtrip(kind, r))
                .collect();
            // The f16 offset sums of Q4_1/Q5_1 (ggml's q8_1), which `xq` cannot express.
            let extra = activation_offset_terms(ty, &w, rows, cols, &x, n);
            for level in SimdLevel::ALL
                .into_iter()
                .filter(|&l| l <= SimdLevel::detected())
            {
                let mut out = vec![f32::NAN; n * rows];
                matmul_with_level(
                    level,
                    &pool,
                    ty,
                    &w,
                    rows,
                    cols,
                    &x,
                    n,
                    &mut out,
                    &mut scratch,
                )
                .unwrap();
                let (mut num, mut den) = (0f64, 0f64);
                for t in 0..n {
                    for r in 0..rows {
                        let want: f64 = (0..cols)
                            .map(|c| deq[r * cols + c] as f64 * xq[t * cols + c] as f64)
                            .sum::<f64>()
                            + extra[t * rows + r];
                        let got = out[t * rows + r] as f64;
                        num += if got.is_finite() {
                            (got - want) * (got - want)
                        } else {
                            f64::INFINITY
                        };
                        den += want * want;
                    }
                }
                let e = (num / den).sqrt();
                assert!(
                    e < 2e-5,
                    "{ty} n={n} {}: GEMM path error {e:.3e}",
                    level.name()
                );
            }
        }
    }
}
