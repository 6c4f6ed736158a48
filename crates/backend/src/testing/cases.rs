//! The case table: what every backend's ops are checked over. The step ops (`embed`,
//! `matmul_logits`, `rope_kv_write`, `attention`) also run over every batch of
//! [`batches`](super::batches::batches).

use crate::{AttnParams, Llama3Scaling, RopeMode, RopeParams};
use quiver_gguf::GgmlType;
use std::sync::Arc;

/// Every weight type the products and the embedding take somewhere; a backend that refuses
/// one at load skips it with a note.
pub const WEIGHT_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Weight shapes `[rows, cols]` of the products (columns whole 256-blocks of the K-quants; one,
/// two, three and nine of them: the last over two CUDA tensor-core tiles of 64 rows and over
/// nine of its 256-column summation chunks, more than the warps of a decode block, qmv, so that
/// one warp takes two).
pub const PRODUCT_SHAPES: &[(usize, usize)] = &[(96, 512), (40, 256), (72, 768), (136, 2304)];

/// Token counts of the plain products: decode (1), the CUDA backend's cut-over to the tensor
/// cores (3), its matrix-vector kernels' launches of up to 8 tokens (8, 9, 17), prefill (40,
/// 64, and 150 over three of its tensor-core tiles of 64 tokens).
pub const PRODUCT_TOKENS: &[usize] = &[1, 3, 8, 9, 17, 40, 64, 150];

/// Token counts of the fused products (q/k/v in one call, gate·up with the activation).
pub const FUSED_TOKENS: &[usize] = &[1, 5, 12, 64];

/// One attention shape: head dim, heads, KV heads (GQA ratio heads / KV heads), sliding
/// window, soft-cap.
#[derive(Clone, Copy, Debug)]
pub struct AttnCase {
    pub head_dim: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub window: Option<u32>,
    pub softcap: Option<f32>,
}

impl AttnCase {
    pub fn params(&self) -> AttnParams {
        AttnParams {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            scale_q: false,
            window: self.window,
            softcap: self.softcap,
        }
    }
}

const fn attn(
    head_dim: usize,
    n_head: usize,
    n_head_kv: usize,
    window: Option<u32>,
    softcap: Option<f32>,
) -> AttnCase {
    AttnCase {
        head_dim,
        n_head,
        n_head_kv,
        window,
        softcap,
    }
}

/// Attention shapes: head dims 64, 128 and 256; GQA 1, 2, 3, 4 and 8 heads per KV head; windows
/// of 3, 40 and 100 positions; soft-caps of 20 and 30.
pub const ATTENTION: &[AttnCase] = &[
    attn(64, 4, 2, None, None),
    // Phi-3's head dim.
    attn(96, 8, 8, None, None),
    attn(96, 4, 2, Some(40), None),
    attn(256, 4, 1, Some(3), None),
    attn(128, 6, 3, None, Some(30.0)),
    attn(128, 32, 8, None, None),
    attn(128, 8, 2, None, None),
    // Qwen2.5-32B's KV group of 5 (the wgmma prompt kernel's 128-row blocks: 2 + 2 + 1 heads).
    attn(128, 10, 2, None, None),
    attn(128, 4, 4, Some(40), None),
    attn(64, 4, 1, Some(100), Some(20.0)),
    attn(256, 4, 1, Some(40), None),
    attn(256, 8, 2, None, Some(30.0)),
    attn(256, 2, 2, None, None),
    // Gemma 4's global layers; a KV group of 6 (the decode kernel's blocks of 4 heads: 4 + 2).
    attn(512, 8, 2, None, None),
    attn(64, 12, 2, Some(40), None),
];

/// How a rope case scales its frequencies.
#[derive(Clone, Copy, Debug)]
pub enum Scaling {
    None,
    /// Llama-3 style, over an original context of 64 (so the batches' positions reach every
    /// band).
    Llama3,
    /// Per-pair frequency divisors (`rope_freqs.weight`).
    FreqFactors,
    /// Linear position scaling by 1/4.
    Linear,
    /// YaRN by 4 over an original context of 64, with an attention factor.
    Yarn,
}

/// One rope + KV write case.
#[derive(Clone, Copy, Debug)]
pub struct RopeCase {
    pub mode: RopeMode,
    pub head_dim: usize,
    /// Rotated dimensions (≤ head_dim).
    pub n_dims: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub scaling: Scaling,
}

impl RopeCase {
    pub fn params(&self) -> (RopeParams, AttnParams) {
        let half = self.n_dims / 2;
        let rope = RopeParams {
            mode: self.mode,
            n_dims: self.n_dims,
            base: 10000.0,
            freq_scale: match self.scaling {
                Scaling::Linear | Scaling::Yarn => 0.25,
                _ => 1.0,
            },
            llama3: matches!(self.scaling, Scaling::Llama3).then_some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 64.0,
            }),
            freq_factors: matches!(self.scaling, Scaling::FreqFactors)
                .then(|| Arc::new((0..half).map(|i| 1.0 + (i % 7) as f32 * 0.5).collect())),
            yarn: matches!(self.scaling, Scaling::Yarn).then_some(crate::Yarn {
                ext_factor: 1.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_context: 64.0,
            }),
            attn_factor: if matches!(self.scaling, Scaling::Yarn) {
                0.9
            } else {
                1.0
            },
            q_temp: None,
        };
        let a = AttnParams {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            scale: 1.0,
            scale_q: false,
            window: None,
            softcap: None,
        };
        (rope, a)
    }
}

const fn rope(
    mode: RopeMode,
    head_dim: usize,
    n_dims: usize,
    n_head: usize,
    n_head_kv: usize,
    scaling: Scaling,
) -> RopeCase {
    RopeCase {
        mode,
        head_dim,
        n_dims,
        n_head,
        n_head_kv,
        scaling,
    }
}

/// Rope cases: both modes, head dims 32 to 256, partial rotation, every scaling.
pub const ROPE: &[RopeCase] = &[
    rope(RopeMode::Normal, 32, 32, 4, 2, Scaling::None),
    rope(RopeMode::Neox, 32, 32, 4, 2, Scaling::None),
    rope(RopeMode::Normal, 64, 64, 4, 2, Scaling::Llama3),
    rope(RopeMode::Neox, 128, 128, 4, 2, Scaling::None),
    rope(RopeMode::Neox, 128, 64, 4, 2, Scaling::None),
    rope(RopeMode::Normal, 128, 128, 8, 1, Scaling::FreqFactors),
    rope(RopeMode::Neox, 256, 256, 8, 4, Scaling::Linear),
    rope(RopeMode::Neox, 128, 128, 4, 2, Scaling::Yarn),
    rope(RopeMode::Normal, 64, 64, 4, 2, Scaling::Yarn),
];

/// Norm cases `(rows, width)`: one row to 604 (per-head norms of 151 tokens × 4 heads), widths
/// 64 to 1024.
pub const NORMS: &[(usize, usize)] = &[(1, 96), (6, 96), (9, 256), (64, 128), (604, 64), (3, 1024)];

/// GLU lengths (elements).
pub const GLU: &[usize] = &[1, 576, 1000, 6148];

/// Logits shapes `(rows, cols)` of softcap, argmax and top-k (rows ≥ 3: ties are planted in
/// rows 1 and 2).
pub const LOGITS: &[(usize, usize)] = &[(3, 50_000), (9, 1000)];

/// The k of top-k.
pub const TOP_K: &[usize] = &[1, 5, 40, 64];
