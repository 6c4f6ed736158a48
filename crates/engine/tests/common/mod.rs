//! What several engine test binaries share.

use quiver_engine::serve::{EngineHandle, Event, Request};
use quiver_engine::SamplerParams;
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// A generation request for `prompt` with `sampling`, no stop strings, log-probabilities,
/// constraint or embedding, that ignores end-of-text (it always takes `max_tokens`).
#[allow(dead_code)] // not every test binary serves
pub fn request(prompt: &[u32], sampling: SamplerParams, max_tokens: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling,
        max_tokens,
        stop: vec![],
        logprobs: None,
        prompt_logprobs: None,
        ignore_eos: true,
        constraint: None,
        embed: None,
        cache_salt: None,
        speculative: Default::default(),
    }
}

/// The generated tokens of `reqs`, submitted together to the engine `h` (an engine error
/// fails the test).
#[allow(dead_code)] // not every test binary serves
pub fn answers(h: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| {
            let (tx, rx) = std::sync::mpsc::channel();
            h.submit(r.clone(), Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|rx| {
            let mut out = Vec::new();
            for e in rx {
                match e {
                    Event::Token { id, .. } => out.push(id),
                    Event::Finished { .. } => return out,
                    Event::Error(e) => panic!("engine error: {e}"),
                    _ => {}
                }
            }
            panic!("no Finished event")
        })
        .collect()
}

/// `n` token ids below `vocab`, drawn by xorshift from `seed`.
#[allow(dead_code)] // not every test binary makes prompts
pub fn ids(n: usize, seed: u64, vocab: u32) -> Vec<u32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// The real SmolLM2 test model (scripts/test fetches it).
#[allow(dead_code)] // not every test binary opens it
pub fn smollm2() -> Arc<GgufFile> {
    let p = quiver_hub::alias_path("smollm2-135m");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        p.display()
    );
    Arc::new(GgufFile::open(&p).unwrap())
}

/// A CPU runner over a test model fetched by alias (scripts/test fetches them), with the
/// numerics of the single-sequence commands (`Numerics::Fast`: the GEMM path for prompts).
#[allow(dead_code)] // not every test binary loads a model by alias
pub fn cpu_runner(
    alias: &str,
    opts: &quiver_engine::RunnerOptions,
) -> quiver_engine::ModelRunner<quiver_backend_cpu::CpuBackend> {
    use quiver_backend_cpu::{CpuBackend, CpuConfig, Numerics};
    let p = quiver_hub::alias_path(alias);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        p.display()
    );
    let f = Arc::new(GgufFile::open(&p).unwrap());
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let config = CpuConfig {
        threads,
        numerics: Numerics::Fast,
    };
    quiver_engine::ModelRunner::new(CpuBackend::with_config(config), &f, opts).unwrap()
}

/// `preset` written F32 with `seed` once per test process (`name` tells the variants apart),
/// renamed into place whole: tests running at once each write their own copy first.
#[allow(dead_code)] // not every test binary writes models
pub fn synth_f32(preset: &quiver_synth::Preset, seed: u64, name: &str) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-synth-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-{seed}.gguf"));
    if !path.is_file() {
        let ft = quiver_synth::file_type("F32").unwrap();
        let tmp = path.with_extension(format!("{:?}.tmp", std::thread::current().id()));
        quiver_synth::write(preset, ft, seed, &tmp, 2, |_, _| {}).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    Arc::new(GgufFile::open(&path).unwrap())
}

/// The serving engine on 2 CPU threads over `target` with `spec` and `kv_blocks` blocks: a
/// context of 256, 8 sequences, steps of 128 tokens. Err: the load's one-line error.
#[allow(dead_code)] // not every test binary serves with speculation
pub fn serve_cpu(
    target: Arc<GgufFile>,
    spec: quiver_engine::spec::SpecConfig,
    kv_blocks: usize,
) -> Result<EngineHandle, String> {
    let opts = quiver_engine::serve::ServeOptions {
        kv: Default::default(),
        spec,
        n_ctx: 256,
        max_seqs: 8,
        kv_blocks,
        max_batch_tokens: 128,
        max_waiting: 64,
    };
    let tok = quiver_tokenizer::Tokenizer::from_gguf(&target).unwrap();
    let cpu = || quiver_backend_cpu::CpuBackend::new(2);
    quiver_engine::start_serving(cpu, target, tok, opts, "t".into()).map_err(|e| e.to_string())
}

/// A draft head's parity fixture (`tools/parity/make_eagle3_fixtures.sh`,
/// `make_mtp_fixtures.sh`): the model's preset, type, seed and sha256 (and its target's, for a
/// head of its own file), a token sequence, the drafted positions, and llama.cpp's best
/// [id, log-probability] pairs of every row.
#[allow(dead_code)] // not every test binary reads them
pub struct HeadFixture {
    pub name: String,
    pub preset: String,
    pub ty: String,
    pub seed: u64,
    pub sha256: String,
    pub target_sha256: Option<String>,
    pub tokens: Vec<u32>,
    pub draft: usize,
    pub top: Vec<Vec<(u32, f64)>>,
}

/// The `count` fixtures of `tests/fixtures/{sub}`, by name (relative to the repository where
/// the binary runs elsewhere: the GPU machine).
#[allow(dead_code)] // not every test binary reads them
pub fn head_fixtures(sub: &str, count: usize) -> Vec<HeadFixture> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(sub);
    let dir = match dir.is_dir() {
        true => dir,
        false => std::path::PathBuf::from("crates/engine/tests/fixtures").join(sub),
    };
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    names.sort();
    assert_eq!(names.len(), count, "fixtures in {}", dir.display());
    names
        .iter()
        .map(|p| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            let s = |k: &str| v[k].as_str().unwrap().to_string();
            let ids = |x: &serde_json::Value| x.as_u64().unwrap() as u32;
            HeadFixture {
                name: p.file_stem().unwrap().to_string_lossy().into(),
                preset: s("preset"),
                ty: s("type"),
                seed: v["seed"].as_u64().unwrap(),
                sha256: s("sha256"),
                target_sha256: v["target_sha256"].as_str().map(String::from),
                tokens: v["tokens"].as_array().unwrap().iter().map(ids).collect(),
                draft: v["draft"].as_u64().unwrap() as usize,
                top: v["top"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|row| {
                        let row = row.as_array().unwrap();
                        row.iter()
                            .map(|p| (ids(&p[0]), p[1].as_f64().unwrap()))
                            .collect()
                    })
                    .collect(),
            }
        })
        .collect()
}

/// log-softmax of a logits row in f64 (llama.cpp's harnesses print the same).
#[allow(dead_code)] // not every test binary reads logits
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// The CPU's bound on |Δ log-probability| against a fixture of llama.cpp's AVX-512 build, for a
/// model whose weights are `ty`: 0.02 for F32 files, 0.05 for Q8_0 ones (most give llama.cpp's
/// bits). One token's F32 products take ggml's AVX-512 `vec_dot_f32` order at every SIMD level
/// (cpu-kernels driver/float.rs), so the bound holds on any CPU.
#[allow(dead_code)] // not every test binary compares with llama.cpp
pub fn cpu_bound(ty: &str) -> f64 {
    if ty == "F32" {
        0.02
    } else {
        0.05
    }
}
