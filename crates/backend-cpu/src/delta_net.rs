//! The gated delta net on the CPU: the convolution per sequence, then the delta rule one task
//! per (sequence, value head), each task the scalar recurrence of
//! [`quiver_backend::delta_net`] (so every token's floats are what it gets alone, whatever the
//! batch).

use crate::{check, par_rows, SyncPtr};
use quiver_backend::delta_net as dn;
use quiver_backend::{Batch, DeltaNetParams, Result};
use quiver_cpu_kernels::ThreadPool;

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    pool: &ThreadPool,
    batch: &Batch,
    p: &DeltaNetParams,
    conv_w: &[f32],
    dt_bias: &[f32],
    a: &[f32],
    qkv: &mut [f32],
    alpha: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) -> Result<()> {
    let n = batch.n_tokens();
    let (c, hv, vd) = (p.channels(), p.n_v_heads, p.value_dim());
    let per_slot = p.state_floats();
    check("delta_net", p.check().is_ok(), || {
        p.check().err().unwrap_or_default()
    })?;
    check(
        "delta_net",
        qkv.len() >= n * c
            && alpha.len() >= n * hv
            && beta.len() >= n * hv
            && out.len() >= n * vd
            && conv_w.len() == c * p.conv_kernel
            && dt_bias.len() == hv
            && a.len() == hv,
        || format!("{n} rows of {c} channels, {hv} value heads"),
    )?;
    for s in &batch.seqs {
        let slot = s.state_slot as usize;
        check("delta_net", (slot + 1) * per_slot <= state.len(), || {
            format!(
                "state slot {slot} past the {} slots",
                state.len() / per_slot.max(1)
            )
        })?;
        let st = &mut state[slot * per_slot..(slot + 1) * per_slot];
        if s.kv_len == s.len {
            st.fill(0.0);
        }
        let rows = &mut qkv[s.start * c..(s.start + s.len) * c];
        conv_in_place(
            rows,
            s.len,
            c,
            conv_w,
            p.conv_kernel,
            &mut st[..p.conv_floats()],
        );
        dn::normalize_qk(p, s.len, rows);
    }
    // The gates of every row.
    let mut g = vec![0f32; n * hv];
    let mut b = vec![0f32; n * hv];
    for t in 0..n {
        let r = t * hv..(t + 1) * hv;
        dn::gates(
            &alpha[r.clone()],
            &beta[r.clone()],
            dt_bias,
            a,
            &mut g[r.clone()],
            &mut b[r],
        );
    }
    let tasks: Vec<(usize, usize)> = (0..batch.seqs.len())
        .flat_map(|s| (0..hv).map(move |h| (s, h)))
        .collect();
    let (op, sp) = (SyncPtr(out.as_mut_ptr()), SyncPtr(state.as_mut_ptr()));
    let mat = p.head_k * p.head_v;
    let qkv = &*qkv;
    par_rows(pool, tasks.len(), 1, |i0, i1| {
        let mut o = Vec::new();
        for &(si, h) in &tasks[i0..i1] {
            let s = &batch.seqs[si];
            let (gs, bs) = (&g[s.start * hv..], &b[s.start * hv..]);
            let inputs = dn::head_inputs(p, s.len, &qkv[s.start * c..], gs, bs, h);
            let slot = s.state_slot as usize;
            // SAFETY: head h's matrix of this sequence's slot is this task's alone (each
            // sequence has its own slot, each head its own matrix), inside `state` (checked).
            let m = unsafe { sp.slice(slot * per_slot + p.conv_floats() + h * mat, mat) };
            o.clear();
            o.resize(s.len * p.head_v, 0.0);
            dn::recurrent(m, &inputs, &mut o);
            for t in 0..s.len {
                // SAFETY: head h's columns of the sequence's rows are this task's alone.
                let row = unsafe { op.slice((s.start + t) * vd + h * p.head_v, p.head_v) };
                row.copy_from_slice(&o[t * p.head_v..(t + 1) * p.head_v]);
            }
        }
    });
    Ok(())
}

/// `Backend::sigmoid_mul`: x[r, c] *= σ(gate[r, c]), or σ(gate[r]) with `per_row`.
pub(crate) fn sigmoid_mul(
    x: &mut [f32],
    gate: &[f32],
    rows: usize,
    cols: usize,
    per_row: bool,
) -> Result<()> {
    let n = rows * cols;
    let gn = if per_row { rows } else { n };
    check("sigmoid_mul", x.len() >= n && gate.len() >= gn, || {
        format!("{rows}×{cols} elements")
    })?;
    if per_row {
        for (row, &g) in x[..n].chunks_exact_mut(cols.max(1)).zip(&gate[..rows]) {
            let s = dn::sigmoid(g);
            row.iter_mut().for_each(|v| *v *= s);
        }
    } else {
        for (v, &g) in x[..n].iter_mut().zip(&gate[..n]) {
            *v *= dn::sigmoid(g);
        }
    }
    Ok(())
}

/// [`dn::conv_silu`] in place over one sequence's `n` rows: outputs from the last row back, so
/// that each row is overwritten only after every output that reads it.
fn conv_in_place(x: &mut [f32], n: usize, c: usize, w: &[f32], k: usize, conv: &mut [f32]) {
    let hist = k - 1;
    // The state after these rows: the window's last k - 1 rows.
    let mut next = vec![0f32; hist * c];
    for r in 0..hist {
        let src = n + r; // row of the window (state rows first)
        let v = if src < hist {
            &conv[src * c..(src + 1) * c]
        } else {
            &x[(src - hist) * c..(src - hist + 1) * c]
        };
        next[r * c..(r + 1) * c].copy_from_slice(v);
    }
    for t in (0..n).rev() {
        for ch in 0..c {
            let mut s = 0.0f32;
            for i in 0..k {
                let r = t + i;
                let v = if r < hist {
                    conv[r * c + ch]
                } else {
                    x[(r - hist) * c + ch]
                };
                s += v * w[ch * k + i];
            }
            x[t * c + ch] = dn::silu(s);
        }
    }
    conv.copy_from_slice(&next);
}
