//! OpenAI's Responses API, stateless: `POST /v1/responses`. A request (`input` as text or
//! items, `instructions`, function tools, `tool_choice`, `text.format`, `max_output_tokens`)
//! is translated into a chat-completions body and runs as `/v1/chat/completions` runs it
//! ([`crate::turn`]); the answer comes back as output items (a message with `output_text`,
//! `function_call`s), whole or streamed as the Responses events with sequence numbers.
//! Nothing is stored: `previous_response_id` and `conversation` are refused.

use crate::app::{on_cpu, unix_now, AppState, St};
use crate::error::ApiError;
use crate::generate::prepare_chat;
use crate::reqlog::ReqLog;
use crate::turn::{Part, Stop, Turn, Whole};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn present<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

/// The text of a message item's `content`: a string, or its text parts joined.
fn content_text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text")) {
                    ("input_text" | "output_text" | "text", Some(Value::String(t))) => {
                        out.push_str(t)
                    }
                    ("input_text" | "output_text" | "text", _) => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{i}].text"),
                            "a text part needs a string `text`",
                        ))
                    }
                    ("refusal", _) => {}
                    ("input_image" | "input_file" | "input_audio", _) => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{i}].type"),
                            format!(
                                "`{kind}` parts are not supported: this server runs a text model"
                            ),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{i}].type"),
                            format!("unknown content part type `{kind}` (input_text, output_text)"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::invalid(
            param,
            "`content` must be a string or an array of text parts",
        )),
    }
}

/// `input` as chat messages: a string is one user message; items are messages,
/// `function_call`s (joined into the assistant message before them) and
/// `function_call_output`s (`tool` messages).
fn input_messages(v: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match v {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(a) if !a.is_empty() => a,
        Value::Array(_) => return Err(ApiError::invalid("input", "`input` must not be empty")),
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or an array of items",
            ))
        }
    };
    for (i, it) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let Some(o) = it.as_object() else {
            return Err(ApiError::invalid(
                &param,
                "each input item must be an object",
            ));
        };
        let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = match o.get("role").and_then(Value::as_str) {
                    Some(r @ ("user" | "assistant" | "system")) => r,
                    Some("developer") => "system",
                    Some(r) => {
                        return Err(ApiError::invalid(
                            &format!("{param}.role"),
                            format!("unknown role `{r}` (user, assistant, system, developer)"),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{param}.role"),
                            "a message item needs a `role`",
                        ))
                    }
                };
                let text = content_text(o.get("content"), &format!("{param}.content"))?;
                out.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (
                    o.get("call_id").and_then(Value::as_str),
                    o.get("name").and_then(Value::as_str),
                ) else {
                    return Err(ApiError::invalid(
                        &param,
                        "a `function_call` item needs `call_id` and `name`",
                    ));
                };
                let args = match o.get("arguments") {
                    None | Some(Value::Null) => "{}".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                };
                let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let Some(call_id) = o.get("call_id").and_then(Value::as_str) else {
                    return Err(ApiError::invalid(
                        &param,
                        "a `function_call_output` item needs `call_id`",
                    ));
                };
                let output = content_text(o.get("output"), &format!("{param}.output"))?;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            // Earlier reasoning is not sent back to the model (as the chat templates drop it).
            "reasoning" => {}
            "item_reference" => {
                return Err(ApiError::invalid(
                    &format!("{param}.type"),
                    "`item_reference` is not supported: this server stores nothing; send the items themselves",
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("{param}.type"),
                    format!("input items of type `{other}` are not supported (message, function_call, function_call_output)"),
                ))
            }
        }
    }
    Ok(())
}

/// `tools` (function tools, in the Responses' flat shape) and `tool_choice` as chat's.
fn tools(m: &Map<String, Value>, o: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(t) = present(m, "tools") {
        let Some(list) = t.as_array() else {
            return Err(ApiError::invalid("tools", "`tools` must be an array"));
        };
        let mut fs = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(k) => {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}].type"),
                        format!("tools of type `{k}` are not supported; only `function`"),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}].type"),
                        "each tool needs a `type` (`function`)",
                    ))
                }
            }
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].name"),
                    "each function tool needs a `name`",
                ));
            };
            let mut f = json!({"name": name});
            for k in ["description", "parameters", "strict"] {
                if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                    f[k] = v.clone();
                }
            }
            fs.push(json!({"type": "function", "function": f}));
        }
        o.insert("tools".into(), Value::Array(fs));
    }
    if let Some(c) = present(m, "tool_choice") {
        let choice = match c {
            Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => c.clone(),
            Value::Object(_) if c.get("type").and_then(Value::as_str) == Some("function") => {
                match c.get("name").and_then(Value::as_str) {
                    Some(n) => json!({"type": "function", "function": {"name": n}}),
                    None => {
                        return Err(ApiError::invalid(
                            "tool_choice",
                            "a function `tool_choice` needs a `name`",
                        ))
                    }
                }
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be `auto`, `none`, `required` or {\"type\": \"function\", \"name\": ...}",
                ))
            }
        };
        o.insert("tool_choice".into(), choice);
    }
    Ok(())
}

/// `text.format` as chat's `response_format`.
fn text_format(m: &Map<String, Value>, o: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(t) = present(m, "text") else {
        return Ok(());
    };
    let Some(f) = t.get("format").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let rf = match f.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(()),
        Some("json_object") => json!({"type": "json_object"}),
        Some("json_schema") => {
            let Some(schema) = f.get("schema").filter(|v| !v.is_null()) else {
                return Err(ApiError::invalid(
                    "text.format.schema",
                    "`text.format` of type `json_schema` needs a `schema`",
                ));
            };
            let mut js = json!({"name": f.get("name").cloned().unwrap_or(json!("response")), "schema": schema});
            if let Some(s) = f.get("strict").filter(|v| !v.is_null()) {
                js["strict"] = s.clone();
            }
            json!({"type": "json_schema", "json_schema": js})
        }
        _ => {
            return Err(ApiError::invalid(
                "text.format.type",
                "`text.format.type` must be `text`, `json_object` or `json_schema`",
            ))
        }
    };
    o.insert("response_format".into(), rf);
    Ok(())
}

/// A Responses request as a chat-completions body.
pub(crate) fn to_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    for (k, why) in [
        ("previous_response_id", "this server stores no responses (`store` is false): send the whole conversation in `input`"),
        ("conversation", "this server stores no conversations: send the whole conversation in `input`"),
        ("prompt", "stored prompts are not supported: send `instructions` and `input`"),
    ] {
        if present(m, k).is_some() {
            return Err(ApiError::invalid(k, format!("`{k}` is not supported: {why}")));
        }
    }
    let logprobs = present(m, "include")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|v| v == "message.output_text.logprobs"));
    if logprobs || present(m, "top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        let k = if logprobs { "include" } else { "top_logprobs" };
        return Err(ApiError::invalid(
            k,
            "log-probabilities are not served on /v1/responses: use /v1/chat/completions with `logprobs`",
        ));
    }
    if present(m, "background") == Some(&Value::Bool(true)) {
        return Err(ApiError::invalid(
            "background",
            "`background` is not supported: this server stores no responses",
        ));
    }
    let mut msgs = Vec::new();
    match present(m, "instructions") {
        None => {}
        Some(Value::String(s)) => msgs.push(json!({"role": "system", "content": s})),
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "`instructions` must be a string",
            ))
        }
    }
    match present(m, "input") {
        None => return Err(ApiError::invalid("input", "`input` is required")),
        Some(v) => input_messages(v, &mut msgs)?,
    }
    let mut o = Map::new();
    o.insert("messages".into(), Value::Array(msgs));
    if let Some(v) = present(m, "max_output_tokens") {
        o.insert("max_tokens".into(), v.clone());
    }
    for k in [
        "model",
        "stream",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "seed",
        "cache_salt",
    ] {
        if let Some(v) = present(m, k) {
            o.insert(k.into(), v.clone());
        }
    }
    tools(m, &mut o)?;
    text_format(m, &mut o)?;
    Ok(o)
}

/// Errors of the chat parse, named by the Responses fields they came from.
fn renamed(mut e: ApiError) -> ApiError {
    let to = match e.param.as_deref() {
        Some("max_tokens") => "max_output_tokens",
        Some("response_format") => "text.format",
        Some("messages") => "input",
        _ => return e,
    };
    let from = e.param.replace(to.to_string()).unwrap_or_default();
    e.message = e.message.replace(&format!("`{from}`"), &format!("`{to}`"));
    e
}

/// The response object without its output and usage: the request's settings echoed.
pub(crate) fn base(m: &Map<String, Value>, id: &str, model: &str, created: u64) -> Value {
    let get = |k: &str, d: Value| present(m, k).cloned().unwrap_or(d);
    let format = m
        .get("text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
        .cloned()
        .unwrap_or(json!({"type": "text"}));
    json!({
        "id": id, "object": "response", "created_at": created, "status": "in_progress",
        "model": model, "output": [], "error": null, "incomplete_details": null,
        "instructions": get("instructions", Value::Null),
        "max_output_tokens": get("max_output_tokens", Value::Null),
        "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
        "previous_response_id": null, "store": false,
        "temperature": get("temperature", json!(1.0)), "top_p": get("top_p", json!(1.0)),
        "tool_choice": get("tool_choice", json!("auto")), "tools": get("tools", json!([])),
        "text": {"format": format}, "truncation": "disabled",
        "metadata": get("metadata", json!({})), "usage": null,
    })
}

fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    })
}

/// Ids of a response's items, from its own.
struct Ids<'a>(&'a str);

impl Ids<'_> {
    fn tail(&self) -> &str {
        self.0.trim_start_matches("resp_")
    }
    fn message(&self) -> String {
        format!("msg_{}", self.tail())
    }
    fn reasoning(&self) -> String {
        format!("rs_{}", self.tail())
    }
    fn call(&self, i: usize) -> (String, String) {
        (
            format!("fc_{}_{i}", self.tail()),
            format!("call_{}_{i}", self.tail()),
        )
    }
}

fn message_item(id: String, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn reasoning_item(id: String, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn call_item(ids: &Ids, i: usize, name: &str, args: &str, status: &str) -> Value {
    let (id, call_id) = ids.call(i);
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args, "status": status})
}

/// The response's status and `incomplete_details` for how the turn ended.
fn status(stop: &Stop) -> (&'static str, Value) {
    match stop {
        Stop::Length => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => ("completed", Value::Null),
    }
}

/// The whole response of a turn, on `base`.
pub(crate) fn response_json(mut base: Value, w: &Whole) -> Value {
    let id = base["id"].as_str().unwrap_or_default().to_string();
    let ids = Ids(&id);
    let (st, incomplete) = status(&w.end.stop);
    let mut output = Vec::new();
    if let Some(r) = w.reasoning.as_ref().filter(|r| !r.is_empty()) {
        output.push(reasoning_item(ids.reasoning(), r));
    }
    if !w.text.is_empty() || w.calls.is_empty() {
        output.push(message_item(ids.message(), &w.text, st));
    }
    for (i, (name, args)) in w.calls.iter().enumerate() {
        output.push(call_item(&ids, i, name, args, "completed"));
    }
    base["status"] = json!(st);
    base["incomplete_details"] = incomplete;
    base["output"] = Value::Array(output);
    base["usage"] = usage(
        w.end.prompt_tokens,
        w.end.cached_tokens,
        w.end.completion_tokens,
    );
    base
}

/// The item open in a stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Open {
    Message,
    Reasoning,
}

/// Turns a turn's parts into the Responses stream events, numbered.
pub(crate) struct Events {
    base: Value,
    seq: u64,
    output: Vec<Value>,
    open: Option<Open>,
    /// The open item's text so far.
    text: String,
}

impl Events {
    pub(crate) fn new(base: Value) -> Events {
        Events {
            base,
            seq: 0,
            output: Vec::new(),
            open: None,
            text: String::new(),
        }
    }

    fn push(&mut self, out: &mut Vec<Value>, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(v);
    }

    /// `response.created` and `response.in_progress`.
    pub(crate) fn begin(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        let r = self.base.clone();
        self.push(&mut out, "response.created", json!({"response": r}));
        self.push(&mut out, "response.in_progress", json!({"response": r}));
        out
    }

    fn ids(&self) -> Ids<'_> {
        Ids(self.base["id"].as_str().unwrap_or_default())
    }

    fn close(&mut self, out: &mut Vec<Value>, status: &str) {
        let Some(kind) = self.open.take() else {
            return;
        };
        let index = self.output.len();
        let text = std::mem::take(&mut self.text);
        let item = match kind {
            Open::Message => {
                let id = self.ids().message();
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                self.push(out, "response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                self.push(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
                message_item(id, &text, status)
            }
            Open::Reasoning => {
                let id = self.ids().reasoning();
                self.push(
                    out,
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                reasoning_item(id, &text)
            }
        };
        self.push(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
    }

    fn open(&mut self, out: &mut Vec<Value>, kind: Open) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out, "completed");
        let index = self.output.len();
        match kind {
            Open::Message => {
                let id = self.ids().message();
                let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
                self.push(
                    out,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                let part =
                    json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                self.push(
                    out,
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
            }
            Open::Reasoning => {
                let id = self.ids().reasoning();
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"});
                self.push(
                    out,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
            }
        }
        self.open = Some(kind);
    }

    pub(crate) fn on(&mut self, part: Part) -> Vec<Value> {
        let mut out = Vec::new();
        match part {
            Part::Started { .. } => {}
            Part::Reasoning(r) => {
                self.open(&mut out, Open::Reasoning);
                self.text.push_str(&r);
                let (id, index) = (self.ids().reasoning(), self.output.len());
                self.push(
                    &mut out,
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": r}),
                );
            }
            Part::Text(t) => {
                self.open(&mut out, Open::Message);
                self.text.push_str(&t);
                let (id, index) = (self.ids().message(), self.output.len());
                self.push(&mut out, "response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": []}));
            }
            Part::Calls(calls) => {
                self.close(&mut out, "completed");
                for (i, (name, args)) in calls.iter().enumerate() {
                    let index = self.output.len();
                    let ids = self.ids();
                    let added = call_item(&ids, i, name, "", "in_progress");
                    let done = call_item(&ids, i, name, args, "completed");
                    let item_id = ids.call(i).0;
                    self.push(
                        &mut out,
                        "response.output_item.added",
                        json!({"output_index": index, "item": added}),
                    );
                    self.push(
                        &mut out,
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": args}),
                    );
                    self.push(&mut out, "response.function_call_arguments.done", json!({"item_id": item_id, "output_index": index, "name": name, "arguments": args}));
                    self.push(
                        &mut out,
                        "response.output_item.done",
                        json!({"output_index": index, "item": done}),
                    );
                    self.output.push(done);
                }
            }
            Part::End(e) => {
                let (st, incomplete) = status(&e.stop);
                if self.output.is_empty() && self.open.is_none() {
                    // An empty answer is still a message, as a whole response has one.
                    self.open(&mut out, Open::Message);
                }
                self.close(&mut out, st);
                let mut r = self.base.clone();
                r["status"] = json!(st);
                r["incomplete_details"] = incomplete;
                r["output"] = Value::Array(std::mem::take(&mut self.output));
                r["usage"] = usage(e.prompt_tokens, e.cached_tokens, e.completion_tokens);
                let kind = if st == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                self.push(&mut out, kind, json!({"response": r}));
            }
            Part::Failed(e) => {
                let mut r = self.base.clone();
                r["status"] = json!("failed");
                r["error"] = json!({"code": "server_error", "message": e.message});
                r["output"] = Value::Array(std::mem::take(&mut self.output));
                self.push(&mut out, "response.failed", json!({"response": r}));
            }
        }
        out
    }
}

fn next_id(st: &AppState) -> String {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    format!("resp_{:x}{:06x}", st.nonce, n)
}

/// `POST /v1/responses`.
pub(crate) async fn responses(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let id = next_id(&st);
        let created = unix_now();
        let (p, ids, base) = on_cpu(&st, body, move |s, m| {
            let base = base(&m, &id, &s.model, created);
            let (p, ids) = prepare_chat(s, to_chat(&m)?).map_err(renamed)?;
            Ok((p, ids, base))
        })
        .await?;
        let turn = Turn::start(&st, &log, &p, ids).await.map_err(renamed)?;
        log.submitted(base["id"].as_str().unwrap_or_default());
        if !p.stream {
            let w = turn.whole().await?;
            return Ok(Json(response_json(base, &w)).into_response());
        }
        let mut events = Events::new(base);
        let first: std::collections::VecDeque<Value> = events.begin().into();
        let s = futures_util::stream::unfold(
            (turn, events, first),
            |(mut turn, mut ev, mut pending)| async move {
                loop {
                    if let Some(v) = pending.pop_front() {
                        let name = v["type"].as_str().unwrap_or("message").to_string();
                        let e = SseEvent::default().event(name).data(v.to_string());
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

#[cfg(test)]
mod tests;
