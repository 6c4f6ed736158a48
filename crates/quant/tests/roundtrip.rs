//! Round-trip error bounds of every quantizer, behaviour on special input, and the error
//! cases of the public API.

use quiver_gguf::GgmlType;
use quiver_quant::{can_dequantize, can_quantize, dequantize, quantize, QuantError};

const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// splitmix64: a small deterministic generator for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn gaussian(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Weight-like data: Gaussian with a per-256 magnitude and occasional outliers.
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut x = Vec::with_capacity(n);
    for _ in 0..n / 256 {
        let scale = 10f64.powf(rng.uniform() * 4.0 - 3.0) as f32;
        for _ in 0..256 {
            let mut v = rng.gaussian() * scale;
            if rng.uniform() < 0.002 {
                v *= 8.0;
            }
            x.push(v);
        }
    }
    x
}

fn roundtrip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut q = Vec::new();
    quantize(ty, x, &mut q).unwrap();
    assert_eq!(
        q.len() as u64,
        ty.row_bytes(x.len() as u64).unwrap(),
        "{ty}: encoded size"
    );
    let mut y = vec![0f32; x.len()];
    dequantize(ty, &q, &mut y).unwrap();
    y
}

/// sqrt(sum (x - y)^2 / sum x^2), per 256-element block, averaged: every block counts the
/// same whatever its magnitude.
fn relative_rms_error(x: &[f32], y: &[f32]) -> f64 {
    let mut total = 0.0;
    let mut n = 0;
    for (xb, yb) in x.chunks(256).zip(y.chunks(256)) {
        let err: f64 = xb
            .iter()
            .zip(yb)
            .map(|(&a, &b)| ((a - b) as f64).powi(2))
            .sum();
        let norm: f64 = xb.iter().map(|&a| (a as f64).powi(2)).sum();
        total += (err / norm).sqrt();
        n += 1;
    }
    total / n as f64
}

/// Upper bounds on the relative RMS error for the Gaussian weights above: the measured
/// value (in the comment) plus about 30%. A uniform b-bit quantizer over a block's range of
/// about ±3.5σ has relative error ≈ 7 / 2^b / sqrt(12) ≈ 2 / 2^b; every bound is below that
/// prediction except Q8_K's (one scale per 256 elements, so outliers cost more).
fn bound(ty: GgmlType) -> f64 {
    use GgmlType::*;
    match ty {
        F32 => 0.0,
        F16 => 3e-4,              // 0.00021  (prediction 2^-10 ≈ 0.0010)
        BF16 => 2.2e-3,           // 0.00165  (2^-7 ≈ 0.0078)
        Q8_0 | Q8_1 => 0.0075,    // 0.00584  (0.0078)
        Q8_K => 0.0115,           // 0.00890
        Q6_K => 0.025,            // 0.0191   (0.031)
        Q5_0 => 0.06,             // 0.0464   (0.0625)
        Q5_1 => 0.051,            // 0.0393
        Q5_K => 0.049,            // 0.0375
        Q4_0 => 0.12,             // 0.0927   (0.125)
        Q4_1 => 0.104,            // 0.0801
        Q4_K => 0.096,            // 0.0737
        IQ4_NL | IQ4_XS => 0.105, // 0.0802, 0.0812
        Q3_K => 0.2,              // 0.157    (0.25)
        Q2_K => 0.4,              // 0.304    (0.5)
        _ => unreachable!(),
    }
}

#[test]
fn round_trip_error_is_within_the_bit_width_bound() {
    let x = weights(256 * 64, 7);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for &ty in SUPPORTED {
        let err = relative_rms_error(&x, &roundtrip(ty, &x));
        report.push(format!("{ty}: {err:.5}"));
        // NaN fails too.
        if err.is_nan() || err > bound(ty) {
            failures.push(format!("{ty}: relative RMS error {err:.5} > {}", bound(ty)));
        }
    }
    println!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn reference_quantizers_beat_the_plain_legacy_formats() {
    // The K-quants' scale searches must pay off against the same-width legacy formats.
    let x = weights(256 * 64, 11);
    let e = |ty| relative_rms_error(&x, &roundtrip(ty, &x));
    assert!(e(GgmlType::Q4_K) < e(GgmlType::Q4_1));
    assert!(e(GgmlType::Q5_K) < e(GgmlType::Q5_1));
    assert!(e(GgmlType::IQ4_NL) < e(GgmlType::Q4_0));
    assert!(e(GgmlType::Q6_K) < e(GgmlType::Q5_K));
    assert!(e(GgmlType::Q3_K) < e(GgmlType::Q2_K));
}

#[test]
fn requantizing_a_dequantized_tensor_is_stable() {
    // y = D(Q(x)) lies on the quantization grid; quantizing it again must not move it far:
    // exactly for the direct formats, and within a fraction of the first round trip's
    // error for the searched ones.
    let x = weights(256 * 32, 3);
    for &ty in SUPPORTED {
        let y = roundtrip(ty, &x);
        let z = roundtrip(ty, &y);
        let first = relative_rms_error(&x, &y);
        let second = relative_rms_error(&y, &z);
        assert!(
            second <= 0.5 * first + 1e-6,
            "{ty}: re-quantizing moved values by {second} (first error {first})"
        );
        let exact = matches!(
            ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q8_1
        );
        if exact {
            assert!(
                y.iter().zip(&z).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty}: not idempotent"
            );
        }
    }
}

#[test]
fn special_blocks_round_trip_sensibly() {
    for &ty in SUPPORTED {
        let n = 512;
        // All zero: exactly zero back.
        let y = roundtrip(ty, &vec![0.0; n]);
        assert!(y.iter().all(|&v| v == 0.0), "{ty}: zeros");
        // A constant block comes back close to the constant.
        let y = roundtrip(ty, &vec![0.75; n]);
        assert!(
            y.iter().all(|&v| (v - 0.75).abs() <= 0.75 * 0.15),
            "{ty}: constant {:?}",
            &y[..4]
        );
        // One non-zero value per block and tiny values must not blow up.
        let mut x = vec![0.0f32; n];
        x[5] = -3.0;
        x[300] = 2.0;
        let y = roundtrip(ty, &x);
        assert!(
            (y[5] + 3.0).abs() < 0.5 && (y[300] - 2.0).abs() < 0.5,
            "{ty}: sparse {} {}",
            y[5],
            y[300]
        );
        let y = roundtrip(ty, &vec![1e-20; n]);
        assert!(
            y.iter().all(|v| v.is_finite() && v.abs() < 1e-19),
            "{ty}: tiny"
        );
    }
}

#[test]
fn non_finite_input_and_random_bytes_do_not_panic() {
    let mut rng = Rng(99);
    for &ty in SUPPORTED {
        let mut x = weights(512, 5);
        x[3] = f32::NAN;
        x[260] = f32::INFINITY;
        x[300] = f32::NEG_INFINITY;
        x[400] = f32::MAX;
        let mut q = Vec::new();
        quantize(ty, &x, &mut q).unwrap();
        assert_eq!(q.len() as u64, ty.row_bytes(512).unwrap());
        // Random bytes, NaN and Inf scales included.
        let bytes: Vec<u8> = (0..q.len()).map(|_| rng.next_u64() as u8).collect();
        let mut y = vec![0f32; 512];
        dequantize(ty, &bytes, &mut y).unwrap();
    }
}

#[test]
fn quantize_appends_and_is_deterministic() {
    let x = weights(512, 8);
    for &ty in SUPPORTED {
        let mut a = vec![0xaa, 0xbb];
        quantize(ty, &x, &mut a).unwrap();
        let mut b = Vec::new();
        quantize(ty, &x, &mut b).unwrap();
        assert_eq!(&a[..2], &[0xaa, 0xbb], "{ty}");
        assert_eq!(&a[2..], &b[..], "{ty}");
    }
}

#[test]
fn support_is_reported_for_exactly_the_implemented_types() {
    for ty in GgmlType::all() {
        let expected = SUPPORTED.contains(&ty);
        assert_eq!(can_dequantize(ty), expected, "{ty}");
        assert_eq!(can_quantize(ty), expected, "{ty}");
        if !expected {
            let n = ty.block_size();
            let bytes = vec![0u8; ty.type_size()];
            assert_eq!(
                dequantize(ty, &bytes, &mut vec![0.0; n]),
                Err(QuantError::DequantizeUnsupported { ty })
            );
            let mut out = Vec::new();
            assert_eq!(
                quantize(ty, &vec![0.0; n], &mut out),
                Err(QuantError::QuantizeUnsupported { ty })
            );
            assert!(out.is_empty());
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    for &ty in SUPPORTED {
        let (bs, ts) = (ty.block_size(), ty.type_size());
        // Empty is fine.
        dequantize(ty, &[], &mut []).unwrap();
        quantize(ty, &[], &mut Vec::new()).unwrap();
        if bs > 1 {
            let n = bs + 1;
            let err = dequantize(ty, &vec![0u8; 2 * ts], &mut vec![0.0; n]).unwrap_err();
            assert_eq!(
                err,
                QuantError::NotBlockMultiple {
                    op: "dequantize",
                    ty,
                    n_elements: n,
                    block_size: bs
                }
            );
            let mut out = vec![1u8];
            let err = quantize(ty, &vec![0.0; n], &mut out).unwrap_err();
            assert_eq!(
                err,
                QuantError::NotBlockMultiple {
                    op: "quantize",
                    ty,
                    n_elements: n,
                    block_size: bs
                }
            );
            assert_eq!(out, [1u8], "{ty}: nothing appended on error");
            assert!(err.to_string().contains(ty.name()), "{err}");
        }
        for got in [2 * ts - 1, 2 * ts + 1, ts, 0] {
            let err = dequantize(ty, &vec![0u8; got], &mut vec![0.0; 2 * bs]).unwrap_err();
            assert_eq!(
                err,
                QuantError::ByteCountMismatch {
                    ty,
                    n_elements: 2 * bs,
                    expected_bytes: 2 * ts,
                    got_bytes: got
                }
            );
            let msg = err.to_string();
            assert!(
                msg.contains(ty.name()) && msg.contains(&got.to_string()),
                "{msg}"
            );
        }
    }
}
