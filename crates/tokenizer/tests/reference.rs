//! The tokenizers against llama.cpp's ids for the two real models (`tests/reference/` at the
//! workspace root).
//!
//! The model files come from the quiver cache; `scripts/test` fetches them. A missing file
//! fails these tests: it never passes silently.

use quiver_gguf::GgufFile;
use quiver_tokenizer::{Detokenizer, Tokenizer, TokenizerKind};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/reference");

fn model_file(alias: &str) -> GgufFile {
    let path = quiver_hub::alias_path(alias);
    assert!(
        path.exists(),
        "model '{alias}' is missing at {}: run scripts/test, which fetches the reference models",
        path.display()
    );
    GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

fn tokenizer(alias: &'static str) -> &'static Tokenizer {
    static SMOLLM: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match alias {
        "smollm2-135m" => &SMOLLM,
        "gemma3-270m" => &GEMMA,
        _ => panic!("unknown alias {alias}"),
    };
    cell.get_or_init(|| Tokenizer::from_gguf(&model_file(alias)).expect("tokenizer loads"))
}

fn records(file: &str) -> Vec<Value> {
    let path = PathBuf::from(REFERENCE).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e} (the reference outputs are vendored in tests/reference/)",
            path.display()
        )
    });
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

struct Case {
    text: String,
    add_special: bool,
    parse_special: bool,
    ids: Vec<u32>,
}

/// The tokenize-*.jsonl records plus the prompts of generate-*.jsonl (tokenized by
/// llama-server with add_special and parse_special both true).
fn cases(model: &str) -> Vec<Case> {
    let mut out: Vec<Case> = records(&format!("tokenize-{model}.jsonl"))
        .iter()
        .map(|r| Case {
            text: r["text"].as_str().expect("text").to_string(),
            add_special: r["add_special"].as_bool().expect("add_special"),
            parse_special: r["parse_special"].as_bool().expect("parse_special"),
            ids: ids_of(&r["ids"]),
        })
        .collect();
    assert_eq!(
        out.len(),
        96,
        "tokenize-{model}.jsonl should hold 96 records"
    );
    for r in records(&format!("generate-{model}.jsonl")) {
        out.push(Case {
            text: r["prompt"].as_str().expect("prompt").to_string(),
            add_special: true,
            parse_special: true,
            ids: ids_of(&r["prompt_ids"]),
        });
    }
    out
}

fn check_ids(alias: &'static str, model: &str) {
    let tok = tokenizer(alias);
    let cases = cases(model);
    let mut bad = Vec::new();
    for c in &cases {
        match tok.encode(&c.text, c.add_special, c.parse_special) {
            Ok(got) if got == c.ids => {}
            got => bad.push(format!(
                "text {:?} add_special={} parse_special={}\n  expected {:?}\n  got      {:?}",
                c.text, c.add_special, c.parse_special, c.ids, got
            )),
        }
    }
    for b in &bad {
        eprintln!("MISMATCH {b}");
    }
    eprintln!(
        "{model}: {}/{} records match llama.cpp",
        cases.len() - bad.len(),
        cases.len()
    );
    assert!(
        bad.is_empty(),
        "{} of {} records differ from llama.cpp (listed above)",
        bad.len(),
        cases.len()
    );
}

#[test]
fn smollm2_ids_match_llama_cpp() {
    check_ids("smollm2-135m", "smollm2");
}

#[test]
fn gemma3_ids_match_llama_cpp() {
    check_ids("gemma3-270m", "gemma3");
}

#[test]
fn metadata_and_special_tokens() {
    let s = tokenizer("smollm2-135m");
    assert_eq!(s.kind(), TokenizerKind::Bpe);
    assert_eq!(s.n_vocab(), 49152);
    // EOT is found by text; llama.cpp (this build) picks <|endoftext|> over <|im_end|> too.
    assert_eq!((s.bos(), s.eos(), s.eot()), (Some(1), Some(2), Some(0)));
    assert!(!s.add_bos() && !s.add_eos());
    assert_eq!(s.token_text(2), Some("<|im_end|>"));
    // <|endoftext|>, <|im_end|> and (as FIM repo marker) <reponame>.
    assert_eq!(s.eog_ids().collect::<Vec<_>>(), [0, 2, 4]);

    let g = tokenizer("gemma3-270m");
    assert_eq!(g.kind(), TokenizerKind::Spm);
    assert_eq!(g.n_vocab(), 262144);
    assert_eq!((g.bos(), g.eos(), g.eot()), (Some(2), Some(1), Some(106)));
    assert!(g.add_bos() && !g.add_eos());
    // <eos>, <end_of_turn>, and </s> which llama.cpp turns into a control token.
    assert_eq!(g.eog_ids().collect::<Vec<_>>(), [1, 106, 212]);
    assert!(g.is_control(212) && !g.is_control(203));
    assert_eq!(g.encode("", true, false).unwrap(), [2]);
}

/// decode(encode(x)) == x, and streaming decoding one token at a time gives the same text
/// in valid chunks, never a stray U+FFFD.
fn check_round_trip(alias: &'static str, model: &str) {
    let tok = tokenizer(alias);
    let mut n = 0;
    for c in cases(model).iter().filter(|c| !c.add_special) {
        let ids = tok.encode(&c.text, false, c.parse_special).unwrap();
        assert_eq!(
            tok.decode(&ids, false),
            c.text,
            "round trip of {:?}",
            c.text
        );
        let mut d = Detokenizer::new(tok, false);
        let mut streamed = String::new();
        for &id in &ids {
            let chunk = d.push(id);
            assert!(
                !chunk.contains('\u{fffd}'),
                "U+FFFD while streaming {:?}: {chunk:?}",
                c.text
            );
            streamed.push_str(&chunk);
        }
        streamed.push_str(&d.flush());
        assert_eq!(streamed, c.text, "streamed decode of {:?}", c.text);
        // And on llama.cpp's own ids.
        let mut d = Detokenizer::new(tok, true);
        let streamed: String = c.ids.iter().map(|&id| d.push(id)).collect::<String>() + &d.flush();
        assert_eq!(streamed, tok.decode(&c.ids, true));
        n += 1;
    }
    assert!(n >= 40, "only {n} round-trip cases");
}

#[test]
fn smollm2_round_trip_and_streaming() {
    check_round_trip("smollm2-135m", "smollm2");
}

#[test]
fn gemma3_round_trip_and_streaming() {
    check_round_trip("gemma3-270m", "gemma3");
}

#[test]
fn gemma3_emoji_split_across_byte_tokens() {
    let g = tokenizer("gemma3-270m");
    // A rare CJK extension character and a flag sequence: byte fallback splits them.
    let text = "\u{2a6d6}🏴\u{e0067}\u{e0062}\u{e0073}\u{e0063}\u{e0074}\u{e007f}!";
    let ids = g.encode(text, false, false).unwrap();
    let pieces: Vec<&[u8]> = ids.iter().map(|&id| g.token_bytes(id).unwrap()).collect();
    assert!(
        pieces.iter().any(|p| std::str::from_utf8(p).is_err()),
        "expected partial UTF-8 pieces: {ids:?}"
    );
    let mut d = Detokenizer::new(g, true);
    let chunks: Vec<String> = ids.iter().map(|&id| d.push(id)).collect();
    assert!(
        chunks.iter().any(String::is_empty),
        "some bytes must be held back"
    );
    assert_eq!(chunks.concat() + &d.flush(), text);
}

/// Tokenizing the perplexity text gives llama-perplexity's token counts
/// (tests/reference/perplexity.json: 7638 for SmolLM2, 7562 for Gemma 3).
#[test]
fn gpl3_token_counts() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/reference/GPL-3");
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (needed for the perplexity check)"));
    let text = text.strip_suffix('\n').unwrap_or(&text);
    for (alias, want) in [("smollm2-135m", 7638), ("gemma3-270m", 7562)] {
        let tok = tokenizer(alias);
        let t0 = std::time::Instant::now();
        let ids = tok.encode(text, true, false).unwrap();
        eprintln!(
            "{alias}: GPL-3 ({} bytes) -> {} tokens in {:?}",
            text.len(),
            ids.len(),
            t0.elapsed()
        );
        assert_eq!(ids.len(), want, "{alias}");
        assert_eq!(tok.decode(&ids, true), text);
    }
}

#[test]
fn smollm2_chat_template_matches_reference_prompts() {
    use quiver_tokenizer::chat::{ChatTemplate, Message};
    let f = model_file("smollm2-135m");
    let tmpl = ChatTemplate::from_gguf(&f)
        .unwrap()
        .expect("SmolLM2 ships a chat template");
    let tok = tokenizer("smollm2-135m");
    let mut n = 0;
    for r in records("generate-smollm2.jsonl") {
        let Some(msgs) = r.get("messages") else {
            continue;
        };
        let msgs: Vec<Message> = serde_json::from_value(msgs.clone()).expect("messages");
        let prompt = tmpl.render(&msgs, true, None).unwrap();
        assert_eq!(prompt, r["prompt"].as_str().unwrap());
        assert_eq!(
            tok.encode(&prompt, true, true).unwrap(),
            ids_of(&r["prompt_ids"])
        );
        n += 1;
    }
    assert_eq!(n, 2, "expected the two ChatML records");
}

#[test]
fn gemma3_uses_the_builtin_template() {
    use quiver_tokenizer::chat::{Builtin, ChatTemplate, Message};
    let f = model_file("gemma3-270m");
    assert!(ChatTemplate::from_gguf(&f).unwrap().is_none());
    let tmpl = ChatTemplate::for_model(&f).unwrap();
    assert_eq!(tmpl.builtin_kind(), Some(Builtin::Gemma));
    let msgs = [
        Message::new("user", "Hello!"),
        Message::new("assistant", "Hi there."),
        Message::new("user", "Bye."),
    ];
    let prompt = tmpl.render(&msgs, true, None).unwrap();
    assert_eq!(
        prompt,
        "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\nHi there.<end_of_turn>\n\
         <start_of_turn>user\nBye.<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = tokenizer("gemma3-270m")
        .encode(&prompt, true, true)
        .unwrap();
    assert_eq!(&ids[..3], &[2, 105, 2364], "BOS, <start_of_turn>, user");
}

/// Generated text as llama-server returned it is the decode of the generated ids.
#[test]
fn decode_matches_generated_text() {
    for (alias, model) in [("smollm2-135m", "smollm2"), ("gemma3-270m", "gemma3")] {
        let tok = tokenizer(alias);
        let recs = records(&format!("generate-{model}.jsonl"));
        assert_eq!(recs.len(), 5);
        for r in recs {
            let ids = ids_of(&r["output_ids"]);
            let want = r["output_text"].as_str().unwrap();
            assert_eq!(tok.decode(&ids, true), want, "{model}: {:?}", r["prompt"]);
            let mut d = Detokenizer::new(tok, true);
            let streamed: String =
                ids.iter().map(|&id| d.push(id)).collect::<String>() + &d.flush();
            assert_eq!(streamed, want);
        }
    }
}
