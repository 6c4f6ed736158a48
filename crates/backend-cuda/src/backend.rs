//! The fast backend's `Backend` impl: each op checks its shapes, then runs its entry point
//! (src/products.rs, attention.rs, norm.rs, rope.rs, activation.rs, embed.rs, sampling.rs,
//! moe.rs, extras.rs) on the families of the kernel table (src/plan.rs). The parity mode is
//! a backend of its own (src/parity.rs) that shares the shape checks below.

use crate::attention::check_attention;
use crate::batch::CudaStep;
use crate::embed::check_embed;
use crate::kinds::Kind;
use crate::memory::{CudaBuf, CudaKv};
use crate::norm::Norm;
use crate::products::{check_glu, check_matmul};
use crate::rope::check_rope_kv_write;
use crate::weights::{rows_cols, CudaWeight};
use crate::{check, CudaBackend};
use quiver_backend::{
    Activation, AttnParams, Backend, BackendError, Batch, ExtraOp, KvSpec, MoeParams, MoeScratch,
    MoeWeights, Result, RopeParams, Step, WeightBytes, WorkspaceSpec,
};
use quiver_gguf::GgmlType;

/// The shapes of `add`.
pub(crate) fn check_add(a: &CudaBuf, b: &CudaBuf, n: usize) -> Result<()> {
    check("add", a.len >= n && b.len >= n, || {
        format!("{n} over {} / {}", a.len, b.len)
    })
}

/// The shapes of `matmul_many`.
pub(crate) fn check_many(
    w: &[&CudaWeight],
    x: &CudaBuf,
    rows_x: usize,
    out: &[&mut CudaBuf],
) -> Result<()> {
    quiver_backend::check_many(w.len(), out.len())?;
    for (m, o) in w.iter().zip(out) {
        check(
            "matmul",
            x.len >= rows_x * m.cols && o.len >= rows_x * m.rows,
            || format!("{rows_x} rows"),
        )?;
    }
    Ok(())
}

/// The shapes of `matmul_logits` over `n` rows.
pub(crate) fn check_logits(w: &CudaWeight, n: usize, out: &CudaBuf) -> Result<()> {
    check("matmul_logits", out.len >= n * w.rows, || {
        format!("out {} for {n}×{}", out.len, w.rows)
    })
}

/// The shapes of `softcap`.
pub(crate) fn check_softcap(x: &CudaBuf, n: usize) -> Result<()> {
    check("softcap", x.len >= n, || format!("{n} > {}", x.len))
}

/// A step's attention shapes: every head dim of `ws` has kernels (a load-time error, not a
/// failed first step).
pub(crate) fn check_head_dims(ws: &WorkspaceSpec) -> Result<()> {
    match ws
        .attention
        .iter()
        .find(|(_, hd)| !crate::attention::HEAD_DIMS.contains(hd))
    {
        Some(&(_, hd)) => Err(BackendError::Shape {
            op: "attention",
            detail: format!(
                "head dim {hd} has no CUDA kernels (built: {:?})",
                crate::attention::HEAD_DIMS
            ),
        }),
        None => Ok(()),
    }
}

/// The KV cache of `spec`'s layer `layer` (checked).
pub(crate) fn make_kv(be: &CudaBackend, spec: &KvSpec, layer: usize) -> Result<CudaKv> {
    spec.check()
        .map_err(|detail| BackendError::Shape { op: "kv", detail })?;
    if spec.k.key_blocks() {
        // tq4 keys are per-block records with exact keys kept aside (quiver_backend::kblock):
        // their kernels are not written yet (docs/TURBOQUANT.md, "tq4 keys").
        return Err(BackendError::Shape {
            op: "kv",
            detail: "the cuda backend has no tq4 keys yet (per-block records); tq8 keys with \
                     tq4 values (what --kv-type tq4 names) run there"
                .into(),
        });
    }
    let types = quiver_backend::KvTypes {
        k: spec.k,
        v: spec.v,
    };
    be.zeroed_kv(spec.n_slots, spec.layers[layer], types)
}

/// A norm over its rows (checked), by `run`.
pub(crate) fn norm_with(n: &Norm, run: impl FnOnce(&Norm) -> Result<()>) -> Result<()> {
    n.check()?;
    if n.rows == 0 {
        return Ok(());
    }
    run(n)
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type StepCtx = CudaStep;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn weight(
        &self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        bytes: WeightBytes,
    ) -> Result<CudaWeight> {
        self.dev.bind().map_err(BackendError::Device)?;
        let (rows, cols) = rows_cols(shape);
        if rows == 1 {
            return self.vector_weight(name, ty, cols, &bytes);
        }
        self.matrix_weight(name, ty, rows, cols, &bytes)
    }

    fn weight_rows(&self, w: &CudaWeight) -> usize {
        w.rows
    }

    fn memory_available(&self) -> Option<u64> {
        match self.dev.mem_info() {
            (0, 0) => None,
            (free, _) => Some(free),
        }
    }

    fn weights_bytes(&self) -> Option<u64> {
        Some(self.mem_stats().weights)
    }

    fn workspace_bytes(&self, ws: &WorkspaceSpec) -> u64 {
        self.scratch_bytes(ws)
    }

    fn reserve_workspace(&self, ws: &WorkspaceSpec) -> Result<()> {
        check_head_dims(ws)?;
        self.reserve_scratch(ws)
    }

    fn buf(&self, n: usize) -> Result<CudaBuf> {
        self.zeroed_buf(n)
    }

    fn kv(&self, spec: &KvSpec, layer: usize) -> Result<CudaKv> {
        make_kv(self, spec, layer)
    }

    fn begin_step<'b>(
        &mut self,
        batch: &'b Batch,
        state: u64,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<Step<'b, CudaStep>> {
        self.begin(batch, state, max_tokens, max_logits)
    }

    fn end_step(&mut self, ok: bool) -> Result<bool> {
        Ok(self.graphs.end(ok, self.dev.stream))
    }

    fn embed(
        &self,
        st: &Step<CudaStep>,
        table: &CudaWeight,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.embed_part(st, table, 0, scale, out)
    }

    fn embed_part(
        &self,
        st: &Step<CudaStep>,
        table: &CudaWeight,
        first: usize,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check_embed(table, st.rows, out)?;
        self.embed_fast(st, table, first, scale, out)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        norm_with(&Norm::of(x, w, eps, rows, out), |n| self.norm_fast(n))
    }

    fn rms_norm_inplace(
        &self,
        x: &mut CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        norm_with(&Norm::of(x, w, eps, rows, x), |n| self.norm_fast(n))
    }

    fn rms_norm_gated(
        &self,
        x: &mut CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        cols: usize,
        gate: &CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check("rms_norm_gated", w.cols == cols, || {
            format!("a norm of {} over rows of {cols}", w.cols)
        })?;
        norm_with(&Norm::of(x, w, eps, rows, out).gated(gate), |n| {
            self.norm_fast(n)
        })
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        norm_with(&Norm::with_residual(residual, x, w, eps, rows, out), |n| {
            self.norm_fast(n)
        })
    }

    fn add(&self, a: &mut CudaBuf, b: &CudaBuf, n: usize) -> Result<()> {
        check_add(a, b, n)?;
        self.add_kernel(a.ptr(), b.ptr(), n)
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaWeight, rows: usize) -> Result<()> {
        let cols = bias.cols;
        check(
            "add_bias",
            bias.rows == 1 && x.len >= rows * cols && cols > 0,
            || format!("{rows}×{cols} over {}", x.len),
        )?;
        self.add_bias_kernel(x.ptr(), bias.data.ptr, rows * cols, cols)
    }

    fn moe(
        &self,
        x: &CudaBuf,
        rows: usize,
        w: MoeWeights<'_, CudaWeight>,
        p: &MoeParams,
        s: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.moe_routed(x, rows, w, p, s, out, None)
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaBuf, rows_x: usize, out: &mut CudaBuf) -> Result<()> {
        check_matmul(w, x, rows_x, out)?;
        self.mm(w, x.ptr(), rows_x, out.ptr())
    }

    fn matmul_many(
        &self,
        w: &[&CudaWeight],
        x: &CudaBuf,
        rows_x: usize,
        out: &mut [&mut CudaBuf],
    ) -> Result<()> {
        check_many(w, x, rows_x, out)?;
        let mut ys = [0u64; crate::products::MANY_MAX];
        if w.len() > ys.len() {
            for (m, o) in w.iter().zip(out.iter()) {
                self.mm(m, x.ptr(), rows_x, o.ptr())?;
            }
            return Ok(());
        }
        for (y, o) in ys.iter_mut().zip(out.iter()) {
            *y = o.ptr();
        }
        self.matmul_many_fast(w, x.ptr(), rows_x, &ys[..w.len()])
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_glu(
        &self,
        act: Activation,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: &CudaBuf,
        rows_x: usize,
        scratch: [&mut CudaBuf; 2],
        out: &mut CudaBuf,
    ) -> Result<()> {
        // Each path checks the buffers it uses (the fused one never touches `scratch`).
        self.matmul_glu_fast(
            crate::products::act_code(act),
            gate,
            up,
            x,
            rows_x,
            scratch,
            out,
        )
    }

    fn matmul_logits(
        &self,
        st: &Step<CudaStep>,
        w: &CudaWeight,
        x: &CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = st.logit_rows;
        check_logits(w, n, out)?;
        if n == 0 {
            return Ok(());
        }
        // Every logits row on the decode kernels (the same bits for any count).
        let rows = self.logits_input(st, w, x, n)?;
        self.mm_as(w, rows, n, out.ptr(), Kind::Decode)
    }

    fn rope_kv_write(
        &self,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CudaKv,
    ) -> Result<()> {
        check_rope_kv_write(q, k, v, rope, a, kv, st.rows)?;
        self.rope_kv_write_fast(st, q, k, v, rope, a, kv, None)
    }

    fn qk_norm_rope_kv_write(
        &self,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        norms: (&CudaWeight, &CudaWeight, f32),
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CudaKv,
    ) -> Result<()> {
        let (qn, kn, eps) = norms;
        // One launch; a norm of another length as three ops.
        if qn.cols != a.head_dim || kn.cols != a.head_dim {
            return quiver_backend::qk_norm_then_rope(self, st, q, k, v, norms, rope, a, kv);
        }
        check_rope_kv_write(q, k, v, rope, a, kv, st.rows)?;
        let norms = Some((qn.data.ptr, kn.data.ptr, eps));
        self.rope_kv_write_fast(st, q, k, v, rope, a, kv, norms)
    }

    fn attention(
        &self,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = st.rows;
        check_attention(q, kv, a, n, out)?;
        if n == 0 {
            return Ok(());
        }
        self.attention_fast(st, q, kv, a, out)
    }

    fn glu(
        &self,
        act: Activation,
        gate: &CudaBuf,
        up: &CudaBuf,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check_glu(gate, up, n, out)?;
        self.glu_fast(act, gate.ptr(), up.ptr(), n, out.ptr())
    }

    fn softcap(&self, x: &mut CudaBuf, cap: f32, n: usize) -> Result<()> {
        check_softcap(x, n)?;
        self.softcap_kernel(x, cap, n)
    }

    /// Every extra op (src/extras.rs).
    fn supports(&self, op: ExtraOp) -> bool {
        // Not yet: per-expert gate/up scales, an embedding split by vocabulary (no ranks).
        !matches!(op, ExtraOp::MoeProductScales | ExtraOp::EmbedPart)
    }

    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        step: &Step<CudaStep>,
        p: &quiver_backend::DeltaNetParams,
        w: quiver_backend::DeltaNetWeights<'_, CudaWeight>,
        qkv: &mut CudaBuf,
        alpha: &CudaBuf,
        beta: &CudaBuf,
        state: &mut CudaBuf,
        snaps: Option<quiver_backend::Snapshots<'_, CudaBuf>>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.delta_net_kernel(step, p, w, qkv, alpha, beta, state, snaps, out)
    }

    fn copy_range(
        &self,
        src: &CudaBuf,
        src_at: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        self.copy_range_kernel(src, src_at, dst, dst_at, n)
    }

    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &self,
        x: &CudaBuf,
        mixes: &CudaBuf,
        scale: &CudaWeight,
        base: &CudaWeight,
        p: &quiver_backend::dsv4::HcParams,
        head: bool,
        rows: usize,
        out: &mut CudaBuf,
        pc: &mut CudaBuf,
    ) -> Result<()> {
        self.hc_pre_kernel(x, mixes, scale, base, p, head, rows, out, pc, None)
    }

    fn hc_mix_pre(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        scale: &CudaWeight,
        base: &CudaWeight,
        p: &quiver_backend::dsv4::HcParams,
        head: bool,
        rows: usize,
        scratch: &mut CudaBuf,
        mixes: &mut CudaBuf,
        out: &mut CudaBuf,
        pc: &mut CudaBuf,
    ) -> Result<()> {
        self.hc_mix_pre_kernel(
            x,
            w,
            eps,
            (scale, base, p, head),
            rows,
            scratch,
            mixes,
            out,
            pc,
        )
    }

    fn hc_mixes(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        cols: usize,
        eps: f32,
        rows: usize,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.hc_mixes_kernel(x, w, cols, eps, rows, scratch, out)
    }

    fn hc_post(
        &self,
        y: &CudaBuf,
        residual: &CudaBuf,
        pc: &CudaBuf,
        p: &quiver_backend::dsv4::HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.hc_post_kernel(y, residual, pc, p, rows, out)
    }

    fn hc_expand(
        &self,
        x: &CudaBuf,
        p: &quiver_backend::dsv4::HcParams,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.hc_expand_kernel(x, p, rows, out)
    }

    fn swiglu_clamp(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        limit: f32,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check_glu(gate, up, n, out)?;
        let code = crate::activation::clamp_code(limit)?;
        self.glu_code(code, gate.ptr(), up.ptr(), n, out.ptr())
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_glu_clamp(
        &self,
        limit: f32,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: &CudaBuf,
        rows_x: usize,
        scratch: [&mut CudaBuf; 2],
        out: &mut CudaBuf,
    ) -> Result<()> {
        let code = crate::activation::clamp_code(limit)?;
        self.matmul_glu_fast(code, gate, up, x, rows_x, scratch, out)
    }

    fn matmul_grouped(
        &self,
        w: &[CudaWeight],
        x: &CudaBuf,
        rows: usize,
        out: &mut CudaBuf,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        self.matmul_grouped_kernel(w, x, rows, out, scratch)
    }

    fn dsv4_attention(
        &self,
        step: &Step<CudaStep>,
        s: &quiver_backend::dsv4::AttnShape,
        w: quiver_backend::dsv4::AttnWeights<'_, CudaWeight>,
        x: quiver_backend::dsv4::AttnInputs<'_, CudaBuf>,
        state: &mut CudaBuf,
        kept: Option<quiver_backend::Snapshots<'_, CudaBuf>>,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.dsv4_attention_kernel(step, s, w, x, state, kept, scratch, out)
    }

    fn dsv4_rewind(
        &self,
        s: &quiver_backend::dsv4::AttnShape,
        state: &mut CudaBuf,
        kept: &CudaBuf,
        planes: usize,
        slot: usize,
        kept_slot: usize,
        start: usize,
        len: usize,
        row: usize,
    ) -> Result<()> {
        self.dsv4_rewind_kernel(s, state, kept, planes, slot, kept_slot, start, len, row)
    }

    fn moe_dsv4(
        &self,
        step: &Step<CudaStep>,
        x: &CudaBuf,
        w: MoeWeights<'_, CudaWeight>,
        p: &MoeParams,
        bias: Option<&CudaWeight>,
        hash: Option<&CudaBuf>,
        clamp: f32,
        scratch: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.moe_dsv4_kernel(step, x, w, p, bias, hash, clamp, scratch, out)
    }

    fn sigmoid_mul(
        &self,
        x: &mut CudaBuf,
        gate: &CudaBuf,
        rows: usize,
        cols: usize,
        per_row: bool,
    ) -> Result<()> {
        self.sigmoid_mul_kernel(x, gate, rows, cols, per_row)
    }

    fn scale(&self, x: &mut CudaBuf, s: f32, n: usize) -> Result<()> {
        self.scale_kernel(x, s, n)
    }

    fn rms_norm_plain(
        &self,
        x: &CudaBuf,
        cols: usize,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.rms_norm_plain_kernel(x, cols, eps, rows, out)
    }

    fn mul_cols(&self, x: &mut CudaBuf, w: &CudaWeight, rows: usize) -> Result<()> {
        self.mul_cols_kernel(x, w, rows)
    }

    fn copy_cols(
        &self,
        src: &CudaBuf,
        src_cols: usize,
        first: usize,
        width: usize,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        self.copy_cols_kernel(src, src_cols, first, width, rows, out)
    }

    fn put_cols(
        &self,
        src: &CudaBuf,
        width: usize,
        rows: usize,
        out: &mut CudaBuf,
        out_cols: usize,
        at: usize,
    ) -> Result<()> {
        self.put_cols_kernel(src, width, rows, out, out_cols, at)
    }

    fn write(&self, x: &mut CudaBuf, data: &[f32]) -> Result<()> {
        self.write_buf(x, data)
    }

    fn rope_q(
        &self,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
    ) -> Result<()> {
        self.rope_q_kernel(st, q, rope, a)
    }

    fn shard(&self) -> quiver_backend::Shard {
        self.link
            .as_ref()
            .map_or(quiver_backend::Shard::ONE, |l| l.shard())
    }

    fn all_reduce(&self, x: &mut CudaBuf, n: usize) -> Result<()> {
        check("all_reduce", x.len >= n, || format!("{n} of {}", x.len))?;
        self.tp_all_reduce(x, n)
    }

    fn leave_group(&self) {
        self.tp_leave()
    }

    fn all_gather_cols(&self, x: &mut CudaBuf, rows: usize, width: usize) -> Result<()> {
        self.tp_all_gather_cols(x, rows, width)
    }

    fn read(&self, x: &CudaBuf, n: usize, out: &mut Vec<f32>) -> Result<()> {
        self.read_buf(x, n, out)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let g = self.graphs.stats;
        let (compiled, cached) = self.kernel_counts();
        vec![
            ("graph_captures", g.captures),
            ("graph_failed_captures", g.failed_captures),
            ("graph_replays", g.replays),
            ("eager_steps", g.eager),
            ("kernels_compiled", compiled as u64),
            ("kernels_from_cache", cached as u64),
        ]
    }

    fn top_k(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        self.top_k_rows(x, rows, cols, k, out)
    }

    fn mask_rows(&self, x: &mut CudaBuf, cols: usize, masks: &[(usize, &[u32])]) -> Result<()> {
        self.mask_logit_rows(x, cols, masks)
    }

    fn argmax(&self, x: &CudaBuf, rows: usize, cols: usize, out: &mut Vec<u32>) -> Result<()> {
        self.argmax_rows(x, rows, cols, out)
    }
}
