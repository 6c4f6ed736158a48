//! The small routes: models, health, metrics, tokenize, detokenize.

use crate::app::{check_prompt_bytes, on_cpu, AppState, St};
use crate::error::ApiError;
use crate::generate::render_chat;
use crate::params;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
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
        st.metrics.render(&s)
            + &connection_metrics(&st)
            + &st.metrics.render_peer_names(&s, &st.model),
    )
        .into_response()
}

/// Prometheus lines of the connections.
fn connection_metrics(st: &AppState) -> String {
    let c = &st.conns;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    metric(
        "quiver_connections_open",
        "gauge",
        "Open HTTP connections.",
        c.open() as u64,
    );
    metric(
        "quiver_connections_max",
        "gauge",
        "Most open HTTP connections (--max-connections).",
        c.limits().max as u64,
    );
    metric(
        "quiver_connections_accepted_total",
        "counter",
        "Connections accepted and served.",
        n(&c.accepted),
    );
    metric(
        "quiver_connections_rejected_total",
        "counter",
        "Connections answered 503 at the cap, every connection busy.",
        n(&c.rejected),
    );
    metric(
        "quiver_connections_evicted_total",
        "counter",
        "Connections without a request in progress closed to make room at the cap.",
        n(&c.evicted),
    );
    metric(
        "quiver_connections_timed_out_total",
        "counter",
        "Connections closed for not sending a request's headers in time or idling too long.",
        n(&c.timed_out),
    );
    out
}

/// vLLM's form `{"prompt": TEXT, "add_special_tokens": true}`, llama-server's
/// `{"content": TEXT, "add_special": false, "parse_special": true, "with_pieces": false}` (each
/// with its own defaults), or `{"messages": [...]}` → `{"tokens", "count", "max_model_len"}`;
/// with `with_pieces` each token is `{"id", "piece"}` (the piece as text, or its bytes where
/// they are not UTF-8), as llama-server gives them.
pub(crate) async fn tokenize(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    json_on_cpu(st, body, tokenize_body).await
}

/// A JSON endpoint whose work runs on the CPU pool: `f`'s JSON or its error.
async fn json_on_cpu(
    st: St,
    body: Result<Bytes, BytesRejection>,
    f: impl FnOnce(&AppState, Map<String, Value>) -> Result<Value, ApiError> + Send + 'static,
) -> Response {
    match on_cpu(&st, body, f).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn tokenize_body(s: &AppState, m: Map<String, Value>) -> Result<Value, ApiError> {
    let tok = s.handle.tokenizer();
    let ids = if m.get("messages").is_some_and(|v| !v.is_null()) {
        let req = params::parse_chat(&m, s.handle.info().n_vocab)?;
        let agp = params::opt_bool(&m, "add_generation_prompt", true)?;
        render_chat(s, &req, agp)?
    } else {
        let (key, text) = match (m.get("prompt"), m.get("content")) {
            (Some(Value::String(t)), _) => ("prompt", t),
            (None, Some(Value::String(t))) => ("content", t),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "give `prompt` (or `content`) as a string, or `messages`",
                ))
            }
        };
        // llama-server adds no special tokens unless asked; vLLM adds them.
        let llama = key == "content";
        let add = if llama {
            params::opt_bool(&m, "add_special", false)?
        } else {
            let d = params::opt_bool(&m, "add_special", true)?;
            params::opt_bool(&m, "add_special_tokens", d)?
        };
        let parse_special = params::opt_bool(&m, "parse_special", true)?;
        check_prompt_bytes(s, text.len(), key)?;
        let ids = tok
            .encode(text, add, parse_special)
            .map_err(|e| ApiError::invalid(key, format!("cannot tokenize: {e}")))?;
        if params::opt_bool(&m, "with_pieces", false)? {
            let pieces: Vec<Value> = ids
                .iter()
                .map(|&id| {
                    let b = tok.token_bytes(id).unwrap_or(&[]);
                    let piece = match std::str::from_utf8(b) {
                        Ok(t) => json!(t),
                        Err(_) => json!(b),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect();
            return Ok(
                json!({"count": ids.len(), "max_model_len": s.handle.info().n_ctx, "tokens": pieces}),
            );
        }
        ids
    };
    Ok(json!({"count": ids.len(), "max_model_len": s.handle.info().n_ctx, "tokens": ids}))
}

/// `{"tokens": [ids]}` → `{"prompt": TEXT, "content": TEXT}`.
/// Most bytes of text `/detokenize` answers for a body of `body` bytes: as many as the body,
/// and at least 256 KiB (a context of ordinary tokens), so that a body of ids of the longest
/// tokens cannot make the answer many times its size.
fn detokenize_cap(body: usize) -> usize {
    body.max(256 << 10)
}

pub(crate) async fn detokenize(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let cap = detokenize_cap(body.as_ref().map_or(0, Bytes::len));
    json_on_cpu(st, body, move |s, m| {
        let n_vocab = s.handle.info().n_vocab;
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
        let tok = s.handle.tokenizer();
        // Counted before decoding: each token's text at most its bytes.
        let bytes: usize = ids
            .iter()
            .map(|&t| tok.token_bytes(t).map_or(0, <[u8]>::len))
            .sum();
        if bytes > cap {
            return Err(ApiError::invalid(
                "tokens",
                format!("the text of these tokens takes up to {bytes} bytes; a request of this size gets at most {cap}"),
            ));
        }
        let text = tok.decode(&ids, false);
        Ok(json!({"prompt": text, "content": text}))
    })
    .await
}

/// llama-server's `/apply-template`: `{"messages": [...]}` (and `tools`,
/// `add_generation_prompt`, default true, `chat_template_kwargs`) → `{"prompt": the rendered
/// text}`, a last assistant message continued as a chat request's is.
pub(crate) async fn apply_template(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    json_on_cpu(st, body, |s, m| {
        let req = params::parse_chat(&m, s.handle.info().n_vocab)?;
        let agp = params::opt_bool(&m, "add_generation_prompt", true)?;
        let kwargs = crate::compat::template_kwargs(&m)?;
        // As a chat request renders it: a last assistant message continued.
        let (messages, prefill) = crate::generate::prefill_split(&req.messages, agp);
        let mut prompt = s
            .template
            .render_with(messages, agp, req.tools.as_ref(), kwargs.as_ref())
            .map_err(|e| {
                ApiError::invalid(
                    "messages",
                    format!("the chat template cannot render these messages: {e}"),
                )
            })?;
        prompt.push_str(prefill.unwrap_or(""));
        Ok(json!({"prompt": prompt}))
    })
    .await
}

/// llama-server's `/props`: the served model, its context, slots and chat template.
pub(crate) async fn props(State(st): State<St>) -> Response {
    let info = st.handle.info();
    let tok = st.handle.tokenizer();
    let text = |id: Option<u32>| id.map(|i| tok.decode(&[i], false)).unwrap_or_default();
    // The defaults of requests that leave fields out (`quiver serve --temp`, `-n` …).
    let mut params = json!({"temperature": 1.0, "top_p": 1.0});
    for (k, v) in &st.defaults.fields {
        params[k.as_str()] = v.clone();
    }
    if let Some(n) = st.defaults.max_tokens {
        params["n_predict"] = json!(if n == 0 { -1 } else { n as i64 });
    }
    Json(json!({
        "default_generation_settings": {"n_ctx": info.n_ctx, "params": params},
        "total_slots": st.max_seqs,
        "model_alias": st.model,
        "model": info.name,
        "chat_template": st.template.source().unwrap_or("(built in)"),
        "bos_token": text(tok.bos()),
        "eos_token": text(tok.eos()),
        "build_info": concat!("quiver ", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}

/// llama-server's `/slots`: one entry per sequence the engine runs at once (`--max-seqs`), the
/// running requests in the first ones, oldest first (quiver's sequences are not pinned to
/// slots: a request's slot number can change between calls): its engine id (`id_task`),
/// prompt tokens, those found in the prefix cache, positions cached (`n_past`) and tokens
/// generated (`next_token.n_decoded`).
pub(crate) async fn slots(State(st): State<St>) -> Response {
    let s = st.handle.stats();
    let n_ctx = st.handle.info().n_ctx;
    let v: Vec<Value> = (0..st.max_seqs)
        .map(|i| match s.requests.get(i) {
            Some(r) => json!({
                "id": i,
                "id_task": r.id,
                "n_ctx": n_ctx,
                "speculative": false,
                "is_processing": true,
                "n_past": r.n_past,
                "n_prompt_tokens": r.prompt_tokens,
                "n_prompt_tokens_cache": r.cached_tokens,
                "next_token": {"has_next_token": true, "n_decoded": r.generated_tokens},
            }),
            None => json!({
                "id": i,
                "id_task": -1,
                "n_ctx": n_ctx,
                "speculative": false,
                "is_processing": false,
                "n_past": 0,
                "next_token": {"has_next_token": false, "n_decoded": 0},
            }),
        })
        .collect();
    Json(Value::Array(v)).into_response()
}
