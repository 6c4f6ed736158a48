//! The decode path's llama.cpp forms (`decode::FORM_GEMM4`, `FORM_TILED`): with
//! `Numerics::Fast`, as single-sequence commands run, a batch under 64 tokens rounds as the
//! llama.cpp kernel the same batch would take — the repacked Q4_K GEMM for each group of four
//! tokens, the tiled kernel for Q5_K/Q6_K from 8 tokens. They must stay products of the right
//! values: checked against the f64 reference exactly as `parity.rs` checks every path. (That
//! they are llama.cpp's floats bit for bit is checked end to end by the engine's parity test.)

mod common;

use common::{check, levels, Case, Pool2};
use quiver_cpu_kernels::{GgmlType, Numerics, Scratch, ThreadPool};

fn run(ty: GgmlType, ns: &[usize]) {
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::with_numerics(Numerics::Fast);
    let mut pooled = vec![Pool2::default(); levels().len()];
    let mut seed = 0x51ed_2700_9e37_79b9u64 ^ ty as u64;
    let mut worst = 0f64;
    for (rows, cols) in [(37, 512), (13, 2304), (8, 256)] {
        for &n in ns {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            worst = worst.max(check(
                &Case { ty, rows, cols, n },
                &pool,
                &mut scratch,
                seed,
                &mut pooled,
            ));
        }
    }
    eprintln!("{ty}: worst error vs the quantized-activation reference {worst:.2e}");
}

#[test]
fn q4_k_gemm4_groups_match_the_reference() {
    // 4..=7: one group of four (GEMM form) and 0..=3 tokens in the one-token form; 12, 13: more.
    run(GgmlType::Q4_K, &[4, 5, 7, 12, 13]);
}

#[test]
fn q5_k_and_q6_k_tiled_form_matches_the_reference() {
    // 8+ tokens under 64: the tiled form for every token.
    run(GgmlType::Q5_K, &[8, 9, 33, 63]);
    run(GgmlType::Q6_K, &[8, 9, 33, 63]);
}
