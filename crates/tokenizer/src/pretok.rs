//! Pre-tokenizers of byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.
//!
//! A pre-tokenizer is a list of rules applied one after another, each one splitting every
//! piece the previous rules produced (llama.cpp's `unicode_regex_split`). Two rules are the
//! GPT-2 and Llama-3 patterns, which llama.cpp runs through hand-written matchers rather than
//! a regex engine; the others are simple regexes (`[class]+`, `\s?[class]+`, `\s+$`, ...)
//! where both the matches and the text between them become pieces. Classes follow
//! llama.cpp's view of Unicode: general categories collapsed to letter / number / mark /
//! punctuation / symbol / separator / control, `\s` = the `White_Space` property.

use crate::unicode::Flags;
use crate::TokenizerError;

/// A set of code points used by the simple regex rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Set {
    /// `\p{N}`
    Number,
    /// `\p{L}`
    Letter,
    /// `\p{P}`
    Punct,
    /// `[\p{P}\$\+<=>\^~\|]` (and with a backtick for Falcon).
    PunctSym { backtick: bool },
    /// `[\r\n]`
    CrLf,
    /// `[0-9]`
    AsciiDigit,
    /// Code point ranges (inclusive), compared after non-ASCII whitespace has been replaced
    /// by U+000B the way llama.cpp prepares text for `std::wregex`.
    Ranges(&'static [(u32, u32)]),
}

impl Set {
    fn contains(self, c: char, f: Flags) -> bool {
        match self {
            Set::Number => f.number(),
            Set::Letter => f.letter(),
            Set::Punct => f.punct(),
            Set::PunctSym { backtick } => {
                f.punct()
                    || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
                    || (backtick && c == '`')
            }
            Set::CrLf => c == '\r' || c == '\n',
            Set::AsciiDigit => c.is_ascii_digit(),
            Set::Ranges(r) => {
                let v = if !c.is_ascii() && f.ws {
                    0x0b
                } else {
                    c as u32
                };
                r.iter().any(|&(lo, hi)| lo <= v && v <= hi)
            }
        }
    }
}

/// One splitting rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// with D = 3 (Llama 3) or 1 (Qwen 2). With `marks` (Qwen 3.5) marks join letters:
    /// `[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+` and ` ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*`.
    Llama3 { max_digits: usize, marks: bool },
    /// `[^\n]+|[\n]+`: runs of newlines and runs of everything else.
    Newlines,
    /// `[set]+`
    Run(Set),
    /// `[set]` (one code point per match)
    Single(Set),
    /// `\s?[set]+`
    OptSpaceRun(Set),
    /// `\s+$`
    TrailingSpace,
    /// `[0-9][0-9][0-9]`
    DigitTriples,
}

const DEEPSEEK_LETTERS: &[(u32, u32)] = &[
    (0x41, 0x5a),
    (0x61, 0x7a),
    (0xb5, 0xb5),
    (0xc0, 0xd6),
    (0xd8, 0xf6),
    (0xf8, 0x1ba),
    (0x1bc, 0x1bf),
    (0x1c4, 0x293),
    (0x295, 0x2af),
    (0x370, 0x373),
    (0x376, 0x377),
    (0x37b, 0x37d),
    (0x37f, 0x37f),
    (0x386, 0x386),
    (0x388, 0x38a),
    (0x38c, 0x38c),
    (0x38e, 0x3a1),
    (0x3a3, 0x3f5),
    (0x3f7, 0x481),
    (0x48a, 0x52f),
    (0x531, 0x556),
    (0x10a0, 0x10c5),
    (0x13a0, 0x13f5),
    (0x13f8, 0x13fd),
    (0x1c90, 0x1cba),
    (0x1cbd, 0x1cbf),
    (0x1d00, 0x1d2b),
    (0x1d6b, 0x1d77),
    (0x1d79, 0x1d9a),
    (0x1e00, 0x1f15),
    (0x1f18, 0x1f1d),
    (0x1f20, 0x1f45),
    (0x1f48, 0x1f4d),
    (0x1f50, 0x1f57),
    (0x1f59, 0x1f59),
    (0x1f5b, 0x1f5b),
    (0x1f5d, 0x1f5d),
    (0x1f5f, 0x1f7d),
    (0x1f80, 0x1fb4),
    (0x1fb6, 0x1fbc),
    (0x1fbe, 0x1fbe),
    (0x1fc2, 0x1fc4),
    (0x1fc6, 0x1fcc),
    (0x1fd0, 0x1fd3),
    (0x1fd6, 0x1fdb),
    (0x1fe0, 0x1fec),
    (0x1ff2, 0x1ff4),
    (0x1ff6, 0x1ffc),
    (0x2102, 0x2102),
    (0x2107, 0x2107),
    (0x210a, 0x2113),
    (0x2115, 0x2115),
    (0x2119, 0x211d),
    (0x2124, 0x2124),
    (0x2126, 0x2126),
    (0x2128, 0x2128),
    (0x212a, 0x212d),
    (0x212f, 0x2134),
    (0x2139, 0x2139),
    (0x213c, 0x213f),
    (0x2145, 0x2149),
    (0x214e, 0x214e),
    (0x2183, 0x2184),
    (0x2c00, 0x2c7b),
    (0x2c7e, 0x2ce4),
    (0x2ceb, 0x2cee),
    (0x2cf2, 0x2cf3),
    (0xa640, 0xa66d),
    (0xa680, 0xa69b),
    (0xa722, 0xa76f),
    (0xa771, 0xa787),
    (0xa78b, 0xa78e),
    (0xab70, 0xabbf),
    (0xfb00, 0xfb06),
    (0xfb13, 0xfb17),
    (0xff21, 0xff3a),
    (0xff41, 0xff5a),
    (0x10400, 0x1044f),
    (0x104b0, 0x104d3),
    (0x104d8, 0x104fb),
    (0x10c80, 0x10cb2),
    (0x10cc0, 0x10cf2),
    (0x118a0, 0x118df),
    (0x1e900, 0x1e943),
];
const DEEPSEEK_PUNCT: &[(u32, u32)] = &[
    (0x21, 0x2f),
    (0x3a, 0x7e),
    (0xff01, 0xff0f),
    (0xff1a, 0xff5e),
    (0x2018, 0x201f),
    (0x3000, 0x3002),
];
const DEEPSEEK_CJK: &[(u32, u32)] = &[(0x4e00, 0x9fa5), (0x800, 0x4e00), (0xac00, 0xd7ff)];

/// The pre-tokenizer of a BPE vocabulary plus the load-time flags llama.cpp ties to it.
#[derive(Clone, Debug)]
pub struct PreTokenizer {
    pub name: String,
    pub rules: Vec<Rule>,
    /// A word that is itself a token is emitted whole, without running merges.
    pub ignore_merges: bool,
    /// Default of `add_bos` before `tokenizer.ggml.add_bos_token` is read.
    pub add_bos: bool,
    /// The default BOS id is dropped (ChatGLM).
    pub no_default_bos: bool,
    /// llama.cpp's `clean_up_tokenization_spaces` in `llama_detokenize`.
    pub clean_spaces: bool,
    /// SentencePiece-style BPE (Gemma 4): spaces become `▁` before splitting, words are raw
    /// UTF-8 rather than GPT-2 byte-level text, and bytes fall back to `<0xNN>` tokens.
    pub escape_ws: bool,
    /// A word of newlines only that is itself a token is emitted whole (Gemma 4).
    pub whole_newlines: bool,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value (`None` or empty: `default`).
    pub fn from_name(name: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        use Rule::*;
        let name = name.unwrap_or("").to_string();
        let default = vec![
            Run(Set::PunctSym { backtick: false }),
            Gpt2,
            Run(Set::Number),
            DigitTriples,
        ];
        let llama3 = vec![Llama3 {
            max_digits: 3,
            marks: false,
        }];
        let mut p = PreTokenizer {
            name,
            rules: Vec::new(),
            ignore_merges: false,
            add_bos: false,
            no_default_bos: false,
            clean_spaces: true,
            escape_ws: false,
            whole_newlines: false,
        };
        p.clean_spaces = !matches!(
            p.name.as_str(),
            "deepseek-llm"
                | "deepseek-coder"
                | "command-r"
                | "qwen2"
                | "qwen35"
                | "deepseek-r1-qwen"
                | "kormo"
                | "f2llmv2"
                | "smollm"
                | "trillion"
                | "granite-docling"
                | "hunyuan"
                | "solar-open"
        );
        p.rules = match p.name.as_str() {
            "" | "default" => default,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => {
                p.ignore_merges = true;
                p.add_bos = true;
                llama3
            }
            "dbrx" | "smaug-bpe" => llama3,
            "chatglm-bpe" => {
                p.no_default_bos = true;
                llama3
            }
            "glm4" | "glm5" => {
                p.no_default_bos = true;
                p.ignore_merges = true;
                llama3
            }
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
            | "hunyuan" | "solar-open" => vec![Llama3 {
                max_digits: 1,
                marks: false,
            }],
            "qwen35" => vec![Llama3 {
                max_digits: 1,
                marks: true,
            }],
            "gemma4" | "granite-embed-multi-311m" => {
                p.escape_ws = true;
                p.whole_newlines = true;
                vec![Newlines]
            }
            "deepseek-llm" => vec![
                Single(Set::CrLf),
                OptSpaceRun(Set::Ranges(DEEPSEEK_LETTERS)),
                OptSpaceRun(Set::Ranges(DEEPSEEK_PUNCT)),
                TrailingSpace,
                Run(Set::Ranges(DEEPSEEK_CJK)),
                Run(Set::Number),
            ],
            "deepseek-coder" => vec![
                Single(Set::CrLf),
                OptSpaceRun(Set::Letter),
                OptSpaceRun(Set::Punct),
                Run(Set::Ranges(DEEPSEEK_CJK)),
                Single(Set::Number),
            ],
            "falcon" => vec![Run(Set::PunctSym { backtick: true }), Gpt2, DigitTriples],
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => {
                vec![Single(Set::Number), Gpt2]
            }
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "mpt" | "olmo" | "jais" | "exaone4"
            | "trillion" | "granite-docling" => vec![Gpt2],
            other => return Err(TokenizerError::UnknownPreTokenizer(other.to_string())),
        };
        Ok(p)
    }

    /// Splits `text` into words (byte ranges of `text`, in order, covering all of it).
    pub fn split(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        let mut offs: Vec<usize> = Vec::with_capacity(text.len() + 1);
        let mut cps: Vec<(char, Flags)> = Vec::with_capacity(text.len());
        for (i, c) in text.char_indices() {
            offs.push(i);
            cps.push((c, Flags::of(c)));
        }
        offs.push(text.len());
        let mut pieces: Vec<std::ops::Range<usize>> = std::iter::once(0..cps.len()).collect();
        for rule in &self.rules {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in &pieces {
                split_piece(*rule, &cps, p.start, p.end, &mut next);
            }
            pieces = next;
        }
        pieces
            .into_iter()
            .map(|r| offs[r.start]..offs[r.end])
            .collect()
    }
}

/// Collects the pieces one rule makes of `cps[a..b]` (code point indices).
struct Out<'o> {
    out: &'o mut Vec<std::ops::Range<usize>>,
    prev: usize,
}

impl Out<'_> {
    /// Ends the current piece at `end` (nothing if it would be empty).
    fn cut(&mut self, end: usize) {
        if end > self.prev {
            self.out.push(self.prev..end);
            self.prev = end;
        }
    }
}

fn split_piece(
    rule: Rule,
    cps: &[(char, Flags)],
    a: usize,
    b: usize,
    out: &mut Vec<std::ops::Range<usize>>,
) {
    if a == b {
        return;
    }
    let mut o = Out { out, prev: a };
    match rule {
        Rule::Gpt2 => gpt2(cps, a, b, &mut o),
        Rule::Llama3 { max_digits, marks } => llama3(cps, a, b, max_digits.max(1), marks, &mut o),
        Rule::Newlines => {
            let mut pos = a;
            while pos < b {
                let nl = cps[pos].0 == '\n';
                while pos < b && (cps[pos].0 == '\n') == nl {
                    pos += 1;
                }
                o.cut(pos);
            }
        }
        _ => {
            // A simple regex: every match and every gap between matches is a piece.
            let mut pos = a;
            while let Some((s, e)) = find(rule, cps, pos, b) {
                o.cut(s);
                o.cut(e);
                pos = e;
            }
        }
    }
    o.cut(b);
}

/// Leftmost match of a simple regex rule in `cps[from..b]`.
fn find(rule: Rule, cps: &[(char, Flags)], from: usize, b: usize) -> Option<(usize, usize)> {
    let is = |set: Set, i: usize| i < b && set.contains(cps[i].0, cps[i].1);
    let run_end = |set: Set, mut i: usize| {
        while is(set, i) {
            i += 1;
        }
        i
    };
    match rule {
        Rule::Run(set) => (from..b)
            .find(|&i| is(set, i))
            .map(|s| (s, run_end(set, s))),
        Rule::Single(set) => (from..b).find(|&i| is(set, i)).map(|s| (s, s + 1)),
        Rule::OptSpaceRun(set) => (from..b).find_map(|i| {
            if cps[i].1.ws && is(set, i + 1) {
                Some((i, run_end(set, i + 1)))
            } else if is(set, i) {
                Some((i, run_end(set, i)))
            } else {
                None
            }
        }),
        Rule::TrailingSpace => {
            let mut s = b;
            while s > from && cps[s - 1].1.ws {
                s -= 1;
            }
            (s < b).then_some((s, b))
        }
        Rule::DigitTriples => (from..b.saturating_sub(2))
            .find(|&i| (i..i + 3).all(|j| cps[j].0.is_ascii_digit()))
            .map(|s| (s, s + 3)),
        Rule::Gpt2 | Rule::Llama3 { .. } | Rule::Newlines => None,
    }
}

/// Length of an English contraction (`'s 't 're 've 'm 'll 'd`) starting at `pos`, if any.
fn contraction(cps: &[(char, Flags)], pos: usize, b: usize, fold_case: bool) -> Option<usize> {
    if cps[pos].0 != '\'' || pos + 1 >= b {
        return None;
    }
    let low = |c: char| if fold_case { c.to_ascii_lowercase() } else { c };
    let c1 = low(cps[pos + 1].0);
    if matches!(c1, 's' | 't' | 'm' | 'd') {
        return Some(2);
    }
    if pos + 2 < b {
        let c2 = low(cps[pos + 2].0);
        if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
            return Some(3);
        }
    }
    None
}

/// After the word-like alternatives failed at `pos`: `\s+(?!\S)|\s+` (with `\s*[\r\n]+` first
/// when `newlines` is set). Returns where the piece ends.
fn whitespace_end(cps: &[(char, Flags)], pos: usize, b: usize, newlines: bool) -> usize {
    let mut n = 0;
    let mut after_newline = None;
    while pos + n < b && cps[pos + n].1.ws {
        if newlines && matches!(cps[pos + n].0, '\r' | '\n') {
            after_newline = Some(pos + n + 1);
        }
        n += 1;
    }
    if let Some(e) = after_newline {
        e
    } else if n > 1 && pos + n < b {
        // Leave the last space to prefix the word that follows.
        pos + n - 1
    } else if n > 0 {
        pos + n
    } else {
        pos + 1
    }
}

fn gpt2(cps: &[(char, Flags)], a: usize, b: usize, o: &mut Out) {
    let flags = |i: usize| (i < b).then(|| cps[i].1);
    let mut pos = a;
    while pos < b {
        if let Some(n) = contraction(cps, pos, b, false) {
            pos += n;
            o.cut(pos);
            continue;
        }
        let lead = usize::from(cps[pos].0 == ' ');
        let word = |pos: usize, pred: fn(Flags) -> bool| {
            let mut e = pos + lead;
            while flags(e).is_some_and(pred) {
                e += 1;
            }
            e
        };
        pos = match flags(pos + lead) {
            Some(f) if f.letter() => word(pos, Flags::letter),
            Some(f) if f.number() => word(pos, Flags::number),
            Some(f) if f.other() => word(pos, Flags::other),
            _ => whitespace_end(cps, pos, b, false),
        };
        o.cut(pos);
    }
}

fn llama3(cps: &[(char, Flags)], a: usize, b: usize, max_digits: usize, marks: bool, o: &mut Out) {
    let flags = |i: usize| (i < b).then(|| cps[i].1);
    let is = |i: usize, pred: fn(Flags) -> bool| flags(i).is_some_and(pred);
    // \p{L}, or [\p{L}\p{M}] with `marks`.
    let wordy = |f: Flags| f.letter() || (marks && f.mark());
    let is_wordy = |i: usize| flags(i).is_some_and(wordy);
    // [^\s\p{L}\p{N}], or [^\s\p{L}\p{M}\p{N}] with `marks`.
    let other = |f: Flags| f.other() && !(marks && f.mark());
    let is_other = |i: usize| flags(i).is_some_and(other);
    let mut pos = a;
    while pos < b {
        if let Some(n) = contraction(cps, pos, b, true) {
            pos += n;
            o.cut(pos);
            continue;
        }
        let (c, f) = cps[pos];
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.number()) && (wordy(f) || is_wordy(pos + 1)) {
            pos += 1;
            while is_wordy(pos) {
                pos += 1;
            }
            o.cut(pos);
            continue;
        }
        // \p{N}{1,max_digits}
        if f.number() {
            let mut start = pos;
            while is(pos, Flags::number) {
                pos += 1;
                if pos - start >= max_digits {
                    o.cut(pos);
                    start = pos;
                }
            }
            o.cut(pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let lead = usize::from(c == ' ');
        let f2 = flags(pos + lead);
        // (Past the end counts too: a lone trailing space becomes its own piece either way.)
        if !matches!(f2, Some(f) if !other(f)) {
            pos += lead;
            while is_other(pos) {
                pos += 1;
            }
            while pos < b && matches!(cps[pos].0, '\r' | '\n') {
                pos += 1;
            }
            o.cut(pos);
            continue;
        }
        pos = whitespace_end(cps, pos, b, true);
        o.cut(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let p = PreTokenizer::from_name(Some(pre)).unwrap();
        p.split(text)
            .into_iter()
            .map(|r| text[r].to_string())
            .collect()
    }

    #[test]
    fn unknown_name_is_an_error() {
        let e = PreTokenizer::from_name(Some("no-such-pre")).unwrap_err();
        assert!(e.to_string().contains("no-such-pre"), "{e}");
    }

    #[test]
    fn gpt2_basic() {
        assert_eq!(words("gpt-2", "Hello world"), ["Hello", " world"]);
        assert_eq!(
            words("gpt-2", "I'm sure you're"),
            ["I", "'m", " sure", " you", "'re"]
        );
        assert_eq!(words("gpt-2", "DON'T"), ["DON", "'", "T"]);
        assert_eq!(words("gpt-2", "a   b"), ["a", "  ", " b"]);
        assert_eq!(words("gpt-2", "a  "), ["a", "  "]);
        assert_eq!(words("gpt-2", "x\n\n\ny"), ["x", "\n\n", "\n", "y"]);
        assert_eq!(words("gpt-2", "abc123 456!!"), ["abc", "123", " 456", "!!"]);
        assert_eq!(words("gpt-2", " ?!x"), [" ?!", "x"]);
        assert_eq!(words("gpt-2", ""), Vec::<String>::new());
    }

    #[test]
    fn gpt2_unicode() {
        // Combining marks are neither letters nor numbers: they split words.
        assert_eq!(
            words("gpt-2", "e\u{301}t\u{e9}"),
            ["e", "\u{301}", "t\u{e9}"]
        );
        // NBSP is whitespace; ZWSP and BOM are format characters (punctuation-like here).
        assert_eq!(
            words("gpt-2", "non\u{a0}b\u{200b}z\u{feff}w"),
            ["non", "\u{a0}", "b", "\u{200b}", "z", "\u{feff}", "w"]
        );
        assert_eq!(words("gpt-2", "你好，世界"), ["你好", "，", "世界"]);
        assert_eq!(words("gpt-2", "pizza 🍕🔥"), ["pizza", " 🍕🔥"]);
        assert_eq!(words("gpt-2", "\r\n\r\nx"), ["\r\n\r", "\n", "x"]);
    }

    #[test]
    fn smollm_splits_every_digit() {
        assert_eq!(
            words("smollm", "1234567"),
            ["1", "2", "3", "4", "5", "6", "7"]
        );
        assert_eq!(words("smollm", "x 42."), ["x", " ", "4", "2", "."]);
        assert_eq!(words("smollm", "٣٤"), ["٣", "٤"]);
    }

    #[test]
    fn llama3_rules() {
        assert_eq!(words("llama3", "Hello world"), ["Hello", " world"]);
        assert_eq!(words("llama3", "1234567"), ["123", "456", "7"]);
        assert_eq!(words("llama3", "DON'T we'LL"), ["DON", "'T", " we", "'LL"]);
        assert_eq!(words("llama3", "(hello)"), ["(hello", ")"]);
        assert_eq!(words("llama3", "x\n\n  y"), ["x", "\n\n", " ", " y"]);
        assert_eq!(words("llama3", "a  \n b"), ["a", "  \n", " b"]);
        assert_eq!(words("llama3", "ok!!\n\nnext"), ["ok", "!!\n\n", "next"]);
        assert_eq!(words("llama3", "\tx"), ["\tx"]);
        assert_eq!(words("llama3", "a   "), ["a", "   "]);
        assert_eq!(words("qwen2", "12 345"), ["1", "2", " ", "3", "4", "5"]);
        // Qwen 3.5: combining marks stay inside words (Qwen 2 splits them off).
        assert_eq!(words("qwen35", "ne\u{301}e x"), ["ne\u{301}e", " x"]);
        assert_eq!(words("qwen2", "ne\u{301}e x"), ["ne", "\u{301}e", " x"]);
    }

    #[test]
    fn gemma4_splits_newlines_only() {
        let p = PreTokenizer::from_name(Some("gemma4")).unwrap();
        assert!(p.escape_ws && p.whole_newlines);
        assert_eq!(words("gemma4", "a b\n\nc!\n"), ["a b", "\n\n", "c!", "\n"]);
    }

    #[test]
    fn default_and_deepseek() {
        assert_eq!(
            words("default", "a+b=1234;"),
            ["a", "+", "b", "=", "123", "4", ";"]
        );
        assert_eq!(
            words("deepseek-llm", "Hi there\r\n你好 123  "),
            ["Hi", " there", "\r", "\n", "你好", " ", "123", "  "]
        );
        assert_eq!(
            words("deepseek-coder", "x=12\n"),
            ["x", "=", "1", "2", "\n"]
        );
    }
}
