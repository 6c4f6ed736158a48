//! Batch invariance: for every supported type and every SIMD level this CPU has, the output
//! row of a token is bit-identical whatever the other tokens of the call are, whatever
//! `n_tokens` is and whatever the thread count (compared as f32 bits).
//!
//! 70 random tokens are multiplied all at once, then each token alone (n = 1), then the
//! subsets 3..8, 10..27, 0..2, 5..8, 30..47, 0..64 and 64..70 (n = 5, 17, 2, 3, 17, 64, 6),
//! each with pools of 1 and 2 threads; every row must equal the row of the full call.
//! Rows are 37 (not a multiple of the row groups) and columns include odd block counts.
//!
//! The check can fail: `checker_sees_a_one_ulp_difference` flips one bit of one row.
//!
//! Numerics are per caller (`Scratch`), not per process:
//! `numerics_are_per_scratch_and_coexist` runs a batch-invariant and a fast caller side by side.

use quiver_cpu_kernels::{
    matmul, matmul_with_level, GgmlType, Numerics, Scratch, SimdLevel, ThreadPool,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const N: usize = 70;

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .into_iter()
        .filter(|&l| l <= SimdLevel::detected())
        .collect()
}

fn cols_for(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        256 => vec![256, 768, 2304],
        32 => vec![96, 800, 2304],
        _ => vec![45, 640, 2304],
    }
}

/// Returns the index of the first token whose row differs, with a description.
fn first_mismatch(full: &[f32], got: &[f32], t0: usize, n: usize, rows: usize) -> Option<String> {
    for lt in 0..n {
        let t = t0 + lt;
        let (a, b) = (
            &full[t * rows..(t + 1) * rows],
            &got[lt * rows..(lt + 1) * rows],
        );
        if let Some(r) = (0..rows).find(|&r| a[r].to_bits() != b[r].to_bits()) {
            return Some(format!(
                "token {t} row {r}: {} (n = {N}) vs {} (n = {n} from token {t0})",
                a[r], b[r]
            ));
        }
    }
    None
}

fn run_type(ty: GgmlType) {
    let pools = [ThreadPool::new(1).unwrap(), ThreadPool::new(2).unwrap()];
    let mut scratch = Scratch::new();
    let rows = 37;
    for cols in cols_for(ty) {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (ty as u64) << 20 ^ cols as u64);
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| 0.05 * rng.uniform() + if i % 7 == 0 { 0.01 } else { 0.0 })
            .collect();
        let mut w = Vec::new();
        quiver_quant::quantize(ty, &wf, &mut w).unwrap();
        let x: Vec<f32> = (0..N * cols).map(|_| rng.uniform()).collect();
        for level in levels() {
            let mut full = vec![f32::NAN; N * rows];
            matmul_with_level(
                level,
                &pools[1],
                ty,
                &w,
                rows,
                cols,
                &x,
                N,
                &mut full,
                &mut scratch,
            )
            .unwrap();
            assert!(
                full.iter().all(|v| v.is_finite()),
                "{ty} {level:?}: non-finite output"
            );
            let mut subsets: Vec<(usize, usize)> = (0..N).map(|t| (t, 1)).collect();
            subsets.extend([
                (3, 5),
                (10, 17),
                (0, 2),
                (5, 3),
                (30, 17),
                (0, 64),
                (64, 6),
                (0, N),
            ]);
            for pool in &pools {
                for &(t0, n) in &subsets {
                    let mut out = vec![f32::NAN; n * rows];
                    let xs = &x[t0 * cols..(t0 + n) * cols];
                    matmul_with_level(
                        level,
                        pool,
                        ty,
                        &w,
                        rows,
                        cols,
                        xs,
                        n,
                        &mut out,
                        &mut scratch,
                    )
                    .unwrap();
                    if let Some(m) = first_mismatch(&full, &out, t0, n, rows) {
                        panic!(
                            "{ty} {rows}x{cols} {} ({} threads): not batch invariant: {m}",
                            level.name(),
                            pool.n_threads()
                        );
                    }
                }
            }
        }
    }
}

macro_rules! type_tests {
    ($($name:ident => $ty:ident),* $(,)?) => {
        $(#[test] fn $name() { run_type(GgmlType::$ty); })*
    };
}

type_tests! {
    invariant_q4_0 => Q4_0, invariant_q4_1 => Q4_1, invariant_q5_0 => Q5_0, invariant_q5_1 => Q5_1,
    invariant_q8_0 => Q8_0, invariant_q2_k => Q2_K, invariant_q3_k => Q3_K, invariant_q4_k => Q4_K,
    invariant_q5_k => Q5_K, invariant_q6_k => Q6_K, invariant_iq4_nl => IQ4_NL, invariant_iq4_xs => IQ4_XS,
    invariant_f16 => F16, invariant_bf16 => BF16, invariant_f32 => F32,
}

#[test]
fn checker_sees_a_one_ulp_difference() {
    let rows = 5;
    let full: Vec<f32> = (0..3 * rows).map(|i| i as f32 * 0.37 + 1.0).collect();
    let mut got = full[rows..2 * rows].to_vec();
    assert!(first_mismatch(&full, &got, 1, 1, rows).is_none());
    got[2] = f32::from_bits(got[2].to_bits() + 1);
    assert!(first_mismatch(&full, &got, 1, 1, rows).is_some());
}

/// `w` (`rows × cols` of `ty`) and `N` tokens of activations, from `seed`.
fn case(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = Rng(seed);
    let wf: Vec<f32> = (0..rows * cols).map(|_| 0.05 * rng.uniform()).collect();
    let mut w = Vec::new();
    quiver_quant::quantize(ty, &wf, &mut w).unwrap();
    let x: Vec<f32> = (0..N * cols).map(|_| rng.uniform()).collect();
    (w, x)
}

/// What one caller sees: the `N`-token call, and every token alone.
fn batch_and_alone(
    pool: &ThreadPool,
    scratch: &mut Scratch,
    ty: GgmlType,
    (w, x): &(Vec<u8>, Vec<f32>),
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut batch = vec![f32::NAN; N * rows];
    matmul(pool, ty, w, rows, cols, x, N, &mut batch, scratch).unwrap();
    let mut alone = vec![f32::NAN; N * rows];
    for (xt, o) in x.chunks_exact(cols).zip(alone.chunks_exact_mut(rows)) {
        matmul(pool, ty, w, rows, cols, xt, 1, o, scratch).unwrap();
    }
    (batch, alone)
}

/// Whether the GEMM path rounds otherwise than the decode path for `ty` at the active level:
/// always for the K-quants; for the 32-element types only in the x86 kernels (the portable
/// GEMM adds their blocks in the decode path's order).
fn gemm_rounds_apart(ty: GgmlType) -> bool {
    ty.block_size() == 256 || SimdLevel::active() > SimdLevel::Portable
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Two callers with different numerics in one process, at the same time (two threads, each
/// its own pool and scratch) and in turn (one thread alternating between them): each rounds
/// as its own setting says, which a process-wide switch could not give. The batch-invariant
/// caller gives every token of a 70-token call the bits it gets alone; the fast caller takes
/// the GEMM path for the 70 tokens (rows that differ from the token alone, where that path
/// rounds apart) and the same decode path as the other for one token..
#[test]
fn numerics_are_per_scratch_and_coexist() {
    let (rows, cols) = (64, 2304);
    let check = |ty: GgmlType, inv: &(Vec<f32>, Vec<f32>), fast: &(Vec<f32>, Vec<f32>)| {
        assert!(
            same_bits(&inv.0, &inv.1),
            "{ty}: the batch-invariant caller's 70-token rows differ from its tokens alone"
        );
        assert!(
            same_bits(&fast.1, &inv.1),
            "{ty}: one token alone rounds differently under the two numerics"
        );
        let differ = fast
            .0
            .iter()
            .zip(&fast.1)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(
            differ > 0 || !gemm_rounds_apart(ty),
            "{ty}: the fast caller's 70-token call gave the bits of one-token calls (no GEMM path)"
        );
    };
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let data = case(ty, rows, cols, 0x5eed ^ (ty as u64) << 8);
        // At the same time: one thread per caller.
        let (inv, fast) = std::thread::scope(|s| {
            let run = |numerics| {
                let data = &data;
                s.spawn(move || {
                    let pool = ThreadPool::new(2).unwrap();
                    let mut scratch = Scratch::with_numerics(numerics);
                    assert_eq!(scratch.numerics(), numerics);
                    batch_and_alone(&pool, &mut scratch, ty, data, rows, cols)
                })
            };
            let (a, b) = (run(Numerics::BatchInvariant), run(Numerics::Fast));
            (a.join().unwrap(), b.join().unwrap())
        });
        check(ty, &inv, &fast);
        // In turn: one pool, two scratches, calls interleaved; the same bits as above.
        let pool = ThreadPool::new(2).unwrap();
        let mut s_inv = Scratch::new();
        assert_eq!(s_inv.numerics(), Numerics::BatchInvariant, "the default");
        let mut s_fast = Scratch::with_numerics(Numerics::Fast);
        let fast2 = batch_and_alone(&pool, &mut s_fast, ty, &data, rows, cols);
        let inv2 = batch_and_alone(&pool, &mut s_inv, ty, &data, rows, cols);
        let fast3 = batch_and_alone(&pool, &mut s_fast, ty, &data, rows, cols);
        for (what, a, b) in [
            ("invariant", &inv, &inv2),
            ("fast", &fast, &fast2),
            ("fast", &fast, &fast3),
        ] {
            assert!(
                same_bits(&a.0, &b.0) && same_bits(&a.1, &b.1),
                "{ty}: the {what} caller's results changed when the other ran in between"
            );
        }
    }
}
