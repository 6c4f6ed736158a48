//! Tensor parallelism on CPU ranks: N ranks in threads, each a CPU backend with its part of
//! every layer and a communicator of threads, give the logits of the unsharded model whose
//! output and down projections are computed in N column parts (`load_reduce_chunks`) bit for
//! bit, on every rank; those are close to the whole model's; one rank is the whole model.

#[path = "common/tp.rs"]
mod shared;

use quiver_backend::{Backend, Batch, Comm, LocalComm, Shard, KV_BLOCK_SIZE};
use quiver_backend_cpu::CpuBackend;
use quiver_gguf::GgufFile;
use quiver_models::{load_reduce_chunks, load_shard, Model, State, TpPeers, TpSizes};
use shared::{batch, bits_differ, preset_of, run, steps, synth};
use std::sync::Arc;

/// tiny-llama with heads, KV heads and FFN width that 2 and 4 ranks divide (8, 4, 1024).
fn preset() -> quiver_synth::Preset {
    preset_of("tiny-llama")
}

/// The ranks' sizes in these tests: 4 blocks of KV (f16), steps of 16 rows and logits.
fn sizes() -> TpSizes {
    TpSizes {
        n_ctx: 4 * KV_BLOCK_SIZE,
        kv: Default::default(),
        n_slots: 4 * KV_BLOCK_SIZE,
        max_tokens: 16,
        max_logits: 16,
    }
}

fn whole(f: &Arc<GgufFile>) -> Vec<Vec<f32>> {
    let mut b = CpuBackend::new(1);
    let m = quiver_models::load(&b, f).unwrap();
    run(&mut b, &m)
}

fn reference(f: &Arc<GgufFile>, chunks: usize) -> Vec<Vec<f32>> {
    let mut b = CpuBackend::new(1);
    let m = load_reduce_chunks(&b, f, chunks).unwrap();
    run(&mut b, &m)
}

/// Each of `n` ranks' logits, rank 0 first.
fn ranks(f: &Arc<GgufFile>, n: usize) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = LocalComm::group(n)
            .into_iter()
            .map(|c| {
                sc.spawn(move || {
                    let shard = c.shard();
                    let mut b = CpuBackend::new(1).with_comm(Arc::new(c));
                    let m = load_shard(&b, f, shard).unwrap();
                    assert_eq!(m.hp.n_head, 8 / n);
                    // Embedding and head split by vocabulary where the ranks divide it.
                    let v = m.hp.n_vocab;
                    let part = if v % n == 0 { v / n } else { v };
                    let head = b.weight_rows(m.output.as_ref().unwrap_or(&m.tok_embd));
                    assert_eq!((b.weight_rows(&m.tok_embd), head), (part, part));
                    run(&mut b, &m)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// ‖a − b‖ / ‖b‖ over all the logits.
fn rel_l2(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut e, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        e += ((x - y) as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (e / n).sqrt()
}

/// The ranks of each of `tp_sizes` against the reference, bit for bit, and the reference
/// against the whole model within `close` (relative L2 over every logit). The reference's
/// reordered sums differ from the whole model's in the last bits; once such a difference
/// moves one rounding of a value to the f16 KV cache or to the int8 activations of a
/// quantized product, the difference grows to that rounding's noise: about 1e-4 with F32
/// weights, 1e-2 with quantized ones, on these tiny random models. A rank's missing or
/// misplaced part differs by order 1.
fn check(ty: &str, tp_sizes: &[usize], close: f64) {
    check_preset(&preset(), ty, tp_sizes, close)
}

fn check_preset(p: &quiver_synth::Preset, ty: &str, tp_sizes: &[usize], close: f64) {
    let f = synth(p, ty, p.name);
    let want = whole(&f);
    assert!(want.iter().flatten().all(|x| x.is_finite()));
    assert_eq!(bits_differ(&reference(&f, 1), &want), 0, "{ty}: 1 part");
    for &n in tp_sizes {
        let r = reference(&f, n);
        let d = rel_l2(&r, &want);
        assert!(d <= close, "{ty}: {n} parts: relative L2 difference {d}");
        for (rank, got) in ranks(&f, n).iter().enumerate() {
            let differ = bits_differ(got, &r);
            assert_eq!(
                differ, 0,
                "{ty}: rank {rank} of {n}: {differ} logits differ"
            );
        }
    }
}

#[test]
fn ranks_give_the_reference_bit_for_bit_f32() {
    check("F32", &[2, 4], 1e-3);
}

#[test]
fn ranks_give_the_reference_bit_for_bit_q8_0() {
    check("Q8_0", &[2, 4], 5e-2);
}

#[test]
fn ranks_give_the_reference_bit_for_bit_q4_k_m() {
    // (Q4_K and Q6_K blocks of 256: 4 ranks would split the 512 head columns off them.)
    check("Q4_K_M", &[2], 5e-2);
}

#[test]
fn every_dense_architecture_splits() {
    // Biases and a tied output (qwen2), q/k norms (qwen3, gemma3), post-norms, soft-capping
    // and sliding windows (gemma2, gemma3), YaRN (mistral3), fused QKV and gate-up (phi3).
    for name in [
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-mistral3",
        "tiny-phi3",
    ] {
        check_preset(&preset_of(name), "F32", &[2, 4], 1e-3);
    }
}

#[test]
fn experts_split_by_width_or_by_expert_give_the_whole_models_logits() {
    // tiny-qwen3moe, 16 experts (4 a token), split by shape: experts of width 512 over 2 ranks
    // by width (each rank 256 of every expert: gate and up by rows, down by columns); of width
    // 128, or 512 over 4, by expert (each rank a run of whole experts, the pairs of the others
    // adding nothing there). The router is whole on every rank and the ranks' outputs are
    // summed. Within the reordered sums' rounding of the whole model (F32: 1e-4).
    let of = |ff: usize| quiver_synth::Preset {
        n_ff_exp: ff as u64,
        ..preset_of("tiny-qwen3moe")
    };
    for (ff, ty, close) in [(512, "F32", 1e-3), (128, "F32", 1e-3), (128, "Q8_0", 5e-2)] {
        let f = synth(&of(ff), ty, &format!("experts-{ff}"));
        let want = whole(&f);
        for n in [2, 4] {
            let hp = quiver_models::hparams(&f).unwrap().shard(n).unwrap();
            let m = hp.moe.unwrap();
            let by_width = ff == 512 && n == 2;
            assert_eq!(m.held.1 < m.n_expert, !by_width, "{ff} over {n}: {m:?}");
            let got = ranks(&f, n);
            let d = rel_l2(&got[0], &want);
            assert!(
                d <= close,
                "{ty}, width {ff}, {n} ranks: relative L2 difference {d}"
            );
            // Every rank computes the same logits (the head's gathered columns).
            for (rank, g) in got.iter().enumerate().skip(1) {
                assert_eq!(bits_differ(g, &got[0]), 0, "{ty}: rank {rank} of {n}");
            }
        }
    }
    // Batch invariant over the ranks, either way: sequence 0 alone gives its rows of the
    // mixed steps.
    for ff in [512, 128] {
        let f = synth(&of(ff), "Q8_0", &format!("experts-invariant-{ff}"));
        let mut tp = Ranks::start(group(2), &f).unwrap();
        let mixed: Vec<Vec<f32>> = steps().iter().map(|b| tp.forward(b).unwrap()).collect();
        let mut tp = Ranks::start(group(2), &f).unwrap();
        let v = tp.m.hp.n_vocab;
        let first = tp
            .forward(&batch(&[(0, &[1, 17, 300, 42, 9, 505, 3], 0)]))
            .unwrap();
        assert_eq!(bits_differ(&[first], &[mixed[0][..7 * v].to_vec()]), 0);
        let next = tp.forward(&batch(&[(0, &[12], 7)])).unwrap();
        assert_eq!(bits_differ(&[next], &[mixed[1][..v].to_vec()]), 0);
    }
}

#[test]
fn a_vocabulary_the_ranks_do_not_divide_keeps_the_head_whole() {
    // 510 tokens: split over 2 ranks, whole on each of 4; tied (the head is the embedding's).
    let p = quiver_synth::Preset {
        n_vocab: 510,
        ..preset_of("tiny-qwen2")
    };
    check_preset(&p, "Q8_0", &[2, 4], 5e-2);
}

/// Rank 0 on the test's thread, the others following it ([`TpPeers`]): the engine's runner
/// in small.
struct Ranks {
    b: CpuBackend,
    m: Model<CpuBackend>,
    s: State<CpuBackend>,
    peers: TpPeers,
}

impl Ranks {
    fn start(backends: Vec<CpuBackend>, f: &Arc<GgufFile>) -> quiver_models::Result<Ranks> {
        let (b, peers) = TpPeers::start(backends, f, sizes())?;
        let (m, s) = sizes().load(&b, f)?;
        Ok(Ranks { b, m, s, peers })
    }

    /// One step on every rank: rank 0's logits.
    fn forward(&mut self, batch: &Batch) -> quiver_models::Result<Vec<f32>> {
        self.peers
            .forward(&mut self.b, &self.m, &mut self.s, batch)?;
        let mut out = Vec::new();
        let n = batch.logits.len() * self.m.hp.n_vocab;
        self.b.read(&self.s.logits, n, &mut out)?;
        Ok(out)
    }
}

fn group(n: usize) -> Vec<CpuBackend> {
    LocalComm::group(n)
        .into_iter()
        .map(|c| CpuBackend::new(1).with_comm(Arc::new(c)))
        .collect()
}

#[test]
fn a_driver_runs_the_ranks_as_one_model() {
    let f = synth(&preset(), "Q8_0", "driver");
    let want = reference(&f, 2);
    let mut backends = group(2);
    backends.reverse(); // in any order
    let mut tp = Ranks::start(backends, &f).unwrap();
    assert_eq!(tp.peers.size(), 2);
    let got: Vec<Vec<f32>> = steps().iter().map(|b| tp.forward(b).unwrap()).collect();
    assert_eq!(bits_differ(&got, &want), 0);
    // A token past the vocabulary, which no rank's part of the embedding holds: every rank
    // refuses it, and the ranks stop.
    let e = tp.forward(&batch(&[(0, &[600], 11)])).unwrap_err();
    assert!(
        e.to_string().contains("token id 600 ≥ vocabulary 512"),
        "{e}"
    );
    let e = tp.forward(&steps()[1]).unwrap_err();
    assert!(e.to_string().contains("stopped"), "{e}");
    // Rank 0 alone failing (its state too small for the step) leaves the group: the others
    // stop instead of waiting in their first reduction, and the error is rank 0's.
    let (b, peers) = TpPeers::start(group(4), &f, sizes()).unwrap();
    let (m, _) = sizes().load(&b, &f).unwrap();
    let s = m.state(&b, 4 * KV_BLOCK_SIZE, 4, 4).unwrap();
    let mut small = Ranks { b, m, s, peers };
    let e = small.forward(&steps()[0]).unwrap_err().to_string();
    assert!(!e.contains("left the group"), "{e}");
    let e = small.forward(&steps()[1]).unwrap_err();
    assert!(e.to_string().contains("stopped"), "{e}");
    // Backends of no group: rank 0 of 1 each, not the parts of one model.
    let alone = vec![CpuBackend::new(1), CpuBackend::new(1)];
    let e = Ranks::start(alone, &f).err().unwrap();
    assert!(
        e.to_string().contains("not the ranks of one group of 2"),
        "{e}"
    );
}

#[test]
fn the_ranks_are_batch_invariant_and_deterministic() {
    let f = synth(&preset(), "Q8_0", "invariant");
    let start = || Ranks::start(group(4), &f).unwrap();
    let mut tp = start();
    let mixed: Vec<Vec<f32>> = steps().iter().map(|b| tp.forward(b).unwrap()).collect();
    // Sequence 0 alone, step by step: its rows of the mixed steps (the row of each step).
    let v = tp.m.hp.n_vocab;
    let alone = [
        (batch(&[(0, &[1, 17, 300, 42, 9, 505, 3], 0)]), 0..7, 0..7),
        (batch(&[(0, &[12], 7)]), 1..2, 0..1),
        (batch(&[(0, &[401], 8)]), 2..3, 1..2),
        (batch(&[(0, &[2], 9)]), 3..4, 0..1),
        (batch(&[(0, &[33], 10)]), 4..5, 0..1),
    ];
    let mut tp = start();
    for (b, step, rows) in alone {
        let got = tp.forward(&b).unwrap();
        let want = &mixed[step.start][rows.start * v..rows.end * v];
        assert_eq!(bits_differ(&[got], &[want.to_vec()]), 0, "step {step:?}");
    }
    // The same steps again on fresh ranks: the same bits.
    let mut tp = start();
    let again: Vec<Vec<f32>> = steps().iter().map(|b| tp.forward(b).unwrap()).collect();
    assert_eq!(bits_differ(&again, &mixed), 0);
}

#[test]
fn one_rank_is_the_whole_model() {
    let f = synth(&preset(), "Q8_0", "one");
    let mut b = CpuBackend::new(1);
    let m = load_shard(&b, &f, Shard::ONE).unwrap();
    assert_eq!(bits_differ(&run(&mut b, &m), &whole(&f)), 0);
}

#[test]
fn what_cannot_be_split_is_refused_with_its_reason() {
    let err = |f: &Arc<GgufFile>, n: usize| {
        let b = CpuBackend::new(1);
        match load_reduce_chunks(&b, f, n) {
            Ok(_) => panic!("{n} parts loaded"),
            Err(e) => e.to_string(),
        }
    };
    let f = synth(&preset(), "Q4_K_M", "refused");
    let e = err(&f, 4);
    assert!(e.contains("blocks of 256"), "{e}");
    let e = err(&f, 3);
    assert!(e.contains("heads (8) do not divide by 3"), "{e}");
    let moe = synth(quiver_synth::preset("tiny-qwen3moe").unwrap(), "F32", "moe");
    let e = err(&moe, 2);
    assert!(e.contains("dense layers' products only"), "{e}");
    // Experts whose width and count 2 ranks both do not divide (the rest of tiny-qwen3moe
    // divides).
    let mut hp = quiver_models::hparams(&moe).unwrap();
    assert!(hp.shard(2).is_ok());
    let m = hp.moe.as_mut().unwrap();
    (m.n_ff, m.n_expert) = (129, 15);
    let e = hp.shard(2).unwrap_err().to_string();
    assert!(
        e.contains("neither the experts' FFN width (129) nor their count (15) divides by 2"),
        "{e}"
    );
    // A rank's part on a backend of no group.
    let b = CpuBackend::new(1);
    let shard = Shard { rank: 1, size: 2 };
    let e = load_shard(&b, &f, shard).err().unwrap().to_string();
    assert!(
        e.contains("rank 1 of 2") && e.contains("rank 0 of 1"),
        "{e}"
    );
}
