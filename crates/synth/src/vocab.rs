//! A random model that speaks a real model's vocabulary (`quiver synth --vocab-from FILE`):
//! a draft whose proposals a real target can check, and which is almost never right — the
//! cost floor of draft-model speculation.

use crate::{Preset, SynthError};
use quiver_gguf::{GgufFile, Value};

/// The size of `file`'s vocabulary (its `tokenizer.ggml.tokens` list).
pub fn vocab_size(file: &GgufFile) -> Result<u64, SynthError> {
    match file.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => Ok(a.len() as u64),
        _ => Err(SynthError::Vocab(
            "--vocab-from: the file has no tokenizer.ggml.tokens list".into(),
        )),
    }
}

/// Every `tokenizer.*` key of `file`, to write into a model of preset `p`; Err when the
/// file's vocabulary is not the preset's size.
pub fn tokenizer_keys(file: &GgufFile, p: &Preset) -> Result<Vec<(String, Value)>, SynthError> {
    let n = vocab_size(file)?;
    if n != p.n_vocab {
        return Err(SynthError::Vocab(format!(
            "--vocab-from: the file's vocabulary has {n} tokens, preset {}'s {}",
            p.name, p.n_vocab
        )));
    }
    Ok(file
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}
