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
