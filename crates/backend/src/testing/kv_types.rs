//! The KV cache's element types on a backend: K and V written by `rope_kv_write` into a cache
//! of each pair of types, then `attention` over it, against the f32 reference over the same
//! keys and values (the error each codec is allowed), and the last token alone against the
//! same token in the whole step (bit for bit: a quantized cache is batch invariant too), and
//! the same tokens written and attended in steps of 7 against their rows of the whole step
//! (bit for bit: tq4 keys encode a block again at each write, and a row reads its own block
//! exactly, whatever wrote it).

use super::{read, rel_err, Harness, Rng};
use crate::{reference, AttnParams, Backend, Batch, KvLayer, KvSpec, KvType, KvTypes, RopeMode};
use crate::{RopeParams, KV_BLOCK_SIZE};

/// The relative error (L2 over the outputs) attention may make with `t` for K or V, from the
/// codec's resolution (measured errors are several times smaller): f16 and bf16 rounding, q8_0
/// steps of amax/127, and TurboQuant's Lloyd–Max distortion (tq8 about 1e-4 of the variance,
/// tq4 about 1e-2; tq4 keys: half a step of (max − min) / 15 per channel of a block).
pub fn codec_bound(t: KvType) -> f64 {
    match t {
        KvType::F16 => 3e-3,
        KvType::Bf16 => 2e-2,
        KvType::Q8_0 => 2e-2,
        KvType::Tq8 => 2e-2,
        KvType::Tq4 => 0.2,
    }
}

/// (heads, KV heads, head dim, window, soft-cap).
type Shape = (usize, usize, usize, Option<u32>, Option<f32>);

const SHAPES: &[Shape] = &[
    (8, 2, 64, None, None),
    (4, 1, 256, Some(7), Some(30.0)),
    (2, 1, 512, None, None),
];

/// Attention of one shape of the tables (scale 1/√hd).
fn params(
    nh: usize,
    nkv: usize,
    hd: usize,
    window: Option<u32>,
    softcap: Option<f32>,
) -> AttnParams {
    AttnParams {
        n_head: nh,
        n_head_kv: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        scale_q: false,
        window,
        softcap,
    }
}

/// One layer's cache of `kv_types` over `n_slots` slots.
fn spec(kv_types: KvTypes, n_slots: usize, nkv: usize, hd: usize) -> KvSpec {
    KvSpec {
        k: kv_types.k,
        v: kv_types.v,
        block_size: KV_BLOCK_SIZE,
        n_slots,
        layers: vec![KvLayer {
            n_head_kv: nkv,
            head_dim: hd,
        }],
    }
}

/// Runs every pair of `pairs` over every shape; returns one line per (pair, shape) with the
/// error measured.
pub fn kv_types<B: Backend, H: Harness<B>>(
    be: &mut B,
    h: &H,
    pairs: &[KvTypes],
    rng: &mut Rng,
) -> Vec<String> {
    let mut notes = Vec::new();
    let n = 40;
    let bs = KV_BLOCK_SIZE;
    let table = [2u32, 0, 3];
    let n_slots = 4 * bs;
    let tokens: Vec<u32> = (0..n as u32).collect();
    // Prompt rows (a backend may give prompt rows and decode rows kernels of their own): the
    // last one alone is still a prompt row.
    let mut whole = Batch::single(&tokens, 0, &table, bs, vec![]);
    let mut last = Batch::single(&tokens[n - 1..], n - 1, &table, bs, vec![]);
    whole.seqs[0].decode_from = n;
    last.seqs[0].decode_from = n;
    for &kv_types in pairs {
        for &(nh, nkv, hd, window, softcap) in SHAPES {
            let what = format!(
                "K {} V {}, head dim {hd}",
                kv_types.k.name(),
                kv_types.v.name()
            );
            let a = params(nh, nkv, hd, window, softcap);
            let rope = RopeParams::plain(RopeMode::Neox, hd, 10000.0);
            let spec = spec(kv_types, n_slots, nkv, hd);
            let mut kv = be.kv(&spec, 0).unwrap();
            let (qd, kvd) = (nh * hd, nkv * hd);
            let (qh, kh, vh) = (
                rng.scaled(n * qd, 3.0),
                rng.scaled(n * kvd, 3.0),
                rng.vec(n * kvd),
            );
            let up = |be: &B, x: &[f32]| h.upload(be, x);
            let (mut q, mut k, v) = (up(be, &qh), up(be, &kh), up(be, &vh));
            let st = be.begin_step(&whole, 0, 256, 256).unwrap();
            be.rope_kv_write(&st, &mut q, &mut k, &v, &rope, &a, &mut kv)
                .unwrap();
            let mut out = be.buf(n * qd).unwrap();
            be.attention(&st, &q, &kv, &a, &mut out).unwrap();
            be.end_step(true).unwrap();
            let got = read(be, &out, n * qd);
            // The reference over the keys as rope left them, at the batch's slots.
            let (qr, kr) = (read(be, &q, n * qd), read(be, &k, n * kvd));
            let (mut kc, mut vc) = (vec![0f32; n_slots * kvd], vec![0f32; n_slots * kvd]);
            for t in 0..n {
                let s = whole.slots[t] as usize;
                kc[s * kvd..][..kvd].copy_from_slice(&kr[t * kvd..][..kvd]);
                vc[s * kvd..][..kvd].copy_from_slice(&vh[t * kvd..][..kvd]);
            }
            let mut want = vec![0f32; n * qd];
            reference::attention(&qr, &kc, &vc, &whole, &a, &mut want);
            let err = rel_err(&got, &want);
            let bound = codec_bound(kv_types.k) + codec_bound(kv_types.v);
            assert!(
                err <= bound,
                "{what}: relative error {err:.2e} > {bound:.0e}"
            );
            // The last token alone: the same bits as in the whole step.
            let st = be.begin_step(&last, 0, 256, 256).unwrap();
            let ql = up(be, &qr[(n - 1) * qd..]);
            let mut alone = be.buf(qd).unwrap();
            be.attention(&st, &ql, &kv, &a, &mut alone).unwrap();
            be.end_step(true).unwrap();
            let alone = read(be, &alone, qd);
            let same = alone
                .iter()
                .zip(&got[(n - 1) * qd..])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{what}: the last token alone differs from the same token in the step"
            );
            // The same tokens written and attended in steps of 7 (prompt rows): each row's
            // bits as in the whole step.
            let mut kv2 = be.kv(&spec, 0).unwrap();
            for p0 in (0..n).step_by(7) {
                let p1 = (p0 + 7).min(n);
                let mut part = Batch::single(&tokens[p0..p1], p0, &table, bs, vec![]);
                part.seqs[0].decode_from = n;
                let st = be.begin_step(&part, 0, 256, 256).unwrap();
                // q and k as rope left them in the whole step; no rotation here.
                let mut qp = up(be, &qr[p0 * qd..p1 * qd]);
                let mut kp = up(be, &kr[p0 * kvd..p1 * kvd]);
                let vp = up(be, &vh[p0 * kvd..p1 * kvd]);
                let none = RopeParams::plain(RopeMode::Neox, 0, 10000.0);
                be.rope_kv_write(&st, &mut qp, &mut kp, &vp, &none, &a, &mut kv2)
                    .unwrap();
                let mut o = be.buf((p1 - p0) * qd).unwrap();
                be.attention(&st, &qp, &kv2, &a, &mut o).unwrap();
                be.end_step(true).unwrap();
                let o = read(be, &o, (p1 - p0) * qd);
                let same = o
                    .iter()
                    .zip(&got[p0 * qd..p1 * qd])
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{what}: tokens {p0}..{p1} written and attended in a step of their own differ from the whole step"
                );
            }
            notes.push(format!(
                "{what}: relative error {err:.2e} (bound {bound:.0e})"
            ));
        }
    }
    notes
}

/// Every pair of one type for both (tq4: per-block keys, rotated values), the mixed pairs that
/// exercise a rotated side next to a plain one, tq4 keys with f16 values, and tq8 keys with
/// tq4 values (what `--kv-type tq4` named before tq4 keys met the quality bound).
pub fn all_pairs() -> Vec<KvTypes> {
    let mut p: Vec<KvTypes> = KvType::ALL
        .iter()
        .map(|&t| KvTypes { k: t, v: t })
        .collect();
    p.push(KvTypes {
        k: KvType::Tq8,
        v: KvType::F16,
    });
    p.push(KvTypes {
        k: KvType::Q8_0,
        v: KvType::Tq4,
    });
    p.push(KvTypes {
        k: KvType::Tq4,
        v: KvType::F16,
    });
    p.push(KvTypes {
        k: KvType::Tq8,
        v: KvType::Tq4,
    });
    p
}

/// The prompt path over every pair of `pairs` at depth: a sequence of `len` positions (K and V
/// written by `rope_kv_write` in one step, no rotation), then its last 100 tokens as one prompt
/// step against the f32 reference over the same keys, and its last 37 as another step (other
/// query tiles) bit for bit against the same rows of the first. With `len` past the backend's
/// key range (4,096 on CUDA) rows span several ranges. Then the last token alone as a decode
/// step against the reference. One line per (pair, shape).
pub fn prompt_at_depth<B: Backend, H: Harness<B>>(
    be: &mut B,
    h: &H,
    pairs: &[KvTypes],
    len: usize,
    rng: &mut Rng,
) -> Vec<String> {
    const SHAPES: &[Shape] = &[
        (8, 2, 64, None, None),
        (16, 2, 128, None, None),
        (4, 1, 256, Some(4200), Some(30.0)),
    ];
    let mut notes = Vec::new();
    let bs = KV_BLOCK_SIZE;
    let n_blocks = len.div_ceil(bs);
    // Blocks in a scrambled order: the block table is followed.
    let table: Vec<u32> = (0..n_blocks as u32)
        .map(|i| (i * 7) % n_blocks as u32)
        .rev()
        .collect();
    assert!(
        !n_blocks.is_multiple_of(7),
        "the scrambled table is a permutation"
    );
    let n_slots = n_blocks * bs;
    let tokens: Vec<u32> = (0..len as u32).collect();
    let all = Batch::single(&tokens, 0, &table, bs, vec![]);
    let (p1, p2) = (100.min(len), 37.min(len));
    let tail = Batch::single(&tokens[len - p1..], len - p1, &table, bs, vec![]);
    let tail2 = Batch::single(&tokens[len - p2..], len - p2, &table, bs, vec![]);
    let last = Batch::single(&tokens[len - 1..], len - 1, &table, bs, vec![]);
    for &kv_types in pairs {
        for &(nh, nkv, hd, window, softcap) in SHAPES {
            let what = format!(
                "K {} V {}, head dim {hd}, {len} positions",
                kv_types.k.name(),
                kv_types.v.name()
            );
            let a = params(nh, nkv, hd, window, softcap);
            let rope = RopeParams::plain(RopeMode::Neox, 0, 10000.0);
            let spec = spec(kv_types, n_slots, nkv, hd);
            let mut kv = be.kv(&spec, 0).unwrap();
            let (qd, kvd) = (nh * hd, nkv * hd);
            let (kh, vh) = (rng.scaled(len * kvd, 3.0), rng.vec(len * kvd));
            let up = |be: &B, x: &[f32]| h.upload(be, x);
            let (mut q, mut k, v) = (up(be, &vec![0.0; len * qd]), up(be, &kh), up(be, &vh));
            let st = be.begin_step(&all, 0, len.max(256), 256).unwrap();
            be.rope_kv_write(&st, &mut q, &mut k, &v, &rope, &a, &mut kv)
                .unwrap();
            be.end_step(true).unwrap();
            let qh = rng.scaled(p1 * qd, 3.0);
            let run = |be: &mut B, b: &Batch, q: &[f32]| {
                let n = b.n_tokens();
                let st = be.begin_step(b, 0, 256, 256).unwrap();
                let qb = up(be, q);
                let mut out = be.buf(n * qd).unwrap();
                be.attention(&st, &qb, &kv, &a, &mut out).unwrap();
                be.end_step(true).unwrap();
                read(be, &out, n * qd)
            };
            let got = run(be, &tail, &qh);
            let mut want = vec![0f32; p1 * qd];
            let mut kc = vec![0f32; n_slots * kvd];
            let mut vc = vec![0f32; n_slots * kvd];
            for t in 0..len {
                let s = all.slots[t] as usize;
                kc[s * kvd..][..kvd].copy_from_slice(&kh[t * kvd..][..kvd]);
                vc[s * kvd..][..kvd].copy_from_slice(&vh[t * kvd..][..kvd]);
            }
            reference::attention(&qh, &kc, &vc, &tail, &a, &mut want);
            let err = rel_err(&got, &want);
            let bound = codec_bound(kv_types.k) + codec_bound(kv_types.v) + 3e-3;
            assert!(
                err <= bound,
                "{what}: relative error {err:.2e} > {bound:.0e}"
            );
            let got2 = run(be, &tail2, &qh[(p1 - p2) * qd..]);
            let same = got2
                .iter()
                .zip(&got[(p1 - p2) * qd..])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{what}: the last {p2} tokens in a step of their own differ from the same rows in a step of {p1}"
            );
            // The last token as a decode step (the decode kernels, their key ranges merged).
            let got1 = run(be, &last, &qh[(p1 - 1) * qd..]);
            let err1 = rel_err(&got1, &want[(p1 - 1) * qd..]);
            // One row's relative error spreads wider than a step's (a tq8 key cache's single
            // decode row measured 2.65e-2 against a step's 1.3e-2 on the H200): half again the
            // step's bound.
            let bound1 = 1.5 * bound;
            assert!(
                err1 <= bound1,
                "{what}: the last token's decode step: relative error {err1:.2e} > {bound1:.1e}"
            );
            notes.push(format!(
                "{what}: relative error {err:.2e}, decode {err1:.2e} (bound {bound:.0e})"
            ));
        }
    }
    notes
}
