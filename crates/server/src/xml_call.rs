//! The XML-style tool calls of Qwen3-Coder and Qwen 3.5 (and Nemotron's templates, which write
//! the same): each call is
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=KEY>
//! VALUE
//! </parameter>
//! …
//! </function>
//! </tool_call>
//! ```
//!
//! with each value written raw (a string as it is, over as many lines as it takes; other
//! values as JSON), as llama.cpp's test-chat.cpp cases for those templates spell them. A
//! value's type comes from the function's schema: a string parameter keeps its text, others
//! parse as JSON (and stay text where they do not).

use serde_json::{Map, Value};

pub(crate) const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const P_OPEN: &str = "<parameter=";
const P_CLOSE: &str = "</parameter>";

/// The calls in `text` from the first `<tool_call>` on: (name, arguments) with each value typed
/// by `schema_of(name)`; None if one does not parse, except a last one cut short (no
/// `</tool_call>` after it), left out.
pub(crate) fn calls<'a>(
    mut text: &str,
    schema_of: impl Fn(&str) -> Option<&'a Value>,
) -> Option<Vec<(String, Value)>> {
    let mut out = Vec::new();
    while let Some(a) = text.find(OPEN) {
        let after = &text[a + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            break;
        };
        out.push(one(&after[..end], &schema_of)?);
        text = &after[end + CLOSE.len()..];
    }
    Some(out)
}

/// One call's body (between `<tool_call>` and `</tool_call>`).
fn one<'a>(body: &str, schema_of: &impl Fn(&str) -> Option<&'a Value>) -> Option<(String, Value)> {
    let body = body.trim_start().strip_prefix(FN_OPEN)?;
    let (name, mut rest) = body.split_once('>')?;
    let name = name.trim();
    let props = schema_of(name).and_then(|s| s.get("properties"));
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix(FN_CLOSE) {
            if !r.trim().is_empty() {
                return None;
            }
            return Some((name.to_string(), Value::Object(args)));
        }
        let p = rest.strip_prefix(P_OPEN)?;
        let (key, p) = p.split_once('>')?;
        // The value sits between a newline after the tag and one before the closing tag; a
        // value's own trailing newlines stay.
        let p = p.strip_prefix('\n').unwrap_or(p);
        let end = p
            .find(&format!("\n{P_CLOSE}"))
            .map(|e| (e, e + 1))
            .or_else(|| p.find(P_CLOSE).map(|e| (e, e)))?;
        let raw = &p[..end.0];
        rest = &p[end.1 + P_CLOSE.len()..];
        let ty = props.and_then(|ps| ps.get(key)).and_then(|s| s.get("type"));
        args.insert(key.to_string(), typed(raw, ty));
    }
}

/// A raw value as the parameter's schema types it: text for a string (or a type that allows
/// one), JSON where it parses for the other types, else text.
pub(crate) fn typed(raw: &str, ty: Option<&Value>) -> Value {
    let allows_string = match ty {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
        _ => false,
    };
    if allows_string {
        return Value::String(raw.to_string());
    }
    serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
}

/// A function's parameters (an object schema): its properties in order, and the names it
/// requires.
pub(crate) fn parameters(params: &Value) -> (Map<String, Value>, Vec<&str>) {
    let props = params
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    (props, required)
}

/// The Lark rules of one call of each function in `fs` (name, parameters: an object schema,
/// closed), as rule `call`; `%json` holds the values that are not strings to their schemas.
/// `json_style`: the `x-guidance` options of those values.
fn call_rules(fs: &[(&str, &Value)], json_style: &Value) -> String {
    let lit = |t: &str| serde_json::to_string(t).expect("a string");
    let mut rules = String::new();
    let mut alts = Vec::new();
    for (i, (name, params)) in fs.iter().enumerate() {
        let (props, required) = crate::xml_call::parameters(params);
        // The parameters in the schema's order, the optional ones optional.
        let mut seq = Vec::new();
        for (j, (key, schema)) in props.iter().enumerate() {
            let value = format!("v{i}_{j}");
            let is_string = schema.get("type").and_then(Value::as_str) == Some("string")
                && schema.get("enum").is_none()
                && schema.get("const").is_none();
            let close = lit(&format!("\n{P_CLOSE}\n"));
            let p = if is_string {
                // Any text up to the first closing tag, which it takes too.
                rules.push_str(&format!("{value}[suffix={close}]: /(?s:.*)/\n"));
                format!("{} {value}", lit(&format!("{P_OPEN}{key}>\n")))
            } else {
                let mut s = schema.clone();
                if let Some(o) = s.as_object_mut() {
                    o.insert("x-guidance".into(), json_style.clone());
                }
                rules.push_str(&format!("{value}: %json {s}\n"));
                format!("{} {value} {close}", lit(&format!("{P_OPEN}{key}>\n")))
            };
            seq.push(if required.contains(&key.as_str()) {
                p
            } else {
                format!("({p})?")
            });
        }
        rules.push_str(&format!(
            "f{i}: {} {} {}\n",
            lit(&format!("\n{FN_OPEN}{name}>\n")),
            seq.join(" "),
            lit(&format!("{FN_CLOSE}\n"))
        ));
        alts.push(format!("f{i}"));
    }
    format!("call: {}\n{rules}", alts.join(" | "))
}

/// `<tool_call>` then one call (and more where `parallel`), as Lark's `start`.
pub(crate) fn grammar(fs: &[(&str, &Value)], parallel: bool, json_style: &Value) -> String {
    let lit = |t: &str| serde_json::to_string(t).expect("a string");
    let more = if parallel {
        format!(" ({} call {})*", lit(&format!("\n{OPEN}")), lit(CLOSE))
    } else {
        String::new()
    };
    format!(
        "start: {} call {}{more}\n{}",
        lit(OPEN),
        lit(CLOSE),
        call_rules(fs, json_style)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> Value {
        json!({
            "special_function": {"type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]},
            "special_function_with_opt": {"type": "object", "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}}, "required": ["arg1"]},
            "python": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            "edit": {"type": "object", "properties": {"filename": {"type": "string"}, "oldString": {"type": "string"}, "newString": {"type": "string"}}},
        })
    }

    fn parse(text: &str) -> Option<Vec<(String, Value)>> {
        let s = schemas();
        calls(text, |n| s.get(n))
    }

    // The cases of llama.cpp's tests/test-chat.cpp for Qwen3.5-4B.jinja.
    #[test]
    fn calls_of_the_qwen_3_5_cases() {
        let c = parse("<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(c, vec![("special_function".into(), json!({"arg1": 1}))]);
        let c = parse(
            "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>\n\
             <tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>",
        )
        .unwrap();
        assert_eq!(
            c,
            vec![
                ("special_function".into(), json!({"arg1": 1})),
                (
                    "special_function_with_opt".into(),
                    json!({"arg1": 1, "arg2": 2})
                ),
            ]
        );
        let c = parse("<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print(\"Hello, world!\")\n\nhello()\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(
            c[0].1,
            json!({"code": "def hello():\n    print(\"Hello, world!\")\n\nhello()"})
        );
        let c = parse("<tool_call>\n<function=edit>\n<parameter=filename>\nfoo.c\n</parameter>\n<parameter=oldString>\n#iclunde\n</parameter>\n<parameter=newString>\n#include\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(
            c[0].1,
            json!({"filename": "foo.c", "oldString": "#iclunde", "newString": "#include"})
        );
        // A value that ends in a newline keeps it.
        let c = parse("<tool_call>\n<function=edit>\n<parameter=newString>\n#include\n\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(c[0].1, json!({"newString": "#include\n"}));
    }

    #[test]
    fn a_call_cut_short_is_left_out_and_a_broken_one_refused() {
        let c = parse("<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=python>\n<parameter=code>\nprint(").unwrap();
        assert_eq!(c.len(), 1);
        assert!(parse("<tool_call>\n{\"name\": \"python\"}\n</tool_call>").is_none());
        assert!(parse("<tool_call>\n<function=python>\n<parameter=code>\nx\n</parameter>\n</function>\ntrailing\n</tool_call>").is_none());
        // A value of a type other than string that is not JSON stays text; unknown functions
        // keep their text values.
        let c = parse("<tool_call>\n<function=special_function>\n<parameter=arg1>\none\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(c[0].1, json!({"arg1": "one"}));
        let c = parse("<tool_call>\n<function=other>\n<parameter=x>\n[1, 2]\n</parameter>\n</function>\n</tool_call>").unwrap();
        assert_eq!(c[0].1, json!({"x": [1, 2]}));
    }
}
