//! The parity mode as a backend of its own (`--numerics parity`): [`ParityBackend`] holds a
//! CUDA context opened with [`Numerics::Parity`] (graphs off, the "exact" module loaded) and
//! runs every op that must round as the CPU backend's batch-invariant path does through
//! [`Parity`]'s entry points (src/exact.rs); the ops where the fast kernels already compute
//! what the CPU computes (buffers, KV caches, steps, the bias add, masks, reads) are the fast
//! backend's. It has no mixture-of-experts kernels, none of the extra ops of src/extras.rs (an
//! architecture that needs them is refused at load) and only f16 KV caches.

use crate::backend::{
    check_add, check_head_dims, check_logits, check_many, check_softcap, make_kv, norm_with,
};
use crate::batch::CudaStep;
use crate::embed::check_embed;
use crate::exact::Parity;
use crate::memory::{CudaBuf, CudaKv};
use crate::norm::Norm;
use crate::products::{check_glu, check_matmul};
use crate::rope::check_rope_kv_write;
use crate::weights::{rows_cols, CudaWeight};
use crate::{CudaBackend, CudaConfig};
use quiver_backend::{
    Activation, AttnParams, Backend, BackendError, Batch, KvSpec, KvType, MoeParams, MoeScratch,
    MoeWeights, Numerics, Result, RopeParams, Step, WeightBytes, WorkspaceSpec,
};
use quiver_gguf::GgmlType;

/// The CUDA backend in the parity mode.
pub struct ParityBackend {
    cuda: CudaBackend,
    p: Parity,
}

impl ParityBackend {
    /// Opens CUDA device `ordinal` for `config` with its numerics set to parity.
    pub fn new(ordinal: usize, config: CudaConfig) -> Result<Self> {
        let cuda = CudaBackend::open(
            ordinal,
            CudaConfig {
                numerics: Numerics::Parity,
                ..config
            },
        )?;
        Ok(ParityBackend {
            cuda,
            p: Parity::default(),
        })
    }

    /// The CUDA context underneath (device, memory, kernel counts).
    pub fn cuda(&self) -> &CudaBackend {
        &self.cuda
    }
}

impl Backend for ParityBackend {
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
        self.cuda.dev.bind().map_err(BackendError::Device)?;
        let (rows, cols) = rows_cols(shape);
        if rows == 1 {
            return self.cuda.vector_weight(name, ty, cols, &bytes);
        }
        self.p.weight(&self.cuda, name, ty, rows, cols, &bytes)
    }

    fn weight_rows(&self, w: &CudaWeight) -> usize {
        w.rows
    }

    fn memory_available(&self) -> Option<u64> {
        self.cuda.memory_available()
    }

    /// The parity mode grows its own scratch (src/exact.rs).
    fn workspace_bytes(&self, _: &WorkspaceSpec) -> u64 {
        0
    }

    fn reserve_workspace(&self, ws: &WorkspaceSpec) -> Result<()> {
        check_head_dims(ws)
    }

    fn buf(&self, n: usize) -> Result<CudaBuf> {
        self.cuda.zeroed_buf(n)
    }

    fn kv(&self, spec: &KvSpec, layer: usize) -> Result<CudaKv> {
        if (spec.k, spec.v) != (KvType::F16, KvType::F16) {
            return Err(BackendError::UnsupportedKv {
                k: spec.k.name(),
                v: spec.v.name(),
                backend: "cuda parity mode (--numerics parity)",
            });
        }
        make_kv(&self.cuda, spec, layer)
    }

    fn begin_step<'b>(
        &mut self,
        batch: &'b Batch,
        state: u64,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<Step<'b, CudaStep>> {
        self.cuda.begin_step(batch, state, max_tokens, max_logits)
    }

    fn end_step(&mut self, ok: bool) -> Result<bool> {
        self.cuda.end_step(ok)
    }

    fn embed(
        &self,
        st: &Step<CudaStep>,
        table: &CudaWeight,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        check_embed(table, st.rows, out)?;
        self.p.embed(&self.cuda, st, table, scale, out)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        norm_with(&Norm::of(x, w, eps, rows, out), |n| {
            self.p.norm(&self.cuda, n)
        })
    }

    fn rms_norm_inplace(
        &self,
        x: &mut CudaBuf,
        w: &CudaWeight,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        norm_with(&Norm::of(x, w, eps, rows, x), |n| {
            self.p.norm(&self.cuda, n)
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
            self.p.norm(&self.cuda, n)
        })
    }

    fn add(&self, a: &mut CudaBuf, b: &CudaBuf, n: usize) -> Result<()> {
        check_add(a, b, n)?;
        self.p.add(&self.cuda, a.ptr(), b.ptr(), n)
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaWeight, rows: usize) -> Result<()> {
        self.cuda.add_bias(x, bias, rows)
    }

    fn moe(
        &self,
        _: &CudaBuf,
        _: usize,
        _: MoeWeights<'_, CudaWeight>,
        _: &MoeParams,
        _: MoeScratch<'_, CudaBuf>,
        _: &mut CudaBuf,
    ) -> Result<()> {
        Err(BackendError::Device(
            "the parity mode (--numerics parity) has no mixture-of-experts kernels".into(),
        ))
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaBuf, rows_x: usize, out: &mut CudaBuf) -> Result<()> {
        check_matmul(w, x, rows_x, out)?;
        self.p.mm(&self.cuda, w, x.ptr(), rows_x, out.ptr())
    }

    fn matmul_many(
        &self,
        w: &[&CudaWeight],
        x: &CudaBuf,
        rows_x: usize,
        out: &mut [&mut CudaBuf],
    ) -> Result<()> {
        check_many(w, x, rows_x, out)?;
        for (m, o) in w.iter().zip(out.iter()) {
            self.p.mm(&self.cuda, m, x.ptr(), rows_x, o.ptr())?;
        }
        Ok(())
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
        self.p
            .matmul_glu(&self.cuda, act, gate, up, x, rows_x, scratch, out)
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
        self.p.matmul_logits(&self.cuda, st, w, x, n, out)
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
        self.p.rope_kv_write(&self.cuda, st, q, k, v, rope, a, kv)
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
        crate::attention::check_attention(q, kv, a, n, out)?;
        if n == 0 {
            return Ok(());
        }
        self.p.attention(&self.cuda, st, q, kv, a, out)
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
        self.p.glu(&self.cuda, act, gate, up, n, out)
    }

    fn softcap(&self, x: &mut CudaBuf, cap: f32, n: usize) -> Result<()> {
        check_softcap(x, n)?;
        self.p.softcap(&self.cuda, x, cap, n)
    }

    fn read(&self, x: &CudaBuf, n: usize, out: &mut Vec<f32>) -> Result<()> {
        self.cuda.read(x, n, out)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.cuda.counters()
    }

    fn top_k(
        &self,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        self.p.top_k(&self.cuda, x, rows, cols, k, out)
    }

    fn mask_rows(&self, x: &mut CudaBuf, cols: usize, masks: &[(usize, &[u32])]) -> Result<()> {
        self.cuda.mask_rows(x, cols, masks)
    }

    fn argmax(&self, x: &CudaBuf, rows: usize, cols: usize, out: &mut Vec<u32>) -> Result<()> {
        self.p.argmax(&self.cuda, x, rows, cols, out)
    }
}
