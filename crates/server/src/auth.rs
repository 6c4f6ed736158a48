//! API keys: `Authorization: Bearer KEY`.

use crate::app::St;
use crate::error::ApiError;
use axum::extract::{Request as HttpRequest, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Keys guard everything but `/health` (`/v1/health`) and `/metrics`.
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
        .map(str::trim);
    match given {
        Some(k)
            if st
                .keys
                .iter()
                .any(|key| ct_eq(key.as_bytes(), k.as_bytes())) =>
        {
            next.run(req).await
        }
        _ => ApiError::unauthorized().into_response(),
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
