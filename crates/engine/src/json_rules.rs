//! What quiver adds to JSON grammars beyond the schema's own words, as OpenAI's strict mode and
//! llama.cpp's grammars do: objects closed unless the schema opens them
//! ([`close_objects`]), and every number's digits bounded ([`Digits`]).

use serde_json::Value;

/// Most digits in a row of a JSON number's integer part, fraction or exponent (llama.cpp's
/// grammars allow 16 too). A model left free may otherwise write digits to its token limit.
pub const MAX_DIGITS: usize = 16;

/// Closes the object schemas in `schema` that list `properties` but say nothing of the others
/// (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`): they get
/// `"additionalProperties": false`, so the output holds the listed keys only. An object schema
/// without `properties` (`{"type": "object"}`) stays any object. The parts of an `allOf` stay as
/// they are: closing each would refuse the keys the others add.
pub fn close_objects(schema: &mut Value) {
    close(schema, false);
}

fn close(schema: &mut Value, in_all_of: bool) {
    let Value::Object(o) = schema else {
        return;
    };
    let opened = [
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    ]
    .iter()
    .any(|k| o.contains_key(*k));
    if o.get("properties").is_some_and(Value::is_object) && !opened && !in_all_of {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (k, v) in o.iter_mut() {
        match k.as_str() {
            // Maps of name to schema.
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(m) = v {
                    m.values_mut().for_each(|s| close(s, false));
                }
            }
            // One schema, or (`items` of old drafts) a list of them.
            "items"
            | "additionalItems"
            | "additionalProperties"
            | "unevaluatedItems"
            | "unevaluatedProperties"
            | "contains"
            | "propertyNames"
            | "not"
            | "if"
            | "then"
            | "else" => match v {
                Value::Array(a) => a.iter_mut().for_each(|s| close(s, false)),
                s => close(s, false),
            },
            "prefixItems" | "anyOf" | "oneOf" => {
                if let Value::Array(a) = v {
                    a.iter_mut().for_each(|s| close(s, false));
                }
            }
            "allOf" => {
                if let Value::Array(a) = v {
                    a.iter_mut().for_each(|s| close(s, true));
                }
            }
            _ => {}
        }
    }
}

/// The digit bound of one request's JSON output: follows the text drawn (in a string or not,
/// the digits in a row outside strings) and takes out of a mask the tokens that would write
/// more than [`MAX_DIGITS`] digits in a row.
#[derive(Clone, Debug, Default)]
pub struct Digits {
    in_string: bool,
    escaped: bool,
    run: usize,
    /// Output that is free text until a marker (tool calls after free text): the marker, and
    /// the text's last bytes (shorter than it) while it has not come.
    wait: Option<(Vec<u8>, Vec<u8>)>,
}

impl Digits {
    /// The bound of output that is JSON only after `marker` (free text before it).
    pub fn after(marker: &str) -> Digits {
        Digits {
            wait: Some((marker.as_bytes().to_vec(), Vec::new())),
            ..Digits::default()
        }
    }

    /// Follows a token's bytes (a special token's are none of JSON's: they end a run).
    pub fn push(&mut self, bytes: &[u8], special: bool) {
        if special {
            self.run = 0;
            return;
        }
        let bytes = match &mut self.wait {
            None => bytes,
            Some((marker, tail)) => {
                let from = tail.len();
                tail.extend_from_slice(bytes);
                match tail.windows(marker.len()).position(|w| w == &marker[..]) {
                    Some(at) => {
                        let rest = at + marker.len() - from;
                        self.wait = None;
                        &bytes[rest.min(bytes.len())..]
                    }
                    None => {
                        let keep = tail.len().min(marker.len() - 1);
                        tail.drain(..tail.len() - keep);
                        return;
                    }
                }
            }
        };
        for &b in bytes {
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
            } else if b.is_ascii_digit() {
                self.run += 1;
            } else {
                self.run = 0;
                self.in_string = b == b'"';
            }
        }
    }

    /// Takes out of `bits` the tokens whose leading digits (`leads`: token, how many it starts
    /// with) would make the run longer than [`MAX_DIGITS`]; unless that leaves no token, when
    /// the grammar itself asks for more digits (a schema's large `minimum`).
    pub fn restrict(&self, bits: &mut [u32], leads: &[(u32, u8)], longest: usize) {
        if self.wait.is_some() || self.in_string || self.run + longest <= MAX_DIGITS {
            return;
        }
        let room = MAX_DIGITS.saturating_sub(self.run);
        let mut cleared = Vec::new();
        for &(id, lead) in leads {
            let (w, b) = (id as usize / 32, 1u32 << (id % 32));
            if lead as usize > room && w < bits.len() && bits[w] & b != 0 {
                bits[w] &= !b;
                cleared.push((w, b));
            }
        }
        if !cleared.is_empty() && bits.iter().all(|&w| w == 0) {
            for (w, b) in cleared {
                bits[w] |= b;
            }
        }
    }
}

/// How many ASCII digits a token's text starts with (at most 255).
pub fn leading_digits(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count()
        .min(255) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_with_properties_are_closed() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "pet": {"type": "object", "properties": {"kind": {"type": "string"}}},
                "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {}}}},
                "extra": {"type": "object", "properties": {}, "additionalProperties": true},
                "any": {"type": "object"},
                // A property named like a keyword is a property, not a keyword.
                "properties": {"type": "object", "properties": {"x": {}}},
            },
            "$defs": {"D": {"properties": {"a": {}}}},
            "anyOf": [{"properties": {"b": {}}}],
            "allOf": [{"properties": {"c": {}}}],
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        let p = &s["properties"];
        assert_eq!(p["pet"]["additionalProperties"], json!(false));
        assert_eq!(p["tags"]["items"]["additionalProperties"], json!(false));
        assert_eq!(p["extra"]["additionalProperties"], json!(true));
        assert!(p["any"].get("additionalProperties").is_none());
        assert_eq!(p["properties"]["additionalProperties"], json!(false));
        assert!(p.get("additionalProperties").is_none(), "{p}");
        assert_eq!(s["$defs"]["D"]["additionalProperties"], json!(false));
        assert_eq!(s["anyOf"][0]["additionalProperties"], json!(false));
        assert!(s["allOf"][0].get("additionalProperties").is_none());
    }

    fn bits_all(n: usize) -> Vec<u32> {
        vec![u32::MAX; n.div_ceil(32)]
    }

    #[test]
    fn digit_runs_are_bounded_outside_strings() {
        // Token 1 is "7", token 2 is "12", token 3 is ",".
        let leads = [(1u32, 1u8), (2, 2)];
        let mut d = Digits::default();
        d.push(b"{\"a\":", false);
        for _ in 0..MAX_DIGITS - 1 {
            d.push(b"7", false);
        }
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b110, 0b010, "one more digit fits, two do not");
        d.push(b"7", false);
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b1110, 0b1000, "no digit fits, ',' does");
        // A fraction starts a new run.
        d.push(b".", false);
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b110, 0b110);
        // Inside a string (escaped quotes included) digits are free.
        let mut d = Digits::default();
        d.push(b"\"x\\\"", false);
        for _ in 0..40 {
            d.push(b"7", false);
        }
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b110, 0b110);
        // Where only digits are allowed (the grammar asks for them), nothing is taken out.
        let mut d = Digits::default();
        for _ in 0..20 {
            d.push(b"7", false);
        }
        let mut bits = vec![0b110u32, 0];
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0], 0b110);
        assert_eq!(leading_digits(b"123,"), 3);
        // Free text until the marker: digits bounded after it only (a marker split over
        // tokens, the JSON starting in the token that ends it).
        let mut d = Digits::after("<tool_call>");
        d.push(b"call 12345678901234567890 <tool", false);
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b110, 0b110);
        d.push(b"_call>\n{\"a\": 1234567890123456", false);
        let mut bits = bits_all(64);
        d.restrict(&mut bits, &leads, 2);
        assert_eq!(bits[0] & 0b110, 0, "16 digits after the marker");
        assert_eq!(leading_digits(b"a1"), 0);
    }
}
