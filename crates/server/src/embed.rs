//! Embeddings: OpenAI's `/v1/embeddings` and llama-server's `/embedding` (also `/embeddings`).
//! Each input is one engine request (`Request::embed`), batched with whatever else runs (a
//! batch counts as one request against the queue: [`embed`]); the
//! vector is the model's final hidden states pooled as the server was told (`--pooling`, else
//! the file's `pooling_type`, else the last token's) at unit length.

use crate::app::{check_prompt_bytes, on_cpu, AppState, St};
use crate::error::ApiError;
use crate::params::token_ids;
use crate::reqlog::ReqLog;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use quiver_engine::serve::{Event, Request, SubmitError};
use quiver_engine::SamplerParams;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Most inputs in one request (OpenAI allows 2048).
const MAX_INPUTS: usize = 2048;

/// The inputs of `field`: a string, token ids, or an array of either.
fn inputs(
    st: &AppState,
    m: &Map<String, Value>,
    field: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let n_vocab = st.handle.info().n_vocab;
    let tok = st.handle.tokenizer();
    let text = |t: &str| -> Result<Vec<u32>, ApiError> {
        check_prompt_bytes(st, t.len(), field)?;
        tok.encode(t, true, false)
            .map_err(|e| ApiError::invalid(field, format!("cannot tokenize the input: {e}")))
    };
    let list: Vec<Vec<u32>> = match m.get(field) {
        None | Some(Value::Null) => return Err(ApiError::invalid(field, format!("`{field}` is required"))),
        Some(Value::String(s)) => vec![text(s)?],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid(field, format!("`{field}` must not be empty")))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![token_ids(a, n_vocab, field)?],
        Some(Value::Array(a)) => {
            if a.len() > MAX_INPUTS {
                return Err(ApiError::invalid(field, format!("at most {MAX_INPUTS} inputs per request, not {}", a.len())));
            }
            a.iter()
                .map(|v| match v {
                    Value::String(s) => text(s),
                    Value::Array(ids) => token_ids(ids, n_vocab, field),
                    _ => Err(ApiError::invalid(field, format!("`{field}` must be a string, token ids, or an array of strings or of token-id arrays"))),
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(field, format!("`{field}` must be a string, token ids, or an array of strings or of token-id arrays")))
        }
    };
    let ctx = st.handle.info().n_ctx;
    for ids in &list {
        if ids.is_empty() {
            return Err(ApiError::invalid(field, "an input is empty"));
        }
        if ids.len() > ctx {
            return Err(ApiError::context_exceeded(field, ids.len(), None, ctx));
        }
    }
    Ok(list)
}

/// Runs every input through the engine; the vectors in input order, and the tokens read.
///
/// A batch is one request to the queue (`--max-waiting`): it is refused (429) only when its
/// first input finds the queue full. Its inputs then go to the engine at most `max_seqs` at a
/// time (as many as run at once), the next one as one ends, so that a batch of 2,048 neither
/// fills the queue nor keeps other requests out of it; an input the queue refuses meanwhile
/// waits for one of its batch to end, or for room.
async fn embed(
    st: &St,
    log: &ReqLog,
    list: Vec<Vec<u32>>,
    field: &str,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    if st.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    let tokens: usize = list.iter().map(Vec::len).sum();
    log.prompt(tokens);
    // Aborts what is still running if the client leaves first, or one input fails.
    struct Guard<'a>(&'a St, HashMap<usize, u64>);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            for &id in self.1.values() {
                self.0.handle.abort(id);
            }
        }
    }
    let n = list.len();
    let window = st.max_seqs.max(1);
    let mut guard = Guard(st, HashMap::new());
    let mut out: Vec<Option<Vec<f32>>> = vec![None; n];
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Event)>();
    let (mut next, mut done) = (0, 0);
    while done < n {
        while next < n && guard.1.len() < window {
            let req = Request {
                prompt: list[next].clone(),
                sampling: SamplerParams::greedy(),
                max_tokens: 0,
                stop: Vec::new(),
                logprobs: None,
                prompt_logprobs: None,
                ignore_eos: false,
                constraint: None,
                embed: Some(st.pooling),
                cache_salt: None,
                speculative: Default::default(),
            };
            let (tx, i) = (tx.clone(), next);
            match st
                .handle
                .submit(req, Box::new(move |ev| tx.send((i, ev)).is_ok()))
            {
                Ok(id) => {
                    guard.1.insert(i, id);
                    next += 1;
                }
                // Admitted: the rest waits for room, not refused.
                Err(SubmitError::QueueFull(_)) if next > 0 => {
                    if guard.1.is_empty() {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                    break;
                }
                Err(e) => return Err(ApiError::from_submit(&e, field)),
            }
        }
        if guard.1.is_empty() {
            continue;
        }
        let Some((i, ev)) = rx.recv().await else {
            return Err(ApiError::internal(
                "the engine dropped an embedding request",
            ));
        };
        match ev {
            Event::Embedding(e) => out[i] = Some(e),
            Event::Error(e) => return Err(ApiError::internal(format!("embedding failed: {e}"))),
            Event::Finished { .. } => {
                guard.1.remove(&i);
                if out[i].is_none() {
                    return Err(ApiError::internal(
                        "the engine ended an embedding request without a vector",
                    ));
                }
                done += 1;
            }
            _ => {}
        }
    }
    Ok((out.into_iter().flatten().collect(), tokens))
}

/// The little-endian bytes of `v` in standard base64 (OpenAI's `encoding_format: "base64"`).
fn base64_f32(v: &[f32]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

pub(crate) async fn embeddings_oai(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let (list, base64) = on_cpu(&st, body, |s, m| {
            let base64 = match m.get("encoding_format") {
                None | Some(Value::Null) => false,
                Some(Value::String(f)) if f == "float" => false,
                Some(Value::String(f)) if f == "base64" => true,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "encoding_format",
                        "`encoding_format` must be \"float\" or \"base64\"",
                    ))
                }
            };
            if !matches!(m.get("dimensions"), None | Some(Value::Null)) {
                return Err(ApiError::invalid(
                    "dimensions",
                    "`dimensions` is not supported: this model's embeddings have a fixed size",
                ));
            }
            Ok((inputs(s, &m, "input")?, base64))
        })
        .await?;
        let (vecs, tokens) = embed(&st, &log, list, "input").await?;
        let data: Vec<Value> = vecs
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let e = if base64 {
                    json!(base64_f32(v))
                } else {
                    json!(v)
                };
                json!({"object": "embedding", "index": i, "embedding": e})
            })
            .collect();
        Ok::<_, ApiError>(
            Json(json!({
                "object": "list",
                "data": data,
                "model": st.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }))
            .into_response(),
        )
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// llama-server's form: `{"content": …}` (or `input`) in, `[{"index", "embedding": [[…]]}]` out.
pub(crate) async fn embeddings_native(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let (list, field) = on_cpu(&st, body, |s, m| {
            let field = if m.contains_key("content") {
                "content"
            } else {
                "input"
            };
            Ok((inputs(s, &m, field)?, field))
        })
        .await?;
        let (vecs, _) = embed(&st, &log, list, field).await?;
        let out: Vec<Value> = vecs
            .into_iter()
            .enumerate()
            .map(|(i, v)| json!({"index": i, "embedding": [v]}))
            .collect();
        Ok::<_, ApiError>(Json(Value::Array(out)).into_response())
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::base64_f32;

    #[test]
    fn base64_is_the_little_endian_bytes() {
        // 1.0f32 = 00 00 80 3f; 1.0, -2.0 = 00 00 80 3f 00 00 00 c0.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64_f32(&[]), "");
    }
}
