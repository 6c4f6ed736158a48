//! Chat-completions fields beyond OpenAI's current ones, read into what quiver serves:
//! OpenAI's legacy `functions` / `function_call` (as `tools` / `tool_choice`, the answer's call
//! then given back as `function_call`; `role: "function"` messages and an assistant's
//! `function_call` as tool messages and tool calls), the chat template's extra variables
//! (`chat_template_kwargs`, as vLLM and llama-server pass them) and llama-server's
//! `reasoning_format`.

use crate::error::ApiError;
use serde_json::{json, Map, Value};

/// Rewrites a body's legacy function fields as tools; true when it asked with `functions`.
pub(crate) fn legacy_functions(m: &mut Map<String, Value>) -> Result<bool, ApiError> {
    if let Some(Value::Array(msgs)) = m.get_mut("messages") {
        for msg in msgs.iter_mut() {
            let Some(o) = msg.as_object_mut() else {
                continue;
            };
            if o.get("role").and_then(Value::as_str) == Some("function") {
                o.insert("role".into(), json!("tool"));
                if let Some(n) = o.get("name").cloned() {
                    o.entry("tool_call_id").or_insert(n);
                }
            }
            let fc = o.get("function_call").filter(|v| v.is_object()).cloned();
            let has_calls = o.get("tool_calls").is_some_and(|v| !v.is_null());
            if let Some(fc) = fc.filter(|_| !has_calls) {
                let id = fc.get("name").cloned().unwrap_or(json!("call"));
                o.insert(
                    "tool_calls".into(),
                    json!([{"id": id, "type": "function", "function": fc}]),
                );
            }
            o.remove("function_call");
        }
    }
    let present = |k: &str| m.get(k).filter(|v| !v.is_null()).cloned();
    let Some(functions) = present("functions") else {
        if present("function_call").is_some() {
            return Err(ApiError::invalid(
                "function_call",
                "`function_call` needs `functions`",
            ));
        }
        return Ok(false);
    };
    if present("tools").is_some() {
        return Err(ApiError::invalid(
            "functions",
            "`functions` and `tools` both give tools: give one",
        ));
    }
    let Value::Array(list) = functions else {
        return Err(ApiError::invalid(
            "functions",
            "`functions` must be an array",
        ));
    };
    let mut tools = Vec::with_capacity(list.len());
    for (i, f) in list.into_iter().enumerate() {
        if f.get("name").and_then(Value::as_str).is_none() {
            return Err(ApiError::invalid(
                &format!("functions[{i}]"),
                "each function needs a `name`",
            ));
        }
        tools.push(json!({"type": "function", "function": f}));
    }
    let choice = match present("function_call") {
        None => json!("auto"),
        Some(Value::String(s)) if s == "none" || s == "auto" => json!(s),
        Some(Value::Object(o)) if o.get("name").is_some_and(Value::is_string) => {
            json!({"type": "function", "function": {"name": o["name"]}})
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "function_call",
                "`function_call` must be \"none\", \"auto\" or {\"name\": ...}",
            ))
        }
    };
    m.insert("tools".into(), Value::Array(tools));
    m.insert("tool_choice".into(), choice);
    m.insert("parallel_tool_calls".into(), json!(false));
    Ok(true)
}

/// `chat_template_kwargs`: variables for the chat template (an object), or a 400.
pub(crate) fn template_kwargs(
    m: &Map<String, Value>,
) -> Result<Option<Map<String, Value>>, ApiError> {
    match m.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o.clone())),
        Some(_) => Err(ApiError::invalid(
            "chat_template_kwargs",
            "`chat_template_kwargs` must be an object",
        )),
    }
}

/// llama-server's `reasoning_format` (a request's, or `--reasoning-format`'s default): whether
/// a thinking model's thoughts are taken out of `content` into `reasoning_content`. `none`
/// leaves them in `content`, as the model wrote them; `deepseek` and `auto` take them out.
pub(crate) fn reasoning_parsed(m: &Map<String, Value>) -> Result<bool, ApiError> {
    match m.get("reasoning_format") {
        None | Some(Value::Null) => Ok(true),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(false),
            "auto" | "deepseek" => Ok(true),
            other => Err(ApiError::invalid(
                "reasoning_format",
                format!("unknown `reasoning_format` {other:?} (none, deepseek, auto)"),
            )),
        },
        Some(_) => Err(ApiError::invalid(
            "reasoning_format",
            "`reasoning_format` must be a string",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(v: Value) -> (Result<bool, String>, Value) {
        let mut m = v.as_object().unwrap().clone();
        let r = legacy_functions(&mut m).map_err(|e| e.param.unwrap_or_default());
        (r, Value::Object(m))
    }

    #[test]
    fn legacy_functions_become_tools() {
        let f = json!({"name": "get_time", "parameters": {"type": "object", "properties": {}}});
        let (r, m) = norm(json!({
            "messages": [
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": null, "function_call": {"name": "get_time", "arguments": "{}"}},
                {"role": "function", "name": "get_time", "content": "noon"},
            ],
            "functions": [f],
            "function_call": {"name": "get_time"},
        }));
        assert_eq!(r, Ok(true));
        assert_eq!(m["tools"], json!([{"type": "function", "function": f}]));
        assert_eq!(
            m["tool_choice"],
            json!({"type": "function", "function": {"name": "get_time"}})
        );
        assert_eq!(m["parallel_tool_calls"], json!(false));
        assert_eq!(
            m["messages"][1]["tool_calls"][0]["function"]["name"],
            "get_time"
        );
        assert!(m["messages"][1].get("function_call").is_none());
        assert_eq!(m["messages"][2]["role"], "tool");
        assert_eq!(m["messages"][2]["tool_call_id"], "get_time");
        // Without functions: nothing changes.
        let (r, m) = norm(json!({"messages": [], "tools": []}));
        assert_eq!((r, m), (Ok(false), json!({"messages": [], "tools": []})));
        for (body, param) in [
            (json!({"function_call": "auto"}), "function_call"),
            (json!({"functions": {}}), "functions"),
            (json!({"functions": [{}]}), "functions[0]"),
            (json!({"functions": [f], "tools": []}), "functions"),
            (
                json!({"functions": [f], "function_call": 3}),
                "function_call",
            ),
        ] {
            assert_eq!(norm(body.clone()).0, Err(param.to_string()), "{body}");
        }
    }

    #[test]
    fn reasoning_formats() {
        let r = |v: Value| reasoning_parsed(v.as_object().unwrap()).map_err(|e| e.param);
        assert_eq!(r(json!({})), Ok(true));
        assert_eq!(r(json!({"reasoning_format": "none"})), Ok(false));
        assert_eq!(r(json!({"reasoning_format": "deepseek"})), Ok(true));
        assert_eq!(
            r(json!({"reasoning_format": "x"})),
            Err(Some("reasoning_format".into()))
        );
        assert!(template_kwargs(json!({"chat_template_kwargs": 1}).as_object().unwrap()).is_err());
    }
}
