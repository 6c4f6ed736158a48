//! Python behaviour that Hugging Face's chat-template renderer (Jinja2) has and minijinja
//! does not by itself: `tojson` as `json.dumps`, `str()` of values (`{{ x }}`, `x|string`),
//! and the `{% generation %}` tag of transformers' AssistantTracker.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// transformers' `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keywords. Default separators are `", "` and
/// `": "`, or `","` and `": "` with an indent (newlines then).
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // An integer counts spaces; a string is the indent itself; None means inline.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(v.clone())
                    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: bad indent"))?;
                " ".repeat(n.max(0) as usize)
            }
        }),
    };
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&json, &style, 0, &mut out);
    if ensure_ascii.unwrap_or(false) {
        out = ascii_escape(&out);
    }
    Ok(Value::from(out))
}

pub struct JsonStyle {
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort: bool,
}

impl JsonStyle {
    /// `json.dumps` defaults, with `indent` spaces if given.
    #[cfg(test)]
    pub fn python(indent: Option<usize>) -> JsonStyle {
        JsonStyle {
            indent: indent.map(|n| " ".repeat(n)),
            item_sep: if indent.is_some() { "," } else { ", " }.to_string(),
            key_sep: ": ".to_string(),
            sort: false,
        }
    }
}

/// Non-ASCII characters as `\uXXXX` (UTF-16 surrogate pairs beyond the BMP). In JSON text
/// they can only be inside strings, so the whole text can be escaped at once.
fn ascii_escape(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for u in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

pub fn write_json(v: &serde_json::Value, style: &JsonStyle, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
    };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json(x, style, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            if style.sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(&style.key_sep);
                write_json(x, style, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `str(value)`: strings as they are, `None`/`True`/`False`, and lists and dicts
/// in `repr` form (`{'a': [1, 'x']}`). `None` for values this does not change (undefined,
/// numbers, objects), which keep minijinja's own rendering.
pub fn py_str(v: &Value) -> Option<String> {
    match v.kind() {
        ValueKind::String => None,
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            py_repr(v, &mut out);
            Some(out)
        }
        _ => None,
    }
}

/// Python's `repr(value)` for JSON-like values.
fn py_repr(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::String => repr_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(it) = v.try_iter() {
                for (i, x) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&x, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(it) = v.try_iter() {
                for (i, k) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&k, out);
                    out.push_str(": ");
                    py_repr(&v.get_item(&k).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double
/// quote; backslash escapes for the quote, backslash, `\n \r \t` and other control characters.
fn repr_str(s: &str, out: &mut String) {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(q);
}

/// The source with `{% generation %}` / `{% endgeneration %}` (transformers' marker around
/// the assistant's text, which renders its body unchanged) turned into `{% if true %}` /
/// `{% endif %}`, whitespace control kept.
pub fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner.trim_start_matches(['-', '+']);
        let lead = &inner[..inner.len() - body.len()];
        let body = body.trim_end_matches(['-', '+']);
        let trail = &inner[lead.len() + body.len()..];
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_str_and_repr() {
        let v = Value::from_serialize(serde_json::json!({
            "a": [1, 2.5, "it's", "say \"hi\"\n", null, true],
            "b": {}
        }));
        assert_eq!(
            py_str(&v).unwrap(),
            r#"{'a': [1, 2.5, "it's", 'say "hi"\n', None, True], 'b': {}}"#
        );
        assert_eq!(py_str(&Value::from(false)).unwrap(), "False");
        assert_eq!(py_str(&Value::from(())).unwrap(), "None");
        assert!(py_str(&Value::from("x")).is_none());
    }

    #[test]
    fn ascii_json() {
        assert_eq!(ascii_escape("\"é😀\""), "\"\\u00e9\\ud83d\\ude00\"");
    }

    #[test]
    fn generation_tags() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}{%if x%}"),
            "a{%- if true -%}b{% endif %}{%if x%}"
        );
        assert_eq!(rewrite_generation_tags("{{ x }} {%"), "{{ x }} {%");
    }
}
