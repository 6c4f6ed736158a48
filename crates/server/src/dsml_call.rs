//! DeepSeek V3.2 and V4's tool calls, in their "DSML" markup: a block of one or more invokes,
//!
//! ```text
//! <｜DSML｜tool_calls>
//! <｜DSML｜invoke name="NAME">
//! <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
//! <｜DSML｜parameter name="N" string="false">JSON</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! …
//! </｜DSML｜tool_calls>
//! ```
//!
//! (V3.2 names the block `function_calls`; V4 writes a lone newline in an invoke without
//! arguments.) `string="true"` values are text as written, `string="false"` ones JSON, as the
//! templates write them and llama.cpp's test-chat.cpp cases read them.

use serde_json::{Map, Value};

const DSML: &str = "｜DSML｜";
const INVOKE: &str = "<｜DSML｜invoke name=\"";
const INVOKE_END: &str = "</｜DSML｜invoke>";
const PARAM: &str = "<｜DSML｜parameter name=\"";
const PARAM_END: &str = "</｜DSML｜parameter>";

/// Which of the two models' blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// V3.2: `<｜DSML｜function_calls>`.
    FunctionCalls,
    /// V4: `<｜DSML｜tool_calls>`.
    ToolCalls,
}

impl Block {
    /// The block a template writes, where it writes DSML (its source spells the token apart
    /// from the tags: `'<' + dsml_token + 'tool_calls>'`).
    pub fn of_template(s: &str) -> Option<Block> {
        if !s.contains(DSML) {
            None
        } else if s.contains("'tool_calls>") || s.contains("<｜DSML｜tool_calls>") {
            Some(Block::ToolCalls)
        } else {
            Some(Block::FunctionCalls)
        }
    }

    /// The tag that opens the block (where a call begins in the text).
    pub fn open(self) -> &'static str {
        match self {
            Block::FunctionCalls => "<｜DSML｜function_calls>",
            Block::ToolCalls => "<｜DSML｜tool_calls>",
        }
    }

    fn close(self) -> &'static str {
        match self {
            Block::FunctionCalls => "</｜DSML｜function_calls>",
            Block::ToolCalls => "</｜DSML｜tool_calls>",
        }
    }
}

/// The calls in `text` from the block's opening tag on: (name, arguments), each value typed
/// by its `string` attribute (or, without one, by `schema_of(name)`). A last invoke cut short
/// (no closing tag) is left out with the rest of the text; None where a closed invoke does not
/// parse or text other than invokes stands in the block.
pub(crate) fn calls<'a>(
    text: &str,
    block: Block,
    schema_of: impl Fn(&str) -> Option<&'a Value>,
) -> Option<Vec<(String, Value)>> {
    let at = text.find(block.open())?;
    let mut rest = &text[at + block.open().len()..];
    let mut out = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() || rest.starts_with(block.close()) {
            return Some(out);
        }
        let Some(body) = rest.strip_prefix(INVOKE) else {
            // A tag still arriving when the text was cut.
            return (INVOKE.starts_with(rest) || block.close().starts_with(rest)).then_some(out);
        };
        let Some(end) = body.find(INVOKE_END) else {
            return Some(out);
        };
        out.push(invoke(&body[..end], &schema_of)?);
        rest = &body[end + INVOKE_END.len()..];
    }
}

/// One invoke from after `name="` to its closing tag.
fn invoke<'a>(
    body: &str,
    schema_of: &impl Fn(&str) -> Option<&'a Value>,
) -> Option<(String, Value)> {
    let (name, mut rest) = body.split_once("\">")?;
    let props = schema_of(name).and_then(|s| s.get("properties"));
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some((name.to_string(), Value::Object(args)));
        }
        let p = rest.strip_prefix(PARAM)?;
        let (key, p) = p.split_once('"')?;
        let (attrs, p) = p.split_once('>')?;
        let end = p.find(PARAM_END)?;
        let raw = &p[..end];
        rest = &p[end + PARAM_END.len()..];
        let value = match attrs.trim() {
            "string=\"true\"" => Value::String(raw.to_string()),
            "string=\"false\"" => {
                serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
            }
            "" => crate::xml_call::typed(
                raw,
                props.and_then(|ps| ps.get(key)).and_then(|s| s.get("type")),
            ),
            _ => return None,
        };
        args.insert(key.to_string(), value);
    }
}

/// The block with one call (more where `parallel`) of the functions `fs` (name, parameters:
/// an object schema, closed), as Lark's `start`: each function's parameters in its schema's
/// order, the required ones always; a string's value raw up to its closing tag (an enum's one
/// of its strings), the others `%json` to their schemas (`json_style`: their `x-guidance`).
pub(crate) fn grammar(
    fs: &[(&str, &Value)],
    block: Block,
    parallel: bool,
    json_style: &Value,
) -> String {
    let lit = |t: &str| serde_json::to_string(t).expect("a string");
    let mut rules = String::new();
    let mut alts = Vec::new();
    for (i, (name, params)) in fs.iter().enumerate() {
        let (props, required) = crate::xml_call::parameters(params);
        let mut seq = Vec::new();
        for (j, (key, schema)) in props.iter().enumerate() {
            let v = format!("v{i}_{j}");
            let head = |string: bool| lit(&format!("{PARAM}{key}\" string=\"{string}\">"));
            let close = lit(&format!("{PARAM_END}\n"));
            let strings: Option<Vec<String>> = schema
                .get("enum")
                .and_then(Value::as_array)
                .map(|e| e.iter().map(|x| x.as_str().map(lit)).collect())
                .or_else(|| {
                    schema
                        .get("const")
                        .map(|c| c.as_str().map(|s| vec![lit(s)]))
                })
                .flatten()
                .filter(|s| !s.is_empty());
            let ty = schema.get("type");
            let p = if let Some(strings) = strings {
                // Strings from a list: written raw, as any string.
                rules.push_str(&format!("{v}: {}\n", strings.join(" | ")));
                format!("{} {v} {close}", head(true))
            } else if ty.and_then(Value::as_str) == Some("string") {
                // Any text up to the first closing tag (which it takes too), as the parse
                // reads it.
                rules.push_str(&format!("{v}[suffix={}]: /(?s:.*)/\n", lit(PARAM_END)));
                format!("{} {v} \"\\n\"", head(true))
            } else {
                let mut s = schema.clone();
                if let Some(o) = s.as_object_mut() {
                    o.insert("x-guidance".into(), json_style.clone());
                }
                rules.push_str(&format!("{v}: %json {s}\n"));
                let json = format!("{} {v} {close}", head(false));
                // A type that allows a string too: raw text, or the others as JSON.
                let or_text = ty
                    .and_then(Value::as_array)
                    .is_some_and(|ts| ts.iter().any(|t| t == "string"));
                if or_text {
                    rules.push_str(&format!("{v}s[suffix={}]: /(?s:.*)/\n", lit(PARAM_END)));
                    format!("({json} | {} {v}s \"\\n\")", head(true))
                } else {
                    json
                }
            };
            seq.push(if required.contains(&key.as_str()) {
                p
            } else {
                format!("({p})?")
            });
        }
        // V4 writes a newline in an invoke without arguments.
        if block == Block::ToolCalls && required.is_empty() {
            seq.push("\"\\n\"?".to_string());
        }
        rules.push_str(&format!(
            "f{i}: {} {} {}\n",
            lit(&format!("{INVOKE}{name}\">\n")),
            seq.join(" "),
            lit(&format!("{INVOKE_END}\n"))
        ));
        alts.push(format!("f{i}"));
    }
    let more = if parallel { " call*" } else { "" };
    format!(
        "start: {} \"\\n\" call{more} {}\ncall: {}\n{rules}",
        lit(block.open()),
        lit(block.close()),
        alts.join(" | ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The tools of llama.cpp's test-chat.cpp cases.
    fn schemas() -> Value {
        let one = |k: &str, t: &str| json!({"type": "object", "properties": {k: {"type": t}}, "required": [k]});
        json!({
            "get_time": one("city", "string"),
            "get_weather": one("city", "string"),
            "special_function": one("arg1", "integer"),
            "magic_int": {"type": "object", "properties": {"ref": {"type": "integer"}, "name": {"type": "string"}}, "required": ["ref"]},
            "amount": one("orig", "number"),
            "toggle": one("enabled", "boolean"),
            "todo_list": {"type": "object", "properties": {"todos": {"type": "array", "items": {"type": "string"}}}, "required": ["todos"]},
            "set_config": one("config", "object"),
        })
    }

    fn parse(block: Block, text: &str) -> Option<Vec<(String, Value)>> {
        let s = schemas();
        calls(text, block, |n| s.get(n))
    }

    /// The invokes of a block, in `block`'s tags.
    fn wrap(block: Block, invokes: &str) -> String {
        format!("{}\n{invokes}{}", block.open(), block.close())
    }

    // The tool-call cases of llama.cpp's tests/test-chat.cpp for DeepSeek-V3.2.jinja (the V4
    // cases are the same invokes in V4's block).
    #[test]
    #[allow(clippy::approx_constant)] // The cases' 3.14, not π.
    fn calls_of_the_v3_2_and_v4_cases() {
        let inv = |name: &str, params: &[(&str, bool, &str)]| {
            let ps: String = params
                .iter()
                .map(|(k, s, v)| {
                    format!(
                        "<｜DSML｜parameter name=\"{k}\" string=\"{s}\">{v}</｜DSML｜parameter>\n"
                    )
                })
                .collect();
            format!("<｜DSML｜invoke name=\"{name}\">\n{ps}</｜DSML｜invoke>\n")
        };
        for block in [Block::FunctionCalls, Block::ToolCalls] {
            let cases: Vec<(String, Vec<(&str, Value)>)> = vec![
                (
                    inv("get_time", &[("city", true, "Tokyo")]),
                    vec![("get_time", json!({"city": "Tokyo"}))],
                ),
                (
                    inv("special_function", &[("arg1", false, "1")]),
                    vec![("special_function", json!({"arg1": 1}))],
                ),
                (
                    inv("get_time", &[("city", true, "Paris")])
                        + &inv("get_weather", &[("city", true, "Paris")]),
                    vec![
                        ("get_time", json!({"city": "Paris"})),
                        ("get_weather", json!({"city": "Paris"})),
                    ],
                ),
                (
                    inv("magic_int", &[("ref", false, "-14")]),
                    vec![("magic_int", json!({"ref": -14}))],
                ),
                (
                    inv("amount", &[("orig", false, "3.14")]),
                    vec![("amount", json!({"orig": 3.14}))],
                ),
                (
                    inv("toggle", &[("enabled", false, "true")]),
                    vec![("toggle", json!({"enabled": true}))],
                ),
                (
                    inv(
                        "todo_list",
                        &[("todos", false, "[\"buy milk\",\"walk dog\"]")],
                    ),
                    vec![("todo_list", json!({"todos": ["buy milk", "walk dog"]}))],
                ),
                (
                    inv(
                        "set_config",
                        &[("config", false, "{\"theme\":\"dark\",\"level\":2}")],
                    ),
                    vec![(
                        "set_config",
                        json!({"config": {"theme": "dark", "level": 2}}),
                    )],
                ),
                (
                    inv("get_time", &[("city", true, "XYZCITY")]),
                    vec![("get_time", json!({"city": "XYZCITY"}))],
                ),
                (
                    inv(
                        "magic_int",
                        &[("ref", false, "42"), ("name", true, "foo bar")],
                    ),
                    vec![("magic_int", json!({"ref": 42, "name": "foo bar"}))],
                ),
            ];
            for (invokes, want) in cases {
                let text = wrap(block, &invokes);
                let got = parse(block, &text).unwrap_or_else(|| panic!("{text}"));
                let want: Vec<(String, Value)> =
                    want.into_iter().map(|(n, v)| (n.to_string(), v)).collect();
                assert_eq!(got, want, "{text}");
            }
        }
    }

    #[test]
    fn values_and_blocks_as_the_templates_write_them() {
        // A string keeps its text (digits, JSON-looking text, lines) as written.
        let t = wrap(Block::ToolCalls, "<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">[1, 2]\nline</｜DSML｜parameter>\n</｜DSML｜invoke>\n");
        assert_eq!(
            parse(Block::ToolCalls, &t).unwrap()[0].1,
            json!({"city": "[1, 2]\nline"})
        );
        // V4's invoke without arguments (a lone newline).
        let t = wrap(
            Block::ToolCalls,
            "<｜DSML｜invoke name=\"empty_args\">\n\n</｜DSML｜invoke>\n",
        );
        assert_eq!(
            parse(Block::ToolCalls, &t).unwrap(),
            vec![("empty_args".into(), json!({}))]
        );
        // The other model's block is not a call.
        assert!(parse(Block::FunctionCalls, &t).is_none());
        // No attribute: the schema types the value.
        let t = wrap(Block::ToolCalls, "<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜parameter name=\"arg1\">7</｜DSML｜parameter>\n</｜DSML｜invoke>\n");
        assert_eq!(
            parse(Block::ToolCalls, &t).unwrap()[0].1,
            json!({"arg1": 7})
        );
    }

    #[test]
    fn a_call_cut_short_is_left_out_and_a_broken_one_refused() {
        let whole = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n";
        for cut in [
            "",
            "<｜DSML｜inv",
            "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Par",
            "</｜DSML｜tool",
        ] {
            let got = parse(Block::ToolCalls, &format!("{whole}{cut}")).unwrap();
            assert_eq!(
                got,
                vec![("get_time".into(), json!({"city": "Tokyo"}))],
                "{cut}"
            );
        }
        assert_eq!(
            parse(
                Block::ToolCalls,
                "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_ti"
            ),
            Some(vec![])
        );
        // Text in the block, a parameter not closed inside its invoke, an unknown attribute.
        assert!(parse(
            Block::ToolCalls,
            &format!("{whole}oops</｜DSML｜tool_calls>")
        )
        .is_none());
        assert!(parse(Block::ToolCalls, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">x\n</｜DSML｜invoke>\n").is_none());
        assert!(parse(Block::ToolCalls, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" kind=\"x\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n").is_none());
    }

    #[test]
    fn blocks_follow_the_template() {
        let v32 = "{%- set dsml_token = '｜DSML｜' -%}{{- '\\n\\n<' + dsml_token + 'function_calls>\\n' -}}";
        let v4 =
            "{%- set dsml_token = '｜DSML｜' -%}{{- '\\n\\n<' + dsml_token + 'tool_calls>\\n' -}}";
        assert_eq!(Block::of_template(v32), Some(Block::FunctionCalls));
        assert_eq!(Block::of_template(v4), Some(Block::ToolCalls));
        assert_eq!(Block::of_template("<tool_call>"), None);
    }
}
