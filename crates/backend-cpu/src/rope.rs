//! Rope for q and k together: each token's sin/cos once for all its heads (the reference
//! recomputes `powf` per element). The angles are ggml's (llama.cpp parity): the position
//! times `base^(−2/n_dims)` raised one pair at a time in f32, then divided by the pair's
//! frequency factor and scaled; Llama-3 scaling, which ggml expresses as frequency factors,
//! keeps `position × theta(i)`.

use quiver_backend::{AttnParams, RopeMode, RopeParams};

pub const MAX_PAIRS: usize = 256;

pub fn apply(q: &mut [f32], k: &mut [f32], positions: &[u32], a: &AttnParams, p: &RopeParams) {
    let half = p.n_dims / 2;
    // Llama-3 scaling (which ggml takes as frequency factors) keeps position × theta(i).
    let llama3 = p.llama3.is_some();
    let mut theta = [0f32; MAX_PAIRS];
    if llama3 {
        for (i, t) in theta[..half].iter_mut().enumerate() {
            *t = p.theta(i);
        }
    }
    let mut ff = [1f32; MAX_PAIRS];
    if let Some(f) = &p.freq_factors {
        for (d, &s) in ff[..half].iter_mut().zip(f.iter()) {
            *d = s;
        }
    }
    let (mut cos, mut sin) = ([0f32; MAX_PAIRS], [0f32; MAX_PAIRS]);
    let hd = a.head_dim;
    let theta_scale = p.base.powf(-2.0 / p.n_dims as f32);
    for (t, &pos) in positions.iter().enumerate() {
        let mut th = pos as f32;
        for i in 0..half {
            let angle = if llama3 {
                pos as f32 * theta[i]
            } else {
                p.freq_scale * (th / ff[i])
            };
            (sin[i], cos[i]) = angle.sin_cos();
            th *= theta_scale;
        }
        let rotate = |v: &mut [f32]| {
            for i in 0..half {
                let (ia, ib) = match p.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (v[ia], v[ib]);
                // ggml's contraction of `x0·cos − x1·sin` and `x0·sin + x1·cos`: the first
                // product fused, the second rounded.
                v[ia] = x0.mul_add(cos[i], -(x1 * sin[i]));
                v[ib] = x0.mul_add(sin[i], x1 * cos[i]);
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
