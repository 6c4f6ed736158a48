//! `quiver info`: a report of a GGUF file as JSON (the stable form, documented in
//! docs/CLI.md) and as text rendered from the same report.

use quiver_gguf::{Array, GgufFile, Value};
use serde_json::{json, Map, Value as J};
use std::io::Write;
use std::path::Path;

/// The f64 with the same shortest decimal form as the f32 (1e-5, not 9.99999974e-6).
fn f32_to_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn value_json(v: &Value) -> J {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => json!(f32_to_f64(*x)),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(s) => json!(s),
        Value::Array(a) => array_json(a),
    }
}

fn array_json(a: &Array) -> J {
    match a {
        Array::String(v) => json!(v),
        Array::Bool(v) => json!(v),
        Array::F32(v) => json!(v.iter().map(|&x| f32_to_f64(x)).collect::<Vec<_>>()),
        Array::F64(v) => json!(v),
        Array::Array(v) => J::Array(v.iter().map(array_json).collect()),
        other => J::Array(
            (0..other.len())
                .map(|i| json!(other.int_at(i).unwrap_or(0) as i64))
                .collect(),
        ),
    }
}

const SPECIAL: &[(&str, &str)] = &[
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"),
    ("eom", "tokenizer.ggml.eom_token_id"),
    ("unknown", "tokenizer.ggml.unknown_token_id"),
    ("padding", "tokenizer.ggml.padding_token_id"),
    ("separator", "tokenizer.ggml.seperator_token_id"),
    ("mask", "tokenizer.ggml.mask_token_id"),
];

/// A file of an architecture quiver runs must have hyperparameters it can load (as `bench`,
/// `run` and `serve` read them: counts within the file, sizes that fit together); else one
/// error. A file of another architecture is described as stored.
pub fn check(path: &Path, f: &GgufFile) -> anyhow::Result<()> {
    match f.arch() {
        Ok(a) if quiver_models::SUPPORTED.contains(&a) => {
            quiver_models::hparams(f).map(drop).map_err(|e| {
                anyhow::anyhow!("{}: {a} file that cannot be loaded: {e}", path.display())
            })
        }
        _ => Ok(()),
    }
}

/// The report; every field is always present (null when the file does not say).
pub fn report(path: &Path, f: &GgufFile) -> J {
    let arch = f
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let mut hparams = Map::new();
    if let Some(a) = &arch {
        let prefix = format!("{a}.");
        for (k, v) in &f.metadata {
            if let Some(rest) = k.strip_prefix(&prefix) {
                hparams.insert(rest.to_string(), value_json(v));
            }
        }
    }
    let tokens = f
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings());
    let vocab_size = tokens.map(|t| t.len() as u64).or_else(|| {
        arch.as_ref()
            .and_then(|a| f.get(&format!("{a}.vocab_size")))
            .and_then(|v| v.as_i128())
            .map(|n| n as u64)
    });
    let mut special = Map::new();
    for (name, key) in SPECIAL {
        if let Some(id) = f.get(key).and_then(|v| v.as_i128()) {
            let text = tokens.and_then(|t| usize::try_from(id).ok().and_then(|i| t.get(i)));
            special.insert(name.to_string(), json!({"id": id as i64, "text": text}));
        }
    }
    let s = |k: &str| f.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let b = |k: &str| f.get(k).and_then(|v| v.as_bool());
    let tokenizer = json!({
        "model": s("tokenizer.ggml.model"),
        "pre": s("tokenizer.ggml.pre"),
        "vocab_size": vocab_size,
        "merges": f.get("tokenizer.ggml.merges").and_then(|v| v.as_array()).map(|a| a.len()),
        "add_bos": b("tokenizer.ggml.add_bos_token"),
        "add_eos": b("tokenizer.ggml.add_eos_token"),
        "special_tokens": special,
        "chat_template": f.get("tokenizer.chat_template").is_some(),
    });
    let mut by_type: std::collections::BTreeMap<String, (u64, u64, u64)> = Default::default();
    let mut tensors = Vec::with_capacity(f.tensors.len());
    for t in &f.tensors {
        let e = by_type.entry(t.ty.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_elements;
        e.2 += t.n_bytes;
        tensors.push(
            json!({"name": t.name, "type": t.ty.name(), "shape": t.shape, "bytes": t.n_bytes}),
        );
    }
    let by_type: Map<String, J> = by_type
        .into_iter()
        .map(|(k, (n, p, b))| (k, json!({"tensors": n, "parameters": p, "bytes": b})))
        .collect();
    json!({
        "path": path.display().to_string(),
        "file_bytes": f.file_len(),
        "gguf_version": f.version,
        "alignment": f.alignment,
        "architecture": arch,
        "name": s("general.name"),
        "file_type": f.get("general.file_type").and_then(|v| v.as_i128()).map(|x| x as i64),
        "metadata_keys": f.metadata.len(),
        "hparams": hparams,
        "tokenizer": tokenizer,
        "tensors": tensors,
        "totals": {
            "tensors": f.tensors.len(),
            "parameters": f.tensors.iter().map(|t| t.n_elements).sum::<u64>(),
            "bytes": f.tensors.iter().map(|t| t.n_bytes).sum::<u64>(),
            "by_type": by_type,
        },
    })
}

fn show(v: &J) -> String {
    match v {
        J::Null => "-".into(),
        J::String(s) => s.clone(),
        J::Array(a) if a.len() > 8 => format!("[{} values]", a.len()),
        other => other.to_string(),
    }
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / 1048576.0)
}

/// Text rendering of [`report`].
pub fn print_text(r: &J, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "file:          {} ({}, GGUF v{})",
        show(&r["path"]),
        mib(r["file_bytes"].as_u64().unwrap_or(0)),
        r["gguf_version"]
    )?;
    writeln!(out, "architecture:  {}", show(&r["architecture"]))?;
    writeln!(out, "name:          {}", show(&r["name"]))?;
    writeln!(out, "file type:     {}", show(&r["file_type"]))?;
    writeln!(out, "hyperparameters:")?;
    if let Some(h) = r["hparams"].as_object() {
        for (k, v) in h {
            writeln!(out, "  {k:<40} {}", show(v))?;
        }
    }
    let t = &r["tokenizer"];
    writeln!(
        out,
        "tokenizer:     {} (pre: {}), vocabulary {}",
        show(&t["model"]),
        show(&t["pre"]),
        show(&t["vocab_size"])
    )?;
    writeln!(
        out,
        "  add bos/eos: {}/{}",
        show(&t["add_bos"]),
        show(&t["add_eos"])
    )?;
    if let Some(sp) = t["special_tokens"].as_object() {
        for (k, v) in sp {
            writeln!(out, "  {k:<10} {} {}", v["id"], show(&v["text"]))?;
        }
    }
    writeln!(
        out,
        "  chat template: {}",
        if t["chat_template"].as_bool() == Some(true) {
            "yes"
        } else {
            "no"
        }
    )?;
    writeln!(out, "tensors:")?;
    writeln!(
        out,
        "  {:<40} {:<8} {:<20} {:>12}",
        "name", "type", "shape", "bytes"
    )?;
    for x in r["tensors"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "  {:<40} {:<8} {:<20} {:>12}",
            show(&x["name"]),
            show(&x["type"]),
            x["shape"].to_string(),
            x["bytes"]
        )?;
    }
    let tot = &r["totals"];
    writeln!(
        out,
        "totals: {} tensors, {} parameters, {}",
        tot["tensors"],
        tot["parameters"],
        mib(tot["bytes"].as_u64().unwrap_or(0))
    )?;
    if let Some(bt) = tot["by_type"].as_object() {
        for (k, v) in bt {
            writeln!(
                out,
                "  {k:<8} {:>5} tensors {:>14} parameters {:>12}",
                v["tensors"],
                v["parameters"],
                mib(v["bytes"].as_u64().unwrap_or(0))
            )?;
        }
    }
    Ok(())
}
