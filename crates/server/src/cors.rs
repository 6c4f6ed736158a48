//! CORS, so that a page in a browser can call the server (llama-server and vLLM allow every
//! origin by default; `--allowed-origins` narrows it). A preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) is answered here, before the API key is checked (browsers
//! send no credentials with it); other requests from an allowed origin get
//! `Access-Control-Allow-Origin` on their response.

use crate::app::St;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The warning for a server that listens beyond loopback with neither API keys nor an origin
/// list: anyone who reaches the address, and any web page in a browser that does, may use it.
pub(crate) fn exposure_warning(
    addr: std::net::SocketAddr,
    keys: &[String],
    origins: &[String],
) -> Option<String> {
    let loopback = addr.ip().is_loopback()
        || matches!(addr.ip(), std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()));
    (!loopback && keys.is_empty() && origins.iter().any(|o| o == "*")).then(|| {
        format!(
            "listening on {addr}, beyond loopback, with no API key and CORS open to every origin: any host that reaches it, and any web page in a browser that does, can use the server; give --api-key (or --api-key-file) or --allowed-origins"
        )
    })
}

/// True when `origin` may call: every origin with `*` in the list, else an exact match.
fn allowed(list: &[String], origin: &str) -> bool {
    list.iter().any(|o| o == "*" || o == origin)
}

pub(crate) async fn cors(State(st): State<St>, req: HttpRequest, next: Next) -> Response {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Some(origin) = origin.filter(|o| allowed(&st.allowed_origins, o)) else {
        return next.run(req).await;
    };
    let allow = HeaderValue::from_str(&origin).unwrap_or(HeaderValue::from_static("*"));
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let headers = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static("*"));
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, headers);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("86400"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        return r;
    }
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    r
}

#[cfg(test)]
mod tests {
    use super::{allowed, exposure_warning};

    #[test]
    fn beyond_loopback_without_keys_or_origins_is_warned() {
        let any = vec!["*".to_string()];
        let some = vec!["https://a.example".to_string()];
        let key = vec!["k".to_string()];
        let at = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        assert!(exposure_warning(at("0.0.0.0:8080"), &[], &any).is_some());
        assert!(exposure_warning(at("[::]:8080"), &[], &any).is_some());
        assert!(exposure_warning(at("192.168.1.5:8080"), &[], &any).is_some());
        assert!(exposure_warning(at("127.0.0.1:8080"), &[], &any).is_none());
        assert!(exposure_warning(at("[::1]:8080"), &[], &any).is_none());
        assert!(exposure_warning(at("[::ffff:127.0.0.1]:8080"), &[], &any).is_none());
        assert!(exposure_warning(at("0.0.0.0:8080"), &key, &any).is_none());
        assert!(exposure_warning(at("0.0.0.0:8080"), &[], &some).is_none());
    }

    #[test]
    fn origins_match_exactly_or_by_star() {
        let any = vec!["*".to_string()];
        let some = vec!["https://a.example".to_string()];
        assert!(allowed(&any, "https://x.example"));
        assert!(allowed(&some, "https://a.example"));
        assert!(!allowed(&some, "https://a.example.evil"));
        assert!(!allowed(&[], "https://a.example"));
    }
}
