//! Rope for q and k together: the angle table is built once per call and each token's
//! sin/cos once for all its heads (the reference recomputes `powf` per element).

use quiver_backend::{AttnParams, RopeMode, RopeParams};

pub const MAX_PAIRS: usize = 256;

pub fn apply(q: &mut [f32], k: &mut [f32], positions: &[u32], a: &AttnParams, p: &RopeParams) {
    let half = p.n_dims / 2;
    let mut theta = [0f32; MAX_PAIRS];
    for (i, t) in theta[..half].iter_mut().enumerate() {
        *t = p.theta(i);
    }
    let (mut cos, mut sin) = ([0f32; MAX_PAIRS], [0f32; MAX_PAIRS]);
    let hd = a.head_dim;
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let (s, c) = (pos as f32 * theta[i]).sin_cos();
            (sin[i], cos[i]) = (s, c);
        }
        let rotate = |v: &mut [f32]| {
            for i in 0..half {
                let (ia, ib) = match p.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (v[ia], v[ib]);
                v[ia] = x0 * cos[i] - x1 * sin[i];
                v[ib] = x0 * sin[i] + x1 * cos[i];
            }
        };
        q[t * a.n_head * hd..][..a.n_head * hd]
            .chunks_exact_mut(hd)
            .for_each(rotate);
        k[t * a.n_head_kv * hd..][..a.n_head_kv * hd]
            .chunks_exact_mut(hd)
            .for_each(rotate);
    }
}
