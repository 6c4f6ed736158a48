//! Mixture-of-experts FFN on the CPU: routing on the host, then each expert's tokens gathered
//! into one block and multiplied by the expert's rows of the stacked 3-D tensors (a product
//! per expert that has tokens, never one per token), and the weighted outputs summed per
//! token in slot order, as llama.cpp sums them.

use crate::{check, CpuBackend, CpuWeight};
use quiver_backend::{reference, Activation, Backend, MoeParams, MoeScratch, MoeWeights, Result};

/// The host side of a step's routing, kept between steps (no allocation once grown).
#[derive(Default)]
pub(crate) struct Routing {
    /// (expert, weight) per (token, slot).
    routes: Vec<(u32, f32)>,
    one: Vec<(u32, f32)>,
    /// Where pair (token, slot) lies in the expert-ordered blocks.
    pos: Vec<usize>,
    /// First pair of each expert's block; `n_expert + 1` entries.
    start: Vec<usize>,
    /// The next free pair of each expert's block while the pairs are placed.
    next: Vec<usize>,
}

/// A router other than [`reference::moe_route`]: token t's (expert, weight) pairs from its
/// logits (DeepSeek-V4's), and the clamp of its SwiGLU (0: none).
pub(crate) type Router<'a> = (&'a dyn Fn(usize, &[f32], &mut Vec<(u32, f32)>), f32);

impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_cpu(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: MoeWeights<'_, CpuWeight>,
        p: &MoeParams,
        s: MoeScratch<'_, Vec<f32>>,
        out: &mut [f32],
        router: Option<Router<'_>>,
    ) -> Result<()> {
        let d = w.router.cols;
        let (ne, k, ff) = (p.n_expert, p.n_used, p.n_ff);
        // The experts held here (expert parallelism: a run of them; else all), their weights
        // stacked from expert e0 on.
        let (e0, nh) = p.held;
        let sizes = p.scratch_floats(rows, d);
        // Gate and up in one tensor: 2·ff rows per expert, the gate's first.
        let fused = std::ptr::eq(w.gate, w.up);
        let per = if fused { 2 * ff } else { ff };
        check(
            "moe",
            w.router.rows == ne
                && e0 + nh <= ne
                && w.gate.rows == nh * per
                && w.up.rows == nh * per
                && w.gate.cols == d
                && w.down.rows == nh * d
                && w.down.cols == ff
                && (1..=ne).contains(&k)
                && x.len() >= rows * d
                && out.len() >= rows * d
                && s.logits.len() >= sizes[0]
                && s.xs.len() >= sizes[2]
                && s.gate.len() >= sizes[3]
                && s.up.len() >= sizes[4]
                && s.act.len() >= sizes[5]
                && s.ys.len() >= sizes[6],
            || format!("{rows} rows, {nh} of {ne} experts of {ff}, {k} used, n_embd {d}"),
        )?;
        if !p.router_given {
            self.matmul(w.router, x, rows, s.logits)?;
        }
        let down_scale = per_expert(w.down_scale, ne, "down")?;
        let gate_scale = per_expert(w.gate_scale, ne, "gate")?;
        let up_scale = per_expert(w.up_scale, ne, "up")?;
        let mut r = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        let r = &mut *r;
        r.routes.clear();
        for t in 0..rows {
            match router {
                Some((f, _)) => f(t, &s.logits[t * ne..][..ne], &mut r.one),
                None => reference::moe_route(&s.logits[t * ne..][..ne], p, &mut r.one),
            }
            r.routes.extend_from_slice(&r.one);
        }
        check("moe", r.routes.len() == rows * k, || {
            format!("{} routes for {rows} rows of {k} experts", r.routes.len())
        })?;
        // Counting sort of the pairs by expert.
        r.start.clear();
        r.start.resize(ne + 1, 0);
        for &(e, _) in &r.routes {
            r.start[e as usize + 1] += 1;
        }
        for e in 0..ne {
            r.start[e + 1] += r.start[e];
        }
        r.next.clear();
        r.next.extend_from_slice(&r.start);
        r.pos.clear();
        r.pos.resize(rows * k, 0);
        for (i, &(e, _)) in r.routes.iter().enumerate() {
            let at = r.next[e as usize];
            r.next[e as usize] += 1;
            r.pos[i] = at;
            if p.holds(e as usize) {
                s.xs[at * d..][..d].copy_from_slice(&x[(i / k) * d..][..d]);
            }
        }
        let (gb, ub, db) = (
            w.gate.ty.row_bytes(d as u64).unwrap_or(0) as usize * ff,
            w.up.ty.row_bytes(d as u64).unwrap_or(0) as usize * ff,
            w.down.ty.row_bytes(ff as u64).unwrap_or(0) as usize * d,
        );
        // Where expert e's gate and up rows start.
        let g_at = |e: usize, gb: usize| if fused { e * 2 * gb } else { e * gb };
        let u_at = |e: usize, ub: usize| if fused { e * 2 * ub + ub } else { e * ub };
        for e in e0..e0 + nh {
            let (a, n) = (r.start[e], r.start[e + 1] - r.start[e]);
            if n == 0 {
                continue;
            }
            // Its place in the held experts' stacked weights.
            let h = e - e0;
            let xs = &s.xs[a * d..(a + n) * d];
            let g = &mut s.gate[a * ff..(a + n) * ff];
            self.mm.run(
                w.gate.ty,
                &w.gate.bytes()[g_at(h, gb)..][..gb],
                ff,
                d,
                xs,
                n,
                g,
            )?;
            let u = &mut s.up[a * ff..(a + n) * ff];
            self.mm
                .run(w.up.ty, &w.up.bytes()[u_at(h, ub)..][..ub], ff, d, xs, n, u)?;
            if let Some(sc) = gate_scale {
                g.iter_mut().for_each(|v| *v *= sc[e]);
            }
            if let Some(sc) = up_scale {
                u.iter_mut().for_each(|v| *v *= sc[e]);
            }
            let act = &mut s.act[a * ff..(a + n) * ff];
            let (g, u) = (&s.gate[a * ff..(a + n) * ff], &s.up[a * ff..(a + n) * ff]);
            match (p.act, router) {
                (_, Some((_, limit))) if limit > 0.0 => {
                    quiver_backend::dsv4::swiglu_clamp(g, u, limit, act)
                }
                (Activation::GeGlu, _) => crate::act_fn::geglu(g, u, act),
                (Activation::SwiGlu, _) => crate::act_fn::swiglu(g, u, act),
            }
            let ys = &mut s.ys[a * d..(a + n) * d];
            self.mm.run(
                w.down.ty,
                &w.down.bytes()[h * db..][..db],
                d,
                ff,
                &s.act[a * ff..(a + n) * ff],
                n,
                ys,
            )?;
            if let Some(sc) = down_scale {
                ys.iter_mut().for_each(|v| *v *= sc[e]);
            }
        }
        for t in 0..rows {
            let o = &mut out[t * d..][..d];
            let mut first = true;
            for j in 0..k {
                let (e, wt) = r.routes[t * k + j];
                if !p.holds(e as usize) {
                    continue;
                }
                let y = &s.ys[r.pos[t * k + j] * d..][..d];
                if first {
                    o.iter_mut().zip(y).for_each(|(o, &v)| *o = v * wt);
                } else {
                    o.iter_mut().zip(y).for_each(|(o, &v)| *o += v * wt);
                }
                first = false;
            }
            if first {
                o.fill(0.0); // none of its experts here
            }
        }
        // The routes, for anyone reading the scratch (tests): expert id, weight.
        for (i, &(e, wt)) in r.routes.iter().enumerate() {
            if let Some(c) = s.routes.get_mut(2 * i..2 * i + 2) {
                c[0] = e as f32;
                c[1] = wt;
            }
        }
        Ok(())
    }
}

/// A per-expert scale vector of `ne` floats, where the model has one.
fn per_expert<'w>(w: Option<&'w CpuWeight>, ne: usize, what: &str) -> Result<Option<&'w [f32]>> {
    let Some(v) = w else { return Ok(None) };
    let v = v.vector("moe")?;
    check("moe", v.len() == ne, || {
        format!("{} {what} scales for {ne} experts", v.len())
    })?;
    Ok(Some(v))
}
