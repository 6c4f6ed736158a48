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
