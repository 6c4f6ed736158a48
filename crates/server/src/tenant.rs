//! Per-tenant prefix-cache namespaces. A request's prompt blocks are reused only by requests
//! of the same namespace, so `usage.prompt_tokens_details.cached_tokens` tells a client nothing
//! of another tenant's prompts. The namespace is the request's `cache_salt` (vLLM's field),
//! within its API key's namespace when the server isolates the cache by key
//! (`--cache-isolation key`); a request with neither shares the default namespace.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// Longest `cache_salt`, in UTF-8 bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// A request's `cache_salt`: absent (or null), or a non-empty string of at most
/// [`MAX_CACHE_SALT_BYTES`] bytes; anything else is a 400 naming the field.
pub(crate) fn parse_salt(m: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    let bad = |what: String| {
        ApiError::invalid(
            "cache_salt",
            format!("`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes, got {what}"),
        )
    };
    match m.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES => {
            Err(bad(format!("{} bytes", s.len())))
        }
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad(v.to_string().chars().take(64).collect())),
    }
}

/// The engine's salt for a request: the client's `salt`, inside the namespace of API key
/// number `key` when the cache is isolated by key. Distinct (key, salt) pairs give distinct
/// salts: the key's number ends at the first NUL or at the end.
pub(crate) fn engine_salt(key: Option<usize>, salt: Option<&str>) -> Option<String> {
    match (key, salt) {
        (None, salt) => salt.map(str::to_string),
        (Some(k), None) => Some(format!("key {k}")),
        (Some(k), Some(s)) => Some(format!("key {k}\0{s}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        json!({ "cache_salt": v }).as_object().unwrap().clone()
    }

    #[test]
    fn salts_are_non_empty_bounded_strings() {
        assert_eq!(parse_salt(&Map::new()).unwrap(), None);
        assert_eq!(parse_salt(&body(Value::Null)).unwrap(), None);
        assert_eq!(
            parse_salt(&body(json!("tenant-a"))).unwrap().as_deref(),
            Some("tenant-a")
        );
        let long = "x".repeat(MAX_CACHE_SALT_BYTES);
        assert_eq!(parse_salt(&body(json!(long))).unwrap(), Some(long));
        for bad in [
            json!(""),
            json!("x".repeat(MAX_CACHE_SALT_BYTES + 1)),
            json!(7),
            json!(["a"]),
        ] {
            let e = parse_salt(&body(bad.clone())).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.param.as_deref(), Some("cache_salt"), "{bad}");
        }
    }

    #[test]
    fn every_key_and_salt_pair_is_its_own_namespace() {
        let pairs = [
            (None, None),
            (None, Some("a")),
            (Some(0), None),
            (Some(0), Some("a")),
            (Some(1), None),
            (Some(1), Some("a")),
            (Some(10), None),
            (Some(1), Some("0")),
            (Some(1), Some("a\0b")),
            (Some(1), Some("a")),
        ];
        let salts: Vec<_> = pairs.iter().map(|&(k, s)| engine_salt(k, s)).collect();
        assert_eq!(salts[0], None, "no key, no salt: the shared namespace");
        assert_eq!(salts[1].as_deref(), Some("a"));
        for i in 0..pairs.len() {
            for j in 0..i {
                assert_eq!(salts[i] == salts[j], pairs[i] == pairs[j], "{i} {j}");
            }
        }
    }
}
