//! Tool calls: how the model's chat template writes them (its family's format), the grammar
//! that forces one when `tool_choice` asks for it, and the parse of the generated text back
//! into OpenAI's `tool_calls`.
//!
//! Formats: Hermes / Qwen (`<tool_call>{"name", "arguments"}</tool_call>`, also the default for
//! templates that show none), Mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`), Llama 3.x
//! (a bare JSON object `{"name", "parameters"}`).

use crate::error::ApiError;
use quiver_engine::constraint::ConstraintSpec;
use serde_json::{json, Map, Value};

/// How forced calls' JSON is spaced: as the templates' `tojson` writes the calls they render
/// (Python's `json.dumps`), so that a model's calls look like the ones it was shown.
static JSON_STYLE: std::sync::LazyLock<Value> = std::sync::LazyLock::new(
    || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Mistral,
    Llama3,
    /// DeepSeek R1 (and its distilled Qwen and Llama models), V3: `<｜tool▁calls▁begin｜>`
    /// `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json
    /// block, `<｜tool▁call▁end｜>` … `<｜tool▁calls▁end｜>`; V3.1's `NAME<｜tool▁sep｜>ARGS` is
    /// read too.
    DeepSeek,
    /// Gemma 4: `<|tool_call>call:NAME{key:value,…}<tool_call|>` (crate::gemma_call).
    Gemma4,
}

const DS_CALLS: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

impl Format {
    /// The format a chat template writes tool calls in (by what its source spells).
    pub fn of_template(source: Option<&str>) -> Format {
        let s = source.unwrap_or("");
        if s.contains("[TOOL_CALLS]") {
            Format::Mistral
        } else if s.contains(DS_CALLS) {
            Format::DeepSeek
        } else if s.contains(crate::gemma_call::OPEN) {
            Format::Gemma4
        } else if s.contains("<tool_call>") {
            Format::Hermes
        } else if s.contains("<|python_tag|>") || s.contains("ipython") {
            Format::Llama3
        } else {
            Format::Hermes
        }
    }

    /// Where a tool call begins in the text (None: anywhere, the whole output is the call).
    pub fn marker(self) -> Option<&'static str> {
        match self {
            Format::Hermes => Some("<tool_call>"),
            Format::Mistral => Some("[TOOL_CALLS]"),
            Format::Llama3 => None,
            Format::DeepSeek => Some(DS_CALLS),
            Format::Gemma4 => Some(crate::gemma_call::OPEN),
        }
    }
}

/// What `tool_choice` asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools: their format, `tool_choice`, and the functions (name, parameters).
#[derive(Clone, Debug)]
pub struct Tools {
    pub format: Format,
    pub choice: Choice,
    pub parallel: bool,
    /// Asked for with the legacy `functions`: answered with `function_call`, one call.
    pub legacy: bool,
    functions: Vec<(String, Value)>,
}

impl Tools {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls`; None without tools.
    pub fn parse(m: &Map<String, Value>, format: Format) -> Result<Option<Tools>, ApiError> {
        let Some(Value::Array(list)) = m.get("tools") else {
            if m.get("tool_choice")
                .is_some_and(|c| !c.is_null() && c != "none")
            {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` needs `tools`",
                ));
            }
            return Ok(None);
        };
        let mut functions = Vec::new();
        for (i, t) in list.iter().enumerate() {
            let f = t.get("function").unwrap_or(t);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid(
                    &format!("tools[{i}]"),
                    "each tool needs `function.name`",
                ));
            };
            let params = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            functions.push((name.to_string(), params));
        }
        let choice = match m.get("tool_choice") {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("unknown `tool_choice` {other:?} (none, auto, required, or a function)"),
                    ))
                }
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(n) if functions.iter().any(|(f, _)| f == n) => Choice::Named(n.to_string()),
                Some(n) => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`tool_choice` names {n:?}, which is not among `tools`"),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            },
        };
        let parallel = m
            .get("parallel_tool_calls")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        Ok(Some(Tools {
            format,
            choice,
            parallel,
            legacy: false,
            functions,
        }))
    }

    /// The grammar that forces a call, for `required` and a named function.
    pub fn constraint(&self) -> Option<ConstraintSpec> {
        let fs: Vec<&(String, Value)> = match &self.choice {
            Choice::None | Choice::Auto => return None,
            Choice::Required => self.functions.iter().collect(),
            Choice::Named(n) => self.functions.iter().filter(|(f, _)| f == n).collect(),
        };
        let args = match self.format {
            Format::Llama3 => "parameters",
            _ => "arguments",
        };
        // Parameters are closed as a schema's are: an object schema lists its keys.
        let closed: Vec<(String, Value)> = fs
            .iter()
            .map(|(name, params)| {
                let mut p = params.clone();
                quiver_engine::json_rules::close_objects(&mut p);
                (name.clone(), p)
            })
            .collect();
        let fs: Vec<&(String, Value)> = closed.iter().collect();
        // Each function's parameters may reference their own definitions (`#/$defs/…`,
        // `#/definitions/…`): they move to the root's `$defs`, their references with them.
        let mut defs = Map::new();
        let one: Vec<Value> = fs
            .iter()
            .enumerate()
            .map(|(i, (name, params))| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, args: hoist(params, i, &mut defs)},
                    "required": ["name", args],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut call = json!({"anyOf": one, "x-guidance": JSON_STYLE.clone()});
        if !defs.is_empty() {
            call["$defs"] = Value::Object(defs.clone());
        }
        let lark = match self.format {
            Format::Hermes => {
                // Qwen's templates put a newline between one call's block and the next.
                let more = if self.parallel {
                    " (\"\\n<tool_call>\\n\" call \"\\n</tool_call>\")*"
                } else {
                    ""
                };
                format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"{more}\ncall: %json {call}\n")
            }
            Format::Mistral => {
                let max = if self.parallel { json!(null) } else { json!(1) };
                let mut items = call.clone();
                if let Some(o) = items.as_object_mut() {
                    o.remove("$defs");
                }
                let mut arr = json!({"type": "array", "items": items, "minItems": 1, "x-guidance": JSON_STYLE.clone()});
                if !max.is_null() {
                    arr["maxItems"] = max;
                }
                if !defs.is_empty() {
                    arr["$defs"] = Value::Object(defs);
                }
                format!("start: \"[TOOL_CALLS]\" calls\ncalls: %json {arr}\n")
            }
            // Llama 3.x's templates take one call per turn.
            Format::Llama3 => format!("start: call\ncall: %json {call}\n"),
            Format::Gemma4 => {
                let funcs: Vec<(&str, &Value)> = fs.iter().map(|(n, p)| (n.as_str(), p)).collect();
                crate::gemma_call::grammar(&funcs, self.parallel)
            }
            Format::DeepSeek => {
                // One alternative per function: its name, then arguments to its schema.
                let alts: Vec<String> = fs
                    .iter()
                    .enumerate()
                    .map(|(i, (name, params))| {
                        let head = serde_json::to_string(&format!(
                            "{DS_CALL}function{DS_SEP}{name}\n```json\n"
                        ))
                        .expect("a string");
                        let tail = serde_json::to_string(&format!("\n```{DS_CALL_END}"))
                            .expect("a string");
                        let schema = json!({"x-guidance": JSON_STYLE.clone()})
                            .as_object()
                            .cloned()
                            .map(|mut o| {
                                if let Some(p) = params.as_object() {
                                    o.extend(p.clone());
                                }
                                Value::Object(o)
                            })
                            .unwrap_or(json!({}));
                        format!("f{i}: {head} a{i} {tail}\na{i}: %json {schema}\n")
                    })
                    .collect();
                let names: Vec<String> = (0..fs.len()).map(|i| format!("f{i}")).collect();
                // R1's template puts a newline between calls.
                let rep = if self.parallel {
                    " (\"\\n\" call)*"
                } else {
                    ""
                };
                format!(
                    "start: {} call{rep} {}\ncall: {}\n{}",
                    serde_json::to_string(DS_CALLS).expect("a string"),
                    serde_json::to_string(DS_CALLS_END).expect("a string"),
                    names.join(" | "),
                    alts.concat()
                )
            }
        };
        Some(match self.format {
            // Gemma 4's strings are not JSON's: its grammar bounds its own numbers.
            Format::Gemma4 => ConstraintSpec::Lark(lark),
            _ => ConstraintSpec::JsonLark(lark),
        })
    }

    /// The text before any call, and the calls (name, arguments as a JSON string), where the
    /// text holds calls in the format; None where it holds none (plain content). A last call
    /// cut short (the token limit) is left out, the complete ones before it kept: the calls
    /// may then be none, and the text before the call is still all the content.
    pub fn extract(&self, text: &str) -> Option<(String, Vec<(String, String)>)> {
        if self.choice == Choice::None {
            return None;
        }
        let mut calls = Vec::new();
        let (content, rest) = match self.format.marker() {
            Some(m) => {
                let at = text.find(m)?;
                (text[..at].trim().to_string(), &text[at..])
            }
            None => (String::new(), text.trim()),
        };
        let mut push = |v: &Value, args_key: &str| -> Option<()> {
            let name = v.get("name")?.as_str()?.to_string();
            let args = v
                .get(args_key)
                .or_else(|| v.get("arguments"))
                .cloned()
                .unwrap_or(json!({}));
            let args = match args {
                Value::String(s) => s,
                other => other.to_string(),
            };
            calls.push((name, args));
            Some(())
        };
        match self.format {
            Format::Hermes => {
                let mut r = rest;
                while let Some(a) = r.find("<tool_call>") {
                    let body = &r[a + "<tool_call>".len()..];
                    let end = body.find("</tool_call>");
                    let json = body[..end.unwrap_or(body.len())].trim();
                    match serde_json::from_str::<Value>(json) {
                        Ok(v) => push(&v, "arguments")?,
                        // The last call, unclosed: cut short.
                        Err(_) if end.is_none() => break,
                        Err(_) => return None,
                    }
                    r = &body[end.unwrap_or(body.len())..];
                }
            }
            Format::Mistral => {
                let body = rest.strip_prefix("[TOOL_CALLS]")?.trim_start();
                if !body.is_empty() {
                    for c in json_array_items(body.strip_prefix('[')?)? {
                        push(&c, "arguments")?;
                    }
                }
            }
            Format::Llama3 => {
                let body = rest.strip_prefix("<|python_tag|>").unwrap_or(rest);
                match serde_json::from_str::<Value>(body) {
                    Ok(v) => push(&v, "parameters")?,
                    // A call cut short: `{"name"` and no end.
                    Err(e) if e.is_eof() && squeezed(body).starts_with("{\"name\"") => {}
                    Err(_) => return None,
                }
            }
            Format::Gemma4 => {
                for (name, args) in crate::gemma_call::calls(rest)? {
                    push(&json!({"name": name, "arguments": args}), "arguments")?;
                }
            }
            Format::DeepSeek => {
                let mut r = rest;
                while let Some(a) = r.find(DS_CALL) {
                    let body = &r[a + DS_CALL.len()..];
                    let Some(end) = body.find(DS_CALL_END) else {
                        // The last call, cut short unless its arguments are whole.
                        if let Some((name, v)) = ds_call(body) {
                            push(&json!({"name": name, "arguments": v}), "arguments")?;
                        }
                        break;
                    };
                    let (name, v) = ds_call(&body[..end])?;
                    push(&json!({"name": name, "arguments": v}), "arguments")?;
                    r = &body[end..];
                }
            }
        }
        Some((content, calls))
    }
}

/// One DeepSeek call's body (between its begin and end marks): its name and arguments.
fn ds_call(body: &str) -> Option<(String, Value)> {
    let (left, right) = body.split_once(DS_SEP)?;
    let (name, args) = if left.trim() == "function" {
        // R1: NAME, a newline, ```json ARGS ```.
        let (name, block) = right.split_once('\n')?;
        let block = block.trim();
        let block = block
            .strip_prefix("```json")
            .or_else(|| block.strip_prefix("```"))
            .unwrap_or(block);
        (
            name.trim(),
            block.strip_suffix("```").unwrap_or(block).trim(),
        )
    } else {
        // V3.1: NAME<｜tool▁sep｜>ARGS.
        (left.trim(), right.trim())
    };
    let v: Value = serde_json::from_str(args).ok()?;
    Some((name.to_string(), v))
}

/// The first characters of `s` without whitespace.
fn squeezed(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).take(8).collect()
}

/// The whole items of a JSON array from after its `[`: a last item cut short is left out.
/// None: an item is not JSON, or the array goes on after a whole item with neither `,` nor `]`.
fn json_array_items(mut s: &str) -> Option<Vec<Value>> {
    let mut items = Vec::new();
    loop {
        s = s.trim_start();
        if s.is_empty() || s.starts_with(']') {
            return Some(items);
        }
        let mut it = serde_json::Deserializer::from_str(s).into_iter::<Value>();
        match it.next() {
            Some(Ok(v)) => {
                items.push(v);
                s = s[it.byte_offset()..].trim_start();
                match s.strip_prefix(',') {
                    Some(r) => s = r,
                    None if s.is_empty() || s.starts_with(']') => return Some(items),
                    None => return None,
                }
            }
            Some(Err(e)) if e.is_eof() => return Some(items),
            _ => return None,
        }
    }
}

/// Function `i`'s parameters as the arguments' schema inside a larger one: where they hold
/// references into themselves (`#`, `#/$defs/X`, `#/definitions/X`, any pointer), they go to
/// `defs` as `quiver_fI` and the references are rewritten to point there, so that they
/// resolve from the larger schema's root as they did from the parameters'.
fn hoist(params: &Value, i: usize, defs: &mut Map<String, Value>) -> Value {
    fn refs(v: &mut Value, prefix: &str) -> bool {
        let mut any = false;
        match v {
            Value::Object(o) => {
                for (k, x) in o.iter_mut() {
                    match (k.as_str(), x) {
                        // Literal values, not schemas.
                        ("const" | "enum" | "default" | "examples", _) => {}
                        ("$ref", Value::String(r)) if r.starts_with('#') => {
                            *r = format!("{prefix}{}", &r[1..]);
                            any = true;
                        }
                        (_, x) => any |= refs(x, prefix),
                    }
                }
            }
            Value::Array(a) => {
                for x in a {
                    any |= refs(x, prefix);
                }
            }
            _ => {}
        }
        any
    }
    let name = format!("quiver_f{i}");
    let mut p = params.clone();
    if !refs(&mut p, &format!("#/$defs/{name}")) {
        return params.clone();
    }
    defs.insert(name.clone(), p);
    json!({"$ref": format!("#/$defs/{name}")})
}

/// The legacy `function_call` of a call: `{name, arguments}`.
pub fn function_call_json(call: &(String, String)) -> Value {
    json!({"name": call.0, "arguments": call.1})
}

/// OpenAI's `tool_calls` array for parsed calls; ids unique within the response.
pub fn tool_calls_json(calls: &[(String, String)], response_id: &str) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| {
                json!({
                    "id": format!("call_{}_{i}", response_id.trim_start_matches("chatcmpl-")),
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(format: Format, choice: Value) -> Tools {
        let m = json!({
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                {"type": "function", "function": {"name": "get_time"}}
            ],
            "tool_choice": choice,
        });
        Tools::parse(m.as_object().unwrap(), format)
            .unwrap()
            .unwrap()
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(
            Format::of_template(Some("{{ '<tool_call>\\n' }}")),
            Format::Hermes
        );
        assert_eq!(Format::of_template(Some("[TOOL_CALLS]")), Format::Mistral);
        assert_eq!(Format::of_template(Some("<|python_tag|>")), Format::Llama3);
        assert_eq!(Format::of_template(None), Format::Hermes);
        assert_eq!(
            Format::of_template(Some("{{'<｜tool▁calls▁begin｜>'}}")),
            Format::DeepSeek
        );
    }

    #[test]
    fn calls_are_parsed_in_each_format() {
        let t = tools(Format::Hermes, json!("auto"));
        let (c, calls) = t
            .extract("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>")
            .unwrap();
        assert_eq!(c, "Let me check.");
        assert_eq!(
            calls,
            vec![
                ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
                ("get_time".into(), "{}".into())
            ]
        );
        assert!(t.extract("Just text, no call.").is_none());
        let t = tools(Format::Mistral, json!("auto"));
        let (_, calls) = t
            .extract("[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]")
            .unwrap();
        assert_eq!(calls[0].0, "get_time");
        let t = tools(Format::Llama3, json!("auto"));
        let (_, calls) = t
            .extract("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}")
            .unwrap();
        assert_eq!(
            calls[0],
            ("get_weather".into(), "{\"city\":\"Oslo\"}".into())
        );
        // DeepSeek R1, as llama.cpp's test-chat.cpp has it (one ``` closing the block), and
        // V3.1's form with two calls.
        let t = tools(Format::DeepSeek, json!("auto"));
        let (c, calls) = t
            .extract("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\"}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
            .unwrap();
        assert_eq!(
            (c.as_str(), &calls[..]),
            (
                "Sure.",
                &[("get_weather".to_string(), "{\"city\":\"Rome\"}".to_string())][..]
            )
        );
        let (_, calls) = t
            .extract("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":\"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
            .unwrap();
        assert_eq!(
            calls.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
            ["get_time", "get_weather"]
        );
        assert!(tools(Format::Hermes, json!("none"))
            .extract("<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>")
            .is_none());
    }

    #[test]
    fn choices_and_their_grammars() {
        assert!(tools(Format::Hermes, json!("auto")).constraint().is_none());
        let Some(ConstraintSpec::JsonLark(g)) = tools(
            Format::Hermes,
            json!({"type": "function", "function": {"name": "get_time"}}),
        )
        .constraint() else {
            panic!()
        };
        assert!(g.contains("get_time") && !g.contains("get_weather"), "{g}");
        let m = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}});
        let e = Tools::parse(m.as_object().unwrap(), Format::Hermes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"g\""), "{e}");
        let m = json!({"tool_choice": "required"});
        assert!(Tools::parse(m.as_object().unwrap(), Format::Hermes).is_err());
    }

    #[test]
    fn calls_cut_short_keep_the_whole_ones() {
        let w = (
            "get_weather".to_string(),
            "{\"city\":\"Paris\"}".to_string(),
        );
        let t = tools(Format::Hermes, json!("auto"));
        let two = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_ti";
        assert_eq!(t.extract(two), Some(("Sure.".into(), vec![w.clone()])));
        // Only a cut call: no calls, and its text is not content.
        assert_eq!(
            t.extract("Hi <tool_call>\n{\"name\": \"get"),
            Some(("Hi".into(), vec![]))
        );
        // Unclosed but whole (the model ended there): kept.
        let (_, c) = t
            .extract("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}")
            .unwrap();
        assert_eq!(c, vec![w.clone()]);
        // A closed call that is not JSON is not a call: the text stays content.
        assert!(t.extract("<tool_call>{oops</tool_call>").is_none());
        let t = tools(Format::Mistral, json!("auto"));
        assert_eq!(
            t.extract("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_"),
            Some((String::new(), vec![w.clone()]))
        );
        assert_eq!(t.extract("[TOOL_CALLS]"), Some((String::new(), vec![])));
        let t = tools(Format::Llama3, json!("auto"));
        assert_eq!(
            t.extract("{\"name\": \"get_weather\", \"parameters\": {\"ci"),
            Some((String::new(), vec![]))
        );
        assert!(t.extract("{not a call").is_none());
        let t = tools(Format::DeepSeek, json!("auto"));
        let ds = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{";
        assert_eq!(t.extract(ds), Some((String::new(), vec![w])));
    }

    #[test]
    fn forced_calls_follow_the_templates_forms() {
        let cat = json!({
            "tools": [{"type": "function", "function": {"name": "Cat", "strict": true, "parameters": {
                "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}}}],
            "tool_choice": "required",
        });
        let grammar = |format| {
            let t = Tools::parse(cat.as_object().unwrap(), format)
                .unwrap()
                .unwrap();
            match t.constraint() {
                Some(ConstraintSpec::JsonLark(g) | ConstraintSpec::Lark(g)) => g,
                other => panic!("{other:?}"),
            }
        };
        // The parameters are closed: the schema lists the only keys.
        let g = grammar(Format::Hermes);
        let schema = g
            .lines()
            .find_map(|l| l.strip_prefix("call: %json "))
            .unwrap();
        let schema: Value = serde_json::from_str(schema).unwrap();
        let args = &schema["anyOf"][0]["properties"]["arguments"];
        assert_eq!(args["additionalProperties"], json!(false), "{g}");
        // Parallel calls: Qwen's newline between blocks, R1's newline between calls.
        assert!(
            g.contains("(\"\\n<tool_call>\\n\" call \"\\n</tool_call>\")*"),
            "{g}"
        );
        assert!(grammar(Format::DeepSeek).contains("(\"\\n\" call)*"));
        // JSON spaced as the templates' tojson writes it.
        assert!(g.contains("\"item_separator\":\", \""), "{g}");
        assert!(grammar(Format::Mistral).contains("\"key_separator\":\": \""));
    }

    /// Every `$ref` in the grammar's JSON schemas resolves from its schema's root.
    #[test]
    fn definitions_resolve_in_forced_calls() {
        let params = |defs: &str| {
            json!({
                "type": "object",
                "properties": {"place": {"$ref": format!("#/{defs}/Place")}},
                "required": ["place"],
                defs: {
                    "Place": {"type": "object", "properties": {"unit": {"$ref": format!("#/{defs}/Unit")}}, "required": ["unit"]},
                    "Unit": {"enum": ["C", "F"]},
                },
            })
        };
        fn check_refs(v: &Value, root: &Value, n: &mut usize) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        assert!(root.pointer(&r[1..]).is_some(), "{r} in {root}");
                        *n += 1;
                    }
                    o.values().for_each(|x| check_refs(x, root, n));
                }
                Value::Array(a) => a.iter().for_each(|x| check_refs(x, root, n)),
                _ => {}
            }
        }
        for format in [
            Format::Hermes,
            Format::Mistral,
            Format::Llama3,
            Format::DeepSeek,
        ] {
            for defs in ["$defs", "definitions"] {
                let m = json!({
                    "tools": [
                        {"type": "function", "function": {"name": "a", "parameters": params(defs)}},
                        {"type": "function", "function": {"name": "b", "parameters": params(defs)}},
                    ],
                    "tool_choice": "required",
                });
                let t = Tools::parse(m.as_object().unwrap(), format)
                    .unwrap()
                    .unwrap();
                let Some(ConstraintSpec::JsonLark(g)) = t.constraint() else {
                    panic!()
                };
                let mut n = 0;
                for line in g.lines() {
                    if let Some((_, schema)) = line.split_once("%json ") {
                        let root: Value = serde_json::from_str(schema).unwrap();
                        check_refs(&root, &root, &mut n);
                    }
                }
                assert!(n >= 4, "{format:?} {defs}: {n} references in {g}");
            }
        }
        // Gemma 4's own syntax: the referenced enum shapes the value.
        let m = json!({
            "tools": [{"type": "function", "function": {"name": "a", "parameters": params("$defs")}}],
            "tool_choice": "required",
        });
        let t = Tools::parse(m.as_object().unwrap(), Format::Gemma4)
            .unwrap()
            .unwrap();
        let Some(ConstraintSpec::Lark(g)) = t.constraint() else {
            panic!()
        };
        assert!(g.contains("\"C\"") && g.contains("\"unit:\""), "{g}");
    }
}
