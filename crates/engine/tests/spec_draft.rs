//! Speculative decoding with a draft model (`-md`) on the CPU, on tiny synthetic models written
//! at test time: the tokens are those of plain decoding, greedy and seeded, alone, together and
//! under preemption; the target as its own draft has its greedy proposals accepted, a draft of
//! random weights (same vocabulary) few; a draft of another vocabulary is refused at load.
//! tests/gpu.rs has the same comparison on the GPU.

mod common;

use quiver_backend_cpu::CpuBackend;
use quiver_engine::serve::{EngineHandle, Event, Request};
use quiver_engine::spec::{DraftFile, SpecConfig, SpecType};
use quiver_engine::SamplerParams;
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::{mpsc, Arc};

/// A tiny-llama-shaped model (vocabulary `n_vocab`) with weights from `seed`.
fn synth(n_vocab: u64, seed: u64) -> Arc<GgufFile> {
    let p = quiver_synth::Preset {
        n_vocab,
        ..quiver_synth::preset("tiny-llama").unwrap().clone()
    };
    common::synth_f32(&p, seed, &format!("tiny-{n_vocab}"))
}

fn draft(file: Arc<GgufFile>, draft_max: usize) -> SpecConfig {
    SpecConfig {
        kind: SpecType::Draft,
        draft_max,
        max_decoding: 8,
        draft_model: Some(DraftFile(file)),
        // By acceptance alone: what these tests count does not depend on the step times.
        timed: false,
        ..Default::default()
    }
}

/// Eight requests: prompts of 3 to 66 tokens, the even ones greedy, the odd ones sampled at
/// temperature 0.9 with their own seed, 32 tokens each.
fn requests() -> Vec<Request> {
    (0..8)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                SamplerParams::greedy()
            } else {
                SamplerParams {
                    temperature: 0.9,
                    seed: 40 + i as u64,
                    ..Default::default()
                }
            };
            common::request(&common::ids(3 + 9 * i, 7 + i as u64, 512), sampling, 32)
        })
        .collect()
}

/// Each request alone, then all together.
fn alone_and_together(h: &EngineHandle, reqs: &[Request]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let alone = reqs
        .iter()
        .map(|r| common::answers(h, std::slice::from_ref(r)).remove(0))
        .collect();
    (alone, common::answers(h, reqs))
}

/// (proposed, accepted) since `before`.
fn spec_delta(h: &EngineHandle, before: (u64, u64)) -> (u64, u64) {
    let st = h.stats();
    (
        st.spec_proposed_tokens_total - before.0,
        st.spec_accepted_tokens_total - before.1,
    )
}

fn plain_answers(target: &Arc<GgufFile>, reqs: &[Request]) -> Vec<Vec<u32>> {
    let plain = common::serve_cpu(target.clone(), SpecConfig::default(), 256).unwrap();
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| common::answers(&plain, std::slice::from_ref(r)).remove(0))
        .collect();
    plain.shutdown(std::time::Duration::from_secs(5));
    want
}

#[test]
fn the_target_as_its_own_draft_gives_plain_tokens_and_its_greedy_proposals_are_accepted() {
    let target = synth(512, 7);
    let reqs = requests();
    let want = plain_answers(&target, &reqs);
    let h = common::serve_cpu(target.clone(), draft(target.clone(), 6), 256).unwrap();
    // Greedy requests alone: every proposal is the target's own argmax.
    let greedy: Vec<Request> = reqs.iter().step_by(2).cloned().collect();
    let g = common::answers(&h, &greedy[..1]);
    let (p, a) = spec_delta(&h, (0, 0));
    assert_eq!(g[0], want[0]);
    eprintln!("greedy alone: {a}/{p} accepted");
    assert!(p >= 20 && a * 10 >= p * 9, "greedy alone: {a}/{p} accepted");
    let before = spec_delta(&h, (0, 0));
    let (alone, together) = alone_and_together(&h, &reqs);
    let (p, a) = spec_delta(&h, before);
    h.shutdown(std::time::Duration::from_secs(5));
    for (i, w) in want.iter().enumerate() {
        assert_eq!(w.len(), 32);
        assert_eq!(&alone[i], w, "request {i} alone");
        assert_eq!(&together[i], w, "request {i} with the others");
    }
    eprintln!("all: {a}/{p} accepted");
    assert!(a > p / 2, "{a}/{p} accepted");
}

#[test]
fn a_random_draft_is_rarely_accepted_and_changes_no_token_even_under_preemption() {
    let target = synth(512, 7);
    let other = synth(512, 99);
    let reqs = requests();
    let want = plain_answers(&target, &reqs);
    // 24 blocks of 16 cannot hold eight requests of up to 98 tokens: preemptions, and the
    // draft's KV recomputed with the target's.
    let h = common::serve_cpu(target.clone(), draft(other, 4), 24).unwrap();
    let (alone, together) = alone_and_together(&h, &reqs);
    let st = h.stats();
    h.shutdown(std::time::Duration::from_secs(5));
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&alone[i], w, "request {i} alone");
        assert_eq!(&together[i], w, "request {i} with the others");
    }
    let (p, a) = (st.spec_proposed_tokens_total, st.spec_accepted_tokens_total);
    eprintln!(
        "random draft: {a}/{p} accepted, {} preemptions",
        st.preemptions_total
    );
    assert!(p > 0 && a * 4 < p, "{a}/{p} accepted");
    assert!(st.preemptions_total > 0, "no preemption");
    assert_eq!(st.kv_blocks_used, 0, "blocks left behind");
}

#[test]
fn draft_p_min_stops_proposals_and_per_request_limits_apply() {
    let target = synth(512, 7);
    let reqs = requests();
    let want = plain_answers(&target, &reqs[..2]);
    // p_min 1: no draft token is that sure (the probabilities of a softmax over 512 logits).
    let spec = SpecConfig {
        p_min: 1.0,
        ..draft(target.clone(), 6)
    };
    let h = common::serve_cpu(target.clone(), spec, 256).unwrap();
    assert_eq!(common::answers(&h, &reqs[..2]), want);
    assert_eq!(spec_delta(&h, (0, 0)), (0, 0));
    // A request's own p_min 0 and n_max 2: proposals of at most 2 tokens.
    let mut r = reqs[0].clone();
    r.speculative.p_min = Some(0.0);
    r.speculative.n_max = Some(2);
    let steps0 = h.stats().steps_total;
    assert_eq!(common::answers(&h, std::slice::from_ref(&r))[0], want[0]);
    let st = h.stats();
    h.shutdown(std::time::Duration::from_secs(5));
    let (p, a) = (st.spec_proposed_tokens_total, st.spec_accepted_tokens_total);
    let steps = st.steps_total - steps0;
    assert!(p > 0 && a > 0, "{a}/{p}");
    assert!(p <= 2 * steps, "{p} proposed in {steps} steps");
    // The greedy draft that is the target: its proposals accepted, so fewer steps than tokens.
    assert!(steps < 31, "{steps} steps for 32 tokens");
}

#[test]
fn a_draft_of_another_vocabulary_is_refused_at_load() {
    let target = synth(512, 7);
    let e = common::serve_cpu(target.clone(), draft(synth(1024, 7), 4), 256)
        .err()
        .expect("a draft of 1024 tokens for a target of 512 loaded");
    assert!(e.contains("not the same vocabulary"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // -md without --spec-type draft, and draft without -md, are refused too.
    let spec = SpecConfig {
        kind: SpecType::Draft,
        ..Default::default()
    };
    let e = common::serve_cpu(target.clone(), spec, 256).err().unwrap();
    assert!(e.contains("-md"), "{e}");
}

/// `quiver run`'s path (one sequence, `generate_spec`): with prompt lookup, the target as its
/// own draft and a random draft, the tokens of plain `generate`, greedy and seeded; a chat's
/// second turn (KV reused, the speculator kept) too.
#[test]
fn single_sequence_speculation_gives_the_tokens_of_plain_generation() {
    use quiver_engine::{generate, generate_spec, GenOptions, ModelRunner, RunnerOptions};
    use quiver_engine::{Sampler, Session, Speculator};
    let target = synth(512, 7);
    let other = synth(512, 99);
    let tok = Tokenizer::from_gguf(&target).unwrap();
    let runner = |f: &Arc<GgufFile>, max_logits| {
        let opts = RunnerOptions {
            n_ctx: 256,
            n_batch: 64,
            max_logits,
            kv: Default::default(),
        };
        ModelRunner::new(CpuBackend::new(2), f, &opts).unwrap()
    };
    let opts = GenOptions {
        max_tokens: 40,
        ..Default::default()
    };
    // A prompt that repeats itself (prompt lookup finds it), then a second turn.
    let first: Vec<u32> = common::ids(12, 5, 512).repeat(3);
    let second = common::ids(9, 6, 512);
    let sampling = |i: u64| {
        if i == 0 {
            SamplerParams::greedy()
        } else {
            SamplerParams {
                temperature: 0.9,
                seed: i,
                ..Default::default()
            }
        }
    };
    // Two turns: the second's prompt after the first's prompt and answer (its K/V kept).
    let two_turns = |r: &mut ModelRunner<CpuBackend>,
                     mut s: Option<&mut Speculator>,
                     i: u64|
     -> Vec<Vec<u32>> {
        let mut sampler = Sampler::new(sampling(i));
        let g1 = generate_spec(
            r,
            s.as_deref_mut(),
            &tok,
            &first,
            0,
            &mut sampler,
            &opts,
            |_| true,
        )
        .unwrap();
        let start = first.len() + g1.kv_tokens;
        let g2 = generate_spec(r, s, &tok, &second, start, &mut sampler, &opts, |_| true).unwrap();
        vec![g1.tokens, g2.tokens]
    };
    for i in [0u64, 3, 4] {
        let mut plain = runner(&target, 1);
        let want = two_turns(&mut plain, None, i);
        // `generate` is `generate_spec` without a speculator.
        let mut sampler = Sampler::new(sampling(i));
        let g = generate(&mut plain, &tok, &first, 0, &mut sampler, &opts, |_| true).unwrap();
        assert_eq!(g.tokens, want[0]);
        for (label, kind, draft) in [
            ("ngram", SpecType::Ngram, None),
            ("self draft", SpecType::Draft, Some(&target)),
            ("random draft", SpecType::Draft, Some(&other)),
        ] {
            let mut r = runner(&target, 7);
            let mut d = draft.map(|f| runner(f, 1));
            let cfg = SpecConfig {
                kind,
                draft_max: 6,
                ngram_min: 1,
                timed: false,
                ..Default::default()
            };
            let mut s = Speculator::new(cfg, d.as_mut().map(|d| d as &mut dyn Session));
            let got = two_turns(&mut r, Some(&mut s), i);
            assert_eq!(got, want, "{label}, sampling {i}");
            eprintln!(
                "{label}, sampling {i}: {}/{} accepted",
                s.accepted, s.proposed
            );
            assert!(s.proposed > 0, "{label}: nothing proposed");
            if label == "self draft" && i == 0 {
                assert_eq!(
                    s.accepted, s.proposed,
                    "{label}: a greedy proposal rejected"
                );
            }
            if label == "random draft" {
                assert!(
                    s.accepted * 4 < s.proposed,
                    "{label}: {}/{}",
                    s.accepted,
                    s.proposed
                );
            }
        }
    }
}

/// Log-probabilities of tokens accepted from a proposal are those plain decoding gives them
/// (each verified row's logits are its own position's), and a request with prompt
/// log-probabilities (never speculated) runs beside speculating ones unchanged.
#[test]
fn log_probabilities_of_accepted_tokens_are_plain_decodings() {
    let target = synth(512, 7);
    let mut reqs = requests();
    for r in reqs.iter_mut().take(4) {
        r.logprobs = Some(2);
    }
    reqs[4].prompt_logprobs = Some(1);
    let run = |spec: SpecConfig| {
        let h = common::serve_cpu(target.clone(), spec, 256).unwrap();
        let rxs: Vec<_> = reqs
            .iter()
            .map(|r| {
                let (tx, rx) = mpsc::channel();
                h.submit(r.clone(), Box::new(move |e| tx.send(e).is_ok()))
                    .unwrap();
                rx
            })
            .collect();
        let out: Vec<Vec<String>> = rxs
            .into_iter()
            .map(|rx| {
                let mut got = Vec::new();
                for e in rx {
                    match e {
                        Event::Token { id, logprob, .. } => got.push(format!("{id} {logprob:?}")),
                        Event::PromptLogprobs(lp) => got.push(format!("{lp:?}")),
                        Event::Finished { .. } => break,
                        Event::Error(e) => panic!("{e}"),
                        _ => {}
                    }
                }
                got
            })
            .collect();
        let st = h.stats();
        h.shutdown(std::time::Duration::from_secs(5));
        (out, st.spec_accepted_tokens_total)
    };
    let (want, _) = run(SpecConfig::default());
    let (got, accepted) = run(draft(target.clone(), 6));
    assert!(accepted > 20, "{accepted} accepted");
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[i], w, "request {i}");
    }
}
