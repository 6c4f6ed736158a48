//! A model over tensor-parallel CPU ranks (`ModelRunner::with_ranks`): a prompt in steps of a
//! few tokens and greedy decoding give the whole model's logits (within the reordered o/down
//! sums' rounding) and its tokens; the serving loop over the ranks gives each request what it
//! gets alone; what the ranks do not run is refused in one line.

mod common;

use quiver_backend::{Comm, KvType, KvTypes, LocalComm};
use quiver_backend_cpu::CpuBackend;
use quiver_engine::serve::{EngineHandle, ServeOptions};
use quiver_engine::{ModelRunner, RunnerOptions, Sampler, SamplerParams, Session, Want};
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// tiny-llama with heads, KV heads and FFN width that 2 ranks divide, F32 (the sums' order is
/// the only difference from the whole model).
fn model(tag: &str) -> Arc<GgufFile> {
    let p = quiver_synth::Preset {
        n_head: 8,
        n_head_kv: 4,
        n_ff: 1024,
        ..quiver_synth::preset("tiny-llama").unwrap().clone()
    };
    synth(&p, 11, tag)
}

/// `p`'s F32 file of random weights (`seed`), opened (the file itself removed).
fn synth(p: &quiver_synth::Preset, seed: u64, tag: &str) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-tp-session-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.gguf"));
    let ft = quiver_synth::file_type("F32").unwrap();
    quiver_synth::write(p, ft, seed, &path, 1, |_, _| {}).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    f
}

fn ranks(n: usize) -> Vec<CpuBackend> {
    LocalComm::group(n)
        .into_iter()
        .map(|c| {
            let c: Arc<dyn Comm> = Arc::new(c);
            CpuBackend::new(1).with_comm(c)
        })
        .collect()
}

fn opts(n_batch: usize) -> RunnerOptions {
    RunnerOptions {
        n_ctx: 64,
        n_batch,
        max_logits: n_batch,
        kv: KvTypes::default(),
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn two_ranks_give_the_whole_models_logits_and_tokens() {
    let f = model("logits");
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 505, 3, 77, 250, 8];
    let mut whole = ModelRunner::new(CpuBackend::new(1), &f, &opts(64)).unwrap();
    let want = whole.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
    // Steps of 3 tokens: 4 steps, every row's logits.
    let mut tp = ModelRunner::with_ranks(ranks(2), &f, &opts(3)).unwrap();
    assert_eq!(tp.ranks(), 2);
    let got = tp.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
    assert_eq!(got.len(), want.len(), "a row of logits per prompt token");
    let e = rel_l2(&got, &want);
    assert!(e < 1e-3, "logits off the whole model's by {e}");
    // A wrong position shows: the prompt shifted by one gives other logits.
    let mut shifted = ModelRunner::with_ranks(ranks(2), &f, &opts(3)).unwrap();
    let off = shifted.eval(&prompt[1..], 0, Want::Last).unwrap().to_vec();
    assert!(rel_l2(&off, &want[want.len() - off.len()..]) > 1e-2);
    // Greedy decoding: the same tokens as the whole model, by argmax and by a greedy sampler.
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let (mut a, mut b) = (*prompt.last().unwrap(), *prompt.last().unwrap());
    for i in 0..8 {
        let pos = prompt.len() - 1 + i;
        a = whole.eval_argmax(&[a], pos).unwrap();
        b = if i % 2 == 0 {
            tp.eval_argmax(&[b], pos).unwrap()
        } else {
            tp.eval_pick(&[b], pos, &mut sampler, &prompt).unwrap()
        };
        assert_eq!(a, b, "token {i} of greedy decoding");
    }
}

#[test]
fn ranks_keep_a_quantized_kv_cache_as_the_whole_model_does() {
    let f = model("kv");
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 505, 3, 77, 250, 8, 61, 140];
    let with = |kv: KvTypes| RunnerOptions { kv, ..opts(4) };
    let f16 = ModelRunner::with_ranks(ranks(2), &f, &opts(4))
        .unwrap()
        .eval(&prompt, 0, Want::From(0))
        .unwrap()
        .to_vec();
    for t in [KvType::Q8_0, KvType::Tq8, KvType::Tq4] {
        let kv = KvTypes { k: t, v: t };
        let mut whole = ModelRunner::new(CpuBackend::new(1), &f, &with(kv)).unwrap();
        let want = whole.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
        let mut tp = ModelRunner::with_ranks(ranks(2), &f, &with(kv)).unwrap();
        let got = tp.eval(&prompt, 0, Want::From(0)).unwrap().to_vec();
        // Each rank codes its own KV heads as the whole model codes them: only the o and
        // down sums' order differs, and a key's last bit can move one of its codes by a step
        // (tq4's 4-bit codes: 0.006 of 0.24 on an AVX2 CPU, 2026-12-07). The ranks lie within
        // 5% of the distance between the type's logits and f16's (Q8_0 0.0002 of 0.02).
        let (e, codec) = (rel_l2(&got, &want), rel_l2(&want, &f16));
        assert!(
            e < 0.05 * codec,
            "{t:?}: logits off the whole model's by {e} (the type's from f16's: {codec})"
        );
        // And the cache is the type's: not f16's logits.
        assert!(
            rel_l2(&got, &f16) > 1e-6,
            "{t:?}: the same logits as an f16 cache"
        );
    }
}

#[test]
fn ranks_verify_proposals_as_the_whole_model_does() {
    let f = model("verify");
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 505, 3, 77];
    let mut whole = ModelRunner::new(CpuBackend::new(1), &f, &opts(8)).unwrap();
    let mut tp = ModelRunner::with_ranks(ranks(2), &f, &opts(8)).unwrap();
    assert_eq!(tp.max_verify(), 8);
    whole.eval(&prompt[..7], 0, Want::Last).unwrap();
    tp.eval(&prompt[..7], 0, Want::Last).unwrap();
    // The whole model's own greedy continuation as the proposal: every token accepted, and
    // the token after them.
    let mut cont = vec![prompt[7]];
    for i in 0..5 {
        let t = whole.eval_argmax(&[*cont.last().unwrap()], 7 + i).unwrap();
        cont.push(t);
    }
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let mut picks = Vec::new();
    tp.eval_verify(&cont[..5], 7, &mut sampler, &prompt, &mut picks)
        .unwrap();
    assert_eq!(
        picks,
        cont[1..6].to_vec(),
        "all four proposals and the next token"
    );
    // A wrong second proposal: the first accepted, then the model's own token.
    let mut wrong = cont[..5].to_vec();
    wrong[2] = wrong[2].wrapping_add(1) % 512;
    tp.eval_verify(&wrong, 7, &mut sampler, &prompt, &mut picks)
        .unwrap();
    assert_eq!(picks, cont[1..3].to_vec());
}

#[test]
fn ranks_take_the_rope_factors_of_their_context() {
    // tiny-phi3: LongRoPE's long factors past an original context of 512.
    let f = synth(quiver_synth::preset("tiny-phi3").unwrap(), 5, "phi3");
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 505, 3, 77];
    let at = |n_ctx: usize| RunnerOptions { n_ctx, ..opts(8) };
    let mut long = ModelRunner::new(CpuBackend::new(1), &f, &at(1024)).unwrap();
    let want = long.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    let mut short = ModelRunner::new(CpuBackend::new(1), &f, &at(256)).unwrap();
    let other = short.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    assert!(
        rel_l2(&other, &want) > 1e-3,
        "the factors should matter here"
    );
    let mut tp = ModelRunner::with_ranks(ranks(2), &f, &at(1024)).unwrap();
    let got = tp.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    let e = rel_l2(&got, &want);
    assert!(
        e < 1e-3,
        "logits off the whole model's at its context by {e}"
    );
}

#[test]
fn what_the_ranks_do_not_run_is_refused_in_one_line() {
    let f = model("refusals");
    let mut tp = ModelRunner::with_ranks(ranks(2), &f, &opts(8)).unwrap();
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let errors = [
        tp.eval_verify(&[1; 9], 0, &mut sampler, &[], &mut Vec::new())
            .unwrap_err(),
        tp.batched_bench(8, 8, 4, 64).map(|_| ()).unwrap_err(),
        tp.eval(&[1, 9999], 0, Want::Last).map(|_| ()).unwrap_err(),
        tp.eval(&[1; 65], 0, Want::Last).map(|_| ()).unwrap_err(),
    ]
    .map(|e| e.to_string());
    let says = [&["9", "8"][..], &["--parallel"], &["9999"], &["context"]];
    for (e, says) in errors.iter().zip(says) {
        assert!(says.iter().all(|w| e.contains(w)), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
    // An error ends no rank: the next step runs.
    assert!(tp.eval(&[1, 2, 3], 0, Want::Last).is_ok());
}

/// The serving engine over `ranks` CPU ranks of `f`: a context of 64, 4 sequences, steps of
/// 64 tokens.
fn serve(
    f: &Arc<GgufFile>,
    ranks_n: usize,
    spec: quiver_engine::spec::SpecConfig,
) -> Result<EngineHandle, String> {
    let opts = ServeOptions {
        kv: Default::default(),
        spec,
        n_ctx: 64,
        max_seqs: 4,
        kv_blocks: 16,
        max_batch_tokens: 64,
        max_waiting: 16,
    };
    let tok = quiver_tokenizer::Tokenizer::from_gguf(f).unwrap();
    quiver_engine::start_serving_ranks(move || ranks(ranks_n), f.clone(), tok, opts, "t".into())
        .map_err(|e| e.to_string())
}

#[test]
fn served_requests_over_ranks_get_what_they_get_alone() {
    let f = model("serve");
    let h = serve(&f, 2, Default::default()).unwrap();
    let prompts: [&[u32]; 4] = [
        &[1, 17, 300, 42, 9],
        &[1, 505, 3, 77, 250, 8, 61],
        &[1, 17, 300, 42, 9, 140, 2], // shares its first block's tokens with the first
        &[4, 4, 4],
    ];
    let greedy = SamplerParams::greedy();
    let reqs: Vec<_> = prompts
        .iter()
        .map(|p| common::request(p, greedy.clone(), 8))
        .collect();
    let together = common::answers(&h, &reqs);
    // Each alone on the ranks, one sequence: the same tokens, and the whole model's.
    let mut alone = ModelRunner::with_ranks(ranks(2), &f, &opts(64)).unwrap();
    let mut whole = ModelRunner::new(CpuBackend::new(1), &f, &opts(64)).unwrap();
    for (p, got) in prompts.iter().zip(&together) {
        let mut a = alone.eval_argmax(p, 0).unwrap();
        let mut w = whole.eval_argmax(p, 0).unwrap();
        let (mut want, mut whole_tokens) = (vec![a], vec![w]);
        for i in 0..7 {
            a = alone.eval_argmax(&[a], p.len() + i).unwrap();
            w = whole.eval_argmax(&[w], p.len() + i).unwrap();
            want.push(a);
            whole_tokens.push(w);
        }
        assert_eq!(
            got, &want,
            "prompt {p:?}: served over the ranks, then alone"
        );
        assert_eq!(got, &whole_tokens, "prompt {p:?}: the whole model's");
    }
    // Served again, one at a time: the same tokens.
    for (r, want) in reqs.iter().zip(&together) {
        assert_eq!(&common::answers(&h, std::slice::from_ref(r))[0], want);
    }
    h.shutdown(std::time::Duration::from_secs(5));
    // A draft model would run whole on rank 0: refused in one line. n-gram proposals need
    // none, and are verified on the ranks.
    let spec = |kind, draft| quiver_engine::spec::SpecConfig {
        kind,
        draft_model: draft,
        ..Default::default()
    };
    let mtp = spec(quiver_engine::spec::SpecType::Mtp, None);
    let e = serve(&f, 2, mtp).err().unwrap();
    assert!(
        e.contains("draft model") && e.contains("2 tensor-parallel ranks"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    let ngram = spec(quiver_engine::spec::SpecType::Ngram, None);
    let h = serve(&f, 2, ngram).unwrap();
    assert_eq!(common::answers(&h, &reqs[..2]), together[..2].to_vec());
    h.shutdown(std::time::Duration::from_secs(5));
}

#[test]
fn a_mixture_of_experts_over_ranks_decodes_as_the_whole_model() {
    // tiny-qwen3moe, each rank a share of every expert's width: greedy tokens of the whole.
    let p = quiver_synth::Preset {
        n_head: 8,
        n_head_kv: 4,
        ..quiver_synth::preset("tiny-qwen3moe").unwrap().clone()
    };
    let f = synth(&p, 3, "moe");
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 505, 3];
    let mut whole = ModelRunner::new(CpuBackend::new(1), &f, &opts(8)).unwrap();
    let mut tp = ModelRunner::with_ranks(ranks(2), &f, &opts(8)).unwrap();
    let want = whole.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    let got = tp.eval(&prompt, 0, Want::Last).unwrap().to_vec();
    let e = rel_l2(&got, &want);
    assert!(e < 1e-3, "logits off the whole model's by {e}");
    let (mut a, mut b) = (quiver_engine::argmax(&want), quiver_engine::argmax(&got));
    for i in 0..6 {
        assert_eq!(a, b, "token {i} of greedy decoding");
        a = whole.eval_argmax(&[a], prompt.len() + i).unwrap();
        b = tp.eval_argmax(&[b], prompt.len() + i).unwrap();
    }
}
