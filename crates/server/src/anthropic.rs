//! Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`. A request
//! is translated into a chat-completions body (system, messages with text, `tool_use` and
//! `tool_result` blocks, tools with `input_schema`, `tool_choice`, `stop_sequences`,
//! `output_config.format`) and runs as `/v1/chat/completions` runs it ([`crate::turn`]); the
//! answer comes back as a message with content blocks, `stop_reason` and `usage`, whole or
//! streamed as Anthropic's events.
//! Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`.

use crate::app::{on_cpu, AppState, St};
use crate::error::ApiError;
use crate::generate::{prepare_chat, render_chat};
use crate::reqlog::ReqLog;
use crate::turn::{arguments_object, Part, Stop, Turn, Whole};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request as HttpRequest, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Whether a path is one of the Messages API's (its errors take Anthropic's shape).
fn is_messages_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    p == "/messages" || p.starts_with("/messages/")
}

/// Anthropic's error type for a status.
fn error_type(status: u16) -> &'static str {
    match status {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An error's body in Anthropic's shape. The field at fault leads the message, as
/// Anthropic's own messages name it (`max_tokens: Field required`).
pub(crate) fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status.as_u16()), "message": message}})
}

/// Gives the errors of the Messages paths Anthropic's shape, whatever answered them (the
/// handlers, the API key check, the body limits).
pub(crate) async fn error_shape(req: HttpRequest, next: Next) -> Response {
    let ours = is_messages_path(req.uri().path());
    let res = next.run(req).await;
    if !ours {
        return res;
    }
    let Some(e) = res.extensions().get::<ApiError>().cloned() else {
        return res;
    };
    let (mut parts, _) = res.into_parts();
    let body = error_body(&e).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// A field's error in Anthropic's dotted path (`messages.0.content.1.type`).
fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// The text of a `system` or `tool_result` content: a string, or text blocks joined.
fn text_of(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => {
                        if !out.is_empty() {
                            out.push('\n');
                        }
                        out.push_str(t);
                    }
                    (Some("text"), _) => {
                        return Err(bad(
                            &format!("{param}.{i}.text"),
                            "a text block needs a string `text`",
                        ))
                    }
                    (Some(t), _) => {
                        return Err(bad(
                            &format!("{param}.{i}.type"),
                            format!("blocks of type `{t}` are not supported here; only `text`"),
                        ))
                    }
                    (None, _) => {
                        return Err(bad(
                            &format!("{param}.{i}.type"),
                            "each block needs a `type`",
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(param, "must be a string or an array of text blocks")),
    }
}

/// One Anthropic message as chat messages: a user turn's `tool_result` blocks become `tool`
/// messages (first, as Anthropic puts them), its text a user message; an assistant turn's
/// text and `tool_use` blocks one assistant message with `tool_calls`.
fn message(v: &Value, i: usize, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let param = format!("messages.{i}");
    let Some(o) = v.as_object() else {
        return Err(bad(&param, "each message must be an object"));
    };
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => {
            return Err(bad(
                &format!("{param}.role"),
                format!("unknown role `{r}`: messages are `user` or `assistant` (the system prompt is the top-level `system`)"),
            ))
        }
        None => return Err(bad(&format!("{param}.role"), "each message needs a `role`")),
    };
    let blocks = match o.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(bad(
                &format!("{param}.content"),
                "`content` must be a string or an array of content blocks",
            ))
        }
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}.content.{j}");
        let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
        match (role, kind) {
            (_, "text") => match b.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => {
                    return Err(bad(
                        &format!("{bp}.text"),
                        "a text block needs a string `text`",
                    ))
                }
            },
            ("assistant", "tool_use") => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(bad(&bp, "a `tool_use` block needs `id` and `name`"));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("user", "tool_result") => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(bad(&bp, "a `tool_result` block needs `tool_use_id`"));
                };
                let mut content = text_of(
                    b.get("content").unwrap_or(&Value::Null),
                    &format!("{bp}.content"),
                )?;
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            // Earlier thinking is not sent back to the model (as the chat templates drop it).
            ("assistant", "thinking" | "redacted_thinking") => {}
            (_, "image" | "document") => {
                return Err(bad(
                    &format!("{bp}.type"),
                    format!("`{kind}` blocks are not supported: this server runs a text model"),
                ))
            }
            (_, "") => return Err(bad(&format!("{bp}.type"), "each block needs a `type`")),
            (r, k) => {
                return Err(bad(
                    &format!("{bp}.type"),
                    format!("blocks of type `{k}` are not supported in a `{r}` message"),
                ))
            }
        }
    }
    if role == "assistant" {
        let mut m = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        out.push(m);
    } else if !text.is_empty() || !out.last().is_some_and(|m| m["role"] == "tool") {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// Anthropic's tools and `tool_choice` as chat's.
fn tools(m: &Map<String, Value>, o: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(t) = m.get("tools").filter(|v| !v.is_null()) {
        let Some(list) = t.as_array() else {
            return Err(bad("tools", "`tools` must be an array"));
        };
        let mut fs = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(k) => {
                    return Err(bad(
                        &format!("tools.{i}.type"),
                        format!("tools of type `{k}` (Anthropic's own tools) are not supported; give client tools with `name` and `input_schema`"),
                    ))
                }
            }
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                return Err(bad(&format!("tools.{i}.name"), "each tool needs a `name`"));
            };
            let schema = match t.get("input_schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => {
                    return Err(bad(
                        &format!("tools.{i}.input_schema"),
                        "each tool needs an `input_schema` object",
                    ))
                }
            };
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description").filter(|d| d.is_string()) {
                f["description"] = d.clone();
            }
            fs.push(json!({"type": "function", "function": f}));
        }
        o.insert("tools".into(), Value::Array(fs));
    }
    if let Some(c) = m.get("tool_choice").filter(|v| !v.is_null()) {
        let choice = match c.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match c.get("name").and_then(Value::as_str) {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => {
                    return Err(bad(
                        "tool_choice.name",
                        "`tool_choice` of type `tool` needs a `name`",
                    ))
                }
            },
            _ => {
                return Err(bad(
                    "tool_choice.type",
                    "`tool_choice.type` must be `auto`, `any`, `tool` or `none`",
                ))
            }
        };
        if c.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            o.insert("parallel_tool_calls".into(), json!(false));
        }
        o.insert("tool_choice".into(), choice);
    }
    Ok(())
}

/// A Messages request as a chat-completions body. `count_only` (count_tokens) does not need
/// `max_tokens`.
pub(crate) fn to_chat(
    m: &Map<String, Value>,
    count_only: bool,
) -> Result<Map<String, Value>, ApiError> {
    let mut o = Map::new();
    match m.get("max_tokens") {
        None | Some(Value::Null) if !count_only => return Err(bad("max_tokens", "Field required")),
        None | Some(Value::Null) => {}
        Some(v) => {
            if v.as_u64().is_none_or(|n| n == 0) {
                return Err(bad(
                    "max_tokens",
                    format!("must be a positive integer, got {v}"),
                ));
            }
            if !count_only {
                o.insert("max_tokens".into(), v.clone());
            }
        }
    }
    let mut msgs = Vec::new();
    match m.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => {
            let text = text_of(s, "system")?;
            msgs.push(json!({"role": "system", "content": text}));
        }
    }
    match m.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => {
            for (i, v) in a.iter().enumerate() {
                message(v, i, &mut msgs)?;
            }
        }
        Some(Value::Array(_)) => return Err(bad("messages", "`messages` must not be empty")),
        None | Some(Value::Null) => return Err(bad("messages", "Field required")),
        Some(_) => return Err(bad("messages", "`messages` must be an array")),
    }
    o.insert("messages".into(), Value::Array(msgs));
    match m.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            o.insert("stop".into(), Value::Array(a.clone()));
        }
        Some(_) => {
            return Err(bad(
                "stop_sequences",
                "`stop_sequences` must be an array of strings",
            ))
        }
    }
    for k in ["model", "stream", "temperature", "top_p", "top_k"] {
        if let Some(v) = m.get(k).filter(|v| !v.is_null()) {
            o.insert(k.into(), v.clone());
        }
    }
    tools(m, &mut o)?;
    // Structured output: `output_config.format` of type `json_schema`.
    if let Some(f) = m
        .get("output_config")
        .and_then(|c| c.get("format"))
        .filter(|v| !v.is_null())
    {
        match (f.get("type").and_then(Value::as_str), f.get("schema")) {
            (Some("json_schema"), Some(schema @ Value::Object(_))) => {
                o.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}}),
                );
            }
            (Some("json_schema"), _) => {
                return Err(bad(
                    "output_config.format.schema",
                    "a `json_schema` format needs a `schema` object",
                ))
            }
            _ => {
                return Err(bad(
                    "output_config.format.type",
                    "`output_config.format.type` must be `json_schema`",
                ))
            }
        }
    }
    Ok(o)
}

/// Errors of the chat parse, named by the Messages fields they came from.
fn renamed(mut e: ApiError) -> ApiError {
    let to = match e.param.as_deref() {
        Some("stop") => "stop_sequences",
        Some("response_format") => "output_config.format",
        _ => return e,
    };
    let from = e.param.replace(to.to_string()).unwrap_or_default();
    e.message = e.message.replace(&format!("`{from}`"), &format!("`{to}`"));
    e
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop_reason(s: &Stop) -> (&'static str, Value) {
    match s {
        Stop::EndTurn | Stop::Abort => ("end_turn", Value::Null),
        Stop::Sequence(q) => ("stop_sequence", json!(q)),
        Stop::Length => ("max_tokens", Value::Null),
        Stop::ToolCalls => ("tool_use", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` are the prompt's tokens not read from the prefix cache,
/// `cache_read_input_tokens` those that were.
fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt - cached.min(prompt),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
}

fn tool_use(id: &str, i: usize, name: &str, args: &str) -> Value {
    json!({"type": "tool_use", "id": format!("toolu_{}_{i}", id.trim_start_matches("msg_")), "name": name, "input": arguments_object(args)})
}

/// The whole message of a turn.
pub(crate) fn message_json(id: &str, model: &str, w: &Whole) -> Value {
    let mut content = Vec::new();
    if let Some(r) = w.reasoning.as_ref().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if !w.text.is_empty() {
        content.push(json!({"type": "text", "text": w.text}));
    }
    for (i, (name, args)) in w.calls.iter().enumerate() {
        content.push(tool_use(id, i, name, args));
    }
    let (reason, seq) = stop_reason(&w.end.stop);
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": reason, "stop_sequence": seq,
        "usage": usage(w.end.prompt_tokens, w.end.cached_tokens, w.end.completion_tokens),
    })
}

/// The kind of the content block open in a stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Open {
    Text,
    Thinking,
}

/// Turns a turn's parts into Anthropic's stream events (name, data).
pub(crate) struct Events {
    id: String,
    model: String,
    started: bool,
    /// The prompt's length, for `message_start` when the engine's count has not come.
    prompt: usize,
    open: Option<Open>,
    next_index: usize,
}

impl Events {
    pub(crate) fn new(id: String, model: String, prompt: usize) -> Events {
        Events {
            id,
            model,
            started: false,
            prompt,
            open: None,
            next_index: 0,
        }
    }

    fn start(&mut self, out: &mut Vec<(&'static str, Value)>, prompt: usize, cached: usize) {
        if self.started {
            return;
        }
        self.started = true;
        out.push((
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": usage(prompt, cached, 0),
            }}),
        ));
        out.push(("ping", json!({"type": "ping"})));
    }

    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if self.open.take().is_some() {
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.next_index - 1}),
            ));
        }
    }

    /// Opens a block of `kind` unless one is open: its index.
    fn open(&mut self, out: &mut Vec<(&'static str, Value)>, kind: Open) -> usize {
        if self.open == Some(kind) {
            return self.next_index - 1;
        }
        self.close(out);
        let block = match kind {
            Open::Text => json!({"type": "text", "text": ""}),
            Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
        };
        let index = self.next_index;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        self.next_index += 1;
        self.open = Some(kind);
        index
    }

    pub(crate) fn on(&mut self, part: Part) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let prompt = self.prompt;
        match part {
            Part::Started {
                prompt_tokens,
                cached,
            } => self.start(&mut out, prompt_tokens, cached),
            Part::Reasoning(r) => {
                self.start(&mut out, prompt, 0);
                let index = self.open(&mut out, Open::Thinking);
                out.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": r}})));
            }
            Part::Text(t) => {
                self.start(&mut out, prompt, 0);
                let index = self.open(&mut out, Open::Text);
                out.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}})));
            }
            Part::Calls(calls) => {
                self.start(&mut out, prompt, 0);
                self.close(&mut out);
                for (i, (name, args)) in calls.iter().enumerate() {
                    let mut block = tool_use(&self.id, i, name, args);
                    let input = block["input"].to_string();
                    block["input"] = json!({});
                    let index = self.next_index;
                    self.next_index += 1;
                    out.push(("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": block})));
                    out.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": input}})));
                    out.push((
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    ));
                }
            }
            Part::End(e) => {
                self.start(&mut out, e.prompt_tokens, e.cached_tokens);
                self.close(&mut out);
                let (reason, seq) = stop_reason(&e.stop);
                out.push((
                    "message_delta",
                    json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": usage(e.prompt_tokens, e.cached_tokens, e.completion_tokens),
                    }),
                ));
                out.push(("message_stop", json!({"type": "message_stop"})));
            }
            Part::Failed(e) => out.push(("error", error_body(&e))),
        }
        out
    }
}

fn next_id(st: &AppState) -> String {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    format!("msg_{:x}{:06x}", st.nonce, n)
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let (p, ids) = on_cpu(&st, body, |s, m| {
            prepare_chat(s, to_chat(&m, false)?).map_err(renamed)
        })
        .await?;
        let prompt = ids.len();
        let turn = Turn::start(&st, &log, &p, ids).await?;
        let id = next_id(&st);
        log.submitted(&id);
        if !p.stream {
            let w = turn.whole().await?;
            return Ok(Json(message_json(&id, &st.model, &w)).into_response());
        }
        let events = Events::new(id, st.model.clone(), prompt);
        let s = futures_util::stream::unfold(
            (turn, events, std::collections::VecDeque::new()),
            |(mut turn, mut ev, mut pending)| async move {
                loop {
                    if let Some((name, data)) = pending.pop_front() {
                        let e = SseEvent::default()
                            .event(name)
                            .data(Value::to_string(&data));
                        return Some((Ok::<_, Infallible>(e), (turn, ev, pending)));
                    }
                    for part in turn.next().await? {
                        pending.extend(ev.on(part));
                    }
                }
            },
        );
        Ok::<_, ApiError>(Sse::new(s).into_response())
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt's tokens as
/// `/v1/messages` would render them.
pub(crate) async fn count_tokens(
    State(st): State<St>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = on_cpu(&st, body, |s, m| {
        let chat = to_chat(&m, true)?;
        let req = crate::params::parse_chat(&chat, s.handle.info().n_vocab).map_err(renamed)?;
        let ids = render_chat(s, &req, true)?;
        Ok(json!({"input_tokens": ids.len()}))
    })
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests;
