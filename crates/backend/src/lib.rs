//! The device contract every backend implements, and the flat batch models run over.
//!
//! A forward step takes the tokens of all scheduled sequences as one flat list (vLLM's
//! layout): token ids, positions, the sequence each token belongs to, the KV slot each token
//! writes, and per-sequence block tables into a paged KV pool. Prefill, decode, chunked prefill
//! and mixed batches are the same call.
//!
//! Backends own their buffers. Every op writes into a caller-given buffer; nothing allocates
//! after the workspace is made at load. `reference` holds the scalar implementation of every
//! op, which each backend's parity tests compare against.

mod batch;
pub mod comm;
pub mod delta_net;
pub mod dsv4;
mod error;
pub mod kblock;
mod kv;
pub mod kvcodec;
pub mod numerics;
mod ops;
pub mod reference;
mod rope;
#[doc(hidden)]
pub mod testing;
pub mod turboquant;

pub use batch::{Batch, SeqSpan};
pub use comm::{Comm, LocalComm, Shard};
pub use delta_net::{DeltaNetParams, DeltaNetWeights, Snapshots};
pub use error::{host_memory_available, human_bytes, BackendError, Result};
pub use kv::{KvLayer, KvSpec, KvType, KvTypes, KV_BLOCK_SIZE};
pub use numerics::Numerics;
pub use ops::{Activation, ExtraOp, Gating, MoeParams, MoeScratch, MoeWeights};
use quiver_gguf::GgmlType;
pub use rope::{Llama3Scaling, RopeAngles, RopeMode, RopeParams, Yarn, ROPE_MAX_PAIRS};

/// [`Backend::qk_norm_rope_kv_write`] as three ops: q's and k's heads normed in place, then
/// `rope_kv_write` (the default, and a backend's fallback where it does not fuse them).
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_then_rope<B: Backend + ?Sized>(
    b: &B,
    step: &Step<B::StepCtx>,
    q: &mut B::Buf,
    k: &mut B::Buf,
    v: &B::Buf,
    norms: (&B::Weight, &B::Weight, f32),
    rope: &RopeParams,
    attn: &AttnParams,
    kv: &mut B::Kv,
) -> Result<()> {
    let (qn, kn, eps) = norms;
    b.rms_norm_inplace(q, qn, eps, step.rows * attn.n_head)?;
    b.rms_norm_inplace(k, kn, eps, step.rows * attn.n_head_kv)?;
    b.rope_kv_write(step, q, k, v, rope, attn, kv)
}

/// Attention shape and masking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplies q·k.
    pub scale: f32,
    /// The scale multiplies q itself before q meets the cache (llama.cpp's order for Gemma:
    /// q is rounded to the cache's precision already scaled); the same product in exact math.
    pub scale_q: bool,
    /// Sliding window: a query at position p sees keys at positions > p - window.
    pub window: Option<u32>,
    /// `tanh` soft-capping of scores.
    pub softcap: Option<f32>,
}

/// The largest step a model's buffers are made for, in the shapes a backend's own scratch
/// depends on: `Model::state` asks the backend for it at load ([`Backend::reserve_workspace`]),
/// so that no step grows a buffer (and a workspace that cannot fit is an error at load).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceSpec {
    /// Token rows per step.
    pub max_tokens: usize,
    /// Logits rows per step.
    pub max_logits: usize,
    /// The widest input of any product (`n_embd`, `n_ff`, `n_head * head_dim`).
    pub max_product_cols: usize,
    /// The output product's input width and rows.
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Each distinct attention shape: (heads, head dim).
    pub attention: Vec<(usize, usize)>,
    /// KV positions in the pool.
    pub n_slots: usize,
}

/// `matmul_many`'s lists: a weight for every output.
pub fn check_many(weights: usize, outs: usize) -> Result<()> {
    if weights == outs {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op: "matmul_many",
            detail: format!("{weights} weights for {outs} outputs"),
        })
    }
}

/// The device contract. Buffers hold f32 activations; weights keep their GGUF type.
pub trait Backend {
    /// An activation buffer of f32.
    type Buf;
    /// A weight (matrix or vector) in its GGUF type.
    type Weight;
    /// One layer's K and V cache over the paged pool.
    type Kv;
    /// The backend's part of a step: where the step's batch lives on its device.
    type StepCtx: Copy;

    fn name(&self) -> &'static str;

    /// Makes a weight from the bytes of a tensor (row-major shape).
    fn weight(
        &self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        bytes: WeightBytes,
    ) -> Result<Self::Weight>;
    /// A zeroed activation buffer of `n` f32.
    fn buf(&self, n: usize) -> Result<Self::Buf>;
    /// K/V of layer `layer` of the cache `spec` describes (`spec.n_slots` positions of
    /// `spec.layer_dims[layer]` values each). A backend refuses element types it has no
    /// kernels for with `BackendError::Unsupported`-style errors naming the type.
    fn kv(&self, spec: &KvSpec, layer: usize) -> Result<Self::Kv>;
    /// Memory the backend's buffers can still take, where known: the model checks its
    /// workspace against it before allocating anything.
    fn memory_available(&self) -> Option<u64> {
        None
    }
    /// Bytes of the weights this backend has made (`weight`), where it counts them: what a
    /// tensor-parallel rank holds, for the load log.
    fn weights_bytes(&self) -> Option<u64> {
        None
    }
    /// Bytes of the backend's own scratch a step of at most `ws` needs.
    fn workspace_bytes(&self, ws: &WorkspaceSpec) -> u64 {
        let _ = ws;
        0
    }
    /// Allocates that scratch now (at load), so that steps never grow it.
    fn reserve_workspace(&self, ws: &WorkspaceSpec) -> Result<()> {
        let _ = ws;
        Ok(())
    }

    /// Starts a forward step: makes the batch's index arrays visible to the device and returns
    /// the step every batch-dependent op takes (no op reads per-step state kept elsewhere).
    /// The batch is valid (`Batch::validate`; `Model::forward` checks it once per step).
    /// `state` names the caller's buffers (a step captured over one state is never replayed
    /// over another); `max_tokens` / `max_logits` are what its buffers hold. When the
    /// returned step says `replayed`, the backend has already run the whole step and the
    /// caller skips the ops.
    fn begin_step<'b>(
        &mut self,
        batch: &'b Batch,
        state: u64,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<Step<'b, Self::StepCtx>>;
    /// Ends a step whose ops the caller ran (`ok`: all of them succeeded). Ok(false) means
    /// the ops were only recorded (a graph capture) and the recording could not be kept: the
    /// caller runs the ops again, which the backend then executes one by one.
    fn end_step(&mut self, ok: bool) -> Result<bool> {
        let _ = ok;
        Ok(true)
    }

    /// out[t] = dequantized row `batch.tokens[t]` of `table` · scale   // out: [step.rows, cols]
    fn embed(
        &self,
        step: &Step<Self::StepCtx>,
        table: &Self::Weight,
        scale: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// [`Backend::embed`] of a table holding rows `first..first + rows` of the vocabulary (a
    /// rank's part): a token outside them gets a row of −0.0, which a sum adds exactly, so
    /// that the ranks' rows all-reduced are the whole table's.
    fn embed_part(
        &self,
        step: &Step<Self::StepCtx>,
        table: &Self::Weight,
        first: usize,
        scale: f32,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (step, table, first, scale, out);
        Err(self.missing(ExtraOp::EmbedPart))
    }
    /// out[t] = x[t] / rms(x[t]) · w, rows of `w.len()`                 // x, out: [rows, cols]
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// In place row-wise rms norm of `rows` rows (per-head q/k norms).
    fn rms_norm_inplace(
        &self,
        x: &mut Self::Buf,
        w: &Self::Weight,
        eps: f32,
        rows: usize,
    ) -> Result<()>;
    /// out = rms_norm(x) · w · silu(gate), row by row over `rows` rows of `cols` (Qwen 3.5's
    /// gated norm); `x` may be left holding the norm.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated(
        &self,
        x: &mut Self::Buf,
        w: &Self::Weight,
        eps: f32,
        rows: usize,
        cols: usize,
        gate: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.rms_norm_inplace(x, w, eps, rows)?;
        self.glu(Activation::SwiGlu, gate, x, rows * cols, out)
    }
    /// residual[t] += x[t]; out[t] = rms_norm(residual[t]) · w
    fn add_rms_norm(
        &self,
        residual: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Weight,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// a[i] += b[i] for the first n elements.
    fn add(&self, a: &mut Self::Buf, b: &Self::Buf, n: usize) -> Result<()>;
    /// x[t, c] += bias[c] for `rows` rows of `bias.len()` (a product's bias).
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Weight, rows: usize) -> Result<()>;
    /// A mixture-of-experts FFN over `rows` rows of x [rows, n_embd]: router logits, the
    /// top `n_used` experts per token ([`reference::moe_route`]), each chosen expert's gated
    /// FFN, and out[t] = Σ_j w[t, j] · y[t, j] summed in slot order (best expert first).
    fn moe(
        &self,
        x: &Self::Buf,
        rows: usize,
        w: MoeWeights<'_, Self::Weight>,
        p: &MoeParams,
        scratch: MoeScratch<'_, Self::Buf>,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// out[t, r] = Σ_c W[r, c] · x[t, c]                                   // x: [rows_x, cols], out: [rows_x, W.rows]
    fn matmul(
        &self,
        w: &Self::Weight,
        x: &Self::Buf,
        rows_x: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// out[i] = x · w[i]ᵀ for every i: the products of one x (q, k and v; a layer's input
    /// projections), each with the bits `matmul` gives it; a backend may share one copy of x
    /// between them and run several in one launch.
    fn matmul_many(
        &self,
        w: &[&Self::Weight],
        x: &Self::Buf,
        rows_x: usize,
        out: &mut [&mut Self::Buf],
    ) -> Result<()> {
        check_many(w.len(), out.len())?;
        for (w, o) in w.iter().zip(out.iter_mut()) {
            self.matmul(w, x, rows_x, o)?;
        }
        Ok(())
    }
    /// out = act(x·gateᵀ) · (x·upᵀ), `scratch` holding the two products where the backend
    /// does not fuse them.
    #[allow(clippy::too_many_arguments)]
    fn matmul_glu(
        &self,
        act: Activation,
        gate: &Self::Weight,
        up: &Self::Weight,
        x: &Self::Buf,
        rows_x: usize,
        scratch: [&mut Self::Buf; 2],
        out: &mut Self::Buf,
    ) -> Result<()> {
        let [g, u] = scratch;
        self.matmul(gate, x, rows_x, g)?;
        self.matmul(up, x, rows_x, u)?;
        self.glu(act, g, u, rows_x * self.weight_rows(gate), out)
    }
    /// Rows of a weight matrix.
    fn weight_rows(&self, w: &Self::Weight) -> usize;
    /// Like `matmul` over only the rows of x listed by `batch.logits` (packed into out,
    /// `step.logit_rows` rows).
    fn matmul_logits(
        &self,
        step: &Step<Self::StepCtx>,
        w: &Self::Weight,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Rotates q [n_tokens, n_head, head_dim] in place; rotates k and writes k and v
    /// [n_tokens, n_head_kv, head_dim] into the cache at each token's slot.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        step: &Step<Self::StepCtx>,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        rope: &RopeParams,
        attn: &AttnParams,
        kv: &mut Self::Kv,
    ) -> Result<()>;
    /// Per-head RMS norms of q and k (weights `qn`, `kn` of `head_dim`: Qwen 3, Gemma 3 and 4),
    /// then [`Backend::rope_kv_write`]: one op so that a backend may fuse them. The default runs
    /// the three ops.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_write(
        &self,
        step: &Step<Self::StepCtx>,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        norms: (&Self::Weight, &Self::Weight, f32),
        rope: &RopeParams,
        attn: &AttnParams,
        kv: &mut Self::Kv,
    ) -> Result<()> {
        qk_norm_then_rope(self, step, q, k, v, norms, rope, attn, kv)
    }
    /// Causal attention of every batch token over its sequence's cached K/V.
    /// q: [n_tokens, n_head, head_dim] → out: [n_tokens, n_head, head_dim]
    fn attention(
        &self,
        step: &Step<Self::StepCtx>,
        q: &Self::Buf,
        kv: &Self::Kv,
        attn: &AttnParams,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// out[t, i] = act(gate[t, i]) · up[t, i]
    fn glu(
        &self,
        act: Activation,
        gate: &Self::Buf,
        up: &Self::Buf,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// x = cap · tanh(x / cap) for the first n elements.
    fn softcap(&self, x: &mut Self::Buf, cap: f32, n: usize) -> Result<()>;

    /// Whether the backend has `op` (the ops below, which only some architectures use; their
    /// defaults refuse).
    fn supports(&self, op: ExtraOp) -> bool {
        let _ = op;
        false
    }
    /// x[i] *= s for the first n elements.
    fn scale(&self, x: &mut Self::Buf, s: f32, n: usize) -> Result<()> {
        let _ = (x, s, n);
        Err(self.missing(ExtraOp::Scale))
    }
    /// out[r] = x[r] / rms(x[r]) over `rows` rows of `cols` (an rms norm without weight).
    fn rms_norm_plain(
        &self,
        x: &Self::Buf,
        cols: usize,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (x, cols, eps, rows, out);
        Err(self.missing(ExtraOp::RmsNormPlain))
    }
    /// x[t, c] *= w[c] for `rows` rows of `w.len()`.
    fn mul_cols(&self, x: &mut Self::Buf, w: &Self::Weight, rows: usize) -> Result<()> {
        let _ = (x, w, rows);
        Err(self.missing(ExtraOp::MulCols))
    }
    /// out[t, c] = src[t, first + c] for c < width, t < rows; src rows hold `src_cols`.
    fn copy_cols(
        &self,
        src: &Self::Buf,
        src_cols: usize,
        first: usize,
        width: usize,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (src, src_cols, first, width, rows, out);
        Err(self.missing(ExtraOp::CopyCols))
    }
    /// out[t, at + c] = src[t, c] for c < width, t < rows; out rows hold `out_cols` (the other
    /// columns untouched): one part of a concatenation.
    fn put_cols(
        &self,
        src: &Self::Buf,
        width: usize,
        rows: usize,
        out: &mut Self::Buf,
        out_cols: usize,
        at: usize,
    ) -> Result<()> {
        let _ = (src, width, rows, out, out_cols, at);
        Err(self.missing(ExtraOp::PutCols))
    }
    /// dst[dst_at + i] = src[src_at + i] for i < n: a sequence's recurrent state put back to
    /// one it kept ([`Snapshots`]).
    fn copy_range(
        &self,
        src: &Self::Buf,
        src_at: usize,
        dst: &mut Self::Buf,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        let _ = (src, src_at, dst, dst_at, n);
        Err(self.missing(ExtraOp::CopyRange))
    }
    /// Overwrites the first `data.len()` elements of `x` with `data` (an input the host made:
    /// a draft head's hidden states).
    fn write(&self, x: &mut Self::Buf, data: &[f32]) -> Result<()> {
        let _ = (x, data);
        Err(self.missing(ExtraOp::Write))
    }
    /// The q half of [`Backend::rope_kv_write`]: rotates q and prepares it for attention, for
    /// a layer that reads another layer's cache and writes none.
    fn rope_q(
        &self,
        step: &Step<Self::StepCtx>,
        q: &mut Self::Buf,
        rope: &RopeParams,
        attn: &AttnParams,
    ) -> Result<()> {
        let _ = (step, q, rope, attn);
        Err(self.missing(ExtraOp::RopeQ))
    }
    /// One gated-delta-net layer ([`delta_net`]) over the step's sequences. `qkv` holds the
    /// in-projection ([rows, `p.channels()`]; the op may overwrite it), `alpha` and `beta`
    /// the raw gate products ([rows, `p.n_v_heads`]). Sequence s reads and updates slot
    /// `batch.seqs[s].state_slot` of `state` (slots of `p.state_floats()`: the convolution's
    /// last inputs, then the matrices); a sequence whose span starts at position 0 starts
    /// from a zero state. `out` gets the rule's output, [rows, `p.value_dim()`]. With `snaps`,
    /// each sequence also keeps the states a rollback may return to ([`Snapshots`]).
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        step: &Step<Self::StepCtx>,
        p: &DeltaNetParams,
        w: DeltaNetWeights<'_, Self::Weight>,
        qkv: &mut Self::Buf,
        alpha: &Self::Buf,
        beta: &Self::Buf,
        state: &mut Self::Buf,
        snaps: Option<Snapshots<'_, Self::Buf>>,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (step, p, w, qkv, alpha, beta, state, snaps, out);
        Err(self.missing(ExtraOp::DeltaNet))
    }
    /// x[r, c] *= σ(gate[r, c]) over `rows` rows of `cols`, or with `per_row`
    /// x[r, c] *= σ(gate[r]) (one gate per row).
    fn sigmoid_mul(
        &self,
        x: &mut Self::Buf,
        gate: &Self::Buf,
        rows: usize,
        cols: usize,
        per_row: bool,
    ) -> Result<()> {
        let _ = (x, gate, rows, cols, per_row);
        Err(self.missing(ExtraOp::SigmoidMul))
    }
    /// DeepSeek-V4's mixes of the hc streams: out [rows, w.rows] = w · (x / rms(x)) over rows
    /// of `cols` (`rms_norm_plain` then `matmul`, `scratch` holding the normed rows: rows·cols
    /// floats); a backend may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn hc_mixes(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        cols: usize,
        eps: f32,
        rows: usize,
        scratch: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.rms_norm_plain(x, cols, eps, rows, scratch)?;
        self.matmul(w, scratch, rows, out)
    }
    /// `hc_mixes` of the streams x [rows, hc·d] by `w` (the norm's `eps`) into `mixes`, then
    /// `hc_pre` over them: a block's (or, with `head`, the output head's) input; a backend may
    /// fuse the two and leave `mixes` unwritten.
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        eps: f32,
        scale: &Self::Weight,
        base: &Self::Weight,
        p: &dsv4::HcParams,
        head: bool,
        rows: usize,
        scratch: &mut Self::Buf,
        mixes: &mut Self::Buf,
        out: &mut Self::Buf,
        pc: &mut Self::Buf,
    ) -> Result<()> {
        self.hc_mixes(x, w, p.hc * p.d, eps, rows, scratch, mixes)?;
        self.hc_pre(x, mixes, scale, base, p, head, rows, out, pc)
    }
    /// DeepSeek-V4's block input ([`dsv4::hc_pre`]): out [rows, d] and the post/comb
    /// weights pc [rows, pc_dim] from the streams x [rows, hc·d] and their mixes.
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &self,
        x: &Self::Buf,
        mixes: &Self::Buf,
        scale: &Self::Weight,
        base: &Self::Weight,
        p: &dsv4::HcParams,
        head: bool,
        rows: usize,
        out: &mut Self::Buf,
        pc: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (x, mixes, scale, base, p, head, rows, out, pc);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// DeepSeek-V4's block output ([`dsv4::hc_post`]).
    fn hc_post(
        &self,
        y: &Self::Buf,
        residual: &Self::Buf,
        pc: &Self::Buf,
        p: &dsv4::HcParams,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (y, residual, pc, p, rows, out);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// out[t, h] = x[t] for each of the hc streams (x [rows, d], out [rows, hc·d]).
    fn hc_expand(
        &self,
        x: &Self::Buf,
        p: &dsv4::HcParams,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (x, p, rows, out);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// A product per group of columns ([`dsv4::matmul_grouped`]): group g's weight `w[g]`
    /// [R, C], x [rows, groups·C], out [rows, groups·R]; `scratch` holds
    /// [`dsv4::grouped_scratch_floats`].
    fn matmul_grouped(
        &self,
        w: &[Self::Weight],
        x: &Self::Buf,
        rows: usize,
        out: &mut Self::Buf,
        scratch: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (w, x, rows, out, scratch);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// out = silu(min(gate, limit)) · clamp(up, −limit, limit) for n elements.
    fn swiglu_clamp(
        &self,
        gate: &Self::Buf,
        up: &Self::Buf,
        limit: f32,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (gate, up, limit, n, out);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// [`Self::matmul_glu`] with DeepSeek-V4's clamped SwiGLU ([`Self::swiglu_clamp`]).
    #[allow(clippy::too_many_arguments)]
    fn matmul_glu_clamp(
        &self,
        limit: f32,
        gate: &Self::Weight,
        up: &Self::Weight,
        x: &Self::Buf,
        rows_x: usize,
        scratch: [&mut Self::Buf; 2],
        out: &mut Self::Buf,
    ) -> Result<()> {
        let [g, u] = scratch;
        self.matmul(gate, x, rows_x, g)?;
        self.matmul(up, x, rows_x, u)?;
        self.swiglu_clamp(g, u, limit, rows_x * self.weight_rows(gate), out)
    }
    /// One DeepSeek-V4 attention layer over the step's sequences ([`dsv4::attention`]):
    /// `state` holds the sequences' slots of [`dsv4::AttnShape::state_floats`]. With `kept`
    /// (its `buf` holding `planes` rows of [`dsv4::kept_floats`] per slot, as
    /// [`dsv4::Kept`] lays them out) each sequence's last rows keep what they overwrite, for
    /// [`Backend::dsv4_rewind`]. `scratch` holds [`dsv4::attention_scratch_floats`].
    #[allow(clippy::too_many_arguments)]
    fn dsv4_attention(
        &self,
        step: &Step<Self::StepCtx>,
        s: &dsv4::AttnShape,
        w: dsv4::AttnWeights<'_, Self::Weight>,
        x: dsv4::AttnInputs<'_, Self::Buf>,
        state: &mut Self::Buf,
        kept: Option<Snapshots<'_, Self::Buf>>,
        scratch: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (step, s, w, x, state, kept, scratch, out);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// [`dsv4::rewind`]: slot `slot` back to its state after row `row` of its last step's
    /// span of `len` rows from position `start`, from the rows `kept` holds in `kept_slot`.
    #[allow(clippy::too_many_arguments)]
    fn dsv4_rewind(
        &self,
        s: &dsv4::AttnShape,
        state: &mut Self::Buf,
        kept: &Self::Buf,
        planes: usize,
        slot: usize,
        kept_slot: usize,
        start: usize,
        len: usize,
        row: usize,
    ) -> Result<()> {
        let _ = (s, state, kept, planes, slot, kept_slot, start, len, row);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// A DeepSeek-V4 MoE layer: [`Backend::moe`]'s contract with the experts chosen by
    /// [`dsv4::moe_route`] (sqrt-softplus scores, `bias` [n_expert] for the choice, or the
    /// token's row of `hash`, [n_vocab, n_used] expert ids as f32) and, where `clamp` > 0, the
    /// clamped SwiGLU.
    #[allow(clippy::too_many_arguments)]
    fn moe_dsv4(
        &self,
        step: &Step<Self::StepCtx>,
        x: &Self::Buf,
        w: MoeWeights<'_, Self::Weight>,
        p: &MoeParams,
        bias: Option<&Self::Weight>,
        hash: Option<&Self::Buf>,
        clamp: f32,
        scratch: MoeScratch<'_, Self::Buf>,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let _ = (step, x, w, p, bias, hash, clamp, scratch, out);
        Err(self.missing(ExtraOp::Dsv4))
    }
    /// The error of an op this backend lacks.
    fn missing(&self, op: ExtraOp) -> BackendError {
        BackendError::MissingOp {
            op,
            backend: self.name(),
            arch: "these".into(),
        }
    }
    /// The part of a tensor-parallel model this instance runs: its communicator's rank and
    /// size ([`comm`]); [`Shard::ONE`] without one.
    fn shard(&self) -> Shard {
        Shard::ONE
    }
    /// x[..n] ← the sum over the ranks of their x[..n], in rank order ([`Comm::all_reduce_sum`]):
    /// after a product whose input columns the ranks split. Nothing to do on one rank.
    fn all_reduce(&self, x: &mut Self::Buf, n: usize) -> Result<()> {
        let _ = (x, n);
        Ok(())
    }
    /// This rank leaves its tensor-parallel group after a step failed on it, so that the
    /// other ranks' exchanges fail instead of waiting for it ([`Comm::leave`]).
    fn leave_group(&self) {}
    /// x[..rows · width · size] ← every rank's columns side by side: rank r's x[..rows · width]
    /// (rows of `width`) becomes columns r·width.. of rows of size·width (the logits of a head
    /// the ranks split by vocabulary). Nothing to do on one rank.
    fn all_gather_cols(&self, x: &mut Self::Buf, rows: usize, width: usize) -> Result<()> {
        let _ = (x, rows, width);
        Ok(())
    }
    /// Copies the first n elements to the host.
    fn read(&self, x: &Self::Buf, n: usize, out: &mut Vec<f32>) -> Result<()>;
    /// Constrained decoding's token masks, applied where the logits are: for each
    /// `(row, bits)`, column c of that row (rows of `cols`) becomes −∞ unless bit c of `bits`
    /// is set (`bits[c / 32] >> (c % 32) & 1`); columns past the bits are refused. Greedy and
    /// top-k rows then still read back a few values per row.
    fn mask_rows(&self, x: &mut Self::Buf, cols: usize, masks: &[(usize, &[u32])]) -> Result<()>;
    /// The `k` largest values of each of `rows` rows of `cols` as (index, value), best first,
    /// ties to the smaller index: `k` pairs per row, row after row (a sampler with top-k needs
    /// only these).
    fn top_k(
        &self,
        x: &Self::Buf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        let mut v = Vec::new();
        self.read(x, rows * cols, &mut v)?;
        out.clear();
        for row in v.chunks_exact(cols.max(1)) {
            let before = out.len();
            reference::top_k(row, k, out);
            // Rows of fewer than k usable values are padded so every row has k pairs.
            out.resize(before + k, (0, f32::NEG_INFINITY));
        }
        Ok(())
    }
    /// Named counters for logs and benchmarks (graph captures and replays, kernels compiled).
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// The index of the largest value (the first on ties) of each of `rows` rows of `cols`:
    /// greedy decoding reads back one id per row instead of the logits.
    fn argmax(&self, x: &Self::Buf, rows: usize, cols: usize, out: &mut Vec<u32>) -> Result<()> {
        let mut v = Vec::new();
        self.read(x, rows * cols, &mut v)?;
        out.clear();
        out.extend(v.chunks_exact(cols.max(1)).map(reference::argmax));
        Ok(())
    }
}

/// A forward step in progress, as `begin_step` decided it: the batch, the rows the ops run
/// over, and the backend's handle to the batch on its device (`ctx`).
#[derive(Clone, Copy, Debug)]
pub struct Step<'b, C> {
    pub batch: &'b Batch,
    /// Token rows the step's ops run over: the batch's tokens plus any padding rows (a graph
    /// bucket), which the backend makes harmless (no KV write, no attention).
    pub rows: usize,
    /// Logits rows `matmul_logits` writes (the batch's wanted rows, plus padding).
    pub logit_rows: usize,
    /// The backend ran the whole step from a captured graph.
    pub replayed: bool,
    pub ctx: C,
}

impl<'b, C> Step<'b, C> {
    /// A step run op by op over exactly the batch's rows.
    pub fn eager(batch: &'b Batch, ctx: C) -> Step<'b, C> {
        Step {
            batch,
            rows: batch.n_tokens(),
            logit_rows: batch.logits.len(),
            replayed: false,
            ctx,
        }
    }
}

/// Where a weight's bytes live: borrowed from the mapped file, which the weight keeps alive.
/// A weight may be a run of whole rows of a tensor (the q, k and v parts of a fused QKV
/// tensor, one expert of a 3-D expert tensor).
#[derive(Clone)]
pub struct WeightBytes {
    pub file: std::sync::Arc<quiver_gguf::GgufFile>,
    pub tensor: usize,
    /// (byte offset, byte length) within the tensor's data; None: all of it.
    pub range: Option<(usize, usize)>,
}

impl WeightBytes {
    /// All of tensor `tensor` of `file`.
    pub fn whole(file: std::sync::Arc<quiver_gguf::GgufFile>, tensor: usize) -> WeightBytes {
        WeightBytes {
            file,
            tensor,
            range: None,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        let all = self.file.tensor_data(&self.file.tensors[self.tensor]);
        match self.range {
            None => all,
            Some((at, len)) => &all[at..at + len],
        }
    }
}
