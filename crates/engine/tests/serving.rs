//! The serving engine on the real SmolLM2 model: continuous batching gives every request
//! exactly what it gets alone (the CPU kernels are batch invariant by default), prefix caching reuses blocks, preemption under a small KV pool
//! loses nothing, aborts free blocks.

mod common;
#[path = "common/constrained.rs"]
mod constrained;

use quiver_backend_cpu::CpuBackend;
use quiver_engine::serve::{EngineHandle, Event, FinishReason, Request, ServeOptions};
use quiver_engine::{generate, GenOptions, ModelRunner, RunnerOptions, Sampler, SamplerParams};
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::mpsc;
use std::sync::Arc;

fn file() -> Arc<GgufFile> {
    common::smollm2()
}

fn start(kv_blocks: usize, max_seqs: usize) -> EngineHandle {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let opts = ServeOptions {
        kv: Default::default(),
        spec: Default::default(),
        n_ctx: 1024,
        max_seqs,
        kv_blocks,
        max_batch_tokens: 256,
        max_waiting: 64,
    };
    quiver_engine::start_serving(|| CpuBackend::new(2), f, tok, opts, "smollm2".into()).unwrap()
}

/// Submits and collects (token ids, text, finish reason, cached tokens).
fn submit(h: &EngineHandle, req: Request) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
        .unwrap();
    rx
}

fn collect(rx: mpsc::Receiver<Event>) -> (Vec<u32>, String, FinishReason, usize) {
    let (mut ids, mut text, mut cached) = (Vec::new(), String::new(), 0);
    for e in rx {
        match e {
            Event::Started { cached_tokens, .. } => cached = cached_tokens,
            Event::PromptLogprobs(_) => panic!("no prompt logprobs were asked for"),
            Event::Embedding(_) => panic!("no embedding was asked for"),
            Event::Token { id, text: t, .. } => {
                ids.push(id);
                text.push_str(&t);
            }
            Event::Finished { reason, .. } => return (ids, text, reason, cached),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
    panic!("no Finished event");
}

fn request(prompt: &[u32], max_tokens: usize, temperature: f32, seed: u64) -> Request {
    let sampling = SamplerParams {
        temperature,
        seed,
        ..Default::default()
    };
    common::request(prompt, sampling, max_tokens)
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "1, 2, 3, 4,",
        "Rust is a systems programming language that",
    ]
    .iter()
    .map(|p| tok.encode(p, true, false).unwrap())
    .collect()
}

#[test]
fn batched_requests_equal_solo_runs_and_blocks_come_back() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let ps = prompts(&tok);
    // Alone, on the single-sequence runner.
    let mut r = ModelRunner::new(
        CpuBackend::new(2),
        &f,
        &RunnerOptions {
            kv: Default::default(),
            n_ctx: 256,
            n_batch: 256,
            max_logits: 1,
        },
    )
    .unwrap();
    let solo: Vec<Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let temp = if i.is_multiple_of(2) { 0.0 } else { 0.9 };
            let mut s = Sampler::new(SamplerParams {
                temperature: temp,
                seed: i as u64,
                ..Default::default()
            });
            generate(
                &mut r,
                &tok,
                p,
                0,
                &mut s,
                &GenOptions {
                    max_tokens: 12,
                    ignore_eos: true,
                    ..Default::default()
                },
                |_| true,
            )
            .unwrap()
            .tokens
        })
        .collect();
    // Together, on the serving engine.
    let h = start(256, 8);
    let rxs: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            submit(
                &h,
                request(p, 12, if i.is_multiple_of(2) { 0.0 } else { 0.9 }, i as u64),
            )
        })
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (ids, _, reason, _) = collect(rx);
        assert_eq!(reason, FinishReason::Length);
        // Greedy requests must match token for token; sampled ones share the seed and logits
        // up to rounding, so they match too unless a draw lands on a rounding edge.
        if i.is_multiple_of(2) {
            assert_eq!(ids, solo[i], "request {i} differs from its solo run");
        }
        assert_eq!(ids.len(), 12);
    }
    let st = h.stats();
    assert_eq!(
        (st.running, st.waiting, st.kv_blocks_used),
        (0, 0, 0),
        "{st:?}"
    );
    assert!(st.generated_tokens_total >= 72);
    h.shutdown(std::time::Duration::from_secs(1));
}

#[test]
fn prefix_cache_preemption_stop_and_abort() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    // A long shared system prompt: the second request reuses its full blocks.
    let system = "You are a careful assistant. ".repeat(12);
    let p1 = tok
        .encode(&format!("{system}Question: what is 2+2?"), true, false)
        .unwrap();
    let p2 = tok
        .encode(&format!("{system}Question: name a color."), true, false)
        .unwrap();
    let h = start(64, 4);
    let (a, _, _, c1) = collect(submit(&h, request(&p1, 4, 0.0, 0)));
    let (_, _, _, c2) = collect(submit(&h, request(&p2, 4, 0.0, 0)));
    assert_eq!(c1, 0);
    assert!(c2 >= 64 && c2 < p2.len(), "cached {c2} of {}", p2.len());
    // The same prompt again: all full blocks but the last token's are reused, same output.
    let (a2, _, _, c3) = collect(submit(&h, request(&p1, 4, 0.0, 0)));
    assert_eq!(a, a2);
    assert!(c3 >= c2);

    // Preemption: 8 requests of up to 80 tokens each need far more than 64 blocks × 16 at
    // once... with 64 blocks (1024 slots) and 8 × (prompt + 100) tokens, the pool runs out.
    let ps = prompts(&tok);
    let solo: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| collect(submit(&h, request(p, 100, 0.0, 0))).0)
        .collect();
    let small = start(24, 6);
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| submit(&small, request(p, 100, 0.0, 0)))
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        assert_eq!(
            collect(rx).0,
            solo[i],
            "request {i} changed under preemption"
        );
    }
    let st = small.stats();
    assert!(
        st.preemptions_total > 0,
        "the small pool never preempted: {st:?}"
    );
    assert_eq!(st.kv_blocks_used, 0);

    // Stop strings end the text before the stop string.
    let mut req = request(&ps[4], 40, 0.0, 0);
    req.stop = vec![" 7".into()];
    let (_, text, reason, _) = collect(submit(&h, req));
    assert_eq!(reason, FinishReason::Stop);
    assert!(!text.contains(" 7") && text.contains("6"), "{text:?}");

    // A receiver that goes away aborts the request and frees its blocks.
    let (tx, rx) = mpsc::channel();
    let mut n = 0;
    h.submit(
        request(&ps[0], 500, 0.0, 0),
        Box::new(move |e| {
            n += 1;
            n < 5 && tx.send(e).is_ok()
        }),
    )
    .unwrap();
    drop(rx);
    for _ in 0..100 {
        if h.stats().running == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let st = h.stats();
    assert_eq!((st.running, st.kv_blocks_used), (0, 0), "{st:?}");
    h.shutdown(std::time::Duration::from_secs(1));
    small.shutdown(std::time::Duration::from_secs(1));
}

/// The gauges a client reads when it hears of its request are already that step's: running
/// and blocks in use when it starts, nothing in use once it finished.
#[test]
fn gauges_are_current_when_events_arrive() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let h = start(64, 4);
    let p = tok.encode("The capital of France is", true, false).unwrap();
    let (tx, rx) = mpsc::channel();
    let h2 = h.clone();
    h.submit(
        request(&p, 3, 0.0, 0),
        Box::new(move |e| tx.send((e, h2.stats())).is_ok()),
    )
    .unwrap();
    let mut seen = 0;
    for (e, st) in rx {
        match e {
            Event::PromptLogprobs(_) => panic!("no prompt logprobs were asked for"),
            Event::Embedding(_) => panic!("no embedding was asked for"),
            Event::Started { .. } => {
                assert_eq!((st.running, st.waiting), (1, 0), "{st:?}");
                assert!(st.kv_blocks_used > 0, "{st:?}");
                assert_eq!(st.prompt_tokens_total, p.len() as u64);
                seen += 1;
            }
            Event::Token { .. } => assert_eq!(st.running, 1, "{st:?}"),
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!((st.running, st.kv_blocks_used), (0, 0), "{st:?}");
                assert_eq!(st.generated_tokens_total, 3, "{st:?}");
                seen += 1;
                break;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(seen, 2);
}

/// Constrained decoding on the real vocabulary: alone, together and masked on the host, the
/// same tokens, and the text follows the grammar (tests/common/constrained.rs).
#[test]
fn constrained_requests_agree_alone_together_and_masked_on_the_host() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let g = quiver_engine::constraint::Grammars::new(&tok).unwrap();
    let h = start(256, 8);
    constrained::agree(&h, &g, &prompts(&tok), |ids| tok.decode(ids, true));
}

/// The same on a synthetic model with a made-up vocabulary, as the GPU test runs it.
#[test]
fn constrained_requests_agree_on_a_made_up_vocabulary() {
    let dir = std::env::temp_dir().join(format!("quiver-constrained-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let p = quiver_synth::preset("smollm2-135m").unwrap();
    let ft = quiver_synth::file_type("Q4_1").unwrap();
    quiver_synth::write(p, ft, 7, &path, 2, |_, _| {}).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let words = constrained::made_up_vocabulary(49152);
    let g = quiver_engine::constraint::Grammars::from_words(&words, vec![0], 0, None).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let opts = ServeOptions {
        kv: Default::default(),
        spec: Default::default(),
        n_ctx: 256,
        max_seqs: 8,
        kv_blocks: 64,
        max_batch_tokens: 128,
        max_waiting: 16,
    };
    let h =
        quiver_engine::start_serving(|| CpuBackend::new(2), f, tok, opts, "synth".into()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|i| (1..6 + 3 * i).collect()).collect();
    constrained::agree(&h, &g, &prompts, |ids| constrained::spell(&words, ids));
    std::fs::remove_dir_all(&dir).ok();
}

/// A shutdown grace of any length (`Duration::MAX` included) is a far deadline, never an
/// overflow (it panicked adding the grace to the clock); a second shutdown brings it closer
/// and aborts what still runs.
#[test]
fn shutdown_takes_any_grace_and_a_second_call_shortens_it() {
    use std::time::Duration;
    let h = start(64, 2);
    let p = h
        .tokenizer()
        .encode("Once upon a time", true, false)
        .unwrap();
    let rx = submit(&h, request(&p, 900, 0.0, 0));
    assert!(matches!(rx.recv().unwrap(), Event::Started { .. }));
    let first = h.clone();
    let t = std::thread::spawn(move || first.shutdown(Duration::MAX));
    std::thread::sleep(Duration::from_millis(200));
    h.shutdown(Duration::ZERO);
    t.join().expect("shutdown with Duration::MAX returns");
    let (ids, _, reason, _) = collect(rx);
    assert_eq!(reason, FinishReason::Abort);
    assert!(ids.len() < 900);
    // On an idle engine it returns at once.
    let idle = start(64, 2);
    let t0 = std::time::Instant::now();
    idle.shutdown(Duration::MAX);
    assert!(t0.elapsed() < Duration::from_secs(5));
}
