//! OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use quiver_engine::serve::SubmitError;
use serde_json::json;

/// An error answered to the client. Never a panic: every failure of a request ends here.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 naming the parameter at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("invalid_parameter"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or incorrect API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
            )
        }
    }

    pub fn model_not_found(name: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{name}` does not exist; this server serves `{served}`"),
            )
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            code: Some("not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("no route for {path}"),
            )
        }
    }

    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError {
            code: Some("method_not_allowed"),
            ..ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                format!("{method} is not allowed on {path}"),
            )
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the limit of {limit} bytes"),
            )
        }
    }

    /// The request's body did not arrive in time.
    pub fn request_timeout(limit: std::time::Duration) -> ApiError {
        ApiError {
            code: Some("request_timeout"),
            ..ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    limit.as_secs_f64()
                ),
            )
        }
    }

    pub fn shutting_down() -> ApiError {
        ApiError {
            code: Some("shutting_down"),
            retry_after: Some(5),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
            )
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The prompt (with `max_tokens`) does not fit the context: 400 naming both lengths.
    pub fn context_exceeded(
        param: &str,
        prompt: usize,
        max_tokens: Option<usize>,
        ctx: usize,
    ) -> ApiError {
        let message = match max_tokens {
            Some(m) => format!(
                "this model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens and max_tokens asks for {m} more ({} in all)",
                prompt + m
            ),
            None => format!("this model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens"),
        };
        ApiError {
            param: Some(param.to_string()),
            code: Some("context_length_exceeded"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// The prompt's text is too long for the context whatever its tokens: refused before
    /// tokenizing it. `at_least` is its least possible token count.
    pub fn context_exceeded_bytes(
        param: &str,
        at_least: usize,
        bytes: usize,
        ctx: usize,
    ) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("context_length_exceeded"),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("this model's maximum context length is {ctx} tokens, but the prompt has at least {at_least} tokens ({bytes} bytes of text)"),
            )
        }
    }

    /// The engine refused a request. `param` names the prompt's field (`messages` or `prompt`).
    pub fn from_submit(e: &SubmitError, param: &str) -> ApiError {
        match e {
            SubmitError::TooLong {
                prompt,
                max_tokens,
                ctx,
            } => ApiError::context_exceeded(param, *prompt, Some(*max_tokens), *ctx),
            SubmitError::EmptyPrompt => ApiError::invalid(param, "the prompt is empty"),
            SubmitError::BadToken { .. } => ApiError::invalid(param, e.to_string()),
            SubmitError::QueueFull(_) => ApiError {
                code: Some("rate_limit_exceeded"),
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    format!("server over capacity: {e}; retry later"),
                )
            },
            SubmitError::ShuttingDown => ApiError::shutting_down(),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        // The request log reads the cause from here.
        r.extensions_mut().insert(self);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_errors_map_to_statuses() {
        let e = ApiError::from_submit(
            &SubmitError::TooLong {
                prompt: 3000,
                max_tokens: 100,
                ctx: 2048,
            },
            "messages",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("3000") && e.message.contains("2048"),
            "{}",
            e.message
        );
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = ApiError::from_submit(&SubmitError::QueueFull(64), "prompt");
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        let r = e.into_response();
        assert_eq!(r.headers().get(header::RETRY_AFTER).unwrap(), "1");
        assert_eq!(
            ApiError::from_submit(&SubmitError::ShuttingDown, "prompt").status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ApiError::from_submit(&SubmitError::EmptyPrompt, "prompt").status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ApiError::from_submit(&SubmitError::BadToken { id: 9, n_vocab: 5 }, "prompt")
                .param
                .as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn error_bodies_are_openai_shaped() {
        let b = ApiError::invalid("temperature", "bad").body();
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "bad");
        assert!(b["error"].get("code").is_some());
        assert_eq!(ApiError::unauthorized().status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            ApiError::too_large(10).status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            ApiError::model_not_found("x", "y").status,
            StatusCode::NOT_FOUND
        );
        let e = ApiError::context_exceeded("prompt", 5000, None, 2048);
        assert!(e.message.contains("5000") && e.message.contains("2048"));
    }
}
