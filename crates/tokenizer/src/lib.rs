//! quiver-tokenizer: tokenizers built from GGUF metadata alone, reproducing llama.cpp's ids.
//!
//! - `tokenizer.ggml.model = gpt2`: byte-level BPE with merge ranks and the pre-tokenizer
//!   named by `tokenizer.ggml.pre` ([`pretok`]).
//! - `gemma4`: BPE over raw UTF-8 with spaces escaped as `▁` (the `gemma4` pre-tokenizer).
//! - `llama`: SentencePiece-style highest-score bigram merging with byte fallback.
//! - `bert`: WordPiece, greedy longest match after a BERT normalizer ([`wpm`]).
//! - `none`: only a vocabulary size (random-weight benchmark files); encoding is an error.
//!
//! Special tokens (control, user-defined, unknown) are split out of the text before
//! tokenization, longest first; user-defined tokens always, control tokens only when
//! `parse_special` is set. [`Detokenizer`] turns a stream of ids into text without ever
//! emitting a broken UTF-8 sequence. Chat templates live in [`chat`].

mod bpe;
pub mod chat;
mod chat_py;
mod guard;
mod load;
pub mod pretok;
mod special;
mod spm;
mod unicode;
mod wpm;

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use quiver_gguf::{GgufError, GgufFile};

/// Token attributes, as llama.cpp derives them from `tokenizer.ggml.token_type`.
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;

    /// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub fn from_token_type(ty: i32) -> u32 {
        match ty {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("bad metadata {key}: {why}")]
    BadMetadata { key: String, why: String },
    #[error(
        "unsupported tokenizer model '{0}' (tokenizer.ggml.model); supported: gpt2, gemma4, \
         llama, bert, none"
    )]
    UnknownModel(String),
    #[error("unknown pre-tokenizer '{0}' (tokenizer.ggml.pre)")]
    UnknownPreTokenizer(String),
    #[error("the model has no vocabulary (tokenizer.ggml.model = none): it cannot encode text")]
    NoVocabulary,
    #[error("the vocabulary has no {0} token")]
    MissingSpecial(&'static str),
    #[error("chat template: {0}")]
    Template(String),
}

/// Which algorithm a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (`gpt2`).
    Bpe,
    /// SentencePiece-style (`llama`).
    Spm,
    /// WordPiece (`bert`).
    Wpm,
    /// No vocabulary, only a size (`none`).
    None,
}

/// A tokenizer built from a GGUF file's metadata.
pub struct Tokenizer {
    kind: TokenizerKind,
    n_vocab: usize,
    model: String,
    texts: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u32>,
    token_to_id: HashMap<String, u32>,
    /// What each token decodes to when special tokens are rendered.
    pieces: Vec<Box<[u8]>>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    /// Separator (WordPiece: appended with `add_special`).
    sep: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    eog: BTreeSet<u32>,
    pre: Option<pretok::PreTokenizer>,
    merges: Option<bpe::Merges>,
    byte_map: unicode::ByteMap,
    /// Fallback token of each byte (SPM: `<0xNN>`).
    byte_tokens: [Option<u32>; 256],
    specials: special::Specials,
    /// WordPiece: the normalizer and the longest token's length in bytes.
    wpm: Option<(wpm::Normalizer, usize)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("model", &self.model)
            .field("pre", &self.pre.as_ref().map(|p| p.name.as_str()))
            .field("n_vocab", &self.n_vocab)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by `tokenizer.*` keys of a GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        load::from_gguf(f)
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// `tokenizer.ggml.model` (`none` for vocabulary-less files).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `tokenizer.ggml.pre` as resolved (`""` when absent; `None` for non-BPE models).
    pub fn pre_tokenizer(&self) -> Option<&str> {
        self.pre.as_ref().map(|p| p.name.as_str())
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// End of turn: `tokenizer.ggml.eot_token_id`, or found by text (`<|im_end|>`,
    /// `<end_of_turn>`, ...).
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// Separator token (`tokenizer.ggml.seperator_token_id`; WordPiece defaults to 102).
    pub fn sep(&self) -> Option<u32> {
        self.sep
    }

    /// Whether generation stops at `id` (llama.cpp's EOG set).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The whole end-of-generation set, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The vocabulary entry of `id` as stored (byte-level or ▁-escaped).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The id whose vocabulary entry is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The raw bytes `id` decodes to, special tokens rendered as their text. May be a partial
    /// UTF-8 sequence (byte tokens). `None` for ids outside the vocabulary and for
    /// vocabulary-less models.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(|p| &p[..])
    }

    /// Control tokens (BOS, EOS, turn markers ...) and unknown tokens: hidden when decoding
    /// with `skip_special`, matched in text only with `parse_special`.
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & (attr::CONTROL | attr::UNKNOWN) != 0)
    }

    /// The special tokens (control, user-defined, unknown) as (id, text), in the order they
    /// are matched in text (longest first).
    pub fn special_tokens(&self) -> Vec<(u32, &str)> {
        self.specials
            .ids()
            .map(|id| (id, self.texts[id as usize].as_str()))
            .collect()
    }

    /// Tokenizes `text`. `add_special` adds BOS/EOS as the model asks (`add_bos`/`add_eos`);
    /// `parse_special` lets control-token text (`<|im_start|>`) become those tokens.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_guarded(text, add_special, parse_special, None)
    }

    /// `encode`, with the text between special tokens given back its original text by `guard`
    /// (a rendered chat prompt's client text, see `guard.rs`).
    fn encode_guarded(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        guard: Option<&guard::Guard>,
    ) -> Result<Vec<u32>, TokenizerError> {
        if self.kind == TokenizerKind::None {
            return Err(TokenizerError::NoVocabulary);
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        // WordPiece always wraps the text in BOS (CLS) ... SEP.
        let wpm = self.kind == TokenizerKind::Wpm;
        if add_special && (self.add_bos || wpm) {
            out.push(self.bos.ok_or(TokenizerError::MissingSpecial("BOS"))?);
        }
        let mut prev_special = true;
        for frag in self.specials.partition(text, parse_special) {
            match frag {
                special::Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                special::Fragment::Text(r) => {
                    let t = match guard {
                        Some(g) => g.restore(&text[r]),
                        None => std::borrow::Cow::Borrowed(&text[r]),
                    };
                    match self.kind {
                        TokenizerKind::Spm => self.encode_spm(&t, prev_special, &mut out),
                        TokenizerKind::Wpm => {
                            if let Some((norm, max_len)) = self.wpm {
                                wpm::tokenize(
                                    &t,
                                    norm,
                                    &self.token_to_id,
                                    max_len,
                                    self.unk,
                                    &mut out,
                                );
                            }
                        }
                        _ => self.encode_bpe(&t, &mut out),
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && wpm {
            out.push(self.sep.ok_or(TokenizerError::MissingSpecial("SEP"))?);
        } else if add_special && self.add_eos {
            out.push(self.eos.ok_or(TokenizerError::MissingSpecial("EOS"))?);
        }
        Ok(out)
    }

    fn encode_spm(&self, text: &str, prev_special: bool, out: &mut Vec<u32>) {
        let mut s = String::with_capacity(text.len() + 4);
        if self.add_space_prefix && prev_special {
            s.push(' ');
        }
        s.push_str(text);
        let escaped = s.replace(' ', "\u{2581}");
        spm::tokenize(
            &escaped,
            &self.token_to_id,
            &self.scores,
            |b| self.byte_tokens[b as usize],
            out,
        );
    }

    fn encode_bpe(&self, text: &str, out: &mut Vec<u32>) {
        let (Some(pre), Some(merges)) = (&self.pre, &self.merges) else {
            return;
        };
        let escaped;
        let text = if pre.escape_ws {
            escaped = text.replace(' ', "\u{2581}");
            escaped.as_str()
        } else {
            text
        };
        let mut mapped = String::new();
        let mut parts = Vec::new();
        for w in pre.split(text) {
            mapped.clear();
            if pre.escape_ws {
                mapped.push_str(&text[w]);
            } else {
                self.byte_map.encode(&text[w], &mut mapped);
            }
            let whole =
                pre.ignore_merges || (pre.whole_newlines && mapped.bytes().all(|b| b == b'\n'));
            if whole {
                if let Some(&id) = self.token_to_id.get(mapped.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            parts.clear();
            merges.apply(&mapped, &mut parts);
            for p in parts.drain(..) {
                let s = &mapped[p];
                match self.token_to_id.get(s) {
                    Some(&id) => out.push(id),
                    None => out.extend(s.bytes().filter_map(|b| self.byte_tokens[b as usize])),
                }
            }
        }
    }

    /// What `id` decodes to when special tokens are rendered.
    fn render_piece(&self, id: u32) -> Vec<u8> {
        let i = id as usize;
        let (a, t) = (self.attrs[i], &self.texts[i]);
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            t.as_bytes().to_vec()
        } else if a & attr::NORMAL != 0 {
            match self.kind {
                TokenizerKind::Spm | TokenizerKind::Wpm => t.replace('\u{2581}', " ").into_bytes(),
                _ if self.pre.as_ref().is_some_and(|p| p.escape_ws) => {
                    t.replace('\u{2581}', " ").into_bytes()
                }
                _ => {
                    let mut v = Vec::with_capacity(t.len());
                    self.byte_map.decode(t, &mut v);
                    v
                }
            }
        } else if a & attr::BYTE != 0 {
            match t
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => vec![b],
                None => t.as_bytes().to_vec(),
            }
        } else {
            Vec::new()
        }
    }

    /// The bytes token `id` stands for, special tokens as their text: a token that holds part
    /// of a UTF-8 character gives just those bytes (what OpenAI's logprob `bytes` carry).
    /// Empty for ids outside the vocabulary.
    pub fn token_piece_bytes(&self, id: u32) -> Cow<'_, [u8]> {
        self.piece(id, true)
    }

    /// What `id` decodes to; control and unknown tokens are empty unless `special`.
    fn piece(&self, id: u32, special: bool) -> Cow<'_, [u8]> {
        if self.kind == TokenizerKind::None {
            return Cow::Owned(format!("<{id}>").into_bytes());
        }
        if !special && self.is_control(id) {
            return Cow::Borrowed(&[]);
        }
        match self.pieces.get(id as usize) {
            Some(p) => Cow::Borrowed(p),
            None => Cow::Borrowed(&[]),
        }
    }

    /// Tokenizes a rendered chat prompt: special-token text parsed, BOS added only when the
    /// model adds one and the template did not already write it. Client text in the prompt
    /// must not become control tokens: render and tokenize with `ChatTemplate::tokenize`,
    /// which protects it; this is for prompts wholly written by the caller.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_guarded(text, None)
    }

    pub(crate) fn encode_chat_guarded(
        &self,
        text: &str,
        guard: Option<&guard::Guard>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let bos_text = self.bos().and_then(|b| self.token_text(b)).unwrap_or("");
        let written = !bos_text.is_empty() && text.starts_with(bos_text);
        let mut ids = self.encode_guarded(text, false, true, guard)?;
        if self.add_bos() && !written {
            if let Some(b) = self.bos() {
                ids.insert(0, b);
            }
        }
        Ok(ids)
    }

    /// Decodes ids to text: the concatenation of the tokens' pieces, as llama-server returns
    /// generated text, and exactly what [`Detokenizer`] streams. With `skip_special` control
    /// tokens are left out (and a BOS/EOS the model adds itself is dropped); without it they
    /// appear as their text. Invalid UTF-8 becomes U+FFFD, only here at the end. Ids outside
    /// the vocabulary decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut ids = ids;
        if skip_special && self.add_eos && !ids.is_empty() && ids.last().copied() == self.eos {
            ids = &ids[..ids.len() - 1];
        }
        let mut d = Detokenizer::new(self, skip_special);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&d.push(id));
        }
        out.push_str(&d.flush());
        out
    }

    /// llama.cpp's `llama_detokenize(remove_special, unparse_special)`, byte for byte: like
    /// [`decode`](Self::decode), plus the clean-up of spaces before punctuation and
    /// contractions (`" ."` → `"."`, `" 's"` → `"'s"`) that vocabularies with
    /// `clean_up_tokenization_spaces` ask for (most byte-level BPE pre-tokenizers; not SPM,
    /// smollm, qwen2 or deepseek).
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> String {
        if self.kind == TokenizerKind::None {
            return String::new();
        }
        let mut ids = ids;
        let mut strip_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && Some(ids[0]) == self.bos {
            strip_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && !ids.is_empty() && ids.last().copied() == self.eos {
            ids = &ids[..ids.len() - 1];
        }
        let mut bytes = Vec::new();
        for &id in ids {
            let piece = self.piece(id, unparse_special);
            let skip =
                usize::from(std::mem::take(&mut strip_space) && piece.first() == Some(&b' '));
            bytes.extend_from_slice(&piece[skip..]);
        }
        if self.pre.as_ref().is_some_and(|p| p.clean_spaces) {
            bytes = clean_spaces(&bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether [`detokenize`](Self::detokenize) cleans up spaces.
    pub fn clean_spaces(&self) -> bool {
        self.pre.as_ref().is_some_and(|p| p.clean_spaces)
    }
}

/// llama.cpp's three clean-up passes over detokenized bytes: drop the space before `?!.,`;
/// turn `" ' "` into `"'"`; drop the space before `'s 'm 're 've`.
fn clean_spaces(text: &[u8]) -> Vec<u8> {
    if text.is_empty() {
        return Vec::new();
    }
    // 1. " ?" " !" " ." " ,"
    let mut a = vec![text[0]];
    for i in 1..text.len() {
        if text[i - 1] == b' ' && matches!(text[i], b'?' | b'!' | b'.' | b',') {
            a.pop();
        }
        a.push(text[i]);
    }
    // 2. A lone apostrophe between spaces loses both spaces. The space after it is consumed
    // (llama.cpp zeroes it in place, so it cannot start another match).
    let mut src = a;
    let mut b = vec![src[0]];
    let mut i = 1;
    while i < src.len() {
        let x = src[i];
        if x == b'\'' && i + 1 < src.len() && src[i - 1] == b' ' && src[i + 1] == b' ' {
            b.pop();
            src[i + 1] = 0;
            i += 1;
        }
        b.push(x);
        i += 1;
    }
    // 3. " 's" " 'm" " 're" " 've" (but not " 't" " 'd" " 'll").
    let mut c = vec![b[0]];
    for i in 1..b.len() {
        if b[i - 1] == b' ' && b[i] == b'\'' && i + 1 < b.len() {
            let x1 = b[i + 1];
            let x2 = b.get(i + 2).copied();
            let drop = matches!(x1, b's' | b'm')
                || (i + 2 < b.len() && matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e'))));
            if drop {
                c.pop();
            }
        }
        c.push(b[i]);
    }
    c
}

/// Incremental decoding: feed ids one at a time and get the text that became complete.
/// Bytes of an unfinished UTF-8 sequence are held back until the sequence completes; a
/// sequence that can never complete becomes U+FFFD, so the concatenated output always equals
/// [`Tokenizer::decode`] of all the ids.
pub struct Detokenizer<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
    first: bool,
    strip_space: bool,
}

impl<'a> Detokenizer<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Detokenizer<'a> {
        Detokenizer {
            tok,
            skip_special,
            pending: Vec::new(),
            first: true,
            strip_space: tok.add_space_prefix,
        }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let t = self.tok;
        if std::mem::take(&mut self.first) && self.skip_special && t.add_bos && Some(id) == t.bos {
            // A leading BOS is dropped, and the text after it keeps its leading space.
            self.strip_space = false;
            return String::new();
        }
        let piece = t.piece(id, !self.skip_special);
        let piece: &[u8] = if std::mem::take(&mut self.strip_space) && piece.first() == Some(&b' ')
        {
            &piece[1..]
        } else {
            &piece
        };
        self.pending.extend_from_slice(piece);
        self.drain(false)
    }

    /// Ends the stream: an unfinished UTF-8 sequence left over becomes U+FFFD.
    pub fn flush(&mut self) -> String {
        self.drain(true)
    }

    fn drain(&mut self, end: bool) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = consumed + e.valid_up_to();
                    // The prefix up to `valid` was just checked.
                    out.push_str(
                        std::str::from_utf8(&self.pending[consumed..valid]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{fffd}');
                            consumed = valid + n;
                        }
                        None => {
                            if end {
                                out.push('\u{fffd}');
                                consumed = self.pending.len();
                            } else {
                                consumed = valid;
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }
}

#[cfg(test)]
#[path = "lib_tests.rs"]
mod tests;
