//! Tensor parallelism on CUDA (`#[ignore]`d: needs a GPU; docs/GPU.md says how to run them).
//! N ranks of a tiny model, each a CUDA backend with its part of every layer, give the logits
//! of the unsharded model whose output and down projections are computed in N column parts
//! (`load_reduce_chunks`, on the GPU too) bit for bit, on every rank:
//! - ranks linked through the host (`LocalComm`), two backends on one GPU;
//! - ranks over NCCL, one GPU each: as many ranks as the machine has GPUs (one alone is the
//!   whole model, through NCCL's all-gather of one rank);
//!
//! and greedy decoding over NCCL ranks gives the whole model's tokens.

#[path = "../../models/tests/common/tp.rs"]
mod shared;

use quiver_backend::{Comm, LocalComm, Numerics, Shard};
use quiver_backend_cuda::{CudaBackend, CudaConfig};
use quiver_gguf::GgufFile;
use quiver_models::{load_reduce_chunks, load_shard};
use shared::{bits_differ, preset_of, run, synth};
use std::sync::Arc;

fn model(ty: &str) -> Arc<GgufFile> {
    synth(&preset_of("tiny-llama"), ty, "gpu-tiny-llama")
}

fn cuda(ordinal: usize) -> CudaBackend {
    CudaBackend::new(ordinal, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap()
}

/// A new NCCL group's id, or None (said on stderr) where NCCL is missing.
fn nccl_group() -> Option<quiver_backend_cuda::UniqueId> {
    quiver_backend_cuda::nccl_group()
        .map_err(|e| eprintln!("skipped: no NCCL ({e})"))
        .ok()
}

/// The GPUs this machine has.
fn gpus() -> usize {
    (0..16)
        .take_while(|&i| quiver_backend_cuda::probe(i).is_ok())
        .count()
}

fn reference(f: &Arc<GgufFile>, chunks: usize) -> Vec<Vec<f32>> {
    let mut b = cuda(0);
    let m = load_reduce_chunks(&b, f, chunks).unwrap();
    run(&mut b, &m)
}

/// Each rank's logits, rank 0 first; `make(rank)` gives its backend (made on its thread:
/// joining an NCCL group is collective).
fn ranks(
    f: &Arc<GgufFile>,
    n: usize,
    make: impl Fn(Shard) -> CudaBackend + Sync,
) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let make = &make;
                sc.spawn(move || {
                    let shard = Shard { rank, size: n };
                    let mut b = make(shard);
                    let m = load_shard(&b, f, shard).unwrap();
                    run(&mut b, &m)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_linked_through_the_host_equal_the_column_parts_bit_for_bit() {
    // (Q4_K's blocks of 256 split the tiny model's 512 columns in 2 parts, not 4.)
    for (ty, sizes) in [("Q8_0", &[2, 4][..]), ("Q4_K_M", &[2][..])] {
        let f = model(ty);
        for &n in sizes {
            let want = reference(&f, n);
            assert!(want.iter().flatten().all(|x| x.is_finite()));
            let comms = std::sync::Mutex::new(
                LocalComm::group(n)
                    .into_iter()
                    .map(Some)
                    .collect::<Vec<_>>(),
            );
            let got = ranks(&f, n, |s| {
                let c = comms.lock().unwrap()[s.rank].take().unwrap();
                assert_eq!(c.shard(), s);
                cuda(0).with_comm(Arc::new(c))
            });
            for (rank, g) in got.iter().enumerate() {
                assert_eq!(bits_differ(g, &want), 0, "{ty}: rank {rank} of {n}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_over_nccl_equal_the_column_parts_bit_for_bit() {
    let n = gpus().min(4);
    let Some(id) = nccl_group() else { return };
    // (Q8_0's blocks of 32 split the tiny model's columns in 4.)
    let f = model("Q8_0");
    let want = reference(&f, n);
    let got = ranks(&f, n, |s| cuda(s.rank).with_nccl(id, s).unwrap());
    for (rank, g) in got.iter().enumerate() {
        assert_eq!(bits_differ(g, &want), 0, "rank {rank} of {n} over NCCL");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_decoding_over_nccl_ranks_gives_the_whole_models_tokens() {
    use quiver_engine::{ModelRunner, RunnerOptions, Want};
    let n = gpus().min(2);
    let Some(id) = nccl_group() else { return };
    // F32 weights: the sums' order is the only difference from the whole model.
    let f = model("F32");
    let opts = RunnerOptions {
        n_ctx: 64,
        n_batch: 16,
        max_logits: 16,
        kv: Default::default(),
    };
    let prompt = [1u32, 17, 300, 42, 9, 505, 3];
    let greedy = |r: &mut ModelRunner<CudaBackend>| -> Vec<u32> {
        r.eval(&prompt[..prompt.len() - 1], 0, Want::Last).unwrap();
        let mut a = *prompt.last().unwrap();
        (0..12)
            .map(|i| {
                a = r.eval_argmax(&[a], prompt.len() - 1 + i).unwrap();
                a
            })
            .collect()
    };
    let want = greedy(&mut ModelRunner::new(cuda(0), &f, &opts).unwrap());
    let backends: Vec<CudaBackend> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                sc.spawn(move || cuda(rank).with_nccl(id, Shard { rank, size: n }).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut tp = ModelRunner::with_ranks(backends, &f, &opts).unwrap();
    assert_eq!(greedy(&mut tp), want, "{n} ranks over NCCL");
}
