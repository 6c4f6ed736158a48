//! DeepSeek-V4's ops ([`crate::ExtraOp::Dsv4`]) against the scalar references of
//! [`crate::dsv4`] on random inputs: the hyper-connections (pre with its Sinkhorn weights,
//! post, expand, the head), the grouped product (Q8_0 weights), the clamped SwiGLU, the MoE
//! with sqrt-softplus routing plus a bias and with hash routing, and the attention over the
//! per-sequence state: three sequences (ratios 0, 4 with the indexer's top-k, and 128) each
//! alone in one step against the same sequences interleaved in one batch over several steps
//! of other chunkings, in other slots — every output the same, and a slot no sequence names
//! left as it was.

use super::{bits_differ, poison, read, rel_err, tensor, vector, Harness, Notes, Rng, WeightCase};
use crate::dsv4::{self as ds, AttnInputs, AttnShape, AttnWeights, HcParams};
use crate::{
    Activation, Backend, Batch, Gating, MoeParams, MoeScratch, MoeWeights, RopeMode, RopeParams,
    SeqSpan,
};
use quiver_gguf::GgmlType;

pub fn dsv4<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = elementwise(be, h, rng);
    let bound = h.delta_net_bound(be);
    products(be, h, rng, &mut notes);
    moe(be, h, rng, &mut notes);
    for ratio in [0, 4, 128] {
        attention(be, h, rng, ratio, bound, &mut notes);
    }
    notes
}

/// The element-wise ops alone: the hyper-connections (pre with its Sinkhorn weights, post,
/// expand, the head) and the clamped SwiGLU.
fn elementwise<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    let bound = h.delta_net_bound(be);
    hyper_connections(be, h, rng, bound, &mut notes);
    swiglu(be, h, rng, &mut notes);
    notes
}

fn hyper_connections<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    bound: f64,
    notes: &mut Notes,
) {
    // Four streams (DeepSeek-V4's) and eight (comb elements past a warp's lanes), rows of one
    // block's columns and of several.
    for (hc, d) in [(4, 48), (8, 1100)] {
        let p = HcParams {
            hc,
            d,
            eps: 1e-6,
            iters: 20,
        };
        hc_case(be, h, rng, bound, notes, &p);
    }
}

/// `hc_mixes` (the block's mixes and the head's) against `rms_norm_plain` then the product in
/// the reference, and each row's bits alone against among the others.
#[allow(clippy::too_many_arguments)]
fn hc_mixes_case<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    bound: f64,
    notes: &mut Notes,
    p: &HcParams,
    x: &[f32],
    rows: usize,
) {
    let hcd = p.hc * p.d;
    for md in [p.mix_dim(), p.hc] {
        let wv = rng.vec(md * hcd);
        let w = f32_matrix(be, md, hcd, &wv);
        let mut normed = vec![0f32; rows * hcd];
        for (o, r) in normed.chunks_exact_mut(hcd).zip(x.chunks_exact(hcd)) {
            crate::reference::rms_norm_plain(r, hcd, p.eps, o);
        }
        let mut want = vec![0f32; rows * md];
        crate::reference::matmul(&wv, md, hcd, &normed, rows, &mut want);
        let mut got = Vec::new();
        for n in [rows, 1] {
            let mut scratch = poison(be, h, n * hcd);
            let mut out = poison(be, h, n * md);
            be.hc_mixes(
                &h.upload(be, &x[..n * hcd]),
                &w,
                hcd,
                p.eps,
                n,
                &mut scratch,
                &mut out,
            )
            .unwrap();
            got.push(read(be, &out, n * md));
        }
        notes.check("hc_mixes", rel_err(&got[0], &want), bound, || {
            format!("{md} mixes of {} streams", p.hc)
        });
        assert_eq!(
            bits_differ(&got[0][..md], &got[1]),
            0,
            "hc_mixes: a row's mixes alone differ from the same row among {rows}"
        );
    }
}

/// An F32 matrix of `rows` × `cols` values on `be`.
fn f32_matrix<B: Backend>(be: &B, rows: usize, cols: usize, values: &[f32]) -> B::Weight {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [rows as u64, cols as u64];
    be.weight(
        "w",
        GgmlType::F32,
        &shape,
        tensor(GgmlType::F32, &shape, &bytes),
    )
    .expect("an f32 matrix")
}

/// `hc_mix_pre` (which a backend may fuse) gives `hc_mixes` then `hc_pre`'s bits, for a
/// block (pre, post and comb) and for the head (pre).
fn hc_mix_pre_case<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    p: &HcParams,
    x: &[f32],
    rows: usize,
) {
    let hcd = p.hc * p.d;
    let xb = h.upload(be, x);
    for head in [false, true] {
        let md = if head { p.hc } else { p.mix_dim() };
        let wv = rng.vec(md * hcd);
        let w = f32_matrix(be, md, hcd, &wv);
        let scale = vector(be, &rng.vec(if head { 1 } else { 3 }));
        let base = vector(be, &rng.vec(md));
        let mut got = Vec::new();
        for fused in [false, true] {
            let mut scratch = poison(be, h, rows * hcd);
            let mut mixes = poison(be, h, rows * md);
            let mut out = poison(be, h, rows * p.d);
            let mut pc = poison(be, h, rows * p.pc_dim());
            if fused {
                be.hc_mix_pre(
                    &xb,
                    &w,
                    p.eps,
                    &scale,
                    &base,
                    p,
                    head,
                    rows,
                    &mut scratch,
                    &mut mixes,
                    &mut out,
                    &mut pc,
                )
                .unwrap();
            } else {
                be.hc_mixes(&xb, &w, hcd, p.eps, rows, &mut scratch, &mut mixes)
                    .unwrap();
                be.hc_pre(&xb, &mixes, &scale, &base, p, head, rows, &mut out, &mut pc)
                    .unwrap();
            }
            let pc = if head {
                vec![]
            } else {
                read(be, &pc, rows * p.pc_dim())
            };
            got.push((read(be, &out, rows * p.d), pc));
        }
        assert_eq!(
            bits_differ(&got[0].0, &got[1].0),
            0,
            "hc_mix_pre's input, head {head}"
        );
        assert_eq!(
            bits_differ(&got[0].1, &got[1].1),
            0,
            "hc_mix_pre's weights, head {head}"
        );
    }
}

fn hc_case<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    rng: &mut Rng,
    bound: f64,
    notes: &mut Notes,
    p: &HcParams,
) {
    let p = *p;
    let rows = 5;
    let hcd = p.hc * p.d;
    let x = rng.vec(rows * hcd);
    hc_mixes_case(be, h, rng, bound, notes, &p, &x, rows);
    hc_mix_pre_case(be, h, rng, &p, &x, rows);
    for head in [false, true] {
        let md = if head { p.hc } else { p.mix_dim() };
        let mixes = rng.scaled(rows * md, 3.0);
        let scale = rng.vec(if head { 1 } else { 3 });
        let base = rng.vec(md);
        let mut out = poison(be, h, rows * p.d);
        let mut pc = poison(be, h, rows * p.pc_dim());
        be.hc_pre(
            &h.upload(be, &x),
            &h.upload(be, &mixes),
            &vector(be, &scale),
            &vector(be, &base),
            &p,
            head,
            rows,
            &mut out,
            &mut pc,
        )
        .unwrap();
        let mut want = vec![0f32; rows * p.d];
        let mut want_pc = vec![0f32; rows * p.pc_dim()];
        ds::hc_pre(
            &x,
            &mixes,
            &scale,
            &base,
            &p,
            head,
            rows,
            &mut want,
            &mut want_pc,
        );
        let got = read(be, &out, rows * p.d);
        notes.check("hc_pre", rel_err(&got, &want), bound, || {
            format!("head {head}")
        });
        if head {
            continue;
        }
        let got_pc = read(be, &pc, rows * p.pc_dim());
        notes.check("hc_pre weights", rel_err(&got_pc, &want_pc), bound, || {
            "post and comb".into()
        });
        // The comb weights are doubly stochastic after 20 Sinkhorn rounds: the columns (the
        // last normalisation) to 1e-3, the rows to 1e-2 (some random mixes converge that
        // slowly: seed 1796481540548801645 leaves a row at 0.99878).
        for t in 0..rows {
            let c = &got_pc[t * p.pc_dim() + p.hc..][..p.hc * p.hc];
            for i in 0..p.hc {
                let row: f32 = (0..p.hc).map(|j| c[i * p.hc + j]).sum();
                let col: f32 = (0..p.hc).map(|j| c[j * p.hc + i]).sum();
                assert!(
                    (row - 1.0).abs() < 1e-2 && (col - 1.0).abs() < 1e-3,
                    "{row} {col}"
                );
            }
        }
        let y = rng.vec(rows * p.d);
        let mut post = poison(be, h, rows * hcd);
        be.hc_post(
            &h.upload(be, &y),
            &h.upload(be, &x),
            &pc,
            &p,
            rows,
            &mut post,
        )
        .unwrap();
        let mut want_post = vec![0f32; rows * hcd];
        ds::hc_post(&y, &x, &want_pc, &p, rows, &mut want_post);
        notes.check(
            "hc_post",
            rel_err(&read(be, &post, rows * hcd), &want_post),
            bound,
            || "post".into(),
        );
        let mut ex = poison(be, h, rows * hcd);
        be.hc_expand(&h.upload(be, &y), &p, rows, &mut ex).unwrap();
        let want_ex: Vec<f32> = (0..rows * hcd)
            .map(|i| y[(i / hcd) * p.d + i % p.d])
            .collect();
        notes.check(
            "hc_expand",
            rel_err(&read(be, &ex, rows * hcd), &want_ex),
            0.0,
            || "copies".into(),
        );
    }
}

fn products<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng, notes: &mut Notes) {
    let (groups, r, c, rows) = (4, 16, 64, 3);
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let ws: Vec<WeightCase> = (0..groups)
            .map(|_| WeightCase::random(rng, ty, r, c).expect("a quantizer"))
            .collect();
        let x = rng.vec(rows * groups * c);
        let mut out = poison(be, h, rows * groups * r);
        let loaded: Vec<B::Weight> = ws.iter().map(|w| w.load(be).unwrap()).collect();
        let mut scratch = be
            .buf(ds::grouped_scratch_floats(rows, groups, c, r))
            .unwrap();
        be.matmul_grouped(&loaded, &h.upload(be, &x), rows, &mut out, &mut scratch)
            .unwrap();
        let mut want = vec![0f32; rows * groups * r];
        let seen = h.as_seen(be, ty, rows * groups, &x);
        let values: Vec<f32> = ws.iter().flat_map(|w| w.values.iter().copied()).collect();
        ds::matmul_grouped(&values, groups, &seen, rows, &mut want);
        let got = read(be, &out, rows * groups * r);
        notes.check(
            "matmul_grouped",
            rel_err(&got, &want),
            h.product_bound(be, ty, c, rows),
            || format!("{ty:?}"),
        );
        // The first row alone: the same bits.
        let mut one = poison(be, h, groups * r);
        be.matmul_grouped(
            &loaded,
            &h.upload(be, &x[..groups * c]),
            1,
            &mut one,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(
            bits_differ(&read(be, &one, groups * r), &got[..groups * r]),
            0,
            "matmul_grouped {ty:?}: a row alone differs from the same row among {rows}"
        );
    }
}

fn swiglu<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng, notes: &mut Notes) {
    let n = 300;
    let (g, u) = (rng.scaled(n, 20.0), rng.scaled(n, 20.0));
    let mut out = poison(be, h, n);
    be.swiglu_clamp(&h.upload(be, &g), &h.upload(be, &u), 7.0, n, &mut out)
        .unwrap();
    let mut want = vec![0f32; n];
    ds::swiglu_clamp(&g, &u, 7.0, &mut want);
    notes.check(
        "swiglu_clamp",
        rel_err(&read(be, &out, n), &want),
        1e-6,
        || "limit 7".into(),
    );
}

fn moe<B: Backend, H: Harness<B>>(be: &mut B, h: &H, rng: &mut Rng, notes: &mut Notes) {
    let (ne, used, ff, d, rows, vocab) = (6, 2, 32, 64, 7, 10);
    let p = MoeParams {
        n_expert: ne,
        n_used: used,
        n_ff: ff,
        gating: Gating::Softmax,
        norm: true,
        scale: 1.5,
        act: Activation::SwiGlu,
        router_given: false,
        held: (0, ne),
    };
    let f32w =
        |rng: &mut Rng, r: usize, c: usize| WeightCase::random(rng, GgmlType::F32, r, c).unwrap();
    let (router, gate, up, down) = (
        f32w(rng, ne, d),
        f32w(rng, ne * ff, d),
        f32w(rng, ne * ff, d),
        f32w(rng, ne * d, ff),
    );
    let bias = rng.vec(ne);
    let hash: Vec<f32> = (0..vocab * used).map(|_| rng.below(ne) as f32).collect();
    let hash_buf = h.upload(&*be, &hash);
    let x = rng.scaled(rows * d, 2.0);
    let tokens: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
    let batch = Batch {
        tokens: tokens.clone(),
        positions: (0..rows as u32).collect(),
        slots: (0..rows as u32).collect(),
        seq_of: vec![0; rows],
        seqs: vec![SeqSpan {
            start: 0,
            len: rows,
            kv_len: rows,
            block_table: vec![0],
            ..Default::default()
        }],
        logits: Vec::new(),
        block_size: crate::KV_BLOCK_SIZE,
    };
    let ws = [&router, &gate, &up, &down].map(|w| w.load(&*be).unwrap());
    let bw = vector(&*be, &bias);
    for (hashed, clamp) in [(false, 0.0), (false, 1.5), (true, 1.5)] {
        let sizes = p.scratch_floats(rows, d);
        let mut sc: Vec<B::Buf> = sizes.iter().map(|&n| be.buf(n).unwrap()).collect();
        let [lg, rt, xs, g, u, a, ys] = &mut sc[..] else {
            unreachable!()
        };
        let mut out = poison(be, h, rows * d);
        let st = be.begin_step(&batch, 0, 64, 64).unwrap();
        be.moe_dsv4(
            &st,
            &h.upload(be, &x),
            MoeWeights {
                router: &ws[0],
                gate: &ws[1],
                up: &ws[2],
                down: &ws[3],
                down_scale: None,
                gate_scale: None,
                up_scale: None,
            },
            &p,
            (!hashed).then_some(&bw),
            hashed.then_some(&hash_buf),
            clamp,
            MoeScratch {
                logits: lg,
                routes: rt,
                xs,
                gate: g,
                up: u,
                act: a,
                ys,
            },
            &mut out,
        )
        .unwrap();
        assert!(be.end_step(true).unwrap());
        // The reference: route, then each chosen expert's clamped SwiGLU FFN.
        let route = ds::MoeRoute {
            bias: (!hashed).then_some(&bias[..]),
            hash: hashed.then_some(&hash[..]),
            n_used: used,
            norm: true,
            scale: 1.5,
        };
        let mut want = vec![0f32; rows * d];
        let mut r = Vec::new();
        let mv = |w: &[f32], rows_w: usize, cols: usize, x: &[f32]| -> Vec<f32> {
            (0..rows_w)
                .map(|i| (0..cols).map(|j| w[i * cols + j] * x[j]).sum())
                .collect()
        };
        for t in 0..rows {
            let xt = &x[t * d..][..d];
            let logits = mv(&router.values, ne, d, xt);
            ds::moe_route(&logits, tokens[t], &route, &mut r);
            for &(e, wt) in &r {
                let e = e as usize;
                let gv = mv(&gate.values[e * ff * d..][..ff * d], ff, d, xt);
                let uv = mv(&up.values[e * ff * d..][..ff * d], ff, d, xt);
                let mut act = vec![0f32; ff];
                if clamp > 0.0 {
                    ds::swiglu_clamp(&gv, &uv, clamp, &mut act);
                } else {
                    crate::reference::glu(Activation::SwiGlu, &gv, &uv, &mut act);
                }
                let y = mv(&down.values[e * d * ff..][..d * ff], d, ff, &act);
                for c in 0..d {
                    want[t * d + c] += wt * y[c];
                }
            }
        }
        notes.check(
            "moe_dsv4",
            rel_err(&read(be, &out, rows * d), &want),
            h.moe_bound(be, GgmlType::F32, rows),
            || format!("hash {hashed}, clamp {clamp}"),
        );
    }
}

/// Per-token inputs of one sequence, [len, width] each.
struct SeqInputs {
    parts: Vec<Vec<f32>>,
}

fn attention<B: Backend, H: Harness<B>>(
    be: &mut B,
    h: &H,
    rng: &mut Rng,
    ratio: usize,
    bound: f64,
    notes: &mut Notes,
) {
    let rope = |base| RopeParams::plain(RopeMode::Normal, 16, base);
    let s = AttnShape {
        n_head: 4,
        head_dim: 32,
        n_rot: 16,
        n_swa: 8,
        spare: 0,
        ratio,
        rope: rope(if ratio == 0 { 10000.0 } else { 160000.0 }),
        comp_rope: rope(160000.0),
        rms_eps: 1e-6,
        ix_heads: 2,
        ix_dim: 32,
        ix_top_k: 3,
        n_ctx: 160,
    };
    let (hd, cw, id) = (s.head_dim, s.comp_width(), s.ix_dim);
    // Widths of q, kv, comp kv, comp score, indexer q, w, kv, score.
    let widths = [s.n_head * hd, hd, cw, cw, 2 * id, 2, 2 * id, 2 * id];
    // Three sequences: (length, slot alone, slot together).
    let seqs = [(150usize, 0usize, 3usize), (23, 1, 0), (9, 2, 1)];
    let mut inputs: Vec<SeqInputs> = seqs
        .iter()
        .map(|&(len, _, _)| SeqInputs {
            parts: widths.iter().map(|&w| rng.scaled(len * w, 2.0)).collect(),
        })
        .collect();
    // A fourth: the first sequence's rows up to position 44, other rows after (rejected
    // proposals' rows).
    let wrong = SeqInputs {
        parts: widths
            .iter()
            .enumerate()
            .map(|(k, &w)| {
                let mut v = inputs[0].parts[k].clone();
                let other = rng.scaled(v.len() - 44 * w, 2.0);
                v[44 * w..].copy_from_slice(&other);
                v
            })
            .collect(),
    };
    inputs.push(wrong);
    let sinks = rng.vec(s.n_head);
    let ape = rng.vec(ratio * cw);
    let norm: Vec<f32> = rng.vec(hd).iter().map(|v| 1.0 + 0.3 * v).collect();
    let ix_ape = rng.vec(4 * 2 * id);
    let ix_norm: Vec<f32> = rng.vec(id).iter().map(|v| 1.0 + 0.3 * v).collect();
    let wv = |v: &[f32]| (!v.is_empty()).then(|| vector(&*be, v));
    let (w_sinks, w_ape, w_norm) = (vector(&*be, &sinks), wv(&ape), wv(&norm));
    let (w_ix_ape, w_ix_norm) = if ratio == 4 {
        (wv(&ix_ape), wv(&ix_norm))
    } else {
        (None, None)
    };
    let sf = s.state_floats();
    let n_slots = 5;
    let state0 = rng.scaled(n_slots * sf, 9.0);
    let width = s.n_head * hd;
    // One step over `spans` (sequence, first token, tokens, slot): the outputs per span.
    // A step's batch and inputs over `spans` (sequence, first token, tokens, slot).
    let make = |spans: &[(usize, usize, usize, usize)]| -> (Batch, Vec<Vec<f32>>) {
        let mut batch = Batch {
            block_size: crate::KV_BLOCK_SIZE,
            ..Default::default()
        };
        let mut parts: Vec<Vec<f32>> = widths.iter().map(|_| Vec::new()).collect();
        for (si, &(q, first, len, slot)) in spans.iter().enumerate() {
            batch.seqs.push(SeqSpan {
                start: batch.tokens.len(),
                len,
                kv_len: first + len,
                block_table: vec![0; 16],
                state_slot: slot as u32,
                ..Default::default()
            });
            for t in first..first + len {
                batch.tokens.push(0);
                batch.positions.push(t as u32);
                batch.slots.push(0);
                batch.seq_of.push(si as u32);
            }
            for (k, &w) in widths.iter().enumerate() {
                parts[k].extend_from_slice(&inputs[q].parts[k][first * w..(first + len) * w]);
            }
        }
        (batch, parts)
    };
    let run_kept = |be: &mut B,
                    state: &mut B::Buf,
                    kept: Option<&mut B::Buf>,
                    spans: &[(usize, usize, usize, usize)]|
     -> Vec<Vec<f32>> {
        let (mut batch, parts) = make(spans);
        if kept.is_some() {
            // Kept slots apart from the state slots: 1, 2, …
            for (i, q) in batch.seqs.iter_mut().enumerate() {
                q.kept_slot = 1 + i as u32;
            }
        }
        let n = batch.tokens.len();
        let bufs: Vec<B::Buf> = parts.iter().map(|p| h.upload(&*be, p)).collect();
        let mut out = poison(&*be, h, n * width);
        let mut scratch = be.buf(ds::attention_scratch_floats(&s, n)).unwrap();
        let st = be.begin_step(&batch, 0, 256, 256).unwrap();
        let c = ratio > 0;
        let i = ratio == 4;
        be.dsv4_attention(
            &st,
            &s,
            AttnWeights {
                sinks: &w_sinks,
                ape: w_ape.as_ref().filter(|_| c),
                norm: w_norm.as_ref().filter(|_| c),
                ix_ape: w_ix_ape.as_ref(),
                ix_norm: w_ix_norm.as_ref(),
            },
            AttnInputs {
                q: &bufs[0],
                kv: &bufs[1],
                comp_kv: c.then_some(&bufs[2]),
                comp_score: c.then_some(&bufs[3]),
                ix_q: i.then_some(&bufs[4]),
                ix_w: i.then_some(&bufs[5]),
                ix_kv: i.then_some(&bufs[6]),
                ix_score: i.then_some(&bufs[7]),
            },
            state,
            kept.map(|buf| crate::Snapshots { buf, planes: KEPT }),
            &mut scratch,
            &mut out,
        )
        .unwrap();
        assert!(be.end_step(true).unwrap());
        let got = read(&*be, &out, n * width);
        let mut at = 0;
        spans
            .iter()
            .map(|&(_, _, len, _)| {
                at += len;
                got[(at - len) * width..at * width].to_vec()
            })
            .collect()
    };
    let run = |be: &mut B, state: &mut B::Buf, spans: &[(usize, usize, usize, usize)]| {
        run_kept(be, state, None, spans)
    };
    // Each sequence alone, in one step.
    let mut state = h.upload(be, &state0);
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .enumerate()
        .map(|(q, &(len, slot, _))| run(be, &mut state, &[(q, 0, len, slot)]).remove(0))
        .collect();
    // The scalar reference, each sequence alone.
    let host = ds::AttnHost {
        sinks: &sinks,
        ape: if ratio > 0 { &ape } else { &[] },
        norm: if ratio > 0 { &norm } else { &[] },
        ix_ape: if ratio == 4 { &ix_ape } else { &[] },
        ix_norm: if ratio == 4 { &ix_norm } else { &[] },
    };
    for (q, &(len, slot, _)) in seqs.iter().enumerate() {
        let (batch, parts) = make(&[(q, 0, len, slot)]);
        let (c, i) = (ratio > 0, ratio == 4);
        let x = AttnInputs {
            q: &parts[0][..],
            kv: &parts[1][..],
            comp_kv: c.then_some(&parts[2][..]),
            comp_score: c.then_some(&parts[3][..]),
            ix_q: i.then_some(&parts[4][..]),
            ix_w: i.then_some(&parts[5][..]),
            ix_kv: i.then_some(&parts[6][..]),
            ix_score: i.then_some(&parts[7][..]),
        };
        let mut st = state0.clone();
        let mut want = vec![0f32; len * width];
        ds::attention(&batch, &s, &host, &x, &mut st, None, &mut want).unwrap();
        notes.check(
            "dsv4_attention",
            rel_err(&alone[q], &want),
            h.dsv4_attention_bound(be),
            || format!("ratio {ratio}, sequence {q} alone against the reference"),
        );
    }
    // Together, in other slots, over steps of other chunkings (prompt pieces and decodes).
    let mut state = h.upload(be, &state0);
    let mut got: Vec<Vec<f32>> = seqs.iter().map(|_| Vec::new()).collect();
    let mut next = [0usize; 3];
    let chunks = [[40, 5, 1], [70, 1, 3], [1, 17, 1], [39, 0, 4]];
    for step in chunks {
        let spans: Vec<(usize, usize, usize, usize)> = (0..3)
            .filter(|&q| step[q] > 0 && next[q] < seqs[q].0)
            .map(|q| (q, next[q], step[q].min(seqs[q].0 - next[q]), seqs[q].2))
            .collect();
        for (o, &(q, _, len, _)) in run(be, &mut state, &spans).into_iter().zip(&spans) {
            got[q].extend_from_slice(&o);
            next[q] += len;
        }
    }
    assert_eq!(next, [150, 23, 9], "the chunking covers every token");
    for q in 0..3 {
        notes.check("dsv4_attention", rel_err(&got[q], &alone[q]), bound, || {
            format!("ratio {ratio}, sequence {q} in steps against alone")
        });
        assert!(
            got[q].iter().all(|v| v.is_finite()),
            "ratio {ratio}: not finite"
        );
    }
    let st = read(be, &state, n_slots * sf);
    assert_eq!(
        st[2 * sf..3 * sf],
        state0[2 * sf..3 * sf],
        "ratio {ratio}: a slot no sequence names changed"
    );
    // A rollback (speculative decoding): the first sequence to position 40 in slot 4, a step
    // of 12 rows keeping what they overwrite (the rings wrap: 8 rows) of which the last 8 are
    // wrong, undone back to position 44, then on with the right rows: what it gets alone.
    let mut state = h.upload(be, &state0);
    let mut kept = h.upload(be, &vec![0f32; n_slots * KEPT * ds::kept_floats(&s)]);
    run(be, &mut state, &[(0, 0, 40, 4)]);
    run_kept(be, &mut state, Some(&mut kept), &[(3, 40, 12, 4)]);
    be.dsv4_rewind(&s, &mut state, &kept, KEPT, 4, 1, 40, 12, 3)
        .unwrap();
    let after = run(be, &mut state, &[(0, 44, 30, 4)]).remove(0);
    notes.check(
        "dsv4_attention rollback",
        rel_err(&after, &alone[0][44 * width..74 * width]),
        bound,
        || format!("ratio {ratio}: positions 44..74 after undoing 44..52"),
    );
}

/// Rows a slot keeps for a rollback in the attention test.
const KEPT: usize = 12;
