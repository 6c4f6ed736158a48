//! The gated delta net on the CPU: the convolution per sequence, then the delta rule one task
//! per (sequence, value head), each task the scalar recurrence of
//! [`quiver_backend::delta_net`] (so every token's floats are what it gets alone, whatever the
//! batch).

use crate::{check, par_rows, SyncPtr};
use quiver_backend::delta_net as dn;
use quiver_backend::{Batch, DeltaNetParams, Result, Snapshots};
use quiver_cpu_kernels::ThreadPool;

/// The op's host scratch, kept by the backend: it grows to the largest step and is reused
/// (no allocation per step once grown).
#[derive(Default)]
pub(crate) struct Scratch {
    g: Vec<f32>,
    b: Vec<f32>,
    conv: Vec<f32>,
    tasks: Vec<(usize, usize)>,
    /// One output row per task.
    rows: Vec<f32>,
    slots: Vec<u32>,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    pool: &ThreadPool,
    sc: &mut Scratch,
    batch: &Batch,
    p: &DeltaNetParams,
    conv_w: &[f32],
    dt_bias: &[f32],
    a: &[f32],
    qkv: &mut [f32],
    alpha: &[f32],
    beta: &[f32],
    state: &mut [f32],
    snaps: Option<Snapshots<'_, Vec<f32>>>,
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
    // Each sequence its own slot: two sharing one would race over it.
    sc.slots.clear();
    sc.slots.extend(batch.seqs.iter().map(|s| s.state_slot));
    sc.slots.sort_unstable();
    check(
        "delta_net",
        sc.slots.windows(2).all(|w| w[0] != w[1]),
        || "two sequences of the step name one state slot".into(),
    )?;
    sc.slots.clear();
    sc.slots.extend(batch.seqs.iter().map(|s| s.kept_slot));
    sc.slots.retain(|&k| k != quiver_backend::SeqSpan::NOT_KEPT);
    sc.slots.sort_unstable();
    check(
        "delta_net",
        sc.slots.windows(2).all(|w| w[0] != w[1]),
        || "two sequences of the step name one kept slot".into(),
    )?;
    let (snap, planes) = match snaps {
        Some(sn) => (sn.buf.as_mut_slice(), sn.planes),
        None => (&mut [][..], 0),
    };
    for s in &batch.seqs {
        let slot = s.state_slot as usize;
        check("delta_net", (slot + 1) * per_slot <= state.len(), || {
            format!(
                "state slot {slot} past the {} slots",
                state.len() / per_slot.max(1)
            )
        })?;
        let kept = s.kept_slot as usize;
        let keeps = s.kept_slot != quiver_backend::SeqSpan::NOT_KEPT && planes > 0;
        check(
            "delta_net",
            !keeps || (kept + 1) * planes * per_slot <= snap.len(),
            || format!("kept slot {kept}'s {planes} states past their buffer"),
        )?;
        let st = &mut state[slot * per_slot..(slot + 1) * per_slot];
        if s.kv_len == s.len {
            st.fill(0.0);
        }
        let rows = &mut qkv[s.start * c..(s.start + s.len) * c];
        // The convolution's state after each kept row: the window's k - 1 inputs after it
        // (the state's rows, then the span's), before the convolution overwrites them.
        let hist = p.conv_kernel - 1;
        for j in (0..planes).filter(|_| keeps) {
            let Some(r) = Snapshots::<Vec<f32>>::row_of(planes, s.len, j) else {
                continue;
            };
            let dst = &mut snap[(kept * planes + j) * per_slot..][..hist * c];
            for i in 0..hist {
                let w = r + 1 + i; // of the window: state rows, then the span's
                let src = if w < hist {
                    &st[w * c..(w + 1) * c]
                } else {
                    &rows[(w - hist) * c..(w - hist + 1) * c]
                };
                dst[i * c..(i + 1) * c].copy_from_slice(src);
            }
        }
        conv_in_place(
            pool,
            rows,
            s.len,
            c,
            conv_w,
            p.conv_kernel,
            &mut st[..p.conv_floats()],
            &mut sc.conv,
        );
        dn::normalize_qk(p, s.len, rows);
    }
    // The gates of every row.
    sc.g.clear();
    sc.g.resize(n * hv, 0.0);
    sc.b.clear();
    sc.b.resize(n * hv, 0.0);
    for t in 0..n {
        let r = t * hv..(t + 1) * hv;
        dn::gates(
            &alpha[r.clone()],
            &beta[r.clone()],
            dt_bias,
            a,
            &mut sc.g[r.clone()],
            &mut sc.b[r],
        );
    }
    sc.tasks.clear();
    sc.tasks
        .extend((0..batch.seqs.len()).flat_map(|s| (0..hv).map(move |h| (s, h))));
    sc.rows.clear();
    sc.rows.resize(sc.tasks.len() * p.head_v, 0.0);
    let (op, sp) = (SyncPtr(out.as_mut_ptr()), SyncPtr(state.as_mut_ptr()));
    let kp = SyncPtr(snap.as_mut_ptr());
    let rp = SyncPtr(sc.rows.as_mut_ptr());
    let mat = p.head_k * p.head_v;
    let qkv = &*qkv;
    let (g, b, tasks) = (&sc.g, &sc.b, &sc.tasks);
    par_rows(pool, tasks.len(), 1, |i0, i1| {
        for (i, &(si, h)) in tasks.iter().enumerate().take(i1).skip(i0) {
            let s = &batch.seqs[si];
            let (gs, bs) = (&g[s.start * hv..], &b[s.start * hv..]);
            let inputs = dn::head_inputs(p, s.len, &qkv[s.start * c..], gs, bs, h);
            let slot = s.state_slot as usize;
            // SAFETY: head h's matrix of this sequence's slot is this task's alone (each
            // sequence has its own slot (checked), each head its own matrix), inside `state`
            // (checked); row i of the scratch is this task's.
            let m = unsafe { sp.slice(slot * per_slot + p.conv_floats() + h * mat, mat) };
            let row = unsafe { rp.slice(i * p.head_v, p.head_v) };
            recurrent(m, &inputs, row, |t, o, m| {
                // SAFETY: head h's columns of the sequence's rows are this task's alone.
                let dst = unsafe { op.slice((s.start + t) * vd + h * p.head_v, p.head_v) };
                dst.copy_from_slice(o);
                let kept = s.kept_slot as usize;
                let plane = match s.kept_slot {
                    quiver_backend::SeqSpan::NOT_KEPT => None,
                    _ => Snapshots::<Vec<f32>>::plane_of(planes, s.len, t),
                };
                if let Some(j) = plane {
                    let at = (kept * planes + j) * per_slot + p.conv_floats() + h * mat;
                    // SAFETY: head h's matrix in this sequence's planes is this task's alone
                    // (each sequence its own kept slot, checked), inside `snap` (checked).
                    unsafe { kp.slice(at, mat) }.copy_from_slice(m);
                }
            });
        }
    });
    Ok(())
}

/// [`dn::recurrent_with`], on AVX-512 four rows of the matrix at a time ([`step_avx512`]).
fn recurrent(
    m: &mut [f32],
    h: &dn::HeadInputs,
    row: &mut [f32],
    mut emit: impl FnMut(usize, &[f32], &[f32]),
) {
    #[cfg(target_arch = "x86_64")]
    if quiver_cpu_kernels::SimdLevel::active() == quiver_cpu_kernels::SimdLevel::Avx512 {
        for t in 0..h.n {
            // SAFETY: the level's features were detected (`SimdLevel::detected` caps it).
            unsafe { step_avx512(m, h.q(t), h.k(t), h.v(t), h.g(t), h.beta(t), row) };
            emit(t, row, m);
        }
        return;
    }
    dn::recurrent_with(m, h, row, emit)
}

/// [`dn::step`] four rows at a time: each row's operations and their order as there (so its
/// bits: Rust neither fuses nor reorders float operations), the four rows' dependency chains
/// (the 16-lane sums, then the lanes in order) side by side for the core to overlap.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn step_avx512(
    m: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    let s = v.len();
    let decay = g.exp();
    let scale = 1.0 / (q.len() as f32).sqrt();
    let mut j = 0;
    for rows in m[..s * s].chunks_exact_mut(4 * s) {
        let (r01, r23) = rows.split_at_mut(2 * s);
        let (r0, r1) = r01.split_at_mut(s);
        let (r2, r3) = r23.split_at_mut(s);
        for r in [&mut *r0, &mut *r1, &mut *r2, &mut *r3] {
            for x in r.iter_mut() {
                *x *= decay;
            }
        }
        // SAFETY: the caller's.
        let dk = unsafe { dot4_avx512([&*r0, &*r1, &*r2, &*r3], k) };
        for (i, r) in [&mut *r0, &mut *r1, &mut *r2, &mut *r3]
            .into_iter()
            .enumerate()
        {
            let d = (v[j + i] - dk[i]) * beta;
            for (a, &b) in r.iter_mut().zip(k) {
                *a += d * b;
            }
        }
        // SAFETY: the caller's.
        let dq = unsafe { dot4_avx512([&*r0, &*r1, &*r2, &*r3], q) };
        for i in 0..4 {
            o[j + i] = dq[i] * scale;
        }
        j += 4;
    }
    for j in j..s {
        o[j] = dn::step_row(&mut m[j * s..(j + 1) * s], q, k, v[j], decay, beta, scale);
    }
}

/// [`dn::dot`] of four rows (as long as `b`) with `b`, each in its order: lane l of a row's
/// register sums its elements l, l + 16, … (a product, then a sum, each rounded), then the
/// lanes in order and the tail.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot4_avx512(rows: [&[f32]; 4], b: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let n16 = b.len() / 16 * 16;
    assert!(rows.iter().all(|r| r.len() == b.len()));
    let mut acc = [_mm512_setzero_ps(); 4];
    for c in (0..n16).step_by(16) {
        // SAFETY: c + 16 ≤ n16 ≤ every row's length and b's (asserted).
        unsafe {
            let y = _mm512_loadu_ps(b.as_ptr().add(c));
            for (a, r) in acc.iter_mut().zip(&rows) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_loadu_ps(r.as_ptr().add(c)), y));
            }
        }
    }
    let mut out = [0f32; 4];
    for ((o, a), r) in out.iter_mut().zip(acc).zip(rows) {
        let mut lanes = [0f32; 16];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
        let mut sum = lanes.iter().sum::<f32>();
        for (x, y) in r[n16..].iter().zip(&b[n16..]) {
            sum += x * y;
        }
        *o = sum;
    }
    out
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
/// that each row is overwritten only after every output that reads it; channels split over
/// the pool (each channel's outputs read that channel alone).
#[allow(clippy::too_many_arguments)]
fn conv_in_place(
    pool: &ThreadPool,
    x: &mut [f32],
    n: usize,
    c: usize,
    w: &[f32],
    k: usize,
    conv: &mut [f32],
    next: &mut Vec<f32>,
) {
    let hist = k - 1;
    // The state after these rows: the window's last k - 1 rows.
    next.clear();
    next.resize(hist * c, 0.0);
    for r in 0..hist {
        let src = n + r; // row of the window (state rows first)
        let v = if src < hist {
            &conv[src * c..(src + 1) * c]
        } else {
            &x[(src - hist) * c..(src - hist + 1) * c]
        };
        next[r * c..(r + 1) * c].copy_from_slice(v);
    }
    let xp = SyncPtr(x.as_mut_ptr());
    let conv_r = &*conv;
    par_rows(pool, c, 256, |c0, c1| {
        for t in (0..n).rev() {
            for ch in c0..c1 {
                let mut s = 0.0f32;
                for i in 0..k {
                    let r = t + i;
                    let v = if r < hist {
                        conv_r[r * c + ch]
                    } else {
                        // SAFETY: channel ch of any row is this task's alone, inside `x`.
                        unsafe { *xp.at((r - hist) * c + ch) }
                    };
                    s += v * w[ch * k + i];
                }
                // SAFETY: as above.
                unsafe { *xp.at(t * c + ch) = dn::silu(s) };
            }
        }
    });
    conv.copy_from_slice(next);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 step gives the reference's bits over a few tokens, at head widths with and
    /// without remainders (rows past a multiple of 4, columns past a multiple of 16).
    #[test]
    fn avx512_step_is_the_reference_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if quiver_cpu_kernels::SimdLevel::detected() == quiver_cpu_kernels::SimdLevel::Avx512 {
            let mut rng = quiver_backend::testing::Rng(0x2545_f491_4f6c_dd1d);
            for s in [128usize, 42, 7] {
                let mut m = rng.vec(s * s);
                let mut want = m.clone();
                for _ in 0..3 {
                    let (q, k, v) = (rng.vec(s), rng.vec(s), rng.vec(s));
                    let (g, beta) = (-0.3 * rng.f().abs(), 0.5 + 0.4 * rng.f());
                    let (mut o, mut o_want) = (vec![0f32; s], vec![0f32; s]);
                    // SAFETY: AVX-512F detected above.
                    unsafe { step_avx512(&mut m, &q, &k, &v, g, beta, &mut o) };
                    dn::step(&mut want, &q, &k, &v, g, beta, &mut o_want);
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&o), bits(&o_want), "outputs, s = {s}");
                    assert_eq!(bits(&m), bits(&want), "matrix, s = {s}");
                }
            }
            return;
        }
        println!("skipped: no AVX-512 here");
    }
}
