//! Tool calls: how the model's chat template writes them (its family's format), the grammar
//! that forces one when `tool_choice` asks for it, and the parse of the generated text back
//! into OpenAI's `tool_calls`.
//!
//! Formats: Hermes / Qwen (`<tool_call>{"name", "arguments"}</tool_call>`, also the default for
//! templates that show none), Mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`), Llama 3.x
//! (a bare JSON object `{"name", "parameters"}`), DeepSeek (R1, V3, V3.1; V3.2 and V4's DSML
//! markup in crate::dsml_call), Gemma 4, and Qwen3-Coder / Qwen 3.5's XML form
//! (crate::xml_call).

use crate::error::ApiError;
use crate::reasoning::Thinking;
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
    /// Qwen3-Coder, Qwen 3.5: `<tool_call>` `<function=NAME>` `<parameter=KEY>` raw value
    /// `</parameter>` … `</function>` `</tool_call>` (crate::xml_call).
    XmlFunction,
    /// DeepSeek V3.2 (`<｜DSML｜function_calls>`) and V4 (`<｜DSML｜tool_calls>`): `<｜DSML｜invoke
    /// name="NAME">` with `<｜DSML｜parameter name="KEY" string="true|false">` values
    /// (crate::dsml_call).
    Dsml(crate::dsml_call::Block),
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
        } else if let Some(b) = crate::dsml_call::Block::of_template(s) {
            Format::Dsml(b)
        } else if s.contains(DS_CALLS) {
            Format::DeepSeek
        } else if s.contains(crate::gemma_call::OPEN) {
            Format::Gemma4
        } else if s.contains("<function=") {
            Format::XmlFunction
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
            Format::XmlFunction => Some(crate::xml_call::OPEN),
            Format::Dsml(b) => Some(b.open()),
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
        let lark = self.calls_grammar(&fs);
        Some(match self.format {
            // Gemma 4's strings are not JSON's: its grammar bounds its own numbers. The XML
            // and DSML forms' string values are raw text, where digits are free.
            Format::Gemma4 | Format::XmlFunction | Format::Dsml(_) => ConstraintSpec::Lark(lark),
            _ => ConstraintSpec::JsonLark(lark),
        })
    }

    /// With `tool_choice: auto`, the grammar that leaves the answer free until the format's
    /// marker and holds the calls after it to the tools' schemas (closed, as forced calls'
    /// are), as llama.cpp's lazy grammars do: text without the marker, or text, the marker and
    /// the calls. None where the format has no marker (Llama 3.x's bare JSON) or there are no
    /// tools. Digits are bounded from the marker on (Gemma 4's grammar bounds its own). A
    /// thinking model's thinking (`think`: its tags, and whether the prompt opened it) is free
    /// too: a marker there is not a call.
    pub fn auto_constraint(&self, think: Option<Thinking>) -> Option<ConstraintSpec> {
        if self.choice != Choice::Auto || self.functions.is_empty() {
            return None;
        }
        let fs: Vec<&(String, Value)> = self.functions.iter().collect();
        let lark = self.calls_grammar(&fs);
        let (first, rules) = lark.split_once('\n')?;
        let body = first.strip_prefix("start: ")?;
        let marker = self.format.marker()?;
        let lit = |t: &str| serde_json::to_string(t).expect("a string");
        let mut rules = rules.to_string();
        let rest = match self.format {
            Format::Hermes => body
                .strip_prefix("\"<tool_call>\\n\"")
                .map(|r| format!("\"\\n\"{r}")),
            Format::Mistral | Format::DeepSeek | Format::XmlFunction | Format::Dsml(_) => {
                body.strip_prefix(&lit(marker)).map(str::to_string)
            }
            // Each call opens with the marker: the first call without it, then the others.
            Format::Gemma4 => {
                let call = rules.lines().find(|l| l.starts_with("call: "))?;
                let open = format!("\"{marker}call:");
                let first = call
                    .replacen("call: ", "first: ", 1)
                    .replace(&open, "\"call:");
                rules.push_str(&first);
                rules.push('\n');
                Some(
                    if body.ends_with('+') {
                        "first call*"
                    } else {
                        "first"
                    }
                    .to_string(),
                )
            }
            Format::Llama3 => None,
        }?;
        let escaped = regex_lit(marker);
        // With thinking: the answer may open with it, and then does not start with its tag.
        let (start, not_think) = match think.map(|t| (t.tags.open, t.tags.close, t.prompt_opened)) {
            // The answer starts inside the thinking.
            Some((_, close, true)) => (
                format!(
                    "start: thinking answer\nthinking[suffix={}]: /(?s:.*)/\n",
                    lit(close)
                ),
                String::new(),
            ),
            Some((open, close, false)) => (
                format!(
                    "start: {} thinking answer | answer\nthinking[suffix={}]: /(?s:.*)/\n",
                    lit(open),
                    lit(close)
                ),
                format!(" & ~/{}(?s:.*)/", regex_lit(open)),
            ),
            None => ("start: answer\n".to_string(), String::new()),
        };
        let lark = format!(
            "{start}\
             answer: FREE_TEXT | pre rest\n\
             FREE_TEXT: /(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/{not_think}\n\
             pre[suffix={}]: /(?s:.*)/{not_think}\n\
             rest: {rest}\n{rules}",
            lit(marker)
        );
        Some(match self.format {
            // Gemma 4's strings are not JSON's: its grammar bounds its own numbers; the XML
            // and DSML forms' raw text values leave digits free.
            Format::Gemma4 | Format::XmlFunction | Format::Dsml(_) => ConstraintSpec::Lark(lark),
            _ => ConstraintSpec::JsonLarkAfter(lark, marker.to_string()),
        })
    }

    /// The Lark grammar of one or more calls (as `parallel` allows) of the functions `fs`, in
    /// the format, from its marker on.
    fn calls_grammar(&self, fs: &[&(String, Value)]) -> String {
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
            Format::XmlFunction => {
                let funcs: Vec<(&str, &Value)> = fs.iter().map(|(n, p)| (n.as_str(), p)).collect();
                crate::xml_call::grammar(&funcs, self.parallel, &JSON_STYLE)
            }
            Format::Dsml(b) => {
                let funcs: Vec<(&str, &Value)> = fs.iter().map(|(n, p)| (n.as_str(), p)).collect();
                crate::dsml_call::grammar(&funcs, b, self.parallel, &JSON_STYLE)
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
        lark
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
            Format::XmlFunction => {
                let schema_of =
                    |n: &str| self.functions.iter().find(|(f, _)| f == n).map(|(_, p)| p);
                for (name, args) in crate::xml_call::calls(rest, schema_of)? {
                    push(&json!({"name": name, "arguments": args}), "arguments")?;
                }
            }
            Format::Dsml(b) => {
                let schema_of =
                    |n: &str| self.functions.iter().find(|(f, _)| f == n).map(|(_, p)| p);
                for (name, args) in crate::dsml_call::calls(rest, b, schema_of)? {
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

/// `s` as a regular expression (between Lark's slashes) that matches it literally.
fn regex_lit(s: &str) -> String {
    s.chars()
        .map(|c| {
            if "\\.+*?()|[]{}^$#&-~/".contains(c) {
                format!("\\{c}")
            } else {
                c.to_string()
            }
        })
        .collect()
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
mod tests;
