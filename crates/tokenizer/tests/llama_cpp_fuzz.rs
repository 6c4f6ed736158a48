//! 500 varied texts (random mixes of scripts, emoji, marks, invisible and odd code points,
//! whitespace runs, special-token strings, plus chunks of licences and source code) with the
//! ids and detokenized text llama.cpp (the same build as shared/reference) gives for them:
//! for both real models in all four add_special × parse_special combinations, and for
//! SmolLM2's vocabulary under eight other pre-tokenizers. The fixture was made with a small
//! harness over `llama_tokenize` / `llama_detokenize`; the `tokenize_lines` example prints
//! the same format for quiver.

use quiver_gguf::{GgufFile, GgufWriter, Value};
use quiver_tokenizer::Tokenizer;
use serde_json::Value as J;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/llama_cpp_fuzz.jsonl"
);

fn model_file(alias: &str) -> GgufFile {
    let path = quiver_hub::alias_path(alias);
    assert!(
        path.exists(),
        "model '{alias}' is missing at {}: run scripts/test, which fetches it",
        path.display()
    );
    GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

fn records() -> Vec<J> {
    let text = std::fs::read_to_string(FIXTURE).expect("fixture");
    let v: Vec<J> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    assert_eq!(v.len(), 500);
    v
}

fn ids(v: &J) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn report(what: &str, bad: Vec<String>, total: usize) {
    for b in &bad {
        eprintln!("MISMATCH {b}");
    }
    eprintln!(
        "{what}: {}/{total} checks match llama.cpp",
        total - bad.len()
    );
    assert!(
        bad.is_empty(),
        "{what}: {} of {total} checks differ from llama.cpp (listed above)",
        bad.len()
    );
}

fn check_model(alias: &str, key: &str) {
    let tok = Tokenizer::from_gguf(&model_file(alias)).unwrap();
    let bos: Vec<u32> = if tok.add_bos() {
        tok.bos().into_iter().collect()
    } else {
        Vec::new()
    };
    let with_bos = |v: &[u32]| bos.iter().chain(v).copied().collect::<Vec<u32>>();
    let (mut bad, mut total) = (Vec::new(), 0);
    for r in records() {
        let text = r["text"].as_str().unwrap();
        let e = &r[key];
        let plain = ids(&e["ids"]);
        let parsed = e
            .get("parse_special")
            .map(ids)
            .unwrap_or_else(|| plain.clone());
        let want = [
            (false, false, plain.clone()),
            (false, true, parsed.clone()),
            (
                true,
                false,
                e.get("add_special")
                    .map(ids)
                    .unwrap_or_else(|| with_bos(&plain)),
            ),
            (
                true,
                true,
                e.get("both").map(ids).unwrap_or_else(|| with_bos(&parsed)),
            ),
        ];
        for (a, p, w) in &want {
            total += 1;
            let got = tok.encode(text, *a, *p).unwrap();
            if &got != w {
                bad.push(format!("{text:?} add_special={a} parse_special={p}\n  expected {w:?}\n  got      {got:?}"));
            }
        }
        let keep = e.get("detok_keep").and_then(J::as_str).unwrap_or(text);
        let skip = e.get("detok_skip").and_then(J::as_str).unwrap_or(text);
        for (got, w, what) in [
            (tok.detokenize(&parsed, false, true), keep, "keep"),
            (tok.detokenize(&want[3].2, true, false), skip, "skip"),
        ] {
            total += 1;
            if got != w {
                bad.push(format!(
                    "{text:?} detokenize ({what})\n  expected {w:?}\n  got      {got:?}"
                ));
            }
        }
    }
    report(key, bad, total);
}

#[test]
fn smollm2_fuzz_matches_llama_cpp() {
    check_model("smollm2-135m", "smollm2");
}

#[test]
fn gemma3_fuzz_matches_llama_cpp() {
    check_model("gemma3-270m", "gemma3");
}

#[test]
fn other_pre_tokenizers_match_llama_cpp() {
    let f = model_file("smollm2-135m");
    let recs = records();
    let (mut bad, mut total) = (Vec::new(), 0);
    for pre in [
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "deepseek-llm",
        "deepseek-coder",
        "falcon",
        "default",
        "starcoder",
    ] {
        // SmolLM2's vocabulary and merges with another pre-tokenizer, metadata only.
        let mut w = GgufWriter::new();
        w.metadata = f.metadata.clone();
        w.set("tokenizer.ggml.pre", Value::String(pre.into()));
        let g = GgufFile::from_bytes(w.to_bytes(&[]).unwrap()).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        for r in &recs {
            let text = r["text"].as_str().unwrap();
            let e = &r["pre"][pre];
            let want = ids(&e["ids"]);
            let got = tok.encode(text, false, false).unwrap();
            total += 2;
            if got != want {
                bad.push(format!(
                    "[{pre}] {text:?}\n  expected {want:?}\n  got      {got:?}"
                ));
            }
            let d = tok.detokenize(&tok.encode(text, false, true).unwrap(), false, true);
            let wd = e.get("detok").and_then(J::as_str).unwrap_or(text);
            if d != wd {
                bad.push(format!(
                    "[{pre}] {text:?} detokenize\n  expected {wd:?}\n  got      {d:?}"
                ));
            }
        }
    }
    report("pre-tokenizers", bad, total);
}
