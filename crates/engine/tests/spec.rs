//! Speculative decoding (prompt lookup) on the real SmolLM2 model with the CPU backend's
//! batch-invariant numerics: the tokens are those of plain decoding, greedy and seeded
//! sampling, alone and with concurrent requests, while prompts that quote themselves get
//! proposals accepted; over an f16 cache and over tq4 (whose keys' blocks are encoded again
//! after rejected tokens are written over, and shared by the prefix cache once full).

mod common;

use quiver_backend::{KvType, KvTypes};
use quiver_backend_cpu::CpuBackend;
use quiver_engine::serve::{EngineHandle, Event, ServeOptions};
use quiver_engine::spec::{SpecConfig, SpecType};
use quiver_engine::SamplerParams;
use quiver_tokenizer::Tokenizer;
use std::sync::mpsc;

fn start(spec: SpecConfig, kv: KvTypes) -> EngineHandle {
    let f = common::smollm2();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let opts = ServeOptions {
        kv,
        spec,
        n_ctx: 1024,
        max_seqs: 8,
        kv_blocks: 256,
        max_batch_tokens: 256,
        max_waiting: 64,
    };
    quiver_engine::start_serving(|| CpuBackend::new(2), f, tok, opts, "smollm2".into()).unwrap()
}

fn ngram() -> SpecConfig {
    SpecConfig {
        kind: SpecType::Ngram,
        draft_max: 8,
        max_decoding: 8,
        // By acceptance alone: what these tests count does not depend on the step times.
        timed: false,
        ..Default::default()
    }
}

const PROMPTS: [&str; 4] = [
    // Quotes itself: the continuation repeats what came before.
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one two three four five six seven eight nine ten, one two three four five six seven eight",
    // Does not.
    "The capital of France is",
    "Once upon a time, in a small village,",
];

/// (temperature, seed) of request i: even ones greedy, odd ones sampled with a seed.
fn sampling(i: usize) -> SamplerParams {
    SamplerParams {
        temperature: if i.is_multiple_of(2) { 0.0 } else { 0.8 },
        seed: 11 + i as u64,
        ..Default::default()
    }
}

/// Each prompt's tokens, the requests submitted together or one after another.
fn generate(h: &EngineHandle, together: bool) -> Vec<Vec<u32>> {
    let tok = h.tokenizer();
    let submit = |i: usize| {
        let p = tok.encode(PROMPTS[i / 2], true, false).unwrap();
        let (tx, rx) = mpsc::channel();
        let req = common::request(&p, sampling(i), 40);
        h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        rx
    };
    let collect = |rx: mpsc::Receiver<Event>| {
        let mut ids = Vec::new();
        for e in rx {
            match e {
                Event::Token { id, .. } => ids.push(id),
                Event::Finished { .. } => return ids,
                Event::Error(e) => panic!("engine error: {e}"),
                _ => {}
            }
        }
        panic!("no Finished event")
    };
    // Each prompt twice: greedy, then sampled.
    let n = PROMPTS.len() * 2;
    if together {
        let rxs: Vec<_> = (0..n).map(submit).collect();
        rxs.into_iter().map(collect).collect()
    } else {
        (0..n).map(|i| collect(submit(i))).collect()
    }
}

#[test]
fn prompt_lookup_gives_the_tokens_of_plain_decoding() {
    lookup_is_plain_decoding(KvTypes::default());
}

#[test]
fn prompt_lookup_over_tq4_gives_the_tokens_of_plain_decoding() {
    lookup_is_plain_decoding(KvTypes {
        k: KvType::Tq4,
        v: KvType::Tq4,
    });
}

fn lookup_is_plain_decoding(kv: KvTypes) {
    let plain = start(SpecConfig::default(), kv);
    let want = generate(&plain, false);
    assert_eq!(plain.stats().spec_proposed_tokens_total, 0);
    plain.shutdown(std::time::Duration::from_secs(5));

    let spec = start(ngram(), kv);
    let alone = generate(&spec, false);
    let st = spec.stats();
    let together = generate(&spec, true);
    let st2 = spec.stats();
    spec.shutdown(std::time::Duration::from_secs(5));
    for (i, w) in want.iter().enumerate() {
        assert_eq!(w.len(), 40);
        assert_eq!(&alone[i], w, "{kv}: request {i} alone");
        assert_eq!(&together[i], w, "{kv}: request {i} with the others");
    }
    // Proposals were made and some accepted, alone and together.
    let (p1, a1) = (st.spec_proposed_tokens_total, st.spec_accepted_tokens_total);
    let (p2, a2) = (
        st2.spec_proposed_tokens_total - p1,
        st2.spec_accepted_tokens_total - a1,
    );
    eprintln!("{kv}: alone: {a1}/{p1} accepted; together: {a2}/{p2}");
    assert!(a1 > 20 && a1 <= p1, "alone: {a1}/{p1}");
    assert!(a2 > 20 && a2 <= p2, "together: {a2}/{p2}");
}
