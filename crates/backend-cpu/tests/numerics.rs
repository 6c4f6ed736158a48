//! Numerics are per `CpuBackend`, not per process: a batch-invariant and a fast instance live
//! side by side, their calls interleaved, and each rounds as its own setting says.
//!
//! - matmul: the batch-invariant instance gives every token of a 70-token call the bits it
//!   gets alone; the fast one takes the GEMM path for the 70 tokens (rows that differ from the
//!   token alone where that path rounds apart), and one token alone rounds the same under both.
//! - attention: the last token of a 70-row step equals the same token in a step of its own on
//!   the batch-invariant instance; the fast one takes llama.cpp's tiled form for the 70 rows.

use quiver_backend::testing::Rng;
use quiver_backend::{AttnParams, Backend, Batch, WeightBytes};
use quiver_backend_cpu::{CpuBackend, CpuConfig, CpuWeight, Numerics};
use quiver_cpu_kernels::SimdLevel;
use quiver_gguf::{GgmlType, GgufFile, GgufWriter};
use std::sync::Arc;

const N: usize = 70;

fn backends() -> (CpuBackend, CpuBackend) {
    let inv = CpuBackend::new(2);
    assert_eq!(inv.numerics(), Numerics::BatchInvariant, "the default");
    let fast = CpuBackend::with_config(CpuConfig {
        threads: 2,
        numerics: Numerics::Fast,
    });
    assert_eq!(fast.numerics(), Numerics::Fast);
    (inv, fast)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn weight_file(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> WeightBytes {
    let wf: Vec<f32> = rng.vec(rows * cols).iter().map(|x| 0.05 * x).collect();
    let mut bytes = Vec::new();
    quiver_quant::quantize(ty, &wf, &mut bytes).unwrap();
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, &[rows as u64, cols as u64]);
    let f = GgufFile::from_bytes(w.to_bytes(&[&bytes]).unwrap()).unwrap();
    WeightBytes::whole(Arc::new(f), 0)
}

/// The `N`-token product, and every token's product alone.
fn batch_and_alone(be: &CpuBackend, w: &CpuWeight, x: &Vec<f32>) -> (Vec<f32>, Vec<f32>) {
    let (rows, cols) = (w.rows, w.cols);
    let mut batch = vec![f32::NAN; N * rows];
    be.matmul(w, x, N, &mut batch).unwrap();
    let mut alone = Vec::with_capacity(N * rows);
    let mut out = vec![f32::NAN; rows];
    for xt in x.chunks_exact(cols) {
        be.matmul(w, &xt.to_vec(), 1, &mut out).unwrap();
        alone.extend_from_slice(&out);
    }
    (batch, alone)
}

#[test]
fn two_instances_with_different_numerics_matmul_each_their_own_way() {
    let (inv, fast) = backends();
    let mut rng = Rng(0x6e75_6d65_7269_6373);
    let (rows, cols) = (64, 2304);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        let bytes = weight_file(ty, rows, cols, &mut rng);
        let wi = inv.weight("w", ty, &[rows as u64, cols as u64], bytes.clone());
        let wf = fast.weight("w", ty, &[rows as u64, cols as u64], bytes);
        let (wi, wf) = (wi.unwrap(), wf.unwrap());
        let x = rng.vec(N * cols);
        // Interleaved: fast, invariant, fast again.
        let f1 = batch_and_alone(&fast, &wf, &x);
        let i1 = batch_and_alone(&inv, &wi, &x);
        let f2 = batch_and_alone(&fast, &wf, &x);
        assert!(
            same_bits(&i1.0, &i1.1),
            "{ty}: the batch-invariant instance's {N}-token rows differ from its tokens alone"
        );
        assert!(
            same_bits(&f1.1, &i1.1),
            "{ty}: one token alone rounds differently on the two instances"
        );
        let differ =
            f1.0.iter()
                .zip(&f1.1)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
        // The portable kernels' GEMM path adds the 32-element types' blocks in the decode
        // path's order; the K-quants (and everything on x86) round apart.
        let apart = ty.block_size() == 256 || SimdLevel::active() > SimdLevel::Portable;
        assert!(
            differ > 0 || !apart,
            "{ty}: the fast instance's {N}-token call gave the one-token bits (no GEMM path)"
        );
        assert!(
            same_bits(&f1.0, &f2.0) && same_bits(&f1.1, &f2.1),
            "{ty}: the fast instance's results changed after the other instance ran"
        );
    }
}

#[test]
fn two_instances_with_different_numerics_attend_each_their_own_way() {
    let (mut inv, mut fast) = backends();
    let mut rng = Rng(0x6174_746e_2d6e_756d);
    let (nh, nkv, hd, bs) = (4, 2, 64, 16);
    let a = AttnParams {
        n_head: nh,
        n_head_kv: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        scale_q: false,
        window: None,
        softcap: None,
    };
    let blocks: Vec<u32> = (0..N.div_ceil(bs) as u32).collect();
    let n_slots = blocks.len() * bs;
    let f16 = |v: Vec<f32>| -> Vec<half::f16> {
        v.iter().map(|&x| half::f16::from_f32(x * 3.0)).collect()
    };
    let (k, v) = (
        f16(rng.vec(n_slots * nkv * hd)),
        f16(rng.vec(n_slots * nkv * hd)),
    );
    let q: Vec<f32> = rng
        .vec(N * nh * hd)
        .iter()
        .map(|&x| half::f16::from_f32(x * 3.0).to_f32())
        .collect();
    let tokens: Vec<u32> = (0..N as u32).collect();
    let whole = Batch::single(&tokens, 0, &blocks, bs, vec![]);
    let last = Batch::single(&tokens[N - 1..], N - 1, &blocks, bs, vec![]);
    let row = nh * hd;
    // The last token's output row: in the N-row step, then in a step of its own.
    let run = |be: &mut CpuBackend| -> (Vec<f32>, Vec<f32>) {
        let mut kv = be
            .kv(&quiver_backend::testing::kv_spec(n_slots, nkv, hd), 0)
            .unwrap();
        kv.k.clone_from(&k);
        kv.v.clone_from(&v);
        let st = be.begin_step(&whole, 0, usize::MAX, usize::MAX).unwrap();
        let mut out = vec![f32::NAN; N * row];
        be.attention(&st, &q, &kv, &a, &mut out).unwrap();
        let st = be.begin_step(&last, 0, usize::MAX, usize::MAX).unwrap();
        let mut alone = vec![f32::NAN; row];
        be.attention(&st, &q[(N - 1) * row..].to_vec(), &kv, &a, &mut alone)
            .unwrap();
        (out[(N - 1) * row..].to_vec(), alone)
    };
    let f1 = run(&mut fast);
    let i1 = run(&mut inv);
    let f2 = run(&mut fast);
    assert!(
        same_bits(&i1.0, &i1.1),
        "the batch-invariant instance's attention depends on the step's size"
    );
    assert!(
        same_bits(&f1.1, &i1.1),
        "one row alone attends differently on the two instances"
    );
    assert!(
        !same_bits(&f1.0, &f1.1),
        "the fast instance's {N}-row step did not take the tiled form"
    );
    assert!(
        same_bits(&f1.0, &f2.0) && same_bits(&f1.1, &f2.1),
        "the fast instance's results changed after the other instance ran"
    );
}
