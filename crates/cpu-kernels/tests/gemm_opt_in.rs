//! The GEMM (prefill) path is off by default (it is not batch invariant, see
//! `gemm_min_tokens`); `QUIVER_CPU_GEMM_MIN_TOKENS` turns it on, whatever a caller's
//! `Numerics`. This binary sets it to 9 before the first matmul (one test only, so no other
//! test reads the variable first) and, with the default (batch-invariant) scratch, checks that
//! path against the scalar reference with the panel's activation quantization,
//! at every SIMD level, for every quantized type (`common::check`, as `parity.rs` checks every
//! path).

mod common;

use common::{check, levels, Case, Pool2, TYPES};
use quiver_cpu_kernels::{
    activation_kind, gemm_min_tokens, GgmlType, Numerics, Scratch, ThreadPool,
};

#[test]
fn gemm_path_when_opted_in_matches_the_reference() {
    std::env::set_var("QUIVER_CPU_GEMM_MIN_TOKENS", "9");
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::new();
    let mut pooled = vec![Pool2::default(); levels().len()];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let quantized = TYPES
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16));
    for ty in quantized {
        assert_eq!(gemm_min_tokens(ty, Numerics::BatchInvariant), 9);
        assert_eq!(gemm_min_tokens(ty, Numerics::Fast), 9);
        for n in [9, 17, 64, 70] {
            // The panel holds the decode path's activations: per 32 (per 256 for K-quants).
            assert_eq!(activation_kind(ty, n), activation_kind(ty, 1));
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let case = Case {
                ty,
                rows: 37,
                cols: 768,
                n,
            };
            check(&case, &pool, &mut scratch, seed, &mut pooled);
        }
    }
}
