//! DeepSeek-V4's ops on the GPU (kernels/dsv4.cu): the hyper-connections' block input and
//! output, the streams' expansion, the clamped SwiGLU, the attention over the per-sequence state
//! in the reference's phases (prepare, select, heads, commit) and its rollback, the MoE routing;
//! the grouped product on the products of each group's weight. A row's floats do not depend on
//! the step's other rows (`quiver_backend::dsv4` holds the scalar references).

use crate::batch::CudaStep;
use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::moe::DsRoute;
use crate::plan::Product;
use crate::weights::CudaWeight;
use crate::{check, registry, CudaBackend};
use quiver_backend::dsv4::{self as ds, AttnInputs, AttnShape, AttnWeights, HcParams};
use quiver_backend::{MoeParams, MoeScratch, MoeWeights, Result, Snapshots, Step};
use quiver_gguf::GgmlType;

/// The attention kernels' shape (kernels/dsv4.cu `DsAttn`).
#[repr(C)]
#[derive(Clone, Copy)]
struct DsAttn {
    hd: i32,
    nh: i32,
    np: i32,
    cnp: i32,
    n_swa: i32,
    raw_ring: i32,
    ratio: i32,
    ring: i32,
    cw: i32,
    nc: i32,
    ih: i32,
    id: i32,
    top_k: i32,
    kf: i32,
    planes: i32,
    sf: i64,
    off: [i64; 7],
    eps: f32,
    scale: f32,
    mscale: f32,
    cmscale: f32,
}

impl DsAttn {
    fn new(s: &AttnShape, planes: usize) -> DsAttn {
        let (hd, cw, nc) = (s.head_dim, s.comp_width(), s.n_comp());
        let off = ds::layout(s).map(|(at, _)| at as i64);
        DsAttn {
            hd: hd as i32,
            nh: s.n_head as i32,
            np: (s.rope.n_dims / 2) as i32,
            cnp: (s.comp_rope.n_dims / 2) as i32,
            n_swa: s.n_swa as i32,
            raw_ring: s.raw_ring() as i32,
            ratio: s.ratio as i32,
            ring: if s.ratio > 0 { s.ring() as i32 } else { 0 },
            cw: cw as i32,
            nc: nc as i32,
            ih: s.ix_heads as i32,
            id: s.ix_dim as i32,
            top_k: s.ix_top_k as i32,
            kf: ds::kept_floats(s) as i32,
            planes: planes as i32,
            sf: s.state_floats() as i64,
            off,
            eps: s.rms_eps,
            scale: 1.0 / (hd as f32).sqrt(),
            mscale: s.rope.mscale(),
            cmscale: s.comp_rope.mscale(),
        }
    }
}

/// Head dims the head kernel holds (4 values a thread of 128).
const MAX_HEAD_DIM: usize = 512;

/// `hc_mix_part`'s chunk of columns, rows a block and most mixes (kernels/dsv4.cu `HCM_*`:
/// fewer than HCM_R mixes take the kernels).
const HCM_COLS: usize = 1024;
const HCM_ROWS: usize = 8;
const HCM_R: usize = 32;
/// Columns a block of `hc_pre` takes (kernels/dsv4.cu `HC_COLS`).
const HC_COLS: usize = 512;
/// Streams the kernels hold per token (kernels/dsv4.cu `HC_MAX`).
const HC_MAX: usize = 8;

/// Whether `w` is an f32 vector of `n` values.
fn f32_vector(w: &CudaWeight, n: usize) -> bool {
    w.ty == GgmlType::F32 && w.rows * w.cols == n && (w.rows == 1 || w.cols == 1)
}

/// Groups one `mmvq_groups` launch takes (mmvq.cu `MMVQ_GROUPS`).
const MMVQ_GROUPS: usize = 8;

/// The groups' matrices of an `mmvq_groups` launch (mirrors `MmvGroups` in mmvq.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct MmvGroups {
    p: [u64; MMVQ_GROUPS],
}

impl CudaBackend {
    pub(crate) fn hc_expand_kernel(
        &self,
        x: &CudaBuf,
        p: &HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * p.hc * p.d;
        check("hc_expand", x.len >= rows * p.d && out.len >= n, || {
            format!("{rows} rows of {} streams of {}", p.hc, p.d)
        })?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_expand",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![x.ptr(), out.ptr(), rows as i64, p.hc as i32, p.d as i32],
        )
    }

    /// `hc_pre`, the mixes from `parts` where given (hc_mix_part's chunks: their pointer,
    /// count, the rows' width and the norm's eps) instead of `mixes`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_pre_kernel(
        &self,
        x: &CudaBuf,
        mixes: &CudaBuf,
        scale: &CudaWeight,
        base: &CudaWeight,
        p: &HcParams,
        head: bool,
        rows: usize,
        out: &mut CudaBuf,
        pc: &mut CudaBuf,
        parts: Option<(u64, usize, usize, f32)>,
    ) -> Result<()> {
        let md = if head { p.hc } else { p.mix_dim() };
        check(
            "hc_pre",
            (1..=HC_MAX).contains(&p.hc)
                && p.iters >= 1
                && x.len >= rows * p.hc * p.d
                && (parts.is_some() || mixes.len >= rows * md)
                && f32_vector(base, md)
                && f32_vector(scale, if head { 1 } else { 3 })
                && out.len >= rows * p.d
                && (head || pc.len >= rows * p.pc_dim()),
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_pre",
            (rows as u32, p.d.div_ceil(HC_COLS) as u32, 1),
            (128, 1, 1),
            args![
                x.ptr(),
                mixes.ptr(),
                scale.data.ptr,
                base.data.ptr,
                out.ptr(),
                pc.ptr(),
                p.hc as i32,
                p.d as i32,
                p.eps,
                p.iters as i32,
                head as i32,
                parts.map(|(q, _, _, _)| q).unwrap_or(0),
                parts.map(|(_, n, _, _)| n as i32).unwrap_or(0),
                parts.map(|(_, _, c, _)| c as i32).unwrap_or(0),
                parts.map(|(_, _, _, e)| e).unwrap_or(0.0)
            ],
        )
    }

    /// `hc_mixes` as two kernels (kernels/dsv4.cu `hc_mix_part`, `hc_mix_sum`) where the
    /// weight is F32 with fewer than `HCM_R` rows; else `rms_norm_plain` then the product.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_mixes_kernel(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        cols: usize,
        eps: f32,
        rows: usize,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let Some(parts) = self.hc_mix_parts(x, w, cols, rows, scratch)? else {
            self.rms_norm_plain_kernel(x, cols, eps, rows, scratch)?;
            return quiver_backend::Backend::matmul(self, w, scratch, rows, out);
        };
        let r = w.rows;
        check("hc_mixes", out.len >= rows * r, || {
            format!("{rows} rows of {cols} into {r} mixes")
        })?;
        self.launch(
            "ops",
            "hc_mix_sum",
            (rows as u32, 1, 1),
            (32, 1, 1),
            args![
                scratch.ptr(),
                parts as i32,
                r as i32,
                cols as i32,
                eps,
                out.ptr()
            ],
        )
    }

    /// `hc_mix_pre`: hc_mix_part, then hc_pre summing the parts itself (one launch fewer),
    /// where `hc_mixes` takes two kernels; else `hc_mixes` then `hc_pre`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_mix_pre_kernel(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        (scale, base, p, head): (&CudaWeight, &CudaWeight, &HcParams, bool),
        rows: usize,
        scratch: &mut CudaBuf,
        mixes: &mut CudaBuf,
        out: &mut CudaBuf,
        pc: &mut CudaBuf,
    ) -> Result<()> {
        let (cols, md) = (p.hc * p.d, if head { p.hc } else { p.mix_dim() });
        match self.hc_mix_parts(x, w, cols, rows, scratch)? {
            Some(parts) if w.rows == md => {
                let part = Some((scratch.ptr(), parts, cols, eps));
                self.hc_pre_kernel(x, mixes, scale, base, p, head, rows, out, pc, part)
            }
            _ => {
                self.hc_mixes_kernel(x, w, cols, eps, rows, scratch, mixes)?;
                self.hc_pre_kernel(x, mixes, scale, base, p, head, rows, out, pc, None)
            }
        }
    }

    /// hc_mix_part's chunks of x's products with `w` into `scratch`: their count, or None
    /// where the weight is not F32 with fewer than `HCM_R` rows of `cols`.
    fn hc_mix_parts(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        cols: usize,
        rows: usize,
        scratch: &mut CudaBuf,
    ) -> Result<Option<usize>> {
        if w.ty != GgmlType::F32 || w.rows >= HCM_R || w.cols != cols || !cols.is_multiple_of(4) {
            return Ok(None);
        }
        let (r, parts) = (w.rows, cols.div_ceil(HCM_COLS));
        check(
            "hc_mixes",
            x.len >= rows * cols
                && scratch.len >= rows * parts * (r + 1)
                && w.row_bytes == cols * 4,
            || format!("{rows} rows of {cols} into {r} mixes"),
        )?;
        self.launch(
            "ops",
            "hc_mix_part",
            (parts as u32, rows.div_ceil(HCM_ROWS) as u32, 1),
            (256, 1, 1),
            args![
                x.ptr(),
                w.data.ptr,
                cols as i64,
                r as i32,
                cols as i32,
                rows as i64,
                scratch.ptr()
            ],
        )?;
        Ok(Some(parts))
    }

    pub(crate) fn hc_post_kernel(
        &self,
        y: &CudaBuf,
        residual: &CudaBuf,
        pc: &CudaBuf,
        p: &HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = rows * p.hc * p.d;
        check(
            "hc_post",
            y.len >= rows * p.d && residual.len >= n && pc.len >= rows * p.pc_dim() && out.len >= n,
            || format!("{rows} rows of {} streams of {}", p.hc, p.d),
        )?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ops",
            "hc_post",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![
                y.ptr(),
                residual.ptr(),
                pc.ptr(),
                out.ptr(),
                rows as i64,
                p.hc as i32,
                p.d as i32
            ],
        )
    }

    /// Group g's columns of x through its weight, into its columns of out (the step's rows
    /// laid out by group in the scratch, each group's product, the outputs laid back).
    pub(crate) fn matmul_grouped_kernel(
        &self,
        w: &[CudaWeight],
        x: &CudaBuf,
        rows: usize,
        out: &mut CudaBuf,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        let groups = w.len();
        let shapes = w.iter().map(|g| (g.rows, g.cols));
        let (r, c) =
            ds::grouped_shape(shapes, rows, x.len, out.len, scratch.len).map_err(|detail| {
                quiver_backend::BackendError::Shape {
                    op: "matmul_grouped",
                    detail,
                }
            })?;
        if rows == 0 {
            return Ok(());
        }
        if rows == 1 {
            // One row is group-major already: each group's product straight from x into out.
            // Where every group runs the matrix-vector kernels on int8 activations, x is
            // quantized once: a token's int8 copy (quants, scales, per-16 sums) is laid out
            // along its columns, so group g's is the slice from column g·c.
            let int8 = registry::int8_activations(w[0].kernel).filter(|b| {
                c.is_multiple_of(*b)
                    && self.kind_of(1).is_some_and(|k| {
                        w.iter()
                            .all(|g| g.kernel == w[0].kernel && g.plan.get(k, 1) == Product::Mmv)
                    })
            });
            let made = match int8 {
                Some(block) => {
                    let (q, d, s) = self.quantize_act(x.ptr(), 1, groups * c, block, w[0].ty)?;
                    Some((q, d, s, block))
                }
                None => None,
            };
            if let Some((q, d, s, block)) = made.filter(|_| {
                groups <= MMVQ_GROUPS && w.iter().all(|g| g.row_bytes == w[0].row_bytes)
            }) {
                // One launch: a block row per group (mmvq.cu `mmvq_groups`).
                let mut p = MmvGroups {
                    p: [0; MMVQ_GROUPS],
                };
                for (g, wg) in w.iter().enumerate() {
                    p.p[g] = wg.data.ptr;
                }
                return self.launch(
                    &w[0].names.module,
                    &w[0].names.mmvq_groups,
                    (r.div_ceil(4) as u32, groups as u32, 1),
                    (32, 4, 1),
                    args![
                        p,
                        w[0].row_bytes as i64,
                        q,
                        d,
                        s,
                        out.ptr(),
                        r as i32,
                        c as i32,
                        block as i32
                    ],
                );
            }
            for (g, wg) in w.iter().enumerate() {
                let (xg, yg) = (x.ptr() + (4 * g * c) as u64, out.ptr() + (4 * g * r) as u64);
                match made {
                    Some((q, d, s, block)) => {
                        // Scales: 2 floats a block of 32, 1 a block of 256; sums: 1 int a 16.
                        let d_bytes = if block == 32 { c / 32 * 8 } else { c / 256 * 4 };
                        let s_bytes = if block == 32 { 0 } else { c / 16 * 4 };
                        let qa = (
                            q + (g * c) as u64,
                            d + (g * d_bytes) as u64,
                            s + (g * s_bytes) as u64,
                        );
                        self.mmv_quantized(&[(wg, yg)], xg, 1, Some(qa))?
                    }
                    None => self.mm(wg, xg, 1, yg)?,
                }
            }
            return Ok(());
        }
        let (xs, ys) = (
            scratch.ptr(),
            scratch.ptr() + (4 * rows * groups * c) as u64,
        );
        // x's groups as consecutive [rows, C] blocks, each group's product, the outputs back.
        let layout = |src: u64, dst: u64, w: usize, to_groups: bool| {
            self.launch(
                "ops",
                "group_major",
                (grid1(rows * groups * w, 256, 8192), 1, 1),
                (256, 1, 1),
                args![
                    src,
                    dst,
                    rows as i64,
                    groups as i32,
                    w as i32,
                    to_groups as i32
                ],
            )
        };
        layout(x.ptr(), xs, c, true)?;
        for (g, wg) in w.iter().enumerate() {
            let (xg, yg) = (
                xs + (4 * g * rows * c) as u64,
                ys + (4 * g * rows * r) as u64,
            );
            self.mm(wg, xg, rows, yg)?;
        }
        layout(ys, out.ptr(), r, false)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_dsv4_kernel(
        &self,
        st: &Step<CudaStep>,
        x: &CudaBuf,
        w: MoeWeights<'_, CudaWeight>,
        p: &MoeParams,
        bias: Option<&CudaWeight>,
        hash: Option<&CudaBuf>,
        clamp: f32,
        s: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let (ne, k) = (p.n_expert, p.n_used);
        check(
            "moe_dsv4",
            bias.is_none_or(|b| f32_vector(b, ne))
                && hash.is_none_or(|h| {
                    st.batch
                        .tokens
                        .iter()
                        .all(|&t| (t as usize + 1) * k <= h.len)
                })
                && (1..=32).contains(&k),
            || format!("routing bias or hash table for {ne} experts"),
        )?;
        let route = DsRoute {
            view: st.ctx.view,
            bias: bias.map_or(0, |b| b.data.ptr),
            hash: hash.map_or(0, |h| h.ptr()),
            clamp,
        };
        self.moe_routed(x, st.rows, w, p, s, out, Some(route))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dsv4_attention_kernel(
        &self,
        st: &Step<CudaStep>,
        s: &AttnShape,
        w: AttnWeights<'_, CudaWeight>,
        x: AttnInputs<'_, CudaBuf>,
        state: &mut CudaBuf,
        kept: Option<Snapshots<'_, CudaBuf>>,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let op = "dsv4_attention";
        let rows = st.rows;
        let (hd, cw, id) = (s.head_dim, s.comp_width(), s.ix_dim);
        let len = |b: Option<&CudaBuf>| b.map_or(0, |b| b.len);
        let vec_ok = |v: Option<&CudaWeight>, n: usize| v.is_some_and(|v| f32_vector(v, n));
        let comp = s.ratio == 0
            || (len(x.comp_kv) >= rows * cw
                && len(x.comp_score) >= rows * cw
                && vec_ok(w.ape, s.ratio * cw)
                && vec_ok(w.norm, hd));
        let ix = s.ratio != 4
            || (len(x.ix_q) >= rows * s.ix_heads * id
                && len(x.ix_w) >= rows * s.ix_heads
                && len(x.ix_kv) >= rows * 2 * id
                && len(x.ix_score) >= rows * 2 * id
                && vec_ok(w.ix_ape, 8 * id)
                && vec_ok(w.ix_norm, id)
                && s.ix_heads * id * 4 <= 48 * 1024
                && id <= MAX_HEAD_DIM);
        check(
            op,
            matches!(s.ratio, 0 | 4 | 128)
                && s.n_rot <= hd
                && s.n_rot == s.rope.n_dims
                && s.comp_rope.n_dims <= hd
                && (s.ratio != 4 || s.comp_rope.n_dims <= id)
                && s.n_swa > 0
                && (2..=MAX_HEAD_DIM).contains(&hd)
                && x.q.len >= rows * s.n_head * hd
                && x.kv.len >= rows * hd
                && f32_vector(w.sinks, s.n_head)
                && out.len >= rows * s.n_head * hd
                && scratch.len >= ds::attention_scratch_floats(s, rows)
                && comp
                && ix,
            || format!("{rows} rows, ratio {}, head dim {hd}", s.ratio),
        )?;
        let detail = |d: String| quiver_backend::BackendError::Shape { op, detail: d };
        let k = kept.as_ref().map(|k| (k.planes, k.buf.len));
        ds::check_step(st.batch, s, state.len, k).map_err(detail)?;
        let planes = kept.as_ref().map_or(0, |k| k.planes);
        let a = DsAttn::new(s, planes);
        let (theta, ctheta) = (self.theta_ptr(&s.rope)?, self.theta_ptr(&s.comp_rope)?);
        let view = st.ctx.view;
        let ptr = |b: Option<&CudaBuf>| b.map_or(0, |b| b.ptr());
        let wptr = |v: Option<&CudaWeight>| v.map_or(0, |v| v.data.ptr);
        let kept = kept.map_or(0, |k| k.buf.ptr());
        // The scratch: keys, each row's first row, the indexer's choices, its scores.
        let keys = scratch.ptr();
        let row0 = keys + (4 * rows * hd) as u64;
        let sel = row0 + (4 * rows) as u64;
        let scores = sel + (4 * rows * s.ix_top_k) as u64;
        let smem = (4 * 2 * hd.max(id)) as u32;
        self.launch_smem(
            "ops",
            "ds_prepare",
            (rows as u32, 1, 1),
            (256, 1, 1),
            smem,
            args![
                view,
                rows as i32,
                a,
                theta,
                ctheta,
                x.kv.ptr(),
                ptr(x.comp_kv),
                ptr(x.comp_score),
                ptr(x.ix_kv),
                ptr(x.ix_score),
                wptr(w.ape),
                wptr(w.norm),
                wptr(w.ix_ape),
                wptr(w.ix_norm),
                state.ptr(),
                kept,
                keys,
                row0
            ],
        )?;
        if s.ratio == 4 {
            let chunk = ds::score_rows(s, rows).max(1);
            for r0 in (0..rows).step_by(chunk) {
                self.launch_smem(
                    "ops",
                    "ds_select",
                    (chunk.min(rows - r0) as u32, 1, 1),
                    (256, 1, 1),
                    (4 * s.ix_heads * id) as u32,
                    args![
                        view,
                        r0 as i32,
                        rows as i32,
                        a,
                        ctheta,
                        ptr(x.ix_q),
                        ptr(x.ix_w),
                        state.ptr(),
                        scores,
                        sel
                    ],
                )?;
            }
        }
        self.launch_smem(
            "ops",
            "ds_head",
            (rows as u32, s.n_head as u32, 1),
            (128, 1, 1),
            (4 * hd) as u32,
            args![
                view,
                rows as i32,
                a,
                theta,
                x.q.ptr(),
                state.ptr(),
                keys,
                row0,
                sel,
                w.sinks.data.ptr,
                out.ptr()
            ],
        )?;
        self.launch(
            "ops",
            "ds_commit",
            (rows as u32, 1, 1),
            (256, 1, 1),
            args![view, rows as i32, a, state.ptr(), kept, keys],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dsv4_rewind_kernel(
        &self,
        s: &AttnShape,
        state: &mut CudaBuf,
        kept: &CudaBuf,
        planes: usize,
        slot: usize,
        kept_slot: usize,
        start: usize,
        len: usize,
        row: usize,
    ) -> Result<()> {
        let (sf, kf) = (s.state_floats(), ds::kept_floats(s));
        let undo = len.saturating_sub(1 + row.min(len.saturating_sub(1)));
        check(
            "dsv4_rewind",
            undo <= planes
                && (slot + 1) * sf <= state.len
                && (kept_slot + 1) * planes * kf <= kept.len,
            || {
                format!(
                    "{undo} rows to undo with {planes} kept, state slot {slot}, kept slot {kept_slot}"
                )
            },
        )?;
        if undo == 0 {
            return Ok(());
        }
        let a = DsAttn::new(s, planes);
        self.launch(
            "ops",
            "ds_rewind",
            (1, 1, 1),
            (256, 1, 1),
            args![
                a,
                state.ptr(),
                kept.ptr(),
                slot as i64,
                kept_slot as i64,
                start as i64,
                len as i32,
                row as i32
            ],
        )
    }
}
