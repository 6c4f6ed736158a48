//! One head of one token of DeepSeek-V4's attention ([`attention_head`]), in the forms of
//! llama.cpp's CPU flash attention over its f16 caches ([`Form`]).

use super::{f16r, layout, part, rope_tail, AttnHost, AttnInputs, AttnShape};
use crate::RopeAngles;

/// Keys per tile of llama.cpp's tiled attention (`GGML_FA_TILE_KV`).
const TILE: usize = 64;

/// How llama.cpp's CPU flash attention runs a step, which [`attention_head`] reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Row by row (its steps of fewer than 64 rows; every step of the batch-invariant
    /// numerics).
    Rows,
    /// A step of one row (a decode step alone): its cache of 512+ cells split between two
    /// threads, the window (and the sink) in the first part, the compressed rows in the
    /// second, each part's online softmax apart, then merged (`ggml_flash_attn_ext`'s
    /// split-KV path with 2 threads).
    Split,
    /// Tiled (its steps of 64+ rows).
    Tiled,
}

/// The online softmax of llama.cpp's row-by-row form over keys `js` (q in f16, the p·v
/// accumulator `o` rounded to f16 after every key, the running sum a fused multiply-add):
/// the running max and sum.
fn rows<'k>(
    q: &[f32],
    keys: impl Iterator<Item = &'k [f32]>,
    scale: f32,
    o: &mut [f32],
) -> (f32, f32) {
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    for k in keys {
        let l = crate::numerics::f16_dot(q, k) * scale;
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
        sum = sum.mul_add(ms, vs);
    }
    (m, sum)
}

/// The sink's logit into a part's (max, sum, accumulator), as llama.cpp adds it last.
fn sink(sk: f32, m: &mut f32, sum: &mut f32, o: &mut [f32]) {
    if sk > *m {
        let ms = (*m - sk).exp();
        *m = sk;
        o.iter_mut().for_each(|v| *v *= ms);
        *sum = *sum * ms + 1.0;
    } else {
        *sum += (sk - *m).exp();
    }
}

/// Head `hh` of token `t` into `o` ([head_dim], rotated back): the window's keys (this
/// step's from its sequence's first position on, the ring's before) and the compressed rows
/// `sel` (ascending, as llama.cpp's cache holds them), in llama.cpp's `form`.
///
/// Tiled: q in f32, keys by tiles of 64 of llama.cpp's cache (the window's by position, the
/// compressed rows after them by index), each tile's scores as fused multiply-add chains, one
/// rescale per tile, p·v accumulated in f32 — the floats of llama.cpp's tiled form up to its
/// vectorised e^x and the order of its per-tile sums. The sink last in every form.
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
    form: Form,
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
    if form == Form::Tiled {
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
        sink(w.sinks[hh], &mut m, &mut sum, o);
    } else {
        // As ggml's one-row flash attention (its C compiled with contraction): q·k in its f16
        // dot's order, the running sum a fused multiply-add.
        q.iter_mut().for_each(|v| *v = f16r(*v));
        let split = if form == Form::Split { n_raw } else { n };
        (m, sum) = rows(&q, (0..split).map(key), scale, o);
        sink(w.sinks[hh], &mut m, &mut sum, o);
        if split < n {
            // The second part apart, then merged as ggml's split-KV reduction does (its
            // products contracted).
            let mut ob = [0f32; 512];
            let ob = &mut ob[..hd];
            let (mb, sb) = rows(&q, (split..n).map(key), scale, ob);
            if sb != 0.0 {
                let mn = m.max(mb);
                let (so, sn) = ((m - mn).exp(), (mb - mn).exp());
                o.iter_mut()
                    .zip(ob.iter())
                    .for_each(|(v, &b)| *v = v.mul_add(so, b * sn));
                sum = sum.mul_add(so, sb * sn);
            }
        }
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    o.iter_mut().for_each(|v| *v *= inv);
    rope_tail(o, &sin[..np], &cos[..np], -1.0);
}
