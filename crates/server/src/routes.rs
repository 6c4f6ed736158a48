//! The small routes: models, health, metrics, tokenize, detokenize.

use crate::app::{body_bytes, AppState, St};
use crate::error::ApiError;
use crate::generate::render_chat;
use crate::params;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;

pub(crate) async fn list_models(State(st): State<St>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model, "object": "model", "created": st.nonce, "owned_by": "quiver", "max_model_len": st.handle.info().n_ctx})
}

pub(crate) async fn get_model(State(st): State<St>, Path(model): Path<String>) -> Response {
    if model == st.model {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::model_not_found(&model, &st.model).into_response()
    }
}

pub(crate) async fn health(State(st): State<St>) -> Response {
    if st.shutting_down.load(Ordering::SeqCst) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

pub(crate) async fn metrics_text(State(st): State<St>) -> Response {
    let s = st.handle.stats();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(&s),
    )
        .into_response()
}

/// `{"prompt"|"content": TEXT, "add_special": bool}` or `{"messages": [...]}` →
/// `{"tokens", "count", "max_model_len"}`.
pub(crate) async fn tokenize(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let tok = st.handle.tokenizer();
        let ids = if m.get("messages").is_some_and(|v| !v.is_null()) {
            let req = params::parse_chat(&m, st.handle.info().n_vocab)?;
            let agp = params::opt_bool(&m, "add_generation_prompt", true)?;
            render_chat(&st, &req, agp)?
        } else {
            let (key, text) = match (m.get("prompt"), m.get("content")) {
                (Some(Value::String(s)), _) => ("prompt", s),
                (None, Some(Value::String(s))) => ("content", s),
                _ => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "give `prompt` (or `content`) as a string, or `messages`",
                    ))
                }
            };
            let add = params::opt_bool(&m, "add_special", true)?;
            let parse_special = params::opt_bool(&m, "parse_special", true)?;
            tok.encode(text, add, parse_special)
                .map_err(|e| ApiError::invalid(key, format!("cannot tokenize: {e}")))?
        };
        Ok(Json(
            json!({"count": ids.len(), "max_model_len": st.handle.info().n_ctx, "tokens": ids}),
        )
        .into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `{"tokens": [ids]}` → `{"prompt": TEXT, "content": TEXT}`.
pub(crate) async fn detokenize(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let n_vocab = st.handle.info().n_vocab;
        let ids = match m.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&t| (t as usize) < n_vocab)
                        .map(|t| t as u32)
                })
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("`tokens` must hold token ids below {n_vocab}"),
                    )
                })?,
            _ => {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` must be an array of token ids",
                ))
            }
        };
        let text = st.handle.tokenizer().decode(&ids, false);
        Ok(Json(json!({"prompt": text, "content": text})).into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}
