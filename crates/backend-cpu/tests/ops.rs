//! Every CPU op against the scalar reference: the shared op body of
//! `quiver_backend::testing` (its case table: every weight type, product shapes, paged
//! multi-sequence batches of 1 to 151 tokens, GQA, windows, soft-cap, both rope modes, norms,
//! GLU, soft-cap, argmax, top-k) with the CPU's numerical model. Fresh random inputs each run
//! (the seed is printed; `QUIVER_TEST_SEED` replays it).

mod common;

use common::{backend, Cpu};
use quiver_backend::testing::{attention, elementwise, products, seeded_rng};
use quiver_backend_cpu::Numerics;

#[test]
fn products_and_embedding_match_reference_for_every_type() {
    let mut rng = seeded_rng();
    let notes = products::products(&mut backend(Numerics::BatchInvariant), &Cpu, &mut rng);
    notes.print("products");
    assert!(notes.skipped.is_empty(), "the CPU takes every type");
}

#[test]
fn attention_matches_reference_with_paging_gqa_window_and_softcap() {
    let mut rng = seeded_rng();
    attention::attention(&mut backend(Numerics::BatchInvariant), &Cpu, &mut rng).print("attention");
}

#[test]
fn rope_kv_write_matches_reference_in_both_modes() {
    let mut rng = seeded_rng();
    attention::rope_kv_write(&mut backend(Numerics::BatchInvariant), &Cpu, &mut rng)
        .print("rope_kv_write");
}

#[test]
fn norms_glu_softcap_argmax_top_k_match_reference() {
    let mut rng = seeded_rng();
    elementwise::elementwise(&backend(Numerics::BatchInvariant), &Cpu, &mut rng)
        .print("elementwise");
}

#[test]
fn moe_and_bias_match_reference() {
    let mut rng = seeded_rng();
    quiver_backend::testing::moe::moe(&backend(Numerics::BatchInvariant), &Cpu, &mut rng)
        .print("moe");
}

#[test]
fn products_are_batch_invariant() {
    let mut rng = seeded_rng();
    products::batch_invariance(
        &backend(Numerics::BatchInvariant),
        &Cpu,
        &mut rng,
        quiver_backend::testing::cases::WEIGHT_TYPES,
        &[1, 2, 3, 9, 64, 65, 150],
    );
}

/// Router logits holding NaN (weights read as another type than written): every token still
/// goes to `n_used` distinct experts, a NaN one never ahead of a number and weighing nothing,
/// and the output is finite (it indexed past its routes and panicked).
#[test]
fn moe_routes_around_nan_router_logits() {
    use quiver_backend::{Activation, Backend, Gating, MoeParams, MoeScratch, MoeWeights};
    use quiver_gguf::GgmlType;
    let be = backend(Numerics::BatchInvariant);
    let (d, ff, ne, k, n) = (32usize, 32usize, 4usize, 2usize, 3usize);
    let weight = |rows: usize, shape: &[u64]| {
        let bytes: Vec<u8> = (0..rows * shape[shape.len() - 1] as usize)
            .flat_map(|i| (((i % 7) as f32 - 3.0) * 0.01).to_le_bytes())
            .collect();
        let t = quiver_backend::testing::tensor(GgmlType::F32, shape, &bytes);
        be.weight("w", GgmlType::F32, shape, t).unwrap()
    };
    let (ne64, ff64, d64) = (ne as u64, ff as u64, d as u64);
    let router = weight(ne, &[ne64, d64]);
    let gate = weight(ne * ff, &[ne64, ff64, d64]);
    let up = weight(ne * ff, &[ne64, ff64, d64]);
    let down = weight(ne * d, &[ne64, d64, ff64]);
    let p = MoeParams {
        n_expert: ne,
        n_used: k,
        n_ff: ff,
        gating: Gating::Softmax,
        norm: true,
        scale: 1.0,
        act: Activation::SwiGlu,
        router_given: true,
    };
    let mut s: Vec<Vec<f32>> = p
        .scratch_floats(n, d)
        .iter()
        .map(|&m| vec![0.0; m])
        .collect();
    let nan = f32::NAN;
    s[0][..n * ne].copy_from_slice(&[nan, 1.0, 0.5, 2.0, nan, nan, nan, nan, 3.0, nan, nan, 1.0]);
    let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.1).sin()).collect();
    let mut out = vec![0.0; n * d];
    let [logits, routes, xs, g, u, a, ys] = &mut s[..] else {
        unreachable!()
    };
    be.moe(
        &x,
        n,
        MoeWeights {
            router: &router,
            gate: &gate,
            up: &up,
            down: &down,
            down_scale: None,
        },
        &p,
        MoeScratch {
            logits,
            routes,
            xs,
            gate: g,
            up: u,
            act: a,
            ys,
        },
        &mut out,
    )
    .unwrap();
    let experts: Vec<f32> = s[1].chunks(2).take(n * k).map(|r| r[0]).collect();
    assert_eq!(experts, [3.0, 1.0, 0.0, 1.0, 0.0, 3.0]);
    let weights: Vec<f32> = s[1].chunks(2).take(n * k).map(|r| r[1]).collect();
    assert_eq!(&weights[2..4], [0.0, 0.0], "token 1's logits are all NaN");
    assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
    assert!(out[d..2 * d].iter().all(|&v| v == 0.0));
}
