//! Speculative decoding with an EAGLE-3 head (`--spec-type eagle3 -md HEAD`) in the serving
//! engine on the CPU, on tiny synthetic models written at test time (tiny-llama and heads of
//! random weights over it): the tokens are those of plain decoding, greedy and seeded, alone,
//! together and under preemption (the head's states kept by request and position, its KV in
//! the target's blocks); a head that does not fit the target, or the wrong `--spec-type`, is
//! refused at load in one line. tests/eagle3.rs checks the head's numbers against llama.cpp.

mod common;

use quiver_engine::serve::{EngineHandle, Request};
use quiver_engine::spec::{DraftFile, SpecConfig, SpecType};
use quiver_engine::SamplerParams;
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// `preset` (a tiny one, or tiny-llama with `embd` columns) written with `seed`, F32.
fn synth(preset: &str, seed: u64, embd: Option<u64>) -> Arc<GgufFile> {
    let base = quiver_synth::preset(preset).unwrap().clone();
    let p = match embd {
        Some(d) => quiver_synth::Preset {
            n_embd: d,
            n_head: d / 64,
            n_head_kv: 1,
            ..base
        },
        None => base,
    };
    common::synth_f32(&p, seed, &format!("{preset}-{embd:?}"))
}

fn eagle(kind: SpecType, head: Arc<GgufFile>, draft_max: usize) -> SpecConfig {
    SpecConfig {
        kind,
        draft_max,
        max_decoding: 8,
        draft_model: Some(DraftFile(head)),
        // By acceptance alone: what these tests count does not depend on the step times.
        timed: false,
        ..Default::default()
    }
}

/// Eight requests: prompts of 3 to 66 tokens (longer than a step of 128 together: prompts in
/// chunks), the even ones greedy, the odd ones sampled with their own seed, 32 tokens each.
fn requests() -> Vec<Request> {
    (0..8)
        .map(|i| {
            let sampling = match i % 2 {
                0 => SamplerParams::greedy(),
                _ => SamplerParams {
                    temperature: 0.9,
                    seed: 40 + i as u64,
                    ..Default::default()
                },
            };
            common::request(&common::ids(3 + 9 * i, 7 + i as u64, 512), sampling, 32)
        })
        .collect()
}

fn answers_alone(h: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| common::answers(h, std::slice::from_ref(r)).remove(0))
        .collect()
}

#[test]
fn an_eagle3_head_changes_no_token_alone_together_or_under_preemption() {
    let target = synth("tiny-llama", 7, None);
    let reqs = requests();
    let plain = common::serve_cpu(target.clone(), SpecConfig::default(), 256).unwrap();
    let want = answers_alone(&plain, &reqs);
    plain.shutdown(std::time::Duration::from_secs(5));
    // 24 blocks of 16 cannot hold eight requests of up to 98 tokens: preemptions, the head's
    // states and KV recomputed with the target's. With at most 2 requests decoding in a step
    // that proposes, the eight together leave the head idle (no states kept, none caught up).
    for (preset, blocks, max_decoding) in [
        ("tiny-eagle3", 256, 8),
        ("tiny-eagle3-norms", 24, 8),
        ("tiny-eagle3", 256, 2),
    ] {
        let head = synth(preset, 8, None);
        let spec = SpecConfig {
            max_decoding,
            ..eagle(SpecType::Eagle3, head, 4)
        };
        let h = common::serve_cpu(target.clone(), spec, blocks).unwrap();
        let alone = answers_alone(&h, &reqs);
        let together = common::answers(&h, &reqs);
        let st = h.stats();
        h.shutdown(std::time::Duration::from_secs(5));
        for (i, w) in want.iter().enumerate() {
            assert_eq!(w.len(), 32);
            assert_eq!(&alone[i], w, "{preset}: request {i} alone");
            assert_eq!(&together[i], w, "{preset}: request {i} with the others");
        }
        let (p, a) = (st.spec_proposed_tokens_total, st.spec_accepted_tokens_total);
        eprintln!(
            "{preset}: {a}/{p} accepted, {} preemptions",
            st.preemptions_total
        );
        assert!(p > 0, "{preset}: nothing proposed");
        assert!(
            a < p,
            "{preset}: a head of random weights had {a}/{p} accepted"
        );
        assert_eq!(st.kv_blocks_used, 0, "{preset}: blocks left behind");
        if blocks < 256 {
            assert!(st.preemptions_total > 0, "no preemption");
        }
    }
}

/// A prompt of 200 tokens, longer than a step (128): its states reach the head over two steps
/// (each part written to the head's KV once 64 rows wait, before the request proposes), then
/// it drafts; the tokens are plain decoding's.
#[test]
fn a_prompt_longer_than_a_step_is_caught_up_in_parts() {
    let target = synth("tiny-llama", 7, None);
    let req = common::request(&common::ids(200, 3, 512), SamplerParams::greedy(), 40);
    let plain = common::serve_cpu(target.clone(), SpecConfig::default(), 256).unwrap();
    let want = common::answers(&plain, std::slice::from_ref(&req));
    plain.shutdown(std::time::Duration::from_secs(5));
    let head = synth("tiny-eagle3", 8, None);
    let h = common::serve_cpu(target, eagle(SpecType::Eagle3, head, 4), 256).unwrap();
    let got = common::answers(&h, std::slice::from_ref(&req));
    let st = h.stats();
    h.shutdown(std::time::Duration::from_secs(5));
    assert_eq!(got, want);
    assert!(st.spec_proposed_tokens_total > 0, "nothing proposed");
}

#[test]
fn a_head_that_does_not_fit_its_target_or_type_is_refused_at_load() {
    let target = synth("tiny-llama", 7, None);
    let head = synth("tiny-eagle3", 8, None);
    let refused = |spec: SpecConfig, target: &Arc<GgufFile>| {
        let e = common::serve_cpu(target.clone(), spec, 256)
            .err()
            .expect("loaded");
        assert!(!e.contains('\n'), "{e}");
        e
    };
    // The head named as a plain draft model, and a draft model named as a head.
    let e = refused(eagle(SpecType::Draft, head.clone(), 4), &target);
    assert!(e.contains("EAGLE-3") && e.contains("eagle3"), "{e}");
    let e = refused(eagle(SpecType::Eagle3, target.clone(), 4), &target);
    assert!(e.contains("EAGLE-3"), "{e}");
    // A target of another width (the head's fc reads 3 × 256 columns).
    let narrow = synth("tiny-llama", 7, Some(128));
    let e = refused(eagle(SpecType::Eagle3, head, 4), &narrow);
    assert!(e.contains("256") && e.contains("128"), "{e}");
    // eagle3 without a head.
    let spec = SpecConfig {
        kind: SpecType::Eagle3,
        timed: false,
        ..Default::default()
    };
    let e = refused(spec, &target);
    assert!(e.contains("-md"), "{e}");
}
