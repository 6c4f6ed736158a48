//! Writer → reader round trips, and read-back by the `gguf` Python package.

use quiver_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use sha2::{Digest, Sha256};
use std::process::Command;

fn every_value() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.alignment", Value::U32(64)),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(0.1)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ▁wörld 🦀".into())),
        ("t.u64", Value::U64(u64::MAX - 7)),
        ("t.i64", Value::I64(i64::MIN + 3)),
        ("t.f64", Value::F64(-1.0e300)),
        ("t.arr.u8", Value::Array(Array::U8(vec![0, 1, 255]))),
        ("t.arr.i8", Value::Array(Array::I8(vec![-128, 127]))),
        ("t.arr.u16", Value::Array(Array::U16(vec![1, 65535]))),
        ("t.arr.i16", Value::Array(Array::I16(vec![-1, 2]))),
        ("t.arr.u32", Value::Array(Array::U32(vec![7, 8, 9]))),
        ("t.arr.i32", Value::Array(Array::I32(vec![-7, 8]))),
        (
            "t.arr.f32",
            Value::Array(Array::F32(vec![1.5, -0.25, 3.0e-8])),
        ),
        (
            "t.arr.bool",
            Value::Array(Array::Bool(vec![true, false, true])),
        ),
        (
            "t.arr.string",
            Value::Array(Array::String(vec!["a".into(), "".into(), "ü ▁x".into()])),
        ),
        ("t.arr.u64", Value::Array(Array::U64(vec![u64::MAX]))),
        ("t.arr.i64", Value::Array(Array::I64(vec![i64::MIN]))),
        ("t.arr.f64", Value::Array(Array::F64(vec![0.1, 1e-300]))),
        ("t.arr.empty", Value::Array(Array::U32(vec![]))),
        (
            "t.arr.nested",
            Value::Array(Array::Array(vec![
                Array::I32(vec![1, 2]),
                Array::I32(vec![3, 4, 5]),
            ])),
        ),
    ]
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn sample_writer() -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    for (k, v) in every_value() {
        w.set(k, v);
    }
    let tensors: &[(&str, GgmlType, &[u64])] = &[
        ("a.f32", GgmlType::F32, &[3, 5]),
        ("b.f16", GgmlType::F16, &[7]),
        ("c.q8_0", GgmlType::Q8_0, &[2, 64]),
        ("d.q4_k", GgmlType::Q4_K, &[1, 2, 256]),
    ];
    let mut data = Vec::new();
    for (i, (name, ty, shape)) in tensors.iter().enumerate() {
        w.add_tensor(*name, *ty, shape);
        let n: u64 = shape.iter().product();
        data.push(random_bytes(
            ty.row_bytes(n).unwrap() as usize,
            i as u64 + 1,
        ));
    }
    (w, data)
}

#[test]
fn writer_output_reads_back_identically() {
    let (w, data) = sample_writer();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let bytes = w.to_bytes(&refs).unwrap();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset % 64, 0);
    let expect = every_value();
    assert_eq!(f.metadata.len(), expect.len());
    for ((k, v), (ek, ev)) in f.metadata.iter().zip(&expect) {
        assert_eq!(k, ek);
        assert_eq!(v, ev, "{k}");
    }
    for (t, d) in f.tensors.iter().zip(&data) {
        assert_eq!(f.tensor_data(t), d.as_slice(), "{}", t.name);
        assert_eq!(t.offset % 64, 0);
    }
    assert_eq!(f.tensor("d.q4_k").unwrap().shape, vec![1, 2, 256]);
    assert_eq!(f.tensor("d.q4_k").unwrap().ne(), vec![256, 2, 1]);
    // Writing what was read gives the same bytes.
    let mut w2 = GgufWriter::new();
    w2.metadata = f.metadata.clone();
    for t in &f.tensors {
        w2.add_tensor(t.name.clone(), t.ty, &t.shape);
    }
    let refs2: Vec<&[u8]> = f.tensors.iter().map(|t| f.tensor_data(t)).collect();
    assert_eq!(w2.to_bytes(&refs2).unwrap(), bytes);
}

/// Released bytes read back the same: from a mapped file (their pages refault from the file)
/// and from a file held in memory (nothing is released).
#[test]
fn released_tensor_bytes_read_back_the_same() {
    let (w, data) = sample_writer();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let bytes = w.to_bytes(&refs).unwrap();
    let path = std::env::temp_dir().join(format!("quiver-release-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    for f in [
        GgufFile::open(&path).unwrap(),
        GgufFile::from_bytes(bytes.clone()).unwrap(),
    ] {
        for (t, d) in f.tensors.iter().zip(&data) {
            f.release(f.tensor_data(t));
            assert_eq!(f.tensor_data(t), d.as_slice(), "{}", t.name);
        }
        // A slice from elsewhere is left alone.
        f.release(&bytes[..16]);
        assert_eq!(&bytes[..4], b"GGUF");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn writer_rejects_wrong_data_size_and_duplicates() {
    let mut w = GgufWriter::new();
    w.add_tensor("x", GgmlType::F32, &[4]);
    let e = w.to_bytes(&[&[0u8; 15]]).unwrap_err().to_string();
    assert!(e.contains("15 bytes, expected 16"), "{e}");
    w.add_tensor("x", GgmlType::F32, &[4]);
    assert!(w
        .to_bytes(&[&[0u8; 16], &[0u8; 16]])
        .unwrap_err()
        .to_string()
        .contains("duplicate"));
    let mut w = GgufWriter::new();
    w.add_tensor("q", GgmlType::Q4_0, &[33]);
    assert!(w
        .to_bytes(&[&[]])
        .unwrap_err()
        .to_string()
        .contains("not a multiple"));
}

fn python() -> String {
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv/bin/python");
    if std::path::Path::new(venv).exists() {
        venv.to_string()
    } else {
        "python3".to_string()
    }
}

#[test]
fn gguf_python_package_reads_writer_output_identically() {
    let (w, data) = sample_writer();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let path = std::env::temp_dir().join(format!("quiver-rt-{}.gguf", std::process::id()));
    w.write_file(&path, |i, _, buf| {
        buf.extend_from_slice(refs[i]);
        Ok(())
    })
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/gguf_dump.py");
    let out = Command::new(python())
        .arg(script)
        .arg(&path)
        .output()
        .expect("python3 runs");
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "gguf_dump.py failed (is the gguf package installed? run scripts/test): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["version"], 3);
    let meta = j["metadata"].as_object().unwrap();
    let f = GgufFile::from_bytes(w.to_bytes(&refs).unwrap()).unwrap();
    assert_eq!(meta.len(), f.metadata.len());
    for (k, v) in &f.metadata {
        let got = &meta[k];
        let leaves = |v: &Value| -> Vec<serde_json::Value> {
            fn flat(a: &Array, out: &mut Vec<serde_json::Value>) {
                let n = a.len();
                for i in 0..n {
                    match a {
                        Array::Array(x) => flat(&x[i], out),
                        Array::String(x) => out.push(x[i].clone().into()),
                        Array::Bool(x) => out.push(x[i].into()),
                        Array::F32(x) => out.push(format!("{:?}", x[i] as f64).into()),
                        Array::F64(x) => out.push(format!("{:?}", x[i]).into()),
                        _ => out.push(serde_json::Value::from(a.int_at(i).unwrap() as i64)),
                    }
                }
            }
            let mut out = Vec::new();
            if let Value::Array(a) = v {
                flat(a, &mut out)
            }
            out
        };
        match v {
            Value::Array(_) => {
                assert_eq!(got["type"], "array", "{k}");
                let py: Vec<serde_json::Value> = got["value"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| match x {
                        serde_json::Value::Number(n)
                            if n.is_u64() && n.as_u64().unwrap() > i64::MAX as u64 =>
                        {
                            // u64 beyond i64: compare through the same integer path as ours.
                            serde_json::Value::from(n.as_u64().unwrap() as i64)
                        }
                        serde_json::Value::String(s)
                            if s.parse::<f64>().is_ok() && s.contains(['.', 'e']) =>
                        {
                            format!("{:?}", s.parse::<f64>().unwrap()).into()
                        }
                        other => other.clone(),
                    })
                    .collect();
                assert_eq!(py, leaves(v), "{k}");
            }
            Value::F32(x) => assert_eq!(
                got["value"].as_str().unwrap().parse::<f64>().unwrap(),
                *x as f64,
                "{k}"
            ),
            Value::F64(x) => assert_eq!(
                got["value"].as_str().unwrap().parse::<f64>().unwrap(),
                *x,
                "{k}"
            ),
            Value::String(s) => assert_eq!(got["value"].as_str().unwrap(), s, "{k}"),
            Value::Bool(b) => assert_eq!(got["value"].as_bool().unwrap(), *b, "{k}"),
            _ => {
                let want = v.as_i128().unwrap();
                let have = got["value"]
                    .as_i64()
                    .map(|x| x as i128)
                    .or(got["value"].as_u64().map(|x| x as i128));
                assert_eq!(have, Some(want), "{k}");
            }
        }
    }
    let tensors = j["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), f.tensors.len());
    for (py, t) in tensors.iter().zip(&f.tensors) {
        assert_eq!(py["name"], t.name.as_str());
        assert_eq!(py["type"], t.ty.id());
        let ne: Vec<u64> = py["ne"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(ne, t.ne(), "{}", t.name);
        assert_eq!(
            py["offset"].as_u64().unwrap(),
            f.data_offset + t.offset,
            "{}",
            t.name
        );
        let sha: String = Sha256::digest(f.tensor_data(t))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(py["sha256"], sha.as_str(), "{}", t.name);
    }
}
