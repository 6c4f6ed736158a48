//! The ops that need no step: norms (plain, in place, fused with the residual add), `add`,
//! `glu` (both activations), `softcap`, `argmax`, `top_k` and `mask_rows`; and, where the backend has them,
//! the extra ops (`scale`, `rms_norm_plain`, `mul_cols`, `copy_cols`).

use super::cases::{GLU, LOGITS, NORMS, TOP_K};
use super::{poison, read, rel_err, vector, Harness, Notes, Rng};
use crate::{reference, Activation, Backend, ExtraOp};

/// Every element-wise and row-wise op of the table.
pub fn elementwise<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    let bounds = h.bounds(be);
    for &(rows, d) in NORMS {
        let n = rows * d;
        let what = format!("{rows}×{d}");
        let g = rng.vec(d);
        let w = vector(be, &g);
        let x = rng.vec(n);
        let xb = h.upload(be, &x);
        let mut want = vec![0.0; n];
        reference::rms_norm(&x, &g, 1e-6, &mut want);
        let mut out = poison(be, h, n);
        be.rms_norm(&xb, &w, 1e-6, rows, &mut out).unwrap();
        let e = rel_err(&read(be, &out, n), &want);
        notes.check("rms_norm", e, bounds.norm, || what.clone());
        let mut inplace = h.upload(be, &x);
        be.rms_norm_inplace(&mut inplace, &w, 1e-6, rows).unwrap();
        let e = rel_err(&read(be, &inplace, n), &want);
        notes.check("rms_norm_inplace", e, bounds.norm, || what.clone());

        // The gated norm against the reference, and against the backend's own two ops (the
        // trait's default) bit for bit.
        let z = rng.scaled(n, 6.0);
        let zb = h.upload(be, &z);
        let mut gated = vec![0.0; n];
        reference::glu(Activation::SwiGlu, &z, &want, &mut gated);
        let mut xg = h.upload(be, &x);
        let mut out = poison(be, h, n);
        be.rms_norm_gated(&mut xg, &w, 1e-6, rows, d, &zb, &mut out)
            .unwrap();
        let fused = read(be, &out, n);
        let e = rel_err(&fused, &gated);
        notes.check("rms_norm_gated", e, bounds.norm + bounds.glu, || {
            what.clone()
        });
        let mut out2 = poison(be, h, n);
        be.glu(Activation::SwiGlu, &zb, &inplace, n, &mut out2)
            .unwrap();
        let same = fused
            .iter()
            .zip(read(be, &out2, n))
            .all(|(a, b)| a.to_bits() == b.to_bits());
        notes.check(
            "rms_norm_gated = rms_norm_inplace, glu",
            f64::from(u8::from(!same)),
            0.0,
            || what.clone(),
        );

        let (resid, addv) = (rng.vec(n), rng.vec(n));
        let sum: Vec<f32> = resid.iter().zip(&addv).map(|(a, b)| a + b).collect();
        reference::rms_norm(&sum, &g, 1e-6, &mut want);
        let (mut rb, ab) = (h.upload(be, &resid), h.upload(be, &addv));
        let mut out = poison(be, h, n);
        be.add_rms_norm(&mut rb, &ab, &w, 1e-6, rows, &mut out)
            .unwrap();
        let e = rel_err(&read(be, &rb, n), &sum);
        notes.check("add_rms_norm residual", e, bounds.add, || what.clone());
        let e = rel_err(&read(be, &out, n), &want);
        notes.check("add_rms_norm", e, bounds.norm, || what.clone());

        let mut ab2 = h.upload(be, &resid);
        be.add(&mut ab2, &ab, n).unwrap();
        let e = rel_err(&read(be, &ab2, n), &sum);
        notes.check("add", e, bounds.add, || what.clone());
        extras(be, h, rng, &mut notes, rows, d);
    }

    for &m in GLU {
        let (gate, up) = (rng.scaled(m, 6.0), rng.vec(m));
        let (gb, ub) = (h.upload(be, &gate), h.upload(be, &up));
        for act in [Activation::SwiGlu, Activation::GeGlu] {
            let mut ob = poison(be, h, m);
            be.glu(act, &gb, &ub, m, &mut ob).unwrap();
            let mut want = vec![0.0; m];
            reference::glu(act, &gate, &up, &mut want);
            let e = rel_err(&read(be, &ob, m), &want);
            notes.check("glu", e, bounds.glu, || format!("{act:?}, {m} elements"));
        }
    }

    for &(rows, cols) in LOGITS {
        logits(be, h, rng, &mut notes, rows, cols, bounds.softcap);
    }
    notes
}

/// The extra ops over `rows` rows of `d`, each against the scalar arithmetic (one rounding
/// per element: within the add bound), the norm against the reference with a weight of ones.
fn extras<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    rows: usize,
    d: usize,
) {
    let bounds = h.bounds(be);
    let (n, what) = (rows * d, format!("{rows}×{d}"));
    let x = rng.vec(n);
    if be.supports(ExtraOp::Scale) {
        let mut xb = h.upload(be, &x);
        be.scale(&mut xb, 0.37, n).unwrap();
        let want: Vec<f32> = x.iter().map(|v| v * 0.37).collect();
        let e = rel_err(&read(be, &xb, n), &want);
        notes.check("scale", e, bounds.add, || what.clone());
    }
    if be.supports(ExtraOp::RmsNormPlain) {
        let mut want = vec![0.0; n];
        reference::rms_norm(&x, &vec![1.0; d], 1e-6, &mut want);
        let mut out = poison(be, h, n);
        be.rms_norm_plain(&h.upload(be, &x), d, 1e-6, rows, &mut out)
            .unwrap();
        let e = rel_err(&read(be, &out, n), &want);
        notes.check("rms_norm_plain", e, bounds.norm, || what.clone());
    }
    if be.supports(ExtraOp::MulCols) {
        let g = rng.vec(d);
        let mut xb = h.upload(be, &x);
        be.mul_cols(&mut xb, &vector(be, &g), rows).unwrap();
        let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * g[i % d]).collect();
        let e = rel_err(&read(be, &xb, n), &want);
        notes.check("mul_cols", e, bounds.add, || what.clone());
    }
    if be.supports(ExtraOp::CopyCols) && d >= 8 {
        let (first, width) = (d / 4, d / 2);
        let mut out = poison(be, h, rows * width);
        be.copy_cols(&h.upload(be, &x), d, first, width, rows, &mut out)
            .unwrap();
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| x[r * d + first..r * d + first + width].to_vec())
            .collect();
        let e = rel_err(&read(be, &out, rows * width), &want);
        notes.check("copy_cols", e, bounds.add, || what.clone());
    }
}

/// `argmax` (ties to the first), `top_k` (ties to the smaller index, NaN never counts, every
/// row k pairs), `mask_rows` and `softcap` over `rows` rows of `cols` logits.
fn logits<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    rows: usize,
    cols: usize,
    softcap_bound: f64,
) {
    let what = format!("{rows}×{cols}");
    let mut logits = rng.vec(rows * cols);
    // Ties: row 0 has its maximum twice far apart (in different blocks of a backend that
    // splits a row), row 1 once, row 2 twice side by side.
    logits[10] = 9.0;
    logits[cols - 3] = 9.0;
    let c1 = cols * 7 / 10;
    logits[cols + c1] = 9.0;
    logits[2 * cols + 5] = 9.0;
    logits[2 * cols + 6] = 9.0;
    let mut lb = h.upload(be, &logits);
    let mut ids = Vec::new();
    be.argmax(&lb, rows, cols, &mut ids).unwrap();
    let want_ids: Vec<u32> = logits.chunks(cols).map(reference::argmax).collect();
    assert_eq!(ids, want_ids, "argmax {what}");
    notes.checked += 1;

    let mut tl = logits.clone();
    tl[7] = f32::NAN;
    tl[cols + c1 + 1] = 9.0;
    let tb = h.upload(be, &tl);
    for &k in TOP_K {
        let mut got = Vec::new();
        be.top_k(&tb, rows, cols, k, &mut got).unwrap();
        let mut want = Vec::new();
        for row in tl.chunks(cols) {
            reference::top_k(row, k, &mut want);
        }
        assert_eq!(got, want, "top_k {k} of {what}");
        notes.checked += 1;
    }

    // Masks on two of the rows (the last and the first, in that order): random bits, one
    // word short on the first (the columns past the bits are refused); the other rows keep
    // their values, and the masked rows' argmax is the best allowed column.
    let mut masked = logits.clone();
    let words = cols.div_ceil(32);
    let b0: Vec<u32> = (0..words)
        .map(|_| (rng.below(1 << 16) as u32) << 16 | rng.below(1 << 16) as u32)
        .collect();
    let b1: Vec<u32> = (0..words - 1).map(|_| rng.below(1 << 16) as u32).collect();
    let masks = [(rows - 1, &b0[..]), (0, &b1[..])];
    for &(r, bits) in &masks {
        reference::mask_row(&mut masked[r * cols..][..cols], bits);
    }
    let mut mb = h.upload(be, &logits);
    be.mask_rows(&mut mb, cols, &masks).unwrap();
    let got = read(be, &mb, rows * cols);
    assert_eq!(super::bits_differ(&got, &masked), 0, "mask_rows {what}");
    be.argmax(&mb, rows, cols, &mut ids).unwrap();
    let want_ids: Vec<u32> = masked.chunks(cols).map(reference::argmax).collect();
    assert_eq!(ids, want_ids, "argmax after mask_rows {what}");
    assert!(masked[..cols]
        .iter()
        .skip((words - 1) * 32)
        .all(|v| *v == f32::NEG_INFINITY));
    notes.checked += 1;

    be.softcap(&mut lb, 5.0, rows * cols).unwrap();
    let want: Vec<f32> = logits.iter().map(|x| 5.0 * (x / 5.0).tanh()).collect();
    let e = rel_err(&read(be, &lb, rows * cols), &want);
    notes.check("softcap", e, softcap_bound, || what);
}
