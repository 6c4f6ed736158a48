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

/// f32 weights round as llama.cpp's AVX-512 build at every SIMD level from AVX2: one token under
/// `Numerics::Fast` as its product for one token (`ggml_vec_dot_f32`:
/// `quiver_backend::numerics::f32_dot`), and every other product (two and three tokens, and one
/// in the batch-invariant numerics) in the order of its tinyBLAS blocks (16-lane sums over whole
/// 16-column chunks, reduced by halves, then the tail: [`block_order`]); bit for bit, on lengths
/// with and without a tail past the last 64 and the last 16.
#[test]
fn f32_weights_round_as_avx512_at_every_level() {
    use quiver_cpu_kernels::{matmul_with_level, SimdLevel};
    if SimdLevel::detected() < SimdLevel::Avx2 {
        eprintln!("skipped: this CPU has no AVX2");
        return;
    }
    let pool = ThreadPool::new(2).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
        if SimdLevel::detected() < level {
            eprintln!("{}: not on this CPU", level.name());
            continue;
        }
        for (rows, cols) in [(9, 1024), (5, 256 + 48 + 7)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            // (The f32 rows' own bytes: aligned as a file's tensor data is.)
            // SAFETY: `w` holds rows·cols f32s; x86 is little-endian, as GGUF is.
            let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 4) };
            let a: Vec<f32> = (0..3 * cols).map(|_| rnd()).collect();
            let mut out = vec![0f32; 3 * rows];
            for (numerics, n) in [
                (Numerics::Fast, 1),
                (Numerics::Fast, 2),
                (Numerics::Fast, 3),
                (Numerics::BatchInvariant, 1),
            ] {
                let mut scratch = Scratch::with_numerics(numerics);
                matmul_with_level(
                    level,
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
                for t in 0..n {
                    for r in 0..rows {
                        let (w, x) = (&w[r * cols..][..cols], &a[t * cols..][..cols]);
                        let want = if n == 1 && numerics == Numerics::Fast {
                            quiver_backend::numerics::f32_dot(w, x)
                        } else {
                            block_order(w, x)
                        };
                        assert_eq!(
                            out[t * rows + r].to_bits(),
                            want.to_bits(),
                            "{} {numerics:?}, {n} tokens: token {t}, row {r} of {rows}×{cols}",
                            level.name()
                        );
                    }
                }
            }
        }
    }
}

/// w·x in the order of llama.cpp's tinyBLAS on AVX-512: 16 lanes of fused multiply-adds over
/// whole 16-column chunks, reduced as `_mm512_reduce_add_ps` (the 256-bit halves, the 128-bit
/// halves, lanes 0 + 2 and 1 + 3, then those two), then the tail's products added in order.
fn block_order(w: &[f32], x: &[f32]) -> f32 {
    let end = w.len() / 16 * 16;
    let mut l = [0f32; 16];
    for (w, x) in w[..end].chunks_exact(16).zip(x[..end].chunks_exact(16)) {
        for i in 0..16 {
            l[i] = w[i].mul_add(x[i], l[i]);
        }
    }
    let h: [f32; 8] = std::array::from_fn(|i| l[i] + l[8 + i]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[4 + i]);
    let mut s = (q[0] + q[2]) + (q[1] + q[3]);
    for c in end..w.len() {
        s += w[c] * x[c];
    }
    s
}
