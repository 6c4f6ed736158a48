//! The state every handler shares, the router, and helpers of the handlers.

use crate::auth::auth;
use crate::conn::Conns;
use crate::cpu::CpuPool;
use crate::error::ApiError;
use crate::generate::{chat_completions, completions};
use crate::metrics::Metrics;
use crate::reqlog::observe;
use crate::routes::{
    apply_template, detokenize, get_model, health, list_models, metrics_text, props, tokenize,
};
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::StatusCode;
use axum::http::{header, HeaderValue};
use axum::middleware;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use quiver_engine::serve::EngineHandle;
use quiver_tokenizer::chat::ChatTemplate;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct AppState {
    pub(crate) handle: EngineHandle,
    pub(crate) model: String,
    pub(crate) keys: Vec<String>,
    /// Each API key has a prefix cache of its own (`crate::tenant`).
    pub(crate) cache_by_key: bool,
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
    /// Sequences the engine runs at once (`/props`' slots).
    pub(crate) max_seqs: usize,
    /// How embeddings pool a text's hidden states.
    pub(crate) pooling: quiver_engine::embed::Pooling,
    /// Origins allowed by CORS (`*`: any).
    pub(crate) allowed_origins: Vec<String>,
    /// Defaults of generation requests that leave a field out (`quiver serve -n`, `--temp` …).
    pub(crate) defaults: crate::RequestDefaults,
    /// The vocabulary indexed for constrained decoding (None: a model without a vocabulary).
    pub(crate) grammars: Option<Arc<quiver_engine::constraint::Grammars>>,
    /// Time a request's body has to arrive once its headers have.
    pub(crate) read_timeout: Duration,
    pub(crate) conns: Arc<Conns>,
    /// The web chat page is served at `/` (`crate::webui`).
    pub(crate) webui: bool,
}

pub(crate) type St = Arc<AppState>;

/// The router the accept loop serves from the start: the server's once it is set, before that
/// 503 `Loading model` (llama-server's answer while it loads) to every request.
pub(crate) fn gate(app: Arc<std::sync::OnceLock<Router>>) -> Router {
    Router::new().fallback(move |req: HttpRequest| {
        let app = app.clone();
        async move {
            match app.get() {
                // (A Router is always ready: no poll_ready needed before the call.)
                Some(r) => match tower_service::Service::call(&mut r.clone(), req).await {
                    Ok(res) => res,
                    Err(never) => match never {},
                },
                None => ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable_error",
                    "Loading model",
                )
                .into_response(),
            }
        }
    })
}

pub(crate) fn router(state: St) -> Router {
    let limit = state.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/v1/responses", post(crate::responses::responses))
        // The same without `/v1`, as llama-server serves them (`/embeddings` is its own shape).
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/messages", post(crate::anthropic::messages))
        .route(
            "/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/responses", post(crate::responses::responses))
        .route("/models", get(list_models))
        .route("/models/{model}", get(get_model))
        .route("/completion", post(crate::native::completion))
        .route("/infill", post(crate::native::infill))
        .route("/v1/embeddings", post(crate::embed::embeddings_oai))
        .route("/embedding", post(crate::embed::embeddings_native))
        .route("/embeddings", post(crate::embed::embeddings_native))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/apply-template", post(apply_template))
        .route("/props", get(props))
        .route("/slots", get(crate::routes::slots))
        .route("/metrics", get(metrics_text))
        .fallback(|req: HttpRequest| async move { ApiError::not_found(req.uri().path()) })
        .method_not_allowed_fallback(|req: HttpRequest| async move {
            ApiError::method_not_allowed(req.method().as_str(), req.uri().path())
        })
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(crate::anthropic::error_shape))
        // The page's static files: outside the key check (a browser opening the page sends none).
        .merge(if state.webui {
            crate::webui::router()
        } else {
            Router::new()
        })
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::cors::cors,
        ))
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

/// A request's JSON body, read and handed to `f` on the CPU pool (parsing and tokenizing
/// never run on the async runtime); `f`'s result or the first error.
pub(crate) async fn on_cpu<T: Send + 'static>(
    st: &St,
    body: Result<Bytes, BytesRejection>,
    f: impl FnOnce(&AppState, serde_json::Map<String, serde_json::Value>) -> Result<T, ApiError>
        + Send
        + 'static,
) -> Result<T, ApiError> {
    let b = body_bytes(st, body)?;
    let s = st.clone();
    st.cpu
        .run(b.len(), move || f(&s, crate::params::parse_body(&b)?))
        .await
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

/// Reads a request's whole body within `read_timeout` of its headers (else 408 and the
/// connection is closed) and at most `max_body` bytes of it (else 413), before the handler.
/// A `Content-Length` past `max_body` is refused from the headers, before any of the body.
async fn read_body(State(st): State<St>, req: HttpRequest, next: Next) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > st.max_body as u64) {
        if n <= 2 * st.max_body as u64 {
            // A body a little over: read and dropped (within the read timeout), so that the
            // client, still sending it, gets the answer rather than a reset.
            let mut body = req.into_body();
            let drain = async { while let Some(Ok(_)) = body.frame().await {} };
            let _ = tokio::time::timeout(st.read_timeout, drain).await;
        }
        let mut r = ApiError::too_large(st.max_body).into_response();
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    let (parts, body) = req.into_parts();
    let whole = parts.extensions.get::<crate::conn::Whole>().cloned();
    let read = Limited::new(body, st.max_body).collect();
    let bytes = match tokio::time::timeout(st.read_timeout, read).await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return ApiError::too_large(st.max_body).into_response()
        }
        Ok(Err(e)) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response()
        }
        Err(_) => {
            let mut r = ApiError::request_timeout(st.read_timeout).into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    // A whole request: its connection is no longer displaced at the cap.
    if let Some(w) = whole {
        w.mark();
    }
    next.run(HttpRequest::from_parts(parts, Body::from(bytes)))
        .await
}
