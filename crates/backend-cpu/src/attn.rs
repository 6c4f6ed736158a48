//! CPU attention: one pass of online softmax per (token, head) over the sequence's cached
//! K/V, accumulating p·v in f16 as llama.cpp's CPU flash attention does with an f16 cache
//! (this keeps quiver's numerics next to llama.cpp's), with no scratch allocation.

use half::f16;
use quiver_backend::{AttnParams, Batch};

pub fn attention(q: &[f32], k_cache: &[f32], v_cache: &[f32], batch: &Batch, a: &AttnParams, out: &mut [f32], acc16: &mut [f16]) {
    let (hd, nh) = (a.head_dim, a.n_head);
    let kv_dim = a.n_head_kv * hd;
    let group = nh / a.n_head_kv;
    let acc16 = &mut acc16[..hd];
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
            let mut m = f32::NEG_INFINITY;
            let mut sum = 0f32;
            acc16.iter_mut().for_each(|x| *x = f16::ZERO);
            for p in first..=pos {
                let slot = batch.slot(s, p);
                let k = &k_cache[slot * kv_dim + kvh * hd..][..hd];
                let mut sc: f32 = qh.iter().zip(k).map(|(x, y)| x * y).sum::<f32>() * a.scale;
                if let Some(c) = a.softcap {
                    sc = c * (sc / c).tanh();
                }
                let mut vs = 1.0f32;
                if sc > m {
                    let ms = (m - sc).exp();
                    m = sc;
                    sum *= ms;
                    acc16.iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() * ms));
                } else {
                    vs = (sc - m).exp();
                }
                sum += vs;
                let v = &v_cache[slot * kv_dim + kvh * hd..][..hd];
                for (x, &y) in acc16.iter_mut().zip(v) {
                    *x = f16::from_f32(x.to_f32() + y * vs);
                }
            }
            let o = &mut out[(t * nh + h) * hd..][..hd];
            let inv = 1.0 / sum;
            for (x, y) in o.iter_mut().zip(acc16.iter()) {
                *x = y.to_f32() * inv;
            }
        }
    }
}
