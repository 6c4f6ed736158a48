use super::*;

/// Deterministic N(0, 1) samples (Box–Muller over splitmix64).
fn gaussians(n: usize, seed: u64) -> Vec<f32> {
    let mut st = seed;
    let mut u = || (splitmix64(&mut st) >> 11) as f64 / (1u64 << 53) as f64;
    (0..n)
        .map(|_| {
            let (a, b) = (u().max(1e-300), u());
            ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
        })
        .collect()
}

fn f64s(l: &[f32]) -> Vec<f64> {
    l.iter().map(|&v| v as f64).collect()
}

#[test]
#[ignore = "prints the tables (regenerating them takes ~15 s)"]
fn print_tables() {
    print!("{}", tables_source());
}

#[test]
fn the_committed_tq4_codebook_is_a_lloyd_max_fixed_point() {
    let l = f64s(&TQ4_LEVELS);
    let n = l.len();
    for i in 0..n {
        assert_eq!(l[i], -l[n - 1 - i], "symmetric");
        // Each level is the mean of N(0, 1) over its cell (to the table's f32 rounding).
        let mean = cell_mean(&l, i);
        assert!(
            (mean - l[i]).abs() < 2e-6 * l[i].abs().max(0.1),
            "level {i}: {} vs the cell mean {mean}",
            l[i]
        );
    }
}

#[test]
fn tq8_is_the_best_uniform_quantizer() {
    let step = uniform_step(256);
    assert_eq!(
        TQ8_STEP, step as f32,
        "TQ8_STEP is uniform_step(256) = {step}"
    );
    let at = |s: f64| distortion(&(0..256).map(|i| (i as f64 - 127.5) * s).collect::<Vec<_>>());
    // A minimum: a step 1% either side loses.
    assert!(at(step) < at(0.99 * step) && at(step) < at(1.01 * step));
    for c in 0..256 {
        assert_eq!(TQ8_LEVELS[c], -TQ8_LEVELS[255 - c], "symmetric");
        // What a decoder computes from the code.
        assert_eq!(TQ8_LEVELS[c], (c as u8 as f32 - 127.5) * TQ8_STEP);
    }
    assert!(TQ8_LEVELS.windows(2).all(|w| {
        let d = (w[1] - w[0]) as f64;
        (d / step - 1.0).abs() < 1e-5
    }));
}

/// The mean squared error of `levels` on N(0, 1), by Simpson's rule over [−12, 12].
fn simpson_distortion(levels: &[f32]) -> f64 {
    let (n, a, b) = (240_000, -12.0f64, 12.0f64);
    let h = (b - a) / n as f64;
    (0..=n)
        .map(|i| {
            let z = a + i as f64 * h;
            let q = levels[nearest(levels, z as f32)] as f64;
            let w = if i == 0 || i == n {
                1.0
            } else if i % 2 == 1 {
                4.0
            } else {
                2.0
            };
            w * (z - q).powi(2) * normal_pdf(z)
        })
        .sum::<f64>()
        * h
        / 3.0
}

#[test]
fn distortion_is_the_known_optimum() {
    // The closed form against Simpson's rule (the 16-level optimum is about 0.0095, as Max's
    // 1960 tables have it).
    let d4 = distortion(&f64s(&TQ4_LEVELS));
    let simpson = simpson_distortion(&TQ4_LEVELS);
    assert!(
        (d4 - simpson).abs() < 1e-7 && (d4 - 0.0095).abs() < 1e-4,
        "tq4 {d4} vs {simpson}"
    );
    // 256 even levels: above the high-resolution optimum of any 256 levels (Panter–Dite,
    // π√3/2 · 4⁻⁸) but within 2.2× of it (8.8e-5 against 4.2e-5), and mostly the granular
    // step²/12.
    let d8 = distortion(&f64s(&TQ8_LEVELS));
    let s8 = simpson_distortion(&TQ8_LEVELS);
    assert!((d8 / s8 - 1.0).abs() < 1e-3, "tq8 {d8} vs {s8}");
    let pd = std::f64::consts::PI * 3f64.sqrt() / 2.0 / 65536.0;
    let granular = (TQ8_STEP as f64).powi(2) / 12.0;
    assert!(
        d8 > pd && d8 < 2.2 * pd && d8 > granular && d8 < 1.2 * granular,
        "tq8 {d8}: Panter–Dite {pd}, step²/12 {granular}"
    );
    // And the quantizer gives it on Gaussian samples.
    let z = gaussians(1 << 17, 7);
    for (levels, d) in [(&TQ8_LEVELS[..], d8), (&TQ4_LEVELS[..], d4)] {
        let mse = z
            .iter()
            .map(|&v| {
                let e = (levels[nearest(levels, v)] - v) as f64;
                e * e
            })
            .sum::<f64>()
            / z.len() as f64;
        assert!(
            (mse / d - 1.0).abs() < 0.03,
            "{} levels: {mse} vs {d}",
            levels.len()
        );
    }
}

#[test]
fn nearest_is_the_closest_level() {
    let z = gaussians(4000, 3);
    for levels in [&TQ8_LEVELS[..], &TQ4_LEVELS[..]] {
        for &v in z
            .iter()
            .chain(&[-100.0, 100.0, 0.0, levels[3], 0.5 * (levels[3] + levels[4])])
        {
            let i = nearest(levels, v);
            let best = levels
                .iter()
                .map(|l| (l - v).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((levels[i] - v).abs(), best, "{v}");
        }
    }
}

#[test]
fn the_signs_are_fixed_and_balanced() {
    let s = signs(MAX_DIM);
    assert!(s.iter().all(|&v| v == 1.0 || v == -1.0));
    let neg = s.iter().filter(|&&v| v < 0.0).count();
    assert!((200..312).contains(&neg), "{neg} of 512 negative");
    assert_eq!(
        signs(64),
        s[..64].to_vec(),
        "one sequence for every head dim"
    );
}

#[test]
fn the_rotation_is_orthonormal_and_keeps_dot_products() {
    for d in [64, 128, 256, 512] {
        let mut q = gaussians(d, d as u64);
        let k = gaussians(d, 1000 + d as u64);
        q[5] = 40.0; // an outlier channel, as keys have
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (*x as f64) * (*y as f64))
                .sum::<f64>()
        };
        let (rq, rk) = (rotate(&q), rotate(&k));
        let scale = dot(&q, &q).sqrt() * dot(&k, &k).sqrt();
        assert!((dot(&rq, &rk) - dot(&q, &k)).abs() < 1e-6 * scale, "d {d}");
        assert!(
            (dot(&rq, &rq) - dot(&q, &q)).abs() < 1e-6 * dot(&q, &q),
            "d {d}"
        );
        let back = unrotate(&rq);
        let err = q
            .iter()
            .zip(&back)
            .map(|(a, b)| ((a - b) as f64).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-5, "d {d}: round trip {err}");
        // The outlier is spread over every coordinate.
        let peak = rq.iter().map(|v| v.abs()).fold(0.0, f32::max);
        assert!(peak < 40.0 / (d as f32).sqrt() + 5.0, "d {d}: peak {peak}");
    }
}

#[test]
fn encoding_loses_what_the_codebook_predicts() {
    for (tq, theory) in [
        (Tq::Tq8, distortion(&f64s(&TQ8_LEVELS))),
        (Tq::Tq4, distortion(&f64s(&TQ4_LEVELS))),
    ] {
        for d in [64, 128, 512] {
            // Skewed inputs: squared Gaussians, an outlier, a constant offset.
            let mut total = (0.0, 0.0);
            for r in 0..40 {
                let mut x: Vec<f32> = gaussians(d, 77 + r * 1000 + d as u64)
                    .iter()
                    .map(|v| v * v + 0.3)
                    .collect();
                x[(r as usize) % d] = 25.0;
                let e = encode(&x, tq);
                assert_eq!(
                    (e.rms.len(), e.codes.len()),
                    (d.div_ceil(BLOCK), tq.code_bytes(d))
                );
                let y = decode(&e, d, tq);
                total.0 += x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| ((a - b) as f64).powi(2))
                    .sum::<f64>();
                total.1 += x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
            }
            let rel = total.0 / total.1;
            assert!(
                rel > 0.5 * theory && rel < 1.5 * theory,
                "{tq:?} d {d}: relative error {rel}, codebook {theory}"
            );
        }
    }
    // A zero vector stays zero.
    let e = encode(&[0.0; 128], Tq::Tq4);
    assert!(decode(&e, 128, Tq::Tq4).iter().all(|&v| v == 0.0));
}
