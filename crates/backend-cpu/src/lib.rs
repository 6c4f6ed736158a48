//! The CPU backend: activations in `Vec<f32>`, weights from the mapped GGUF file (copied at
//! load into arenas of 2 MiB pages, `resident.rs`; kept in the mapping with `--mlock` or
//! `QUIVER_CPU_MMAP=1`), K/V in one f16 pool per layer.
//!
//! Each instance has its own [`Numerics`] ([`CpuConfig`]): batch invariant by default (the
//! server), or fast (single-sequence commands); instances with different settings can live in
//! one process.

mod act_fn;
mod attn;
#[cfg(target_arch = "x86_64")]
mod attn_avx512;
mod attn_tiled;
mod config;
mod copy;
mod delta_net;
mod dsv4;
mod matmul;
mod moe;
mod norm;
mod par;
mod resident;
mod rope;
mod types;

use copy::check;

pub use config::CpuConfig;
use norm::rms_norm_rows;
use par::{par_rows, SyncPtr};
use quiver_backend::{
    reference, Activation, AttnParams, Backend, BackendError, Batch, ExtraOp, KvSpec, MoeParams,
    MoeScratch, MoeWeights, Result, RopeParams, Step, WeightBytes,
};
pub use quiver_cpu_kernels::Numerics;
use quiver_gguf::GgmlType;
pub use types::{CpuKv, CpuWeight};

pub struct CpuBackend {
    mm: matmul::MatMul,
    /// Rows of x gathered for `matmul_logits` when the wanted rows are not contiguous; the
    /// ranks' logits in `all_gather_cols`.
    packed: std::sync::Mutex<Vec<f32>>,
    routing: std::sync::Mutex<moe::Routing>,
    /// The extra ops' buffers (the delta net's, DeepSeek-V4's), kept from step to step.
    extra: std::sync::Mutex<types::ExtraScratch>,
    /// The copies of the weights a step streams (`resident.rs`).
    resident: resident::Resident,
    /// The tensor-parallel group this instance is a rank of ([`CpuBackend::with_comm`]).
    comm: Option<std::sync::Arc<dyn quiver_backend::Comm>>,
    /// Bytes of the weights made so far ([`Backend::weights_bytes`]).
    weights_made: std::sync::atomic::AtomicU64,
}

/// The CPU's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct CpuStep {
    /// KV slots the step's block tables reach.
    pub slots_needed: usize,
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    /// The slots the step's block tables reach (checked against each cache).
    type StepCtx = CpuStep;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn weight(
        &self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        bytes: WeightBytes,
    ) -> Result<CpuWeight> {
        let cols = *shape.last().unwrap_or(&1) as usize;
        let rows = shape.iter().rev().skip(1).product::<u64>() as usize;
        let vector = if rows == 1 {
            let mut v = vec![0f32; cols];
            quiver_quant::dequantize(ty, bytes.bytes(), &mut v).map_err(|e| {
                BackendError::Shape {
                    op: "weight",
                    detail: format!("{name}: {e}"),
                }
            })?;
            Some(v)
        } else {
            if !self.mm.supports(ty) {
                return Err(BackendError::Unsupported {
                    op: "matmul",
                    ty,
                    backend: "cpu",
                });
            }
            None
        };
        self.weights_made.fetch_add(
            bytes.bytes().len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let bytes = match vector {
            Some(_) => resident::Bytes::File(bytes),
            None => self.resident.place(bytes),
        };
        Ok(CpuWeight {
            ty,
            rows,
            cols,
            bytes,
            vector,
        })
    }

    fn weight_rows(&self, w: &CpuWeight) -> usize {
        w.rows
    }

    fn buf(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn memory_available(&self) -> Option<u64> {
        quiver_backend::host_memory_available()
    }

    fn weights_bytes(&self) -> Option<u64> {
        Some(self.weights_made.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn kv(&self, spec: &KvSpec, layer: usize) -> Result<CpuKv> {
        CpuKv::new(spec, layer)
    }

    fn begin_step<'b>(
        &mut self,
        batch: &'b Batch,
        _state: u64,
        _max_tokens: usize,
        _max_logits: usize,
    ) -> Result<Step<'b, CpuStep>> {
        let slots_needed = batch
            .seqs
            .iter()
            .flat_map(|s| s.block_table.iter())
            .map(|&b| (b as usize + 1) * batch.block_size)
            .max()
            .unwrap_or(0);
        Ok(Step::eager(batch, CpuStep { slots_needed }))
    }

    fn embed(
        &self,
        step: &Step<CpuStep>,
        table: &CpuWeight,
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        copy::embed(&step.batch.tokens, table, None, scale, out)
    }

    fn embed_part(
        &self,
        step: &Step<CpuStep>,
        table: &CpuWeight,
        first: usize,
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        copy::embed(&step.batch.tokens, table, Some(first), scale, out)
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &CpuWeight,
        eps: f32,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let w = w.vector("rms_norm")?;
        let d = w.len();
        let n = rows * d;
        check("rms_norm", x.len() >= n && out.len() >= n, || {
            format!("{rows}×{d} elements")
        })?;
        let o = SyncPtr(out.as_mut_ptr());
        par_rows(self.mm.pool(), rows, 16, |r0, r1| {
            // SAFETY: rows r0..r1 of `out` (inside it: checked above) are this task's alone.
            let out = unsafe { o.slice(r0 * d, (r1 - r0) * d) };
            rms_norm_rows(&x[r0 * d..r1 * d], w, eps, out);
        });
        Ok(())
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Vec<f32>,
        w: &CpuWeight,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        let w = w.vector("rms_norm")?;
        let d = w.len();
        check("rms_norm", x.len() >= rows * d, || {
            format!("{rows}×{d} elements")
        })?;
        check("rms_norm", d <= 1024, || format!("row of {d} > 1024"))?;
        let p = SyncPtr(x.as_mut_ptr());
        par_rows(self.mm.pool(), rows, 64, |r0, r1| {
            // SAFETY: rows r0..r1 of `x` (inside it: checked above) are this task's alone.
            let x = unsafe { p.slice(r0 * d, (r1 - r0) * d) };
            let mut tmp = [0f32; 4 * 1024];
            for r in x.chunks_mut(4 * d) {
                let tmp = &mut tmp[..r.len()];
                tmp.copy_from_slice(r);
                rms_norm_rows(tmp, w, eps, r);
            }
        });
        Ok(())
    }

    fn add_rms_norm(
        &self,
        residual: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &CpuWeight,
        eps: f32,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let wv = w.vector("add_rms_norm")?;
        let d = wv.len();
        let n = rows * d;
        check(
            "add_rms_norm",
            residual.len() >= n && x.len() >= n && out.len() >= n,
            || format!("{rows}×{d} elements"),
        )?;
        let (res, o) = (SyncPtr(residual.as_mut_ptr()), SyncPtr(out.as_mut_ptr()));
        par_rows(self.mm.pool(), rows, 16, |r0, r1| {
            let len = (r1 - r0) * d;
            // SAFETY: rows r0..r1 of `residual` and `out` (inside both: checked above) are this
            // task's alone.
            let (res, out) = unsafe { (res.slice(r0 * d, len), o.slice(r0 * d, len)) };
            res.iter_mut()
                .zip(&x[r0 * d..r1 * d])
                .for_each(|(a, b)| *a += b);
            rms_norm_rows(res, wv, eps, out);
        });
        Ok(())
    }

    fn add(&self, a: &mut Vec<f32>, b: &Vec<f32>, n: usize) -> Result<()> {
        check("add", a.len() >= n && b.len() >= n, || {
            format!("{n} elements")
        })?;
        a[..n].iter_mut().zip(&b[..n]).for_each(|(x, y)| *x += y);
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &CpuWeight, rows: usize) -> Result<()> {
        let b = bias.vector("add_bias")?;
        check("add_bias", x.len() >= rows * b.len(), || {
            format!("{rows}×{} elements", b.len())
        })?;
        for row in x[..rows * b.len()].chunks_exact_mut(b.len().max(1)) {
            row.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        Ok(())
    }

    fn matmul(&self, w: &CpuWeight, x: &Vec<f32>, rows_x: usize, out: &mut Vec<f32>) -> Result<()> {
        check(
            "matmul",
            x.len() >= rows_x * w.cols && out.len() >= rows_x * w.rows,
            || format!("x [{rows_x}, {}] · W [{}, {}]ᵀ", w.cols, w.rows, w.cols),
        )?;
        self.mm.run(
            w.ty,
            w.bytes(),
            w.rows,
            w.cols,
            &x[..rows_x * w.cols],
            rows_x,
            &mut out[..rows_x * w.rows],
        )
    }

    fn matmul_logits(
        &self,
        step: &Step<CpuStep>,
        w: &CpuWeight,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let sel = &step.batch.logits;
        let c = w.cols;
        let (Some(&a), Some(&b)) = (sel.first(), sel.last()) else {
            return Ok(());
        };
        let (a, b) = (a as usize, b as usize);
        check(
            "matmul_logits",
            x.len() >= (b + 1) * c && out.len() >= sel.len() * w.rows,
            || format!("{} rows", sel.len()),
        )?;
        if b + 1 - a == sel.len() && sel.windows(2).all(|p| p[1] == p[0] + 1) {
            // A contiguous run (always the case for the runner): no copy.
            return self.mm.run(
                w.ty,
                w.bytes(),
                w.rows,
                c,
                &x[a * c..(b + 1) * c],
                sel.len(),
                &mut out[..sel.len() * w.rows],
            );
        }
        let mut packed = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        packed.clear();
        for &i in sel {
            packed.extend_from_slice(&x[i as usize * c..][..c]);
        }
        self.mm.run(
            w.ty,
            w.bytes(),
            w.rows,
            c,
            &packed,
            sel.len(),
            &mut out[..sel.len() * w.rows],
        )
    }

    fn rope_kv_write(
        &self,
        step: &Step<CpuStep>,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CpuKv,
    ) -> Result<()> {
        let b = step.batch;
        let n = b.n_tokens();
        let kv_dim = a.n_head_kv * a.head_dim;
        check("rope_kv_write", kv_dim == kv.kv_dim, || {
            format!("kv_dim {kv_dim} vs cache {}", kv.kv_dim)
        })?;
        check("rope_kv_write", rope.n_dims / 2 <= rope::MAX_PAIRS, || {
            format!("{} rotated dims", rope.n_dims)
        })?;
        rope::apply(
            &mut q[..n * a.n_head * a.head_dim],
            Some(&mut k[..n * kv_dim]),
            &b.positions,
            a,
            rope,
        );
        self.finish_q(n, q, a);
        kv.write(&b.slots, &k[..n * kv_dim], &v[..n * kv_dim])
    }

    fn attention(
        &self,
        step: &Step<CpuStep>,
        q: &Vec<f32>,
        kv: &CpuKv,
        a: &AttnParams,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let n = step.batch.n_tokens() * a.n_head * a.head_dim;
        check("attention", q.len() >= n && out.len() >= n, || {
            format!("{n} elements")
        })?;
        let needed = step.ctx.slots_needed;
        check("attention", needed <= kv.n_slots, || {
            format!(
                "block tables reach slot {needed} of a {}-slot cache",
                kv.n_slots
            )
        })?;
        check("attention", a.head_dim <= attn::MAX_HEAD_DIM, || {
            format!("head_dim {} > {}", a.head_dim, attn::MAX_HEAD_DIM)
        })?;
        if kv.packed() {
            let rows = |ty, bytes, exact| quiver_backend::kvcodec::KvRows {
                ty,
                bytes,
                n_head_kv: kv.n_head_kv,
                head_dim: kv.head_dim,
                exact,
            };
            attn::attention_packed(
                self.mm.pool(),
                &q[..n],
                rows(kv.types.k, &kv.kb, kv.exact.as_ref()),
                rows(kv.types.v, &kv.vb, None),
                step.batch,
                a,
                &mut out[..n],
            );
            return Ok(());
        }
        attn::attention(
            self.mm.pool(),
            self.numerics(),
            &q[..n],
            &kv.k,
            &kv.v,
            step.batch,
            a,
            &mut out[..n],
        );
        Ok(())
    }

    fn glu(
        &self,
        act: Activation,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        check(
            "glu",
            gate.len() >= n && up.len() >= n && out.len() >= n,
            || format!("{n} elements"),
        )?;
        let o = SyncPtr(out.as_mut_ptr());
        // Element ranges of 4096 per task (as rows of one element).
        par_rows(self.mm.pool(), n, 4096, |i0, i1| {
            // SAFETY: elements i0..i1 of `out` (inside it: checked above) are this task's alone.
            let out = unsafe { o.slice(i0, i1 - i0) };
            let (gate, up) = (&gate[i0..i1], &up[i0..i1]);
            match act {
                // GELU through ggml's f16 table (llama.cpp parity).
                Activation::GeGlu => act_fn::geglu(gate, up, out),
                // SiLU with ggml's vectorised e^x (llama.cpp parity), within 2 ulp of the
                // reference.
                Activation::SwiGlu => act_fn::swiglu(gate, up, out),
            }
        });
        Ok(())
    }

    fn rope_q(
        &self,
        step: &Step<CpuStep>,
        q: &mut Vec<f32>,
        rope: &RopeParams,
        a: &AttnParams,
    ) -> Result<()> {
        let n = step.batch.n_tokens();
        check(
            "rope_q",
            rope.n_dims / 2 <= rope::MAX_PAIRS && q.len() >= n * a.n_head * a.head_dim,
            || format!("{} rotated dims, {n} tokens", rope.n_dims),
        )?;
        rope::apply(
            &mut q[..n * a.n_head * a.head_dim],
            None,
            &step.batch.positions,
            a,
            rope,
        );
        self.finish_q(n, q, a);
        Ok(())
    }

    fn supports(&self, _op: ExtraOp) -> bool {
        true
    }

    fn delta_net(
        &self,
        step: &Step<CpuStep>,
        p: &quiver_backend::DeltaNetParams,
        w: quiver_backend::DeltaNetWeights<'_, CpuWeight>,
        qkv: &mut Vec<f32>,
        alpha: &Vec<f32>,
        beta: &Vec<f32>,
        state: &mut Vec<f32>,
        snaps: Option<quiver_backend::Snapshots<'_, Vec<f32>>>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut sc = self.extra.lock().unwrap_or_else(|e| e.into_inner());
        delta_net::run(
            self.mm.pool(),
            &mut sc.dn,
            step.batch,
            p,
            w.conv.vector("delta_net")?,
            w.dt_bias.vector("delta_net")?,
            w.a.vector("delta_net")?,
            qkv,
            alpha,
            beta,
            state,
            snaps,
            out,
        )
    }

    fn copy_range(
        &self,
        src: &Vec<f32>,
        src_at: usize,
        dst: &mut Vec<f32>,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        copy::copy_range(src, src_at, dst, dst_at, n)
    }

    fn hc_pre(
        &self,
        x: &Vec<f32>,
        mixes: &Vec<f32>,
        scale: &CpuWeight,
        base: &CpuWeight,
        p: &quiver_backend::dsv4::HcParams,
        head: bool,
        rows: usize,
        out: &mut Vec<f32>,
        pc: &mut Vec<f32>,
    ) -> Result<()> {
        self.hc_pre_cpu(x, mixes, scale, base, p, head, rows, out, pc)
    }

    fn hc_post(
        &self,
        y: &Vec<f32>,
        residual: &Vec<f32>,
        pc: &Vec<f32>,
        p: &quiver_backend::dsv4::HcParams,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.hc_post_cpu(y, residual, pc, p, rows, out)
    }

    fn hc_expand(
        &self,
        x: &Vec<f32>,
        p: &quiver_backend::dsv4::HcParams,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.hc_expand_cpu(x, p, rows, out)
    }

    fn matmul_grouped(
        &self,
        w: &[CpuWeight],
        x: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        self.matmul_grouped_cpu(w, x, rows, out, scratch)
    }

    fn swiglu_clamp(
        &self,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        limit: f32,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.swiglu_clamp_cpu(gate, up, limit, n, out)
    }

    fn dsv4_attention(
        &self,
        step: &Step<CpuStep>,
        s: &quiver_backend::dsv4::AttnShape,
        w: quiver_backend::dsv4::AttnWeights<'_, CpuWeight>,
        x: quiver_backend::dsv4::AttnInputs<'_, Vec<f32>>,
        state: &mut Vec<f32>,
        kept: Option<quiver_backend::Snapshots<'_, Vec<f32>>>,
        _scratch: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.dsv4_attention_cpu(step.batch, s, w, x, state, kept, out)
    }

    fn dsv4_rewind(
        &self,
        s: &quiver_backend::dsv4::AttnShape,
        state: &mut Vec<f32>,
        kept: &Vec<f32>,
        planes: usize,
        slot: usize,
        kept_slot: usize,
        start: usize,
        len: usize,
        row: usize,
    ) -> Result<()> {
        quiver_backend::dsv4::rewind(s, state, kept, planes, slot, kept_slot, start, len, row)
            .map_err(|detail| BackendError::Shape {
                op: "dsv4_rewind",
                detail,
            })
    }

    fn moe_dsv4(
        &self,
        step: &Step<CpuStep>,
        x: &Vec<f32>,
        w: MoeWeights<'_, CpuWeight>,
        p: &MoeParams,
        bias: Option<&CpuWeight>,
        hash: Option<&Vec<f32>>,
        clamp: f32,
        scratch: MoeScratch<'_, Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.moe_dsv4_cpu(
            step.batch,
            x,
            w,
            p,
            bias,
            hash.map(|h| &h[..]),
            clamp,
            scratch,
            out,
        )
    }

    fn sigmoid_mul(
        &self,
        x: &mut Vec<f32>,
        g: &Vec<f32>,
        r: usize,
        c: usize,
        row: bool,
    ) -> Result<()> {
        delta_net::sigmoid_mul(x, g, r, c, row)
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, n: usize) -> Result<()> {
        check("scale", x.len() >= n, || format!("{n} elements"))?;
        x[..n].iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn rms_norm_plain(
        &self,
        x: &Vec<f32>,
        cols: usize,
        eps: f32,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let n = rows * cols;
        check("rms_norm_plain", x.len() >= n && out.len() >= n, || {
            format!("{rows}×{cols} elements")
        })?;
        reference::rms_norm_plain(&x[..n], cols.max(1), eps, &mut out[..n]);
        Ok(())
    }

    fn mul_cols(&self, x: &mut Vec<f32>, w: &CpuWeight, rows: usize) -> Result<()> {
        let w = w.vector("mul_cols")?;
        check("mul_cols", x.len() >= rows * w.len(), || {
            format!("{rows}×{} elements", w.len())
        })?;
        reference::mul_cols(&mut x[..rows * w.len()], w);
        Ok(())
    }

    fn copy_cols(
        &self,
        src: &Vec<f32>,
        src_cols: usize,
        first: usize,
        width: usize,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        copy::copy_cols(src, src_cols, first, width, rows, out)
    }

    fn put_cols(
        &self,
        src: &Vec<f32>,
        width: usize,
        rows: usize,
        out: &mut Vec<f32>,
        out_cols: usize,
        at: usize,
    ) -> Result<()> {
        copy::put_cols(src, width, rows, out, out_cols, at)
    }

    fn write(&self, x: &mut Vec<f32>, data: &[f32]) -> Result<()> {
        copy::write(x, data)
    }

    fn moe(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: MoeWeights<'_, CpuWeight>,
        p: &MoeParams,
        scratch: MoeScratch<'_, Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.moe_cpu(x, rows, w, p, scratch, out, None)
    }

    fn softcap(&self, x: &mut Vec<f32>, cap: f32, n: usize) -> Result<()> {
        x[..n].iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        Ok(())
    }

    fn shard(&self) -> quiver_backend::Shard {
        self.comm
            .as_ref()
            .map_or(quiver_backend::Shard::ONE, |c| c.shard())
    }

    fn all_reduce(&self, x: &mut Vec<f32>, n: usize) -> Result<()> {
        check("all_reduce", x.len() >= n, || format!("{n} elements"))?;
        match &self.comm {
            Some(c) => c.all_reduce_sum(&mut x[..n]),
            None => Ok(()),
        }
    }

    fn leave_group(&self) {
        if let Some(c) = &self.comm {
            c.leave();
        }
    }

    fn all_gather_cols(&self, x: &mut Vec<f32>, rows: usize, width: usize) -> Result<()> {
        let Some(c) = &self.comm else { return Ok(()) };
        let mut all = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        quiver_backend::comm::all_gather_cols(c.as_ref(), x, rows, width, &mut all)
    }

    fn read(&self, x: &Vec<f32>, n: usize, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        out.extend_from_slice(&x[..n]);
        Ok(())
    }

    fn mask_rows(&self, x: &mut Vec<f32>, cols: usize, masks: &[(usize, &[u32])]) -> Result<()> {
        for &(row, bits) in masks {
            let Some(r) = x.get_mut(row * cols..(row + 1) * cols) else {
                return Err(BackendError::Shape {
                    op: "mask_rows",
                    detail: format!("row {row} of {cols} past {} values", x.len()),
                });
            };
            quiver_backend::reference::mask_row(r, bits);
        }
        Ok(())
    }
}
