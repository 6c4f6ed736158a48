//! The mixture-of-experts op and the product bias against the scalar reference: random stacked
//! experts of several weight types, 1 to 64 tokens, softmax and sigmoid gating, with and
//! without normalised weights. Each token's chosen experts (read back from the scratch, in any
//! slot order) must be the reference's unless the k-th and (k+1)-th logits are within rounding; the
//! outputs of those tokens must be within the bound (`Harness::moe_bound`).

use super::{poison, read, rel_err, vector, Harness, Notes, Rng, WeightCase};
use crate::{reference, Activation, Backend, Gating, MoeParams, MoeScratch, MoeWeights};
use quiver_gguf::GgmlType;

/// Expert weight types checked (one of each family: dense, 32-blocks, K-quants).
pub const MOE_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];
/// Token counts: decode, a few, a prompt.
pub const MOE_TOKENS: &[usize] = &[1, 3, 17, 64];

pub fn moe<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng) -> Notes {
    let mut notes = Notes::default();
    let (d, ff, ne) = (256usize, 256usize, 16usize);
    for &ty in MOE_TYPES {
        // The last case has gate and up in one tensor, 2·n_ff rows per expert (Qwen 3.5 MoE).
        for (gating, norm, k, act, fused) in [
            (Gating::Softmax, true, 4, Activation::SwiGlu, false),
            (Gating::Sigmoid, false, 2, Activation::GeGlu, false),
            (Gating::Softmax, true, 4, Activation::SwiGlu, true),
        ] {
            let p = MoeParams {
                n_expert: ne,
                n_used: k,
                n_ff: ff,
                gating,
                norm,
                scale: if norm { 1.0 } else { 2.5 },
                act,
                router_given: false,
                held: (0, ne),
            };
            // The router in f32 with well-separated logits, so that rounding does not reorder
            // the experts.
            let router = WeightCase::random(rng, GgmlType::F32, ne, d).unwrap();
            let (Some(gate), Some(up), Some(down)) = (
                WeightCase::random(rng, ty, ne * ff, d),
                WeightCase::random(rng, ty, ne * ff, d),
                WeightCase::random(rng, ty, ne * d, ff),
            ) else {
                notes.skip(format!("no quantizer for {ty}"));
                continue;
            };
            let load = |w: &WeightCase, shape: &[u64]| {
                be.weight("w", w.ty, shape, super::tensor(w.ty, shape, &w.bytes))
            };
            let (ne64, ff64, d64) = (ne as u64, ff as u64, d as u64);
            let (gate_up, up_load) = if fused {
                // Expert e's gate rows, then its up rows.
                let per = gate.bytes.len() / ne;
                let both: Vec<u8> = (0..ne)
                    .flat_map(|e| [&gate.bytes[e * per..][..per], &up.bytes[e * per..][..per]])
                    .flatten()
                    .copied()
                    .collect();
                let shape = [ne64, 2 * ff64, d64];
                let w = be.weight("w", ty, &shape, super::tensor(ty, &shape, &both));
                (w, None)
            } else {
                (
                    load(&gate, &[ne64, ff64, d64]),
                    Some(load(&up, &[ne64, ff64, d64])),
                )
            };
            let loaded = (
                load(&router, &[ne64, d64]),
                gate_up,
                up_load.transpose(),
                load(&down, &[ne64, d64, ff64]),
            );
            let (Ok(rw), Ok(gw), Ok(uw), Ok(dw)) = loaded else {
                notes.skip(format!("{}: no {ty} experts", be.name()));
                continue;
            };
            let uw = uw.as_ref().unwrap_or(&gw);
            for &n in MOE_TOKENS {
                let x = rng.scaled(n * d, 0.5);
                let w = MoeWeights {
                    router: &rw,
                    gate: &gw,
                    up: uw,
                    down: &dw,
                    down_scale: None,
                    gate_scale: None,
                    up_scale: None,
                };
                let (got, routes) = run_moe(be, h, w, &p, &x, n, d);
                let mut want = vec![0f32; n * d];
                reference::moe(
                    &x,
                    &x,
                    n,
                    d,
                    [&router.values, &gate.values, &up.values, &down.values],
                    None,
                    &p,
                    &mut want,
                );
                // Tokens routed to the reference's experts (in any slot order), unless the
                // k-th and (k+1)-th logits are within the router product's rounding (products
                // of 17+ tokens take the activations in f16: logits move by ~1e-3).
                let mut logits = vec![0f32; ne];
                let mut r = Vec::new();
                let (mut same, mut g_same, mut w_same) = (0, Vec::new(), Vec::new());
                for t in 0..n {
                    reference::matmul(&router.values, ne, d, &x[t * d..][..d], 1, &mut logits);
                    reference::moe_route(&logits, &p, &mut r);
                    let slot = |j: usize| (routes[2 * (t * k + j)], routes[2 * (t * k + j) + 1]);
                    let of = |e: u32| (0..k).map(slot).find(|&(id, _)| id == e as f32);
                    let ids_match = r.iter().all(|&(e, _)| of(e).is_some());
                    let mut sorted = logits.clone();
                    sorted.sort_by(|a, b| b.total_cmp(a));
                    let near_tie = sorted[k - 1] - sorted[k] < 1e-2;
                    assert!(
                        ids_match || near_tie,
                        "moe {ty} {gating:?} n={n}: token {t} routed to {:?}, reference {r:?}",
                        (0..k).map(|j| slot(j).0).collect::<Vec<_>>()
                    );
                    if ids_match {
                        same += 1;
                        for &(e, wt) in &r {
                            let (_, gw) = of(e).expect("ids_match found every expert");
                            assert!(
                                (gw - wt).abs() <= 2e-3 * (1.0 + wt.abs()),
                                "moe {ty} {gating:?}: token {t} expert {e} weight {gw} vs {wt}"
                            );
                        }
                        g_same.extend_from_slice(&got[t * d..][..d]);
                        w_same.extend_from_slice(&want[t * d..][..d]);
                    }
                }
                assert!(
                    same * 10 >= n * 9,
                    "moe {ty}: only {same}/{n} tokens routed alike"
                );
                let e = rel_err(&g_same, &w_same);
                notes.check("moe", e, h.moe_bound(be, ty, n), || {
                    let form = if fused {
                        ", gate and up in one tensor"
                    } else {
                        ""
                    };
                    format!("{ty}, {gating:?}{form}, {n} tokens, top {k} of {ne}")
                });
            }
        }
    }
    // The product bias.
    for rows in [1usize, 7] {
        let cols = 96;
        let bias = rng.vec(cols);
        let bw = vector(be, &bias);
        let x = rng.vec(rows * cols);
        let mut xb = h.upload(be, &x);
        be.add_bias(&mut xb, &bw, rows).unwrap();
        let want: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| v + bias[i % cols])
            .collect();
        let e = rel_err(&read(be, &xb, rows * cols), &want);
        notes.check("add_bias", e, 0.0, || format!("{rows}×{cols}"));
    }
    notes
}

/// One `moe` call over the `n` tokens of `x` (rows of `d`) with fresh NaN-filled scratch: the
/// output and the routes (expert, weight per slot) read back.
fn run_moe<B: Backend, H: Harness<B>>(
    be: &B,
    h: &H,
    w: MoeWeights<'_, B::Weight>,
    p: &MoeParams,
    x: &[f32],
    n: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    let xb = h.upload(be, &x[..n * d]);
    let sizes = p.scratch_floats(n, d);
    let mut s: Vec<B::Buf> = sizes.iter().map(|&m| poison(be, h, m)).collect();
    let mut out = poison(be, h, n * d);
    {
        let [logits, routes, xs, gate, up, act, ys] = &mut s[..] else {
            unreachable!()
        };
        let scratch = MoeScratch {
            logits,
            routes,
            xs,
            gate,
            up,
            act,
            ys,
        };
        be.moe(&xb, n, w, p, scratch, &mut out).unwrap();
    }
    (read(be, &out, n * d), read(be, &s[1], 2 * n * p.n_used))
}

/// Router logits holding NaN (weights read as another type than written): every token still
/// goes to `n_used` distinct experts, a NaN one never ahead of a number and weighing nothing,
/// and the output is finite. Three tokens over 4 experts, 2 used: NaN among numbers, all NaN,
/// NaN beside one number.
pub fn moe_nan_router<B: Backend, H: Harness<B>>(be: &B, h: &H) {
    let (d, ff, ne, k, n) = (32usize, 32usize, 4usize, 2usize, 3usize);
    let weight = |rows: usize, shape: &[u64]| {
        let bytes: Vec<u8> = (0..rows * shape[shape.len() - 1] as usize)
            .flat_map(|i| (((i % 7) as f32 - 3.0) * 0.01).to_le_bytes())
            .collect();
        let t = super::tensor(GgmlType::F32, shape, &bytes);
        be.weight("w", GgmlType::F32, shape, t).unwrap()
    };
    let (ne64, ff64, d64) = (ne as u64, ff as u64, d as u64);
    let router = weight(ne, &[ne64, d64]);
    let gate = weight(ne * ff, &[ne64, ff64, d64]);
    let up = weight(ne * ff, &[ne64, ff64, d64]);
    let down = weight(ne * d, &[ne64, d64, ff64]);
    let p = MoeParams {
        n_expert: ne,
        n_used: k,
        n_ff: ff,
        gating: Gating::Softmax,
        norm: true,
        scale: 1.0,
        act: Activation::SwiGlu,
        router_given: true,
        held: (0, ne),
    };
    let sizes = p.scratch_floats(n, d);
    let nan = f32::NAN;
    let mut logits = vec![0.0; sizes[0]];
    logits[..n * ne].copy_from_slice(&[nan, 1.0, 0.5, 2.0, nan, nan, nan, nan, 3.0, nan, nan, 1.0]);
    let mut bufs: Vec<B::Buf> = sizes[1..].iter().map(|&m| poison(be, h, m)).collect();
    let mut lg = h.upload(be, &logits);
    let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.1).sin()).collect();
    let xb = h.upload(be, &x);
    let mut out = poison(be, h, n * d);
    let [routes, xs, g, u, a, ys] = &mut bufs[..] else {
        unreachable!()
    };
    be.moe(
        &xb,
        n,
        MoeWeights {
            router: &router,
            gate: &gate,
            up: &up,
            down: &down,
            down_scale: None,
            gate_scale: None,
            up_scale: None,
        },
        &p,
        MoeScratch {
            logits: &mut lg,
            routes,
            xs,
            gate: g,
            up: u,
            act: a,
            ys,
        },
        &mut out,
    )
    .unwrap();
    let r = read(be, routes, n * k * 2);
    let experts: Vec<f32> = r.chunks(2).map(|e| e[0]).collect();
    assert_eq!(experts, [3.0, 1.0, 0.0, 1.0, 0.0, 3.0], "{}", be.name());
    let weights: Vec<f32> = r.chunks(2).map(|e| e[1]).collect();
    assert_eq!(&weights[2..4], [0.0, 0.0], "token 1's logits are all NaN");
    let out = read(be, &out, n * d);
    assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
    assert!(out[d..2 * d].iter().all(|&v| v == 0.0));
}

/// Per-expert scales of the gate, up and down products (`ExtraOp::MoeProductScales`, with
/// `down_scale`): the same output as the experts' F32 weights multiplied by them, the gate's
/// scale thus taken before the activation. Three tokens over 4 experts, 2 used.
pub fn moe_product_scales<B: Backend, H: Harness<B>>(be: &B, h: &H) {
    let (d, ff, ne, k, n) = (32usize, 16usize, 4usize, 2usize, 3usize);
    let (ne64, ff64, d64) = (ne as u64, ff as u64, d as u64);
    let (gs, us, ds) = (
        [0.5f32, -1.5, 2.0, 0.25],
        [1.25f32, 0.75, -0.5, 3.0],
        [2.0f32, 0.5, 1.5, -1.0],
    );
    // Expert e's rows of a stacked weight, times `s[e]` where given.
    let values = |rows_per_expert: usize, cols: usize, salt: usize, s: Option<&[f32; 4]>| {
        (0..ne * rows_per_expert * cols)
            .map(|i| {
                let v = ((i * 7 + salt) % 13) as f32 * 0.02 - 0.12;
                v * s.map_or(1.0, |s| s[i / (rows_per_expert * cols)])
            })
            .collect::<Vec<f32>>()
    };
    let weight = |v: &[f32], shape: &[u64]| {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = super::tensor(GgmlType::F32, shape, &bytes);
        be.weight("w", GgmlType::F32, shape, t).unwrap()
    };
    let router = weight(&values(1, d, 3, None), &[ne64, d64]);
    let p = MoeParams {
        n_expert: ne,
        n_used: k,
        n_ff: ff,
        gating: Gating::Softmax,
        norm: true,
        scale: 0.0,
        act: Activation::SwiGlu,
        router_given: false,
        held: (0, ne),
    };
    let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
    let xb = h.upload(be, &x);
    let run = |w: MoeWeights<'_, B::Weight>| -> Vec<f32> {
        let sizes = p.scratch_floats(n, d);
        let mut bufs: Vec<B::Buf> = sizes.iter().map(|&m| poison(be, h, m)).collect();
        let [lg, routes, xs, g, u, a, ys] = &mut bufs[..] else {
            unreachable!()
        };
        let mut out = poison(be, h, n * d);
        let s = MoeScratch {
            logits: lg,
            routes,
            xs,
            gate: g,
            up: u,
            act: a,
            ys,
        };
        be.moe(&xb, n, w, &p, s, &mut out).unwrap();
        read(be, &out, n * d)
    };
    let (gate, up, down) = (
        weight(&values(ff, d, 1, None), &[ne64, ff64, d64]),
        weight(&values(ff, d, 5, None), &[ne64, ff64, d64]),
        weight(&values(d, ff, 9, None), &[ne64, d64, ff64]),
    );
    let scale = |s: &[f32; 4]| weight(s, &[ne64]);
    let (g_s, u_s, d_s) = (scale(&gs), scale(&us), scale(&ds));
    let scaled = run(MoeWeights {
        router: &router,
        gate: &gate,
        up: &up,
        down: &down,
        down_scale: Some(&d_s),
        gate_scale: Some(&g_s),
        up_scale: Some(&u_s),
    });
    let (gate_f, up_f, down_f) = (
        weight(&values(ff, d, 1, Some(&gs)), &[ne64, ff64, d64]),
        weight(&values(ff, d, 5, Some(&us)), &[ne64, ff64, d64]),
        weight(&values(d, ff, 9, Some(&ds)), &[ne64, d64, ff64]),
    );
    let folded = run(MoeWeights {
        router: &router,
        gate: &gate_f,
        up: &up_f,
        down: &down_f,
        down_scale: None,
        gate_scale: None,
        up_scale: None,
    });
    let err = rel_err(&scaled, &folded);
    assert!(err < 1e-4, "{}: relative error {err}", be.name());
}

/// Batch invariance (for a backend in its batch-invariant numerics): each token of a step of
/// 300 — sorted by expert, several tiles of some experts — comes out with the same bits as in
/// steps of its first 1, 2, 7 and 40 tokens, which take the pair-wise kernels or fewer tiles;
/// for every type of [`MOE_TYPES`], gate and up apart and in one tensor.
pub fn moe_invariance<B: Backend, H: Harness<B>>(be: &B, h: &H, rng: &mut Rng) {
    let (d, ff, ne, k, n) = (256usize, 256usize, 16usize, 4usize, 300usize);
    let (ne64, ff64, d64) = (ne as u64, ff as u64, d as u64);
    for &ty in MOE_TYPES {
        for fused in [false, true] {
            let p = MoeParams {
                n_expert: ne,
                n_used: k,
                n_ff: ff,
                gating: Gating::Softmax,
                norm: true,
                scale: 1.0,
                act: Activation::SwiGlu,
                router_given: false,
                held: (0, ne),
            };
            let router = WeightCase::random(rng, GgmlType::F32, ne, d).unwrap();
            let gate_rows = if fused { 2 * ne * ff } else { ne * ff };
            let (Some(gate), Some(up), Some(down)) = (
                WeightCase::random(rng, ty, gate_rows, d),
                WeightCase::random(rng, ty, ne * ff, d),
                WeightCase::random(rng, ty, ne * d, ff),
            ) else {
                continue;
            };
            let load = |w: &WeightCase, shape: &[u64]| {
                be.weight("w", w.ty, shape, super::tensor(w.ty, shape, &w.bytes))
                    .unwrap()
            };
            let er = gate_rows as u64 / ne64;
            let (rw, gw, uw, dw) = (
                load(&router, &[ne64, d64]),
                load(&gate, &[ne64, er, d64]),
                load(&up, &[ne64, ff64, d64]),
                load(&down, &[ne64, d64, ff64]),
            );
            let x = rng.scaled(n * d, 0.5);
            let w = MoeWeights {
                router: &rw,
                gate: &gw,
                up: if fused { &gw } else { &uw },
                down: &dw,
                down_scale: None,
                gate_scale: None,
                up_scale: None,
            };
            let run = |m: usize| run_moe(be, h, w, &p, &x, m, d).0;
            let all = run(n);
            for m in [1usize, 2, 7, 40] {
                let part = run(m);
                for t in 0..m {
                    let (a, b) = (&part[t * d..][..d], &all[t * d..][..d]);
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{}: moe {ty}{}: token {t} of a step of {m} differs from the same token in a step of {n}",
                        be.name(),
                        if fused { ", gate and up in one tensor" } else { "" }
                    );
                }
            }
        }
    }
}
