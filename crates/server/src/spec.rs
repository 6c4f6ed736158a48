//! A request's speculative-decoding fields, as llama-server reads them: `speculative.n_max`,
//! `speculative.n_min` (integers, 0 to 256) and `speculative.p_min` (0 to 1), as keys with the
//! dot in their name or in a `speculative` object (`{"speculative": {"n_max": 4}}`). Each
//! replaces the server's `--draft-max`, `--draft-min`, `--draft-p-min` for the request
//! (`n_max` 0 turns proposals off for it); bad values are a 400 naming the field.

use crate::error::ApiError;
use crate::params::{get_f32, get_uint};
use quiver_engine::spec::{RequestSpec, MAX_DRAFT};
use serde_json::{Map, Value};

pub fn parse(m: &Map<String, Value>) -> Result<RequestSpec, ApiError> {
    let nested = match m.get("speculative") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(_) => {
            return Err(ApiError::invalid(
                "speculative",
                "`speculative` must be an object (n_max, n_min, p_min)",
            ))
        }
    };
    // The nested field, renamed with its dotted key so that an error names it so.
    let field = |k: &str| -> Map<String, Value> {
        let key = format!("speculative.{k}");
        let v = nested.and_then(|o| o.get(k)).or_else(|| m.get(&key));
        v.map(|v| (key, v.clone())).into_iter().collect()
    };
    let uint = |k: &str| -> Result<Option<usize>, ApiError> {
        let key = format!("speculative.{k}");
        Ok(get_uint(&field(k), &key, 0, MAX_DRAFT as u64)?.map(|n| n as usize))
    };
    let s = RequestSpec {
        n_max: uint("n_max")?,
        n_min: uint("n_min")?,
        p_min: get_f32(&field("p_min"), "speculative.p_min", 0.0, 1.0)?,
    };
    s.validate().map_err(|e| {
        let param = if e.contains("p_min") {
            "speculative.p_min"
        } else {
            "speculative.n_min"
        };
        ApiError::invalid(param, e)
    })?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(v: Value) -> Result<RequestSpec, ApiError> {
        parse(v.as_object().unwrap())
    }

    #[test]
    fn dotted_and_nested_fields() {
        let s = parse_json(json!({"speculative.n_max": 4, "speculative.p_min": 0.5})).unwrap();
        assert_eq!((s.n_max, s.n_min, s.p_min), (Some(4), None, Some(0.5)));
        let s = parse_json(json!({"speculative": {"n_min": 2, "n_max": 3}})).unwrap();
        assert_eq!((s.n_max, s.n_min, s.p_min), (Some(3), Some(2), None));
        assert_eq!(parse_json(json!({})).unwrap(), RequestSpec::default());
    }

    #[test]
    fn bad_values_are_400s_naming_the_field() {
        for (body, param) in [
            (json!({"speculative.n_max": -1}), "speculative.n_max"),
            (json!({"speculative.n_max": 1000}), "speculative.n_max"),
            (json!({"speculative.n_max": "4"}), "speculative.n_max"),
            (json!({"speculative": {"n_min": 1.5}}), "speculative.n_min"),
            (json!({"speculative.p_min": 1.5}), "speculative.p_min"),
            (json!({"speculative": {"p_min": "x"}}), "speculative.p_min"),
            (
                json!({"speculative.n_max": 2, "speculative.n_min": 3}),
                "speculative.n_min",
            ),
            (json!({"speculative": 3}), "speculative"),
        ] {
            let e = parse_json(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }
}
