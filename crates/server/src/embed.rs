//! Embeddings: OpenAI's `/v1/embeddings` and llama-server's `/embedding` (also `/embeddings`).
//! Each input is one engine request (`Request::embed`), batched with whatever else runs; the
//! vector is the model's final hidden states pooled as the server was told (`--pooling`, else
//! the file's `pooling_type`, else the last token's) at unit length.

use crate::app::{check_prompt_bytes, on_cpu, AppState, St};
use crate::error::ApiError;
use crate::generate::check_model_name;
use crate::params::token_ids;
use crate::reqlog::ReqLog;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use quiver_engine::serve::{Event, Request};
use quiver_engine::SamplerParams;
use serde_json::{json, Map, Value};
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
    let mut rxs = Vec::with_capacity(list.len());
    let mut ids = Vec::with_capacity(list.len());
    for prompt in list {
        let (tx, rx) = mpsc::unbounded_channel();
        let req = Request {
            prompt,
            sampling: SamplerParams::greedy(),
            max_tokens: 0,
            stop: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            ignore_eos: false,
            constraint: None,
            embed: Some(st.pooling),
        };
        match st
            .handle
            .submit(req, Box::new(move |ev| tx.send(ev).is_ok()))
        {
            Ok(id) => ids.push(id),
            Err(e) => {
                for &id in &ids {
                    st.handle.abort(id);
                }
                return Err(ApiError::from_submit(&e, field));
            }
        }
        rxs.push(rx);
    }
    // Aborts what is still running if the client leaves first.
    struct Guard<'a>(&'a St, Vec<u64>);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            for &id in &self.1 {
                self.0.handle.abort(id);
            }
        }
    }
    let mut guard = Guard(st, ids);
    let mut out = Vec::with_capacity(rxs.len());
    for mut rx in rxs {
        let mut v = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Embedding(e) => v = Some(e),
                Event::Error(e) => {
                    return Err(ApiError::internal(format!("embedding failed: {e}")))
                }
                Event::Finished { .. } => break,
                _ => {}
            }
        }
        match v {
            Some(v) => out.push(v),
            None => {
                return Err(ApiError::internal(
                    "the engine ended an embedding request without a vector",
                ))
            }
        }
    }
    guard.1.clear();
    Ok((out, tokens))
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
            check_model_name(s, m.get("model").and_then(Value::as_str))?;
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
