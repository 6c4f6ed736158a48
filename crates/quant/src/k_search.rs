//! Reference quantizers for the K-quants, following ggml's `quantize_row_q*_K_ref` (which
//! is what `llama-quantize` runs when no importance matrix is given). The arithmetic is
//! done in f32 in the same order as ggml's C so the output is bit-identical to it.
//!
//! The search routines:
//! - [`make_qx_quants`]: symmetric quants `x ≈ s * l`, trying 19 scales around `-nmax/max`
//!   and keeping the one with the best weighted least-squares fit (Q6_K).
//! - [`make_q3_quants`]: symmetric quants refined by coordinate descent on the weighted
//!   fit, up to 5 passes (Q3_K).
//! - [`make_qkx2_quants`]: affine quants `x ≈ s * l - m`, scanning `nstep + 1` candidate
//!   scales and solving the weighted 2x2 least-squares for scale and min (Q2_K, Q4_K, Q5_K).

use crate::k_quants::{get_scale_min_k4, K_SCALE_SIZE, QK_K};
use crate::{f16_to_f32, f32_to_f16};

/// Groups whose largest magnitude is below this are treated as all zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, through the 1.5 * 2^23 trick ggml uses (valid for
/// |x| <= 2^22; other input gives a wrong but harmless value, exactly as in ggml).
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The element of largest magnitude (first one on ties), and that magnitude.
#[inline(always)]
fn signed_amax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// Symmetric quantization with weights `x^2` (ggml's `rmse_type = 1`, no importance
/// weights). Writes `L[i] = l + nmax` in `0..2 nmax` and returns the scale.
pub(crate) fn make_qx_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_amax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    // Weighted sums for one candidate inverse scale.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = (quant(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (l, &v) in levels.iter_mut().zip(x) {
                *l = (quant(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit search with coordinate descent (weights `x^2`). Writes `L[i]` in
/// `0..2 nmax` and returns the scale.
pub(crate) fn make_q3_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_amax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (l, &v) in levels.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *l = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (l, &v) in levels.iter_mut().zip(x) {
            let w = v * v;
            let cur = *l as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *l as i32 {
                    let nl = new_l as f32;
                    slx += w * v * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *l = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for l in levels.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of the affine scale scan in [`make_qkx2_quants`].
pub(crate) struct Qkx2 {
    pub nmax: i32,
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    /// Minimise the weighted absolute error instead of the squared error.
    pub use_mad: bool,
}

/// Affine quantization `x ≈ scale * L - min` (min >= 0) with per-element `weights`. Writes
/// `L[i]` in `0..=nmax`; returns `(scale, min)`.
pub(crate) fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    p: &Qkx2,
    levels: &mut [u8],
) -> (f32, f32) {
    let n = x.len();
    let nmax = p.nmax;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let err = |d: f32, w: f32| if p.use_mad { w * d.abs() } else { w * (d * d) };
    let quant =
        |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax) as u8;
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        levels[i] = quant(iscale, x[i], min);
        best_error += err(scale * levels[i] as f32 + min - x[i], weights[i]);
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = quant(iscale, x[i], min);
            aux[i] = l;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                cur_error += err(this_scale * aux[i] as f32 + this_min - x[i], weights[i]);
            }
            if cur_error < best_error {
                levels.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs 2-bit levels (256) into the shared 2-bit `qs` order.
fn pack_2bit(levels: &[u8; QK_K], out: &mut Vec<u8>) {
    for half in levels.chunks_exact(128) {
        for l in 0..32 {
            out.push(half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6));
        }
    }
}

pub fn quantize_block_q2_k(x: &[f32], out: &mut Vec<u8>) {
    const Q4SCALE: f32 = 15.0;
    let params = Qkx2 {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weights = [0f32; 16];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        (scales[j], mins[j]) =
            make_qkx2_quants(xs, &weights, &params, &mut levels[16 * j..16 * j + 16]);
        max_scale = if scales[j] > max_scale {
            scales[j]
        } else {
            max_scale
        };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let mut packed = [0u8; 16];
    let mut d = 0.0f32;
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (p, &s) in packed.iter_mut().zip(&scales) {
            *p = nearest_int(iscale * s) as u8;
        }
        d = max_scale / Q4SCALE;
    }
    let mut dmin = 0.0f32;
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (p, &m) in packed.iter_mut().zip(&mins) {
            *p |= (nearest_int(iscale * m) << 4) as u8;
        }
        dmin = max_min / Q4SCALE;
    }
    let (d_h, dmin_h) = (f32_to_f16(d), f32_to_f16(dmin));
    let (d, dmin) = (f16_to_f32(d_h), f16_to_f32(dmin_h));
    for (j, &p) in packed.iter().enumerate() {
        let dl = d * (p & 0xf) as f32;
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * (p >> 4) as f32;
        for i in 16 * j..16 * j + 16 {
            levels[i] = nearest_int((x[i] + ml) / dl).clamp(0, 3) as u8;
        }
    }
    out.extend_from_slice(&packed);
    pack_2bit(&levels, out);
    out.extend_from_slice(&d_h);
    out.extend_from_slice(&dmin_h);
}

pub fn quantize_block_q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut levels[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut packed = [0u8; K_SCALE_SIZE];
    let mut d = 0.0f32;
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            // ggml stores the rounded value in an int8_t before clamping.
            let l = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = l & 0xf;
            } else {
                packed[j - 8] |= (l & 0xf) << 4;
            }
            packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        d = 1.0 / iscale;
    }
    let d_h = f32_to_f16(d);
    let d = f16_to_f32(d_h);
    let decoded = crate::k_quants::q3_k_scales(&packed);
    for (j, &s) in decoded.iter().enumerate() {
        let dl = d * s as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / dl).clamp(-4, 3) + 4) as i8;
        }
    }
    let mut hmask = [0u8; QK_K / 8];
    let mut low = [0u8; QK_K];
    for (i, (&l, lo)) in levels.iter().zip(low.iter_mut()).enumerate() {
        let mut l = l as u8;
        if l > 3 {
            hmask[i % 32] |= 1 << (i / 32);
            l -= 4;
        }
        *lo = l;
    }
    out.extend_from_slice(&hmask);
    pack_2bit(&low, out);
    out.extend_from_slice(&packed);
    out.extend_from_slice(&d_h);
}

/// The common part of Q4_K and Q5_K: per-32 affine search, 6-bit scales/mins, final
/// levels in `0..=nmax`. Returns (d, dmin, packed scales) as stored.
fn quantize_q45_k(
    x: &[f32],
    params: &Qkx2,
    levels: &mut [u8; QK_K],
) -> ([u8; 2], [u8; 2], [u8; K_SCALE_SIZE]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) =
            make_qkx2_quants(xs, &weights, params, &mut levels[32 * j..32 * j + 32]);
        max_scale = if scales[j] > max_scale {
            scales[j]
        } else {
            max_scale
        };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        // ggml converts the rounded int to uint8_t (wrapping) before taking the minimum.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d_h = f32_to_f16(max_scale / 63.0);
    let dmin_h = f32_to_f16(max_min / 63.0);
    let (d, dmin) = (f16_to_f32(d_h), f16_to_f32(dmin_h));
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dl = d * sc as f32;
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest_int((x[i] + ml) / dl).clamp(0, params.nmax) as u8;
        }
    }
    (d_h, dmin_h, packed)
}

pub fn quantize_block_q4_k(x: &[f32], out: &mut Vec<u8>) {
    let params = Qkx2 {
        nmax: 15,
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    let mut levels = [0u8; QK_K];
    let (d, dmin, scales) = quantize_q45_k(x, &params, &mut levels);
    out.extend_from_slice(&d);
    out.extend_from_slice(&dmin);
    out.extend_from_slice(&scales);
    for chunk in levels.chunks_exact(64) {
        for l in 0..32 {
            out.push(chunk[l] | (chunk[l + 32] << 4));
        }
    }
}

pub fn quantize_block_q5_k(x: &[f32], out: &mut Vec<u8>) {
    let params = Qkx2 {
        nmax: 31,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    let mut levels = [0u8; QK_K];
    let (d, dmin, scales) = quantize_q45_k(x, &params, &mut levels);
    let mut qh = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 2];
    for (j, chunk) in levels.chunks_exact(64).enumerate() {
        for l in 0..32 {
            let (lo, hi) = (chunk[l], chunk[l + 32]);
            qh[l] |= ((lo >> 4) << (2 * j)) | ((hi >> 4) << (2 * j + 1));
            qs[32 * j + l] = (lo & 0xf) | ((hi & 0xf) << 4);
        }
    }
    out.extend_from_slice(&d);
    out.extend_from_slice(&dmin);
    out.extend_from_slice(&scales);
    out.extend_from_slice(&qh);
    out.extend_from_slice(&qs);
}

pub fn quantize_block_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for j in 0..16 {
        scales[j] = make_qx_quants(
            &x[16 * j..16 * j + 16],
            32,
            &mut levels[16 * j..16 * j + 16],
        );
        if scales[j].abs() > max_abs_scale {
            max_abs_scale = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d_h = f32_to_f16(1.0 / iscale);
    let d = f16_to_f32(d_h);
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    for (j, &s) in sc.iter().enumerate() {
        let dl = d * s as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / dl).clamp(-32, 31) + 32) as i8;
        }
    }
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for n in 0..2 {
        let lv = &levels[128 * n..128 * n + 128];
        for l in 0..32 {
            let q = [
                lv[l] as u8,
                lv[l + 32] as u8,
                lv[l + 64] as u8,
                lv[l + 96] as u8,
            ];
            ql[64 * n + l] = (q[0] & 0xf) | ((q[2] & 0xf) << 4);
            ql[64 * n + l + 32] = (q[1] & 0xf) | ((q[3] & 0xf) << 4);
            qh[32 * n + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d_h);
}

pub fn quantize_block_q8_k(x: &[f32], out: &mut Vec<u8>) {
    let (max, amax) = signed_amax(x);
    if amax == 0.0 {
        out.extend_from_slice(&[0u8; 292]);
        return;
    }
    let iscale = -127.0 / max;
    let mut qs = [0i8; QK_K];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    out.extend_from_slice(&(1.0 / iscale).to_le_bytes());
    out.extend(qs.iter().map(|&q| q as u8));
    for group in qs.chunks_exact(16) {
        let sum: i32 = group.iter().map(|&q| q as i32).sum();
        out.extend_from_slice(&(sum as i16).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(7.49), 7);
    }
}
