//! The ops over the paged KV cache, for every batch of the table: `attention` (every shape of
//! [`ATTENTION`]) and `rope_kv_write` (every case of [`ROPE`]; also with per-head q/k norms,
//! `qk_norm_rope_kv_write`).

use super::batches::{batches, TestBatch};
use super::cases::{ATTENTION, ROPE};
use super::{kv_spec, poison, read, rel_err, Bounds, Harness, Notes, Rng};
use crate::{reference, Backend, Batch};
use half::f16;

/// Vocabulary of the batches' token ids (the ids play no part here).
const VOCAB: usize = 1000;

/// The slots of every position the batch's sequences hold (`0..kv_len` of each).
fn held_slots(b: &Batch) -> Vec<usize> {
    let mut v: Vec<usize> = (0..b.seqs.len())
        .flat_map(|s| (0..b.seqs[s].kv_len).map(move |p| b.slot(s, p)))
        .collect();
    // Sequences may share blocks.
    v.sort_unstable();
    v.dedup();
    v
}

/// A cache of `n_slots × kv_dim` that holds random f16 values at the positions the batch's
/// sequences hold (K scaled up, so that softmax is not flat) and NaN everywhere else: an
/// attention that reads outside a sequence's positions fails. Returns K and V as stored and
/// as f32 for the reference.
fn random_kv(rng: &mut Rng, b: &Batch, n_slots: usize, kv_dim: usize) -> [(Vec<f16>, Vec<f32>); 2] {
    [3.0f32, 1.0].map(|scale| {
        let mut h = vec![f16::NAN; n_slots * kv_dim];
        for s in held_slots(b) {
            for x in &mut h[s * kv_dim..][..kv_dim] {
                *x = f16::from_f32(rng.f() * scale);
            }
        }
        let f = h.iter().map(|x| x.to_f32()).collect();
        (h, f)
    })
}

/// `attention` of every shape of the table over every batch.
pub fn attention<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    let bound = h.bounds(be).attention;
    for tb in batches(rng, VOCAB) {
        let b = &tb.batch;
        let n = b.n_tokens();
        let st = be.begin_step(b, 0, 256, 256).unwrap();
        assert!(!st.replayed, "a test step is never replayed");
        for case in ATTENTION {
            let a = case.params();
            let (hd, nh, nkv) = (a.head_dim, a.n_head, a.n_head_kv);
            let mut kv = be.kv(&kv_spec(tb.n_slots, nkv, hd), 0).unwrap();
            let [(kh, kf), (vh, vf)] = random_kv(rng, b, tb.n_slots, nkv * hd);
            h.write_kv(be, &mut kv, &kh, &vh);
            let q = rng.scaled(n * nh * hd, 3.0);
            let qb = h.upload(be, &q);
            let mut out = poison(be, h, st.rows * nh * hd);
            be.attention(&st, &qb, &kv, &a, &mut out).unwrap();
            let got = read(be, &out, q.len());
            let mut want = vec![0.0; q.len()];
            reference::attention(&q, &kf, &vf, b, &a, &mut want);
            let e = rel_err(&got, &want);
            notes.check("attention", e, bound, || {
                format!(
                    "hd {hd} heads {nh}/{nkv} window {:?} softcap {:?}, {}",
                    a.window, a.softcap, tb.name
                )
            });
        }
        assert!(be.end_step(true).unwrap(), "the test step was not kept");
    }
    notes
}

/// `rope_kv_write` of every case of the table over every batch: q rotated, K rotated and V
/// written at each token's slot of a NaN-filled cache, nothing written elsewhere; then
/// `qk_norm_rope_kv_write`: q's and k's heads RMS-normed by random weights, then the same.
pub fn rope_kv_write<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    let bounds = h.bounds(be);
    for tb in batches(rng, VOCAB) {
        let st = be.begin_step(&tb.batch, 0, 256, 256).unwrap();
        assert!(!st.replayed, "a test step is never replayed");
        for case in ROPE {
            rope_case(be, h, rng, &mut notes, &st, &tb, case, bounds);
        }
        assert!(be.end_step(true).unwrap(), "the test step was not kept");
    }
    notes
}

#[allow(clippy::too_many_arguments)]
fn rope_case<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    st: &crate::Step<B::StepCtx>,
    tb: &TestBatch,
    case: &super::cases::RopeCase,
    bounds: Bounds,
) {
    let b = &tb.batch;
    let n = b.n_tokens();
    let (rope, a) = case.params();
    let (nh, nkv, hd) = (a.n_head, a.n_head_kv, a.head_dim);
    let kvd = nkv * hd;
    let what = format!("rope {case:?}, {}", tb.name);
    let mut kv = be.kv(&kv_spec(tb.n_slots, nkv, hd), 0).unwrap();
    let nan = vec![f16::NAN; tb.n_slots * kvd];
    h.write_kv(be, &mut kv, &nan, &nan);
    let (q, k, v) = (rng.vec(n * nh * hd), rng.vec(n * kvd), rng.vec(n * kvd));
    let (mut qb, mut kb, vb) = (h.upload(be, &q), h.upload(be, &k), h.upload(be, &v));
    be.rope_kv_write(st, &mut qb, &mut kb, &vb, &rope, &a, &mut kv)
        .unwrap();
    let (mut qw, mut kw) = (q.clone(), k.clone());
    reference::rope(&mut qw, &b.positions, nh, hd, &rope);
    reference::rope(&mut kw, &b.positions, nkv, hd, &rope);
    let e = rel_err(&read(be, &qb, q.len()), &qw);
    notes.check("rope_kv_write q", e, bounds.rope_q, || what.clone());
    let (kc, vc) = h.read_kv(be, &kv);
    let widen = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
    for t in 0..n {
        let s = b.slots[t] as usize;
        let ek = rel_err(&widen(&kc[s * kvd..][..kvd]), &kw[t * kvd..][..kvd]);
        let ev = rel_err(&widen(&vc[s * kvd..][..kvd]), &v[t * kvd..][..kvd]);
        notes.check("rope_kv_write K", ek, bounds.kv_write, || {
            format!("{what}, token {t}, slot {s}")
        });
        notes.check("rope_kv_write V", ev, bounds.kv_write, || {
            format!("{what}, token {t}, slot {s}")
        });
    }
    let mut written = vec![false; tb.n_slots];
    b.slots.iter().for_each(|&s| written[s as usize] = true);
    let stray = (0..tb.n_slots)
        .filter(|&s| !written[s])
        .filter(|&s| {
            let r = s * kvd..(s + 1) * kvd;
            kc[r.clone()].iter().chain(&vc[r]).any(|x| !x.is_nan())
        })
        .count();
    assert_eq!(
        stray, 0,
        "{what}: {stray} slots no token writes were written"
    );
    notes.checked += 1;
    // With per-head norms, into a fresh cache.
    let (nq, nk, eps) = (rng.vec(hd), rng.vec(hd), 1e-6);
    let (wq, wk) = (super::vector(be, &nq), super::vector(be, &nk));
    let mut kv = be.kv(&kv_spec(tb.n_slots, nkv, hd), 0).unwrap();
    h.write_kv(be, &mut kv, &nan, &nan);
    let (mut qb, mut kb) = (h.upload(be, &q), h.upload(be, &k));
    be.qk_norm_rope_kv_write(
        st,
        &mut qb,
        &mut kb,
        &vb,
        (&wq, &wk, eps),
        &rope,
        &a,
        &mut kv,
    )
    .unwrap();
    let (mut qw, mut kw) = (vec![0f32; q.len()], vec![0f32; k.len()]);
    reference::rms_norm(&q, &nq, eps, &mut qw);
    reference::rms_norm(&k, &nk, eps, &mut kw);
    reference::rope(&mut qw, &b.positions, nh, hd, &rope);
    reference::rope(&mut kw, &b.positions, nkv, hd, &rope);
    let e = rel_err(&read(be, &qb, q.len()), &qw);
    notes.check("qk_norm_rope_kv_write q", e, bounds.rope_q, || what.clone());
    let (kc, _) = h.read_kv(be, &kv);
    for t in 0..n {
        let s = b.slots[t] as usize;
        let ek = rel_err(&widen(&kc[s * kvd..][..kvd]), &kw[t * kvd..][..kvd]);
        notes.check("qk_norm_rope_kv_write K", ek, bounds.kv_write, || {
            format!("{what}, token {t}, slot {s}")
        });
    }
    notes.checked += 1;
}
