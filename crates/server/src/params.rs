//! Request parsing and validation: JSON bodies of `/v1/chat/completions` and
//! `/v1/completions` into a tokenizable prompt and the engine's parameters. Every invalid
//! field is a 400 naming it.

use crate::error::ApiError;
use quiver_engine::SamplerParams;
use quiver_tokenizer::chat::Message;
use serde_json::{Map, Value};

/// Most stop strings per request.
pub const MAX_STOP: usize = 16;
/// Longest stop string, in UTF-8 bytes. The engine matches every stop string against the text
/// generated so far at every token, so their lengths are bounded (all of them together: at
/// most `MAX_STOP * MAX_STOP_BYTES` = 4 KiB).
pub const MAX_STOP_BYTES: usize = 256;
/// Most choices (`n`) per request.
pub const MAX_N: usize = 16;
/// Most `top_logprobs` (chat) per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What both endpoints share once parsed.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    /// None: no logprobs; Some(n): the chosen token's and the n best.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// What the output must follow, and the field that asked for it.
    pub constraint: Option<(quiver_engine::constraint::ConstraintSpec, &'static str)>,
    /// Chat with tools: their format and `tool_choice` (set by the chat handler).
    pub tools: Option<crate::tools::Tools>,
    /// Choices to generate (`n`), each with seed + its index.
    pub n: usize,
    /// A thinking model's chat: its tags and whether the prompt already opened the thinking
    /// (set by the chat handler); its thinking goes to `reasoning_content`.
    pub thinking: Option<crate::reasoning::Thinking>,
    /// vLLM's `cache_salt`: the request's prefix-cache namespace (None: the shared one).
    pub cache_salt: Option<String>,
    /// llama-server's `speculative.n_max`, `.n_min`, `.p_min` (`crate::spec`).
    pub speculative: quiver_engine::spec::RequestSpec,
}

/// The prompt of `/v1/completions`.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub tools: Option<Value>,
    pub params: GenParams,
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: bool,
    pub params: GenParams,
}

/// Parses a body into a JSON object, or a 400.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

fn present<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

/// A field's value if given, or the 400 naming it.
type Field<T> = Result<Option<T>, ApiError>;

pub(crate) fn get_f32(m: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Field<f32> {
    match present(m, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(Some(x as f32)),
            Some(x) => Err(ApiError::invalid(
                key,
                format!("`{key}` must be between {lo} and {hi}, got {x}"),
            )),
            None => Err(ApiError::invalid(key, format!("`{key}` must be a number"))),
        },
    }
}

pub(crate) fn get_uint(m: &Map<String, Value>, key: &str, lo: u64, hi: u64) -> Field<u64> {
    match present(m, key) {
        None => Ok(None),
        Some(v) => {
            let n = v.as_u64().or_else(|| {
                v.as_f64()
                    .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= u64::MAX as f64)
                    .map(|x| x as u64)
            });
            match n {
                Some(n) if n >= lo && n <= hi => Ok(Some(n)),
                Some(n) if hi == u64::MAX => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be at least {lo}, got {n}"),
                )),
                Some(n) => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be between {lo} and {hi}, got {n}"),
                )),
                None => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be a non-negative integer, got {v}"),
                )),
            }
        }
    }
}

fn get_bool(m: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match present(m, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a boolean, got {v}"),
        )),
    }
}

fn get_str<'a>(m: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, ApiError> {
    match present(m, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a string, got {v}"),
        )),
    }
}

/// A fresh seed when the request gives none.
fn random_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = t ^ N.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fields both endpoints share. `chat` selects the chat form of `logprobs` (a boolean plus
/// `top_logprobs`) over the legacy one (an integer).
fn parse_common(m: &Map<String, Value>, n_vocab: usize, chat: bool) -> Result<GenParams, ApiError> {
    let model = get_str(m, "model")?.map(str::to_string);
    let cache_salt = crate::tenant::parse_salt(m)?;
    let n = get_uint(m, "n", 1, u64::MAX)?.unwrap_or(1);
    if n > MAX_N as u64 {
        return Err(ApiError::invalid(
            "n",
            format!("`n` is at most {MAX_N}, got {n}"),
        ));
    }
    let n = n as usize;
    if let Some(n) = get_uint(m, "best_of", 1, u64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "best_of",
                format!("only best_of = 1 is supported, got {n}"),
            ));
        }
    }
    let stream = get_bool(m, "stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(so) = present(m, "stream_options") {
        let so = so.as_object().ok_or_else(|| {
            ApiError::invalid("stream_options", "`stream_options` must be an object")
        })?;
        if !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        include_usage = get_bool(so, "include_usage")
            .map_err(|e| ApiError {
                param: Some("stream_options.include_usage".into()),
                ..e
            })?
            .unwrap_or(false);
    }
    let mct = get_uint(m, "max_completion_tokens", 1, u32::MAX as u64)?;
    let mt = get_uint(m, "max_tokens", 1, u32::MAX as u64)?;
    let max_tokens = mct.or(mt).map(|n| n as usize);

    let mut s = SamplerParams::neutral();
    if let Some(t) = get_f32(m, "temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = get_f32(m, "top_p", 0.0, 1.0)? {
        if p == 0.0 {
            return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
        }
        s.top_p = p;
    }
    if let Some(k) = present(m, "top_k") {
        // -1 and 0 both mean "off", as in vLLM and llama.cpp.
        match k.as_i64() {
            Some(-1 | 0) => s.top_k = 0,
            Some(k) if k > 0 => s.top_k = k as usize,
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be an integer >= -1, got {k}"),
                ))
            }
        }
    }
    if let Some(p) = get_f32(m, "min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = get_f32(m, "presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = get_f32(m, "frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = get_f32(m, "repetition_penalty", 0.0, 10.0)? {
        if p == 0.0 {
            return Err(ApiError::invalid(
                "repetition_penalty",
                "`repetition_penalty` must be greater than 0",
            ));
        }
        s.repeat_penalty = p;
    }
    if let Some(lb) = present(m, "logit_bias") {
        let lb = lb.as_object().ok_or_else(|| {
            ApiError::invalid(
                "logit_bias",
                "`logit_bias` must be an object of token id to bias",
            )
        })?;
        for (k, v) in lb {
            let id: u32 = k
                .parse()
                .ok()
                .filter(|&id: &u32| (id as usize) < n_vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("`logit_bias` key `{k}` is not a token id below {n_vocab}"),
                    )
                })?;
            let b = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "`logit_bias` value for `{k}` must be a number between -100 and 100"
                        ),
                    )
                })?;
            s.logit_bias.push((id, b as f32));
        }
    }
    s.seed = match present(m, "seed") {
        None => random_seed(),
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("`seed` must be an integer, got {v}"),
                ))
            }
        },
    };

    let stop = match present(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("at most {MAX_STOP} stop strings, got {}", a.len()),
                ));
            }
            a.iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid("stop", "`stop` must be a string or an array of strings")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if let Some((i, s)) = stop
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        let which = match present(m, "stop") {
            Some(Value::Array(_)) => format!("`stop[{i}]`"),
            _ => "`stop`".to_string(),
        };
        return Err(ApiError::invalid(
            "stop",
            format!(
                "each stop string must be at most {MAX_STOP_BYTES} bytes; {which} has {} bytes",
                s.len()
            ),
        ));
    }
    let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();

    let logprobs = if chat {
        let on = get_bool(m, "logprobs")?.unwrap_or(false);
        let top = get_uint(m, "top_logprobs", 0, MAX_TOP_LOGPROBS as u64)?;
        match (on, top) {
            (true, t) => Some(t.unwrap_or(0) as usize),
            (false, Some(t)) if t > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs` set to true",
                ))
            }
            (false, _) => None,
        }
    } else {
        match present(m, "logprobs") {
            None | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(0),
            Some(_) => Some(get_uint(m, "logprobs", 0, 5)?.unwrap_or(0) as usize),
        }
    };
    let ignore_eos = get_bool(m, "ignore_eos")?.unwrap_or(false);
    let constraint = crate::constrain::parse(m)?;
    Ok(GenParams {
        model,
        stream,
        include_usage,
        max_tokens,
        sampling: s,
        stop,
        logprobs,
        ignore_eos,
        constraint,
        tools: None,
        n,
        thinking: None,
        cache_salt,
        speculative: crate::spec::parse(m)?,
    })
}

fn message_content(v: Option<&Value>, i: usize) -> Result<String, ApiError> {
    let param = || format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(t), _) if t != "text" => {
                        return Err(ApiError::invalid(
                            &param(),
                            format!("content parts of type `{t}` are not supported; only text"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &param(),
                            "each content part must be {\"type\": \"text\", \"text\": ...}",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::invalid(
            &param(),
            "`content` must be a string or an array of text parts",
        )),
    }
}

/// OpenAI sends a tool call's `arguments` as a JSON string; chat templates read them as an
/// object (`tool_call.arguments | tojson`, `.items()`), as llama.cpp hands them over. A string
/// that holds a JSON object becomes that object; anything else stays as it is.
fn arguments_as_objects(mut calls: Value) -> Value {
    if let Value::Array(a) = &mut calls {
        for call in a {
            let args = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"));
            if let Some(args) = args {
                if let Value::String(s) = args {
                    if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                        *args = v;
                    }
                }
            }
        }
    }
    calls
}

pub fn parse_chat(m: &Map<String, Value>, n_vocab: usize) -> Result<ChatRequest, ApiError> {
    let msgs = match present(m, "messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be an array")),
    };
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, v) in msgs.iter().enumerate() {
        let o = v.as_object().ok_or_else(|| {
            ApiError::invalid(&format!("messages[{i}]"), "each message must be an object")
        })?;
        let role = match o.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r.to_string(),
            Some("developer") => "system".to_string(),
            Some(r) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("unknown role `{r}`; use system, user, assistant or tool"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    "each message needs a `role` string",
                ))
            }
        };
        let content = message_content(o.get("content"), i)?;
        let tool_calls = o
            .get("tool_calls")
            .filter(|v| !v.is_null())
            .cloned()
            .map(arguments_as_objects);
        let name = o.get("name").and_then(Value::as_str).map(str::to_string);
        let tool_call_id = o
            .get("tool_call_id")
            .and_then(Value::as_str)
            .map(str::to_string);
        if role == "tool" && tool_call_id.is_none() && name.is_none() {
            // Accepted: some clients leave it out; the template decides what it needs.
        }
        // A thinking model's earlier thinking, as its answers gave it (`reasoning_content`).
        let reasoning_content = match o.get("reasoning_content") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].reasoning_content"),
                    "`reasoning_content` must be a string",
                ))
            }
        };
        messages.push(Message {
            role,
            content,
            tool_calls,
            name,
            tool_call_id,
            reasoning_content,
        });
    }
    let tools = match present(m, "tools") {
        None => None,
        Some(t @ Value::Array(_)) => Some(t.clone()),
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be an array")),
    };
    let params = parse_common(m, n_vocab, true)?;
    Ok(ChatRequest {
        messages,
        tools,
        params,
    })
}

pub(crate) fn token_ids(a: &[Value], n_vocab: usize, param: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .map(|v| {
            v.as_u64()
                .filter(|&t| (t as usize) < n_vocab)
                .map(|t| t as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        format!("`{param}` holds {v}, which is not a token id below {n_vocab}"),
                    )
                })
        })
        .collect()
}

pub fn parse_completion(
    m: &Map<String, Value>,
    n_vocab: usize,
) -> Result<CompletionRequest, ApiError> {
    let prompt = match present(m, "prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
        Some(Value::Array(a)) => match &a[0] {
            Value::String(s) if a.len() == 1 => Prompt::Text(s.clone()),
            Value::Array(ids) if a.len() == 1 => Prompt::Tokens(token_ids(ids, n_vocab, "prompt")?),
            Value::Number(_) => Prompt::Tokens(token_ids(a, n_vocab, "prompt")?),
            Value::String(_) | Value::Array(_) => return Err(ApiError::invalid("prompt", "only one prompt per request is supported")),
            _ => return Err(ApiError::invalid("prompt", "`prompt` must be a string, an array of token ids, or a one-element array of either")),
        },
        Some(_) => return Err(ApiError::invalid("prompt", "`prompt` must be a string or an array of token ids")),
    };
    if let Prompt::Tokens(t) = &prompt {
        if t.is_empty() {
            return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
        }
    }
    let echo = get_bool(m, "echo")?.unwrap_or(false);
    if get_str(m, "suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let params = parse_common(m, n_vocab, false)?;
    Ok(CompletionRequest {
        prompt,
        echo,
        params,
    })
}

/// An optional boolean field (absent or null: `default`).
pub(crate) fn opt_bool(
    m: &serde_json::Map<String, Value>,
    key: &'static str,
    default: bool,
) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn chat(v: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(&obj(v), 1000)
    }

    fn param_of(r: Result<impl std::fmt::Debug, ApiError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e:?}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn body_must_be_a_json_object() {
        assert!(parse_body(b"{")
            .unwrap_err()
            .message
            .contains("not valid JSON"));
        assert!(parse_body(b"[1]")
            .unwrap_err()
            .message
            .contains("JSON object"));
        assert!(parse_body(br#"{"a": 1}"#).is_ok());
    }

    #[test]
    fn chat_defaults_and_fields() {
        let r = chat(json!({
            "model": "m", "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "1"}
            ],
            "max_completion_tokens": 7, "max_tokens": 9, "temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "logit_bias": {"12": -100, "13": 5.5}, "stop": "\n", "seed": 7, "logprobs": true, "top_logprobs": 3,
            "stream": true, "stream_options": {"include_usage": true}, "n": 1
        }))
        .unwrap();
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[1].content, "hi there");
        assert!(r.messages[2].tool_calls.is_some());
        // The call's arguments, a JSON string on the wire, reach the template as an object.
        assert_eq!(
            r.messages[2].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
            json!({})
        );
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("1"));
        let p = r.params;
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_k, 5);
        assert_eq!(p.sampling.top_p, 0.5);
        assert_eq!(p.sampling.logit_bias, vec![(12, -100.0), (13, 5.5)]);
        assert_eq!(p.sampling.seed, 7);
        assert_eq!(p.sampling.repeat_penalty, 1.1);
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.logprobs, Some(3));
        assert!(p.stream && p.include_usage);

        let d = chat(json!({"messages": [{"role": "user", "content": "x"}]}))
            .unwrap()
            .params;
        assert_eq!(
            (
                d.sampling.temperature,
                d.sampling.top_k,
                d.sampling.top_p,
                d.sampling.min_p
            ),
            (1.0, 0, 1.0, 0.0)
        );
        assert_eq!(d.max_tokens, None);
        assert_eq!(d.logprobs, None);
        assert!(!d.stream);
    }

    #[test]
    fn invalid_parameters_name_the_parameter() {
        let m = |extra: Value| {
            let mut o = obj(json!({"messages": [{"role": "user", "content": "x"}]}));
            o.extend(obj(extra));
            parse_chat(&o, 1000)
        };
        assert_eq!(param_of(chat(json!({}))), "messages");
        assert_eq!(param_of(chat(json!({"messages": []}))), "messages");
        assert_eq!(param_of(chat(json!({"messages": "hi"}))), "messages");
        assert_eq!(
            param_of(chat(json!({"messages": [{"role": "bot", "content": "x"}]}))),
            "messages[0].role"
        );
        assert_eq!(
            param_of(chat(json!({"messages": [{"role": "user", "content": 3}]}))),
            "messages[0].content"
        );
        assert_eq!(param_of(m(json!({"temperature": 3}))), "temperature");
        assert_eq!(param_of(m(json!({"temperature": "hot"}))), "temperature");
        assert_eq!(param_of(m(json!({"top_p": 1.5}))), "top_p");
        assert_eq!(param_of(m(json!({"top_k": -2}))), "top_k");
        assert_eq!(param_of(m(json!({"max_tokens": 0}))), "max_tokens");
        assert_eq!(param_of(m(json!({"max_tokens": -1}))), "max_tokens");
        assert_eq!(
            param_of(m(json!({"max_completion_tokens": "a"}))),
            "max_completion_tokens"
        );
        assert_eq!(param_of(m(json!({"n": 17}))), "n");
        assert_eq!(param_of(m(json!({"n": 0}))), "n");
        assert_eq!(param_of(m(json!({"stop": 5}))), "stop");
        assert_eq!(param_of(m(json!({"stop": ["a", 1]}))), "stop");
        let long = "x".repeat(MAX_STOP_BYTES + 1);
        assert_eq!(param_of(m(json!({"stop": long}))), "stop");
        assert_eq!(param_of(m(json!({"stop": ["a", long]}))), "stop");
        let many: Vec<String> = (0..=MAX_STOP).map(|i| i.to_string()).collect();
        assert_eq!(param_of(m(json!({"stop": many}))), "stop");
        // At the limit: accepted (bytes, not characters: 'é' is two).
        let ok = "é".repeat(MAX_STOP_BYTES / 2);
        let p = m(json!({"stop": vec![ok.clone(); MAX_STOP]}))
            .unwrap()
            .params;
        assert_eq!(p.stop.len(), MAX_STOP);
        let e = m(json!({"stop": ["a", format!("{ok}a")]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(
            e.message.contains("256 bytes") && e.message.contains("`stop[1]` has 257"),
            "{}",
            e.message
        );
        assert_eq!(param_of(m(json!({"logit_bias": {"abc": 1}}))), "logit_bias");
        assert_eq!(
            param_of(m(json!({"logit_bias": {"5000": 1}}))),
            "logit_bias"
        );
        assert_eq!(param_of(m(json!({"logit_bias": {"5": 101}}))), "logit_bias");
        assert_eq!(param_of(m(json!({"seed": "x"}))), "seed");
        assert_eq!(param_of(m(json!({"top_logprobs": 3}))), "top_logprobs");
        assert_eq!(
            param_of(m(json!({"logprobs": true, "top_logprobs": 21}))),
            "top_logprobs"
        );
        assert_eq!(param_of(m(json!({"stream": "yes"}))), "stream");
        assert_eq!(
            param_of(m(json!({"stream_options": {"include_usage": true}}))),
            "stream_options"
        );
        assert_eq!(
            param_of(m(json!({"presence_penalty": 2.5}))),
            "presence_penalty"
        );
        assert_eq!(
            param_of(m(json!({"repetition_penalty": 0}))),
            "repetition_penalty"
        );
        assert_eq!(param_of(m(json!({"tools": {}}))), "tools");
        assert_eq!(param_of(m(json!({"model": 5}))), "model");
    }

    #[test]
    fn completion_prompts() {
        let c = |v: Value| parse_completion(&obj(v), 1000);
        assert_eq!(
            c(json!({"prompt": "hi"})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            c(json!({"prompt": ["hi"]})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            c(json!({"prompt": [1, 2, 3]})).unwrap().prompt,
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            c(json!({"prompt": [[4, 5]]})).unwrap().prompt,
            Prompt::Tokens(vec![4, 5])
        );
        assert_eq!(param_of(c(json!({}))), "prompt");
        assert_eq!(param_of(c(json!({"prompt": []}))), "prompt");
        assert_eq!(param_of(c(json!({"prompt": ["a", "b"]}))), "prompt");
        assert_eq!(param_of(c(json!({"prompt": [1, 5000]}))), "prompt");
        assert_eq!(param_of(c(json!({"prompt": [1, -1]}))), "prompt");
        assert_eq!(
            c(json!({"prompt": "x", "logprobs": 2}))
                .unwrap()
                .params
                .logprobs,
            Some(2)
        );
        assert_eq!(
            param_of(c(json!({"prompt": "x", "logprobs": 6}))),
            "logprobs"
        );
        assert_eq!(c(json!({"prompt": "x"})).unwrap().params.logprobs, None);
    }

    #[test]
    fn seeds_differ_when_not_given() {
        let a = chat(json!({"messages": [{"role": "user", "content": "x"}]}))
            .unwrap()
            .params
            .sampling
            .seed;
        let b = chat(json!({"messages": [{"role": "user", "content": "x"}]}))
            .unwrap()
            .params
            .sampling
            .seed;
        assert_ne!(a, b);
    }
}
