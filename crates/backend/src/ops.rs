//! The extra ops' names, and the shapes of the mixture-of-experts op ([`crate::Backend::moe`]).

/// Ops beyond the core every architecture uses. A backend says which it has
/// ([`Backend::supports`]); a model that needs one its backend lacks is refused at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraOp {
    /// [`Backend::scale`]
    Scale,
    /// [`Backend::rms_norm_plain`]
    RmsNormPlain,
    /// [`Backend::mul_cols`]
    MulCols,
    /// [`Backend::copy_cols`]
    CopyCols,
    /// [`Backend::put_cols`]
    PutCols,
    /// [`Backend::write`]
    Write,
    /// [`Backend::copy_range`]
    CopyRange,
    /// [`Backend::rope_q`]
    RopeQ,
    /// [`Backend::moe`] with router logits the caller computed (`MoeParams::router_given`)
    /// and per-expert output scales (`MoeWeights::down_scale`).
    MoeExtras,
    /// [`Backend::moe`] with per-expert scales of the gate and up products
    /// (`MoeWeights::gate_scale`, `up_scale`).
    MoeProductScales,
    /// [`Backend::delta_net`] over the recurrent state (Qwen 3.5's linear-attention layers).
    DeltaNet,
    /// [`Backend::sigmoid_mul`]
    SigmoidMul,
    /// [`Backend::moe`] with the gate and up experts in one tensor (`MoeWeights::gate` and
    /// `up` the same weight).
    MoeGateUpFused,
    /// DeepSeek-V4's ops ([`dsv4`]): [`Backend::hc_pre`], [`Backend::hc_post`],
    /// [`Backend::hc_expand`], [`Backend::matmul_grouped`], [`Backend::swiglu_clamp`],
    /// [`Backend::dsv4_attention`], [`Backend::moe_dsv4`].
    Dsv4,
    /// [`Backend::embed_part`]
    EmbedPart,
}

impl std::fmt::Display for ExtraOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExtraOp::Scale => "scale",
            ExtraOp::RmsNormPlain => "rms_norm_plain",
            ExtraOp::MulCols => "mul_cols",
            ExtraOp::CopyCols => "copy_cols",
            ExtraOp::CopyRange => "copy_range",
            ExtraOp::PutCols => "put_cols",
            ExtraOp::Write => "write",
            ExtraOp::RopeQ => "rope_q",
            ExtraOp::MoeExtras => "moe (given router logits, per-expert scales)",
            ExtraOp::MoeProductScales => "moe (per-expert gate/up scales)",
            ExtraOp::DeltaNet => "gated delta net (recurrent state)",
            ExtraOp::SigmoidMul => "sigmoid_mul",
            ExtraOp::MoeGateUpFused => "moe (gate and up experts in one tensor)",
            ExtraOp::EmbedPart => "embed_part (an embedding split by vocabulary)",
            ExtraOp::Dsv4 => {
                "deepseek4 (hyper-connections, compressed sparse attention, sqrt-softplus MoE)"
            }
        })
    }
}

/// Element-wise gated activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) · up
    SwiGlu,
    /// gelu_tanh(gate) · up
    GeGlu,
}

/// How a mixture-of-experts router turns its logits into expert probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A mixture-of-experts FFN: `n_used` of `n_expert` experts per token, each a gated FFN of
/// hidden width `n_ff`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeParams {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff: usize,
    pub gating: Gating,
    /// Divide the chosen experts' probabilities by their sum.
    pub norm: bool,
    /// Multiplies the chosen weights (1: none).
    pub scale: f32,
    pub act: Activation,
    /// The caller has written the router logits into [`MoeScratch::logits`] (a router over
    /// another input than the experts', Gemma 4): the backend skips the router product.
    pub router_given: bool,
    /// The experts this instance holds, (first, count) of `n_expert` (all: (0, n_expert)); a
    /// tensor-parallel rank of an expert-parallel split holds a run of them, and the pairs of
    /// the others add nothing to its output (the ranks' outputs are summed).
    pub held: (usize, usize),
}

impl MoeParams {
    /// Whether expert `e` is one this instance holds.
    pub fn holds(&self, e: usize) -> bool {
        (self.held.0..self.held.0 + self.held.1).contains(&e)
    }

    /// Floats of each [`MoeScratch`] buffer a step of `rows` tokens needs, in field order: the
    /// router logits' with room for a device's sort of the pairs by expert once they are spent
    /// (offsets, a row per pair, a list of the tiles of 8 or more pairs of one expert).
    pub fn scratch_floats(&self, rows: usize, n_embd: usize) -> [usize; 7] {
        let pairs = rows * self.n_used;
        [
            (rows * self.n_expert).max(2 * self.n_expert + 2 + pairs + pairs.div_ceil(8)),
            2 * pairs,
            pairs * n_embd,
            pairs * self.n_ff,
            pairs * self.n_ff,
            pairs * self.n_ff,
            pairs * n_embd,
        ]
    }
}

/// One MoE layer's weights: the router [n_expert, n_embd], and the experts stacked as
/// [n_expert · n_ff, n_embd] (gate, up) and [n_expert · n_embd, n_ff] (down), as the GGUF's
/// 3-D tensors lie in memory.
///
/// `gate` and `up` may be the same weight (`std::ptr::eq`): the experts' gate and up in one
/// tensor of 2·n_ff rows per expert, the gate's first ([`ExtraOp::MoeGateUpFused`]).
pub struct MoeWeights<'a, W> {
    pub router: &'a W,
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
    /// Per-expert scales [n_expert] multiplying each expert's output before its routing
    /// weight (`ffn_down_exps.scale`), where the model has them.
    pub down_scale: Option<&'a W>,
    /// Per-expert scales [n_expert] of the gate's and the up product (`ffn_gate_exps.scale`,
    /// `ffn_up_exps.scale`), the gate's before the activation; backends without them refuse.
    pub gate_scale: Option<&'a W>,
    pub up_scale: Option<&'a W>,
}

// Copy whatever W is: the fields are references.
impl<W> Clone for MoeWeights<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for MoeWeights<'_, W> {}

/// Buffers [`Backend::moe`] may overwrite, sized by [`MoeParams::scratch_floats`].
pub struct MoeScratch<'a, B> {
    /// Router logits [rows, n_expert].
    pub logits: &'a mut B,
    /// The chosen experts and their weights per (token, slot).
    pub routes: &'a mut B,
    /// Inputs gathered per (token, slot) [pairs, n_embd].
    pub xs: &'a mut B,
    pub gate: &'a mut B,
    pub up: &'a mut B,
    pub act: &'a mut B,
    /// Each expert's output per (token, slot) [pairs, n_embd].
    pub ys: &'a mut B,
}
