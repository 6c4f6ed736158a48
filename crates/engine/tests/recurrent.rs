//! A model with recurrent state (Qwen 3.5's gated delta net, on llama.cpp's own `qwen35` test
//! model of `tests/reference/llama-archs/`, and `quiver synth`'s `tiny-qwen35moe`) under the
//! serving engine: each request holds its
//! own state slot, so requests served together get exactly the tokens they get alone; a
//! prompt seen before is computed again (no prefix reuse: `cached_tokens` 0) to the same
//! tokens; a preempted request is computed again from its first token and loses nothing.
//! The same for DeepSeek-V4 (`deepseek4`), whose compressed KV is per-sequence state too
//! (llama.cpp's test model at σ 0.3, where the compressed rows and the indexer move the
//! tokens).

mod common;
#[path = "llama_archs/rng.rs"]
mod rng;

use quiver_backend_cpu::CpuBackend;
use quiver_engine::serve::{EngineHandle, Event, ServeOptions};
use quiver_engine::spec::{SpecConfig, SpecType};
use quiver_engine::{ModelRunner, RunnerOptions, SamplerParams, Want};
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;

const FIXTURE: &str = "qwen35-dense-s1";
const DSV4: &str = "deepseek4-moe-d0.3-k4-s1";

/// The fixture's model (its stored head, the weights drawn again, the linear-attention
/// output scaled up), its `test` tokenizer
/// renamed `none` (same length) so that the engine has a tokenizer of ids only.
fn file() -> Arc<GgufFile> {
    fixture(FIXTURE)
}

/// A fixture's model, as [`file`] makes it.
fn fixture(name: &str) -> Arc<GgufFile> {
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/reference/llama-archs"
    ));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let size = v["size"].as_u64().unwrap() as usize;
    let seed = v["seed"].as_u64().unwrap();
    let stdev = v["stdev"].as_f64().unwrap() as f32;
    let mut bytes = std::fs::read(dir.join(format!("{name}.head"))).unwrap();
    bytes.resize(size, 0);
    let tmp = std::env::temp_dir().join(format!("quiver-recurrent-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    // One file per call: the tests run in parallel, and a mapped file is never rewritten.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = tmp.join(format!("{name}-{k}.gguf"));
    std::fs::write(&path, &bytes).unwrap();
    let skeleton = GgufFile::open(&path).unwrap();
    for t in &skeleton.tensors {
        let at = (skeleton.data_offset + t.offset) as usize;
        let mut vals = rng::tensor_values(&t.name, seed, stdev, t.n_elements as usize);
        // At llama.cpp's σ the linear-attention layer's output is too small to move the
        // tokens; its gated norm's weight scaled up makes the recurrent state decide them
        // (this test compares quiver with itself, not with llama.cpp).
        if t.name.contains("ssm_norm") || t.name.contains("ssm_out") {
            vals.iter_mut().for_each(|v| *v *= 20.0);
        }
        bytes[at..at + t.n_bytes as usize]
            .chunks_exact_mut(4)
            .zip(&vals)
            .for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes()));
    }
    drop(skeleton);
    let key = b"tokenizer.ggml.model";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("tokenizer key")
        + key.len()
        + 4
        + 8;
    assert_eq!(&bytes[at..at + 4], b"test");
    bytes[at..at + 4].copy_from_slice(b"none");
    std::fs::write(&path, &bytes).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    // The mapping stays; the file need not outlive the test.
    let _ = std::fs::remove_file(&path);
    f
}

/// `quiver synth --preset tiny-qwen35moe` (F32): experts beside a shared expert, two
/// delta-net layers.
fn synth_moe() -> Arc<GgufFile> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!("quiver-recurrent-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join(format!("tiny-qwen35moe-{k}.gguf"));
    let p = quiver_synth::preset("tiny-qwen35moe").unwrap();
    let ft = quiver_synth::file_type("F32").unwrap();
    quiver_synth::write(p, ft, 7, &path, 2, |_, _| {}).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    f
}

fn prompts() -> Vec<Vec<u32>> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    [21usize, 37, 5, 50, 16, 33]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 128) as u32
                })
                .collect()
        })
        .collect()
}

const GEN: usize = 12;

/// log-softmax at `id`: the engine's own (`quiver_engine::logprobs`), so that an exact
/// comparison with served tokens compares the logits, not two roundings of one value.
fn logprob(row: &[f32], id: u32) -> f32 {
    quiver_engine::logprobs(row, id, 0).0
}

/// Greedy tokens of each prompt alone, on the single-sequence runner, with their
/// log-probabilities.
fn solo(f: &Arc<GgufFile>, ps: &[Vec<u32>]) -> Vec<Vec<(u32, f32)>> {
    solo_n(f, ps, GEN)
}

/// [`solo`], `n` tokens each.
fn solo_n(f: &Arc<GgufFile>, ps: &[Vec<u32>], n: usize) -> Vec<Vec<(u32, f32)>> {
    let mut r = ModelRunner::new(
        CpuBackend::new(2),
        f,
        &RunnerOptions {
            kv: Default::default(),
            n_ctx: 256,
            n_batch: 16,
            max_logits: 1,
        },
    )
    .unwrap();
    ps.iter()
        .map(|p| {
            let mut out = Vec::new();
            let pick = |row: &[f32]| {
                let t = quiver_engine::argmax(row);
                (t, logprob(row, t))
            };
            // The prompt in steps of at most 16 tokens (the state carried between them).
            let mut pos = 0;
            let mut last = (0, 0.0);
            for chunk in p.chunks(16) {
                last = pick(r.eval(chunk, pos, Want::Last).unwrap());
                pos += chunk.len();
            }
            out.push(last);
            while out.len() < n {
                last = pick(r.eval(&[last.0], pos, Want::Last).unwrap());
                pos += 1;
                out.push(last);
            }
            out
        })
        .collect()
}

fn start(f: &Arc<GgufFile>, kv_blocks: usize, max_seqs: usize) -> EngineHandle {
    start_with(f, kv_blocks, max_seqs, Default::default())
}

fn start_with(
    f: &Arc<GgufFile>,
    kv_blocks: usize,
    max_seqs: usize,
    spec: SpecConfig,
) -> EngineHandle {
    let tok = Tokenizer::from_gguf(f).unwrap();
    let opts = ServeOptions {
        kv: Default::default(),
        spec,
        n_ctx: 256,
        max_seqs,
        kv_blocks,
        max_batch_tokens: 24,
        max_waiting: 64,
    };
    quiver_engine::start_serving(|| CpuBackend::new(2), f.clone(), tok, opts, "qwen35".into())
        .unwrap()
}

fn submit(h: &EngineHandle, p: &[u32]) -> mpsc::Receiver<Event> {
    submit_n(h, p, GEN)
}

fn submit_n(h: &EngineHandle, p: &[u32], n: usize) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    let greedy = SamplerParams {
        temperature: 0.0,
        ..Default::default()
    };
    let mut req = common::request(p, greedy, n);
    req.logprobs = Some(0);
    h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
        .unwrap();
    rx
}

/// ((token id, log-probability) of each token, cached tokens)
fn collect(rx: mpsc::Receiver<Event>) -> (Vec<(u32, f32)>, usize) {
    let (mut ids, mut cached) = (Vec::new(), 0);
    for e in rx {
        match e {
            Event::Started { cached_tokens, .. } => cached = cached_tokens,
            Event::Token { id, logprob, .. } => ids.push((id, logprob.unwrap().logprob)),
            Event::Finished { .. } => return (ids, cached),
            Event::Error(e) => panic!("engine error: {e}"),
            _ => {}
        }
    }
    panic!("no Finished event");
}

/// The same tokens, each log-probability within 1e-4 of the solo run's (the state of another
/// sequence leaking in would move them far more), or where `exact` the same bits (deepseek4:
/// batch invariant in the default numerics).
fn same(got: &[(u32, f32)], want: &[(u32, f32)], i: usize, exact: bool) {
    let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "request {i}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.1 - w.1).abs() < 1e-4 && (!exact || g.1.to_bits() == w.1.to_bits()),
            "request {i} token {k}: log-probability {} alone {}",
            g.1,
            w.1
        );
    }
}

#[test]
fn served_together_equals_alone() {
    served_together_equals_alone_on(&file(), false);
}

#[test]
fn deepseek4_served_together_equals_alone() {
    served_together_equals_alone_on(&fixture(DSV4), true);
}

#[test]
fn deepseek4_preempted_requests_lose_nothing() {
    preempted_requests_lose_nothing_on(&fixture(DSV4), true);
}

fn served_together_equals_alone_on(f: &Arc<GgufFile>, exact: bool) {
    let f = f.clone();
    let ps = prompts();
    let want = solo(&f, &ps);
    // Room for every request at once (4 state slots, 6 requests: two wait for a slot).
    let h = start(&f, 64, 4);
    let rxs: Vec<_> = ps.iter().map(|p| submit(&h, p)).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, _) = collect(rx);
        same(&got, &want[i], i, exact);
    }
    // The same prompts again: computed whole (no prefix reuse), the same tokens.
    let rxs: Vec<_> = ps.iter().map(|p| submit(&h, p)).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, cached) = collect(rx);
        assert_eq!(cached, 0, "request {i}: a recurrent model reuses no prefix");
        same(&got, &want[i], i, exact);
    }
}

/// `f`'s requests served together in 6 blocks of 16 tokens (requests of up to 62 tokens each:
/// the newest are preempted and computed again from their first token) give their tokens alone.
fn preempted_requests_lose_nothing_on(f: &Arc<GgufFile>, exact: bool) {
    let ps = prompts();
    let want = solo(f, &ps);
    let h = start(f, 6, 4);
    let rxs: Vec<_> = ps.iter().map(|p| submit(&h, p)).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, _) = collect(rx);
        same(&got, &want[i], i, exact);
    }
}

#[test]
fn moe_served_together_equals_alone_under_preemption() {
    preempted_requests_lose_nothing_on(&synth_moe(), false);
}

#[test]
fn preempted_requests_lose_nothing() {
    preempted_requests_lose_nothing_on(&file(), false);
}

/// Prompt lookup on a model with per-sequence state: rejected proposals roll each sequence's
/// state back to the state after its accepted ones (`State::keep_states`: the delta net's
/// states, DeepSeek-V4's ring rows), so the tokens are plain decoding's (DeepSeek-V4's
/// log-probabilities bit for bit), served together (4 state slots, 6 requests) and under
/// preemption (6 blocks), while proposals are rejected (and on the dense Qwen 3.5 model, which
/// repeats itself, accepted).
#[test]
fn proposals_roll_the_recurrent_state_back() {
    const N: usize = 40;
    let spec = SpecConfig {
        kind: SpecType::Ngram,
        draft_max: 4,
        max_decoding: 8,
        ngram_min: 1,
        // By acceptance alone: what these tests count does not depend on the step times.
        timed: false,
        ..Default::default()
    };
    let models = [
        (file(), true, false),
        (synth_moe(), false, false),
        (fixture(DSV4), false, true),
    ];
    for (f, accepts, exact) in models {
        let ps = prompts();
        let want = solo_n(&f, &ps, N);
        for kv_blocks in [64, 6] {
            let h = start_with(&f, kv_blocks, 4, spec.clone());
            let rxs: Vec<_> = ps.iter().map(|p| submit_n(&h, p, N)).collect();
            for (i, rx) in rxs.into_iter().enumerate() {
                let (got, _) = collect(rx);
                same(&got, &want[i], i, exact);
            }
            let st = h.stats();
            let (p, a) = (st.spec_proposed_tokens_total, st.spec_accepted_tokens_total);
            eprintln!("{} blocks: {a}/{p} proposed tokens accepted", kv_blocks);
            assert!(
                a < p && (a > 0 || !accepts),
                "{kv_blocks} blocks: {a}/{p} accepted"
            );
            h.shutdown(std::time::Duration::from_secs(5));
        }
    }
}

/// The single-sequence runner's verification: a proposal rejected after its first token
/// leaves the state after the accepted one, and decoding goes on from there with the logits
/// of plain decoding, bit for bit; without kept states a step carries no proposal.
#[test]
fn the_runner_rolls_a_rejected_proposal_back() {
    for f in [file(), fixture(DSV4)] {
        runner_rolls_back(&f);
    }
}

fn runner_rolls_back(f: &Arc<GgufFile>) {
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 256,
        n_batch: 16,
        max_logits: 8,
    };
    let p = &prompts()[1];
    let mut plain = ModelRunner::new(CpuBackend::new(2), f, &opts).unwrap();
    let mut t = vec![quiver_engine::argmax(plain.eval(p, 0, Want::Last).unwrap())];
    let mut rows = Vec::new();
    for k in 0..5 {
        let row = plain
            .eval(&[t[k]], p.len() + k, Want::Last)
            .unwrap()
            .to_vec();
        t.push(quiver_engine::argmax(&row));
        rows.push(row);
    }
    let mut r = ModelRunner::new(CpuBackend::new(2), f, &opts).unwrap();
    use quiver_engine::Session;
    assert_eq!(r.max_verify(), 1, "no kept states: no room for a proposal");
    assert_eq!(r.keep_states(4, 1).unwrap(), 4);
    assert_eq!(r.max_verify(), 5);
    r.eval(p, 0, Want::Last).unwrap();
    // t0, then t1 (right) and two wrong tokens.
    let wrong = |x: u32| (x + 1) % 128;
    let mut s = quiver_engine::Sampler::new(SamplerParams::greedy());
    let mut picks = Vec::new();
    let verify = [t[0], t[1], wrong(t[2]), wrong(t[3])];
    r.eval_verify(&verify, p.len(), &mut s, p, &mut picks)
        .unwrap();
    assert_eq!(picks, vec![t[1], t[2]]);
    // On from the position after t1: t2, t3 and t4 all accepted (their rows plain decoding's:
    // the picks), then the sequence returned to the position after t3 (as a stop string
    // inside the accepted tokens would), and t4's row computed again is plain decoding's.
    let mut h = p.clone();
    h.extend_from_slice(&t[..2]);
    r.eval_verify(&[t[2], t[3], t[4]], p.len() + 2, &mut s, &h, &mut picks)
        .unwrap();
    assert_eq!(picks, vec![t[3], t[4], t[5]]);
    r.rewind(p.len() + 4).unwrap();
    let row = r.eval(&[t[4]], p.len() + 4, Want::Last).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(row), bits(&rows[4]), "the row after the rollback");
    // Back past the last verification's rows: refused in one line.
    let e = r.rewind(p.len() + 1).unwrap_err().to_string();
    assert!(e.contains("continues at position"), "{e}");
}

/// The single-sequence runner continues a recurrent state only where it ended (or from 0):
/// evaluating again from an earlier position is refused with one line, not answered wrong.
#[test]
fn the_runner_refuses_to_rewind_a_recurrent_state() {
    for f in [file(), fixture(DSV4)] {
        refuses_to_rewind(&f);
    }
}

fn refuses_to_rewind(f: &Arc<GgufFile>) {
    let f = f.clone();
    let mut r = ModelRunner::new(CpuBackend::new(2), &f, &RunnerOptions::default()).unwrap();
    r.eval(&[1, 2, 3, 4, 5], 0, Want::Last).unwrap();
    r.eval(&[6], 5, Want::Last).unwrap();
    let e = r.eval(&[7], 3, Want::Last).unwrap_err().to_string();
    assert!(e.contains("continues at position 6"), "{e}");
    // From 0 again: a fresh state.
    r.eval(&[1, 2], 0, Want::Last).unwrap();
}

/// A draft model must roll its state back past a rejected proposal: one with recurrent layers
/// is refused in one line, a transformer draft is not.
#[test]
fn a_recurrent_draft_is_refused() {
    for f in [file(), fixture(DSV4)] {
        let e = quiver_engine::draft::check_rollback(&f).unwrap_err();
        assert!(e.contains("recurrent layers") && !e.contains('\n'), "{e}");
    }
    let dir = std::env::temp_dir().join(format!("quiver-rollback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-llama.gguf");
    let p = quiver_synth::preset("tiny-llama").unwrap();
    quiver_synth::write(
        p,
        quiver_synth::file_type("F32").unwrap(),
        7,
        &path,
        2,
        |_, _| {},
    )
    .unwrap();
    let llama = GgufFile::open(&path).unwrap();
    quiver_engine::draft::check_rollback(&llama).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A deepseek4 file with one multi-token-prediction block (a copy of block 0 as block 4,
/// `nextn.*` tensors of zeros): the trunk leaves the block out (its logits are the file's
/// without it, bit for bit), and the block loads as a draft head (`mtp::load`).
#[test]
fn deepseek4_loads_its_multi_token_prediction_block() {
    use quiver_gguf::{Array, GgmlType, GgufWriter, Value};
    let src = fixture(DSV4);
    let mut w = GgufWriter::new();
    w.metadata = src.metadata.clone();
    let k = |s: &str| format!("deepseek4.{s}");
    w.set(k("block_count"), Value::U32(5));
    w.set(k("nextn_predict_layers"), Value::U32(1));
    w.set(
        k("attention.compress_ratios"),
        Value::Array(Array::U32(vec![0, 0, 4, 128, 0])),
    );
    for key in ["swiglu_clamp_exp", "swiglu_clamp_shexp"] {
        w.set(k(key), Value::Array(Array::F32(vec![10.0; 5])));
    }
    // (name, shape, source tensor or zeros)
    let mut parts: Vec<(String, Vec<u64>, Option<usize>)> = Vec::new();
    for (i, t) in src.tensors.iter().enumerate() {
        parts.push((t.name.clone(), t.shape.clone(), Some(i)));
        if let Some(rest) = t.name.strip_prefix("blk.0.") {
            parts.push((format!("blk.4.{rest}"), t.shape.clone(), Some(i)));
        }
    }
    let d = 512u64;
    for (name, shape) in [
        ("eh_proj", vec![d, 2 * d]),
        ("enorm", vec![d]),
        ("hnorm", vec![d]),
    ] {
        parts.push((format!("blk.4.nextn.{name}.weight"), shape, None));
    }
    for (name, shape, _) in &parts {
        w.add_tensor(name.clone(), GgmlType::F32, shape);
    }
    let path = std::env::temp_dir().join(format!("quiver-recurrent-{}", std::process::id()));
    let path = path.join("deepseek4-mtp.gguf");
    w.write_file(&path, |i, info, buf| {
        match parts[i].2 {
            Some(j) => buf.extend_from_slice(src.tensor_data(&src.tensors[j])),
            None => buf.resize(buf.len() + info.n_bytes as usize, 0),
        }
        Ok(())
    })
    .unwrap();
    let with = Arc::new(GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 256,
        n_batch: 16,
        max_logits: 1,
    };
    let mut a = ModelRunner::new(CpuBackend::new(2), &src, &opts).unwrap();
    let mut b = ModelRunner::new(CpuBackend::new(2), &with, &opts).unwrap();
    let ds = b.model.hp.dsv4.as_ref().unwrap();
    assert_eq!((b.model.hp.n_layer, ds.nextn), (4, 1));
    assert_eq!(quiver_models::mtp::blocks(&with), 1);
    let head = quiver_models::mtp::load(&CpuBackend::new(2), &with).unwrap();
    assert_eq!(head.hp.n_layer, 1);
    assert_eq!(head.hp.dsv4.as_ref().unwrap().ratios, [0]);
    let p = &prompts()[1];
    let want = a.eval(p, 0, Want::Last).unwrap().to_vec();
    assert_eq!(b.eval(p, 0, Want::Last).unwrap(), &want[..]);
}

/// In the default numerics (batch invariant) a deepseek4 prompt's logits are the same bits
/// whether it runs in one step, in steps of 5 tokens, or token by token.
#[test]
fn deepseek4_prompts_are_batch_invariant() {
    let f = fixture(DSV4);
    let p = &prompts()[3];
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 256,
        n_batch: 64,
        max_logits: 64,
    };
    let mut r = ModelRunner::new(CpuBackend::new(2), &f, &opts).unwrap();
    let whole = r.eval(p, 0, Want::From(0)).unwrap().to_vec();
    let nv = r.n_vocab();
    for step in [5, 1] {
        let mut rows = Vec::new();
        for (i, chunk) in p.chunks(step).enumerate() {
            rows.extend_from_slice(r.eval(chunk, i * step, Want::From(0)).unwrap());
        }
        assert_eq!(rows.len(), p.len() * nv);
        let differ = rows
            .iter()
            .zip(&whole)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "steps of {step}: {differ} logits differ from one step's"
        );
    }
}
