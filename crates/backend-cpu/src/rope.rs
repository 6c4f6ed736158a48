//! Rope for q and k together: each token's sin/cos once for all its heads (the reference
//! recomputes `powf` per element), with ggml's angles ([`RopeAngles`], llama.cpp parity).

use quiver_backend::{AttnParams, RopeAngles, RopeMode, RopeParams};

pub const MAX_PAIRS: usize = quiver_backend::ROPE_MAX_PAIRS;

pub fn apply(
    q: &mut [f32],
    k: Option<&mut [f32]>,
    positions: &[u32],
    a: &AttnParams,
    p: &RopeParams,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::attn::has_avx2() {
        // SAFETY: `has_avx2` checked AVX2 and FMA.
        unsafe { apply_fma(q, k, positions, a, p) };
        return;
    }
    apply_body(q, k, positions, a, p);
}

/// [`apply`] compiled with FMA: its fused multiply-adds are instructions instead of calls (the
/// same results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply_fma(
    q: &mut [f32],
    k: Option<&mut [f32]>,
    positions: &[u32],
    a: &AttnParams,
    p: &RopeParams,
) {
    apply_body(q, k, positions, a, p);
}

#[inline(always)]
fn apply_body(
    q: &mut [f32],
    mut k: Option<&mut [f32]>,
    positions: &[u32],
    a: &AttnParams,
    p: &RopeParams,
) {
    let angles = RopeAngles::new(p);
    let half = angles.pairs();
    let (mut cos, mut sin) = ([0f32; MAX_PAIRS], [0f32; MAX_PAIRS]);
    let hd = a.head_dim;
    for (t, &pos) in positions.iter().enumerate() {
        angles.at(pos, &mut sin, &mut cos);
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
        let qt = &mut q[t * a.n_head * hd..][..a.n_head * hd];
        qt.chunks_exact_mut(hd).for_each(rotate);
        if p.q_temp.is_some() {
            let s = p.q_scale(pos);
            qt.iter_mut().for_each(|x| *x *= s);
        }
        if let Some(k) = k.as_deref_mut() {
            k[t * a.n_head_kv * hd..][..a.n_head_kv * hd]
                .chunks_exact_mut(hd)
                .for_each(rotate);
        }
    }
}
