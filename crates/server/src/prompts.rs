//! `/v1/completions` with a list of prompts: each prompt its own body, parsed and tokenized as
//! one, its `n` choices generated; the answer is one response whose choices are prompt i's
//! choice j at index i × n + j, usage summed over the prompts (each counted once).

use crate::app::{unix_now, St};
use crate::error::ApiError;
use crate::generate::{submit, Kind};
use crate::output::{whole_json, Out};
use crate::params::{GenParams, MAX_N};
use crate::reqlog::ReqLog;
use crate::stream::stream_groups;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Most choices of one request over all its prompts (prompts × `n`).
pub const MAX_CHOICES: usize = 16 * MAX_N;

/// The body of each prompt: one body when `prompt` is one prompt (a string, token ids, or a
/// one-element list of either), else one per element of a list of strings or of token-id
/// lists, with `prompt` set to it.
pub(crate) fn split(m: &Map<String, Value>) -> Result<Vec<Map<String, Value>>, ApiError> {
    let list = match m.get("prompt") {
        Some(Value::Array(a)) if a.len() > 1 && !a[0].is_number() => a,
        _ => return Ok(vec![m.clone()]),
    };
    let n = match m.get("n") {
        Some(v) => v.as_u64().unwrap_or(1).max(1) as usize,
        None => 1,
    };
    if list.len().saturating_mul(n) > MAX_CHOICES {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{} prompts × n = {n} is more than {MAX_CHOICES} choices in one request",
                list.len()
            ),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::String(_) | Value::Array(_) => {
                let mut one = m.clone();
                one.insert("prompt".into(), json!([p]));
                Ok(one)
            }
            _ => Err(ApiError::invalid(
                "prompt",
                format!("`prompt[{i}]` must be a string or an array of token ids, as the others"),
            )),
        })
        .collect()
}

/// Generates every prompt's choices (`prompts`: ids and the echoed text) as one response.
pub(crate) async fn generate_many(
    st: St,
    log: Arc<ReqLog>,
    prompts: Vec<(Vec<u32>, Option<String>)>,
    p: GenParams,
) -> Result<Response, ApiError> {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("cmpl-{:x}{:06x}", st.nonce, n);
    let created = unix_now();
    let mut groups = Vec::with_capacity(prompts.len());
    for (ids, echo) in prompts {
        let echo_ids = match (&echo, p.logprobs) {
            (Some(_), Some(_)) => ids.clone(),
            _ => Vec::new(),
        };
        let prompt_logprobs = echo.as_ref().and(p.logprobs);
        let gens = submit(&st, &log, ids, &p, "prompt", prompt_logprobs, 16).await?;
        let out = Out {
            st: st.clone(),
            kind: Kind::Completion,
            id: id.clone(),
            created,
            logprobs: p.logprobs.is_some(),
            text_offset: 0,
            echo_ids,
            tools: None,
            thinking: None,
        };
        groups.push((gens, out, echo));
    }
    log.submitted(&id);
    if p.stream {
        return Ok(stream_groups(groups, p.include_usage));
    }
    let wholes = futures_util::future::join_all(
        groups
            .into_iter()
            .map(|(gens, out, echo)| whole_json(gens, out, echo)),
    )
    .await;
    let mut parts = Vec::with_capacity(wholes.len());
    for w in wholes {
        parts.push(w?);
    }
    Ok(Json(merge(parts)).into_response())
}

/// One response of the prompts' responses: their choices one after the other, re-indexed,
/// their usage summed.
pub(crate) fn merge(parts: Vec<Value>) -> Value {
    let mut it = parts.into_iter();
    let Some(mut first) = it.next() else {
        return json!({});
    };
    let mut index = first["choices"].as_array().map_or(0, Vec::len);
    for v in it {
        for mut c in v["choices"].as_array().cloned().unwrap_or_default() {
            c["index"] = json!(index);
            index += 1;
            if let Some(a) = first["choices"].as_array_mut() {
                a.push(c);
            }
        }
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            let sum = first["usage"][k].as_u64().unwrap_or(0) + v["usage"][k].as_u64().unwrap_or(0);
            first["usage"][k] = json!(sum);
        }
        let k = "/usage/prompt_tokens_details/cached_tokens";
        let cached = first.pointer(k).and_then(Value::as_u64).unwrap_or(0)
            + v.pointer(k).and_then(Value::as_u64).unwrap_or(0);
        first["usage"]["prompt_tokens_details"]["cached_tokens"] = json!(cached);
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_list_of_prompts_is_one_body_each() {
        for one in [
            json!("hi"),
            json!(["hi"]),
            json!([1, 2, 3]),
            json!([[1, 2]]),
        ] {
            let m = obj(json!({"prompt": one, "max_tokens": 3}));
            assert_eq!(split(&m).unwrap(), vec![m.clone()]);
        }
        let b = split(&obj(json!({"prompt": ["a", [5, 6], "c"], "n": 2}))).unwrap();
        let ps: Vec<Value> = b.iter().map(|m| m["prompt"].clone()).collect();
        assert_eq!(ps, [json!(["a"]), json!([[5, 6]]), json!(["c"])]);
        assert!(b.iter().all(|m| m["n"] == 2));
        let e = split(&obj(json!({"prompt": ["a", 5]}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("prompt[1]"), "{}", e.message);
        let many = vec![json!("x"); MAX_CHOICES / 2 + 1];
        let e = split(&obj(json!({"prompt": many, "n": 2}))).unwrap_err();
        assert!(e.message.contains("choices"), "{}", e.message);
    }

    #[test]
    fn responses_merge_in_order() {
        let part = |texts: &[&str], p: u64, c: u64, cached: u64| {
            let choices: Vec<Value> = texts
                .iter()
                .enumerate()
                .map(|(i, t)| json!({"index": i, "text": t}))
                .collect();
            json!({"id": "cmpl-1", "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": {"cached_tokens": cached}}})
        };
        let m = merge(vec![part(&["a", "b"], 5, 4, 1), part(&["c", "d"], 7, 3, 2)]);
        let got: Vec<(u64, &str)> = m["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
            .collect();
        assert_eq!(got, [(0, "a"), (1, "b"), (2, "c"), (3, "d")]);
        assert_eq!(
            m["usage"],
            json!({"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 3}})
        );
    }
}
