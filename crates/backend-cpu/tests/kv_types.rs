//! The KV cache's element types on the CPU (the shared body in
//! `quiver_backend::testing::kv_types`): every type written and attended over within its
//! codec's error of the f32 reference, batch invariant; shapes a type cannot store refused.

mod common;

use quiver_backend::testing::{kv_types, Rng};
use quiver_backend::{Backend, KvLayer, KvSpec, KvType, KV_BLOCK_SIZE};
use quiver_backend_cpu::CpuBackend;

#[test]
fn every_kv_type_attends_within_its_codecs_error() {
    let mut be = common::backend(quiver_backend_cpu::Numerics::BatchInvariant);
    let notes = kv_types::kv_types(
        &mut be,
        &common::Cpu,
        &kv_types::all_pairs(),
        &mut Rng(0x5eed_4b56),
    );
    for n in notes {
        eprintln!("{n}");
    }
}

#[test]
fn a_head_dim_a_type_cannot_store_is_refused() {
    let be = CpuBackend::new(1);
    for (ty, hd) in [(KvType::Tq8, 96), (KvType::Tq4, 80), (KvType::Q8_0, 80)] {
        let spec = KvSpec {
            k: KvType::F16,
            v: ty,
            block_size: KV_BLOCK_SIZE,
            n_slots: 16,
            layers: vec![KvLayer {
                n_head_kv: 2,
                head_dim: hd,
            }],
        };
        let e = be.kv(&spec, 0).err().expect("refused").to_string();
        assert!(e.contains(ty.name()) && e.contains(&hd.to_string()), "{e}");
    }
}

#[test]
fn tq4_keys_need_blocks_of_16_slots() {
    let be = CpuBackend::new(1);
    let spec = KvSpec {
        k: KvType::Tq4,
        v: KvType::F16,
        block_size: 32,
        n_slots: 64,
        layers: vec![KvLayer {
            n_head_kv: 2,
            head_dim: 64,
        }],
    };
    let e = be.kv(&spec, 0).err().expect("refused").to_string();
    assert_eq!(e, "kv: tq4 keys need KV blocks of 16 slots, not 32");
    let spec = KvSpec {
        block_size: 16,
        n_slots: 40,
        ..spec
    };
    let e = be.kv(&spec, 0).err().expect("refused").to_string();
    assert_eq!(
        e,
        "kv: tq4 keys need a whole number of 16-slot blocks, not 40 slots"
    );
    // As values tq4 takes any block size.
    let spec = KvSpec {
        k: KvType::F16,
        v: KvType::Tq4,
        block_size: 32,
        n_slots: 64,
        ..spec
    };
    assert!(be.kv(&spec, 0).is_ok());
}

#[test]
fn prompts_over_every_kv_type_at_depth() {
    let mut be = common::backend(quiver_backend_cpu::Numerics::BatchInvariant);
    let mut rng = Rng(0x5eed_4b57);
    for len in [300, 4500] {
        let notes =
            kv_types::prompt_at_depth(&mut be, &common::Cpu, &kv_types::all_pairs(), len, &mut rng);
        for n in notes {
            eprintln!("{n}");
        }
    }
}
