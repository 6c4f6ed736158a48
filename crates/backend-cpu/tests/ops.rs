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
fn delta_net_keeps_each_sequence_in_its_slot_and_matches_reference() {
    let mut rng = seeded_rng();
    quiver_backend::testing::delta_net::delta_net(
        &mut backend(Numerics::BatchInvariant),
        &Cpu,
        &mut rng,
    )
    .print("delta_net");
}

#[test]
fn dsv4_ops_match_reference_and_keep_each_sequence_in_its_slot() {
    let mut rng = seeded_rng();
    quiver_backend::testing::dsv4::dsv4(&mut backend(Numerics::BatchInvariant), &Cpu, &mut rng)
        .print("dsv4");
}

#[test]
fn moe_and_bias_match_reference() {
    let mut rng = seeded_rng();
    quiver_backend::testing::moe::moe(&backend(Numerics::BatchInvariant), &Cpu, &mut rng)
        .print("moe");
}

#[test]
fn moe_is_batch_invariant() {
    let mut rng = seeded_rng();
    quiver_backend::testing::moe::moe_invariance(
        &backend(Numerics::BatchInvariant),
        &Cpu,
        &mut rng,
    );
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

/// Router logits holding NaN: `n_used` distinct experts a token, finite output (it indexed past
/// its routes and panicked).
#[test]
fn moe_routes_around_nan_router_logits() {
    quiver_backend::testing::moe::moe_nan_router(&backend(Numerics::BatchInvariant), &Cpu);
}

/// Per-expert gate, up and down scales: as the experts' weights scaled by them.
#[test]
fn moe_product_scales_match_scaled_weights() {
    quiver_backend::testing::moe::moe_product_scales(&backend(Numerics::BatchInvariant), &Cpu);
}
