//! Gemma 4's tool-call syntax: `<|tool_call>call:NAME{key:value,…}<tool_call|>`, the values
//! strings between `<|"|>` marks, numbers, `true`/`false`/`null`, `[…]` lists and `{…}` dicts
//! with bare keys (as llama.cpp's test-chat.cpp cases spell them).

use serde_json::{Map, Number, Value};

pub(crate) const OPEN: &str = "<|tool_call>";
pub(crate) const CLOSE: &str = "<tool_call|>";
const QUOTE: &str = "<|\"|>";

/// The calls in `text` from the first `<|tool_call>` on: (name, arguments); None if one of
/// them does not parse, except a last one cut short (no `<tool_call|>` after it), left out.
pub(crate) fn calls(mut text: &str) -> Option<Vec<(String, Value)>> {
    let mut out = Vec::new();
    while let Some(a) = text.find(OPEN) {
        let after = &text[a + OPEN.len()..];
        let one = || {
            let body = after.strip_prefix("call:")?;
            let brace = body.find('{')?;
            let name = body[..brace].trim().to_string();
            let mut p = P { s: &body[brace..] };
            let args = p.value()?;
            Some((name, args, p.s.trim_start()))
        };
        match one() {
            Some((name, args, rest)) => {
                text = rest.strip_prefix(CLOSE).unwrap_or(rest);
                out.push((name, args));
            }
            None if !after.contains(CLOSE) => break,
            None => return None,
        }
    }
    Some(out)
}

struct P<'a> {
    s: &'a str,
}

impl P<'_> {
    fn ws(&mut self) {
        self.s = self.s.trim_start();
    }

    fn eat(&mut self, t: &str) -> bool {
        self.ws();
        match self.s.strip_prefix(t) {
            Some(r) => {
                self.s = r;
                true
            }
            None => false,
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.ws();
        if self.eat(QUOTE) {
            let end = self.s.find(QUOTE)?;
            let v = self.s[..end].to_string();
            self.s = &self.s[end + QUOTE.len()..];
            return Some(Value::String(v));
        }
        if self.eat("{") {
            let mut m = Map::new();
            if self.eat("}") {
                return Some(Value::Object(m));
            }
            loop {
                self.ws();
                let k = self
                    .s
                    .find(':')
                    .filter(|&i| i > 0 && !self.s[..i].contains([',', '}', '{']))?;
                let key = self.s[..k].trim().to_string();
                self.s = &self.s[k + 1..];
                let v = self.value()?;
                m.insert(key, v);
                if self.eat("}") {
                    return Some(Value::Object(m));
                }
                if !self.eat(",") {
                    return None;
                }
            }
        }
        if self.eat("[") {
            let mut a = Vec::new();
            if self.eat("]") {
                return Some(Value::Array(a));
            }
            loop {
                a.push(self.value()?);
                if self.eat("]") {
                    return Some(Value::Array(a));
                }
                if !self.eat(",") {
                    return None;
                }
            }
        }
        for (w, v) in [
            ("true", Value::Bool(true)),
            ("false", Value::Bool(false)),
            ("null", Value::Null),
        ] {
            if self.eat(w) {
                return Some(v);
            }
        }
        // A number: the longest prefix JSON reads as one.
        let end = self
            .s
            .find(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c)))
            .unwrap_or(self.s.len());
        let n: Number = serde_json::from_str(&self.s[..end]).ok()?;
        self.s = &self.s[end..];
        Some(Value::Number(n))
    }
}

/// The Lark grammar of one or more calls (`parallel`) to the functions (name, parameters
/// schema): the syntax above, each call's arguments held to its schema where the schema is
/// of the kinds below (objects with properties, closed, strings and their `enum`,
/// integers, numbers, booleans, null, arrays and nested objects); anything else takes any
/// value of the syntax.
pub(crate) fn grammar(functions: &[(&str, &Value)], parallel: bool) -> String {
    let mut g = Grammar::default();
    let calls: Vec<String> = functions
        .iter()
        .map(|(n, schema)| {
            let head = lit(&format!("{OPEN}call:{n}"));
            g.root = (*schema).clone();
            let args = g.object(schema).unwrap_or_else(|| "dict".into());
            format!("{head} {args} {}", lit(CLOSE))
        })
        .collect();
    let rep = if parallel { "+" } else { "" };
    let q = lit(QUOTE);
    format!(
        "start: call{rep}\n\
         call: {}\n\
         {}\
         dict: \"{{\" (pair (\",\" pair)*)? \"}}\"\n\
         pair: KEY \":\" value\n\
         value: {q} TEXT {q} | NUMBER | \"true\" | \"false\" | \"null\" | list | dict\n\
         list: \"[\" (value (\",\" value)*)? \"]\"\n\
         KEY: /[A-Za-z_][A-Za-z0-9_]*/\n\
         TEXT: /[^<]*/\n\
         INT: /-?[0-9]{{1,16}}/\n\
         NUMBER: /-?[0-9]{{1,16}}(\\.[0-9]{{1,16}})?([eE][+-]?[0-9]{{1,16}})?/\n",
        calls.join(" | "),
        g.rules,
    )
}

fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string")
}

/// How deep schemas nest (through references too) before a value is taken as any value.
const MAX_DEPTH: usize = 16;

/// Rules made for schemas, named `s0`, `s1`, …
#[derive(Default)]
struct Grammar {
    rules: String,
    n: usize,
    /// The function's parameters, which its references (`#/$defs/…`) point into.
    root: Value,
    depth: usize,
}

impl Grammar {
    fn rule(&mut self, body: String) -> String {
        let name = format!("s{}", self.n);
        self.n += 1;
        self.rules += &format!("{name}: {body}\n");
        name
    }

    /// The schema a `$ref` (a pointer into the parameters, `#/…`) names, followed through
    /// chains of references; the schema itself without one.
    fn resolve<'a>(&'a self, mut s: &'a Value) -> Option<Value> {
        for _ in 0..MAX_DEPTH {
            match s.get("$ref").and_then(Value::as_str) {
                Some(r) => s = self.root.pointer(r.strip_prefix('#')?)?,
                None => return Some(s.clone()),
            }
        }
        None
    }

    /// An object schema with properties: the required ones in the order of `required`, then
    /// each optional one (in order) or not; all optional: `optional_object`. None: not of that
    /// kind.
    fn object(&mut self, schema: &Value) -> Option<String> {
        let schema = &self.resolve(schema)?;
        let props = schema.get("properties")?.as_object()?;
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if required.iter().any(|r| !props.contains_key(*r)) {
            return None;
        }
        if required.is_empty() {
            return self.optional_object(schema, props);
        }
        let mut parts = Vec::new();
        for (i, k) in required.iter().enumerate() {
            let v = self.value(&props[*k]);
            let sep = if i == 0 { "" } else { "\",\" " };
            parts.push(format!("{sep}{} {v}", lit(&format!("{k}:"))));
        }
        for (k, s) in props
            .iter()
            .filter(|(k, _)| !required.contains(&k.as_str()))
        {
            let v = self.value(s);
            parts.push(format!("(\",\" {} {v})?", lit(&format!("{k}:"))));
        }
        Some(self.rule(format!("\"{{\" {} \"}}\"", parts.join(" "))))
    }

    /// An object schema whose properties are all optional, closed as JSON schemas are unless
    /// it says otherwise: any of them in the schema's order, a comma between two. None (any
    /// dict): it allows other keys, or has too many properties for the grammar's alternatives
    /// (one per first property: quadratic in their number).
    fn optional_object(&mut self, schema: &Value, props: &Map<String, Value>) -> Option<String> {
        let open = ["additionalProperties", "patternProperties"]
            .iter()
            .any(|k| schema.get(*k).is_some_and(|v| v != &Value::Bool(false)));
        if open || props.len() > 12 {
            return None;
        }
        let items: Vec<String> = props
            .iter()
            .map(|(k, s)| format!("{} {}", lit(&format!("{k}:")), self.value(s)))
            .collect();
        let alts: Vec<String> = (0..items.len())
            .map(|first| {
                let mut a = items[first].clone();
                for later in &items[first + 1..] {
                    a += &format!(" (\",\" {later})?");
                }
                a
            })
            .collect();
        let body = if alts.is_empty() {
            String::new()
        } else {
            format!(" ({})?", alts.join(" | "))
        };
        Some(self.rule(format!("\"{{\"{body} \"}}\"")))
    }

    fn value(&mut self, s: &Value) -> String {
        let Some(s) = self.resolve(s).filter(|_| self.depth < MAX_DEPTH) else {
            return "value".into();
        };
        self.depth += 1;
        let v = self.value_of(&s);
        self.depth -= 1;
        v
    }

    fn value_of(&mut self, s: &Value) -> String {
        let q = lit(QUOTE);
        if let Some(e) = s.get("enum").and_then(Value::as_array) {
            let alts: Vec<String> = e
                .iter()
                .map(|v| match v {
                    Value::String(t) if !t.contains('<') => format!("{q} {} {q}", lit(t)),
                    other => lit(&other.to_string()),
                })
                .collect();
            return self.rule(alts.join(" | "));
        }
        match s.get("type").and_then(Value::as_str) {
            Some("string") => format!("{q} TEXT {q}"),
            Some("integer") => "INT".into(),
            Some("number") => "NUMBER".into(),
            Some("boolean") => "(\"true\" | \"false\")".into(),
            Some("null") => "\"null\"".into(),
            Some("array") => {
                let item = s
                    .get("items")
                    .map(|i| self.value(i))
                    .unwrap_or_else(|| "value".into());
                self.rule(format!("\"[\" ({item} (\",\" {item})*)? \"]\""))
            }
            Some("object") => self.object(s).unwrap_or_else(|| "dict".into()),
            _ => "value".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn llama_cpp_test_chat_cases_parse() {
        // test-chat.cpp's Gemma 4 cases, with the arguments it expects.
        for (text, name, args) in [
            ("<|tool_call>call:get_time{city:<|\"|>London<|\"|>}<tool_call|>", "get_time", json!({"city": "London"})),
            ("<|tool_call>call:empty_args{}<tool_call|>", "empty_args", json!({})),
            ("<|tool_call>call:special_function{arg1:-7}<tool_call|>", "special_function", json!({"arg1": -7})),
            ("<|tool_call>call:amount{orig:2.75}<tool_call|>", "amount", json!({"orig": 2.75})),
            ("<|tool_call>call:amount{orig:1.5e10}<tool_call|>", "amount", json!({"orig": 1.5e10})),
            ("<|tool_call>call:toggle{enabled:false}<tool_call|>", "toggle", json!({"enabled": false})),
            ("<|tool_call>call:set_nullable{value:null}<tool_call|>", "set_nullable", json!({"value": null})),
            ("<|tool_call>call:todo_list{todos:[<|\"|>buy milk<|\"|>,<|\"|>walk dog<|\"|>]}<tool_call|>", "todo_list", json!({"todos": ["buy milk", "walk dog"]})),
            ("<|tool_call>call:set_config{config:{theme:<|\"|>dark<|\"|>,count:3}}<tool_call|>", "set_config", json!({"config": {"theme": "dark", "count": 3}})),
            ("<|tool_call>call:todo_list{todos:[]}<tool_call|>", "todo_list", json!({"todos": []})),
        ] {
            assert_eq!(calls(text), Some(vec![(name.to_string(), args)]), "{text}");
        }
        let two = calls("<|tool_call>call:get_time{city:<|\"|>London<|\"|>}<tool_call|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>").unwrap();
        assert_eq!(
            two.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
            ["get_time", "get_weather"]
        );
        assert_eq!(calls("<|tool_call>call:f{a:}<tool_call|>"), None);
        // A last call cut short is left out, the whole ones before it kept.
        assert_eq!(calls("<|tool_call>call:f{a:1"), Some(vec![]));
        assert_eq!(
            calls("<|tool_call>call:f{a:1}<tool_call|><|tool_call>call:g{b:<|\"|>x"),
            Some(vec![("f".to_string(), json!({"a": 1}))])
        );
    }

    #[test]
    fn schemas_shape_the_arguments() {
        let schema = json!({"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}, "days": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "boolean"}}},
            "required": ["unit", "city"]});
        let g = grammar(&[("get_weather", &schema), ("anything", &json!({}))], false);
        // Required in the schema's order of `required`, then the optional ones, each optional.
        // Rules are numbered as made: the enum s0, the array s1, the object last (s2).
        let s0 = g
            .lines()
            .find(|l| l.starts_with("s2:"))
            .expect("the object rule");
        let (unit, city) = (s0.find("\"unit:\"").unwrap(), s0.find("\"city:\"").unwrap());
        assert!(unit < city, "{s0}");
        assert!(
            s0.contains("(\",\" \"days:\" INT)?") && s0.contains("(\",\" \"tags:\" s1)?"),
            "{s0}"
        );
        assert!(
            g.contains("s0: \"<|\\\"|>\" \"C\" \"<|\\\"|>\" | \"<|\\\"|>\" \"F\" \"<|\\\"|>\""),
            "{g}"
        );
        assert!(
            g.contains("s1: \"[\" ((\"true\" | \"false\") (\",\" (\"true\" | \"false\"))*)? \"]\""),
            "{g}"
        );
        // A schema without properties takes any dict.
        assert!(
            g.contains("\"<|tool_call>call:anything\" dict \"<tool_call|>\""),
            "{g}"
        );
        // Properties all optional: closed, any of them in order, commas between.
        let opt = json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}});
        let g = grammar(&[("f", &opt)], false);
        assert!(
            g.contains("\"{\" (\"a:\" INT (\",\" \"b:\" (\"true\" | \"false\"))? | \"b:\" (\"true\" | \"false\"))? \"}\""),
            "{g}"
        );
        let open = json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true});
        assert!(grammar(&[("f", &open)], false).contains("\"<|tool_call>call:f\" dict"));
        assert!(g.starts_with("start: call\n"));
    }
}
