//! Rope for q and k together: each token's sin/cos once for all its heads (the reference
//! recomputes `powf` per element). The angles are ggml's (llama.cpp parity): the position
//! times `base^(−2/n_dims)` raised one pair at a time in f32, then divided by the pair's
//! frequency factor and scaled; Llama-3 scaling, which ggml expresses as frequency factors,
//! keeps `position × theta(i)`.

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
    // ggml's angles (llama.cpp parity): position × base^(−2/n_dims) raised step by step in f32,
    // then / freq factor, × freq_scale. Llama-3 scaling has no such form: position × theta(i).
    let theta_scale = p.base.powf(-2.0 / p.n_dims as f32);
    for (t, &pos) in positions.iter().enumerate() {
        if p.llama3.is_some() {
            for i in 0..half {
                let (s, c) = (pos as f32 * theta[i]).sin_cos();
                (sin[i], cos[i]) = (s, c);
            }
        } else {
            let mut th = pos as f32;
            for i in 0..half {
                let ff = p
                    .freq_factors
                    .as_ref()
                    .and_then(|f| f.get(i).copied())
                    .unwrap_or(1.0);
                let (s, c) = (p.freq_scale * (th / ff)).sin_cos();
                (sin[i], cos[i]) = (s, c);
                th *= theta_scale;
            }
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
