//! Tensor parallelism on CUDA (`#[ignore]`d: needs a GPU; docs/GPU.md says how to run them).
//! N ranks of a tiny model, each a CUDA backend with its part of every layer, give the logits
//! of the unsharded model whose output and down projections are computed in N column parts
//! (`load_reduce_chunks`, on the GPU too) bit for bit, on every rank:
//! - ranks linked through the host (`LocalComm`), two backends on one GPU;
//! - ranks over NCCL, one GPU each: as many ranks as the machine has GPUs (one alone is the
//!   whole model, through NCCL's all-gather of one rank);
//!
//! and greedy decoding over NCCL ranks gives the whole model's tokens.

use quiver_backend::{Backend, Batch, Comm, LocalComm, Numerics, SeqSpan, Shard, KV_BLOCK_SIZE};
use quiver_backend_cuda::{CudaBackend, CudaConfig};
use quiver_gguf::GgufFile;
use quiver_models::{load_reduce_chunks, load_shard, Model};
use std::sync::Arc;

/// tiny-llama with heads, KV heads and FFN width that 2 and 4 ranks divide (8, 4, 1024).
fn model(ty: &str) -> Arc<GgufFile> {
    let p = quiver_synth::Preset {
        n_head: 8,
        n_head_kv: 4,
        n_ff: 1024,
        ..quiver_synth::preset("tiny-llama").unwrap().clone()
    };
    let dir = std::env::temp_dir().join(format!("quiver-gpu-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("tiny-llama-{ty}.gguf"));
    quiver_synth::write(
        &p,
        quiver_synth::file_type(ty).unwrap(),
        7,
        &path,
        2,
        |_, _| {},
    )
    .unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    f
}

fn cuda(ordinal: usize) -> CudaBackend {
    CudaBackend::new(ordinal, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap()
}

/// The GPUs this machine has.
fn gpus() -> usize {
    (0..16)
        .take_while(|&i| quiver_backend_cuda::probe(i).is_ok())
        .count()
}

/// A batch of the listed sequences' spans: (sequence, tokens, first position), every row's
/// logits wanted. Sequence s has blocks 2s and 2s + 1.
fn batch(spans: &[(u32, &[u32], usize)]) -> Batch {
    let mut b = Batch {
        block_size: KV_BLOCK_SIZE,
        ..Default::default()
    };
    for &(seq, tokens, at) in spans {
        let table = vec![2 * seq, 2 * seq + 1];
        let si = b.seqs.len();
        for (j, &t) in tokens.iter().enumerate() {
            let pos = at + j;
            b.tokens.push(t);
            b.positions.push(pos as u32);
            b.slots.push(
                table[pos / KV_BLOCK_SIZE] * KV_BLOCK_SIZE as u32 + (pos % KV_BLOCK_SIZE) as u32,
            );
            b.seq_of.push(si as u32);
        }
        b.seqs.push(SeqSpan {
            start: b.tokens.len() - tokens.len(),
            len: tokens.len(),
            kv_len: at + tokens.len(),
            block_table: table,
            ..Default::default()
        });
    }
    b.logits = (0..b.tokens.len() as u32).collect();
    b
}

/// A prompt of two sequences in one step, decode steps of both (in either order), one alone.
fn steps() -> Vec<Batch> {
    vec![
        batch(&[
            (0, &[1, 17, 300, 42, 9, 505, 3], 0),
            (1, &[5, 250, 77, 8, 100], 0),
        ]),
        batch(&[(0, &[12], 7), (1, &[13], 5)]),
        batch(&[(1, &[400], 6), (0, &[401], 8)]),
        batch(&[(0, &[2], 9)]),
    ]
}

/// Every step's logits.
fn run(b: &mut CudaBackend, m: &Model<CudaBackend>) -> Vec<Vec<f32>> {
    let mut s = m.state(b, 4 * KV_BLOCK_SIZE, 16, 16).unwrap();
    let n_vocab = m.hp.n_vocab;
    steps()
        .iter()
        .map(|batch| {
            m.forward(b, &mut s, batch).unwrap();
            let mut v = Vec::new();
            b.read(&s.logits, batch.logits.len() * n_vocab, &mut v)
                .unwrap();
            v
        })
        .collect()
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

fn bits_differ(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter()
                .zip(y)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count()
        })
        .sum()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_linked_through_the_host_equal_the_column_parts_bit_for_bit() {
    for ty in ["Q8_0", "Q4_K_M"] {
        let f = model(ty);
        for n in [2, 4] {
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
    let id = match quiver_backend_cuda::nccl_group() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("skipped: no NCCL ({e})");
            return;
        }
    };
    let f = model("Q4_K_M");
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
    let id = match quiver_backend_cuda::nccl_group() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("skipped: no NCCL ({e})");
            return;
        }
    };
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
