//! End to end on the GPU, on a synthetic SmolLM2-shaped model written at test time. Needs a
//! GPU: `#[ignore]`d, so CI reports them as ignored; docs/GPU.md says how to run them.
//! - decode steps replayed from CUDA graphs give the same logits, bit for bit, as the same
//!   steps run op by op;
//! - continuous batching on the GPU (padded graph buckets, paged KV) gives every request the
//!   tokens it gets alone;
//! - the parity mode (`--numerics parity`) gives the CPU backend's logits bit for bit.

use quiver_backend::Numerics;
use quiver_backend_cuda::{CudaBackend, CudaConfig, ParityBackend};
use quiver_engine::serve::{Request, ServeOptions};
use quiver_engine::{ModelRunner, RunnerOptions, SamplerParams, Want};
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

mod common;
#[path = "common/constrained.rs"]
mod constrained;

fn model() -> Arc<GgufFile> {
    synth("smollm2-135m", "Q4_1")
}

fn synth(preset: &str, ty: &str) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-gpu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset}-{ty}.gguf"));
    let p = quiver_synth::preset(preset).unwrap();
    let ft = quiver_synth::file_type(ty).unwrap();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    quiver_synth::write(p, ft, 7, &path, threads, |_, _| {}).unwrap();
    Arc::new(GgufFile::open(&path).unwrap())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_replay_equals_eager_bit_for_bit() {
    let f = model();
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 256,
        n_batch: 64,
        max_logits: 1,
    };
    let mut graphs = ModelRunner::new(
        CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap(),
        &f,
        &opts,
    )
    .unwrap();
    let be = CudaBackend::new(
        0,
        CudaConfig {
            graphs: false,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        },
    )
    .unwrap();
    let mut eager = ModelRunner::new(be, &f, &opts).unwrap();
    let nv = graphs.n_vocab() as u32;
    let prompt = common::ids(12, 3, nv);
    let a = graphs.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    let b = eager.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    assert_eq!(
        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "prompt step"
    );
    for (i, &t) in common::ids(24, 5, nv).iter().enumerate() {
        let pos = prompt.len() + i;
        let a = graphs.eval(&[t], pos, Want::Last).unwrap().to_vec();
        let b = eager.eval(&[t], pos, Want::Last).unwrap().to_vec();
        assert!(a.iter().all(|x| x.is_finite()));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "decode step {i}: replay differs from eager"
        );
    }
    let g = graphs.backend.graph_stats();
    assert!(g.captures >= 1 && g.replays >= 20, "{g:?}");
    let e = eager.backend.graph_stats();
    assert_eq!((e.captures, e.replays), (0, 0), "{e:?}");
}

/// A backend whose every op computes a token independently of the batch around it: the
/// products on the invariant numerics' kernel table, and every step's attention on the split-K
/// kernel with a fixed number of key ranges.
fn batch_invariant() -> CudaBackend {
    let config = CudaConfig {
        attention_splits: Some(4),
        ..CudaConfig::from_env(Numerics::BatchInvariant)
    };
    CudaBackend::new(0, config).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_serving_on_the_gpu_equals_solo_runs() {
    let prompts = |nv| {
        (0..6)
            .map(|i| common::ids(5 + 7 * i, 100 + i as u64, nv))
            .collect()
    };
    serving_equals_solo(model(), batch_invariant, prompts, 128);
}

/// The default path (the int8 types' decode rows in the exact-sum order: mmvqc / imv / imm,
/// prompt rows on qmm unsplit), the flash kernel on for prompt rows and the KV-group kernel for
/// decode rows, the key ranges chosen by the kernels. 16 requests of 3 to 198 tokens in steps
/// of at most 64 tokens, so that prompts are cut into chunks that differ from the solo runs'
/// and decode rows share steps with prompt chunks: each answer as alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_serving_of_the_int8_types_equals_solo_runs() {
    for ty in ["Q8_0", "Q4_0", "Q4_1"] {
        let prompts = |nv| {
            (0..16)
                .map(|i| common::ids(3 + 13 * i, 300 + i as u64, nv))
                .collect()
        };
        serving_equals_solo(synth("smollm2-135m", ty), default_backend, prompts, 64);
    }
}

/// A mixture-of-experts model on the default path, 16 requests of 3 to 198 tokens in steps of
/// at most 64 tokens: the experts' products change with a step's (token, expert) pairs (one
/// warp a pair's row on int8 activations for a few, grouped by expert on CUDA cores or in
/// tensor-core tiles for many), and each answer is as alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_serving_of_a_moe_model_equals_solo_runs() {
    for ty in ["Q8_0", "Q4_0"] {
        let prompts = |nv| {
            (0..16)
                .map(|i| common::ids(3 + 13 * i, 500 + i as u64, nv))
                .collect()
        };
        serving_equals_solo(synth("tiny-qwen3moe", ty), default_backend, prompts, 64);
    }
}

/// DeepSeek-V4 on CUDA (its attention over the per-sequence state: the window, ratio-4 blocks
/// with the indexer's top-k and a ratio-128 block; hash- and score-routed experts): 16 requests
/// of 3 to 198 tokens served together, in steps of at most 64 tokens, each answer as alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_serving_of_deepseek4_equals_solo_runs() {
    for ty in ["Q8_0", "Q4_K_M"] {
        let prompts = |nv| {
            (0..16)
                .map(|i| common::ids(3 + 13 * i, 700 + i as u64, nv))
                .collect()
        };
        serving_equals_solo(synth("tiny-deepseek4", ty), default_backend, prompts, 64);
    }
}

/// Qwen 3.5, dense and MoE, on CUDA: 16 requests of 3 to 198 tokens served together in steps
/// of up to 256 rows (the delta net's convolution in blocks of 32 channels, the q/k norms
/// apart) and alone in steps of up to 64 (a head a block, the norms in it): the same answers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_serving_of_qwen35_equals_solo_runs() {
    for preset in ["tiny-qwen35", "tiny-qwen35moe"] {
        let prompts = |nv| {
            (0..16)
                .map(|i| common::ids(3 + 13 * i, 900 + i as u64, nv))
                .collect()
        };
        serving_equals_solo(synth(preset, "Q8_0"), default_backend, prompts, 256);
    }
}

fn default_backend() -> CudaBackend {
    CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap()
}

/// Issue 18 on the default path: requests sent 1, 3, 16 and 64 at a time (`widths`), each
/// answer the one the same server gives the request alone. Mixed prompts of 2 to 38 tokens, a
/// third of them after one 48-token prefix (prefix-cache hits), every fourth sampled at
/// temperature 0.8 with its own seed, a KV pool of `kv_blocks`, too small for the widest group
/// (preemptions: generated tokens recomputed), 24 tokens each.
fn load_equals_alone(f: Arc<GgufFile>, label: &str, widths: &[usize], kv_blocks: usize) {
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let nv = vocab(&f);
    let most = *widths.iter().max().unwrap();
    let shared = common::ids(48, 999, nv);
    let reqs: Vec<Request> = (0..most)
        .map(|i| {
            let mut prompt = if i % 3 == 0 { shared.clone() } else { vec![] };
            prompt.extend(common::ids(2 + (i * 7) % 37, 500 + i as u64, nv));
            let sampling = if i % 4 == 1 {
                SamplerParams {
                    seed: 1000 + i as u64,
                    ..Default::default()
                }
            } else {
                SamplerParams::greedy()
            };
            common::request(&prompt, sampling, 24)
        })
        .collect();
    let so = ServeOptions {
        kv: Default::default(),
        spec: Default::default(),
        n_ctx: 256,
        max_seqs: most,
        kv_blocks,
        max_batch_tokens: 256,
        max_waiting: most,
    };
    let h =
        quiver_engine::start_serving(default_backend, f.clone(), tok, so, "synth".into()).unwrap();
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| common::answers(&h, std::slice::from_ref(r)).remove(0))
        .collect();
    let before = h.stats();
    for &w in widths {
        for (g, group) in reqs.chunks(w).enumerate() {
            for (k, got) in common::answers(&h, group).iter().enumerate() {
                let i = g * w + k;
                assert_eq!(got, &alone[i], "{label}: request {i} of a group of {w}");
            }
        }
    }
    let st = h.stats();
    assert!(
        st.preemptions_total > before.preemptions_total,
        "{label}: no preemption under load"
    );
    assert!(
        st.prefix_cache_hit_tokens_total > before.prefix_cache_hit_tokens_total,
        "{label}: no prefix-cache hit under load"
    );
}

/// 72 requests at once (decode steps of up to 72 rows: imm, the KV-group kernel in two
/// launches) on the SmolLM2 shape in Q8_0 and the Llama-3-1B shape in Q4_K_M.
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_serving_of_72_requests_equals_each_alone() {
    for (preset, ty) in [("smollm2-135m", "Q8_0"), ("llama3-1b", "Q4_K_M")] {
        load_equals_alone(synth(preset, ty), &format!("{preset} {ty}"), &[72], 160);
    }
}

/// Issue 18's widths on the 8B shape (Q4_K_M: Q4_K and Q6_K products).
#[test]
#[ignore = "needs a CUDA GPU"]
fn load_equals_alone_on_the_8b_shape() {
    let f = synth("llama3-8b", "Q4_K_M");
    load_equals_alone(f, "llama3-8b Q4_K_M", &[1, 3, 16, 64], 160);
}

/// Issue 18's widths on the real test models (scripts/test fetches them; on a GPU machine
/// without the network, carry them into `QUIVER_HOME`'s models: docs/GPU.md): SmolLM2-135M
/// Q4_1 and Gemma3-270M Q4_K_M.
#[test]
#[ignore = "needs a CUDA GPU"]
fn load_equals_alone_on_the_real_models() {
    for alias in ["smollm2-135m", "gemma3-270m"] {
        let p = quiver_hub::alias_path(alias);
        assert!(p.is_file(), "{} is missing", p.display());
        let f = Arc::new(GgufFile::open(&p).unwrap());
        load_equals_alone(f, alias, &[1, 3, 16, 64], 160);
    }
}

fn vocab(f: &GgufFile) -> u32 {
    f.hparams()
        .unwrap()
        .u32("vocab_size")
        .ok()
        .flatten()
        .unwrap_or(49152)
}

/// Greedy answers of `prompts(vocab)` from a server of `make()` backends, all at once in steps
/// of at most `step_tokens`, against the same prompts run alone on a runner.
fn serving_equals_solo(
    f: Arc<GgufFile>,
    make: fn() -> CudaBackend,
    prompts: impl Fn(u32) -> Vec<Vec<u32>>,
    step_tokens: usize,
) {
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let prompts = prompts(vocab(&f));
    let max_tokens = 20;
    let kv_blocks = 512;
    let mut solo = Vec::new();
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 256,
        n_batch: 64,
        max_logits: 1,
    };
    let mut r = ModelRunner::new(make(), &f, &opts).unwrap();
    for p in &prompts {
        let mut out = Vec::new();
        let mut next = r.eval_argmax(p, 0).unwrap();
        for k in 0..max_tokens {
            out.push(next);
            if k + 1 < max_tokens {
                next = r.eval_argmax(&[next], p.len() + k).unwrap();
            }
        }
        solo.push(out);
    }
    let so = ServeOptions {
        kv: Default::default(),
        spec: Default::default(),
        n_ctx: 256,
        max_seqs: 16,
        kv_blocks,
        max_batch_tokens: step_tokens,
        max_waiting: 16,
    };
    let h = quiver_engine::start_serving(make, f.clone(), tok, so, "synth".into()).unwrap();
    let reqs: Vec<Request> = prompts
        .iter()
        .map(|p| common::request(p, SamplerParams::greedy(), max_tokens))
        .collect();
    for (i, got) in common::answers(&h, &reqs).iter().enumerate() {
        assert_eq!(got, &solo[i], "request {i}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_bench_sequences_on_the_gpu_equal_solo_runs() {
    let f = model();
    let make = batch_invariant;
    let (n_prompt, n_gen) = (20, 8);
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 128,
        n_batch: 64,
        max_logits: 1,
    };
    let mut r = ModelRunner::new(make(), &f, &opts).unwrap();
    // 3 sequences: decode steps pad to the graph bucket of 4.
    let res =
        quiver_engine::batched_bench(&mut r.backend, &r.model, n_prompt, n_gen, 3, 32).unwrap();
    let nv = r.n_vocab();
    for (s, got) in res.tokens.iter().enumerate() {
        let prompt = quiver_engine::bench_prompt(s, n_prompt, nv);
        let mut want = vec![r.eval_argmax(&prompt, 0).unwrap()];
        for g in 0..n_gen {
            let t = *want.last().unwrap();
            want.push(r.eval_argmax(&[t], n_prompt + g).unwrap());
        }
        assert_eq!(got, &want, "sequence {s}");
    }
    assert!(r.backend.graph_stats().replays > 0);
}

/// The parity mode against the CPU backend (batch invariant, its default) on the same tokens:
/// a prompt step, then decode steps; every logit the same bits. The SmolLM2 shape in Q4_1 and
/// Q8_0 (its output), the Gemma3 shape in Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0; GeGLU, q/k norms,
/// sliding window, head dim 256), Q4_0 and Q5_1 on the SmolLM2 shape, and the Llama-3-1B shape
/// in Q5_K_M, Q3_K_M and Q2_K (Q2_K … Q6_K; head dim 64, GQA, llama3 rope scaling). The K-quant
/// "lanes" forms depend on the CPU's SIMD level: run it also with `QUIVER_CPU_SIMD=avx2`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn parity_mode_equals_the_cpu_bit_for_bit() {
    for (preset, ty) in [
        ("smollm2-135m", "Q4_1"),
        ("gemma3-270m", "Q4_K_M"),
        ("smollm2-135m", "Q4_0"),
        ("smollm2-135m", "Q5_1"),
        ("llama3-1b", "Q5_K_M"),
        ("llama3-1b", "Q3_K_M"),
        ("llama3-1b", "Q2_K"),
    ] {
        let f = synth(preset, ty);
        let opts = RunnerOptions {
            kv: Default::default(),
            n_ctx: 256,
            n_batch: 64,
            max_logits: 64,
        };
        let be = ParityBackend::new(0, CudaConfig::from_env(Numerics::Parity)).unwrap();
        let mut gpu = ModelRunner::new(be, &f, &opts).unwrap();
        let cpu_be = quiver_backend_cpu::CpuBackend::with_config(quiver_backend_cpu::CpuConfig {
            threads: 2,
            numerics: quiver_backend_cpu::Numerics::BatchInvariant,
        });
        let mut cpu = ModelRunner::new(cpu_be, &f, &opts).unwrap();
        let nv = gpu.n_vocab() as u32;
        let prompt = common::ids(40, 11, nv);
        let a = gpu.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
        let b = cpu.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
        assert!(a.iter().all(|x| x.is_finite()), "{preset} {ty}");
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{preset} {ty}: {differ} of {} prompt logits differ",
            a.len()
        );
        for (i, &t) in common::ids(6, 9, nv).iter().enumerate() {
            let pos = prompt.len() + i;
            let a = gpu.eval(&[t], pos, Want::Last).unwrap().to_vec();
            let b = cpu.eval(&[t], pos, Want::Last).unwrap().to_vec();
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{preset} {ty}: decode step {i} differs"
            );
        }
        eprintln!(
            "{preset} {ty}: GPU parity mode == CPU, {} prompt logits and 6 decode steps",
            a.len()
        );
    }
}

/// The scratch a step needs is allocated at load (`Backend::reserve_workspace`): prompt steps,
/// graph-captured decode steps, top-k and argmax reads, with and without the tensor cores,
/// grow nothing afterwards (the workspace counter covers activations and scratch).
#[test]
#[ignore = "needs a CUDA GPU"]
fn steps_allocate_no_scratch_after_load() {
    let f = model();
    for numerics in [Numerics::BatchInvariant, Numerics::Fast] {
        let config = CudaConfig::from_env(numerics);
        let opts = RunnerOptions {
            kv: Default::default(),
            n_ctx: 1024,
            n_batch: 256,
            max_logits: 8,
        };
        let mut r = ModelRunner::new(CudaBackend::new(0, config).unwrap(), &f, &opts).unwrap();
        let at_load = r.backend.mem_stats().workspace;
        assert!(at_load > 0, "nothing reserved");
        let nv = r.n_vocab() as u32;
        let prompt = common::ids(300, 5, nv);
        r.eval(&prompt, 0, Want::From(296)).unwrap();
        let mut sampler = quiver_engine::Sampler::new(SamplerParams {
            temperature: 0.7,
            top_k: 40,
            ..Default::default()
        });
        let mut t = r.eval_argmax(&[prompt[0]], 300).unwrap();
        for p in 301..340 {
            t = r.eval_pick(&[t], p, &mut sampler, &[]).unwrap();
        }
        assert_eq!(
            r.backend.mem_stats().workspace,
            at_load,
            "numerics {numerics}: a step grew the scratch"
        );
    }
}

/// Constrained decoding on the GPU: the masks applied on the device (greedy under a regular
/// expression, top-k sampling under a JSON schema) give the same tokens alone, together, and
/// masked on the host (requests with log-probabilities); the text follows the grammar. The
/// synthetic model has no vocabulary: a made-up one (tests/common/constrained.rs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn constrained_requests_on_the_gpu_agree_alone_together_and_on_the_host() {
    let f = model();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let words = constrained::made_up_vocabulary(49152);
    let g = quiver_engine::constraint::Grammars::from_words(&words, vec![0], 0, None).unwrap();
    let so = ServeOptions {
        kv: Default::default(),
        spec: Default::default(),
        n_ctx: 256,
        max_seqs: 8,
        kv_blocks: 128,
        max_batch_tokens: 128,
        max_waiting: 16,
    };
    let h =
        quiver_engine::start_serving(batch_invariant, f.clone(), tok, so, "synth".into()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| common::ids(5 + 7 * i, 300 + i as u64, 49152))
        .collect();
    constrained::agree(&h, &g, &prompts, |ids| constrained::spell(&words, ids));
}
