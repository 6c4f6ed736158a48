//! DeepSeek-V4's compressed-row selection: every visible row, or the lightning indexer's best
//! `ix_top_k` (`super::attention_token` reads it per token).

use super::{layout, part, rope_tail, AttnInputs, AttnShape};
use crate::RopeAngles;

/// llama.cpp's rotation of the indexer's keys and queries (its lightning-indexer cache rotates
/// both, `llama_kv_cache`'s `n_rot_k`): each block of `n` values (64, doubled while the head
/// width is a multiple of twice that) scaled by 1/√n, then Walsh–Hadamard transformed in
/// ggml's order (`ggml_compute_forward_fwht`). The scores are the same up to rounding, but the
/// keys are stored in f16 after it: where two rows score close, that rounding picks the top-k.
pub(super) fn ix_rotate(head: &mut [f32]) {
    let dim = head.len();
    if !dim.is_multiple_of(64) {
        return;
    }
    let mut n = 64;
    while dim.is_multiple_of(2 * n) {
        n *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    for b in head.chunks_exact_mut(n) {
        b.iter_mut().for_each(|x| *x *= scale);
        crate::turboquant::fwht(b);
    }
}

/// The buffers of [`attention_select_into`]: a caller that keeps them from step to step
/// (the CPU backend, one per token of the largest step) selects without allocating.
#[derive(Clone, Debug, Default)]
pub struct SelectBufs {
    /// The selected compressed rows.
    pub rows: Vec<usize>,
    score: Vec<(f32, usize)>,
    iq: Vec<f32>,
}

/// The compressed rows token `t` attends to ([`attention_select_into`], new buffers).
pub fn attention_select(
    batch: &crate::Batch,
    s: &AttnShape,
    x: &AttnInputs<[f32]>,
    state: &[f32],
    t: usize,
) -> Vec<usize> {
    let mut b = SelectBufs::default();
    attention_select_into(batch, s, x, state, t, &mut b);
    b.rows
}

/// The compressed rows token `t` attends to, into `b.rows`: every visible one, or (ratio 4,
/// more visible than `ix_top_k`) the lightning indexer's best `ix_top_k` (its queries and keys
/// rotated as llama.cpp's, [`ix_rotate`]), ties to the earlier row; ascending. Allocates only
/// where `b` is smaller than this token needs.
pub fn attention_select_into(
    batch: &crate::Batch,
    s: &AttnShape,
    x: &AttnInputs<[f32]>,
    state: &[f32],
    t: usize,
    b: &mut SelectBufs,
) {
    let ratio = s.ratio;
    let p = batch.positions[t] as usize;
    let n_vis = (p + 1).checked_div(ratio).unwrap_or(0);
    b.rows.clear();
    if ratio != 4 || n_vis <= s.ix_top_k {
        b.rows.extend(0..n_vis);
        return;
    }
    let seq = &batch.seqs[batch.seq_of[t] as usize];
    let sf = s.state_floats();
    let slot = &state[seq.state_slot as usize * sf..][..sf];
    let icomp = part(slot, layout(s)[6]);
    let (ixq, ixw) = (x.ix_q.unwrap(), x.ix_w.unwrap());
    let (ih, id) = (s.ix_heads, s.ix_dim);
    let cang = RopeAngles::new(&s.comp_rope);
    let cnp = cang.pairs();
    let mut sin = [0f32; crate::ROPE_MAX_PAIRS];
    let mut cos = [0f32; crate::ROPE_MAX_PAIRS];
    cang.at(p as u32, &mut sin[..cnp], &mut cos[..cnp]);
    b.iq.clear();
    b.iq.extend_from_slice(&ixq[t * ih * id..][..ih * id]);
    for hq in b.iq.chunks_exact_mut(id) {
        rope_tail(hq, &sin[..cnp], &cos[..cnp], 1.0);
        ix_rotate(hq);
    }
    let wscale = 1.0 / ((id * ih) as f32).sqrt();
    let iq = &b.iq;
    b.score.clear();
    b.score.extend((0..n_vis).map(|r| {
        let k = &icomp[r * id..][..id];
        let sc = iq.chunks_exact(id).enumerate().map(|(hh, hq)| {
            let dot: f32 = hq.iter().zip(k).map(|(a, b)| a * b).sum();
            dot.max(0.0) * (ixw[t * ih + hh] * wscale)
        });
        (sc.sum(), r)
    }));
    // Score descending, then row ascending: no two entries compare equal, so the unstable
    // sort (which allocates nothing) orders them as a stable one would.
    b.score.sort_unstable_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.1.cmp(&b.1))
    });
    b.rows.extend(b.score[..s.ix_top_k].iter().map(|e| e.1));
    // In the cache's order, as llama.cpp's attention reads them.
    b.rows.sort_unstable();
}
