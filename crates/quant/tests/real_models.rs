//! Dequantizes every tensor of the two real models and compares the sha256 of the f32 output
//! with gguf-py's (tests/fixtures/real-dequant-sha256.json, made by
//! tools/fixtures/real_model_dequant_hashes.py).

use quiver_gguf::{GgufFile, TensorInfo};
use quiver_quant::dequantize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::Path;

/// Elements dequantized at a time (a multiple of every block size).
const CHUNK: usize = 1 << 16;

fn expected() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real-dequant-sha256.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid JSON")
}

fn open_model(alias: &str) -> GgufFile {
    let path = quiver_hub::alias_path(alias);
    if !path.exists() {
        panic!(
            "model {alias} is missing at {}: run scripts/test, which fetches the test models",
            path.display()
        );
    }
    GgufFile::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn sha256_of_dequantized(
    t: &TensorInfo,
    data: &[u8],
    buf: &mut Vec<f32>,
    bytes: &mut Vec<u8>,
) -> String {
    let n = t.n_elements as usize;
    let (bs, ts) = (t.ty.block_size(), t.ty.type_size());
    assert_eq!(CHUNK % bs, 0);
    let mut hasher = Sha256::new();
    let mut done = 0;
    while done < n {
        let len = CHUNK.min(n - done);
        let src = &data[done / bs * ts..(done + len) / bs * ts];
        buf.resize(len, 0.0);
        dequantize(t.ty, src, buf).unwrap_or_else(|e| panic!("{}: {e}", t.name));
        bytes.resize(len * 4, 0);
        for (b, v) in bytes.chunks_exact_mut(4).zip(buf.iter()) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        hasher.update(&bytes[..]);
        done += len;
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn check_model(alias: &str) {
    let all = expected();
    let want = all[alias]
        .as_object()
        .unwrap_or_else(|| panic!("no hashes for {alias}"));
    let file = open_model(alias);
    assert_eq!(
        file.tensors.len(),
        want.len(),
        "{alias}: tensor count differs from the hash file"
    );
    let (mut buf, mut bytes) = (Vec::new(), Vec::new());
    let mut failures = Vec::new();
    for t in &file.tensors {
        let w = want
            .get(&t.name)
            .unwrap_or_else(|| panic!("{alias}: no hash for tensor {}", t.name));
        assert_eq!(
            w["type"].as_str(),
            Some(t.ty.name()),
            "{alias} {}: type",
            t.name
        );
        assert_eq!(
            w["n_elements"].as_u64(),
            Some(t.n_elements),
            "{alias} {}: n_elements",
            t.name
        );
        let got = sha256_of_dequantized(t, file.tensor_data(t), &mut buf, &mut bytes);
        if Some(got.as_str()) != w["sha256"].as_str() {
            failures.push(format!(
                "{} ({}): got {got}, want {}",
                t.name, t.ty, w["sha256"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{alias}: {} tensors differ from gguf-py:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_135m_dequantizes_like_gguf_py() {
    check_model("smollm2-135m");
}

#[test]
fn gemma3_270m_dequantizes_like_gguf_py() {
    check_model("gemma3-270m");
}
