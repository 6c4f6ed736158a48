//! llama-server's and vLLM's command lines run unchanged on `quiver serve` (issue 33, item 3):
//! each of their flags is taken with its meaning there, or refused with one line naming the
//! nearest flag quiver has (exit 2); a multi-letter single-dash flag is never split into
//! letters, and nothing prints the help and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn quiver(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(args)
        .stdin(Stdio::null())
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

const MISSING: &str = "/no/such/dropin-model.gguf";

/// `quiver CMD -m MISSING FLAGS...`: the flags parsed when the error is about the model (exit
/// 1, one line naming the file), not about a flag.
fn assert_parses(cmd: &str, flags: &[&str]) {
    let mut args = vec![cmd, "-m", MISSING];
    if cmd == "serve" {
        args.extend(["--port", "0"]);
    }
    args.extend(flags);
    let out = quiver(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{flags:?}: {err:?}");
    assert!(
        err.contains(MISSING),
        "{flags:?}: not about the model: {err}"
    );
    assert!(out.stdout.is_empty(), "{flags:?}: printed to stdout");
}

/// `quiver serve -m MISSING FLAGS...` is refused before the model: exit 2, one line on stderr
/// that says each of `says`, no help, nothing on stdout.
fn assert_refused(flags: &[&str], says: &[&str]) {
    let mut args = vec!["serve", "-m", MISSING, "--port", "0"];
    args.extend(flags);
    let out = quiver(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{flags:?}: {err:?}");
    assert!(out.stdout.is_empty(), "{flags:?}: printed to stdout");
    assert!(!err.contains("Usage"), "{flags:?}: {err}");
    for s in says {
        assert!(err.contains(s), "{flags:?}: {err:?} does not say {s:?}");
    }
}

#[test]
fn llama_server_and_vllm_flags_parse() {
    let serve: &[&[&str]] = &[
        // Multi-letter single-dash flags, never read as letters (-cb was -c b, -tb a second -t).
        &["-cb"],
        &["--cont-batching"],
        &["-t", "1", "-tb", "2"],
        &["--threads-batch", "2"],
        &["-ub", "128", "-b", "2048"],
        &["--ubatch-size", "64"],
        &["-kvu"],
        &["--kv-unified"],
        &["-dev", "CUDA0"],
        &["-dev", "none"],
        &["--device", "cuda1"],
        &["--device", "cpu"],
        &["-sm", "none"],
        &["-sm", "layer"],
        &["--split-mode", "layer"],
        &["-np", "4", "-c", "8192"],
        &["-ngl", "99", "-fa"],
        // Speculative decoding's: -md (a path: parsed, and the model's file is checked later).
        &["-md", "draft.gguf", "-ngld", "99", "-cd", "4096"],
        &[
            "--model-draft",
            "d.gguf",
            "--draft-max",
            "8",
            "--draft-min",
            "2",
            "--draft-p-min",
            "0.5",
        ],
        &["--spec-type", "ngram", "--draft", "4"],
        &["-fa", "on", "-cb"],
        &["-ctk", "q8_0", "-ctv", "tq4"],
        &["--cache-type-k", "bf16"],
        // Flags that take no value.
        &["--mlock"],
        &["--no-mmap"],
        &["--embeddings"],
        &["--embedding"],
        &["--no-warmup"],
        &["--enable-auto-tool-choice"],
        &["--jinja", "--metrics", "--no-webui"],
        // Request defaults; negative numbers are values.
        &["-n", "64"],
        &["-n", "-1"],
        &["--n-predict", "-2"],
        &["--predict", "8"],
        &["--temp", "0.7"],
        &["--temp", "0"],
        &["--seed", "42"],
        &["-s", "-1"],
        &["--top-k", "40"],
        &["--top-k", "-1"],
        &["--top-p", "0.9"],
        &["--min-p", "0.05"],
        &["--cache-reuse", "256"],
        &["--reasoning-format", "deepseek"],
        &["--reasoning-format", "auto"],
        &["--reasoning-format", "none"],
        // vLLM's.
        &["--max-model-len", "2048"],
        &["--served-model-name", "my-model"],
        &["--max-num-seqs", "4"],
        &["--tool-call-parser", "llama3_json"],
        // A long llama-server command line at once.
        &[
            "-c",
            "8192",
            "-np",
            "4",
            "-cb",
            "-t",
            "2",
            "-tb",
            "2",
            "-b",
            "2048",
            "-ub",
            "512",
            "-ngl",
            "99",
            "-fa",
            "-ctk",
            "q8_0",
            "-ctv",
            "q8_0",
            "--mlock",
            "--no-mmap",
            "--embeddings",
            "-n",
            "256",
            "--temp",
            "0.6",
            "--seed",
            "1",
            "--top-k",
            "20",
            "--top-p",
            "0.95",
            "--min-p",
            "0",
            "--no-warmup",
            "--cache-reuse",
            "256",
            "--reasoning-format",
            "deepseek",
            "--jinja",
            "-a",
            "name",
            "-to",
            "600",
        ],
    ];
    for flags in serve {
        assert_parses("serve", flags);
    }
    for name in [
        "hermes",
        "mistral",
        "llama3_json",
        "deepseek_v3",
        "deepseek_v31",
        "gemma4",
    ] {
        assert_parses("serve", &["--tool-call-parser", name]);
    }
    for name in quiver_tokenizer::chat::BUILTIN_NAMES {
        assert_parses("serve", &["--chat-template", name]);
    }
    // The load flags on the other inference commands.
    assert_parses(
        "run",
        &[
            "-tb",
            "2",
            "-ub",
            "64",
            "-dev",
            "none",
            "-sm",
            "layer",
            "--mlock",
            "--no-mmap",
            "-p",
            "hi",
        ],
    );
    // `-` stays a value (stdin).
    let out = quiver(&["run", "-m", MISSING, "-f", "-"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("stdin"), "{err}");
    assert_parses("bench", &["-ub", "64", "-tb", "1", "-dev", "CPU"]);
    // One device, however it is said.
    assert_parses("serve", &["-tp", "1", "-ts", "1,0"]);
    assert_parses(
        "run",
        &[
            "--tensor-parallel-size",
            "1",
            "--tensor-split",
            "0/1",
            "-p",
            "hi",
        ],
    );
    assert_parses("bench", &["--tensor-parallel", "1", "-ts", "1"]);
}

#[test]
fn refusals_are_one_line_naming_the_nearest_flag() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["-nocb"], &["-nocb", "--max-seqs 1"]),
        (&["--no-cont-batching"], &["--max-seqs 1"]),
        (&["--reranking"], &["/v1/embeddings"]),
        (&["--rerank"], &["/v1/embeddings"]),
        (
            &["-sm", "row"],
            &["tensor parallelism", "--split-mode layer"],
        ),
        (&["--split-mode", "rows"], &["none or layer"]),
        (&["-ctk", "q4_0"], &["q4_0", "use tq4"]),
        (&["-ctv", "q4_1"], &["use tq4"]),
        (&["--cache-type-k", "iq4_nl"], &["use tq4"]),
        (&["-ctk", "q5_0"], &["use q8_0"]),
        (&["-ctv", "q5_1"], &["use q8_0"]),
        (&["--kv-type", "f32"], &["use f16"]),
        (
            &["--reasoning-format", "deepseek-legacy"],
            &["use deepseek", "or none"],
        ),
        (
            &["--tool-call-parser", "pythonic"],
            &["hermes", "llama3_json"],
        ),
        (
            &["--chat-template", "llama2"],
            &["llama3", "mistral", "phi3", "qwen"],
        ),
        (&["--temp", "3"], &["--temp"]),
        (&["--top-p", "0"], &["--top-p"]),
        (&["-n", "0"], &["--n-predict"]),
        (&["-dev", "CUDA0,CUDA1"], &["one device", "--device cuda:0"]),
        (&["-dev", "gpu"], &["cuda:N"]),
        (
            &["--max-model-len", "512", "-c", "512"],
            &["--max-model-len"],
        ),
        // Any other single-dash word is an unknown flag, never letters.
        (&["-xyz"], &["unknown flag '-xyz'"]),
        (&["-tpx", "2"], &["unknown flag '-tpx'"]),
        // vLLM's -tp out of range; llama-server's -ts over two devices.
        (&["-tp", "0"], &["ranks from 1 to 64"]),
        (&["--tensor-parallel-size", "65"], &["ranks from 1 to 64"]),
        (
            &["-ts", "1,1"],
            &[
                "several devices",
                "tensor parallelism",
                "-tp N (--tensor-parallel-size N)",
            ],
        ),
        (&["--tensor-split", "3/1"], &["several devices"]),
        (&["-ts", "1,x"], &["proportions"]),
        (&["-ts", "0,0"], &["one above zero"]),
        (&["-no-cnv"], &["unknown flag '-no-cnv'"]),
    ];
    for (flags, says) in cases {
        assert_refused(flags, says);
    }
    // After `--` every word is a value: here an unexpected one, still one line, exit 2.
    let out = quiver(&["run", "-m", MISSING, "--", "-xyz"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("unknown flag"));
}

#[test]
fn builtin_chat_templates_render_each_familys_format() {
    use quiver_tokenizer::chat::{ChatTemplate, Message};
    let conv = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi!"),
        Message::new("assistant", "Hello. "),
        Message::new("user", "What is 2+2?"),
    ];
    let render = |name: &str, eos: &str| {
        ChatTemplate::named(name, "<s>", eos)
            .unwrap()
            .render(&conv, true, None)
            .unwrap()
    };
    assert_eq!(
        render("llama3", "<|eot_id|>"),
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let v3 = "[INST] Be brief.\n\nHi![/INST] Hello.</s>[INST] What is 2+2?[/INST]";
    assert_eq!(render("mistral", "</s>"), v3);
    assert_eq!(render("mistral-v3", "</s>"), v3);
    assert_eq!(
        render("mistral-v7", "</s>"),
        "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi![/INST] Hello. </s>[INST] What is 2+2?[/INST]"
    );
    assert_eq!(
        render("mistral-v7-tekken", "</s>"),
        "[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi![/INST]Hello. </s>[INST]What is 2+2?[/INST]"
    );
    assert_eq!(
        render("phi3", "<|endoftext|>"),
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello. <|end|>\n\
         <|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"
    );
    let chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
                  <|im_start|>assistant\nHello. <|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                  <|im_start|>assistant\n";
    assert_eq!(render("qwen", "<|im_end|>"), chatml);
    assert_eq!(render("chatml", "<|im_end|>"), chatml);
    assert_eq!(
        render("gemma", "<eos>"),
        "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
         <start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    // Tools, a call and its result, in each family's call format (the format quiver reads
    // back is chosen by what the template spells).
    let mut call = Message::new("assistant", "");
    call.tool_calls = Some(serde_json::json!([{"id": "c1", "type": "function",
        "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]));
    let mut result = Message::new("tool", "4");
    result.tool_call_id = Some("c1".into());
    let turns = [Message::new("user", "2+2?"), call, result];
    let tools = serde_json::json!([{"type": "function", "function": {"name": "add",
        "parameters": {"type": "object"}}}]);
    let with_tools = |name: &str| {
        ChatTemplate::named(name, "<s>", "</s>")
            .unwrap()
            .render(&turns, true, Some(&tools))
            .unwrap()
    };
    let l = with_tools("llama3");
    assert!(
        l.contains("\"name\": \"add\", \"parameters\": {\"type\": \"object\"}")
            && l.contains("<|end_header_id|>\n\n{\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 2}}<|eot_id|>")
            && l.contains("<|start_header_id|>ipython<|end_header_id|>\n\n4<|eot_id|>"),
        "{l}"
    );
    assert_eq!(
        with_tools("mistral"),
        "[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \"add\", \"parameters\": {\"type\": \"object\"}}}][/AVAILABLE_TOOLS]\
         [INST] 2+2?[/INST][TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 2}}]</s>\
         [TOOL_RESULTS] {\"content\": \"4\"}[/TOOL_RESULTS]"
    );
    let q = with_tools("qwen");
    assert!(
        q.starts_with("<|im_start|>system\n# Tools\n")
            && q.contains("<tools>\n{\"type\": \"function\"")
            && q.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 2}}\n</tool_call><|im_end|>")
            && q.ends_with("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "{q}"
    );
    // Sources carry the markers the server reads the call format from.
    let src = |n: &str| {
        ChatTemplate::named(n, "", "")
            .unwrap()
            .source()
            .unwrap()
            .to_string()
    };
    assert!(src("llama3").contains("ipython"));
    assert!(src("mistral").contains("[TOOL_CALLS]") && src("mistral-v7").contains("[TOOL_CALLS]"));
    assert!(src("qwen").contains("<tool_call>"));
}

/// A running `quiver serve` (killed on drop) and its port.
struct Server(Child, u16);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(flags: &[&str]) -> Server {
    let m = model("smollm2-135m");
    let mut child = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["serve", "-m", &m, "--port", "0", "-t", "1"])
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("quiver serve runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let t0 = Instant::now();
    let mut log = String::new();
    while t0.elapsed() < Duration::from_secs(60) {
        let Some(Ok(line)) = lines.next() else { break };
        log.push_str(&line);
        log.push('\n');
        if let Some(rest) = line.split("listening on http://127.0.0.1:").nth(1) {
            let port: u16 = rest
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap();
            // Keep draining the log so that the server never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return Server(child, port);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the server did not start: {log}");
}

fn http(port: u16, method: &str, path: &str, body: &str) -> serde_json::Value {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn tensor_parallel_size_serves_over_cpu_ranks_as_one_rank() {
    // SmolLM2 over 3 ranks (vLLM's flag): greedy text as one rank's (as `run -tp 3` gives).
    let body = r#"{"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}"#;
    let text = |flags: &[&str]| {
        let srv = serve(&[&["--device", "cpu"], flags].concat());
        let r = http(srv.1, "POST", "/v1/completions", body);
        assert_eq!(r["usage"]["completion_tokens"], 12, "{r}");
        r["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let one = text(&[]);
    assert_eq!(text(&["--tensor-parallel-size", "3"]), one);
}

#[test]
fn ctx_over_parallel_and_request_defaults_as_llama_server_means_them() {
    // -c 1024 -np 4: 256 tokens a sequence, a pool of 1024 (64 blocks); -n 3 and --temp 0 are
    // the defaults of requests that give no max_tokens or temperature.
    let srv = serve(&[
        "-c", "1024", "-np", "4", "-n", "3", "--temp", "0", "--seed", "5",
    ]);
    let props = http(srv.1, "GET", "/props", "");
    assert_eq!(
        props["default_generation_settings"]["n_ctx"], 256,
        "{props}"
    );
    assert_eq!(props["total_slots"], 4);
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(
        (p["n_predict"].as_i64(), p["temperature"].as_f64()),
        (Some(3), Some(0.0)),
        "{p}"
    );
    let metrics = {
        let mut s = TcpStream::connect(("127.0.0.1", srv.1)).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(metrics.contains("quiver_kv_blocks_total 64"), "{metrics}");
    let body = r#"{"prompt": "The capital of France is"}"#;
    let a = http(srv.1, "POST", "/v1/completions", body);
    assert_eq!(a["usage"]["completion_tokens"], 3, "{a}");
    // --temp 0 by default: the same text each time; a request's own fields win.
    assert_eq!(
        http(srv.1, "POST", "/v1/completions", body)["choices"][0]["text"],
        a["choices"][0]["text"]
    );
    let b = http(
        srv.1,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}"#,
    );
    assert_eq!(b["usage"]["completion_tokens"], 2, "{b}");
    // Past a sequence's share: the context is 256 tokens, not 1024.
    let long = format!(
        r#"{{"prompt": "{}", "max_tokens": 1}}"#,
        "hello ".repeat(300)
    );
    let e = http(srv.1, "POST", "/v1/completions", &long);
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    drop(srv);
    // quiver's --max-seqs (and vLLM's --max-num-seqs) keep -c per sequence; without -n the
    // default max_tokens is each endpoint's own.
    let srv = serve(&["-c", "512", "--max-num-seqs", "4"]);
    let props = http(srv.1, "GET", "/props", "");
    assert_eq!(
        props["default_generation_settings"]["n_ctx"], 512,
        "{props}"
    );
    assert_eq!(props["total_slots"], 4);
    assert!(props["default_generation_settings"]["params"]["n_predict"].is_null());
}
