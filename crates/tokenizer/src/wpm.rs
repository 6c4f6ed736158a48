//! WordPiece (`tokenizer.ggml.model = bert`) as llama.cpp does it: a BERT normalizer
//! (optional lowercasing and accent stripping, control characters dropped), words split at
//! whitespace with punctuation, ASCII symbols and CJK ideographs each a word of their own,
//! then every word, prefixed with `▁`, cut greedily into the longest vocabulary entries. A
//! word that cannot be cut wholly becomes the unknown token.

use crate::unicode::{class, Class};
use std::collections::HashMap;
use unicode_normalization::char::decompose_canonical;

/// The BERT normalizer's options (`tokenizer.ggml.normalizer.*`).
#[derive(Clone, Copy, Debug)]
pub struct Normalizer {
    pub lowercase: bool,
    pub strip_accents: bool,
}

/// The code point llama.cpp's accent stripping maps `c` to: the first code point of its
/// canonical decomposition (llama.cpp keeps one code point per code point).
fn nfd_first(c: char) -> char {
    if class(c) == Class::Undefined {
        // Not assigned in llama.cpp's Unicode 15.1 tables.
        return c;
    }
    let mut first = None;
    decompose_canonical(c, |d| {
        first.get_or_insert(d);
    });
    first.unwrap_or(c)
}

/// Unicode's simple lowercase mapping (one code point to one), as llama.cpp's table has it.
fn lower(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    if class(c) == Class::Undefined {
        return c;
    }
    let mut it = c.to_lowercase();
    match (it.next(), it.next()) {
        (Some(l), None) => l,
        // Only U+0130 (İ) lowercases to two code points; its simple mapping is `i`.
        _ if c == '\u{130}' => 'i',
        _ => c,
    }
}

fn is_chinese(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        // (Hugging Face's tokenizers start this range at 0x2B920, and so does llama.cpp.)
        | 0x2B920..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

/// Normalizes `text` and splits it into words.
fn words(text: &str, norm: Normalizer) -> Vec<String> {
    let mut words = vec![String::new()];
    for c in text.chars() {
        let c = if norm.strip_accents { nfd_first(c) } else { c };
        let cls = class(c);
        if c.is_whitespace() {
            if !words.last().is_some_and(String::is_empty) {
                words.push(String::new());
            }
            continue;
        }
        if c == '\0' || c == '\u{fffd}' || cls == Class::Control {
            continue;
        }
        if norm.strip_accents && cls == Class::Mark {
            continue;
        }
        let alone =
            cls == Class::Punctuation || (c < '\x7f' && cls == Class::Symbol) || is_chinese(c);
        let c = if norm.lowercase { lower(c) } else { c };
        if alone {
            if !words.last().is_some_and(String::is_empty) {
                words.push(String::new());
            }
            if let Some(w) = words.last_mut() {
                w.push(c);
            }
            words.push(String::new());
        } else if let Some(w) = words.last_mut() {
            w.push(c);
        }
    }
    if words.last().is_some_and(String::is_empty) {
        words.pop();
    }
    words
}

/// Tokenizes `text` and appends the ids to `out`.
pub fn tokenize(
    text: &str,
    norm: Normalizer,
    vocab: &HashMap<String, u32>,
    max_token_len: usize,
    unk: Option<u32>,
    out: &mut Vec<u32>,
) {
    for word in words(text, norm) {
        if word.is_empty() {
            continue;
        }
        let word = format!("\u{2581}{word}");
        let n = word.len();
        let start = out.len();
        let mut i = 0;
        while i < n {
            // The longest entry starting at byte i.
            let hit = (i + 1..=n.min(i + max_token_len + 1))
                .rev()
                .find_map(|j| word.get(i..j).and_then(|s| vocab.get(s)).map(|&id| (j, id)));
            match hit {
                Some((j, id)) => {
                    out.push(id);
                    i = j;
                }
                None => {
                    out.truncate(start);
                    break;
                }
            }
        }
        if out.len() == start {
            // llama.cpp pushes the unknown token even when the vocabulary has none (-1); a
            // vocabulary without one loses the word.
            out.extend(unk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_and_splits() {
        let n = Normalizer {
            lowercase: true,
            strip_accents: true,
        };
        assert_eq!(
            words("Héllo, WORLD!你好 a\u{301}\tb\u{200b}c", n),
            ["hello", ",", "world", "!", "你", "好", "a", "bc"]
        );
        assert_eq!(words("İ$x", n), ["i", "$", "x"]);
        let keep = Normalizer {
            lowercase: false,
            strip_accents: false,
        };
        assert_eq!(words("Héllo  ", keep), ["Héllo"]);
    }

    #[test]
    fn greedy_longest_match() {
        let vocab: HashMap<String, u32> = [("▁un", 1), ("▁unaff", 2), ("able", 3), ("aff", 4)]
            .iter()
            .map(|&(s, i)| (s.to_string(), i))
            .collect();
        let n = Normalizer {
            lowercase: true,
            strip_accents: true,
        };
        let mut out = Vec::new();
        tokenize("Unaffable unx", n, &vocab, 8, Some(0), &mut out);
        assert_eq!(out, [2, 3, 0]);
    }
}
