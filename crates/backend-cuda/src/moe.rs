//! Mixture-of-experts FFN on the device: the router's product, routing by a kernel (so a
//! decode step stays inside its captured graph), the experts' products reading only the chosen
//! experts' rows of the stacked 3-D tensors, and the weighted sum in slot order. Few tokens: one
//! warp per output row of every (token, slot) pair. Many: the pairs sorted by expert on the
//! device and each expert's tokens run 8 at a time per weight row on CUDA cores, or (with
//! `moe_qmm`) each expert's tokens in tiles of 64 on the tensor cores (kernels/qmm.cu
//! `qmm_g_T`; on sm_90 Hopper's warpgroup products, kernels/wmm.cu `wmm_g_T`). The CUDA-core
//! kernels give a token the same bits either way. Few tokens with `moe_int8`: the pair-wise
//! kernels on int8 activations (kernels/mmvq.cu `moeq_*_T`).

use crate::memory::CudaBuf;
use crate::qmm::QMM_BN;
use crate::weights::CudaWeight;
use crate::{check, registry, CudaBackend};
use quiver_backend::{Activation, Gating, MoeParams, MoeScratch, MoeWeights, Result};

const WARPS: usize = 4;

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
        let act = match p.act {
            Activation::SwiGlu => 0i32,
            Activation::GeGlu => 1,
        };
        // Grouped by expert once there is about a pair per expert: the router's logits are
        // spent by then, and their buffer holds the sort (off: n_expert + 1 ints, pos: a pair).
        let grouped = rows * k >= ne && rows * ne >= ne + 1 + rows * k;
        // On the tensor cores (`moe_qmm`) where the logits' buffer also holds the tile list.
        let tc = grouped
            && s.gate.len >= sizes[3]
            && s.up.len >= sizes[4]
            && rows * ne >= 2 * ne + 2 + rows * k + (rows * k).div_ceil(QMM_BN);
        let pos = if grouped {
            let off = s.logits.ptr();
            let pos = off + 4 * (ne as u64 + 1);
            self.launch(
                "ops",
                "moe_group",
                (1, 1, 1),
                (1024, 1, 1),
                args![s.routes.ptr(), off, pos, pairs as i32, ne as i32],
            )?;
            if tc {
                // The tensor cores: the pairs' inputs in f16 (in xs), gate and up by the
                // grouped qmm, the GLU, its output in f16 (in gate), down by the grouped qmm.
                let tiles = pos + 4 * pairs as u64;
                self.launch(
                    "ops",
                    "moe_tiles",
                    (1, 1, 1),
                    (32, 1, 1),
                    args![off, tiles, ne as i32, QMM_BN as i32],
                )?;
                let max_tiles = (rows * k).div_ceil(QMM_BN) + ne;
                let er = expert_rows;
                let (up_off, pairs_n) = (if fused { ff } else { 0 }, rows * k);
                // On Hopper's warpgroup products where the experts' rows allow: the pairs'
                // inputs gathered (xs), rounded and permuted into ys (free until down), gate
                // and up, the GLU, its output permuted into xs, down into ys.
                let colsp = |c: usize| crate::wmm::permuted_cols(c);
                if self.wmm_grouped_fits(w.gate, er, 0)
                    && self.wmm_grouped_fits(w.up, er, up_off)
                    && self.wmm_grouped_fits(w.down, d, 0)
                    && 2 * s.ys.len >= pairs_n * colsp(d)
                    && 2 * s.xs.len >= pairs_n * colsp(ff)
                {
                    let g = (off, tiles, max_tiles);
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
                    return self.moe_sum(&s, pos, scale, out, k, d, rows);
                }
                let xh = s.xs.ptr();
                self.launch(
                    "ops",
                    "moe_gather_h",
                    (pairs, 1, 1),
                    (256, 1, 1),
                    args![x.ptr(), pos, xh, k as i32, d as i32],
                )?;
                self.qmm_grouped(
                    w.gate,
                    gate_ptr,
                    er,
                    ff,
                    xh,
                    s.gate.ptr(),
                    off,
                    tiles,
                    max_tiles,
                )?;
                self.qmm_grouped(w.up, up_ptr, er, ff, xh, s.up.ptr(), off, tiles, max_tiles)?;
                self.glu_fast(p.act, s.gate, s.up, rows * k * ff, s.act)?;
                let ah = s.gate.ptr();
                self.to_half_plain(s.act.ptr(), ah, rows * k * ff)?;
                let down = w.down.data.ptr;
                self.qmm_grouped(w.down, down, d, d, ah, s.ys.ptr(), off, tiles, max_tiles)?;
                return self.moe_sum(&s, pos, scale, out, k, d, rows);
            }
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
            pos
        } else if let (true, Some(bg), Some(bd)) = (
            true,
            registry::int8_activations(w.gate.kernel),
            registry::int8_activations(w.down.kernel),
        ) {
            // On int8 activations: the tokens' rows quantized for gate and up, then the pairs'
            // GLU outputs for down (the scratch holds one set at a time; the stream orders them).
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
            let (q, dq, sq) = self.quantize_act(s.act.ptr(), rows * k, ff, bd, w.down.ty)?;
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
            0u64
        } else {
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
            0u64
        };
        self.moe_sum(&s, pos, scale, out, k, d, rows)
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
