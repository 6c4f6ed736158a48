//! The tokenizers against llama.cpp's own conformance fixtures: every
//! `models/ggml-vocab-*.gguf` of llama.cpp's source tree that comes with `.inp`/`.out` files,
//! checked the way llama.cpp's `tests/test-tokenizer-0.cpp` checks them.
//!
//! `.inp` holds the inputs separated by `"\n__ggml_vocab_test__\n"`; `.out` holds one line per
//! input with the expected ids separated by spaces (surrounding whitespace stripped; an empty
//! line is no tokens). Inputs are tokenized with `add_special = false` and
//! `parse_special = false`. llama.cpp keeps the cases in a map keyed by input, so when an
//! input repeats, its last line is the one checked.
//!
//! The tree comes from `QUIVER_LLAMA_SRC` or from `tools/llama-src.sh` (which fetches it once
//! into the quiver cache). When it cannot be had, the test fails: it never passes silently.

mod common;

use common::llama_src;
use quiver_gguf::GgufFile;
use quiver_tokenizer::{Tokenizer, TokenizerKind};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const SEP: &str = "\n__ggml_vocab_test__\n";

/// The cases of one vocab, as test-tokenizer-0's `read_tests` builds them.
fn read_cases(inp: &Path, out: &Path) -> BTreeMap<String, Vec<u32>> {
    let raw = std::fs::read_to_string(inp).unwrap_or_else(|e| panic!("{}: {e}", inp.display()));
    let outs = std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let mut inputs: Vec<&str> = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(SEP) {
            Some(n) => {
                inputs.push(&raw[pos..pos + n]);
                pos += n + SEP.len();
            }
            None => {
                inputs.push(&raw[pos..]);
                break;
            }
        }
    }
    let lines: Vec<&str> = outs.split('\n').collect();
    // std::getline: a final newline does not start another line.
    let lines = match lines.split_last() {
        Some((&"", rest)) => rest,
        _ => &lines[..],
    };
    assert_eq!(
        inputs.len(),
        lines.len(),
        "{} and {} hold different numbers of tests",
        inp.display(),
        out.display()
    );
    inputs
        .into_iter()
        .zip(lines)
        .map(|(i, o)| {
            let ids = o
                .trim()
                .split(' ')
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse()
                        .unwrap_or_else(|e| panic!("{}: bad id {s:?}: {e}", out.display()))
                })
                .collect();
            (i.to_string(), ids)
        })
        .collect()
}

/// Every vocab with conformance files, by name (`ggml-vocab-NAME.gguf`).
fn vocabs(src: &Path) -> Vec<(String, PathBuf)> {
    let dir = src.join("models");
    let mut v: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_name()?.to_str()?;
            let name = name.strip_prefix("ggml-vocab-")?.strip_suffix(".gguf")?;
            let has = |ext: &str| {
                p.with_file_name(format!("ggml-vocab-{name}.gguf.{ext}"))
                    .is_file()
            };
            (has("inp") && has("out")).then(|| (name.to_string(), p.clone()))
        })
        .collect();
    v.sort();
    v
}

/// Checks one vocab; returns the number of inputs and a description of each failure.
fn check(name: &str, path: &Path) -> (usize, Vec<String>) {
    let cases = read_cases(
        &path.with_extension("gguf.inp"),
        &path.with_extension("gguf.out"),
    );
    assert!(!cases.is_empty(), "{name}: no tests found");
    let file = match GgufFile::open(path) {
        Ok(f) => f,
        Err(e) => {
            return (
                0,
                vec![format!("{name}: cannot open {}: {e}", path.display())],
            )
        }
    };
    let tok = match Tokenizer::from_gguf(&file) {
        Ok(t) => t,
        Err(e) => return (0, vec![format!("{name}: the vocab does not load: {e}")]),
    };
    let mut fails = Vec::new();
    for (text, want) in &cases {
        match tok.encode(text, false, false) {
            Ok(got) if &got == want => {
                // Decoding gives the text back, except through WordPiece's normalizer
                // (lowercasing, accents and spacing are lost there).
                let back = tok.decode(&got, false);
                if back != *text && tok.kind() != TokenizerKind::Wpm {
                    fails.push(format!("{name}: input {text:?} decodes to {back:?}"));
                }
            }
            Ok(got) => fails.push(format!(
                "{name}: input {text:?}\n    want {want:?}\n    got  {got:?}"
            )),
            Err(e) => fails.push(format!("{name}: input {text:?}: {e}")),
        }
    }
    (cases.len(), fails)
}

#[test]
fn llama_cpp_vocab_fixtures() {
    let src = llama_src();
    let vocabs = vocabs(&src);
    assert!(
        vocabs.len() >= 15,
        "only {} vocabs with .inp/.out under {}/models",
        vocabs.len(),
        src.display()
    );
    let mut fails = Vec::new();
    for (name, path) in &vocabs {
        let (n, f) = check(name, path);
        eprintln!("{name}: {n} inputs, {} failures", f.len());
        fails.extend(f);
    }
    assert!(
        fails.is_empty(),
        "{} failures over {} vocabs:\n{}",
        fails.len(),
        vocabs.len(),
        fails.join("\n")
    );
}

/// The vocabs without conformance files load too, except UGM (`t5`), which quiver does not
/// implement and refuses by name.
#[test]
fn every_llama_cpp_vocab_loads() {
    let dir = llama_src().join("models");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("directory entry").path();
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !(name.starts_with("ggml-vocab-") && name.ends_with(".gguf")) {
            continue;
        }
        n += 1;
        let file = GgufFile::open(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        let model = file.get_str("tokenizer.ggml.model").ok().flatten();
        match Tokenizer::from_gguf(&file) {
            Ok(t) => {
                let ids = t.encode("Hello world", true, false);
                assert!(ids.is_ok_and(|v| !v.is_empty()), "{name}: cannot encode");
            }
            Err(e) if model == Some("t5") => {
                assert!(e.to_string().contains("'t5'"), "{name}: {e}");
            }
            Err(e) => panic!("{name}: the vocab does not load: {e}"),
        }
    }
    assert!(
        n >= 19,
        "only {n} ggml-vocab-*.gguf under {}",
        dir.display()
    );
}
