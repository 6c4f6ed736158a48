//! One log line per request (target `quiver_server::request`): request id, method, route,
//! HTTP status, token counts and timings; at info when it succeeded, at warn for a 4xx and at
//! error for a 5xx or a generation that failed mid-stream, then with the cause.
//!
//! The middleware [`observe`] puts a [`ReqLog`] into the request's extensions; generation
//! handlers fill it in as events arrive. The line is written when the last holder lets go:
//! at the end of the middleware for whole responses, at the end of the body for streams (so a
//! stream's line has its token counts and total time).

use crate::app::St;
use crate::error::ApiError;
use axum::extract::{MatchedPath, Request as HttpRequest, State};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The response header that carries the request id.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// What one request did, logged when it is dropped.
pub struct ReqLog {
    id: String,
    method: Method,
    route: String,
    t0: Instant,
    inner: Mutex<Inner>,
    /// The number of the API key the request came with, when the server keeps the prefix
    /// cache apart by key (`crate::tenant`; set by `crate::auth`, not logged).
    cache_key: std::sync::OnceLock<usize>,
}

#[derive(Default)]
struct Inner {
    status: Option<u16>,
    completion_id: Option<String>,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    generated_tokens: Option<usize>,
    ttft_ms: Option<f64>,
    finish_reason: Option<&'static str>,
    generating: bool,
    error: Option<String>,
    code: Option<&'static str>,
}

fn ms(t0: Instant) -> f64 {
    (t0.elapsed().as_secs_f64() * 10_000.0).round() / 10.0
}

impl ReqLog {
    pub fn new(id: String, method: Method, route: String) -> ReqLog {
        ReqLog {
            id,
            method,
            route,
            t0: Instant::now(),
            inner: Mutex::new(Inner::default()),
            cache_key: std::sync::OnceLock::new(),
        }
    }

    /// The request's prefix cache is API key number `key`'s.
    pub fn set_cache_key(&self, key: usize) {
        let _ = self.cache_key.set(key);
    }

    /// The API key whose prefix cache the request uses (None: no isolation by key).
    pub fn cache_key(&self) -> Option<usize> {
        self.cache_key.get().copied()
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    fn with(&self, f: impl FnOnce(&mut Inner)) {
        if let Ok(mut i) = self.inner.lock() {
            f(&mut i)
        }
    }

    /// The prompt is tokenized: its length (before the engine answers with the real count).
    pub fn prompt(&self, tokens: usize) {
        self.with(|i| i.prompt_tokens = Some(tokens));
    }

    /// The engine took the request.
    pub fn submitted(&self, completion_id: &str) {
        self.with(|i| {
            i.generating = true;
            i.completion_id = Some(completion_id.to_string());
            i.generated_tokens = Some(0);
        });
    }

    /// A token arrived; the first sets the time to first token.
    pub fn token(&self) {
        let now = ms(self.t0);
        self.with(|i| {
            i.ttft_ms.get_or_insert(now);
            *i.generated_tokens.get_or_insert(0) += 1;
        });
    }

    pub fn finished(&self, reason: &'static str, prompt: usize, generated: usize, cached: usize) {
        self.with(|i| {
            i.finish_reason = Some(reason);
            i.prompt_tokens = Some(prompt);
            i.generated_tokens = Some(generated);
            i.cached_tokens = Some(cached);
        });
    }

    /// A failure after the status was sent (a stream's error event).
    pub fn failed(&self, cause: &str) {
        self.with(|i| {
            i.finish_reason = Some("error");
            i.error = Some(cause.to_string());
        });
    }

    fn respond(&self, status: u16, err: Option<&ApiError>) {
        self.with(|i| {
            i.status = Some(status);
            if let Some(e) = err {
                i.error = Some(e.message.clone());
                i.code = e.code;
            } else if status >= 400 && i.error.is_none() {
                i.error = Some(
                    axum::http::StatusCode::from_u16(status)
                        .ok()
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("error")
                        .to_string(),
                );
            }
        });
    }
}

impl Drop for ReqLog {
    fn drop(&mut self) {
        let total_ms = ms(self.t0);
        let i = match self.inner.get_mut() {
            Ok(i) => i,
            Err(p) => p.into_inner(),
        };
        if i.generating && i.finish_reason.is_none() {
            // Dropped before the engine finished: the client went away.
            i.finish_reason = Some("disconnected");
        }
        let status = i.status.unwrap_or(0);
        macro_rules! line {
            ($lvl:expr) => {
                tracing::event!(
                    target: "quiver_server::request",
                    $lvl,
                    id = %self.id,
                    method = %self.method,
                    route = %self.route,
                    status,
                    completion_id = i.completion_id.as_deref(),
                    prompt_tokens = i.prompt_tokens,
                    cached_tokens = i.cached_tokens,
                    generated_tokens = i.generated_tokens,
                    ttft_ms = i.ttft_ms,
                    total_ms,
                    finish_reason = i.finish_reason,
                    error = i.error.as_deref(),
                    code = i.code,
                    "request"
                )
            };
        }
        if status >= 500 || i.finish_reason == Some("error") {
            line!(tracing::Level::ERROR)
        } else if status >= 400 {
            line!(tracing::Level::WARN)
        } else {
            line!(tracing::Level::INFO)
        }
    }
}

/// Counts responses by route and status (metrics), gives every request an id (answered in
/// `x-request-id`) and a [`ReqLog`].
pub(crate) async fn observe(State(st): State<St>, mut req: HttpRequest, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "other".to_string());
    let n = st.next_request.fetch_add(1, Ordering::Relaxed);
    let id = format!("req-{:x}{:06x}", st.nonce, n);
    let log = Arc::new(ReqLog::new(id, req.method().clone(), route.clone()));
    req.extensions_mut().insert(log.clone());
    let mut r = next.run(req).await;
    let status = r.status().as_u16();
    st.metrics.request(&route, status);
    log.respond(status, r.extensions().get::<ApiError>());
    if let Ok(v) = HeaderValue::from_str(log.id()) {
        r.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    r
}
