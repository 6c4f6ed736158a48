//! One head of one token of DeepSeek-V4's attention ([`attention_head`]), in the two forms of
//! llama.cpp's CPU flash attention over its f16 caches: row by row (decode steps, and every
//! step of the batch-invariant numerics) and tiled (its steps of 64+ query rows).

use super::{f16r, layout, part, rope_tail, AttnHost, AttnInputs, AttnShape};
use crate::RopeAngles;

/// Keys per tile of llama.cpp's tiled attention (`GGML_FA_TILE_KV`).
const TILE: usize = 64;

/// Head `hh` of token `t` into `o` ([head_dim], rotated back): the window's keys (this
/// step's from its sequence's first position on, the ring's before) and the compressed rows
/// `sel` (ascending, as llama.cpp's cache holds them).
///
/// Row by row (`tiled` false): q in f16, an online softmax whose p·v accumulator is rounded
/// to f16 after every key. Tiled: q in f32, keys by tiles of 64 of llama.cpp's cache (the
/// window's by position, the compressed rows after them by index), each tile's scores as
/// fused multiply-add chains, one rescale per tile, p·v accumulated in f32 — the floats of
/// llama.cpp's tiled form up to its vectorised e^x and the order of its per-tile sums. The
/// sink last in both.
#[allow(clippy::too_many_arguments)]
pub fn attention_head(
    batch: &crate::Batch,
    s: &AttnShape,
    w: &AttnHost,
    x: &AttnInputs<[f32]>,
    state: &[f32],
    keys: &[f32],
    t: usize,
    hh: usize,
    sel: &[usize],
    tiled: bool,
    o: &mut [f32],
) {
    let (h, hd) = (s.n_head, s.head_dim);
    let seq = &batch.seqs[batch.seq_of[t] as usize];
    let sf = s.state_floats();
    let slot = &state[seq.state_slot as usize * sf..][..sf];
    let lay = layout(s);
    let (raw, comp) = (part(slot, lay[0]), part(slot, lay[3]));
    let p = batch.positions[t] as usize;
    let p0 = batch.positions[seq.start] as usize;
    let mut sin = [0f32; crate::ROPE_MAX_PAIRS];
    let mut cos = [0f32; crate::ROPE_MAX_PAIRS];
    let angles = RopeAngles::new(&s.rope);
    let np = angles.pairs();
    angles.at(p as u32, &mut sin[..np], &mut cos[..np]);
    let first = (p + 1).saturating_sub(s.n_swa);
    let n_raw = p + 1 - first;
    let key = |j: usize| -> &[f32] {
        if j < n_raw {
            let q = first + j;
            if q >= p0 {
                &keys[(seq.start + q - p0) * hd..][..hd]
            } else {
                &raw[(q % s.raw_ring()) * hd..][..hd]
            }
        } else {
            &comp[sel[j - n_raw] * hd..][..hd]
        }
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut q = x.q[t * h * hd + hh * hd..][..hd].to_vec();
    rope_tail(&mut q, &sin[..np], &cos[..np], 1.0);
    o.fill(0.0);
    let n = n_raw + sel.len();
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    if tiled {
        // A key's tile in llama.cpp's cache: the window's by position, the compressed rows'
        // after every window tile.
        let tile = |j: usize| {
            if j < n_raw {
                (first + j) / TILE
            } else {
                usize::MAX / 2 + sel[j - n_raw] / TILE
            }
        };
        let mut sc = [0f32; TILE];
        let mut j = 0;
        while j < n {
            let mut e = j + 1;
            while e < n && tile(e) == tile(j) {
                e += 1;
            }
            for (i, l) in sc[..e - j].iter_mut().enumerate() {
                let k = key(j + i);
                *l = q.iter().zip(k).fold(0f32, |a, (x, y)| x.mul_add(*y, a)) * scale;
            }
            let tmax = sc[..e - j]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let mnew = m.max(tmax);
            if mnew > m {
                let ms = (m - mnew).exp();
                o.iter_mut().for_each(|v| *v *= ms);
                sum *= ms;
            }
            m = mnew;
            let mut tsum = 0f64;
            for (i, l) in sc[..e - j].iter().enumerate() {
                let pw = (l - m).exp();
                tsum += pw as f64;
                o.iter_mut()
                    .zip(key(j + i))
                    .for_each(|(o, &v)| *o = pw.mul_add(v, *o));
            }
            sum = (sum as f64 + tsum) as f32;
            j = e;
        }
    } else {
        q.iter_mut().for_each(|v| *v = f16r(*v));
        for j in 0..n {
            let k = key(j);
            let l = scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
            let (mut ms, mut vs) = (1f32, 1f32);
            if l > m {
                ms = (m - l).exp();
                m = l;
                o.iter_mut().for_each(|v| *v = f16r(*v * ms));
            } else {
                vs = (l - m).exp();
            }
            o.iter_mut()
                .zip(k)
                .for_each(|(o, &v)| *o = f16r(v.mul_add(vs, *o)));
            sum = sum * ms + vs;
        }
    }
    let sink = w.sinks[hh];
    if sink > m {
        let ms = (m - sink).exp();
        o.iter_mut().for_each(|v| *v *= ms);
        sum = sum * ms + 1.0;
    } else {
        sum += (sink - m).exp();
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    o.iter_mut().for_each(|v| *v *= inv);
    rope_tail(o, &sin[..np], &cos[..np], -1.0);
}
