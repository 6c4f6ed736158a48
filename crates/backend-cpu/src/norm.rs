//! The rows of the RMS norm, as the reference rounds them.

use quiver_backend::reference;

/// `reference::rms_norm` over rows of `w.len()`, four rows at a time: each row's squares summed
/// in f64 in order as there (ggml's rounding), the four sums' chains interleaved so that their
/// latencies overlap. The same bits as the reference.
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    let mut xr = x.chunks_exact(4 * d);
    let mut or = out.chunks_exact_mut(4 * d);
    for (x4, o4) in (&mut xr).zip(&mut or) {
        let mut ss = [0f64; 4];
        for i in 0..d {
            for (r, s) in ss.iter_mut().enumerate() {
                let v = x4[r * d + i];
                *s += (v * v) as f64;
            }
        }
        for (r, s) in ss.iter().enumerate() {
            let inv = 1.0 / ((s / d as f64) as f32 + eps).sqrt();
            for ((o, &v), &g) in o4[r * d..][..d].iter_mut().zip(&x4[r * d..][..d]).zip(w) {
                *o = v * inv * g;
            }
        }
    }
    reference::rms_norm(xr.remainder(), w, eps, or.into_remainder());
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_backend::reference;

    /// Four rows at a time gives the reference's bits, remainder rows included.
    #[test]
    fn rms_norm_rows_equals_the_reference_bit_for_bit() {
        let d = 40;
        let x: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.031).collect();
        let (mut a, mut b) = (vec![0f32; 7 * d], vec![0f32; 7 * d]);
        rms_norm_rows(&x, &w, 1e-6, &mut a);
        reference::rms_norm(&x, &w, 1e-6, &mut b);
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(p.to_bits(), q.to_bits(), "{i}");
        }
    }
}
