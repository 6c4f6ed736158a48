//! Scalar reference implementations of every op, on plain slices. Backends are tested against
//! these; the CPU backend also uses the cheap element-wise ones directly.

use crate::{Activation, AttnParams, Batch, Gating, MoeParams, RopeMode, RopeParams};

/// The experts a token goes to and their weights, best first, as llama.cpp routes: the
/// router's probabilities (softmax over all experts, or each logit's sigmoid), the `n_used`
/// largest (ties to the smaller index), divided by their sum (at least 2⁻¹⁴) when `norm`,
/// times `scale`. Always `min(n_used, logits.len())` distinct experts: a NaN probability (a
/// NaN logit, or an infinite one) ranks below every number and is left out of the softmax's
/// sum; when fewer than `n_used` are numbers, NaN ones fill the rest by index, weighing 0.
pub fn moe_route(logits: &[f32], p: &MoeParams, out: &mut Vec<(u32, f32)>) {
    let probs: Vec<f32> = match p.gating {
        Gating::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f64 = e.iter().filter(|v| !v.is_nan()).map(|&v| v as f64).sum();
            let inv = (1.0 / sum) as f32;
            e.iter().map(|&v| v * inv).collect()
        }
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    out.clear();
    top_k(&probs, p.n_used, out);
    let nan = probs.iter().enumerate().filter(|(_, v)| v.is_nan());
    let missing = p.n_used.min(probs.len()) - out.len();
    out.extend(nan.take(missing).map(|(i, _)| (i as u32, 0.0)));
    if p.norm {
        let sum: f32 = out.iter().map(|e| e.1).sum();
        let sum = sum.max(2f32.powi(-14));
        out.iter_mut().for_each(|e| e.1 /= sum);
    }
    if p.scale != 0.0 && p.scale != 1.0 {
        out.iter_mut().for_each(|e| e.1 *= p.scale);
    }
}

/// A mixture-of-experts FFN on f32 weights (`router` [n_expert, d], `gate`/`up`
/// [n_expert · n_ff, d], `down` [n_expert · d, n_ff]) over `rows` rows of x. The router reads
/// `router_x` (x itself but for Gemma 4); `down_scale` [n_expert] scales each expert's output.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    x: &[f32],
    router_x: &[f32],
    rows: usize,
    d: usize,
    w: [&[f32]; 4],
    down_scale: Option<&[f32]>,
    p: &MoeParams,
    out: &mut [f32],
) {
    let [router, gate, up, down] = w;
    let ff = p.n_ff;
    let mut logits = vec![0f32; p.n_expert];
    let mut routes = Vec::new();
    let (mut g, mut u, mut a, mut y) = (
        vec![0f32; ff],
        vec![0f32; ff],
        vec![0f32; ff],
        vec![0f32; d],
    );
    for t in 0..rows {
        let xt = &x[t * d..][..d];
        matmul(
            router,
            p.n_expert,
            d,
            &router_x[t * d..][..d],
            1,
            &mut logits,
        );
        moe_route(&logits, p, &mut routes);
        let o = &mut out[t * d..][..d];
        for (j, &(e, wt)) in routes.iter().enumerate() {
            let e = e as usize;
            matmul(&gate[e * ff * d..][..ff * d], ff, d, xt, 1, &mut g);
            matmul(&up[e * ff * d..][..ff * d], ff, d, xt, 1, &mut u);
            glu(p.act, &g, &u, &mut a);
            matmul(&down[e * d * ff..][..d * ff], d, ff, &a, 1, &mut y);
            if let Some(s) = down_scale {
                y.iter_mut().for_each(|v| *v *= s[e]);
            }
            for (o, &v) in o.iter_mut().zip(&y) {
                *o = if j == 0 { v * wt } else { *o + v * wt };
            }
        }
    }
}

/// out[r] = x[r] / rms(x[r]) · w for each row of `w.len()` elements.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        // Squares in f32, summed in f64: ggml's rounding (llama.cpp parity).
        let ss: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let inv = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// out[r] = x[r] / rms(x[r]) for each row of `d` elements (no weight).
pub fn rms_norm_plain(x: &[f32], d: usize, eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let inv = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for (o, &v) in or.iter_mut().zip(xr) {
            *o = v * inv;
        }
    }
}

/// x[t, c] *= w[c] over rows of `w.len()`.
pub fn mul_cols(x: &mut [f32], w: &[f32]) {
    for row in x.chunks_exact_mut(w.len().max(1)) {
        row.iter_mut().zip(w).for_each(|(x, g)| *x *= g);
    }
}

/// out[t, c] = src[t · src_cols + first + c] for c < width, over `rows` rows.
pub fn copy_cols(
    src: &[f32],
    src_cols: usize,
    first: usize,
    width: usize,
    rows: usize,
    out: &mut [f32],
) {
    for t in 0..rows {
        out[t * width..][..width].copy_from_slice(&src[t * src_cols + first..][..width]);
    }
}

/// out[t, at + c] = src[t, c] over `rows` rows of `width` (out rows of `out_cols`).
pub fn put_cols(
    src: &[f32],
    width: usize,
    rows: usize,
    out: &mut [f32],
    out_cols: usize,
    at: usize,
) {
    for t in 0..rows {
        out[t * out_cols + at..][..width].copy_from_slice(&src[t * width..][..width]);
    }
}

/// In-place rotation of `x` [n_tokens, n_heads, head_dim] at the tokens' positions.
pub fn rope(x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize, p: &RopeParams) {
    let half = p.n_dims / 2;
    let m = p.mscale();
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let v = &mut x[(t * n_heads + h) * head_dim..][..head_dim];
            for i in 0..half {
                let angle = pos as f32 * p.theta(i);
                let (s, c) = angle.sin_cos();
                let (s, c) = (s * m, c * m);
                let (a, b) = match p.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// Constrained decoding's mask on one row ([`crate::Backend::mask_rows`]): column c keeps its
/// value only where bit c of `bits` is set; columns past the bits are refused.
pub fn mask_row(row: &mut [f32], bits: &[u32]) {
    for (i, chunk) in row.chunks_mut(32).enumerate() {
        let w = bits.get(i).copied().unwrap_or(0);
        if w != u32::MAX {
            // Without branches (the bits are as good as random): a refused value's bits
            // become −∞'s.
            for (b, v) in chunk.iter_mut().enumerate() {
                let keep = 0u32.wrapping_sub((w >> b) & 1);
                *v = f32::from_bits(v.to_bits() & keep | f32::NEG_INFINITY.to_bits() & !keep);
            }
        }
    }
}

/// Index of the largest value, the first on ties (NaN never wins).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest values of `row` as (index, value), best first, ties to the smaller index
/// (the sampler's order); NaN never counts.
pub fn top_k(row: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    let by = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let start = out.len();
    out.extend(
        row.iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v)),
    );
    let mine = &mut out[start..];
    if k > 0 && k < mine.len() {
        mine.select_nth_unstable_by(k - 1, by);
    }
    let keep = k.min(mine.len());
    out.truncate(start + keep);
    out[start..].sort_by(by);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// GELU as ggml's CPU path computes it: through an f16 table (input and output rounded to
/// f16), saturating outside ±10, each entry `(0.5x)·(1 + tanh((c·x)·fma(0.044715x, x, 1)))` as
/// the reference build's compiler fused it. Matching it keeps gemma's numerics close to
/// llama.cpp's.
pub fn gelu_tanh_f16(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let xh = half::f16::from_f32(x).to_f32();
        let inner = (SQRT_2_OVER_PI * xh) * (0.044715 * xh).mul_add(xh, 1.0);
        half::f16::from_f32((0.5 * xh) * (1.0 + inner.tanh())).to_f32()
    }
}

pub fn glu(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = match act {
            Activation::SwiGlu => silu(g),
            Activation::GeGlu => gelu_tanh_f16(g),
        } * u;
    }
}

/// Causal attention over a slot-indexed K/V cache of `kv_dim = n_head_kv · head_dim` per slot.
/// q, out: [n_tokens, n_head, head_dim].
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    batch: &Batch,
    a: &AttnParams,
    out: &mut [f32],
) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let kv_dim = a.n_head_kv * hd;
    let group = nh / a.n_head_kv;
    let mut scores = Vec::new();
    for t in 0..batch.n_tokens() {
        let s = batch.seq_of[t] as usize;
        let pos = batch.positions[t] as usize;
        let first = match a.window {
            Some(w) => (pos + 1).saturating_sub(w as usize),
            None => 0,
        };
        for h in 0..nh {
            let qh = &q[(t * nh + h) * hd..][..hd];
            let kvh = h / group;
            scores.clear();
            for p in first..=pos {
                let slot = batch.slot(s, p);
                let k = &k_cache[slot * kv_dim + kvh * hd..][..hd];
                let mut dot: f32 = qh.iter().zip(k).map(|(x, y)| x * y).sum();
                dot *= a.scale;
                if let Some(c) = a.softcap {
                    dot = c * (dot / c).tanh();
                }
                scores.push(dot);
            }
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for x in scores.iter_mut() {
                *x = (*x - m).exp();
                sum += *x;
            }
            let o = &mut out[(t * nh + h) * hd..][..hd];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (i, p) in (first..=pos).enumerate() {
                let slot = batch.slot(s, p);
                let v = &v_cache[slot * kv_dim + kvh * hd..][..hd];
                let wgt = scores[i] / sum;
                for (x, &y) in o.iter_mut().zip(v) {
                    *x += wgt * y;
                }
            }
        }
    }
}

/// out[t, r] = Σ_c W[r, c] · x[t, c] with W dequantized and f64 accumulation.
pub fn matmul(w: &[f32], rows: usize, cols: usize, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    for t in 0..n_tokens {
        let xt = &x[t * cols..][..cols];
        for r in 0..rows {
            let wr = &w[r * cols..][..cols];
            out[t * rows + r] = wr
                .iter()
                .zip(xt)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_routes_every_token_whatever_nan_its_logits_hold() {
        let nan = f32::NAN;
        for gating in [Gating::Softmax, Gating::Sigmoid] {
            let p = MoeParams {
                n_expert: 4,
                n_used: 2,
                n_ff: 1,
                gating,
                norm: true,
                scale: 1.0,
                act: Activation::SwiGlu,
                router_given: false,
                held: (0, 4),
            };
            let mut r = Vec::new();
            // A NaN expert is never chosen ahead of a number; the numbers' weights are as
            // without it.
            moe_route(&[nan, 1.0, 0.5, 2.0], &p, &mut r);
            let ids: Vec<u32> = r.iter().map(|e| e.0).collect();
            assert_eq!(ids, [3, 1], "{gating:?}");
            let mut without = Vec::new();
            moe_route(&[f32::NEG_INFINITY, 1.0, 0.5, 2.0], &p, &mut without);
            assert_eq!(r, without, "{gating:?}");
            // One number: it, then the first NaN expert at weight 0.
            moe_route(&[nan, nan, 3.0, nan], &p, &mut r);
            assert_eq!(r, [(2, 1.0), (0, 0.0)], "{gating:?}");
            // Nothing but NaN: the first experts, weighing nothing.
            moe_route(&[nan; 4], &p, &mut r);
            assert_eq!(r, [(0, 0.0), (1, 0.0)], "{gating:?}");
            // An infinite logit: still two distinct experts with finite weights.
            moe_route(&[f32::INFINITY, 1.0, nan, f32::NEG_INFINITY], &p, &mut r);
            assert_eq!(r.len(), 2);
            assert_ne!(r[0].0, r[1].0);
            assert!(r.iter().all(|e| e.1.is_finite()), "{gating:?}: {r:?}");
        }
    }

    #[test]
    fn rope_preserves_norm_and_position_zero_is_identity() {
        let p = RopeParams::plain(RopeMode::Neox, 8, 10000.0);
        let orig: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = orig.clone();
        rope(&mut x, &[0, 5], 1, 8, &p);
        assert_eq!(&x[..8], &orig[..8]);
        let n0: f32 = orig[8..].iter().map(|v| v * v).sum();
        let n1: f32 = x[8..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5 && x[8..] != orig[8..]);
    }

    #[test]
    fn attention_of_one_position_returns_its_value() {
        let b = Batch::single(&[7], 0, &[0], 4, vec![0]);
        let a = AttnParams {
            n_head: 2,
            n_head_kv: 1,
            head_dim: 2,
            scale: 1.0,
            scale_q: false,
            window: None,
            softcap: None,
        };
        let (k, v) = (
            vec![1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            vec![3.0, -4.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0],
        );
        let mut out = vec![0.0; 4];
        attention(&[0.5, 0.5, -1.0, 1.0], &k, &v, &b, &a, &mut out);
        assert_eq!(out, vec![3.0, -4.0, 3.0, -4.0]);
    }

    #[test]
    fn llama3_scaling_leaves_high_frequencies_and_divides_low_ones() {
        let s = crate::Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192.0,
        };
        let plain = RopeParams {
            mode: RopeMode::Normal,
            n_dims: 128,
            base: 500000.0,
            freq_scale: 1.0,
            llama3: None,
            freq_factors: None,
            yarn: None,
            attn_factor: 1.0,
            q_temp: None,
        };
        let scaled = RopeParams {
            llama3: Some(s),
            ..plain.clone()
        };
        assert_eq!(plain.theta(0), scaled.theta(0));
        assert!((plain.theta(63) / scaled.theta(63) - 8.0).abs() < 1e-4);
    }
}
