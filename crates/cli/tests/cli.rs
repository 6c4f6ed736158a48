//! Black-box tests of the `quiver` binary: bad input gives one line on stderr and a non-zero
//! exit; info, tokenize and synth do what they say on the real models.

use std::process::{Command, Output};

fn quiver(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(args)
        .output()
        .expect("quiver runs")
}

fn model(alias: &str) -> String {
    let p = quiver_hub::alias_path(alias);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        p.display()
    );
    p.display().to_string()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A successful command's JSON output (its stderr in the message otherwise).
fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_one_line_error(out: &Output, code: i32, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: exit code, stderr: {err}"
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{what}: stderr is not one line: {err:?}"
    );
    assert!(out.stdout.is_empty(), "{what}: wrote to stdout on error");
}

#[test]
fn every_malformed_file_is_a_one_line_error_with_exit_1() {
    for c in quiver_gguf::malformed::cases() {
        let p = tmp(&format!("bad-{}.gguf", c.name.replace(' ', "_")));
        std::fs::write(&p, &c.bytes).unwrap();
        let out = quiver(&["info", p.to_str().unwrap()]);
        assert_one_line_error(&out, 1, c.name);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: ") && err.contains(c.expect),
            "{}: {err}",
            c.name
        );
    }
}

#[test]
fn missing_files_unknown_flags_and_bad_values_are_one_line_errors() {
    let out = quiver(&["info", "/no/such/model.gguf"]);
    assert_one_line_error(&out, 1, "missing file");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/model.gguf"));
    // A directory as the model: said once, with the path.
    let dir = tmp("a-directory");
    std::fs::create_dir_all(&dir).unwrap();
    for args in [["run", "-p", "hi"], ["serve", "--port", "0"]] {
        let out = quiver(&[args[0], "-m", dir.to_str().unwrap(), args[1], args[2]]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_one_line_error(&out, 1, "directory");
        assert_eq!(err.matches("is a directory").count(), 1, "{err}");
        assert_eq!(err.matches(dir.to_str().unwrap()).count(), 1, "{err}");
    }
    assert_one_line_error(&quiver(&["info", "--bogus"]), 2, "unknown flag");
    assert_one_line_error(&quiver(&["frobnicate"]), 2, "unknown command");
    // Near misses name what was meant, on the same line.
    for (args, meant) in [
        (&["serv"][..], "'serve'"),
        (&["run", "--seeed", "1"][..], "'--seed'"),
    ] {
        let out = quiver(args);
        assert_one_line_error(&out, 2, "near miss");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(meant), "{args:?}: {err}");
    }
    let o = tmp("never.gguf");
    let o = o.to_str().unwrap();
    let out = quiver(&[
        "synth",
        "--arch",
        "llama",
        "--preset",
        "smollm2-135m",
        "--type",
        "Q9_9",
        "-o",
        o,
    ]);
    assert_one_line_error(&out, 1, "unknown type");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Q4_K_M"),
        "lists the known types"
    );
    let out = quiver(&[
        "synth",
        "--arch",
        "gemma3",
        "--preset",
        "smollm2-135m",
        "--type",
        "Q8_0",
        "-o",
        o,
    ]);
    assert_one_line_error(&out, 1, "arch mismatch");
    let out = quiver(&[
        "synth", "--arch", "llama", "--preset", "tiny", "--type", "Q8_0", "-o", o,
    ]);
    assert_one_line_error(&out, 1, "unknown preset");
    assert!(!std::path::Path::new(o).exists());
    let out = quiver(&[
        "synth",
        "--preset",
        "deep-llama",
        "--type",
        "Q8_0",
        "--weights",
        "wide",
        "-o",
        o,
    ]);
    assert_one_line_error(&out, 1, "unknown --weights");
    assert!(!std::path::Path::new(o).exists());
    let out = quiver(&[
        "synth",
        "--arch",
        "llama",
        "--preset",
        "smollm2-135m",
        "--type",
        "Q8_0",
        "-t",
        "x",
        "-o",
        o,
    ]);
    assert_one_line_error(&out, 2, "non-numeric flag");
    let out = quiver(&["info", "hf:just-an-org"]);
    assert_one_line_error(&out, 1, "bad hf reference");
}

#[test]
fn info_json_describes_smollm2() {
    let out = quiver(&["info", "--json", "-m", &model("smollm2-135m")]);
    let j = json_of(&out);
    assert_eq!(j["architecture"], "llama");
    assert_eq!(j["hparams"]["block_count"], 30);
    assert_eq!(j["hparams"]["attention.layer_norm_rms_epsilon"], 1e-5);
    assert_eq!(j["tokenizer"]["model"], "gpt2");
    assert_eq!(j["tokenizer"]["pre"], "smollm");
    assert_eq!(j["tokenizer"]["vocab_size"], 49152);
    assert_eq!(
        j["tokenizer"]["special_tokens"]["eos"]["text"],
        "<|im_end|>"
    );
    assert_eq!(j["tokenizer"]["chat_template"], true);
    let tensors = j["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 272);
    let sum: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(j["totals"]["bytes"], sum);
    assert_eq!(j["totals"]["by_type"]["Q8_0"]["tensors"], 1);
    let emb = tensors
        .iter()
        .find(|t| t["name"] == "token_embd.weight")
        .unwrap();
    assert_eq!(emb["shape"], serde_json::json!([49152, 576]));
    // Text form from the same report.
    let out = quiver(&["info", &model("smollm2-135m")]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("architecture:  llama") && text.contains("totals: 272 tensors"),
        "{text}"
    );
}

#[test]
fn tokenize_prints_llama_cpp_ids() {
    // From tests/reference/tokenize-smollm2.jsonl and tokenize-gemma3.jsonl.
    let out = quiver(&["tokenize", "-m", &model("smollm2-135m"), "<|endoftext|>"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[44,108,486,1714,2692,108,46]"
    );
    let out = quiver(&["tokenize", "-m", &model("gemma3-270m"), ""]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[2]");
    let out = quiver(&[
        "tokenize",
        "-m",
        &model("gemma3-270m"),
        "--no-add-special",
        "",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
}

#[test]
fn synth_gemma3_q4_k_m_has_the_real_files_tensor_types_and_no_vocabulary() {
    let real = quiver_gguf::GgufFile::open(model("gemma3-270m")).unwrap();
    let p = tmp("gemma3-synth.gguf");
    let out = quiver(&[
        "synth",
        "--arch",
        "gemma3",
        "--preset",
        "gemma3-270m",
        "--type",
        "Q4_K_M",
        "-o",
        p.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f = quiver_gguf::GgufFile::open(&p).unwrap();
    assert_eq!(f.tensors.len(), real.tensors.len());
    for t in &real.tensors {
        let s = f
            .tensor(&t.name)
            .unwrap_or_else(|| panic!("synth lacks {}", t.name));
        assert_eq!((s.ty, &s.shape), (t.ty, &t.shape), "{}", t.name);
    }
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), Some("none"));
    assert_eq!(f.get_u32("gemma3.vocab_size").unwrap(), Some(262144));
    for key in [
        "gemma3.attention.sliding_window",
        "gemma3.attention.key_length",
        "gemma3.block_count",
    ] {
        assert_eq!(f.get(key), real.get(key), "{key}");
    }
    // The weights are random but not degenerate: a dequantized matrix has the requested spread.
    let (t, bytes) = f.tensor_bytes("blk.0.attn_output.weight").unwrap();
    let mut w = vec![0f32; t.n_elements as usize];
    quiver_quant::dequantize(t.ty, bytes, &mut w).unwrap();
    let rms = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((0.015..0.025).contains(&rms), "rms {rms}");
    // Same seed, same file.
    let p2 = tmp("gemma3-synth-2.gguf");
    let out = quiver(&[
        "synth",
        "--arch",
        "gemma3",
        "--preset",
        "gemma3-270m",
        "--type",
        "Q4_K_M",
        "-o",
        p2.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    assert!(
        std::fs::read(&p).unwrap() == std::fs::read(&p2).unwrap(),
        "synth is not deterministic"
    );
    let _ = std::fs::remove_file(&p);
    let _ = std::fs::remove_file(&p2);
}

#[test]
fn run_is_deterministic_for_a_seed_and_streams_text() {
    let m = model("smollm2-135m");
    let args = [
        "run",
        "-m",
        &m,
        "-p",
        "Write a haiku about rivers.",
        "-n",
        "24",
        "--temp",
        "0.9",
        "--seed",
        "7",
    ];
    let a = quiver(&args);
    let b = quiver(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert!(a.stdout.len() > 10, "no text generated");
    assert_eq!(a.stdout, b.stdout, "same seed, different text");
    let err = String::from_utf8_lossy(&a.stderr);
    assert!(err.contains("t/s"), "no speed report on stderr: {err}");
    let c = quiver(&[
        "run",
        "-m",
        &m,
        "-p",
        "Write a haiku about rivers.",
        "-n",
        "24",
        "--temp",
        "0.9",
        "--seed",
        "8",
    ]);
    assert_ne!(a.stdout, c.stdout, "different seeds gave the same text");
}

#[test]
fn generation_flag_errors_and_context_overflow_are_one_line_errors() {
    let m = model("smollm2-135m");
    for (args, code) in [
        (vec!["run", "-m", &m, "-p", "hi", "-n", "0"], 2),
        (vec!["run", "-m", &m, "-p", "hi", "-n", "-3"], 2),
        (vec!["run", "-m", &m, "-p", "hi", "--temp", "abc"], 2),
        (vec!["run", "-m", &m, "-p", "hi", "--temp", "-1"], 2),
        (vec!["run", "-m", &m, "-p", "hi", "--top-p", "1.5"], 2),
        (vec!["run", "-m", &m], 1),
        (vec!["logprobs", "-m", &m, "--ids", "[1, 2"], 1),
        (vec!["logprobs", "-m", &m, "--ids", "[99999999]"], 1),
    ] {
        let out = quiver(&args);
        assert_one_line_error(&out, code, &format!("{args:?}"));
    }
    let long = "word ".repeat(300);
    let out = quiver(&["run", "-m", &m, "--raw", "-p", &long, "-c", "64", "-n", "8"]);
    assert_one_line_error(&out, 1, "prompt longer than the context");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("prompt of 30") && err.contains("context of 64"),
        "names both lengths: {err}"
    );
}

#[test]
fn run_with_speculation_prints_the_text_of_plain_run() {
    let m = model("smollm2-135m");
    let prompt =
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";
    let base = ["run", "-m", &m, "--raw", "-p", prompt, "-n", "40"];
    let greedy = ["--temp", "0"];
    let seeded = ["--temp", "0.9", "--seed", "3"];
    for sampling in [&greedy[..], &seeded[..]] {
        let plain = quiver(&[&base[..], sampling].concat());
        assert!(
            plain.status.success(),
            "{}",
            String::from_utf8_lossy(&plain.stderr)
        );
        assert!(plain.stdout.len() > 40, "no text generated");
        let ngram = ["--spec", "ngram", "--draft-max", "8"];
        let draft = ["-md", &m, "--spec-timing", "off"];
        let sure = [
            "--model-draft",
            &m,
            "--draft-p-min",
            "0.5",
            "--draft-max",
            "4",
        ];
        for spec in [&ngram[..], &draft[..], &sure[..]] {
            let out = quiver(&[&base[..], sampling, spec].concat());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{spec:?}: {err}");
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&plain.stdout),
                "{sampling:?} {spec:?}"
            );
            let line = err.lines().find(|l| l.contains("speculative decoding: "));
            let line = line.unwrap_or_else(|| panic!("{spec:?}: no acceptance line: {err}"));
            // The model as its own draft, greedy: every proposal accepted.
            if spec == &draft[..] && sampling == &greedy[..] {
                let counts = line.split_whitespace().find(|w| w.contains('/')).unwrap();
                let (a, p) = counts.split_once('/').unwrap();
                assert!(a == p && a != "0", "{line}");
            }
        }
    }
}

#[test]
fn tensor_parallel_cpu_ranks_run_bench_and_score_as_one_rank() {
    let m = model("smollm2-135m");
    let run = |tp: &str, t: &str| {
        let p = "The capital of France is";
        let args = ["run", "-m", &m, "--device", "cpu", "-t", t, "-tp", tp];
        let out = quiver(&[&args[..], &["-p", p, "-n", "12", "--temp", "0"]].concat());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "-tp {tp}: {err}");
        (String::from_utf8_lossy(&out.stdout).to_string(), err)
    };
    let (one, _) = run("1", "2");
    let (three, log) = run("3", "2");
    assert!(one.len() > 12, "no text generated: {one:?}");
    // SmolLM2's 9 heads, 3 KV heads, 1,536-wide FFN and vocabulary split over 3 ranks: the
    // partial sums added in rank order round differently from one product, not enough to
    // change these greedy tokens; the ranks' threads change no bits.
    assert_eq!(three, one);
    assert_eq!(run("3", "6").0, three);
    // Prompt lookup over the ranks: the same text.
    let p = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,";
    let spec = |extra: &[&str]| {
        let args = [
            "run", "-m", &m, "--device", "cpu", "-tp", "3", "-p", p, "-n", "24", "--temp", "0",
        ];
        let out = quiver(&[&args[..], extra].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (plain, _) = spec(&[]);
    let (looked, spec_log) = spec(&["--spec", "ngram", "--spec-timing", "off"]);
    assert_eq!(looked, plain);
    assert!(spec_log.contains("speculative decoding: "), "{spec_log}");
    assert!(
        log.contains("as 3 tensor-parallel ranks of 1 thread"),
        "{log}"
    );
    // Each rank holds a third of the weights and of the KV heads.
    let ranks: Vec<&str> = log.lines().filter(|l| l.contains(": rank ")).collect();
    assert_eq!(ranks.len(), 3, "{log}");
    let whole = std::fs::metadata(&m).unwrap().len() as f64 / 1048576.0;
    for l in &ranks {
        let mib: f64 = l
            .split("weights ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            (mib - whole / 3.0).abs() < 0.05 * whole,
            "{l} (file {whole:.1} MiB)"
        );
        assert!(l.contains("256 bytes per token per layer"), "{l}");
    }
    // Perplexity over 3 ranks near one rank's: 0.33% apart here, since the int8 copies of
    // activations the products read flip a code where the reordered sums differ by an ulp
    // (F32 weights: logits within 1e-4).
    let ppl = |tp: &str| -> f64 {
        let out = quiver(&[
            "perplexity",
            "-m",
            &m,
            "--device",
            "cpu",
            "-tp",
            tp,
            "-f",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/reference/GPL-3"),
            "-c",
            "128",
            "--chunk",
            "128",
            "--json",
        ]);
        let j = json_of(&out);
        j["ppl"].as_f64().unwrap_or_else(|| panic!("{j}"))
    };
    let (p1, p3) = (ppl("1"), ppl("3"));
    assert!((p3 / p1 - 1.0).abs() < 0.01, "{p1} {p3}");
    // bench over ranks reports its tests.
    let out = quiver(&[
        "bench", "-m", &m, "--device", "cpu", "-tp", "3", "-p", "16", "-n", "4", "-r", "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("pp16") && table.contains("tg4"), "{table}");
    // A quantized KV cache over the ranks: each holds its heads' records.
    let on3 = |cmd: &'static str, rest: &[&'static str]| {
        let m: &str = &m;
        let mut a = vec![cmd.to_string(), "-m".into(), m.into()];
        a.extend(["--device", "cpu", "-tp", "3"].map(String::from));
        a.extend(rest.iter().map(|s| s.to_string()));
        a
    };
    let kv = on3("run", &["--kv-type", "q8_0", "-p", "hi", "-n", "4"]);
    let out = quiver(&kv.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.matches("KV cache q8_0: 136 bytes per token per layer")
            .count(),
        3,
        "{err}"
    );
    // What ranks do not run, in one line each.
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "-m", &m, "--device", "cpu", "-tp", "2", "-p", "hi"],
            "heads (9) do not divide by 2 ranks",
        ),
        (
            &[
                "bench",
                "-m",
                &m,
                "--device",
                "cpu",
                "-tp",
                "3",
                "--parallel",
                "2",
                "-p",
                "8",
                "-n",
                "2",
            ],
            "--parallel",
        ),
    ];
    for (args, says) in cases {
        let out = quiver(args);
        assert_one_line_error(&out, 1, says);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(says),
            "{args:?}: {err:?} does not say {says:?}"
        );
    }
}

#[test]
fn speculation_flag_errors_are_one_line_errors() {
    let m = model("smollm2-135m");
    let g = model("gemma3-270m");
    for (args, code, says) in [
        (
            vec!["--spec-type", "draft"],
            1,
            "needs a draft model (-md/--model-draft)",
        ),
        (
            vec!["--spec-type", "eagle"],
            2,
            "none, ngram, draft, eagle3 or mtp",
        ),
        (
            vec!["--spec", "ngram", "-md", &m],
            1,
            "goes with --spec-type draft",
        ),
        (vec!["-md", &g], 1, "not the same vocabulary"),
        (vec!["-md", "no-such-draft.gguf"], 1, "no-such-draft.gguf"),
        (vec!["-md", &m, "--draft-p-min", "2"], 2, "--draft-p-min"),
        (
            vec!["-md", &m, "--draft-min", "5", "--draft-max", "2"],
            1,
            "--draft-min 5",
        ),
    ] {
        for cmd in [&["run", "-m", &m, "-p", "hi"][..], &["chat", "-m", &m]] {
            let out = quiver(&[cmd, &args].concat());
            assert_one_line_error(&out, code, &format!("{cmd:?} {args:?}"));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(says), "{cmd:?} {args:?}: {err}");
        }
    }
}

#[test]
fn absurd_sizes_are_one_line_errors_not_aborts() {
    let m = model("smollm2-135m");
    for (args, says) in [
        (
            vec!["run", "-m", &m, "-p", "hi", "-n", "1", "-c", "999999999"],
            "available",
        ),
        (
            vec!["run", "-m", &m, "-p", "hi", "-n", "1", "-t", "100000"],
            "at most",
        ),
        (
            vec![
                "serve",
                "-m",
                &m,
                "--port",
                "0",
                "--kv-blocks",
                "4294967295",
            ],
            "available",
        ),
        (
            vec![
                "serve",
                "-m",
                &m,
                "--port",
                "0",
                "--kv-mem",
                "1000000000000000",
            ],
            "available",
        ),
        // The depth plus the test past u32 (it wrapped to a context of 3 tokens and built
        // 4 G tokens of depth before refusing them).
        (
            vec!["bench", "-m", &m, "-p", "4", "-n", "1", "-d", "4294967295"],
            "past any model",
        ),
        (
            vec!["bench", "-m", &m, "-p", "4", "-n", "1", "-d", "4294967000"],
            "available",
        ),
    ] {
        let out = quiver(&args);
        assert_one_line_error(&out, 1, &format!("{args:?}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn device_flag_errors_are_one_line_errors() {
    let m = model("smollm2-135m");
    // A value --device does not take is a flag error (exit 2).
    let out = quiver(&["run", "-m", &m, "-p", "hi", "-n", "2", "--device", "gpu"]);
    assert_one_line_error(&out, 2, "--device gpu");
    assert!(String::from_utf8_lossy(&out.stderr).contains("use auto, cpu, cuda or cuda:N"));
    let out = quiver(&[
        "bench", "-m", &m, "-p", "8", "-n", "2", "--device", "cuda:x",
    ]);
    assert_one_line_error(&out, 2, "--device cuda:x");
    // `quiver devices` answers either way, with the libraries it found.
    let out = quiver(&["devices", "--json"]);
    assert!(out.status.success());
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for lib in ["cuda", "nvrtc", "cublas"] {
        assert!(j["libraries"][lib]["found"].is_boolean(), "{j}");
    }
    let n = j["devices"].as_array().unwrap().len();
    assert_eq!(n == 0, j["none_because"].is_string(), "{j}");
    if quiver_backend_cuda::probe(0).is_err() {
        assert_eq!(n, 0);
        // No usable GPU here: an explicit CUDA request says why, in one line.
        let out = quiver(&["run", "-m", &m, "-p", "hi", "-n", "2", "--device", "cuda"]);
        assert_one_line_error(&out, 1, "--device cuda without a GPU");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--device cuda: "));
        // auto falls back to the CPU and says so on the load line.
        let out = quiver(&["run", "-m", &m, "-p", "hi", "-n", "2", "--temp", "0"]);
        assert!(out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("on cpu (auto: "), "{err}");
    } else {
        let out = quiver(&[
            "run", "-m", &m, "-p", "hi", "-n", "2", "--device", "cuda:99",
        ]);
        assert_one_line_error(&out, 1, "--device cuda:99");
    }
}

#[test]
fn logprobs_prints_one_sorted_line_per_position() {
    let m = model("smollm2-135m");
    let out = quiver(&[
        "logprobs",
        "-m",
        &m,
        "--ids",
        "[504, 6376, 314]",
        "--top",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["pos"], i);
        let top = l["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0,
            "{lps:?}"
        );
    }
}

#[test]
fn bench_runs_on_a_synth_model_without_vocabulary() {
    let p = tmp("bench-synth.gguf");
    let out = quiver(&[
        "synth",
        "--arch",
        "llama",
        "--preset",
        "smollm2-135m",
        "--type",
        "Q8_0",
        "-o",
        p.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = quiver(&[
        "bench",
        "-m",
        p.to_str().unwrap(),
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--json",
    ]);
    let j = json_of(&out);
    let res = j["results"].as_array().unwrap();
    assert_eq!(res[0]["test"], "pp16");
    assert_eq!(res[1]["test"], "tg4");
    assert!(res
        .iter()
        .all(|r| r["tokens_per_second"].as_f64().unwrap() > 0.0));
    let out = quiver(&[
        "bench",
        "-m",
        p.to_str().unwrap(),
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "--json",
    ]);
    let j = json_of(&out);
    assert_eq!(j["results"].as_array().unwrap().len(), 1);
    assert_one_line_error(
        &quiver(&["bench", "-m", p.to_str().unwrap(), "-p", "0", "-n", "0"]),
        1,
        "bench with nothing to do",
    );
    // Batched mode: one row per sequence count, throughput summed over the sequences.
    let out = quiver(&[
        "bench",
        "-m",
        p.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "3",
        "--parallel",
        "1,3",
        "--json",
    ]);
    let j = json_of(&out);
    let res = j["results"].as_array().unwrap();
    assert_eq!(
        res.iter()
            .map(|r| r["parallel"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 3]
    );
    assert!(res
        .iter()
        .all(|r| r["pp_tokens_per_second"].as_f64().unwrap() > 0.0
            && r["tg_tokens_per_second"].as_f64().unwrap() > 0.0));
    assert_one_line_error(
        &quiver(&["bench", "-m", p.to_str().unwrap(), "--parallel", "0"]),
        2,
        "bench --parallel 0",
    );
    let _ = std::fs::remove_file(&p);
}

/// `--numerics` takes three modes and refuses others in one line; `devices --kernels` prints
/// a model's kernel table and whether it is batch invariant (sm_90 assumed without a GPU); a
/// `QUIVER_*` variable quiver does not read is warned of.
#[test]
fn numerics_kernel_table_and_unknown_variables() {
    let out = quiver(&["run", "-p", "hi", "--numerics", "exact"]);
    assert_one_line_error(&out, 2, "unknown numerics");
    assert!(String::from_utf8_lossy(&out.stderr).contains("fast, invariant, parity"));
    let f = tmp("kernels-tiny-llama.gguf");
    let f = f.to_str().unwrap();
    let out = quiver(&[
        "synth",
        "--preset",
        "tiny-llama",
        "--type",
        "Q4_K_M",
        "-o",
        f,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = quiver(&["devices", "--kernels", "-m", f]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("kernel table (numerics invariant, sm_"),
        "{text}"
    );
    // Prompt rows on wgmma (sm_90 is assumed without a GPU).
    assert!(text.contains("Q4_K     prompt  wmm"), "{text}");
    assert!(
        text.contains("numerics invariant: batch invariant"),
        "{text}"
    );
    let out = quiver(&["devices", "--kernels", "-m", f, "--numerics", "fast"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("qmm (split)") && text.contains("not batch invariant: --numerics fast"),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["devices", "--kernels", "-m", f])
        .env("QUIVER_CUDA_EXACT", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("unknown variable QUIVER_CUDA_EXACT"),
        "{err}"
    );
}

/// With `--log-format json` a fetch's progress lines are log events: stderr stays one JSON
/// object a line, through to the error (pip finds nothing in an empty local index).
#[test]
fn fetch_progress_keeps_the_json_log_json() {
    let home = tmp("json-fetch-home");
    let links = tmp("json-fetch-links");
    std::fs::create_dir_all(&links).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["--log-format", "json", "fetch", "smollm2-135m"])
        .env("QUIVER_HOME", &home)
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", &links)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert!(lines.len() >= 2, "a progress line and the error: {err}");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        assert!(v["level"].is_string(), "{l}");
    }
    assert!(err.contains("fetch smollm2-135m: part 1/"), "{err}");
}

/// llama-server's `-hf` and `-mu` and a positional model for `serve` (vLLM's) name the model;
/// `-hf` never prints help. (Downloads themselves: crates/hub/tests/download.rs.)
#[test]
fn model_flags_of_llama_server_and_vllm() {
    let out = quiver(&["serve", "-hf"]);
    assert_one_line_error(&out, 2, "-hf without a value");
    let out = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["run", "-hf", "org/repo:Q8_0", "-p", "hi"])
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("QUIVER_HOME", tmp("hf-home"))
        .output()
        .unwrap();
    assert_one_line_error(&out, 1, "-hf with no hub");
    assert!(String::from_utf8_lossy(&out.stderr).contains("hf:org/repo:Q8_0"));
    let out = quiver(&[
        "run",
        "-mu",
        "http://127.0.0.1:9/m.gguf",
        "-m",
        "x.gguf",
        "-p",
        "hi",
    ]);
    assert_one_line_error(&out, 2, "-mu with -m");
    let out = quiver(&["serve", "/no/such/model.gguf", "--port", "0"]);
    assert_one_line_error(&out, 1, "positional model");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/model.gguf"));
    let out = quiver(&["serve", "a.gguf", "-m", "b.gguf"]);
    assert_one_line_error(&out, 2, "positional model with -m");
}

fn perplexity_matches_llama_cpp(alias: &str, key: &str) {
    let gpl = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/reference/GPL-3");
    let out = quiver(&[
        "perplexity",
        "-m",
        &model(alias),
        "-f",
        gpl,
        "-c",
        "512",
        // llama.cpp's 512-token batches take its GEMM path, which the fast numerics mirror.
        "--numerics",
        "fast",
        "--json",
    ]);
    let j = json_of(&out);
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/reference/perplexity.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let want = reference["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["model"].as_str().unwrap().to_lowercase().contains(key))
        .and_then(|r| r["ppl"].as_f64())
        .unwrap_or_else(|| panic!("no reference ppl for {key}"));
    let got = j["ppl"].as_f64().unwrap();
    eprintln!(
        "{alias}: PPL {got:.4} vs llama.cpp {want:.4} ({:+.3}%)",
        (got / want - 1.0) * 100.0
    );
    assert_eq!(j["chunks"], 14);
    assert!(
        (got / want - 1.0).abs() < 0.01,
        "{alias}: PPL {got} not within 1% of {want}"
    );
}

#[test]
fn smollm2_perplexity_within_1_percent_of_llama_cpp() {
    perplexity_matches_llama_cpp("smollm2-135m", "smollm2");
}

#[test]
fn gemma3_perplexity_within_1_percent_of_llama_cpp() {
    perplexity_matches_llama_cpp("gemma3-270m", "gemma-3");
}

#[test]
fn chat_answers_resets_and_exits() {
    use std::io::Write;
    let m = model("smollm2-135m");
    let saved = tmp("chat-saved.json");
    let saved = saved.to_str().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["chat", "-m", &m, "-n", "12", "--temp", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            format!(
                "What is 2+2?\n/help\n/frob\nAnd 3+3?\n/save {saved}\n/reset\nWhat is 2+2?\n\
                 /load {saved}\n/bye\nnever read\n"
            )
            .as_bytes(),
        )
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let text = String::from_utf8(out.stdout).unwrap();
    let answers: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    // Commands are not sent to the model: three answers, no more.
    assert_eq!(answers.len(), 3, "expected three answers: {text:?}");
    for said in [
        "(conversation cleared)",
        "/save FILE",
        "(unknown command /frob; /help lists them)",
        "(saved 4 messages to",
        "(loaded 4 messages from",
    ] {
        assert!(err.contains(said), "{said:?} not in {err}");
    }
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved).unwrap()).unwrap();
    assert_eq!(saved[2]["content"], "And 3+3?");
    // After /reset the same question at temperature 0 gets the same first answer.
    let first = text.split("\n").next().unwrap();
    assert!(
        text.matches(first).count() >= 2,
        "answer after /reset differs: {text:?}"
    );
}

#[test]
fn run_takes_its_prompt_from_a_pipe_or_dash_f() {
    use std::io::Write;
    let m = model("smollm2-135m");
    let run = |args: &[&str], input: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_quiver"))
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("quiver runs");
        c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        c.wait_with_output().unwrap()
    };
    let base = ["run", "-m", &m, "-n", "6", "--temp", "0"];
    let piped = run(&base, "Say hi.");
    assert!(
        piped.status.success(),
        "{}",
        String::from_utf8_lossy(&piped.stderr)
    );
    let with_p = quiver(&[&base[..], &["-p", "Say hi."]].concat());
    assert_eq!(piped.stdout, with_p.stdout, "the pipe's prompt is -p's");
    let dash = run(&[&base[..], &["-f", "-"]].concat(), "Say hi.");
    assert_eq!(dash.stdout, with_p.stdout);
    let empty = run(&base, "  \n");
    assert!(!empty.status.success());
    let err = String::from_utf8_lossy(&empty.stderr);
    assert!(
        err.contains("prompt on stdin is empty") && err.lines().count() == 1,
        "{err}"
    );
}
