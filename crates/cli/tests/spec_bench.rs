//! `quiver bench --spec … -f FILE` on SmolLM2 (tools/gpu/spec.sh's measurements, on the CPU):
//! the prompt is the file's text as llama.cpp's `-f` reads it; plain decode is one token a
//! step; prompt lookup on a text that repeats itself is accepted; a random draft of the
//! model's vocabulary (`synth --vocab-from`) is a valid draft that is rarely right, the model
//! as its own draft always.

use serde_json::Value;
use std::process::{Command, Output};

fn quiver(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(args)
        .output()
        .expect("quiver runs")
}

fn ok(out: &Output) -> &Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn one_line_error(out: &Output, code: i32, says: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    assert!(err.contains(says), "{err}");
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-spec-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// `quiver synth`: a random Q4_0 model of SmolLM2's shape with the tokenizer of `vocab` at `out`.
fn synth_draft(out: &str, vocab: &str, more: &[&str]) -> Output {
    let synth = [
        "synth",
        "--preset",
        "smollm2-135m",
        "--type",
        "Q4_0",
        "-o",
        out,
    ];
    quiver(&[&synth[..], &["--vocab-from", vocab], more].concat())
}

/// [`synth_draft`], which must succeed.
fn random_draft(out: &str, vocab: &str, more: &[&str]) {
    ok(&synth_draft(out, vocab, more));
}

/// `quiver chat` over two turns (greedy, `n` tokens each) with `spec`'s flags: its stdout.
fn chat_two_turns(m: &str, n: &str, spec: &[&str]) -> Vec<u8> {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args([&["chat", "-m", m, "-n", n, "--temp", "0"][..], spec].concat())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let mut stdin = c.stdin.take().unwrap();
    stdin
        .write_all(b"Count from one to ten.\nNow backwards.\n")
        .unwrap();
    drop(stdin);
    ok(&c.wait_with_output().unwrap()).stdout.clone()
}

/// The bench's rows: (spec, row) for the plain and the speculative run (proposals by
/// acceptance alone, `--spec-timing off`: the counts do not depend on this machine's speed).
fn bench(m: &str, file: &str, spec: &[&str], n: &str) -> Vec<Value> {
    let base = [
        "bench",
        "-m",
        m,
        "--device",
        "cpu",
        "-f",
        file,
        "-n",
        n,
        "--spec-timing",
        "off",
    ];
    let out = quiver(&[&base[..], &["-r", "1", "--json"], spec].concat());
    let j: Value = serde_json::from_slice(&ok(&out).stdout).unwrap();
    j["results"].as_array().unwrap().clone()
}

#[test]
fn bench_measures_speculation_on_a_prompt_file() {
    let m = quiver_hub::alias_path("smollm2-135m");
    assert!(m.is_file(), "{}: run scripts/test", m.display());
    let m = m.to_str().unwrap();
    // A list that quotes itself, in the ChatML turn spec.sh writes for SmolLM2.
    let lines: String = (1..=12)
        .map(|i| format!("- item {i}: check the valve, then log the pressure.\n"))
        .collect();
    let text = format!(
        "<|im_start|>user\nCopy this list exactly.\n\n{lines}<|im_end|>\n<|im_start|>assistant\n- item 1:"
    );
    let f = tmp("prompt.txt");
    std::fs::write(&f, &text).unwrap();
    let f = f.to_str().unwrap();
    // The prompt's tokens are tokenize's with special-token text parsed (llama.cpp's -f).
    let ids: Vec<u32> = serde_json::from_slice(
        &ok(&quiver(&["tokenize", "-m", m, "--parse-special", &text])).stdout,
    )
    .unwrap();

    let rows = bench(m, f, &["--spec", "ngram"], "48");
    assert_eq!(rows.len(), 2);
    let (plain, ngram) = (&rows[0], &rows[1]);
    assert_eq!(plain["spec"], "none");
    assert_eq!(ngram["spec"], "ngram");
    for r in &rows {
        assert_eq!(r["n_prompt"], ids.len(), "{r}");
        assert_eq!(r["prompt_file"], f);
        assert!(r["tokens_per_second"].as_f64().unwrap() > 0.0);
    }
    // Plain decode: no proposals, one token a decode step (the prompt's step not counted).
    assert_eq!(plain["proposed"], 0);
    assert_eq!(plain["tokens_per_step"], 1.0);
    // Prompt lookup on a list that repeats: proposals made and taken, more than a token a step.
    let (p, a) = (
        ngram["proposed"].as_u64().unwrap(),
        ngram["accepted"].as_u64().unwrap(),
    );
    assert!(a > 0 && a <= p, "{ngram}");
    let tps = ngram["tokens_per_step"].as_f64().unwrap();
    assert!(tps > 1.5, "{ngram}");
    // Each decode step gives its accepted proposals and one token more: 47 tokens after the
    // first, in 47 - a steps.
    assert!((tps - 47.0 / (47 - a) as f64).abs() < 1e-9, "{ngram}");

    // A random draft of SmolLM2's vocabulary: accepted by the vocabulary check, rarely right.
    let rnd = tmp("random-draft.gguf");
    let rnd = rnd.to_str().unwrap();
    random_draft(rnd, m, &[]);
    let rows = bench(m, f, &["--spec", "draft", "-md", rnd], "16");
    let (p, a) = (
        rows[1]["proposed"].as_u64().unwrap(),
        rows[1]["accepted"].as_u64().unwrap(),
    );
    assert!(p > 0 && a * 4 < p, "{}", rows[1]);
    // One layer of it (--layers): a valid draft too, of one block.
    let one = tmp("random-draft-1l.gguf");
    let one = one.to_str().unwrap();
    random_draft(one, m, &["--layers", "1"]);
    let info: Value =
        serde_json::from_slice(&ok(&quiver(&["info", one, "--json"])).stdout).unwrap();
    assert_eq!(info["hparams"]["block_count"], 1, "{}", info["hparams"]);
    let rows = bench(m, f, &["--spec", "draft", "-md", one], "8");
    assert!(rows[1]["proposed"].as_u64().unwrap() > 0, "{}", rows[1]);
    // The model as its own draft: every proposal accepted.
    let rows = bench(m, f, &["--spec", "draft", "-md", m], "16");
    let (p, a) = (
        rows[1]["proposed"].as_u64().unwrap(),
        rows[1]["accepted"].as_u64().unwrap(),
    );
    assert!(p > 0 && a == p, "{}", rows[1]);

    // Errors: one line each.
    let g = quiver_hub::alias_path("gemma3-270m");
    let out = synth_draft(rnd, g.to_str().unwrap(), &[]);
    one_line_error(
        &out,
        1,
        "vocabulary has 262144 tokens, preset smollm2-135m's 49152",
    );
    one_line_error(&quiver(&["bench", "-m", m, "-f", f]), 1, "goes with --spec");
    let out = quiver(&[
        "bench",
        "-m",
        m,
        "-f",
        "no-such-prompt.txt",
        "--spec",
        "ngram",
    ]);
    one_line_error(&out, 1, "no-such-prompt.txt");
    let _ = std::fs::remove_dir_all(tmp(""));
}

/// An EAGLE-3 head of random weights over SmolLM2 (`synth --preset smollm2-135m-eagle3
/// --vocab-from`): `bench --spec eagle3` drafts with it (and `-md HEAD` alone means eagle3);
/// the wrong type for the file is a one-line error; `run` and `chat` with the head write
/// plain decoding's text.
#[test]
fn an_eagle3_head_drafts_in_bench_run_and_chat_and_the_wrong_type_is_refused() {
    let m = quiver_hub::alias_path("smollm2-135m");
    assert!(m.is_file(), "{}: run scripts/test", m.display());
    let m = m.to_str().unwrap();
    let head = tmp("eagle3-head.gguf");
    let head = head.to_str().unwrap();
    let synth = ["synth", "--preset", "smollm2-135m-eagle3", "--type", "Q8_0"];
    ok(&quiver(
        &[&synth[..], &["-o", head, "--vocab-from", m]].concat(),
    ));
    let f = tmp("eagle3-prompt.txt");
    std::fs::write(&f, "The valve is checked, then the pressure is logged.").unwrap();
    let f = f.to_str().unwrap();
    for spec in [&["--spec", "eagle3", "-md", head][..], &["-md", head]] {
        let rows = bench(m, f, spec, "12");
        assert_eq!(rows[1]["spec"], "eagle3", "{}", rows[1]);
        let p = rows[1]["proposed"].as_u64().unwrap();
        assert!(p > 0, "{}", rows[1]);
    }
    let bench_with = |spec: &[&str]| quiver(&[&["bench", "-m", m, "-f", f][..], spec].concat());
    one_line_error(
        &bench_with(&["--spec", "draft", "-md", head]),
        1,
        "is an EAGLE-3 head: use --spec-type eagle3",
    );
    one_line_error(
        &bench_with(&["--spec", "eagle3", "-md", m]),
        1,
        "is not an EAGLE-3 head",
    );
    // `run` and `chat` with the head: the text of plain decoding, greedy and seeded, and
    // proposals made (a chat's second turn continues the first's cache, the head's too).
    let run = |sample: &[&str], spec: &[&str]| {
        let p = [
            "run",
            "-m",
            m,
            "-p",
            "Write the alphabet twice: a b c d",
            "-n",
            "40",
        ];
        ok(&quiver(&[&p[..], sample, spec].concat())).clone()
    };
    let with_head = ["--spec-type", "eagle3", "-md", head, "--spec-timing", "off"];
    for sample in [&["--temp", "0"][..], &["--temp", "0.9", "--seed", "7"]] {
        let (plain, spec) = (run(sample, &[]), run(sample, &with_head));
        assert_eq!(plain.stdout, spec.stdout, "{sample:?}");
        let err = String::from_utf8_lossy(&spec.stderr);
        let proposed = err
            .split("speculative decoding: ")
            .nth(1)
            .and_then(|t| t.split(['/', ' ']).nth(1))
            .and_then(|n| n.parse::<u64>().ok());
        assert!(proposed.is_some_and(|n| n > 0), "{err}");
    }
    let chat = |spec: &[&str]| chat_two_turns(m, "30", spec);
    assert_eq!(chat(&[]), chat(&with_head));
}

/// Qwen 3.5 (a tiny one reading SmolLM2's vocabulary): its own multi-token-prediction block
/// drafts in `bench`, `run` and `chat` (`--spec-type mtp`, the recurrent state rolled back past
/// rejected proposals), and the text is that of plain decoding; a model without a block is
/// refused in one line.
#[test]
fn a_qwen35_models_own_block_drafts_in_bench_run_and_chat() {
    let v = quiver_hub::alias_path("smollm2-135m");
    assert!(v.is_file(), "{}: run scripts/test", v.display());
    let v = v.to_str().unwrap();
    let (m, bare) = (tmp("qwen35-mtp.gguf"), tmp("qwen35.gguf"));
    let (m, bare) = (m.to_str().unwrap(), bare.to_str().unwrap());
    for (preset, out) in [("tiny-qwen35-mtp", m), ("tiny-qwen35", bare)] {
        let synth = ["synth", "--preset", preset, "--type", "Q8_0", "-o", out];
        ok(&quiver(&[&synth[..], &["--vocab-from", v]].concat()));
    }
    let f = tmp("mtp-prompt.txt");
    std::fs::write(&f, "The valve is checked, then the pressure is logged.").unwrap();
    let f = f.to_str().unwrap();
    let rows = bench(m, f, &["--spec", "mtp"], "12");
    assert_eq!(rows[1]["spec"], "mtp", "{}", rows[1]);
    assert!(rows[1]["proposed"].as_u64().unwrap() > 0, "{}", rows[1]);
    one_line_error(
        &quiver(&["bench", "-m", bare, "-f", f, "--spec", "mtp"]),
        1,
        "no multi-token-prediction block",
    );
    let run = |spec: &[&str]| {
        let p = [
            "run",
            "-m",
            m,
            "-p",
            "Write the alphabet twice: a b c d",
            "-n",
            "30",
        ];
        ok(&quiver(&[&p[..], &["--temp", "0"], spec].concat())).clone()
    };
    let plain = run(&[]);
    for spec in [&["--spec-type", "mtp"][..], &["--spec-type", "ngram"]] {
        assert_eq!(run(spec).stdout, plain.stdout, "{spec:?}");
    }
    let chat = |spec: &[&str]| chat_two_turns(m, "24", spec);
    assert_eq!(chat(&[]), chat(&["--spec-type", "mtp"]));
}
