//! The shared op body on the CPU with `Numerics::Fast`, as single-sequence commands run:
//! products of 64 tokens and more on the GEMM path, and attention steps of 64 rows and more in
//! llama.cpp's tiled form (q and the accumulator in f32).

mod common;

use common::{backend, Cpu};
use quiver_backend::testing::{attention, products, seeded_rng};
use quiver_backend_cpu::{CpuBackend, Numerics};

fn prefill_backend() -> CpuBackend {
    backend(Numerics::Fast)
}

#[test]
fn products_on_the_gemm_path_match_reference() {
    let mut rng = seeded_rng();
    let notes = products::products(&mut prefill_backend(), &Cpu, &mut rng);
    notes.print("products, batch invariance off");
    assert!(notes.skipped.is_empty(), "the CPU takes every type");
}

#[test]
fn tiled_attention_matches_reference() {
    let mut rng = seeded_rng();
    attention::attention(&mut prefill_backend(), &Cpu, &mut rng)
        .print("attention, batch invariance off");
}

#[test]
fn rope_kv_write_of_tiled_steps_matches_reference() {
    let mut rng = seeded_rng();
    attention::rope_kv_write(&mut prefill_backend(), &Cpu, &mut rng)
        .print("rope_kv_write, batch invariance off");
}
