//! Unit tests of the tokenizer over small hand-made vocabularies.

use super::*;
use quiver_gguf::{Array, GgufWriter, Value};

fn file(meta: Vec<(&str, Value)>) -> GgufFile {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    for (k, v) in meta {
        w.set(k, v);
    }
    GgufFile::from_bytes(w.to_bytes(&[]).unwrap()).unwrap()
}

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// A small SentencePiece-style vocabulary with byte fallback for all 256 bytes.
fn spm() -> Tokenizer {
    let mut toks: Vec<String> = [
        "<unk>",
        "<s>",
        "</s>",
        "\u{2581}",
        "a",
        "b",
        "\u{2581}a",
        "ab",
        "<ctl>",
        "<ud>",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 3, 4];
    for b in 0..256 {
        toks.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let scores: Vec<f32> = (0..toks.len()).map(|i| -(i as f32)).collect();
    let f = file(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(toks))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
        ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
    ]);
    Tokenizer::from_gguf(&f).unwrap()
}

#[test]
fn spm_small_vocab() {
    let t = spm();
    assert_eq!(t.kind(), TokenizerKind::Spm);
    assert_eq!((t.bos(), t.eos(), t.unk()), (Some(1), Some(2), Some(0)));
    assert!(t.add_bos() && !t.add_eos());
    assert!(t.is_eog(2));
    assert_eq!(t.encode("ab a", true, false).unwrap(), [1, 7, 6]);
    // é = C3 A9 falls back to byte tokens.
    assert_eq!(t.encode("é", false, false).unwrap(), [10 + 0xC3, 10 + 0xA9]);
    // User-defined tokens match whatever parse_special says; control tokens only with it.
    assert_eq!(t.encode("<ud><ctl>", false, false).unwrap()[0], 9);
    assert_eq!(t.encode("<ud><ctl>", false, true).unwrap(), [9, 8]);
    assert_eq!(t.decode(&[1, 7, 6, 2], true), "ab a");
    assert_eq!(t.decode(&[1, 7, 8], false), "<s>ab<ctl>");
    assert_eq!(t.token_bytes(10 + 0xC3), Some(&[0xC3u8][..]));
}

#[test]
fn detokenizer_holds_back_partial_utf8() {
    let t = spm();
    let ids = t.encode("a😂b", false, false).unwrap();
    let mut d = Detokenizer::new(&t, true);
    let outs: Vec<String> = ids.iter().map(|&id| d.push(id)).collect();
    assert_eq!(outs.concat() + &d.flush(), "a😂b");
    assert_eq!(outs[0], "a");
    assert!(outs[1..4].iter().all(String::is_empty), "{outs:?}");
    assert_eq!(outs[4], "😂");
    // A sequence that never completes becomes one U+FFFD, at the end or when broken.
    let mut d = Detokenizer::new(&t, true);
    assert_eq!(d.push(10 + 0xF0), "");
    assert_eq!(d.push(4), "\u{fffd}a");
    assert_eq!(d.push(10 + 0xE4), "");
    assert_eq!(d.flush(), "\u{fffd}");
    assert_eq!(
        t.decode(&[10 + 0xF0, 4, 10 + 0xE4], true),
        "\u{fffd}a\u{fffd}"
    );
}

#[test]
fn shareable_across_threads() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<chat::ChatTemplate>();
}

#[test]
fn clean_spaces_passes() {
    let c = |s: &str| String::from_utf8(clean_spaces(s.as_bytes())).unwrap();
    assert_eq!(c("Hi , there . Ok ?"), "Hi, there. Ok?");
    assert_eq!(c("a ' b"), "a'b");
    assert_eq!(c("a ' ' b"), "a'' b");
    assert_eq!(c("it 's we 're I 'm they 've"), "it's we're I'm they've");
    assert_eq!(c("don 't I 'd we 'll"), "don 't I 'd we 'll");
    assert_eq!(c(" ."), ".");
    assert_eq!(c(""), "");
}

#[test]
fn none_vocab() {
    let f = file(vec![
        ("tokenizer.ggml.model", Value::String("none".into())),
        ("llama.vocab_size", Value::U32(1000)),
    ]);
    let t = Tokenizer::from_gguf(&f).unwrap();
    assert_eq!(t.kind(), TokenizerKind::None);
    assert_eq!(t.n_vocab(), 1000);
    let e = t.encode("hi", true, false).unwrap_err();
    assert!(e.to_string().contains("no vocabulary"), "{e}");
    assert_eq!(t.decode(&[5, 17], true), "<5><17>");
    assert!(!t.is_eog(0) && t.bos().is_none());
}

#[test]
fn bpe_errors_name_the_problem() {
    let f = file(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("mystery".into())),
        ("tokenizer.ggml.tokens", strings(&["a"])),
        ("tokenizer.ggml.merges", strings(&[])),
    ]);
    let e = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(e.to_string().contains("'mystery'"), "{e}");
    let f = file(vec![(
        "tokenizer.ggml.model",
        Value::String("wordpiece".into()),
    )]);
    assert!(Tokenizer::from_gguf(&f)
        .unwrap_err()
        .to_string()
        .contains("wordpiece"));
}

#[test]
fn bpe_small_vocab() {
    // Byte-level: "Ġ" is the space byte.
    let f = file(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("gpt-2".into())),
        (
            "tokenizer.ggml.tokens",
            strings(&["<|endoftext|>", "h", "i", "Ġ", "hi", "Ġhi", "Ġh"]),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![3, 1, 1, 1, 1, 1, 1])),
        ),
        ("tokenizer.ggml.merges", strings(&["h i", "Ġ h", "Ġ hi"])),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ]);
    let t = Tokenizer::from_gguf(&f).unwrap();
    assert_eq!(t.kind(), TokenizerKind::Bpe);
    assert_eq!(t.encode("hi hi", true, false).unwrap(), [4, 5]);
    assert_eq!(t.decode(&[4, 5, 0], true), "hi hi");
    assert_eq!(t.decode(&[4, 5, 0], false), "hi hi<|endoftext|>");
    assert_eq!(t.eot(), Some(0));
    assert!(t.is_eog(0));
    assert_eq!(t.encode("hi<|endoftext|>", false, true).unwrap(), [4, 0]);
}
