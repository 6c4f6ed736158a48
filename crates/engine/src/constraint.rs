//! Constrained decoding with llguidance: a request's output held to a JSON schema, any JSON
//! object, a Lark grammar or a regular expression. [`Grammars`] indexes the model's vocabulary
//! once (the bytes of every token; special tokens marked so that no grammar can spell them);
//! [`Constraint`] is one request's matcher: before each token it masks the logits of every
//! token the grammar cannot take next, after it consumes the token drawn. When the grammar is
//! complete only the end-of-generation tokens remain allowed, and the request ends there.
//! JSON output (schemas, `json_object`, the tool-call grammars) follows quiver's JSON rules
//! (`json_rules`): object schemas closed unless they say otherwise, numbers' digits bounded.

use crate::json_rules;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

/// What a request's output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`, `guided_json`).
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect (`grammar`, `guided_grammar`).
    Lark(String),
    /// A Lark grammar whose output is JSON values (`%json`) between literals holding no `"`
    /// (the tool-call grammars): its numbers' digits are bounded as a schema's are.
    JsonLark(String),
    /// A Lark grammar whose output is free text until the marker (the second string), then
    /// as [`ConstraintSpec::JsonLark`]'s (`tool_choice: auto`'s calls): digits bounded after it.
    JsonLarkAfter(String, String),
    /// A regular expression over the whole output (`guided_regex`).
    Regex(String),
}

/// The model's vocabulary indexed for llguidance, made once per model.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    eog: Vec<u32>,
    primary_eos: u32,
    vocab: Arc<JsonVocab>,
}

/// What the digit bound reads of the vocabulary: each token's bytes (a special token's marked),
/// the tokens that start with digits and how many, the most any starts with.
struct JsonVocab {
    words: Vec<Box<[u8]>>,
    leads: Vec<(u32, u8)>,
    longest: usize,
}

impl Grammars {
    /// Indexes `tok`'s vocabulary; None for a model without one.
    pub fn new(tok: &Tokenizer) -> Option<Grammars> {
        let n = tok.n_vocab();
        if n == 0 {
            return None;
        }
        let eog: Vec<u32> = tok.eog_ids().collect();
        let primary_eos = tok.eos().or_else(|| eog.first().copied())?;
        let specials: std::collections::HashSet<u32> =
            tok.special_tokens().iter().map(|(id, _)| *id).collect();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_piece_bytes(id);
                if specials.contains(&id) || tok.is_control(id) || bytes.is_empty() {
                    special_word(id)
                } else {
                    bytes.into_owned()
                }
            })
            .collect();
        Grammars::from_words(&words, eog, primary_eos, tok.bos())
    }

    /// A vocabulary given as each token's bytes (a special token's start with
    /// `TokTrie::SPECIAL_TOKEN_MARKER`), its end-of-generation tokens (`primary_eos` the one
    /// the grammar ends with) and BOS: a tokenizer's ([`Grammars::new`]) or a made-up one (the
    /// synthetic models of the GPU tests have none). None: llguidance refused it.
    pub fn from_words(
        words: &[Vec<u8>],
        eog: Vec<u32>,
        primary_eos: u32,
        bos: Option<u32>,
    ) -> Option<Grammars> {
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: primary_eos,
            tok_bos: bos,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).ok()?;
        factory.quiet();
        let leads: Vec<(u32, u8)> = words
            .iter()
            .enumerate()
            .map(|(id, w)| (id as u32, json_rules::leading_digits(w)))
            .filter(|&(_, n)| n > 0)
            .collect();
        let longest = leads.iter().map(|&(_, n)| n as usize).max().unwrap_or(0);
        let vocab = JsonVocab {
            words: words.iter().map(|w| w.clone().into_boxed_slice()).collect(),
            leads,
            longest,
        };
        Some(Grammars {
            factory: Arc::new(factory),
            eog,
            primary_eos,
            vocab: Arc::new(vocab),
        })
    }

    /// A fresh matcher for `spec`; Err (the grammar compiler's message) for an invalid
    /// schema or grammar.
    pub fn constraint(&self, spec: &ConstraintSpec) -> Result<Constraint, String> {
        let grammar = match spec {
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            ConstraintSpec::JsonSchema(s) => {
                let mut s = s.clone();
                json_rules::close_objects(&mut s);
                TopLevelGrammar::from_json_schema(compact(s))
            }
            ConstraintSpec::Lark(g)
            | ConstraintSpec::JsonLark(g)
            | ConstraintSpec::JsonLarkAfter(g, _) => TopLevelGrammar::from_lark(g.clone()),
            ConstraintSpec::Regex(r) => TopLevelGrammar::from_regex(r),
        };
        let json = !matches!(spec, ConstraintSpec::Lark(_) | ConstraintSpec::Regex(_));
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            m,
            eog: self.eog.clone(),
            primary_eos: self.primary_eos,
            digits: json.then(|| {
                let d = match spec {
                    ConstraintSpec::JsonLarkAfter(_, marker) => json_rules::Digits::after(marker),
                    _ => json_rules::Digits::default(),
                };
                (d, self.vocab.clone())
            }),
        })
    }
}

/// A special token's entry in [`Grammars::from_words`]: marked, so that no grammar's text
/// matches it.
pub fn special_word(id: u32) -> Vec<u8> {
    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    w.extend_from_slice(format!("<[{id}]>").as_bytes());
    w
}

/// JSON without free whitespace between tokens (as OpenAI's structured outputs write it), unless
/// the schema sets llguidance's own options (`x-guidance`): a small model left free to add
/// whitespace may add nothing else.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    m: Matcher,
    eog: Vec<u32>,
    primary_eos: u32,
    /// JSON output: the digit bound's state.
    digits: Option<(json_rules::Digits, Arc<JsonVocab>)>,
}

impl Constraint {
    /// The tokens the grammar allows next, as the bits of `n_vocab` logits
    /// ([`quiver_backend::Backend::mask_rows`]'s; Err: the matcher failed). It depends only
    /// on the tokens taken so far: the serving loop computes it while the step's forward pass
    /// runs. Where the grammar may end, every end-of-generation token is allowed with the
    /// primary EOS (the trie marks the others special); rows past the trie's vocabulary
    /// (padding of the output matrix) never are.
    pub fn next_mask(&mut self, n_vocab: usize) -> Result<Vec<u32>, String> {
        let vob = self.m.compute_mask().map_err(|e| e.to_string())?;
        let mut bits = vec![0u32; n_vocab.div_ceil(32)];
        let n = vob.len().min(n_vocab);
        let src = vob.as_slice();
        let whole = n / 32;
        bits[..whole].copy_from_slice(&src[..whole]);
        if !n.is_multiple_of(32) {
            bits[whole] = src[whole] & ((1u32 << (n % 32)) - 1);
        }
        if vob.is_allowed(self.primary_eos) {
            for &id in &self.eog {
                if (id as usize) < n_vocab {
                    bits[id as usize / 32] |= 1 << (id % 32);
                }
            }
        }
        if let Some((d, v)) = &self.digits {
            d.restrict(&mut bits, &v.leads, v.longest);
        }
        Ok(bits)
    }

    /// Takes the token drawn. An end-of-generation token ends the grammar.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        let t = if self.eog.contains(&token) {
            self.primary_eos
        } else {
            token
        };
        if let Some((d, v)) = &mut self.digits {
            if let Some(w) = v.words.get(token as usize) {
                d.push(w, w.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER));
            }
        }
        self.m.consume_token(t).map_err(|e| e.to_string())
    }

    /// The grammar has ended (its end-of-generation token was taken): the request ends.
    pub fn done(&self) -> bool {
        self.m.is_stopped()
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A made-up vocabulary and a "model" that takes the first token of a fixed preference
    /// list the mask allows: it would invent keys and write digits for ever if let.
    fn run(spec: &ConstraintSpec) -> String {
        let words: Vec<Vec<u8>> = [
            "9", ",", "\"x\"", ":", "\"age\"", "\"", "{", "}", "age", "x", "1",
        ]
        .iter()
        .map(|w| w.as_bytes().to_vec())
        .chain([special_word(11)])
        .collect();
        let g = Grammars::from_words(&words, vec![11], 11, None).unwrap();
        let mut c = g.constraint(spec).unwrap();
        let mut out = String::new();
        for _ in 0..200 {
            let bits = c.next_mask(words.len()).unwrap();
            let allowed = |id: usize| bits[id / 32] & (1 << (id % 32)) != 0;
            let id = (0..words.len()).find(|&i| allowed(i)).expect("a token");
            c.commit(id as u32).unwrap();
            if id == 11 {
                return out;
            }
            out.push_str(std::str::from_utf8(&words[id]).unwrap());
            if c.done() {
                return out;
            }
        }
        panic!("no end: {out}")
    }

    #[test]
    fn schemas_are_closed_and_numbers_bounded() {
        let schema = json!({"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]});
        let nines = "9".repeat(json_rules::MAX_DIGITS);
        assert_eq!(
            run(&ConstraintSpec::JsonSchema(schema)),
            format!("{{\"age\":{nines}}}")
        );
        // Said open, it stays open (and the invented key's number is bounded too).
        let open = json!({"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"], "additionalProperties": {"type": "integer"}, "maxProperties": 2});
        assert_eq!(
            run(&ConstraintSpec::JsonSchema(open)),
            format!("{{\"age\":{nines},\"x\":{nines}}}")
        );
        // The same rules in a tool-call grammar.
        let lark = format!(
            "start: \"{{\" call \"}}\"\ncall: %json {}\n",
            json!({"type": "object", "properties": {"age": {"type": "number"}}, "required": ["age"], "additionalProperties": false})
        );
        let out = run(&ConstraintSpec::JsonLark(lark.clone()));
        assert!(out.len() < 60 && out.contains(&nines), "{out}");
        // A plain Lark grammar is the client's: nothing is added.
        let free = run(&ConstraintSpec::Lark("start: /9{0,40}/".into()));
        assert_eq!(free, "9".repeat(40));
    }
}
