//! Speculative decoding on the GPU (tests/spec_draft.rs's comparison on the CUDA backend), on a
//! synthetic SmolLM2-shaped model written at test time: with prompt lookup, with the target as
//! its own draft, with a draft of random weights and with an EAGLE-3 head of random weights
//! (the head's numbers against llama.cpp: tests/eagle3.rs), and on Qwen 3.5 (recurrent state
//! rolled back) with prompt lookup and its multi-token-prediction block, the tokens (greedy and seeded, alone,
//! together and under preemption) are those of plain serving on the same backend. Needs a
//! GPU: `#[ignore]`d; docs/GPU.md says how to run them.

use quiver_backend::Numerics;
use quiver_backend_cuda::{CudaBackend, CudaConfig};
use quiver_engine::serve::{EngineHandle, Request, ServeOptions};
use quiver_engine::spec::{DraftFile, SpecConfig, SpecType};
use quiver_engine::SamplerParams;
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

mod common;

fn synth(preset: &str, ty: &str, seed: u64) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-gpu-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset}-{ty}-{seed}.gguf"));
    if !path.is_file() {
        let p = quiver_synth::preset(preset).unwrap();
        let ft = quiver_synth::file_type(ty).unwrap();
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        let tmp = path.with_extension(format!("{:?}.tmp", std::thread::current().id()));
        quiver_synth::write(p, ft, seed, &tmp, threads, |_, _| {}).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    Arc::new(GgufFile::open(&path).unwrap())
}

fn backend() -> CudaBackend {
    CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap()
}

fn start(f: &Arc<GgufFile>, spec: SpecConfig, kv_blocks: usize) -> EngineHandle {
    let tok = Tokenizer::from_gguf(f).unwrap();
    let so = ServeOptions {
        kv: Default::default(),
        spec,
        n_ctx: 256,
        max_seqs: 12,
        kv_blocks,
        max_batch_tokens: 128,
        max_waiting: 16,
    };
    quiver_engine::start_serving(backend, f.clone(), tok, so, "synth".into()).unwrap()
}

/// Twelve requests: random prompts, every third a block that repeats (prompt lookup finds it),
/// even ones greedy, odd ones sampled at 0.8 with their own seed, 24 tokens each.
fn requests(n_vocab: u32) -> Vec<Request> {
    (0..12)
        .map(|i| {
            let mut p = common::ids(4 + 5 * i, 70 + i as u64, n_vocab);
            if i % 3 == 0 {
                p = p.iter().chain(&p).chain(&p).copied().collect();
            }
            let sampling = if i % 2 == 0 {
                SamplerParams::greedy()
            } else {
                SamplerParams {
                    temperature: 0.8,
                    seed: 500 + i as u64,
                    ..Default::default()
                }
            };
            common::request(&p, sampling, 24)
        })
        .collect()
}

fn alone(h: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| common::answers(h, std::slice::from_ref(r)).remove(0))
        .collect()
}

/// `spec`'s answers alone, together, and together in a pool small enough to preempt, against
/// plain serving's alone; returns (proposed, accepted).
fn same_answers(f: &Arc<GgufFile>, spec: SpecConfig, label: &str) -> (u64, u64) {
    let n_vocab = Tokenizer::from_gguf(f).unwrap().n_vocab() as u32;
    let reqs = requests(n_vocab);
    let plain = start(f, SpecConfig::default(), 512);
    let want = alone(&plain, &reqs);
    plain.shutdown(std::time::Duration::from_secs(5));
    let h = start(f, spec.clone(), 512);
    let (a, t) = (alone(&h, &reqs), common::answers(&h, &reqs));
    let st = h.stats();
    h.shutdown(std::time::Duration::from_secs(5));
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&a[i], w, "{label}: request {i} alone");
        assert_eq!(&t[i], w, "{label}: request {i} with the others");
    }
    let small = start(f, spec, 28);
    let t = common::answers(&small, &reqs);
    let st2 = small.stats();
    small.shutdown(std::time::Duration::from_secs(5));
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&t[i], w, "{label}: request {i} under preemption");
    }
    assert!(st2.preemptions_total > 0, "{label}: no preemption");
    let (p, acc) = (
        st.spec_proposed_tokens_total + st2.spec_proposed_tokens_total,
        st.spec_accepted_tokens_total + st2.spec_accepted_tokens_total,
    );
    eprintln!("{label}: {acc}/{p} accepted");
    (p, acc)
}

fn spec(kind: SpecType, draft: Option<Arc<GgufFile>>) -> SpecConfig {
    SpecConfig {
        kind,
        draft_max: 6,
        max_decoding: 12,
        draft_model: draft.map(DraftFile),
        // By acceptance alone: what these tests count does not depend on the step times.
        timed: false,
        ..Default::default()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prompt_lookup_on_the_gpu_gives_the_tokens_of_plain_serving() {
    let f = synth("smollm2-135m", "Q4_1", 7);
    let (p, a) = same_answers(&f, spec(SpecType::Ngram, None), "ngram");
    assert!(p > 0 && a > 0, "{a}/{p}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn draft_models_on_the_gpu_give_the_tokens_of_plain_serving() {
    let f = synth("smollm2-135m", "Q4_1", 7);
    let (p, a) = same_answers(&f, spec(SpecType::Draft, Some(f.clone())), "self draft");
    assert!(p > 0 && a * 2 > p, "self draft: {a}/{p}");
    let other = synth("smollm2-135m", "Q4_1", 99);
    let (p, a) = same_answers(&f, spec(SpecType::Draft, Some(other)), "random draft");
    assert!(p > 0 && a * 4 < p, "random draft: {a}/{p}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eagle3_heads_on_the_gpu_give_the_tokens_of_plain_serving() {
    let f = synth("smollm2-135m", "Q4_1", 7);
    let head = synth("smollm2-135m-eagle3", "Q4_1", 8);
    let (p, a) = same_answers(&f, spec(SpecType::Eagle3, Some(head)), "eagle3");
    assert!(p > 0 && a * 4 < p, "random eagle3 head: {a}/{p}");
}

/// Qwen 3.5 on the GPU: prompt lookup and the model's own multi-token-prediction block
/// (random) propose; the delta net keeps each sequence's states after its last rows and a
/// rejected proposal returns it to its accepted row (the kernels' kept states), so the tokens
/// are plain serving's, alone, together and under preemption.
#[test]
#[ignore = "needs a CUDA GPU"]
fn qwen35_speculation_on_the_gpu_rolls_the_recurrent_state_back() {
    let f = synth("tiny-qwen35-mtp", "Q8_0", 7);
    // Lookups of one token (the tiny random model repeats no longer n-gram of its prompts).
    let lookup = SpecConfig {
        ngram_min: 1,
        ..spec(SpecType::Ngram, None)
    };
    let (p, a) = same_answers(&f, lookup, "qwen35 ngram");
    assert!(p > 0 && a < p, "qwen35 ngram: {a}/{p}");
    let (p, _) = same_answers(&f, spec(SpecType::Mtp, None), "qwen35 mtp");
    assert!(p > 0, "qwen35 mtp: no proposals");
}

/// DeepSeek-V4 on the GPU: its own multi-token-prediction block (random, window-only) proposes;
/// the attention keeps what each speculating row overwrites in the window and compressor rings
/// and a rejected proposal writes them back (dsv4.cu `ds_rewind`), so the tokens are plain
/// serving's, alone, together and under preemption.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deepseek4_speculation_on_the_gpu_rolls_the_rings_back() {
    let f = synth("tiny-deepseek4-mtp", "Q8_0", 7);
    let (p, _) = same_answers(&f, spec(SpecType::Mtp, None), "deepseek4 mtp");
    assert!(p > 0, "deepseek4 mtp: no proposals");
}

/// `quiver run --spec …` on the GPU: one sequence (`generate_spec`, the proposal verified as a
/// step of several rows) gives the tokens of plain `generate` on the same backend, greedy and
/// seeded, with prompt lookup, the target as its own draft (a second backend on the same GPU)
/// and a random draft.
#[test]
#[ignore = "needs a CUDA GPU"]
fn single_sequence_speculation_on_the_gpu_gives_the_tokens_of_plain_generation() {
    use quiver_engine::{generate, generate_spec, GenOptions, ModelRunner, RunnerOptions};
    use quiver_engine::{Sampler, Session, Speculator};
    let target = synth("smollm2-135m", "Q4_1", 7);
    let other = synth("smollm2-135m", "Q4_1", 99);
    let tok = Tokenizer::from_gguf(&target).unwrap();
    let runner = |f: &Arc<GgufFile>, max_logits| {
        let opts = RunnerOptions {
            n_ctx: 256,
            n_batch: 64,
            max_logits,
            kv: Default::default(),
        };
        ModelRunner::new(backend(), f, &opts).unwrap()
    };
    let opts = GenOptions {
        max_tokens: 40,
        ..Default::default()
    };
    let prompt: Vec<u32> = common::ids(16, 5, 49152).repeat(3);
    for i in [0u64, 3] {
        let sampling = || {
            Sampler::new(if i == 0 {
                SamplerParams::greedy()
            } else {
                SamplerParams {
                    temperature: 0.8,
                    seed: i,
                    ..Default::default()
                }
            })
        };
        let mut plain = runner(&target, 1);
        let want = generate(&mut plain, &tok, &prompt, 0, &mut sampling(), &opts, |_| {
            true
        })
        .unwrap()
        .tokens;
        drop(plain);
        for (label, kind, draft) in [
            ("ngram", SpecType::Ngram, None),
            ("self draft", SpecType::Draft, Some(&target)),
            ("random draft", SpecType::Draft, Some(&other)),
        ] {
            // As `quiver run` sizes it: a power of two of logits rows (graph buckets).
            let mut r = runner(&target, 8);
            let mut d = draft.map(|f| runner(f, 1));
            let cfg = SpecConfig {
                kind,
                draft_max: 7,
                timed: false,
                ..Default::default()
            };
            let mut s = Speculator::new(cfg, d.as_mut().map(|d| d as &mut dyn Session));
            let got = generate_spec(
                &mut r,
                Some(&mut s),
                &tok,
                &prompt,
                0,
                &mut sampling(),
                &opts,
                |_| true,
            )
            .unwrap()
            .tokens;
            eprintln!(
                "{label}, sampling {i}: {}/{} accepted",
                s.accepted, s.proposed
            );
            assert_eq!(got, want, "{label}, sampling {i}");
            // Sampled tokens of a random model rarely repeat the prompt: the n-gram lookup
            // may find nothing to propose there (the draft models always propose).
            assert!(
                s.proposed > 0 || (kind == SpecType::Ngram && i != 0),
                "{label}, sampling {i}: nothing proposed"
            );
        }
    }
}
