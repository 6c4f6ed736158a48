//! The gated delta net ([`crate::Backend::delta_net`]) and `sigmoid_mul` against the scalar
//! reference ([`crate::delta_net`]): one step of three sequences in their own state slots (one
//! starting at position 0 over a dirty slot, one continuing a prompt, one decoding), with more
//! value heads than key heads, over random inputs and a random starting state. Each sequence's
//! output and slot must be the reference's for it alone, the slot no sequence names left as it
//! was.

use super::{poison, read, rel_err, vector, Harness, Notes, Rng};
use crate::delta_net as dn;
use crate::{Backend, Batch, DeltaNetParams, DeltaNetWeights, SeqSpan};

pub fn delta_net<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    // Head widths of each kernel (a row over 1, 2 and 4 lanes: 32, 64, Qwen 3.5's 128), and ones
    // that fill no warp (16: idle lanes, 100: idle rows and entries); first prompts past one
    // round of the convolution's segments (128 rows) and within one.
    for (head, conv, first) in [
        (32, 4, 150),
        (16, 3, 37),
        (64, 4, 6),
        (128, 4, 20),
        (100, 2, 9),
    ] {
        let p = DeltaNetParams {
            n_k_heads: 2,
            n_v_heads: 4,
            head_k: head,
            head_v: head,
            conv_kernel: conv,
            eps: 1e-6,
        };
        rule_case(be, h, rng, &mut notes, &p, first);
    }
    sigmoid_case(be, h, rng, &mut notes);
    notes
}

/// One step of three sequences (the first `first` tokens long) through the delta net.
fn rule_case<B: Backend, H: Harness<B>>(
    be: &mut B,
    h: &H,
    rng: &mut Rng,
    notes: &mut Notes,
    p: &DeltaNetParams,
    first: usize,
) {
    let bound = h.delta_net_bound(be);
    let p = *p;
    let (c, hv, vd, per) = (p.channels(), p.n_v_heads, p.value_dim(), p.state_floats());
    // (slot, position of the first token, tokens); slot 1 is nobody's.
    let seqs = [(2usize, 0usize, first), (0, 6, 5), (3, 9, 1)];
    let n: usize = seqs.iter().map(|s| s.2).sum();
    let qkv = rng.vec(n * c);
    let alpha = rng.vec(n * hv);
    let beta = rng.scaled(n * hv, 3.0);
    let conv_w = rng.scaled(c * p.conv_kernel, 0.5);
    let dt = rng.vec(hv);
    let a: Vec<f32> = rng.vec(hv).iter().map(|x| -x.abs() - 0.1).collect();
    let state0 = rng.scaled(5 * per, 0.3);
    let mut batch = Batch {
        block_size: crate::KV_BLOCK_SIZE,
        ..Default::default()
    };
    let mut start = 0;
    for (si, &(slot, pos, len)) in seqs.iter().enumerate() {
        batch.seqs.push(SeqSpan {
            start,
            len,
            kv_len: pos + len,
            block_table: vec![0],
            state_slot: slot as u32,
            // Kept slots apart from the state slots: 1 and 0 for the prompts, none for the
            // decoding one.
            kept_slot: [1, 0, SeqSpan::NOT_KEPT][si],
            ..Default::default()
        });
        for t in 0..len {
            batch.tokens.push(0);
            batch.positions.push((pos + t) as u32);
            batch.slots.push((pos + t) as u32);
            batch.seq_of.push(si as u32);
        }
        start += len;
    }
    let (wc, wdt, wa) = (vector(be, &conv_w), vector(be, &dt), vector(be, &a));
    let mut x = h.upload(be, &qkv);
    let (ba, bb) = (h.upload(be, &alpha), h.upload(be, &beta));
    let mut state = h.upload(be, &state0);
    // Three kept states a kept slot: the first sequence keeps rows 3..6, the second rows 1..4,
    // the decoding one none (kept slots 2.. stay as they were).
    let planes = 3;
    let snap0 = rng.scaled(5 * planes * per, 0.3);
    let mut snap = h.upload(be, &snap0);
    let mut out = poison(be, h, n * vd);
    let st = be.begin_step(&batch, 0, 256, 256).unwrap();
    be.delta_net(
        &st,
        &p,
        DeltaNetWeights {
            conv: &wc,
            dt_bias: &wdt,
            a: &wa,
        },
        &mut x,
        &ba,
        &bb,
        &mut state,
        Some(crate::Snapshots {
            buf: &mut snap,
            planes,
        }),
        &mut out,
    )
    .unwrap();
    assert!(be.end_step(true).unwrap(), "the test step was not kept");
    let got = read(be, &out, n * vd);
    let got_state = read(be, &state, 5 * per);
    let got_snap = read(be, &snap, 5 * planes * per);
    let mut want_state = state0.clone();
    assert_eq!(
        got_snap[2 * planes * per..],
        snap0[2 * planes * per..],
        "kept slots no span names changed"
    );
    for (s, &(slot, pos, len)) in batch.seqs.iter().zip(&seqs) {
        // Each kept state: the reference over the span's rows up to its row.
        let k = s.kept_slot as usize;
        for j in (0..planes).filter(|_| s.kept_slot != SeqSpan::NOT_KEPT) {
            let kept = &got_snap[(k * planes + j) * per..][..per];
            let Some(row) = crate::Snapshots::<B::Buf>::row_of(planes, len, j) else {
                assert_eq!(
                    kept,
                    &snap0[(k * planes + j) * per..][..per],
                    "kept slot {k}'s plane {j} keeps no row of a span of {len}, yet changed"
                );
                continue;
            };
            let mut ws = state0[slot * per..(slot + 1) * per].to_vec();
            if pos == 0 {
                ws.fill(0.0);
            }
            let r = s.start..s.start + row + 1;
            dn::sequence(
                &p,
                row + 1,
                &mut qkv[r.start * c..r.end * c].to_vec(),
                &alpha[r.start * hv..r.end * hv],
                &beta[r.start * hv..r.end * hv],
                &conv_w,
                &dt,
                &a,
                &mut ws,
                &mut vec![0f32; (row + 1) * vd],
            );
            notes.check("delta_net kept state", rel_err(kept, &ws), bound, || {
                format!("slot {slot}, plane {j}: after row {row} of {len}")
            });
        }
        let ws = &mut want_state[slot * per..(slot + 1) * per];
        if pos == 0 {
            ws.fill(0.0);
        }
        let mut want = vec![0f32; len * vd];
        let r = s.start..s.start + len;
        dn::sequence(
            &p,
            len,
            &mut qkv[r.start * c..r.end * c].to_vec(),
            &alpha[r.start * hv..r.end * hv],
            &beta[r.start * hv..r.end * hv],
            &conv_w,
            &dt,
            &a,
            ws,
            &mut want,
        );
        notes.check(
            "delta_net",
            rel_err(&got[r.start * vd..r.end * vd], &want),
            bound,
            || format!("slot {slot}, positions {pos}..{}", pos + len),
        );
        notes.check(
            "delta_net state",
            rel_err(
                &got_state[slot * per..(slot + 1) * per],
                &want_state[slot * per..(slot + 1) * per],
            ),
            bound,
            || format!("slot {slot}"),
        );
    }
    assert_eq!(
        got_state[per..2 * per],
        state0[per..2 * per],
        "a slot no sequence names changed"
    );
}

/// `sigmoid_mul` against its definition.
fn sigmoid_case<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng, notes: &mut Notes) {
    let bound = h.delta_net_bound(be);
    // sigmoid_mul, element by element and one gate per row.
    let (rows, cols) = (5, 48);
    let xs = rng.vec(rows * cols);
    for per_row in [false, true] {
        let g = rng.scaled(if per_row { rows } else { rows * cols }, 4.0);
        let mut bx = h.upload(be, &xs);
        be.sigmoid_mul(&mut bx, &h.upload(be, &g), rows, cols, per_row)
            .unwrap();
        let want: Vec<f32> = (0..rows * cols)
            .map(|i| xs[i] * dn::sigmoid(g[if per_row { i / cols } else { i }]))
            .collect();
        notes.check(
            "sigmoid_mul",
            rel_err(&read(be, &bx, rows * cols), &want),
            bound,
            || format!("per row {per_row}"),
        );
    }
}
