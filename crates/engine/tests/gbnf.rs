//! llama.cpp's own GBNF grammars (`grammars/*.gbnf` in its source tree) rewritten to Lark
//! compile in llguidance over the SmolLM2 vocabulary, and the JSON grammar takes JSON and
//! refuses what is not.

mod common;

use quiver_engine::constraint::{ConstraintSpec, Grammars};
use quiver_engine::gbnf::gbnf_to_lark;
use quiver_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;

/// llama.cpp's source tree: `QUIVER_LLAMA_SRC`, else what `tools/llama-src.sh` fetches.
fn llama_src() -> PathBuf {
    if let Some(p) = std::env::var_os("QUIVER_LLAMA_SRC") {
        return PathBuf::from(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/llama-src.sh");
    let out = Command::new("bash").arg(&script).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn grammars() -> Grammars {
    Grammars::new(&Tokenizer::from_gguf(&common::smollm2()).unwrap()).expect("a vocabulary")
}

#[test]
fn llama_cpp_grammars_compile() {
    let g = grammars();
    let dir = llama_src().join("grammars");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "gbnf") {
            let src = std::fs::read_to_string(&path).unwrap();
            let lark = gbnf_to_lark(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            g.constraint(&ConstraintSpec::Lark(lark.clone()))
                .unwrap_or_else(|e| panic!("{}: {e}\n{lark}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 8, "{n} grammars in {}", dir.display());
}

#[test]
fn the_json_grammar_takes_json_only() {
    let g = grammars();
    let tok = Tokenizer::from_gguf(&common::smollm2()).unwrap();
    let src = std::fs::read_to_string(llama_src().join("grammars/json.gbnf")).unwrap();
    let lark = gbnf_to_lark(&src).unwrap();
    // Every token of a JSON text is allowed in turn; a text that is not JSON hits a refusal.
    let accepts = |text: &str| {
        let mut c = g.constraint(&ConstraintSpec::Lark(lark.clone())).unwrap();
        for t in tok.encode(text, false, false).unwrap() {
            let mask = c.next_mask(tok.n_vocab()).unwrap();
            if mask[t as usize / 32] >> (t % 32) & 1 == 0 {
                return false;
            }
            c.commit(t).unwrap();
        }
        true
    };
    assert!(accepts(
        r#"{"name": "quiver", "tags": ["a", "b"], "n": -1.5e3, "ok": true}"#
    ));
    assert!(!accepts(r#"{"name" "quiver"}"#));
    assert!(!accepts(r#"{name: 1}"#));
}
