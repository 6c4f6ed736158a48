//! Mixture-of-experts FFN on the device: the router's product, routing by a kernel (so a
//! decode step stays inside its captured graph), the experts' products reading only the chosen
//! experts' rows of the stacked 3-D tensors, and the weighted sum in slot order.
//!
//! With the batch-invariant numerics a pair's products do not depend on the step's other pairs:
//! the int8 tensor-core types (`registry::int8_mma`) sum in the exact-sum order, few pairs one
//! warp per output row of each pair (kernels/mmvq.cu `moeqc_*`), many sorted by expert and each
//! expert's in tiles of 64 on imm (kernels/imm.cu `imm_g`), the same bits; the other types run
//! on CUDA cores over f32 (kernels/mmv.cu `moe_*`, pair-wise or grouped: the same bits). The fast
//! numerics take the f16 tensor cores for many pairs (kernels/qmm.cu `qmm_g`; on sm_90 Hopper's
//! warpgroup products, kernels/wmm.cu `wmm_g`) and the float-order int8 kernels for few.

use crate::memory::CudaBuf;
use crate::qmm::QMM_BN;
use crate::weights::CudaWeight;
use crate::{check, registry, CudaBackend};
use quiver_backend::{Gating, MoeParams, MoeScratch, MoeWeights, Numerics, Result};

const WARPS: usize = 4;

/// The kernels of a step's experts' products.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MoePath {
    /// One warp per output row of each (token, slot) pair over f32 activations (mmv.cu
    /// `moe_glu`, `moe_mmv`).
    PairsF32,
    /// The same over int8 activations (mmvq.cu `moeq_*`; `moeqc_*` in the exact-sum order).
    PairsInt8,
    /// Sorted by expert, each expert's pairs 8 at a time per weight row on CUDA cores (mmv.cu
    /// `moe_glu_g`, `moe_mmv_g`): PairsF32's bits.
    GroupedF32,
    /// Sorted, each expert's pairs in tiles of 64 on the int8 tensor cores (imm.cu `imm_g`):
    /// `moeqc`'s bits.
    GroupedImm,
    /// Sorted, tiles on Hopper's warpgroup products (wmm.cu `wmm_g`).
    GroupedWmm,
    /// Sorted, tiles on the f16 tensor cores (qmm.cu `qmm_g`).
    GroupedQmm,
}

impl CudaBackend {
    pub(crate) fn moe_fast(
        &self,
        x: &CudaBuf,
        rows: usize,
        w: MoeWeights<'_, CudaWeight>,
        p: &MoeParams,
        s: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let d = w.router.cols;
        let (ne, k, ff) = (p.n_expert, p.n_used, p.n_ff);
        // Gate and up in one tensor (Qwen 3.5 MoE): each expert's 2·ff rows, the gate's first.
        let fused = std::ptr::eq(w.gate, w.up);
        let expert_rows = if fused { 2 * ff } else { ff };
        let (gate_ptr, up_ptr) = if fused {
            (
                w.gate.data.ptr,
                w.gate.data.ptr + (ff * w.gate.row_bytes) as u64,
            )
        } else {
            (w.gate.data.ptr, w.up.data.ptr)
        };
        let sizes = p.scratch_floats(rows, d);
        check(
            "moe",
            w.router.rows == ne
                && w.gate.rows == ne * expert_rows
                && w.up.rows == ne * expert_rows
                && w.gate.cols == d
                && w.gate.ty == w.up.ty
                && w.down.rows == ne * d
                && w.down.cols == ff
                && (1..=32).contains(&k)
                && k <= ne
                && ne <= 1024
                && x.len >= rows * d
                && out.len >= rows * d
                && s.logits.len >= sizes[0]
                && s.routes.len >= sizes[1]
                && s.act.len >= sizes[5]
                && s.ys.len >= sizes[6],
            || format!("{rows} rows, {ne} experts of {ff}, {k} used, n_embd {d}"),
        )?;
        if rows == 0 {
            return Ok(());
        }
        if !p.router_given {
            self.mm(w.router, x.ptr(), rows, s.logits.ptr())?;
        }
        check(
            "moe",
            w.gate_scale.is_none() && w.up_scale.is_none(),
            || {
                "per-expert gate/up scales (ffn_gate_exps.scale, ffn_up_exps.scale) have no CUDA kernels".into()
            },
        )?;
        let scale = match w.down_scale {
            Some(v) => {
                check(
                    "moe",
                    v.ty == quiver_gguf::GgmlType::F32 && v.rows * v.cols == ne,
                    || format!("{} down scales for {ne} experts", v.rows * v.cols),
                )?;
                v.data.ptr
            }
            None => 0u64,
        };
        let gating = match p.gating {
            Gating::Softmax => 0i32,
            Gating::Sigmoid => 1,
        };
        self.launch(
            "ops",
            "moe_route",
            (rows as u32, 1, 1),
            (32, 1, 1),
            args![
                s.logits.ptr(),
                s.routes.ptr(),
                ne as i32,
                k as i32,
                gating,
                p.norm as i32,
                p.scale
            ],
        )?;
        let pairs = (rows * k) as u32;
        let (er, pairs_n) = (expert_rows, rows * k);
        let up_off = if fused { ff } else { 0 };
        let act = crate::products::act_code(p.act);
        let path = self.moe_path(&w, &s, p, rows, d);
        let (mut off, mut pos, mut tiles) = (0u64, 0u64, 0u64);
        let max_tiles = pairs_n.div_ceil(QMM_BN) + ne;
        if !matches!(path, MoePath::PairsF32 | MoePath::PairsInt8) {
            // Sorted by expert: the router's logits are spent, and their buffer holds the sort
            // (off: n_expert + 1 ints, pos: a pair) and the tile list.
            off = s.logits.ptr();
            pos = off + 4 * (ne as u64 + 1);
            self.launch(
                "ops",
                "moe_group",
                (1, 1, 1),
                (1024, 1, 1),
                args![s.routes.ptr(), off, pos, pairs as i32, ne as i32],
            )?;
            if path != MoePath::GroupedF32 {
                tiles = pos + 4 * pairs as u64;
                self.launch(
                    "ops",
                    "moe_tiles",
                    (1, 1, 1),
                    (32, 1, 1),
                    args![off, tiles, ne as i32, QMM_BN as i32],
                )?;
            }
        }
        let g = (off, tiles, max_tiles);
        match path {
            MoePath::GroupedImm => {
                // The pairs' inputs gathered (xs) and quantized, gate and up, the GLU, its
                // output quantized, down into ys: each pair's bits as moeqc's.
                let bg = registry::int8_activations(w.gate.kernel).expect("an int8 type");
                let bd = registry::int8_activations(w.down.kernel).expect("an int8 type");
                self.launch(
                    "ops",
                    "moe_gather",
                    (pairs, 1, 1),
                    (256, 1, 1),
                    args![x.ptr(), pos, s.xs.ptr(), k as i32, d as i32],
                )?;
                let a = self.quantize_act(s.xs.ptr(), pairs_n, d, bg, w.gate.ty)?;
                self.imm_grouped(w.gate, gate_ptr, er, ff, a, pairs_n, s.gate.ptr(), g)?;
                self.imm_grouped(w.up, up_ptr, er, ff, a, pairs_n, s.up.ptr(), g)?;
                self.glu_fast(p.act, s.gate, s.up, pairs_n * ff, s.act)?;
                let a = self.quantize_act(s.act.ptr(), pairs_n, ff, bd, w.down.ty)?;
                let down = w.down.data.ptr;
                self.imm_grouped(w.down, down, d, d, a, pairs_n, s.ys.ptr(), g)?;
            }
            MoePath::GroupedWmm => {
                // The pairs' inputs gathered (xs), rounded and permuted into ys (free until
                // down), gate and up, the GLU, its output permuted into xs, down into ys.
                self.launch(
                    "ops",
                    "moe_gather",
                    (pairs, 1, 1),
                    (256, 1, 1),
                    args![x.ptr(), pos, s.xs.ptr(), k as i32, d as i32],
                )?;
                let xp = s.ys.ptr();
                self.permute_to(s.xs.ptr(), pairs_n, d, w.gate.ty, xp)?;
                self.wmm_grouped(w.gate, 0, ff, er, xp, pairs_n, s.gate.ptr(), g)?;
                self.wmm_grouped(w.up, up_off, ff, er, xp, pairs_n, s.up.ptr(), g)?;
                self.glu_fast(p.act, s.gate, s.up, pairs_n * ff, s.act)?;
                let ap = s.xs.ptr();
                self.permute_to(s.act.ptr(), pairs_n, ff, w.down.ty, ap)?;
                self.wmm_grouped(w.down, 0, d, d, ap, pairs_n, s.ys.ptr(), g)?;
            }
            MoePath::GroupedQmm => {
                // The pairs' inputs in f16 (in xs), gate and up, the GLU, its output in f16
                // (in gate), down.
                let xh = s.xs.ptr();
                self.launch(
                    "ops",
                    "moe_gather_h",
                    (pairs, 1, 1),
                    (256, 1, 1),
                    args![x.ptr(), pos, xh, k as i32, d as i32],
                )?;
                let t = (off, tiles, max_tiles);
                self.qmm_grouped(w.gate, gate_ptr, er, ff, xh, s.gate.ptr(), t.0, t.1, t.2)?;
                self.qmm_grouped(w.up, up_ptr, er, ff, xh, s.up.ptr(), t.0, t.1, t.2)?;
                self.glu_fast(p.act, s.gate, s.up, pairs_n * ff, s.act)?;
                let ah = s.gate.ptr();
                self.to_half_plain(s.act.ptr(), ah, pairs_n * ff)?;
                let down = w.down.data.ptr;
                self.qmm_grouped(w.down, down, d, d, ah, s.ys.ptr(), t.0, t.1, t.2)?;
            }
            MoePath::GroupedF32 => {
                self.launch(
                    "ops",
                    "moe_gather",
                    (pairs, 1, 1),
                    (256, 1, 1),
                    args![x.ptr(), pos, s.xs.ptr(), k as i32, d as i32],
                )?;
                self.launch(
                    &w.gate.names.module,
                    &w.gate.names.moe[2],
                    (ff.div_ceil(WARPS) as u32, ne as u32, 1),
                    (32, WARPS as u32, 1),
                    args![
                        gate_ptr,
                        up_ptr,
                        w.gate.row_bytes as i64,
                        expert_rows as i64,
                        off,
                        s.xs.ptr(),
                        s.act.ptr(),
                        ff as i32,
                        d as i32,
                        act
                    ],
                )?;
                self.launch(
                    &w.down.names.module,
                    &w.down.names.moe[3],
                    (d.div_ceil(WARPS) as u32, ne as u32, 1),
                    (32, WARPS as u32, 1),
                    args![
                        w.down.data.ptr,
                        w.down.row_bytes as i64,
                        d as i64,
                        off,
                        s.act.ptr(),
                        s.ys.ptr(),
                        d as i32,
                        ff as i32
                    ],
                )?;
            }
            MoePath::PairsInt8 => {
                // The tokens' rows quantized for gate and up, then the pairs' GLU outputs for
                // down (the scratch holds one set at a time; the stream orders them); in the
                // exact-sum order where the weights' names say so (moeqc).
                let bg = registry::int8_activations(w.gate.kernel).expect("an int8 type");
                let bd = registry::int8_activations(w.down.kernel).expect("an int8 type");
                let (q, dq, sq) = self.quantize_act(x.ptr(), rows, d, bg, w.gate.ty)?;
                self.launch(
                    &w.gate.names.module,
                    &w.gate.names.moeq[0],
                    (ff.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        gate_ptr,
                        up_ptr,
                        w.gate.row_bytes as i64,
                        expert_rows as i64,
                        s.routes.ptr(),
                        q,
                        dq,
                        sq,
                        s.act.ptr(),
                        ff as i32,
                        d as i32,
                        k as i32,
                        act,
                        bg as i32
                    ],
                )?;
                let (q, dq, sq) = self.quantize_act(s.act.ptr(), pairs_n, ff, bd, w.down.ty)?;
                self.launch(
                    &w.down.names.module,
                    &w.down.names.moeq[1],
                    (d.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        w.down.data.ptr,
                        w.down.row_bytes as i64,
                        d as i64,
                        s.routes.ptr(),
                        q,
                        dq,
                        sq,
                        s.ys.ptr(),
                        d as i32,
                        ff as i32,
                        bd as i32
                    ],
                )?;
            }
            MoePath::PairsF32 => {
                self.launch(
                    &w.gate.names.module,
                    &w.gate.names.moe[0],
                    (ff.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        gate_ptr,
                        up_ptr,
                        w.gate.row_bytes as i64,
                        expert_rows as i64,
                        s.routes.ptr(),
                        x.ptr(),
                        s.act.ptr(),
                        ff as i32,
                        d as i32,
                        k as i32,
                        act
                    ],
                )?;
                self.launch(
                    &w.down.names.module,
                    &w.down.names.moe[1],
                    (d.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        w.down.data.ptr,
                        w.down.row_bytes as i64,
                        d as i64,
                        s.routes.ptr(),
                        s.act.ptr(),
                        s.ys.ptr(),
                        d as i32,
                        ff as i32
                    ],
                )?;
            }
        }
        self.moe_sum(&s, pos, scale, out, k, d, rows)
    }

    /// The experts' kernels for a step of `rows` tokens (see [`MoePath`]).
    fn moe_path(
        &self,
        w: &MoeWeights<'_, CudaWeight>,
        s: &MoeScratch<'_, CudaBuf>,
        p: &MoeParams,
        rows: usize,
        d: usize,
    ) -> MoePath {
        let (ne, k, ff) = (p.n_expert, p.n_used, p.n_ff);
        let sizes = p.scratch_floats(rows, d);
        let pairs = rows * k;
        let int8 = registry::int8_activations(w.gate.kernel).is_some()
            && registry::int8_activations(w.down.kernel).is_some();
        let invariant = self.cfg.numerics == Numerics::BatchInvariant;
        // moeqc and imm_g: a pair's bits whatever the step's other pairs.
        let exact = invariant && registry::int8_mma(w.gate.kernel) && registry::int8_mma(w.down.kernel);
        // Grouped by expert from about a pair per expert, where the logits' buffer holds the
        // sort; on the tensor cores where it also holds the tile list.
        let grouped = pairs >= ne && rows * ne >= ne + 1 + pairs;
        let tiles = grouped
            && s.gate.len >= sizes[3]
            && s.up.len >= sizes[4]
            && rows * ne >= 2 * ne + 2 + pairs + pairs.div_ceil(QMM_BN);
        let fused = std::ptr::eq(w.gate, w.up);
        let (er, up_off) = if fused { (2 * ff, ff) } else { (ff, 0) };
        let colsp = crate::wmm::permuted_cols;
        match (exact, invariant) {
            (true, _) if tiles => MoePath::GroupedImm,
            (true, _) => MoePath::PairsInt8,
            (false, false) if tiles => {
                let wmm = self.wmm_grouped_fits(w.gate, er, 0)
                    && self.wmm_grouped_fits(w.up, er, up_off)
                    && self.wmm_grouped_fits(w.down, d, 0)
                    && 2 * s.ys.len >= pairs * colsp(d)
                    && 2 * s.xs.len >= pairs * colsp(ff);
                if wmm {
                    MoePath::GroupedWmm
                } else {
                    MoePath::GroupedQmm
                }
            }
            _ if grouped => MoePath::GroupedF32,
            (false, false) if int8 => MoePath::PairsInt8,
            _ => MoePath::PairsF32,
        }
    }

    /// out[t] = Σ_j weight(t, j) · ys[row of pair (t, j)] (`pos`: the sorted rows, or 0).
    #[allow(clippy::too_many_arguments)]
    fn moe_sum(
        &self,
        s: &MoeScratch<'_, CudaBuf>,
        pos: u64,
        scale: u64,
        out: &mut CudaBuf,
        k: usize,
        d: usize,
        rows: usize,
    ) -> Result<()> {
        self.launch(
            "ops",
            "moe_sum",
            (rows as u32, d.div_ceil(256).min(64) as u32, 1),
            (256, 1, 1),
            args![
                s.ys.ptr(),
                s.routes.ptr(),
                pos,
                scale,
                out.ptr(),
                k as i32,
                d as i32
            ],
        )
    }
}
