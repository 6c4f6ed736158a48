//! TurboQuant, the KV cache's quantized element types (docs/TURBOQUANT.md): the scalar
//! reference encoder and decoder that the backends' fused kernels must agree with.
//!
//! A vector x of head dim D (a power of two, at most 512) is stored as:
//! 1. s ⊙ x, with s the fixed ±1 vector [`signs`] (the same everywhere);
//! 2. y = H(s ⊙ x) / √D, H the Walsh–Hadamard transform (so the rotation is orthonormal and
//!    its own inverse up to the signs: x = s ⊙ H(y) / √D);
//! 3. per block of 256 coordinates (all of D when D ≤ 256): the block's RMS r as f32, and
//!    z = y / r, close to N(0, 1) whatever x's distribution was;
//! 4. each z as the index of its nearest level of a codebook for N(0, 1): 256 evenly spaced
//!    levels in a byte (tq8: level c is (c − 127.5) · [`TQ8_STEP`], so a decoder computes it
//!    instead of looking it up), 16 Lloyd–Max levels in a nibble (tq4, two per byte, the even
//!    coordinate in the low nibble).
//!
//! tq8's step is the uniform quantizer of N(0, 1) with the least mean squared error
//! ([`uniform_step`] finds it; a test recomputes it); tq4's levels are computed by
//! [`lloyd_max`] (the procedure is documented there) and committed as a table.

/// The spacing of tq8's 256 levels: [`uniform_step`]`(256)` as f32.
pub const TQ8_STEP: f32 = 0.030_762_38;

/// tq8's levels, (c − 127.5) · [`TQ8_STEP`] for code c, each rounded once to f32 (the
/// difference is exact): what a decoder computes from a code.
pub const TQ8_LEVELS: [f32; 256] = {
    let mut l = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        l[c] = (c as f32 - 127.5) * TQ8_STEP;
        c += 1;
    }
    l
};

/// The quantized KV element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tq {
    /// 256 evenly spaced levels, one byte per element.
    Tq8,
    /// 16 Lloyd–Max levels, a nibble per element.
    Tq4,
}

impl Tq {
    pub fn levels(self) -> &'static [f32] {
        match self {
            Tq::Tq8 => &TQ8_LEVELS,
            Tq::Tq4 => &TQ4_LEVELS,
        }
    }

    /// Bytes of codes for `d` elements.
    pub fn code_bytes(self, d: usize) -> usize {
        match self {
            Tq::Tq8 => d,
            Tq::Tq4 => d.div_ceil(2),
        }
    }
}

/// Largest head dim the codec takes.
pub const MAX_DIM: usize = 512;
/// Coordinates per RMS block.
pub const BLOCK: usize = 256;
/// Seed of the sign vector.
const SIGN_SEED: u64 = 0x5475_7262_6f51_7561;

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fixed ±1 vector s (the first `d` entries of one sequence of [`MAX_DIM`]): bit i % 64 of
/// splitmix64's output number i / 64 from [`SIGN_SEED`], set meaning −1.
pub fn signs(d: usize) -> Vec<f32> {
    let mut st = SIGN_SEED;
    let mut word = 0;
    (0..d.min(MAX_DIM))
        .map(|i| {
            if i % 64 == 0 {
                word = splitmix64(&mut st);
            }
            if (word >> (i % 64)) & 1 == 1 {
                -1.0
            } else {
                1.0
            }
        })
        .collect()
}

/// The Walsh–Hadamard transform in place (unnormalized; `x.len()` a power of two).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

fn check_dim(d: usize) {
    assert!(
        d.is_power_of_two() && (2..=MAX_DIM).contains(&d),
        "TurboQuant needs a power-of-two head dim up to {MAX_DIM}, got {d}"
    );
}

/// [`signs`] of [`MAX_DIM`], made once.
fn sign_table() -> &'static [f32] {
    static S: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    S.get_or_init(|| signs(MAX_DIM))
}

/// x ← H(s ⊙ x) / √D, in place (no allocation).
pub fn rotate_in_place(x: &mut [f32]) {
    let d = x.len();
    check_dim(d);
    x.iter_mut().zip(sign_table()).for_each(|(v, s)| *v *= s);
    fwht(x);
    let k = 1.0 / (d as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= k);
}

/// y ← s ⊙ H(y) / √D, the inverse of [`rotate_in_place`], in place.
pub fn unrotate_in_place(y: &mut [f32]) {
    let d = y.len();
    check_dim(d);
    fwht(y);
    let k = 1.0 / (d as f32).sqrt();
    y.iter_mut()
        .zip(sign_table())
        .for_each(|(v, s)| *v *= k * s);
}

/// y = H(s ⊙ x) / √D.
pub fn rotate(x: &[f32]) -> Vec<f32> {
    let mut y = x.to_vec();
    rotate_in_place(&mut y);
    y
}

/// x = s ⊙ H(y) / √D, the inverse of [`rotate`].
pub fn unrotate(y: &[f32]) -> Vec<f32> {
    let mut x = y.to_vec();
    unrotate_in_place(&mut x);
    x
}

/// The index of the level nearest `z` (ties to the lower level).
pub fn nearest(levels: &[f32], z: f32) -> usize {
    // The first level whose upper threshold (midpoint to the next) is at or above z.
    let (mut lo, mut hi) = (0, levels.len() - 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if z <= 0.5 * (levels[mid] + levels[mid + 1]) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// One vector encoded: the blocks' RMS and the codes.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub rms: Vec<f32>,
    pub codes: Vec<u8>,
}

/// Encodes one vector of head dim `x.len()`.
pub fn encode(x: &[f32], tq: Tq) -> Encoded {
    let d = x.len();
    let mut e = Encoded {
        rms: vec![0.0; d.div_ceil(BLOCK)],
        codes: vec![0; tq.code_bytes(d)],
    };
    encode_into(x, tq, &mut e.codes, &mut e.rms);
    e
}

/// [`encode`] into `codes` ([`Tq::code_bytes`]) and `rms` (one per block), without allocating.
pub fn encode_into(x: &[f32], tq: Tq, codes: &mut [u8], rms: &mut [f32]) {
    let mut buf = [0f32; MAX_DIM];
    let y = &mut buf[..x.len()];
    y.copy_from_slice(x);
    rotate_in_place(y);
    let levels = tq.levels();
    for (bi, b) in y.chunks(BLOCK).enumerate() {
        let r = (b.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / b.len() as f64).sqrt()
            as f32;
        rms[bi] = r;
        let inv = if r > 0.0 { 1.0 / r } else { 0.0 };
        for (j, v) in b.iter().enumerate() {
            let i = bi * BLOCK + j;
            let c = nearest(levels, v * inv) as u8;
            match tq {
                Tq::Tq8 => codes[i] = c,
                Tq::Tq4 if i.is_multiple_of(2) => codes[i / 2] = c,
                Tq::Tq4 => codes[i / 2] |= c << 4,
            }
        }
    }
}

/// The rotated vector an encoding stands for (level × RMS per coordinate): what attention
/// scores against, in the rotated domain.
pub fn decode_rotated(e: &Encoded, d: usize, tq: Tq) -> Vec<f32> {
    let levels = tq.levels();
    (0..d)
        .map(|i| {
            let c = match tq {
                Tq::Tq8 => e.codes[i],
                Tq::Tq4 => (e.codes[i / 2] >> (4 * (i % 2))) & 15,
            };
            levels[c as usize] * e.rms[i / BLOCK]
        })
        .collect()
}

/// Decodes a vector of head dim `d`.
pub fn decode(e: &Encoded, d: usize, tq: Tq) -> Vec<f32> {
    unrotate(&decode_rotated(e, d, tq))
}

// ---- The codebooks ----

/// Φ(x), the standard normal CDF, to ~1e-15: the Taylor series of erf near 0, Lentz's
/// continued fraction for erfc in the tails.
pub fn normal_cdf(x: f64) -> f64 {
    if x.is_infinite() || x.abs() > 40.0 {
        return if x > 0.0 { 1.0 } else { 0.0 };
    }
    let t = x / std::f64::consts::SQRT_2;
    if t.abs() < 1.5 {
        // erf(t) = 2/√π Σ (−1)^n t^(2n+1) / (n! (2n+1))
        let (mut term, mut sum) = (t, t);
        let t2 = t * t;
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs().max(1e-300) {
            n += 1.0;
            term *= -t2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        0.5 * (1.0 + sum * 2.0 / std::f64::consts::PI.sqrt())
    } else {
        // erfc(|t|) = e^(−t²)/√π · 1/(t + 1/2/(t + 1/(t + 3/2/(t + …)))), modified Lentz.
        let a = t.abs();
        let tiny = 1e-300;
        let mut f = a;
        let (mut c, mut dd) = (a, 0.0);
        for k in 1..200 {
            let ak = k as f64 / 2.0;
            dd = a + ak * dd;
            dd = if dd.abs() < tiny { tiny } else { dd };
            c = a + ak / c;
            c = if c.abs() < tiny { tiny } else { c };
            dd = 1.0 / dd;
            let delta = c * dd;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / f;
        if t > 0.0 {
            1.0 - 0.5 * erfc
        } else {
            0.5 * erfc
        }
    }
}

/// Φ(b) − Φ(a) without cancellation in the upper tail (by symmetry, as 1 − Φ there).
fn cell_mass(a: f64, b: f64) -> f64 {
    if a >= 0.0 {
        normal_cdf(-a) - normal_cdf(-b)
    } else {
        normal_cdf(b) - normal_cdf(a)
    }
}

fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// The mean squared error of `levels` (sorted) on N(0, 1) with nearest-level quantization.
pub fn distortion(levels: &[f64]) -> f64 {
    // Σ over cells [a, b] of ∫ (z − l)² φ = (1 + l²) ΔΦ + (a − 2l) φ(a) − (b − 2l) φ(b)
    // (using ∫ z φ = φ(a) − φ(b) and ∫ z² φ = ΔΦ + a φ(a) − b φ(b)).
    let n = levels.len();
    (0..n)
        .map(|i| {
            let l = levels[i];
            let a = if i == 0 {
                f64::NEG_INFINITY
            } else {
                0.5 * (levels[i - 1] + l)
            };
            let b = if i + 1 == n {
                f64::INFINITY
            } else {
                0.5 * (l + levels[i + 1])
            };
            let (pa, pb) = (normal_pdf(a), normal_pdf(b));
            let (fa, fb) = (
                if a.is_finite() { a * pa } else { 0.0 },
                if b.is_finite() { b * pb } else { 0.0 },
            );
            let dp = cell_mass(a, b);
            (1.0 + l * l) * dp + fa - fb - 2.0 * l * (pa - pb)
        })
        .sum()
}

/// The mean of N(0, 1) over the cell of level `i` of `levels` (sorted): between the midpoints
/// to its neighbours, (φ(a) − φ(b)) / (Φ(b) − Φ(a)).
fn cell_mean(levels: &[f64], i: usize) -> f64 {
    let n = levels.len();
    let a = if i == 0 {
        f64::NEG_INFINITY
    } else {
        0.5 * (levels[i - 1] + levels[i])
    };
    let b = if i + 1 == n {
        f64::INFINITY
    } else {
        0.5 * (levels[i] + levels[i + 1])
    };
    (normal_pdf(a) - normal_pdf(b)) / cell_mass(a, b)
}

/// The Lloyd–Max quantizer of N(0, 1) with `n` levels (the procedure behind the tables):
/// start from the high-resolution optimum (levels at the (i + ½)/n quantiles of N(0, 3),
/// whose density is φ^(1/3) normalized), then alternate the two optimality conditions —
/// thresholds at the midpoints of neighbouring levels, each level the mean of N(0, 1) over its
/// cell, (φ(a) − φ(b)) / (Φ(b) − Φ(a)) — until no level moves by more than 1e-13. The levels
/// are symmetric (made exactly so after each step).
pub fn lloyd_max(n: usize) -> Vec<f64> {
    let quantile = |p: f64| {
        // Φ⁻¹(p) by bisection.
        let (mut lo, mut hi) = (-40.0f64, 40.0f64);
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if normal_cdf(mid) < p {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let mut l: Vec<f64> = (0..n)
        .map(|i| 3f64.sqrt() * quantile((i as f64 + 0.5) / n as f64))
        .collect();
    for _ in 0..1_000_000 {
        let mut next: Vec<f64> = (0..n).map(|i| cell_mean(&l, i)).collect();
        for i in 0..n / 2 {
            let m = 0.5 * (next[n - 1 - i] - next[i]);
            next[i] = -m;
            next[n - 1 - i] = m;
        }
        let moved = l
            .iter()
            .zip(&next)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        l = next;
        if moved < 1e-13 {
            break;
        }
    }
    l
}

/// The spacing of the `n` evenly spaced levels, symmetric about 0 ((i − (n − 1)/2) · step),
/// that quantize N(0, 1) with the least mean squared error ([`distortion`]): a golden-section
/// search over steps in (0, 8/n], where the distortion is unimodal.
pub fn uniform_step(n: usize) -> f64 {
    let d = |step: f64| {
        let l: Vec<f64> = (0..n)
            .map(|i| (i as f64 - (n - 1) as f64 / 2.0) * step)
            .collect();
        distortion(&l)
    };
    let g = (5f64.sqrt() - 1.0) / 2.0;
    let (mut a, mut b) = (0.0, 8.0 / n as f64);
    let (mut x1, mut x2) = (b - g * (b - a), a + g * (b - a));
    let (mut d1, mut d2) = (d(x1), d(x2));
    while b - a > 1e-12 {
        if d1 < d2 {
            b = x2;
            (x2, d2) = (x1, d1);
            x1 = b - g * (b - a);
            d1 = d(x1);
        } else {
            a = x1;
            (x1, d1) = (x2, d2);
            x2 = a + g * (b - a);
            d2 = d(x2);
        }
    }
    0.5 * (a + b)
}

include!("turboquant_tables.rs");

/// The committed table as Rust source (what `turboquant_tables.rs` holds), from
/// [`lloyd_max`].
pub fn tables_source() -> String {
    let mut s = String::from(
        "// Lloyd–Max levels of N(0, 1), from `turboquant::lloyd_max` (see there); regenerate with\n\
         // `cargo test -p quiver-backend --release turboquant -- --ignored --nocapture`.\n",
    );
    s += "pub const TQ4_LEVELS: [f32; 16] = [\n";
    for l in lloyd_max(16) {
        s += &format!("    {:e},\n", l as f32);
    }
    s + "];\n"
}

#[cfg(test)]
#[path = "turboquant_tests.rs"]
mod tests;
