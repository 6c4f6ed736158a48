//! Constrained decoding's agreement protocol, on any backend: requests under a regular
//! expression (greedy) and a JSON schema (sampled at 0.9, top-k) alone, together, and together
//! with log-probabilities (which mask on the host; the others are masked where the logits
//! are) give the same tokens, and the text follows the grammar.

use quiver_engine::constraint::{special_word, ConstraintSpec, Grammars};
use quiver_engine::serve::{EngineHandle, Event, Request};
use quiver_engine::SamplerParams;
use std::sync::mpsc;

/// A made-up vocabulary of `n` ids for a synthetic model (which has none): 0 the end of
/// generation, 1–127 the ASCII bytes, the rest three or four of 32 symbols (all distinct).
pub fn made_up_vocabulary(n: u32) -> Vec<Vec<u8>> {
    const SYMBOLS: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz {}\":,";
    (0..n)
        .map(|id| match id {
            0 => special_word(0),
            1..=127 => vec![id as u8],
            _ => {
                let (mut x, len) = if id < 32768 { (id, 3) } else { (id - 32768, 4) };
                (0..len)
                    .map(|_| {
                        let c = SYMBOLS[x as usize % 32];
                        x /= 32;
                        c
                    })
                    .collect()
            }
        })
        .collect()
}

/// `ids` spelled in `words` (the end of generation, id 0, spells nothing).
pub fn spell(words: &[Vec<u8>], ids: &[u32]) -> String {
    let b: Vec<u8> = ids
        .iter()
        .filter(|&&t| t != 0)
        .flat_map(|&t| words[t as usize].clone())
        .collect();
    String::from_utf8(b).unwrap()
}

/// Runs the protocol on `h` over `prompts`; `text_of` spells a request's tokens.
pub fn agree(
    h: &EngineHandle,
    g: &Grammars,
    prompts: &[Vec<u32>],
    text_of: impl Fn(&[u32]) -> String,
) {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": false
    });
    let submit = |i: usize, logprobs: Option<usize>| {
        let (spec, temperature) = if i.is_multiple_of(2) {
            (ConstraintSpec::Regex("[a-z ]+".into()), 0.0)
        } else {
            (ConstraintSpec::JsonSchema(schema.clone()), 0.9)
        };
        let req = Request {
            prompt: prompts[i].clone(),
            sampling: SamplerParams {
                temperature,
                seed: i as u64,
                ..Default::default()
            },
            max_tokens: 24,
            stop: vec![],
            logprobs,
            prompt_logprobs: None,
            ignore_eos: true,
            constraint: Some(g.constraint(&spec).unwrap()),
            embed: None,
            cache_salt: None,
            speculative: Default::default(),
        };
        let (tx, rx) = mpsc::channel();
        h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        rx
    };
    let collect = |rx: mpsc::Receiver<Event>| {
        let mut got = Vec::new();
        for e in rx {
            match e {
                Event::Token { id, .. } => got.push(id),
                Event::Finished { .. } => return got,
                Event::Error(e) => panic!("{e}"),
                _ => {}
            }
        }
        panic!("no Finished event")
    };
    let n = prompts.len();
    let alone: Vec<Vec<u32>> = (0..n).map(|i| collect(submit(i, None))).collect();
    for (i, got) in alone.iter().enumerate() {
        let text = text_of(got);
        assert!(!got.is_empty(), "request {i} made nothing");
        if i.is_multiple_of(2) {
            assert!(
                text.chars().all(|c| c == ' ' || c.is_ascii_lowercase()),
                "request {i}: {text:?}"
            );
        } else {
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("request {i}: {text:?} is not JSON: {e}"));
            assert!(["red", "green", "blue"].contains(&v["color"].as_str().unwrap()));
            assert!(v["ok"].is_boolean(), "request {i}: {text}");
        }
    }
    for logprobs in [None, Some(1)] {
        let rxs: Vec<_> = (0..n).map(|i| submit(i, logprobs)).collect();
        for (i, rx) in rxs.into_iter().enumerate() {
            assert_eq!(collect(rx), alone[i], "request {i}, logprobs {logprobs:?}");
        }
    }
}
