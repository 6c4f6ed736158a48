//! DeepSeek-V4's ops on the CPU ([`quiver_backend::dsv4`]): the hyper-connections and the
//! compressed attention run the scalar references over the host buffers (one sequence's
//! tokens in position order: each updates the state the next reads); the grouped product
//! and the experts run on the matmul kernels.

use crate::{check, par_rows, CpuBackend, CpuWeight, SyncPtr};
use quiver_backend::dsv4::{self, AttnHost, AttnInputs, AttnShape, AttnWeights, HcParams};
use quiver_backend::{Batch, MoeParams, MoeScratch, MoeWeights, Result};

/// Buffers of the ops below, grown to the largest step seen and kept (`ExtraScratch::ds`).
#[derive(Default)]
pub(crate) struct Scratch {
    keys: Vec<f32>,
    /// Each token's compressed-row selection (`dsv4::attention_select_into`).
    sel: Vec<dsv4::SelectBufs>,
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// The indexer's choices per token, written by the pool's tasks, each its own tokens'.
#[derive(Clone, Copy)]
struct SelPtr(*mut dsv4::SelectBufs);
// SAFETY: the tasks write disjoint entries and nothing reads them before the pool returns.
unsafe impl Sync for SelPtr {}

impl SelPtr {
    fn at(&self, t: usize) -> *mut dsv4::SelectBufs {
        self.0.wrapping_add(t)
    }
}

fn vec_of<'a>(w: Option<&'a CpuWeight>, op: &'static str) -> Result<&'a [f32]> {
    match w {
        Some(w) => w.vector(op),
        None => Ok(&[]),
    }
}

impl CpuBackend {
    pub(crate) fn hc_expand_cpu(
        &self,
        x: &[f32],
        p: &HcParams,
        rows: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (hc, d) = (p.hc, p.d);
        check(
            "hc_expand",
            x.len() >= rows * d && out.len() >= rows * hc * d,
            || format!("{rows} rows of {hc} streams of {d}"),
        )?;
        for t in 0..rows {
            for h in 0..hc {
                out[(t * hc + h) * d..][..d].copy_from_slice(&x[t * d..][..d]);
            }
        }
        Ok(())
    }

    pub(crate) fn swiglu_clamp_cpu(
        &self,
        gate: &[f32],
        up: &[f32],
        limit: f32,
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        check(
            "swiglu_clamp",
            gate.len() >= n && up.len() >= n && out.len() >= n,
            || format!("{n} elements"),
        )?;
        quiver_backend::dsv4::swiglu_clamp(&gate[..n], &up[..n], limit, &mut out[..n]);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_pre_cpu(
        &self,
        x: &[f32],
        mixes: &[f32],
        scale: &CpuWeight,
        base: &CpuWeight,
        p: &HcParams,
        head: bool,
        rows: usize,
        out: &mut [f32],
        pc: &mut [f32],
    ) -> Result<()> {
        let (scale, base) = (scale.vector("hc_pre")?, base.vector("hc_pre")?);
        let md = if head { p.hc } else { p.mix_dim() };
        check(
            "hc_pre",
            x.len() >= rows * p.hc * p.d
                && mixes.len() >= rows * md
                && base.len() == md
                && scale.len() == if head { 1 } else { 3 }
                && out.len() >= rows * p.d
                && (head || pc.len() >= rows * p.pc_dim()),
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        dsv4::hc_pre(x, mixes, scale, base, p, head, rows, out, pc);
        Ok(())
    }

    pub(crate) fn hc_post_cpu(
        &self,
        y: &[f32],
        residual: &[f32],
        pc: &[f32],
        p: &HcParams,
        rows: usize,
        out: &mut [f32],
    ) -> Result<()> {
        check(
            "hc_post",
            y.len() >= rows * p.d
                && residual.len() >= rows * p.hc * p.d
                && pc.len() >= rows * p.pc_dim()
                && out.len() >= rows * p.hc * p.d,
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        dsv4::hc_post(y, residual, pc, p, rows, out);
        Ok(())
    }

    pub(crate) fn matmul_grouped_cpu(
        &self,
        w: &[CpuWeight],
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        scratch: &mut [f32],
    ) -> Result<()> {
        let groups = w.len();
        let shapes = w.iter().map(|g| (g.rows, g.cols));
        let (r, c) = dsv4::grouped_shape(shapes, rows, x.len(), out.len(), scratch.len()).map_err(
            |detail| quiver_backend::BackendError::Shape {
                op: "matmul_grouped",
                detail,
            },
        )?;
        let (xs, ys) = scratch.split_at_mut(rows * c);
        for (g, w) in w.iter().enumerate() {
            for t in 0..rows {
                xs[t * c..][..c].copy_from_slice(&x[t * groups * c + g * c..][..c]);
            }
            self.mm.run(
                w.ty,
                w.bytes(),
                r,
                c,
                &xs[..rows * c],
                rows,
                &mut ys[..rows * r],
            )?;
            for t in 0..rows {
                out[t * groups * r + g * r..][..r].copy_from_slice(&ys[t * r..][..r]);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dsv4_attention_cpu(
        &self,
        batch: &Batch,
        s: &AttnShape,
        w: AttnWeights<'_, CpuWeight>,
        x: AttnInputs<'_, Vec<f32>>,
        state: &mut [f32],
        kept: Option<quiver_backend::Snapshots<'_, Vec<f32>>>,
        out: &mut [f32],
    ) -> Result<()> {
        let op = "dsv4_attention";
        let host = AttnHost {
            sinks: w.sinks.vector(op)?,
            ape: vec_of(w.ape, op)?,
            norm: vec_of(w.norm, op)?,
            ix_ape: vec_of(w.ix_ape, op)?,
            ix_norm: vec_of(w.ix_norm, op)?,
        };
        let n = batch.n_tokens();
        let (hd, cw) = (s.head_dim, s.comp_width());
        let len = |b: Option<&Vec<f32>>| b.map_or(0, |b| b.len());
        let comp = s.ratio == 0
            || (len(x.comp_kv) >= n * cw
                && len(x.comp_score) >= n * cw
                && host.ape.len() == s.ratio * cw
                && host.norm.len() == hd);
        let ix = s.ratio != 4
            || (len(x.ix_q) >= n * s.ix_heads * s.ix_dim
                && len(x.ix_w) >= n * s.ix_heads
                && len(x.ix_kv) >= n * 2 * s.ix_dim
                && len(x.ix_score) >= n * 2 * s.ix_dim
                && host.ix_ape.len() == 8 * s.ix_dim
                && host.ix_norm.len() == s.ix_dim);
        check(
            op,
            matches!(s.ratio, 0 | 4 | 128)
                && s.n_rot <= hd
                && s.n_rot == s.rope.n_dims
                && s.n_swa > 0
                && x.q.len() >= n * s.n_head * hd
                && x.kv.len() >= n * hd
                && host.sinks.len() == s.n_head
                && out.len() >= n * s.n_head * hd
                && comp
                && ix,
            || format!("{n} rows, ratio {}, head dim {hd}", s.ratio),
        )?;
        let inputs = AttnInputs {
            q: x.q.as_slice(),
            kv: x.kv.as_slice(),
            comp_kv: x.comp_kv.map(|v| v.as_slice()),
            comp_score: x.comp_score.map(|v| v.as_slice()),
            ix_q: x.ix_q.map(|v| v.as_slice()),
            ix_w: x.ix_w.map(|v| v.as_slice()),
            ix_kv: x.ix_kv.map(|v| v.as_slice()),
            ix_score: x.ix_score.map(|v| v.as_slice()),
        };
        // The phases of dsv4::attention: the state brought up to each sequence's last token
        // (one sequence after another), then every (token, head) in parallel, then the rings.
        let mut guard = self.extra.lock().unwrap_or_else(|e| e.into_inner());
        let ds = &mut guard.ds;
        grow(&mut ds.keys, n * hd);
        if ds.sel.len() < n {
            ds.sel.resize_with(n, Default::default);
        }
        let keys = &mut ds.keys[..n * hd];
        let mut kept = kept.map(|k| dsv4::Kept {
            rows: k.buf.as_mut_slice(),
            planes: k.planes,
        });
        dsv4::attention_prepare(batch, s, &host, &inputs, state, kept.as_mut(), keys)
            .map_err(|detail| quiver_backend::BackendError::Shape { op, detail })?;
        let keys: &[f32] = keys;
        let st: &[f32] = state;
        let sel = &mut ds.sel[..n];
        if s.ratio == 4 {
            // The indexer's scores: every token's in parallel.
            let ptr = SelPtr(sel.as_mut_ptr());
            par_rows(self.mm.pool(), n, 1, |r0, r1| {
                for t in r0..r1 {
                    // SAFETY: each task writes only its own tokens' entries.
                    let b = unsafe { &mut *ptr.at(t) };
                    dsv4::attention_select_into(batch, s, &inputs, st, t, b);
                }
            });
        } else {
            for (t, b) in sel.iter_mut().enumerate() {
                dsv4::attention_select_into(batch, s, &inputs, st, t, b);
            }
        }
        let sel: &[dsv4::SelectBufs] = sel;
        // llama.cpp's tiled form for steps of 64+ rows, as the other attention's (attn.rs), and
        // its split one for a step of one row, under the fast numerics.
        let form = match (crate::attn::tiled(n, self.numerics()), n) {
            (true, _) => dsv4::Form::Tiled,
            (false, 1) if !self.numerics().is_batch_invariant() => dsv4::Form::Split,
            _ => dsv4::Form::Rows,
        };
        let (h, o) = (s.n_head, SyncPtr(out.as_mut_ptr()));
        par_rows(self.mm.pool(), n * h, 1, |r0, r1| {
            for i in r0..r1 {
                let (t, hh) = (i / h, i % h);
                // SAFETY: head hh of token t is its own range of out, written by this task only.
                let o = unsafe { o.slice(i * hd, hd) };
                dsv4::attention_head(
                    batch,
                    s,
                    &host,
                    &inputs,
                    st,
                    keys,
                    t,
                    hh,
                    &sel[t].rows,
                    form,
                    o,
                );
            }
        });
        dsv4::attention_commit(batch, s, state, kept.as_mut(), keys);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_dsv4_cpu(
        &self,
        batch: &Batch,
        x: &Vec<f32>,
        w: MoeWeights<'_, CpuWeight>,
        p: &MoeParams,
        bias: Option<&CpuWeight>,
        hash: Option<&[f32]>,
        clamp: f32,
        s: MoeScratch<'_, Vec<f32>>,
        out: &mut [f32],
    ) -> Result<()> {
        let bias = match bias {
            Some(b) => Some(b.vector("moe_dsv4")?),
            None => None,
        };
        let ne = p.n_expert;
        check(
            "moe_dsv4",
            bias.is_none_or(|b| b.len() == ne)
                && hash.is_none_or(|h| {
                    batch
                        .tokens
                        .iter()
                        .all(|&t| (t as usize + 1) * p.n_used <= h.len())
                }),
            || format!("routing bias or hash table for {ne} experts"),
        )?;
        let route = dsv4::MoeRoute {
            bias,
            hash,
            n_used: p.n_used,
            norm: p.norm,
            scale: p.scale,
        };
        let tokens = &batch.tokens;
        let f = |t: usize, logits: &[f32], out: &mut Vec<(u32, f32)>| {
            dsv4::moe_route(logits, tokens.get(t).copied().unwrap_or(0), &route, out)
        };
        self.moe_cpu(x, batch.n_tokens(), w, p, s, out, Some((&f, clamp)))
    }
}
