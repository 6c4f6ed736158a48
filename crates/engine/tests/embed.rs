//! Embedding requests through the serving engine on the real SmolLM2 (CPU): the pooled final
//! hidden states equal a single-sequence computation of the same tokens bit for bit, whatever
//! runs beside them, however the prompt is chunked, and when the prompt's blocks are in the
//! prefix cache (an embedding computes its whole prompt).

mod common;

use quiver_backend_cpu::CpuBackend;
use quiver_engine::embed::Pooling;
use quiver_engine::serve::{EngineHandle, Event, FinishReason, Request, ServeOptions};
use quiver_engine::{ModelRunner, RunnerOptions, SamplerParams};
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::mpsc;
use std::sync::Arc;

fn file() -> Arc<GgufFile> {
    common::smollm2()
}

fn request(prompt: &[u32], max_tokens: usize, embed: Option<Pooling>) -> Request {
    Request {
        embed,
        ..common::request(prompt, SamplerParams::greedy(), max_tokens)
    }
}

fn submit(h: &EngineHandle, req: Request) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
        .unwrap();
    rx
}

/// The embedding and the finish reason of an embedding request (no tokens on the way).
fn vector(rx: mpsc::Receiver<Event>) -> Vec<f32> {
    let mut v = None;
    for e in rx {
        match e {
            Event::Started { .. } => {}
            Event::Embedding(x) => v = Some(x),
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Stop);
                return v.expect("an embedding before Finished");
            }
            Event::Error(e) => panic!("engine error: {e}"),
            e => panic!("unexpected event {e:?}"),
        }
    }
    panic!("no Finished event");
}

/// Generated token count of a text request.
fn generated(rx: mpsc::Receiver<Event>) -> usize {
    let mut n = 0;
    for e in rx {
        match e {
            Event::Token { .. } => n += 1,
            Event::Embedding(_) => panic!("a text request got an embedding"),
            Event::Finished { .. } => return n,
            Event::Error(e) => panic!("engine error: {e}"),
            _ => {}
        }
    }
    panic!("no Finished event");
}

#[test]
fn served_embeddings_equal_single_sequence_ones() {
    let f = file();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let long: Vec<u32> = tok
        .encode(
            &"The quick brown fox jumps over the lazy dog. ".repeat(40),
            true,
            false,
        )
        .unwrap();
    assert!(long.len() > 300, "{} tokens", long.len());
    let short = tok
        .encode("Embeddings map text to vectors.", true, false)
        .unwrap();
    // Reference: one sequence at a time, in steps of 64 tokens.
    let mut r = ModelRunner::new(
        CpuBackend::new(2),
        &f,
        &RunnerOptions {
            kv: Default::default(),
            n_ctx: 1024,
            n_batch: 64,
            max_logits: 1,
        },
    )
    .unwrap();
    let pools = [Pooling::Mean, Pooling::Cls, Pooling::Last];
    let want: Vec<Vec<Vec<f32>>> = [&long, &short]
        .iter()
        .map(|p| pools.iter().map(|&m| r.embed(p, m).unwrap()).collect())
        .collect();
    for w in want.iter().flatten() {
        let norm: f32 = w.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
        assert_eq!(w.len(), 576);
    }
    assert_ne!(want[0][0], want[0][2], "mean and last pooling agree");
    assert_ne!(want[0][0], want[1][0], "two texts, one embedding");

    let h = quiver_engine::start_serving(
        || CpuBackend::new(2),
        f.clone(),
        tok,
        ServeOptions {
            kv: Default::default(),
            spec: Default::default(),
            n_ctx: 1024,
            max_seqs: 8,
            kv_blocks: 256,
            max_batch_tokens: 256,
            max_waiting: 64,
        },
        "smollm2".into(),
    )
    .unwrap();
    // The long prompt's blocks go into the prefix cache first.
    assert_eq!(generated(submit(&h, request(&long, 4, None))), 4);
    // Text generations beside the embeddings, which are cut into chunks of the step budget.
    let text: Vec<_> = (0..2)
        .map(|i| submit(&h, request(&short[..short.len() - i], 24, None)))
        .collect();
    let got: Vec<Vec<_>> = [&long, &short]
        .iter()
        .map(|p| {
            pools
                .iter()
                .map(|&m| submit(&h, request(p, 0, Some(m))))
                .collect()
        })
        .collect();
    for (i, rxs) in got.into_iter().enumerate() {
        for (j, rx) in rxs.into_iter().enumerate() {
            assert_eq!(vector(rx), want[i][j], "input {i}, pooling {:?}", pools[j]);
        }
    }
    for rx in text {
        assert_eq!(generated(rx), 24);
    }
    let st = h.stats();
    assert_eq!((st.running, st.waiting, st.kv_blocks_used), (0, 0, 0));
    h.shutdown(std::time::Duration::from_secs(1));
}
