//! The output processor: one request's generated tokens become text, streamed safely. UTF-8
//! sequences split across tokens are held back until complete (the detokenizer), and so is a
//! tail that could still become a stop string; the text ends before the first stop string.
//! The CLI's `generate` and the serving loop both stream through it.

use quiver_tokenizer::{Detokenizer, Tokenizer};

pub struct OutputProcessor<'t> {
    detok: Detokenizer<'t>,
    stops: Vec<String>,
    /// The text so far (without the stop string once one is found).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

/// What one token adds to the stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Emit {
    /// Text safe to send now (may be empty).
    pub text: String,
    /// A stop string was found: the request ends, its text ends before the stop string.
    pub stop: bool,
}

impl<'t> OutputProcessor<'t> {
    pub fn new(tok: &'t Tokenizer, stops: Vec<String>) -> Self {
        OutputProcessor {
            detok: Detokenizer::new(tok, true),
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    pub fn push(&mut self, token: u32) -> Emit {
        let piece = self.detok.push(token);
        let before = self.text.len();
        self.text.push_str(&piece);
        let (end, stop) = match stop_at(&self.text, &self.stops, before) {
            Some(cut) => {
                self.text.truncate(cut);
                (cut, true)
            }
            None => (safe_end(&self.text, &self.stops), false),
        };
        Emit {
            text: self.take_to(end),
            stop,
        }
    }

    /// The rest of the text when the request ends by length: held-back bytes and any tail
    /// that was held back for a stop string that never came.
    pub fn finish(&mut self) -> String {
        let tail = self.detok.flush();
        self.text.push_str(&tail);
        self.take_to(self.text.len())
    }

    /// The whole text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn into_text(self) -> String {
        self.text
    }

    fn take_to(&mut self, end: usize) -> String {
        if end <= self.emitted {
            return String::new();
        }
        let s = self.text[self.emitted..end].to_string();
        self.emitted = end;
        s
    }
}

/// The byte offset where the earliest stop string starts, if one ends in the new text (from
/// byte `new_from` on).
pub(crate) fn stop_at(text: &str, stops: &[String], new_from: usize) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let from = new_from.saturating_sub(s.len() - 1);
            let from = (0..=from)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            text[from..].find(s.as_str()).map(|i| from + i)
        })
        .min()
}

/// The end of the text that can be sent without risking a stop string: a tail that is a
/// prefix of some stop string is held back.
fn safe_end(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    for s in stops.iter().filter(|s| !s.is_empty()) {
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && text.is_char_boundary(text.len() - k)
                && s.as_bytes().starts_with(&text.as_bytes()[text.len() - k..])
            {
                end = end.min(text.len() - k);
                break;
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_across_pieces() {
        let stops = vec!["END".to_string(), "\n\n".into()];
        assert_eq!(stop_at("hello EN", &stops, 6), None);
        assert_eq!(stop_at("hello END", &stops, 8), Some(6));
        assert_eq!(stop_at("a\n\nb", &stops, 2), Some(1));
        assert_eq!(stop_at("ünï", &["ï".to_string()], 3), Some(3));
    }

    #[test]
    fn safe_end_holds_back_a_possible_stop_prefix() {
        let stops = vec!["END".to_string()];
        assert_eq!(safe_end("hello E", &stops), 6);
        assert_eq!(safe_end("hello EN", &stops), 6);
        assert_eq!(safe_end("hello", &stops), 5);
        assert_eq!(safe_end("hello", &[]), 5);
    }

    /// A byte-level tokenizer: token i < 256 is byte i (SentencePiece byte tokens).
    fn bytes_tokenizer() -> Tokenizer {
        use quiver_gguf::{Array, GgufFile, GgufWriter, Value};
        let toks: Vec<String> = (0..256).map(|b| format!("<0x{b:02X}>")).collect();
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("llama".into()));
        w.set("tokenizer.ggml.model", Value::String("llama".into()));
        w.set("tokenizer.ggml.tokens", Value::Array(Array::String(toks)));
        w.set(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![6; 256])),
        );
        w.set(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0; 256])),
        );
        w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));
        w.set("tokenizer.ggml.add_space_prefix", Value::Bool(false));
        let f = GgufFile::from_bytes(w.to_bytes(&[]).unwrap()).unwrap();
        Tokenizer::from_gguf(&f).unwrap()
    }

    fn run(p: &mut OutputProcessor, s: &[u8]) -> (String, bool) {
        let mut out = String::new();
        for &b in s {
            let e = p.push(b as u32);
            out.push_str(&e.text);
            if e.stop {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn streams_hold_back_stop_prefixes_and_split_characters() {
        let tok = bytes_tokenizer();
        let mut p = OutputProcessor::new(&tok, vec!["END".into()]);
        // "E" and "EN" are held back until they cannot be a stop string any more.
        assert_eq!(p.push(b'a' as u32).text, "a");
        assert_eq!(p.push(b'E' as u32).text, "");
        assert_eq!(p.push(b'N' as u32).text, "");
        assert_eq!(p.push(b'x' as u32).text, "ENx");
        let (out, stop) = run(&mut p, b"yyEND more");
        assert_eq!((out.as_str(), stop), ("yy", true));
        assert_eq!(p.text(), "aENxyy");
        // A two-byte character arrives whole.
        let mut p = OutputProcessor::new(&tok, vec![]);
        assert_eq!(p.push(0xC3).text, "");
        assert_eq!(p.push(0xA9).text, "é");
        // At the length limit the held-back tail comes out.
        let mut p = OutputProcessor::new(&tok, vec!["END".into()]);
        let (out, stop) = run(&mut p, b"okEN");
        assert_eq!((out.as_str(), stop), ("ok", false));
        assert_eq!(p.finish(), "EN");
        assert_eq!(p.text(), "okEN");
    }
}
