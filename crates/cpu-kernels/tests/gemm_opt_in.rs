//! The GEMM (prefill) path, which only `Numerics::Fast` takes (from 64 tokens: it is not batch
//! invariant, see `gemm_min_tokens`): with a fast scratch, checked against the scalar reference
//! with the panel's activation quantization, at every SIMD level, for every quantized type
//! (`common::check`, as `parity.rs` checks every path).

mod common;

use common::{check, levels, Case, Pool2, TYPES};
use quiver_cpu_kernels::{
    activation_kind, gemm_min_tokens, GgmlType, Numerics, Scratch, ThreadPool,
};

#[test]
fn gemm_path_of_fast_numerics_matches_the_reference() {
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::with_numerics(Numerics::Fast);
    let mut pooled = vec![Pool2::default(); levels().len()];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let quantized = TYPES
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16));
    for ty in quantized {
        assert_eq!(gemm_min_tokens(ty, Numerics::BatchInvariant), usize::MAX);
        assert_eq!(gemm_min_tokens(ty, Numerics::Fast), 64);
        for n in [64, 70, 97] {
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
