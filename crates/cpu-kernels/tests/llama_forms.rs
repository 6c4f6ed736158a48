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

/// One token with f32 weights under `Numerics::Fast` on AVX-512 rounds as llama.cpp's product
/// for one token (`ggml_vec_dot_f32`: `quiver_backend::numerics::f32_dot`), bit for bit, on
/// lengths with and without a tail past the last 64; two tokens keep the blocks' order (the
/// reference within its bound either way).
#[test]
fn f32_one_token_takes_ggml_vec_dot_order() {
    use quiver_cpu_kernels::{matmul_with_level, SimdLevel};
    if SimdLevel::detected() < SimdLevel::Avx512 {
        eprintln!("skipped: this CPU has no AVX-512");
        return;
    }
    let pool = ThreadPool::new(2).unwrap();
    let mut scratch = Scratch::with_numerics(Numerics::Fast);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    for (rows, cols) in [(9, 1024), (5, 256 + 48)] {
        let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        // (The f32 rows' own bytes: aligned as a file's tensor data is.)
        // SAFETY: `w` holds rows·cols f32s; x86 is little-endian, as GGUF is.
        let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 4) };
        let a: Vec<f32> = (0..2 * cols).map(|_| rnd()).collect();
        let mut out = vec![0f32; 2 * rows];
        let mut differ = 0;
        for n in [1, 2] {
            matmul_with_level(
                SimdLevel::Avx512,
                &pool,
                GgmlType::F32,
                bytes,
                rows,
                cols,
                &a[..n * cols],
                n,
                &mut out[..n * rows],
                &mut scratch,
            )
            .unwrap();
            for r in 0..rows {
                let want = quiver_backend::numerics::f32_dot(&w[r * cols..][..cols], &a[..cols]);
                if n == 1 {
                    assert_eq!(out[r].to_bits(), want.to_bits(), "row {r} of {rows}×{cols}");
                } else {
                    differ += usize::from(out[r].to_bits() != want.to_bits());
                    let exact: f64 = (0..cols)
                        .map(|c| w[r * cols + c] as f64 * a[c] as f64)
                        .sum();
                    assert!((out[r] as f64 - exact).abs() < 1e-4, "row {r}: {}", out[r]);
                }
            }
        }
        eprintln!("{rows}×{cols}: two tokens round otherwise in {differ} of {rows} rows");
    }
}
