//! DeepSeek-V4's own ops ([`crate::ExtraOp::Dsv4`]): the hyper-connections' mixing of the
//! residual streams (Sinkhorn-normalised), the attention over a raw sliding window and a
//! compressed KV (ratio 4 with the lightning indexer's top-k, or 128), the MoE routing by
//! sqrt-softplus scores (or by token hash) and the clamped SwiGLU — their shapes, the
//! per-sequence state's layout and the scalar references every backend is tested against.
//!
//! The formulas are those of llama.cpp's `src/models/deepseek4.cpp` and
//! `src/llama-kv-cache-dsv4.cpp`:
//!
//! - hyper-connections: per token, `mixes = fn · rms(x_flat)`; `pre = σ(mixes[..hc]·s0 + b)
//!   + eps`, `post = 2·σ(mixes[hc..2hc]·s1 + b)`, `comb` = the last hc² mixes (·s2 + b) as
//!   [src][dst], softmax over dst, + eps, then columns normalised, and rows-then-columns
//!   `iterations − 1` more times; the block's input is Σ_h pre[h]·x[h], its output stream dst
//!   `post[dst]·y + Σ_src comb[src][dst]·x[src]`;
//! - attention: one KV head (k = v), rope on the last `n_rot` dims of each head, a learnt
//!   sink logit per head, keys = the raw window (`n_swa` positions) and the compressed rows
//!   visible to the token (block b once position `(b + 1)·ratio − 1` is in); the output is
//!   rotated back (rope by −pos);
//! - the compressor: per token a value and a score row (score + `ape[pos % ratio]`); block b's
//!   row is Σ softmax(score)·value per channel over its `ratio` tokens (ratio 4: over the
//!   previous block's first halves and this block's second halves, 2·ratio tokens), then RMS
//!   norm, then rope at position `b·ratio` (the compressed layers' own rope);
//! - the indexer (ratio 4): score(b) = Σ_h w_h·relu(q_h · k_b), the `top_k` best visible
//!   compressed rows take part in attention.
//!
//! Keys are stored rounded to f16, as llama.cpp's f16 caches hold them.

mod head;
mod rollback;
mod select;
use crate::{RopeAngles, RopeParams};
pub use head::{attention_head, Form};
pub use rollback::{kept_floats, rewind, Kept};
pub use select::{attention_select, attention_select_into, SelectBufs};

/// The hyper-connections' shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcParams {
    /// Residual streams (`hyper_connection.count`).
    pub hc: usize,
    /// Width of one stream (`embedding_length`).
    pub d: usize,
    /// `hyper_connection.epsilon`
    pub eps: f32,
    /// `hyper_connection.sinkhorn_iterations`
    pub iters: usize,
}

impl HcParams {
    /// Mixes of a block's pre/post/comb product: (2 + hc)·hc.
    pub fn mix_dim(&self) -> usize {
        (2 + self.hc) * self.hc
    }
    /// Floats per token of the post and comb weights [`hc_pre`] hands to [`hc_post`].
    pub fn pc_dim(&self) -> usize {
        self.hc + self.hc * self.hc
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// One token's pre, post and comb weights from its mixes (`head`: the output head's, pre
/// only: `mixes` has hc values, `scale` one). `pc` gets post then comb[src·hc + dst].
pub fn hc_weights(
    mixes: &[f32],
    scale: &[f32],
    base: &[f32],
    p: &HcParams,
    head: bool,
    pre: &mut [f32],
    pc: &mut [f32],
) {
    let hc = p.hc;
    for h in 0..hc {
        pre[h] = sigmoid(mixes[h] * scale[0] + base[h]) + p.eps;
    }
    if head {
        return;
    }
    for h in 0..hc {
        pc[h] = 2.0 * sigmoid(mixes[hc + h] * scale[1] + base[hc + h]);
    }
    // As ggml's fused CPU op (`dsv4_hc_comb`, its C compiled with contraction): the affine
    // map and the eps step fused multiply-adds, sums in f32 (the normalisations' from eps),
    // products by the inverse.
    let comb = &mut pc[hc..hc + hc * hc];
    for (i, c) in comb.iter_mut().enumerate() {
        *c = mixes[2 * hc + i].mul_add(scale[2], base[2 * hc + i]);
    }
    // Softmax over dst per src row, + eps.
    for row in comb.chunks_exact_mut(hc) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v = v.mul_add(inv, p.eps);
        }
    }
    let norm_cols = |c: &mut [f32]| {
        for dst in 0..hc {
            let s = (0..hc).fold(p.eps, |s, src| s + c[src * hc + dst]);
            let inv = 1.0 / s;
            for src in 0..hc {
                c[src * hc + dst] *= inv;
            }
        }
    };
    let norm_rows = |c: &mut [f32]| {
        for row in c.chunks_exact_mut(hc) {
            let inv = 1.0 / row.iter().fold(p.eps, |s, &v| s + v);
            row.iter_mut().for_each(|v| *v *= inv);
        }
    };
    norm_cols(comb);
    for _ in 1..p.iters {
        norm_rows(comb);
        norm_cols(comb);
    }
}

/// The block input of `rows` tokens: out[t] = Σ_h pre[t, h]·x[t, h] (x: [rows, hc·d],
/// mixes: [rows, mix_dim] or [rows, hc] for the head), and the post/comb weights into `pc`
/// ([rows, pc_dim]; untouched for the head).
#[allow(clippy::too_many_arguments)]
pub fn hc_pre(
    x: &[f32],
    mixes: &[f32],
    scale: &[f32],
    base: &[f32],
    p: &HcParams,
    head: bool,
    rows: usize,
    out: &mut [f32],
    pc: &mut [f32],
) {
    let (hc, d) = (p.hc, p.d);
    let md = if head { hc } else { p.mix_dim() };
    let mut pre = vec![0f32; hc];
    let mut one = vec![0f32; p.pc_dim()];
    for t in 0..rows {
        hc_weights(
            &mixes[t * md..][..md],
            scale,
            base,
            p,
            head,
            &mut pre,
            &mut one,
        );
        if !head {
            pc[t * p.pc_dim()..][..p.pc_dim()].copy_from_slice(&one);
        }
        let o = &mut out[t * d..][..d];
        let xt = &x[t * hc * d..][..hc * d];
        // A block's as ggml's fused `dsv4_hc_pre` (fused multiply-adds); the head's as its
        // separate products and sums.
        for (c, o) in o.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for h in 0..hc {
                acc = match head {
                    true => acc + xt[h * d + c] * pre[h],
                    false => xt[h * d + c].mul_add(pre[h], acc),
                };
            }
            *o = acc;
        }
    }
}

/// The block output of `rows` tokens: out[t, dst] = post[dst]·y[t] + Σ_src comb[src][dst]·
/// residual[t, src] (y: [rows, d], residual and out: [rows, hc·d]).
pub fn hc_post(
    y: &[f32],
    residual: &[f32],
    pc: &[f32],
    p: &HcParams,
    rows: usize,
    out: &mut [f32],
) {
    let (hc, d) = (p.hc, p.d);
    for t in 0..rows {
        let w = &pc[t * p.pc_dim()..][..p.pc_dim()];
        let r = &residual[t * hc * d..][..hc * d];
        let yt = &y[t * d..][..d];
        for dst in 0..hc {
            let o = &mut out[t * hc * d + dst * d..][..d];
            for c in 0..d {
                // (As ggml's fused `dsv4_hc_post`: fused multiply-adds.)
                let mut acc = yt[c] * w[dst];
                for src in 0..hc {
                    acc = r[src * d + c].mul_add(w[hc + src * hc + dst], acc);
                }
                o[c] = acc;
            }
        }
    }
}

/// Floats of [`crate::Backend::matmul_grouped`]'s scratch over `rows` rows of `groups` groups
/// of `cols` columns into `out_rows` rows each: the inputs and the outputs by group.
pub fn grouped_scratch_floats(rows: usize, groups: usize, cols: usize, out_rows: usize) -> usize {
    rows * groups * (cols + out_rows)
}

/// The grouped product's shapes checked (every group's weight [R, C] alike; x, out and the
/// scratch long enough for `rows` rows): (R, C), or what is wrong.
pub fn grouped_shape(
    shapes: impl Iterator<Item = (usize, usize)>,
    rows: usize,
    x: usize,
    out: usize,
    scratch: usize,
) -> Result<(usize, usize), String> {
    let (mut groups, mut alike, mut rc) = (0, true, (0, 0));
    for g in shapes {
        if groups == 0 {
            rc = g;
        }
        alike &= g == rc;
        groups += 1;
    }
    let (r, c) = rc;
    let ok = groups > 0
        && alike
        && x >= rows * groups * c
        && out >= rows * groups * r
        && scratch >= grouped_scratch_floats(rows, groups, c, r);
    match ok {
        true => Ok((r, c)),
        false => Err(format!("{groups} groups of [{r}, {c}] over {rows} rows")),
    }
}

/// out[t, g·R + r] = Σ_c w[g·R + r, c]·x[t, g·C + c]: a product per group of columns
/// (`attn_output_a`), w: [groups·R, C], x: [rows, groups·C].
pub fn matmul_grouped(w: &[f32], groups: usize, x: &[f32], rows: usize, out: &mut [f32]) {
    let gr = w.len() / groups;
    let c_in = x.len() / rows / groups;
    let r_out = gr / c_in;
    for t in 0..rows {
        for g in 0..groups {
            for r in 0..r_out {
                let wr = &w[(g * r_out + r) * c_in..][..c_in];
                let xr = &x[t * groups * c_in + g * c_in..][..c_in];
                out[t * groups * r_out + g * r_out + r] =
                    wr.iter().zip(xr).map(|(a, b)| a * b).sum();
            }
        }
    }
}

/// The clamped SwiGLU: silu(min(gate, limit)) · clamp(up, −limit, limit).
pub fn swiglu_clamp(gate: &[f32], up: &[f32], limit: f32, out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// ggml's softplus: x past 20, else ln(1 + eˣ).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// How a DeepSeek-V4 MoE layer picks its experts for one token: by the token's row of
/// `hash` (`ffn_gate_tid2eid`, the hash-routed first layers), else the `n_used` best
/// sqrt-softplus scores plus `bias` (`exp_probs_b`); the weights are the unbiased scores of
/// the chosen experts, normalised to sum 1 where `norm`, times `scale` (≠ 0, 1).
#[derive(Clone, Copy, Debug)]
pub struct MoeRoute<'a> {
    pub bias: Option<&'a [f32]>,
    /// [n_vocab, n_used] expert ids (as f32: exact below 2²⁴).
    pub hash: Option<&'a [f32]>,
    pub n_used: usize,
    pub norm: bool,
    pub scale: f32,
}

/// One token's (expert, weight) pairs, best first (hash order for hash routing).
pub fn moe_route(logits: &[f32], token: u32, r: &MoeRoute, out: &mut Vec<(u32, f32)>) {
    let probs: Vec<f32> = logits.iter().map(|&l| softplus(l).sqrt()).collect();
    out.clear();
    match r.hash {
        Some(h) => {
            let row = &h[token as usize * r.n_used..][..r.n_used];
            out.extend(row.iter().map(|&e| (e as u32, probs[e as usize])));
        }
        None => {
            let sel: Vec<f32> = match r.bias {
                Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
                None => probs.clone(),
            };
            let mut idx: Vec<usize> = (0..sel.len()).collect();
            // Best first, ties to the smaller index; NaN last.
            idx.sort_by(|&a, &b| {
                sel[b]
                    .partial_cmp(&sel[a])
                    .unwrap_or_else(|| sel[a].is_nan().cmp(&sel[b].is_nan()))
                    .then(a.cmp(&b))
            });
            out.extend(idx[..r.n_used].iter().map(|&e| (e as u32, probs[e])));
        }
    }
    if r.norm {
        let sum = out.iter().map(|e| e.1 as f64).sum::<f64>() as f32;
        let sum = sum.max(6.103_515_6e-5);
        out.iter_mut().for_each(|e| e.1 /= sum);
    }
    if r.scale != 0.0 && r.scale != 1.0 {
        out.iter_mut().for_each(|e| e.1 *= r.scale);
    }
}

/// One attention layer's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnShape {
    pub n_head: usize,
    pub head_dim: usize,
    /// Rotated dims at the tail of each head.
    pub n_rot: usize,
    pub n_swa: usize,
    /// Rows of the raw ring beyond the window (0 but for a draft head: the positions it
    /// drafts past its last verified one then overwrite no row a verified position reads).
    pub spare: usize,
    /// 0 (raw window only), 4 (compressed, overlapping, with the indexer) or 128.
    pub ratio: usize,
    /// Rope of q and kv (the layer's: the compressed layers' own base where ratio > 0).
    pub rope: RopeParams,
    /// Rope of the compressed rows and the indexer's q.
    pub comp_rope: RopeParams,
    pub rms_eps: f32,
    /// Indexer heads, head dim and top-k (ratio 4).
    pub ix_heads: usize,
    pub ix_dim: usize,
    pub ix_top_k: usize,
    /// Positions a sequence's state holds (compressed rows: ⌈n_ctx / ratio⌉).
    pub n_ctx: usize,
}

impl AttnShape {
    /// Width of the compressor's value and score rows: 2·head_dim (ratio 4) or head_dim.
    pub fn comp_width(&self) -> usize {
        if self.ratio == 4 {
            2 * self.head_dim
        } else {
            self.head_dim
        }
    }
    /// Rows of the compressor's ring: 2·ratio (ratio 4: the previous block too) or ratio.
    pub fn ring(&self) -> usize {
        if self.ratio == 4 {
            8
        } else {
            self.ratio
        }
    }
    pub fn n_comp(&self) -> usize {
        if self.ratio == 0 {
            0
        } else {
            self.n_ctx.div_ceil(self.ratio)
        }
    }
    /// Rows of the raw ring: the window and the spare rows.
    pub fn raw_ring(&self) -> usize {
        self.n_swa + self.spare
    }
    /// One sequence's state, as laid out in a slot: the raw window's keys
    /// ([`Self::raw_ring`] rows, by position mod that), then where ratio > 0 the compressor's
    /// value and score rings and the compressed keys, and where ratio = 4 the indexer's value
    /// and score rings and its compressed keys.
    pub fn state_floats(&self) -> usize {
        let mut n = self.raw_ring() * self.head_dim;
        if self.ratio > 0 {
            n += 2 * self.ring() * self.comp_width() + self.n_comp() * self.head_dim;
        }
        if self.ratio == 4 {
            n += 2 * 8 * 2 * self.ix_dim + self.n_comp() * self.ix_dim;
        }
        n
    }
}

/// Indexer scores a backend holds at once ([`attention_scratch_floats`]): a step's rows are
/// scored in chunks of [`score_rows`].
pub const SCORE_FLOATS: usize = 1 << 22;

/// Rows of a step whose indexer scores (one per compressed row of the context) are held at
/// once (0 but for ratio 4).
pub fn score_rows(s: &AttnShape, rows: usize) -> usize {
    match s.ratio {
        4 => rows.min((SCORE_FLOATS / s.n_comp().max(1)).max(1)),
        _ => 0,
    }
}

/// Floats of [`crate::Backend::dsv4_attention`]'s scratch over `rows` rows: the step's keys
/// (rotated, f16-rounded), each row's first row of its sequence, and for ratio 4 the
/// indexer's choices and a chunk of its scores.
pub fn attention_scratch_floats(s: &AttnShape, rows: usize) -> usize {
    let mut n = rows * (s.head_dim + 1);
    if s.ratio == 4 {
        n += rows * s.ix_top_k + score_rows(s, rows) * s.n_comp();
    }
    n
}

/// One layer's small weights, as f32.
#[derive(Clone, Copy, Debug)]
pub struct AttnWeights<'a, W> {
    /// [n_head]
    pub sinks: &'a W,
    /// The compressor's [ratio, comp_width] and [head_dim] (ratio > 0).
    pub ape: Option<&'a W>,
    pub norm: Option<&'a W>,
    /// The indexer's compressor (ratio 4): [4, 2·ix_dim] and [ix_dim].
    pub ix_ape: Option<&'a W>,
    pub ix_norm: Option<&'a W>,
}

/// A step's inputs of one layer, [rows, …]: q (per-head normed, not rotated), kv (normed,
/// not rotated), the compressor's value and score products (ratio > 0), the indexer's q and
/// head weights and its compressor's products (ratio 4).
pub struct AttnInputs<'a, T: ?Sized> {
    pub q: &'a T,
    pub kv: &'a T,
    pub comp_kv: Option<&'a T>,
    pub comp_score: Option<&'a T>,
    pub ix_q: Option<&'a T>,
    pub ix_w: Option<&'a T>,
    pub ix_kv: Option<&'a T>,
    pub ix_score: Option<&'a T>,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Rotates the last `2·pairs` dims of `v` by (sin, cos) (adjacent pairs), `sign` −1 backwards.
fn rope_tail(v: &mut [f32], sin: &[f32], cos: &[f32], sign: f32) {
    let off = v.len() - 2 * sin.len();
    for i in 0..sin.len() {
        // (ggml's contraction of `x0·cos − x1·sin` and `x0·sin + x1·cos`: the first product
        // fused.)
        let (a, b) = (v[off + 2 * i], v[off + 2 * i + 1]);
        let s = sign * sin[i];
        v[off + 2 * i] = a.mul_add(cos[i], -(b * s));
        v[off + 2 * i + 1] = a.mul_add(s, b * cos[i]);
    }
}

/// RMS norm times `w`, summed as ggml does (squares in f32, their sum in f64).
fn rms_norm_w(v: &mut [f32], w: &[f32], eps: f32) {
    let ss: f64 = v.iter().map(|x| (x * x) as f64).sum();
    let mean = (ss / v.len() as f64) as f32;
    let s = 1.0 / (mean + eps).sqrt();
    v.iter_mut().zip(w).for_each(|(x, w)| *x = *x * s * w);
}

/// The small weights as host slices.
pub struct AttnHost<'a> {
    pub sinks: &'a [f32],
    pub ape: &'a [f32],
    pub norm: &'a [f32],
    pub ix_ape: &'a [f32],
    pub ix_norm: &'a [f32],
}

/// Block `b`'s compressed row from a ring of value/score rows (`ring` rows of `w`, position
/// p at p % ring): ratio 4 mixes the previous block's first halves (none for b = 0) and this
/// block's second halves; otherwise the block's rows. Then RMS norm, rope at b·ratio, the
/// indexer's rotation (`rot`), f16.
#[allow(clippy::too_many_arguments)]
fn compress(
    kv: &[f32],
    sc: &[f32],
    ring: usize,
    w: usize,
    ratio: usize,
    dim: usize,
    b: usize,
    norm: &[f32],
    eps: f32,
    angles: &RopeAngles,
    rot: bool,
    out: &mut [f32],
) {
    let overlap = ratio == 4;
    let mut src: Vec<(usize, usize)> = Vec::with_capacity(2 * ratio);
    if overlap && b > 0 {
        for j in 0..ratio {
            src.push((((b - 1) * ratio + j) % ring, 0));
        }
    }
    for j in 0..ratio {
        src.push(((b * ratio + j) % ring, if overlap { dim } else { 0 }));
    }
    for (c, o) in out[..dim].iter_mut().enumerate() {
        let m = src
            .iter()
            .map(|&(r, off)| sc[r * w + off + c])
            .fold(f32::NEG_INFINITY, f32::max);
        // As ggml's soft_max then sum_rows: the exponentials' sum in f64, the weights
        // scaled by its inverse in f32, the weighted values summed in f64.
        let den: f64 = src
            .iter()
            .map(|&(r, off)| (sc[r * w + off + c] - m).exp() as f64)
            .sum();
        let inv = (1.0 / den) as f32;
        let num: f64 = src
            .iter()
            .map(|&(r, off)| {
                let wt = (sc[r * w + off + c] - m).exp() * inv;
                (kv[r * w + off + c] * wt) as f64
            })
            .sum();
        *o = num as f32;
    }
    rms_norm_w(&mut out[..dim], norm, eps);
    let mut sin = [0f32; crate::ROPE_MAX_PAIRS];
    let mut cos = [0f32; crate::ROPE_MAX_PAIRS];
    let np = angles.pairs();
    angles.at((b * ratio) as u32, &mut sin[..np], &mut cos[..np]);
    rope_tail(&mut out[..dim], &sin[..np], &cos[..np], 1.0);
    if rot {
        select::ix_rotate(&mut out[..dim]);
    }
    out[..dim].iter_mut().for_each(|v| *v = f16r(*v));
}

/// Where each part of a slot lies: (start, length) of the raw window, the compressor's value
/// and score rings, its rows, the indexer's rings and its rows.
pub fn layout(s: &AttnShape) -> [(usize, usize); 7] {
    let (hd, cw, nc) = (s.head_dim, s.comp_width(), s.n_comp());
    let ring = if s.ratio > 0 { s.ring() * cw } else { 0 };
    let iw = if s.ratio == 4 { 8 * 2 * s.ix_dim } else { 0 };
    let lens = [
        s.raw_ring() * hd,
        ring,
        ring,
        if s.ratio > 0 { nc * hd } else { 0 },
        iw,
        iw,
        if s.ratio == 4 { nc * s.ix_dim } else { 0 },
    ];
    let mut at = 0;
    lens.map(|l| {
        at += l;
        (at - l, l)
    })
}

fn part(slot: &[f32], l: (usize, usize)) -> &[f32] {
    &slot[l.0..l.0 + l.1]
}

/// Checks the step's sequences against the state: distinct slots inside it, positions inside
/// the state's context, and with kept rows (`kept`: planes per kept slot and the buffer's
/// floats) distinct kept slots inside their buffer.
pub fn check_step(
    batch: &crate::Batch,
    s: &AttnShape,
    state_len: usize,
    kept: Option<(usize, usize)>,
) -> Result<(), String> {
    if let Some((planes, len)) = kept {
        // (No allocation: this runs in every layer of every step.)
        let seqs = &batch.seqs;
        let kept = |i: usize| Some(seqs[i].kept_slot).filter(|&x| x != crate::SeqSpan::NOT_KEPT);
        if (0..seqs.len()).any(|i| kept(i).is_some() && (0..i).any(|j| kept(j) == kept(i))) {
            return Err("two sequences of one step share a kept slot".into());
        }
        let kf = kept_floats(s);
        let past = |l: u32| (l as usize + 1) * planes * kf > len;
        if (0..seqs.len()).any(|i| kept(i).is_some_and(past)) {
            return Err(format!("a kept slot's {planes} rows past their buffer"));
        }
    }
    let sf = s.state_floats();
    let mut slots: Vec<u32> = batch.seqs.iter().map(|q| q.state_slot).collect();
    slots.sort_unstable();
    if slots.windows(2).any(|w| w[0] == w[1]) {
        return Err("two sequences of one step share a state slot".into());
    }
    if let Some(&last) = slots.last() {
        if (last as usize + 1) * sf > state_len {
            return Err(format!(
                "state slot {last} past the state's {} slots",
                state_len / sf.max(1)
            ));
        }
    }
    match batch.positions.iter().find(|&&p| p as usize >= s.n_ctx) {
        Some(p) => Err(format!(
            "position {p} past the state's context of {}",
            s.n_ctx
        )),
        None => Ok(()),
    }
}

/// The first of a layer's three phases over a step ([`attention`]): each token's key rotated
/// and f16-rounded into `keys` ([rows, head_dim]), and each sequence's compressor rings and
/// compressed rows (and the indexer's) brought up to its last token, in position order.
pub fn attention_prepare(
    batch: &crate::Batch,
    s: &AttnShape,
    w: &AttnHost,
    x: &AttnInputs<[f32]>,
    state: &mut [f32],
    mut kept: Option<&mut Kept>,
    keys: &mut [f32],
) -> Result<(), String> {
    let k = kept.as_deref().map(|k| (k.planes, k.rows.len()));
    check_step(batch, s, state.len(), k)?;
    let hd = s.head_dim;
    let sf = s.state_floats();
    let angles = RopeAngles::new(&s.rope);
    let cang = RopeAngles::new(&s.comp_rope);
    let np = angles.pairs();
    let mut sin = [0f32; crate::ROPE_MAX_PAIRS];
    let mut cos = [0f32; crate::ROPE_MAX_PAIRS];
    let (cw, ring, ratio) = (s.comp_width(), s.ring(), s.ratio);
    let lay = layout(s);
    for seq in &batch.seqs {
        let slot = &mut state[seq.state_slot as usize * sf..][..sf];
        for t in seq.start..seq.start + seq.len {
            let p = batch.positions[t] as usize;
            if let Some(k) = kept.as_deref_mut().filter(|_| ratio > 0) {
                let (q, r) = (seq.kept_slot as usize, t - seq.start);
                k.keep(s, slot, q, seq.len, r, p, 1..5);
            }
            angles.at(p as u32, &mut sin[..np], &mut cos[..np]);
            let k = &mut keys[t * hd..][..hd];
            k.copy_from_slice(&x.kv[t * hd..][..hd]);
            rope_tail(k, &sin[..np], &cos[..np], 1.0);
            k.iter_mut().for_each(|v| *v = f16r(*v));
            // The compressors: this token's rows into the rings, a block's row at its end.
            let mut comp = |kv: &[f32],
                            sc: &[f32],
                            ape: &[f32],
                            norm: &[f32],
                            ratio,
                            ring,
                            w,
                            dim,
                            parts: [usize; 3]| {
                let [rk, rs, rc] = parts.map(|i| lay[i]);
                let r = p % ring;
                slot[rk.0 + r * w..][..w].copy_from_slice(&kv[t * w..][..w]);
                let ape = &ape[(p % ratio) * w..][..w];
                for ((d, &v), &a) in slot[rs.0 + r * w..][..w]
                    .iter_mut()
                    .zip(&sc[t * w..][..w])
                    .zip(ape)
                {
                    *d = v + a;
                }
                if (p + 1).is_multiple_of(ratio) {
                    let b = p / ratio;
                    let (head, rows) = slot.split_at_mut(rc.0);
                    compress(
                        &head[rk.0..rk.0 + rk.1],
                        &head[rs.0..rs.0 + rs.1],
                        ring,
                        w,
                        ratio,
                        dim,
                        b,
                        norm,
                        s.rms_eps,
                        &cang,
                        // The indexer's rows (parts 4 to 6) are rotated.
                        parts[0] == 4,
                        &mut rows[b * dim..][..dim],
                    );
                }
            };
            if ratio > 0 {
                let (kv, sc) = (x.comp_kv.unwrap(), x.comp_score.unwrap());
                comp(kv, sc, w.ape, w.norm, ratio, ring, cw, hd, [1, 2, 3]);
            }
            if ratio == 4 {
                let (kv, sc) = (x.ix_kv.unwrap(), x.ix_score.unwrap());
                comp(
                    kv,
                    sc,
                    w.ix_ape,
                    w.ix_norm,
                    4,
                    8,
                    2 * s.ix_dim,
                    s.ix_dim,
                    [4, 5, 6],
                );
            }
        }
    }
    Ok(())
}

/// The second phase: token `t`'s attention (all heads) into `out` ([n_head·head_dim],
/// rotated back), over the keys [`attention_prepare`] made and its sequence's slot: the
/// compressed rows it reads ([`attention_select`]), then each head ([`attention_head`]).
/// Tokens and heads are independent here (any order, in parallel).
#[allow(clippy::too_many_arguments)]
pub fn attention_token(
    batch: &crate::Batch,
    s: &AttnShape,
    w: &AttnHost,
    x: &AttnInputs<[f32]>,
    state: &[f32],
    keys: &[f32],
    t: usize,
    out: &mut [f32],
) {
    let sel = attention_select(batch, s, x, state, t);
    let hd = s.head_dim;
    for (hh, o) in out.chunks_exact_mut(hd).take(s.n_head).enumerate() {
        attention_head(batch, s, w, x, state, keys, t, hh, &sel, Form::Rows, o);
    }
}

/// The third phase: each sequence's keys into its slot's window ring, in position order
/// (what a row overwrites kept first, with `kept`).
pub fn attention_commit(
    batch: &crate::Batch,
    s: &AttnShape,
    state: &mut [f32],
    mut kept: Option<&mut Kept>,
    keys: &[f32],
) {
    let (hd, sf) = (s.head_dim, s.state_floats());
    for seq in &batch.seqs {
        let (q, kq) = (seq.state_slot as usize, seq.kept_slot as usize);
        let slot = &mut state[q * sf..][..sf];
        for t in seq.start..seq.start + seq.len {
            let p = batch.positions[t] as usize;
            if let Some(k) = kept.as_deref_mut() {
                k.keep(s, slot, kq, seq.len, t - seq.start, p, 0..1);
            }
            slot[(p % s.raw_ring()) * hd..][..hd].copy_from_slice(&keys[t * hd..][..hd]);
        }
    }
}

/// One layer's attention over the step's sequences. `state` holds slots of
/// [`AttnShape::state_floats`]; sequence s uses slot `batch.seqs[s].state_slot` (distinct
/// within a step) and must continue where that slot's sequence stopped, or start at position
/// 0 (a token reads only positions its own sequence wrote: a slot needs no clearing).
/// `out`: [rows, n_head·head_dim], rotated back. In three phases: [`attention_prepare`],
/// [`attention_token`] per token, [`attention_commit`]. With `kept`, each sequence's last rows
/// keep what they overwrite, for [`rewind`].
pub fn attention(
    batch: &crate::Batch,
    s: &AttnShape,
    w: &AttnHost,
    x: &AttnInputs<[f32]>,
    state: &mut [f32],
    mut kept: Option<&mut Kept>,
    out: &mut [f32],
) -> Result<(), String> {
    let n = batch.n_tokens();
    let width = s.n_head * s.head_dim;
    let mut keys = vec![0f32; n * s.head_dim];
    attention_prepare(batch, s, w, x, state, kept.as_deref_mut(), &mut keys)?;
    for t in 0..n {
        attention_token(
            batch,
            s,
            w,
            x,
            state,
            &keys,
            t,
            &mut out[t * width..][..width],
        );
    }
    attention_commit(batch, s, state, kept, &keys);
    Ok(())
}

#[cfg(test)]
mod tests;
