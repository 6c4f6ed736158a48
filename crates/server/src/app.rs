//! The state every handler shares, the router, and helpers of the handlers.

use crate::auth::auth;
use crate::cpu::CpuPool;
use crate::error::ApiError;
use crate::generate::{chat_completions, completions};
use crate::metrics::Metrics;
use crate::reqlog::observe;
use crate::routes::{detokenize, get_model, health, list_models, metrics_text, tokenize};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest};
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use quiver_engine::serve::EngineHandle;
use quiver_tokenizer::chat::ChatTemplate;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

pub(crate) struct AppState {
    pub(crate) handle: EngineHandle,
    pub(crate) model: String,
    pub(crate) keys: Vec<String>,
    pub(crate) template: Arc<ChatTemplate>,
    pub(crate) max_body: usize,
    pub(crate) metrics: Metrics,
    pub(crate) shutting_down: AtomicBool,
    pub(crate) next_id: AtomicU64,
    /// Numbers request ids (`x-request-id`, the request log).
    pub(crate) next_request: AtomicU64,
    pub(crate) nonce: u64,
    /// Where requests' CPU work runs.
    pub(crate) cpu: CpuPool,
    /// The longest token in bytes ([`crate::cpu::max_token_bytes`]).
    pub(crate) max_token_bytes: usize,
}

pub(crate) type St = Arc<AppState>;

pub(crate) fn router(state: St) -> Router {
    let limit = state.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|req: HttpRequest| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

pub(crate) fn body_bytes(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    match body {
        Ok(b) => Ok(b),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            Err(ApiError::too_large(st.max_body))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "cannot read the request body: {e}"
        ))),
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Refuses, before tokenizing it, a text of `bytes` bytes that cannot fit the context: every
/// token covers at most `max_token_bytes` bytes, so it has at least `bytes / max_token_bytes`
/// tokens. (A vocabulary that drops bytes it cannot encode may in fact give fewer; such text
/// is mostly lost anyway.)
pub(crate) fn check_prompt_bytes(st: &AppState, bytes: usize, param: &str) -> Result<(), ApiError> {
    let ctx = st.handle.info().n_ctx;
    let at_least = bytes / st.max_token_bytes.max(1);
    if at_least >= ctx {
        Err(ApiError::context_exceeded_bytes(
            param, at_least, bytes, ctx,
        ))
    } else {
        Ok(())
    }
}
