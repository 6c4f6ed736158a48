//! Products and the embedding for every weight type of the table: `matmul` at every token
//! count, `matmul_many` and `matmul_glu` (both activations), `matmul_logits` over each batch's
//! (non-contiguous) logits rows, `embed` of each batch's tokens.

use super::batches::{batches, TestBatch};
use super::cases::{FUSED_TOKENS, PRODUCT_SHAPES, PRODUCT_TOKENS, WEIGHT_TYPES};
use super::{poison, read, rel_err, Harness, Notes, Rng, WeightCase};
use crate::{reference, Activation, Backend, BackendError};

/// The reference of `w` times the `n` rows of `x` as the backend's products see them.
fn reference_product<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    w: &WeightCase,
    n: usize,
    x: &[f32],
) -> Vec<f32> {
    let mut want = vec![0f32; n * w.rows];
    let seen = h.as_seen(be, w.ty, n, x);
    reference::matmul(&w.values, w.rows, w.cols, &seen, n, &mut want);
    let off = h.offsets(be, w, n, x);
    want.iter_mut().zip(&off).for_each(|(w, o)| *w += o);
    want
}

/// Loads `w`, or notes why the backend refuses it.
fn load<B: Backend>(be: &B, w: &WeightCase, notes: &mut Notes) -> Option<B::Weight> {
    match w.load(be) {
        Ok(l) => Some(l),
        Err(BackendError::Unsupported { op, .. }) => {
            notes.skip(format!(
                "{}: no {} {op} ([{}, {}])",
                be.name(),
                w.ty,
                w.rows,
                w.cols
            ));
            None
        }
        Err(e) => panic!("{} [{}, {}]: {e}", w.ty, w.rows, w.cols),
    }
}

/// Every product and the embedding, for every weight type and shape of the table.
pub fn products<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    for &(rows, cols) in PRODUCT_SHAPES {
        let bs = batches(rng, rows);
        for &ty in WEIGHT_TYPES {
            let (Some(wc), Some(wc2)) = (
                WeightCase::random(rng, ty, rows, cols),
                WeightCase::random(rng, ty, rows, cols),
            ) else {
                notes.skip(format!("{ty}: no quantizer"));
                continue;
            };
            let Some(w) = load(be, &wc, &mut notes) else {
                continue;
            };
            let w2 = load(be, &wc2, &mut notes).expect("the type loaded once");
            for &n in PRODUCT_TOKENS {
                matmul(be, h, rng, &mut notes, &wc, &w, n);
            }
            for &n in FUSED_TOKENS {
                fused(be, h, rng, &mut notes, [&wc, &wc2], [&w, &w2], n);
            }
            for b in &bs {
                step_ops(be, h, rng, &mut notes, &wc, &w, b);
            }
        }
    }
    notes
}

/// `matmul` against the reference for each of `types` (those with a quantizer for the shape)
/// at each of `shapes` and `tokens`: shapes outside the table's (columns past whole tiles).
pub fn matmuls<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    shapes: &[(usize, usize)],
    types: &[quiver_gguf::GgmlType],
    tokens: &[usize],
) -> Notes {
    let mut notes = Notes::default();
    for &(rows, cols) in shapes {
        for &ty in types {
            let Some(wc) = WeightCase::random(rng, ty, rows, cols) else {
                notes.skip(format!("{ty}: no quantizer for [{rows}, {cols}]"));
                continue;
            };
            let Some(w) = load(be, &wc, &mut notes) else {
                continue;
            };
            for &n in tokens {
                matmul(be, h, rng, &mut notes, &wc, &w, n);
            }
        }
    }
    notes
}

/// Each token's product is the same bits whatever else is in the call: for every weight type
/// and shape, `matmul` over the last `n` rows of one x, for each `n` of `counts`, against the
/// same rows of the product over all `max(counts)` rows (a token then sits elsewhere in its
/// tiles and among other neighbours).
pub fn batch_invariance<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    types: &[quiver_gguf::GgmlType],
    counts: &[usize],
) -> Notes {
    let mut notes = Notes::default();
    let total = counts.iter().copied().max().unwrap_or(1);
    for &(rows, cols) in PRODUCT_SHAPES {
        for &ty in types {
            let Some(wc) = WeightCase::random(rng, ty, rows, cols) else {
                continue;
            };
            let Some(w) = load(be, &wc, &mut notes) else {
                continue;
            };
            let x = rng.vec(total * cols);
            let product = |x: &[f32], n: usize| {
                let xb = h.upload(be, x);
                let mut out = poison(be, h, n * rows);
                be.matmul(&w, &xb, n, &mut out).unwrap();
                read(be, &out, n * rows)
            };
            let all = product(&x, total);
            for &n in counts {
                let o = total - n;
                let part = product(&x[o * cols..], n);
                let d = super::bits_differ(&part, &all[o * rows..]);
                assert_eq!(
                    d,
                    0,
                    "{ty} [{rows}, {cols}]: {d} of {} results of tokens {o}..{total} differ alone",
                    n * rows
                );
            }
        }
    }
    notes
}

/// Each product is the same bits on every backend of `bes` (one kernel family's configurations
/// side by side: wmm's tiles): for every weight type and shape, `matmul` of the same `n` tokens
/// on each, against the first's.
pub fn same_bits<B: Backend, H: Harness<B>>(
    bes: &[B],
    h: &H,
    rng: &mut Rng,
    shapes: &[(usize, usize)],
    types: &[quiver_gguf::GgmlType],
    n: usize,
) {
    for &(rows, cols) in shapes {
        for &ty in types {
            let Some(wc) = WeightCase::random(rng, ty, rows, cols) else {
                continue;
            };
            let x = rng.vec(n * cols);
            let outs: Vec<Vec<f32>> = bes
                .iter()
                .map(|be| {
                    let w = wc.load(be).expect("the weight loads");
                    let xb = h.upload(be, &x);
                    let mut out = poison(be, h, n * rows);
                    be.matmul(&w, &xb, n, &mut out).unwrap();
                    read(be, &out, n * rows)
                })
                .collect();
            for (i, o) in outs.iter().enumerate().skip(1) {
                let d = super::bits_differ(o, &outs[0]);
                assert_eq!(
                    d, 0,
                    "{ty} [{rows}, {cols}], {n} tokens: {d} results differ on backend {i}"
                );
            }
        }
    }
}

/// `matmul` of `n` tokens.
fn matmul<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    wc: &WeightCase,
    w: &B::Weight,
    n: usize,
) {
    let (ty, rows, cols) = (wc.ty, wc.rows, wc.cols);
    let x = rng.vec(n * cols);
    let xb = h.upload(be, &x);
    let mut out = poison(be, h, n * rows);
    be.matmul(w, &xb, n, &mut out).unwrap();
    let got = read(be, &out, n * rows);
    let want = reference_product(be, h, wc, n, &x);
    let e = rel_err(&got, &want);
    let bound = h.product_bound(be, ty, cols, n);
    notes.check("matmul", e, bound, || {
        format!("{ty} [{rows}, {cols}], {n} tokens")
    });
    if h.activations_rounded(be, ty, cols, n) {
        // Against x itself the error is the activations' rounding's, several times larger.
        let mut plain = vec![0f32; n * rows];
        reference::matmul(&wc.values, rows, cols, &x, n, &mut plain);
        let ep = rel_err(&got, &plain);
        eprintln!("{ty} [{rows}, {cols}], {n} tokens: error {e:.2e} (as seen), {ep:.2e} (plain x)");
        assert!(
            ep > 3.0 * e,
            "{ty} [{rows}, {cols}], {n} tokens: activations not rounded as the model says ({e} vs {ep})"
        );
    }
}

/// `matmul_many` over `[w, w2, w, w2]` and `matmul_glu` (gate `w`, up `w2`) with both activations.
fn fused<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    wc: [&WeightCase; 2],
    w: [&B::Weight; 2],
    n: usize,
) {
    let (ty, rows, cols) = (wc[0].ty, wc[0].rows, wc[0].cols);
    let x = rng.vec(n * cols);
    let xb = h.upload(be, &x);
    let bound = h.product_bound(be, ty, cols, n);
    let mut outs: Vec<B::Buf> = (0..4).map(|_| poison(be, h, n * rows)).collect();
    be.matmul_many(
        &[w[0], w[1], w[0], w[1]],
        &xb,
        n,
        &mut outs.iter_mut().collect::<Vec<_>>(),
    )
    .unwrap();
    let wa = reference_product(be, h, wc[0], n, &x);
    let wb = reference_product(be, h, wc[1], n, &x);
    for (i, buf) in outs.iter().enumerate() {
        let got = read(be, buf, n * rows);
        let e = rel_err(&got, [&wa, &wb][i % 2]);
        notes.check("matmul_many", e, bound, || {
            format!("{ty} [{rows}, {cols}], output {i}, {n} tokens")
        });
        // Each product of the set has the bits `matmul` gives it alone.
        let mut alone = poison(be, h, n * rows);
        be.matmul(w[i % 2], &xb, n, &mut alone).unwrap();
        let same = got
            .iter()
            .zip(read(be, &alone, n * rows))
            .all(|(a, b)| a.to_bits() == b.to_bits());
        notes.check(
            "matmul_many = matmul",
            f64::from(u8::from(!same)),
            0.0,
            || format!("{ty} [{rows}, {cols}], output {i}, {n} tokens"),
        );
    }
    for act in [Activation::SwiGlu, Activation::GeGlu] {
        let (mut s1, mut s2, mut o) = (
            poison(be, h, n * rows),
            poison(be, h, n * rows),
            poison(be, h, n * rows),
        );
        be.matmul_glu(act, w[0], w[1], &xb, n, [&mut s1, &mut s2], &mut o)
            .unwrap();
        let mut want = vec![0f32; n * rows];
        reference::glu(act, &wa, &wb, &mut want);
        let e = rel_err(&read(be, &o, n * rows), &want);
        // GeGLU goes through f16 (as ggml's): a rounding step can move an element by 1e-3.
        notes.check("matmul_glu", e, bound.max(2e-3), || {
            format!("{ty} [{rows}, {cols}] {act:?}, {n} tokens")
        });
    }
}

/// `embed` of the batch's tokens (scaled) and `matmul_logits` over its logits rows, in one step.
fn step_ops<B: Backend, H: Harness<B>>(
    be: &mut B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    wc: &WeightCase,
    w: &B::Weight,
    tb: &TestBatch,
) {
    let (ty, rows, cols) = (wc.ty, wc.rows, wc.cols);
    let b = &tb.batch;
    let (n, nl) = (b.n_tokens(), b.logits.len());
    let x = rng.vec(n * cols);
    let xb = h.upload(be, &x);
    let bound = h.bounds(be).embed;
    let st = be.begin_step(b, 0, 256, 256).unwrap();
    assert!(!st.replayed, "a test step is never replayed");
    let mut emb = poison(be, h, st.rows * cols);
    be.embed(&st, w, 1.5, &mut emb).unwrap();
    let mut logits = poison(be, h, st.logit_rows * rows);
    be.matmul_logits(&st, w, &xb, &mut logits).unwrap();
    assert!(be.end_step(true).unwrap(), "the test step was not kept");

    let want: Vec<f32> = b
        .tokens
        .iter()
        .flat_map(|&t| {
            wc.values[t as usize * cols..][..cols]
                .iter()
                .map(|v| v * 1.5)
        })
        .collect();
    let e = rel_err(&read(be, &emb, n * cols), &want);
    notes.check("embed", e, bound, || {
        format!("{ty} [{rows}, {cols}], {}", tb.name)
    });

    let picked: Vec<f32> = b
        .logits
        .iter()
        .flat_map(|&t| x[t as usize * cols..][..cols].iter().copied())
        .collect();
    let want = reference_product(be, h, wc, nl, &picked);
    let e = rel_err(&read(be, &logits, nl * rows), &want);
    let bound = h.product_bound(be, ty, cols, nl);
    notes.check("matmul_logits", e, bound, || {
        format!("{ty} [{rows}, {cols}], {} (rows {:?})", tb.name, b.logits)
    });
}
