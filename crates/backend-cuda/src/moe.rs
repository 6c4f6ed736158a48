//! Mixture-of-experts FFN on the device: the router's product, routing by a kernel (so a
//! decode step stays inside its captured graph), the experts' products reading only the chosen
//! experts' rows of the stacked 3-D tensors, and the weighted sum in slot order.
//!
//! With the batch-invariant numerics a row's experts do not depend on the step's other rows,
//! each kind of row (kinds.rs) on its own kernels as the dense products are: decode rows of the
//! int8 tensor-core types (`registry::int8_mma`) in the exact-sum order, few pairs one warp per
//! output row of each pair (kernels/mmvq.cu `moeqc_*`), many sorted by expert and each expert's
//! in tiles of 8 or 16 on imv (kernels/imm.cu `imv_g`), the same bits; decode rows of the other types
//! on CUDA cores over f32 (kernels/mmv.cu `moe_*`, pair-wise or grouped: the same bits); prompt
//! rows always sorted and on the tensor cores, whose per-element order does not depend on the
//! tile's other pairs (kernels/wmm.cu `wmm_g` on sm_90 Hopper's warpgroup products where the
//! weights' rows allow, else kernels/qmm.cu `qmm_g`). The fast numerics choose by the step's
//! pair count alone: the tensor cores for many, the float-order int8 kernels (`moeq_*`) for few.

use crate::batch::BatchView;
use crate::kinds::Kind;
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
    /// Sorted, each expert's pairs in tiles of 8·n (n = 1, 2 n8 tiles) on the int8 tensor cores
    /// (imm.cu `imv_g`): `moeqc`'s bits.
    GroupedImv(usize),
    /// Sorted, tiles on Hopper's warpgroup products (wmm.cu `wmm_g`).
    GroupedWmm,
    /// Sorted, tiles on the f16 tensor cores (qmm.cu `qmm_g`).
    GroupedQmm,
}

impl MoePath {
    /// Whether the pairs are sorted by expert (moe_group), their outputs at their sorted rows.
    fn sorted(self) -> bool {
        !matches!(self, MoePath::PairsF32 | MoePath::PairsInt8)
    }

    /// The pairs of one expert a tile takes (moe_group's tile list).
    fn tile(self) -> usize {
        match self {
            MoePath::GroupedImv(n) => 8 * n,
            _ => QMM_BN,
        }
    }
}

/// Decode's pairs from which the exact-sum experts take imv_g rather than moeqc (the same
/// bits): from half a pair per expert. Measured on an H100 (8 layers of Qwen3-30B-A3B Q4_K_M,
/// 128 experts): at 8 sequences (64 pairs) imv_g 4,283.7 t/s against moeqc's 3,552.7; at one
/// (8 pairs) 1,164.7 against 1,332.3.
fn imv_g_from(ne: usize, pairs: usize) -> bool {
    2 * pairs >= ne
}

/// Decode's pairs per expert (the step's average) from which imv's two n8 tiles (16 pairs)
/// take a tile.
const IMV2_PAIRS: usize = 6;

/// Where the experts' gate and up rows lie: each expert's `er` rows from `gate` / `up` (gate and
/// up in one tensor, Qwen 3.5 MoE: each expert's 2·ff rows, the gate's first, so `up` is the
/// gate's address plus ff rows and `up_row` = ff, the offset wmm's maps take).
#[derive(Clone, Copy)]
struct Layout {
    er: usize,
    gate: u64,
    up: u64,
    up_row: usize,
}

impl Layout {
    fn of(w: &MoeWeights<'_, CudaWeight>, ff: usize) -> Layout {
        if std::ptr::eq(w.gate, w.up) {
            let up = w.gate.data.ptr + (ff * w.gate.row_bytes) as u64;
            Layout {
                er: 2 * ff,
                gate: w.gate.data.ptr,
                up,
                up_row: ff,
            }
        } else {
            Layout {
                er: ff,
                gate: w.gate.data.ptr,
                up: w.up.data.ptr,
                up_row: 0,
            }
        }
    }
}

/// A part of a step's rows: its first row's pointers into the op's buffers (x, out, routes) and
/// the scratch's buffers (sort: the router logits' buffer, spent by then), and its row count.
#[derive(Clone, Copy)]
struct Rows {
    x: u64,
    out: u64,
    routes: u64,
    sort: u64,
    sort_len: usize,
    xs: u64,
    gate: u64,
    up: u64,
    act: u64,
    ys: u64,
    xs_len: usize,
    ys_len: usize,
    n: usize,
}

/// DeepSeek-V4's routing (dsv4.cu `moe_route_dsv4`) and its clamped SwiGLU.
#[derive(Clone, Copy)]
pub(crate) struct DsRoute {
    pub(crate) view: BatchView,
    /// exp_probs_b [n_expert] (0: none) and the hash table [n_vocab, n_used] (0: none).
    pub(crate) bias: u64,
    pub(crate) hash: u64,
    /// The SwiGLU's limit (0: none).
    pub(crate) clamp: f32,
}

impl CudaBackend {
    /// The MoE op, routed by `moe_route` or (`ds`) DeepSeek-V4's routing.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_routed(
        &self,
        x: &CudaBuf,
        rows: usize,
        w: MoeWeights<'_, CudaWeight>,
        p: &MoeParams,
        s: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
        ds: Option<DsRoute>,
    ) -> Result<()> {
        let d = w.router.cols;
        let (ne, k, ff) = (p.n_expert, p.n_used, p.n_ff);
        let lay = Layout::of(&w, ff);
        let sizes = p.scratch_floats(rows, d);
        check(
            "moe",
            // (Every expert held: CUDA has no tensor-parallel ranks.)
            p.held == (0, ne)
                && w.router.rows == ne
                && w.gate.rows == ne * lay.er
                && w.up.rows == ne * lay.er
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
                && s.xs.len >= sizes[2]
                && s.gate.len >= sizes[3]
                && s.up.len >= sizes[4]
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
        let mut act = crate::products::act_code(p.act);
        match ds {
            Some(r) => {
                if r.clamp > 0.0 {
                    act = crate::activation::clamp_code(r.clamp)?;
                }
                self.launch(
                    "ops",
                    "moe_route_dsv4",
                    (rows as u32, 1, 1),
                    (32, 1, 1),
                    args![
                        r.view,
                        s.logits.ptr(),
                        s.routes.ptr(),
                        ne as i32,
                        k as i32,
                        r.bias,
                        r.hash,
                        p.norm as i32,
                        p.scale
                    ],
                )?
            }
            None => self.launch(
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
            )?,
        }
        // The step's decode rows, then its prompt rows (one part unless the kinds route).
        let all = Rows {
            x: x.ptr(),
            out: out.ptr(),
            routes: s.routes.ptr(),
            sort: s.logits.ptr(),
            sort_len: s.logits.len,
            xs: s.xs.ptr(),
            gate: s.gate.ptr(),
            up: s.up.ptr(),
            act: s.act.ptr(),
            ys: s.ys.ptr(),
            xs_len: s.xs.len,
            ys_len: s.ys.len,
            n: rows,
        };
        let invariant = self.cfg.numerics == Numerics::BatchInvariant;
        let dr = if invariant {
            self.decode_rows(rows)
        } else {
            rows
        };
        for (r0, n, kind) in [(0, dr, Kind::Decode), (dr, rows - dr, Kind::Prompt)] {
            if n > 0 {
                let part = Rows {
                    x: all.x + (4 * r0 * d) as u64,
                    out: all.out + (4 * r0 * d) as u64,
                    routes: all.routes + (8 * r0 * k) as u64,
                    n,
                    ..all
                };
                let path = self.moe_path(&w, lay, p, &part, d, kind);
                self.experts(&w, lay, p, &part, d, path, act)?;
                self.moe_sum(&part, path, scale, p, d)?;
            }
        }
        Ok(())
    }

    /// The experts' kernels for `r.n` rows of `kind` (see [`MoePath`]).
    fn moe_path(
        &self,
        w: &MoeWeights<'_, CudaWeight>,
        lay: Layout,
        p: &MoeParams,
        r: &Rows,
        d: usize,
        kind: Kind,
    ) -> MoePath {
        let (ne, pairs) = (p.n_expert, r.n * p.n_used);
        let invariant = self.cfg.numerics == Numerics::BatchInvariant;
        let int8 = registry::int8_activations(w.gate.kernel).is_some()
            && registry::int8_activations(w.down.kernel).is_some();
        // moeqc and imv_g: a pair's bits whatever the step's other pairs.
        let exact = registry::int8_mma(w.gate.kernel) && registry::int8_mma(w.down.kernel);
        // Grouped by expert from about a pair per expert.
        let many = pairs >= ne;
        let tensor_cores = || {
            let colsp = crate::wmm::permuted_cols;
            let wmm = self.wmm_grouped_fits(w.gate, lay.er, 0)
                && self.wmm_grouped_fits(w.up, lay.er, lay.up_row)
                && self.wmm_grouped_fits(w.down, d, 0)
                && 2 * r.ys_len >= pairs * colsp(d)
                && 2 * r.xs_len >= pairs * colsp(p.n_ff);
            if wmm {
                MoePath::GroupedWmm
            } else {
                MoePath::GroupedQmm
            }
        };
        let imv_fits = |nt| {
            [w.gate, w.up, w.down]
                .iter()
                .all(|m| crate::imm::imv_g_fits(m, nt))
        };
        // Experts with an F32 weight on the f32 kernels in every mode (as the dense F32
        // products; F32 has no tensor-core kernels, and the f32 kernels take every type).
        let f32 = [w.gate, w.up, w.down].iter().any(|m| m.kernel == "f32");
        match (invariant, kind) {
            _ if f32 && many => MoePath::GroupedF32,
            _ if f32 => MoePath::PairsF32,
            (true, Kind::Prompt) => tensor_cores(),
            (true, Kind::Decode) if exact && imv_g_from(ne, pairs) && imv_fits(1) => {
                MoePath::GroupedImv(if pairs / ne >= IMV2_PAIRS && imv_fits(2) {
                    2
                } else {
                    1
                })
            }
            (true, Kind::Decode) if exact => MoePath::PairsInt8,
            (true, Kind::Decode) if many => MoePath::GroupedF32,
            (true, Kind::Decode) => MoePath::PairsF32,
            (false, _) if many => tensor_cores(),
            (false, _) if int8 => MoePath::PairsInt8,
            (false, _) => MoePath::PairsF32,
        }
    }

    /// The experts' products of the rows `r` by `path`, each pair's output into ys (at its
    /// sorted row where the path sorts).
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &self,
        w: &MoeWeights<'_, CudaWeight>,
        lay: Layout,
        p: &MoeParams,
        r: &Rows,
        d: usize,
        path: MoePath,
        act: i32,
    ) -> Result<()> {
        let (ne, k, ff) = (p.n_expert, p.n_used, p.n_ff);
        let (er, gate_ptr, up_ptr) = (lay.er, lay.gate, lay.up);
        let pairs_n = r.n * k;
        let pairs = pairs_n as u32;
        let (off, pos, tiles) = Self::sort_at(r, ne, pairs_n);
        let max_tiles = pairs_n.div_ceil(path.tile()) + ne;
        let g = (off, tiles, max_tiles);
        if path.sorted() {
            // The sort and the tile list in the logits' buffer (MoeParams::scratch_floats).
            let need = sort_floats(ne, pairs_n, path.tile());
            check("moe", r.sort_len >= need, || {
                format!(
                    "{} floats for a sort of {pairs_n} pairs ({need})",
                    r.sort_len
                )
            })?;
            // The tile list with the sort, where the path reads one.
            let bn = if path == MoePath::GroupedF32 {
                0
            } else {
                path.tile() as i32
            };
            self.launch(
                "ops",
                "moe_group",
                (1, 1, 1),
                (1024, 1, 1),
                args![r.routes, off, pos, tiles, pairs as i32, ne as i32, bn],
            )?;
        }
        let gather = |name: &str| {
            self.launch(
                "ops",
                name,
                (pairs, 1, 1),
                (256, 1, 1),
                args![r.x, pos, r.xs, k as i32, d as i32],
            )
        };
        match path {
            MoePath::GroupedImv(nt) => {
                // The pairs' inputs gathered and quantized, gate and up, the GLU, its output
                // quantized, down: each pair's bits as moeqc's.
                let (bg, bd) = int8_blocks(w);
                gather("moe_gather")?;
                let a = self.quantize_act(r.xs, pairs_n, d, bg, w.gate.ty)?;
                if w.gate.kernel == w.up.kernel && w.gate.row_bytes == w.up.row_bytes {
                    // Gate and up in one launch.
                    self.imv_grouped(
                        w.gate,
                        &[(gate_ptr, r.gate), (up_ptr, r.up)],
                        er,
                        ff,
                        a,
                        g,
                        nt,
                    )?;
                } else {
                    self.imv_grouped(w.gate, &[(gate_ptr, r.gate)], er, ff, a, g, nt)?;
                    self.imv_grouped(w.up, &[(up_ptr, r.up)], er, ff, a, g, nt)?;
                }
                self.glu_code(act, r.gate, r.up, pairs_n * ff, r.act)?;
                let a = self.quantize_act(r.act, pairs_n, ff, bd, w.down.ty)?;
                self.imv_grouped(w.down, &[(w.down.data.ptr, r.ys)], d, d, a, g, nt)
            }
            MoePath::GroupedWmm => {
                // The pairs' inputs gathered (xs), rounded and permuted into ys (free until
                // down), gate and up, the GLU, its output permuted into xs, down into ys.
                gather("moe_gather")?;
                self.permute_to(r.xs, pairs_n, d, w.gate.ty, r.ys)?;
                self.wmm_grouped(w.gate, 0, ff, er, r.ys, pairs_n, r.gate, g)?;
                self.wmm_grouped(w.up, lay.up_row, ff, er, r.ys, pairs_n, r.up, g)?;
                self.glu_code(act, r.gate, r.up, pairs_n * ff, r.act)?;
                self.permute_to(r.act, pairs_n, ff, w.down.ty, r.xs)?;
                self.wmm_grouped(w.down, 0, d, d, r.xs, pairs_n, r.ys, g)
            }
            MoePath::GroupedQmm => {
                // The pairs' inputs in f16 (in xs), gate and up, the GLU, its output in f16
                // (in gate), down.
                gather("moe_gather_h")?;
                self.qmm_grouped(
                    w.gate, gate_ptr, er, ff, r.xs, r.gate, off, tiles, max_tiles,
                )?;
                self.qmm_grouped(w.up, up_ptr, er, ff, r.xs, r.up, off, tiles, max_tiles)?;
                self.glu_code(act, r.gate, r.up, pairs_n * ff, r.act)?;
                self.to_half_plain(r.act, r.gate, pairs_n * ff)?;
                let dw = w.down.data.ptr;
                self.qmm_grouped(w.down, dw, d, d, r.gate, r.ys, off, tiles, max_tiles)
            }
            MoePath::GroupedF32 => {
                gather("moe_gather")?;
                self.launch(
                    &w.gate.names.module,
                    &w.gate.names.moe[2],
                    (ff.div_ceil(WARPS) as u32, ne as u32, 1),
                    (32, WARPS as u32, 1),
                    args![
                        gate_ptr,
                        up_ptr,
                        w.gate.row_bytes as i64,
                        er as i64,
                        off,
                        r.xs,
                        r.act,
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
                        r.act,
                        r.ys,
                        d as i32,
                        ff as i32
                    ],
                )
            }
            MoePath::PairsInt8 => {
                // The tokens' rows quantized for gate and up, then the pairs' GLU outputs for
                // down (the scratch holds one set at a time; the stream orders them); in the
                // exact-sum order where the weights' names say so (moeqc).
                let (bg, bd) = int8_blocks(w);
                let (q, dq, sq) = self.quantize_act(r.x, r.n, d, bg, w.gate.ty)?;
                self.launch(
                    &w.gate.names.module,
                    &w.gate.names.moeq[0],
                    (ff.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        gate_ptr,
                        up_ptr,
                        w.gate.row_bytes as i64,
                        er as i64,
                        r.routes,
                        q,
                        dq,
                        sq,
                        r.act,
                        ff as i32,
                        d as i32,
                        k as i32,
                        act,
                        bg as i32
                    ],
                )?;
                let (q, dq, sq) = self.quantize_act(r.act, pairs_n, ff, bd, w.down.ty)?;
                self.launch(
                    &w.down.names.module,
                    &w.down.names.moeq[1],
                    (d.div_ceil(WARPS) as u32, pairs, 1),
                    (32, WARPS as u32, 1),
                    args![
                        w.down.data.ptr,
                        w.down.row_bytes as i64,
                        d as i64,
                        r.routes,
                        q,
                        dq,
                        sq,
                        r.ys,
                        d as i32,
                        ff as i32,
                        bd as i32
                    ],
                )
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
                        er as i64,
                        r.routes,
                        r.x,
                        r.act,
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
                        r.routes,
                        r.act,
                        r.ys,
                        d as i32,
                        ff as i32
                    ],
                )
            }
        }
    }

    /// Where the sort of `pairs` pairs over `ne` experts lies in the router logits' buffer
    /// (`MoeParams::scratch_floats` leaves room): off (n_expert + 1 ints), pos (a pair each),
    /// the tile list (a count, then at most pairs / tile + n_expert tiles).
    fn sort_at(r: &Rows, ne: usize, pairs: usize) -> (u64, u64, u64) {
        let off = r.sort;
        let pos = off + 4 * (ne as u64 + 1);
        (off, pos, pos + 4 * pairs as u64)
    }

    /// out[t] = Σ_j weight(t, j) · ys[row of pair (t, j)] over the rows `r` (the sorted rows
    /// where `path` sorts).
    fn moe_sum(&self, r: &Rows, path: MoePath, scale: u64, p: &MoeParams, d: usize) -> Result<()> {
        let k = p.n_used;
        let pos = if path.sorted() {
            Self::sort_at(r, p.n_expert, r.n * k).1
        } else {
            0
        };
        self.launch(
            "ops",
            "moe_sum",
            (r.n as u32, d.div_ceil(256).min(64) as u32, 1),
            (256, 1, 1),
            args![r.ys, r.routes, pos, scale, r.out, k as i32, d as i32],
        )
    }
}

/// Floats (ints) the sort of `pairs` pairs over `ne` experts takes ([`CudaBackend::sort_at`]'s
/// layout): off, pos, the tile list's count and its tiles of `tile` pairs.
fn sort_floats(ne: usize, pairs: usize, tile: usize) -> usize {
    (ne + 1) + pairs + 1 + pairs.div_ceil(tile) + ne
}

/// The int8 activations' block lengths of gate (and up) and of down.
fn int8_blocks(w: &MoeWeights<'_, CudaWeight>) -> (usize, usize) {
    let b = |w: &CudaWeight| registry::int8_activations(w.kernel).expect("an int8 type");
    (b(w.gate), b(w.down))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_backend::Activation;

    /// `MoeParams::scratch_floats` leaves the logits' buffer room for every sorted path's sort
    /// (the smallest tile, imv_g's 8 pairs, needs the most), at any row count.
    #[test]
    fn the_logits_buffer_holds_every_sort() {
        for (ne, k) in [(4, 2), (16, 4), (128, 8), (256, 8)] {
            let p = MoeParams {
                n_expert: ne,
                n_used: k,
                n_ff: 64,
                gating: Gating::Softmax,
                norm: true,
                scale: 1.0,
                act: Activation::SwiGlu,
                router_given: false,
                held: (0, ne),
            };
            for rows in [1, 2, 7, 64, 300, 4096] {
                let room = p.scratch_floats(rows, 64)[0];
                for path in [
                    MoePath::GroupedImv(1),
                    MoePath::GroupedImv(2),
                    MoePath::GroupedQmm,
                ] {
                    let need = sort_floats(ne, rows * k, path.tile());
                    assert!(need <= room, "{ne} experts, {rows} rows: {need} > {room}");
                }
            }
        }
    }
}
