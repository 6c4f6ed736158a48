//! Bit-exact parity with the reference fixtures written by
//! `tools/fixtures/make_quant_fixtures.py` (gguf-py 0.19.0 and ggml's reference quantizers).

use quiver_gguf::{GgmlType, GgufFile};
use quiver_quant::{dequantize, quantize};
use std::path::Path;

const TYPES: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS",
];

fn fixtures() -> GgufFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant-fixtures.gguf");
    GgufFile::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn tensor<'a>(f: &'a GgufFile, name: &str) -> (GgmlType, usize, &'a [u8]) {
    let (info, bytes) = f
        .tensor_bytes(name)
        .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
    (info.ty, info.n_elements as usize, bytes)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn source(f: &GgufFile, key: &str) -> String {
    f.get_str(key).ok().flatten().unwrap_or("?").to_string()
}

#[test]
fn dequantize_matches_reference_bit_for_bit() {
    let f = fixtures();
    let mut failures = Vec::new();
    for name in TYPES {
        let ty = GgmlType::from_name(name).unwrap();
        let (in_ty, n, data) = tensor(&f, &format!("deq.{name}.in"));
        assert_eq!(in_ty, ty, "deq.{name}.in has type {in_ty}");
        let (_, n_out, expected) = tensor(&f, &format!("deq.{name}.out"));
        assert_eq!(n, n_out);
        let expected = f32s(expected);
        let mut got = vec![0f32; n];
        dequantize(ty, data, &mut got).unwrap_or_else(|e| panic!("{e}"));
        if let Some(i) = (0..n).find(|&i| got[i].to_bits() != expected[i].to_bits()) {
            let n_bad = (0..n)
                .filter(|&i| got[i].to_bits() != expected[i].to_bits())
                .count();
            failures.push(format!(
                "{name} ({}): {n_bad}/{n} differ, first at {i}: got {} ({:#010x}) want {} ({:#010x})",
                source(&f, &format!("quiver.fixture.deq.{name}")),
                got[i],
                got[i].to_bits(),
                expected[i],
                expected[i].to_bits()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "dequantize mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn quantize_matches_reference_bit_for_bit() {
    let f = fixtures();
    let mut failures = Vec::new();
    for name in TYPES {
        let ty = GgmlType::from_name(name).unwrap();
        let (_, _, input) = tensor(&f, &format!("q.{name}.in"));
        let (out_ty, _, expected) = tensor(&f, &format!("q.{name}.out"));
        assert_eq!(out_ty, ty, "q.{name}.out has type {out_ty}");
        let input = f32s(input);
        let mut got = Vec::new();
        quantize(ty, &input, &mut got).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.len(), expected.len(), "{name}: encoded length");
        if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
            let bs = ty.type_size();
            let n_bad = got
                .chunks(bs)
                .zip(expected.chunks(bs))
                .filter(|(a, b)| a != b)
                .count();
            let blk = i / bs;
            failures.push(format!(
                "{name} ({}): {n_bad}/{} blocks differ, first byte {i} (block {blk}, offset {})\n  got  {:02x?}\n  want {:02x?}",
                source(&f, &format!("quiver.fixture.q.{name}")),
                expected.len() / bs,
                i % bs,
                &got[blk * bs..(blk + 1) * bs],
                &expected[blk * bs..(blk + 1) * bs],
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "quantize mismatches:\n{}",
        failures.join("\n")
    );
}
