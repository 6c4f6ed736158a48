//! The request fields that constrain the output: OpenAI's `response_format` (`json_object`,
//! `json_schema`), llama-server's `json_schema` and `grammar`, vLLM's `guided_json`,
//! `guided_regex`, `guided_grammar` and `guided_choice`, and their newer form
//! `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`). JSON schemas
//! are closed and numbers bounded by the engine (`quiver_engine::json_rules`). At most one per
//! request; an unknown
//! `response_format.type`, a malformed one or (at compile time, `generate`) an invalid schema
//! or grammar is a 400 naming the field.

use crate::error::ApiError;
use quiver_engine::constraint::ConstraintSpec;
use serde_json::{Map, Value};

/// The constraint a body asks for, with the name of the field that asked (for errors).
pub fn parse(m: &Map<String, Value>) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
    let mut found: Vec<(ConstraintSpec, &'static str)> = Vec::new();
    if let Some(rf) = m.get("response_format").filter(|v| !v.is_null()) {
        if let Some(spec) = response_format(rf)? {
            found.push((spec, "response_format"));
        }
    }
    if let Some(s) = m.get("json_schema").filter(|v| !v.is_null()) {
        found.push((
            ConstraintSpec::JsonSchema(schema(s, "json_schema")?),
            "json_schema",
        ));
    }
    if let Some(g) = m.get("grammar").filter(|v| !v.is_null()) {
        found.push((grammar(g, "grammar")?, "grammar"));
    }
    if let Some(s) = m.get("guided_json").filter(|v| !v.is_null()) {
        found.push((
            ConstraintSpec::JsonSchema(schema(s, "guided_json")?),
            "guided_json",
        ));
    }
    if let Some(r) = m.get("guided_regex").filter(|v| !v.is_null()) {
        let Some(r) = r.as_str() else {
            return Err(ApiError::invalid(
                "guided_regex",
                "`guided_regex` must be a string",
            ));
        };
        found.push((ConstraintSpec::Regex(r.to_string()), "guided_regex"));
    }
    if let Some(g) = m.get("guided_grammar").filter(|v| !v.is_null()) {
        found.push((grammar(g, "guided_grammar")?, "guided_grammar"));
    }
    if let Some(c) = m.get("guided_choice").filter(|v| !v.is_null()) {
        found.push((choice(c, "guided_choice")?, "guided_choice"));
    }
    if let Some(so) = m.get("structured_outputs").filter(|v| !v.is_null()) {
        structured_outputs(so, &mut found)?;
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            found[1].1,
            format!(
                "`{}` and `{}` both constrain the output: give one",
                found[0].1, found[1].1
            ),
        )),
    }
}

/// A choice among strings, as a regular expression.
fn choice(c: &Value, field: &'static str) -> Result<ConstraintSpec, ApiError> {
    let choices: Option<Vec<&str>> = c
        .as_array()
        .and_then(|a| a.iter().map(|s| s.as_str()).collect());
    match choices {
        Some(ch) if !ch.is_empty() => {
            let alts: Vec<String> = ch.iter().map(|s| regex_escape(s)).collect();
            Ok(ConstraintSpec::Regex(format!("({})", alts.join("|"))))
        }
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a non-empty array of strings"),
        )),
    }
}

/// vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice`, `grammar`,
/// `json_object`; its switches `disable_any_whitespace`, `disable_additional_properties` and
/// `disable_fallback` ask for what quiver always does, and are taken; others are a 400.
fn structured_outputs(
    so: &Value,
    found: &mut Vec<(ConstraintSpec, &'static str)>,
) -> Result<(), ApiError> {
    const F: &str = "structured_outputs";
    let Some(o) = so.as_object() else {
        return Err(ApiError::invalid(
            F,
            "`structured_outputs` must be an object",
        ));
    };
    for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
        let spec = match k.as_str() {
            "json" => ConstraintSpec::JsonSchema(schema(v, F)?),
            "regex" => match v.as_str() {
                Some(r) => ConstraintSpec::Regex(r.to_string()),
                None => return Err(ApiError::invalid(F, "`structured_outputs.regex` must be a string")),
            },
            "choice" => choice(v, F)?,
            "grammar" => grammar(v, F)?,
            "json_object" => match v {
                Value::Bool(true) => ConstraintSpec::JsonObject,
                Value::Bool(false) => continue,
                _ => return Err(ApiError::invalid(F, "`structured_outputs.json_object` must be a boolean")),
            },
            "disable_any_whitespace" | "disable_additional_properties" | "disable_fallback" => {
                continue
            }
            other => {
                return Err(ApiError::invalid(
                    F,
                    format!("`structured_outputs.{other}` is not supported (json, regex, choice, grammar, json_object)"),
                ))
            }
        };
        found.push((spec, F));
    }
    Ok(())
}

fn response_format(rf: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    let bad = |msg: &str| ApiError::invalid("response_format", msg);
    let Some(o) = rf.as_object() else {
        return Err(bad("`response_format` must be an object"));
    };
    match o.get("type").and_then(|t| t.as_str()) {
        Some("text") => Ok(None),
        Some("json_object") => match o.get("schema").filter(|v| !v.is_null()) {
            // llama-server's form: a schema beside `json_object`.
            Some(s) => Ok(Some(ConstraintSpec::JsonSchema(schema(
                s,
                "response_format",
            )?))),
            None => Ok(Some(ConstraintSpec::JsonObject)),
        },
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(|j| j.as_object()) else {
                return Err(bad(
                    "`response_format.json_schema` must be an object with a `schema`",
                ));
            };
            match js.get("schema").filter(|v| !v.is_null()) {
                Some(s) => Ok(Some(ConstraintSpec::JsonSchema(schema(
                    s,
                    "response_format",
                )?))),
                None => Err(bad("`response_format.json_schema.schema` is required")),
            }
        }
        Some(other) => Err(bad(&format!(
            "unknown `response_format.type` {other:?} (text, json_object, json_schema)"
        ))),
        None => Err(bad("`response_format.type` is required")),
    }
}

/// A schema given as an object (or as a JSON string holding one).
fn schema(v: &Value, field: &'static str) -> Result<Value, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| ApiError::invalid(field, format!("the schema is not JSON: {e}")))?,
        other => other.clone(),
    };
    match v {
        Value::Object(_) | Value::Bool(true) => Ok(v),
        _ => Err(ApiError::invalid(field, "the schema must be a JSON object")),
    }
}

fn grammar(v: &Value, field: &'static str) -> Result<ConstraintSpec, ApiError> {
    let Some(g) = v.as_str() else {
        return Err(ApiError::invalid(field, "the grammar must be a string"));
    };
    // llama-server's grammars are GBNF (`root ::= ...`); Lark (`start: ...`) is taken as is.
    if g.contains("::=") {
        return quiver_engine::gbnf::gbnf_to_lark(g)
            .map(ConstraintSpec::Lark)
            .map_err(|e| ApiError::invalid(field, e));
    }
    Ok(ConstraintSpec::Lark(g.to_string()))
}

/// `s` as a regular expression matching it literally.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~ \t\n".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> Result<Option<ConstraintSpec>, String> {
        parse(v.as_object().unwrap())
            .map(|o| o.map(|(s, _)| s))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn response_formats() {
        assert_eq!(p(json!({})).unwrap(), None);
        assert_eq!(
            p(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            p(json!({"response_format": {"type": "json_object"}})).unwrap(),
            Some(ConstraintSpec::JsonObject)
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            p(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}})).unwrap(),
            Some(ConstraintSpec::JsonSchema(s.clone()))
        );
        assert_eq!(
            p(json!({"guided_json": s.to_string()})).unwrap(),
            Some(ConstraintSpec::JsonSchema(s))
        );
        assert_eq!(
            p(json!({"guided_choice": ["yes", "no."]})).unwrap(),
            Some(ConstraintSpec::Regex("(yes|no\\.)".into()))
        );
    }

    #[test]
    fn vllm_structured_outputs() {
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let so = |v: Value| p(json!({"structured_outputs": v}));
        assert_eq!(
            so(json!({"json": s, "disable_any_whitespace": true})).unwrap(),
            Some(ConstraintSpec::JsonSchema(s.clone()))
        );
        assert_eq!(
            so(json!({"regex": "[0-9]+"})).unwrap(),
            Some(ConstraintSpec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            so(json!({"choice": ["a", "b"]})).unwrap(),
            Some(ConstraintSpec::Regex("(a|b)".into()))
        );
        assert_eq!(
            so(json!({"grammar": "start: \"x\""})).unwrap(),
            Some(ConstraintSpec::Lark("start: \"x\"".into()))
        );
        assert_eq!(
            so(json!({"json_object": true})).unwrap(),
            Some(ConstraintSpec::JsonObject)
        );
        for bad in [
            json!("x"),
            json!({"regex": 1}),
            json!({"choice": []}),
            json!({"structural_tag": "{}"}),
            json!({"regex": "a", "choice": ["a"]}),
        ] {
            let e = so(bad.clone()).unwrap_err();
            assert!(e.contains("structured_outputs"), "{bad}: {e}");
        }
        assert!(p(json!({"structured_outputs": {"regex": "a"}, "guided_regex": "a"})).is_err());
    }

    #[test]
    fn bad_forms_are_400s_naming_the_field() {
        for (body, field) in [
            (json!({"response_format": {"type": "bogus"}}), "bogus"),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "schema",
            ),
            (json!({"grammar": "root ::= \"a"}), "unterminated string"),
            (json!({"guided_json": "{not json"}), "not JSON"),
            (json!({"guided_choice": []}), "guided_choice"),
            (
                json!({"grammar": "start: \"a\"", "guided_regex": "a"}),
                "both",
            ),
        ] {
            let e = p(body.clone()).unwrap_err();
            assert!(e.contains(field), "{body}: {e}");
        }
    }
}
