//! The web chat page at `/` (`crates/server/web/`), built into the binary: HTML, one ES module
//! for the chat and one for its Markdown, a style sheet and an icon. Served without the API key
//! (a browser cannot send one when it opens the page; the page asks for it and sends it with its
//! API calls), under a Content-Security-Policy that lets the page load and call only its own
//! origin. `quiver serve --no-webui` leaves these routes out (`/` is then a 404).

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// Scripts, styles, images and API calls from the page's own origin only; no inline script or
/// style, no plugins, no frames, no forms posted anywhere.
pub(crate) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../web/index.html"),
    },
    Asset {
        path: "/index.html",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../web/index.html"),
    },
    Asset {
        path: "/webui/app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/app.js"),
    },
    Asset {
        path: "/webui/markdown.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/markdown.js"),
    },
    Asset {
        path: "/webui/style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../web/style.css"),
    },
    Asset {
        path: "/webui/icon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../web/icon.svg"),
    },
];

fn respond(a: &'static Asset) -> Response {
    let h = |v: &'static str| HeaderValue::from_static(v);
    let headers: [(HeaderName, HeaderValue); 6] = [
        (header::CONTENT_TYPE, h(a.content_type)),
        (header::CONTENT_SECURITY_POLICY, h(CSP)),
        (header::X_CONTENT_TYPE_OPTIONS, h("nosniff")),
        (header::REFERRER_POLICY, h("no-referrer")),
        (header::X_FRAME_OPTIONS, h("DENY")),
        // Revalidated each time: a new binary serves new files at the same paths.
        (header::CACHE_CONTROL, h("no-cache")),
    ];
    (headers, a.body).into_response()
}

/// The page's routes (GET and HEAD), to merge outside the API key check.
pub(crate) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS
        .iter()
        .fold(Router::new(), |r, a| {
            r.route(a.path, get(move || async move { respond(a) }))
        })
        .method_not_allowed_fallback(|req: axum::extract::Request| async move {
            crate::error::ApiError::method_not_allowed(req.method().as_str(), req.uri().path())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_reference_only_their_own_files() {
        let html = std::str::from_utf8(ASSETS[0].body).unwrap();
        for r in ["/webui/app.js", "/webui/style.css", "/webui/icon.svg"] {
            assert!(html.contains(&format!("\"{r}\"")), "{r}");
        }
        let app = std::str::from_utf8(ASSETS[2].body).unwrap();
        assert!(app.contains("from './markdown.js'"));
        for a in ASSETS {
            let text = std::str::from_utf8(a.body).unwrap();
            // No other origin (the page loads nothing from elsewhere), no inline script or style
            // the CSP would block, no HTML written from strings.
            let no_ns = text.replace("http://www.w3.org/2000/svg", "");
            assert!(!no_ns.contains("://"), "an absolute URL in {}", a.path);
            let html_sinks = [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
            ];
            for sink in html_sinks {
                assert!(!text.contains(sink), "{sink} in {}", a.path);
            }
            assert!(!text.contains("style=\""), "{}", a.path);
            if a.content_type.starts_with("text/html") {
                assert!(!text.contains("<script>"), "inline script in {}", a.path);
                assert!(!text.contains("<style"), "inline style in {}", a.path);
            }
        }
    }
}
