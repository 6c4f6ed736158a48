//! API keys: `Authorization: Bearer KEY`, or `x-api-key: KEY` (Anthropic's clients).

use crate::app::St;
use crate::error::ApiError;
use crate::reqlog::ReqLog;
use axum::extract::{Request as HttpRequest, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Keys guard everything but `/health` (`/v1/health`) and `/metrics`. With the cache isolated by
/// key, the request's log records which key it came with (its prefix-cache namespace).
pub(crate) async fn auth(State(st): State<St>, req: HttpRequest, next: Next) -> Response {
    let path = req.uri().path();
    if st.keys.is_empty() || path == "/health" || path == "/v1/health" || path == "/metrics" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        // Anthropic's clients send the key as `x-api-key`.
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    // Every key is compared (no early exit on a match either).
    let found = given.and_then(|k| {
        st.keys
            .iter()
            .enumerate()
            .map(|(i, key)| (i, ct_eq(key.as_bytes(), k.as_bytes())))
            .fold(None, |first, (i, eq)| first.or(eq.then_some(i)))
    });
    match found {
        Some(i) => {
            if st.cache_by_key {
                if let Some(log) = req.extensions().get::<Arc<ReqLog>>() {
                    log.set_cache_key(i);
                }
            }
            next.run(req).await
        }
        None => ApiError::unauthorized().into_response(),
    }
}

/// The credentials of a `Bearer` authorization; the scheme is case-insensitive (RFC 7235).
fn bearer(v: &str) -> Option<&str> {
    let (scheme, rest) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(rest)
}

/// Compares without an early exit on the first differing byte.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_compare() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }
}
