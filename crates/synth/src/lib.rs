//! `quiver synth`: GGUF files with random weights of a named real shape, quantized like
//! llama.cpp would, with `tokenizer.ggml.model = none`. Speed does not depend on weight
//! values, so these files let benchmarks and GPU-vs-CPU parity run on real shapes where the
//! real models cannot be carried.

mod deep;
mod deepseek4;
mod eagle3;
mod gemma4;
mod meta;
mod mix;
mod qwen35;
mod vocab;
mod weights;

use meta::metadata;
pub(crate) use meta::metadata_common;
pub use mix::{Chooser, FileType, Role};
use quiver_gguf::{GgufError, GgufWriter, Value};
use std::path::Path;
pub use vocab::{tokenizer_keys, vocab_size};
use weights::{quantize_rows, slow_quantizer, Prequant, Weights, PREQUANT_MIN};

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset {0:?} (known: {1})")]
    UnknownPreset(String, String),
    #[error("preset {preset} is a {preset_arch} model, not {arch}")]
    ArchMismatch {
        preset: String,
        preset_arch: String,
        arch: String,
    },
    #[error("unknown type {0:?} (known: {1})")]
    UnknownType(String, String),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{0}")]
    Vocab(String),
}

pub use deep::{Init, LOGIT_SD};

/// A model shape.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_vocab: u64,
    pub n_embd: u64,
    pub n_layer: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub n_ff: u64,
    pub n_ctx: u64,
    pub rope_base: f32,
    pub head_dim: u64,
    pub tied: bool,
    pub rms_eps: f32,
    /// gemma2/gemma3: the sliding window of local layers.
    pub sliding_window: u64,
    /// Mixture of experts (qwen3moe): experts, experts per token, each one's hidden width.
    pub n_expert: u64,
    pub n_expert_used: u64,
    pub n_ff_exp: u64,
    /// Standard deviation of the weights (0.02 as models are initialised; tiny parity models
    /// use more, so that their outputs have clear winners).
    pub stdev: f32,
    /// Norm weights around 1 (1 + N(0, 0.1²)) and random biases, instead of ones and zeros:
    /// the parity models, where a norm applied twice or not at all must show.
    pub random_vectors: bool,
    /// YaRN rope scaling (`rope.scaling.type = yarn`): factor (0: none) and original context.
    pub yarn: (f32, u64),
    /// gemma4: the sliding-window layers' head dim (`head_dim` is the global layers').
    pub head_dim_swa: u64,
    /// gemma4: the global layers' KV heads (`n_head_kv` is the sliding layers'); 0: the same.
    pub n_head_kv_global: u64,
    /// gemma4: every `swa_period`-th layer is global, the others sliding-window.
    pub swa_period: u64,
    /// gemma4: the last layers that read an earlier layer's KV cache.
    pub n_kv_shared: u64,
    /// gemma4: per-layer embedding width (0: none).
    pub n_embd_per_layer: u64,
    /// gemma4: the shared-KV layers' FFN is twice as wide.
    pub double_wide_shared: bool,
    /// gemma4: global layers have no `attn_v` (v is k's product).
    pub k_eq_v: bool,
    /// qwen35/qwen35moe: the gated delta net's key heads, value heads and head width (0: no
    /// such layers), every `full_attn_interval`-th layer full attention.
    pub ssm_heads: (u64, u64, u64),
    pub full_attn_interval: u64,
    /// qwen35/qwen35moe: rotated dims of the full-attention heads (0: all).
    pub n_rot: u64,
    /// qwen35moe: the shared expert's width (0: none).
    pub n_ff_shexp: u64,
    /// How the weights are drawn (`stdev` is `Init::Flat`'s σ).
    pub init: Init,
    /// eagle3: the draft head's target and form.
    pub eagle3: Option<eagle3::Head>,
    /// qwen35/qwen35moe: multi-token-prediction blocks after the `n_layer` blocks
    /// (`nextn_predict_layers`: a full-attention block with `nextn.eh_proj`, `enorm`, `hnorm`
    /// and `shared_head_norm`).
    pub nextn: u64,
    /// deepseek4: its own shape (hyper-connections, compression, indexer, hash routing).
    pub dsv4: Option<deepseek4::Shape>,
}

pub(crate) const BASE: Preset = Preset {
    name: "",
    arch: "llama",
    n_vocab: 32000,
    n_embd: 4096,
    n_layer: 32,
    n_head: 32,
    n_head_kv: 8,
    n_ff: 14336,
    n_ctx: 8192,
    rope_base: 10000.0,
    head_dim: 128,
    tied: false,
    rms_eps: 1e-5,
    sliding_window: 0,
    n_expert: 0,
    n_expert_used: 0,
    n_ff_exp: 0,
    stdev: 0.02,
    random_vectors: false,
    yarn: (0.0, 0),
    head_dim_swa: 0,
    n_head_kv_global: 0,
    swa_period: 0,
    n_kv_shared: 0,
    n_embd_per_layer: 0,
    double_wide_shared: false,
    k_eq_v: false,
    ssm_heads: (0, 0, 0),
    full_attn_interval: 0,
    n_rot: 0,
    n_ff_shexp: 0,
    init: Init::Flat,
    eagle3: None,
    nextn: 0,
    dsv4: None,
};

/// The tiny parity models' common shape: 4 layers of 256, head dim 64, GQA 2.
pub(crate) const TINY: Preset = Preset {
    name: "",
    arch: "llama",
    n_vocab: 512,
    n_embd: 256,
    n_layer: 4,
    n_head: 4,
    n_head_kv: 2,
    n_ff: 512,
    n_ctx: 4096,
    rope_base: 10000.0,
    head_dim: 64,
    tied: false,
    rms_eps: 1e-6,
    sliding_window: 0,
    n_expert: 0,
    n_expert_used: 0,
    n_ff_exp: 0,
    stdev: 0.1,
    random_vectors: true,
    yarn: (0.0, 0),
    head_dim_swa: 0,
    n_head_kv_global: 0,
    swa_period: 0,
    n_kv_shared: 0,
    n_embd_per_layer: 0,
    double_wide_shared: false,
    k_eq_v: false,
    ssm_heads: (0, 0, 0),
    full_attn_interval: 0,
    n_rot: 0,
    n_ff_shexp: 0,
    init: Init::Flat,
    eagle3: None,
    nextn: 0,
    dsv4: None,
};

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "smollm2-135m",
        n_vocab: 49152,
        n_embd: 576,
        n_layer: 30,
        n_head: 9,
        n_head_kv: 3,
        n_ff: 1536,
        rope_base: 100000.0,
        head_dim: 64,
        tied: true,
        ..BASE
    },
    Preset {
        name: "llama3-1b",
        n_vocab: 128256,
        n_embd: 2048,
        n_layer: 16,
        n_ff: 8192,
        rope_base: 500000.0,
        head_dim: 64,
        tied: true,
        ..BASE
    },
    Preset {
        name: "llama3-8b",
        n_vocab: 128256,
        rope_base: 500000.0,
        ..BASE
    },
    // EAGLE-3 heads of those targets' shapes (the converter's default layers 2, n/2, n - 3;
    // the target's vocabulary and output matrix): the machinery's cost with nothing accepted.
    Preset {
        name: "smollm2-135m-eagle3",
        arch: "eagle3",
        n_vocab: 49152,
        n_embd: 576,
        n_layer: 1,
        n_head: 9,
        n_head_kv: 3,
        n_ff: 1536,
        rope_base: 100000.0,
        head_dim: 64,
        eagle3: Some(eagle3::Head {
            target_layers: [2, 15, 27],
            draft_vocab: 0,
            norms: false,
        }),
        ..BASE
    },
    Preset {
        name: "llama3-8b-eagle3",
        arch: "eagle3",
        n_vocab: 128256,
        n_layer: 1,
        rope_base: 500000.0,
        // Llama 3.1 8B's EAGLE-3 heads predict over a draft vocabulary of 32,000 tokens.
        eagle3: Some(eagle3::Head {
            target_layers: [2, 16, 29],
            draft_vocab: 32000,
            norms: false,
        }),
        ..BASE
    },
    Preset {
        name: "gemma3-270m",
        arch: "gemma3",
        n_vocab: 262144,
        n_embd: 640,
        n_layer: 18,
        n_head: 4,
        n_head_kv: 1,
        n_ff: 2048,
        n_ctx: 32768,
        rope_base: 1_000_000.0,
        head_dim: 256,
        tied: true,
        rms_eps: 1e-6,
        sliding_window: 512,
        ..BASE
    },
    Preset {
        name: "qwen3-0.6b",
        arch: "qwen3",
        n_vocab: 151936,
        n_embd: 1024,
        n_layer: 28,
        n_head: 16,
        n_head_kv: 8,
        n_ff: 3072,
        n_ctx: 40960,
        rope_base: 1_000_000.0,
        head_dim: 128,
        tied: true,
        rms_eps: 1e-6,
        ..BASE
    },
    Preset {
        name: "qwen3-8b",
        arch: "qwen3",
        n_vocab: 151936,
        n_embd: 4096,
        n_layer: 36,
        n_head: 32,
        n_head_kv: 8,
        n_ff: 12288,
        n_ctx: 40960,
        rope_base: 1_000_000.0,
        head_dim: 128,
        rms_eps: 1e-6,
        ..BASE
    },
    Preset {
        name: "qwen3-30b-a3b",
        arch: "qwen3moe",
        n_vocab: 151936,
        n_embd: 2048,
        n_layer: 48,
        n_head: 32,
        n_head_kv: 4,
        n_ff: 6144,
        n_ctx: 40960,
        rope_base: 1_000_000.0,
        head_dim: 128,
        rms_eps: 1e-6,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 768,
        ..BASE
    },
    Preset {
        name: "qwen2.5-7b",
        arch: "qwen2",
        n_vocab: 152064,
        n_embd: 3584,
        n_layer: 28,
        n_head: 28,
        n_head_kv: 4,
        n_ff: 18944,
        n_ctx: 32768,
        rope_base: 1_000_000.0,
        head_dim: 128,
        rms_eps: 1e-6,
        ..BASE
    },
    Preset {
        name: "qwen2.5-32b",
        arch: "qwen2",
        n_vocab: 152064,
        n_embd: 5120,
        n_layer: 64,
        n_head: 40,
        n_head_kv: 8,
        n_ff: 27648,
        n_ctx: 32768,
        rope_base: 1_000_000.0,
        head_dim: 128,
        rms_eps: 1e-6,
        ..BASE
    },
    Preset {
        name: "gemma2-2b",
        arch: "gemma2",
        n_vocab: 256000,
        n_embd: 2304,
        n_layer: 26,
        n_head: 8,
        n_head_kv: 4,
        n_ff: 9216,
        n_ctx: 8192,
        head_dim: 256,
        tied: true,
        rms_eps: 1e-6,
        sliding_window: 4096,
        ..BASE
    },
    Preset {
        name: "phi3-mini",
        arch: "phi3",
        n_vocab: 32064,
        n_embd: 3072,
        n_layer: 32,
        n_head: 32,
        n_head_kv: 32,
        n_ff: 8192,
        n_ctx: 4096,
        head_dim: 96,
        ..BASE
    },
    Preset {
        name: "tiny-llama",
        ..TINY
    },
    Preset {
        name: "tiny-eagle3",
        arch: "eagle3",
        n_layer: 1,
        // Reads tiny-llama's layers 1 to 3; a draft vocabulary of 384 of its 512 tokens, with
        // an output matrix of its own.
        eagle3: Some(eagle3::Head {
            target_layers: [1, 2, 3],
            draft_vocab: 384,
            norms: false,
        }),
        ..TINY
    },
    Preset {
        name: "tiny-eagle3-norms",
        arch: "eagle3",
        n_layer: 1,
        // g normed before fc and as the residual; the target's vocabulary and output matrix.
        eagle3: Some(eagle3::Head {
            target_layers: [0, 2, 3],
            draft_vocab: 0,
            norms: true,
        }),
        ..TINY
    },
    Preset {
        name: "tiny-mistral3",
        arch: "mistral3",
        rope_base: 1_000_000.0,
        // YaRN by 4 over an original context of 16, as Ministral 3 scales its rope.
        yarn: (4.0, 16),
        ..TINY
    },
    Preset {
        name: "tiny-qwen2",
        arch: "qwen2",
        tied: true,
        ..TINY
    },
    Preset {
        name: "tiny-qwen3",
        arch: "qwen3",
        // Heads wider than n_embd / n_head, as Qwen3 has them.
        head_dim: 64,
        n_head: 8,
        ..TINY
    },
    Preset {
        name: "tiny-qwen3moe",
        arch: "qwen3moe",
        n_expert: 16,
        n_expert_used: 4,
        n_ff_exp: 128,
        ..TINY
    },
    Preset {
        name: "tiny-gemma2",
        arch: "gemma2",
        tied: true,
        sliding_window: 8,
        ..TINY
    },
    Preset {
        name: "tiny-gemma3",
        arch: "gemma3",
        n_layer: 6,
        tied: true,
        sliding_window: 8,
        ..TINY
    },
    // Gemma 4 E2B, from the Hugging Face config of google/gemma-4-E2B as remembered (not
    // checked against a file): llama.cpp's sources confirm 35 layers (its E2B type), 8 query
    // heads of 256 on sliding layers (test-backend-ops' "gemma4 E2B sliding" rope case), the
    // 512-wide global heads and the 0.25 partial rope (the converter's defaults).
    Preset {
        name: "gemma4-e2b",
        arch: "gemma4",
        n_vocab: 262144,
        n_embd: 1536,
        n_layer: 35,
        n_head: 8,
        n_head_kv: 1,
        n_ff: 6144,
        n_ctx: 131072,
        rope_base: 1_000_000.0,
        head_dim: 512,
        head_dim_swa: 256,
        swa_period: 5,
        sliding_window: 512,
        n_kv_shared: 20,
        n_embd_per_layer: 256,
        double_wide_shared: true,
        tied: true,
        rms_eps: 1e-6,
        ..BASE
    },
    // Gemma 4 26B-A4B, likewise from memory of its config: llama.cpp confirms 30 layers (its
    // 26B_A4B type) and 16 query heads over 2 KV heads on global layers (test-backend-ops);
    // 8 KV heads on sliding layers, 128 experts of 704 (8 per token) beside a 2112-wide MLP,
    // window 1024, a global layer every sixth, k = v on global layers are as remembered.
    Preset {
        name: "gemma4-26b-a4b",
        arch: "gemma4",
        n_vocab: 262144,
        n_embd: 2816,
        n_layer: 30,
        n_head: 16,
        n_head_kv: 8,
        n_head_kv_global: 2,
        n_ff: 2112,
        n_ctx: 262144,
        rope_base: 1_000_000.0,
        head_dim: 512,
        head_dim_swa: 256,
        swa_period: 6,
        sliding_window: 1024,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 704,
        k_eq_v: true,
        tied: true,
        rms_eps: 1e-6,
        ..BASE
    },
    // Both kinds of layer with different head dims (64 sliding, 128 global) and KV heads,
    // three shared-KV layers (two sliding, one global) of double-wide FFN, PLE.
    Preset {
        name: "tiny-gemma4",
        arch: "gemma4",
        n_layer: 6,
        n_head_kv: 2,
        n_head_kv_global: 1,
        head_dim: 128,
        head_dim_swa: 64,
        swa_period: 3,
        sliding_window: 8,
        n_kv_shared: 3,
        n_embd_per_layer: 64,
        double_wide_shared: true,
        rope_base: 1_000_000.0,
        tied: true,
        ..TINY
    },
    // Experts beside a dense MLP in every layer, global layers without attn_v.
    Preset {
        name: "tiny-gemma4moe",
        arch: "gemma4",
        n_head_kv: 2,
        n_head_kv_global: 1,
        head_dim: 128,
        head_dim_swa: 64,
        swa_period: 2,
        sliding_window: 8,
        n_ff: 256,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 128,
        k_eq_v: true,
        rope_base: 1_000_000.0,
        tied: true,
        ..TINY
    },
    qwen35::QWEN35_0_8B,
    qwen35::TINY_QWEN35,
    qwen35::TINY_QWEN35MOE,
    Preset {
        name: "tiny-phi3",
        arch: "phi3",
        n_head_kv: 4,
        ..TINY
    },
];

/// Every preset: the real shapes, the tiny parity models, the deep parity models.
pub fn presets() -> impl Iterator<Item = &'static Preset> {
    PRESETS
        .iter()
        .chain(qwen35::PRESETS)
        .chain(deepseek4::PRESETS)
        .chain(deep::PRESETS)
}

pub fn preset(name: &str) -> Result<&'static Preset, SynthError> {
    presets().find(|p| p.name == name).ok_or_else(|| {
        SynthError::UnknownPreset(
            name.into(),
            presets().map(|p| p.name).collect::<Vec<_>>().join(", "),
        )
    })
}

pub fn file_type(name: &str) -> Result<FileType, SynthError> {
    FileType::parse(name)
        .ok_or_else(|| SynthError::UnknownType(name.into(), FileType::names().join(", ")))
}

/// One tensor of the model: name, role and row-major shape.
pub struct Planned {
    pub name: String,
    pub role: Role,
    pub shape: Vec<u64>,
}

/// A multi-token-prediction block's input stage and its shared head's norm (block `i`, width
/// `d`), as Qwen 3.5's and DeepSeek-V4's files carry them.
pub(crate) fn mtp_input(i: u64, d: u64) -> [Planned; 4] {
    let t = |s: &str, role, shape: &[u64]| Planned {
        name: format!("blk.{i}.nextn.{s}.weight"),
        role,
        shape: shape.to_vec(),
    };
    [
        t("eh_proj", Role::AttnOutput, &[d, 2 * d]),
        t("enorm", Role::Vector, &[d]),
        t("hnorm", Role::Vector, &[d]),
        t("shared_head_norm", Role::Vector, &[d]),
    ]
}

/// The tensors of a preset in file order.
pub fn plan(p: &Preset) -> Vec<Planned> {
    let t = |name: String, role, shape: &[u64]| Planned {
        name,
        role,
        shape: shape.to_vec(),
    };
    if p.arch == "gemma4" {
        return gemma4::plan(p);
    }
    if p.ssm_heads.0 > 0 {
        return qwen35::plan(p);
    }
    if p.dsv4.is_some() {
        return deepseek4::plan(p);
    }
    if let Some(h) = &p.eagle3 {
        return eagle3::plan(p, h);
    }
    let (d, hd, arch) = (p.n_embd, p.head_dim, p.arch);
    let (qd, kvd) = (p.n_head * hd, p.n_head_kv * hd);
    let gemma = arch == "gemma2" || arch == "gemma3";
    let qk_norm = matches!(arch, "gemma3" | "qwen3" | "qwen3moe");
    let mut v = vec![t(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        &[p.n_vocab, d],
    )];
    for i in 0..p.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(t(b("attn_norm"), Role::Vector, &[d]));
        if arch == "phi3" {
            v.push(t(b("attn_qkv"), Role::AttnQkv, &[qd + 2 * kvd, d]));
        } else {
            v.push(t(b("attn_q"), Role::AttnQ, &[qd, d]));
            v.push(t(b("attn_k"), Role::AttnK, &[kvd, d]));
            v.push(t(b("attn_v"), Role::AttnV, &[kvd, d]));
        }
        if arch == "qwen2" {
            for (s, n) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                v.push(t(format!("blk.{i}.{s}.bias"), Role::Vector, &[n]));
            }
        }
        if qk_norm {
            v.push(t(b("attn_q_norm"), Role::Vector, &[hd]));
            v.push(t(b("attn_k_norm"), Role::Vector, &[hd]));
        }
        v.push(t(b("attn_output"), Role::AttnOutput, &[d, qd]));
        if gemma {
            v.push(t(b("post_attention_norm"), Role::Vector, &[d]));
        }
        v.push(t(b("ffn_norm"), Role::Vector, &[d]));
        if p.n_expert > 0 {
            let (ne, fe) = (p.n_expert, p.n_ff_exp);
            v.push(t(b("ffn_gate_inp"), Role::Router, &[ne, d]));
            v.push(t(b("ffn_gate_exps"), Role::FfnGate, &[ne, fe, d]));
            v.push(t(b("ffn_up_exps"), Role::FfnUp, &[ne, fe, d]));
            v.push(t(b("ffn_down_exps"), Role::FfnDown, &[ne, d, fe]));
        } else if arch == "phi3" {
            v.push(t(b("ffn_up"), Role::FfnUp, &[2 * p.n_ff, d]));
            v.push(t(b("ffn_down"), Role::FfnDown, &[d, p.n_ff]));
        } else {
            v.push(t(b("ffn_gate"), Role::FfnGate, &[p.n_ff, d]));
            v.push(t(b("ffn_up"), Role::FfnUp, &[p.n_ff, d]));
            v.push(t(b("ffn_down"), Role::FfnDown, &[d, p.n_ff]));
        }
        if gemma {
            v.push(t(b("post_ffw_norm"), Role::Vector, &[d]));
        }
    }
    if arch == "phi3" && p.random_vectors {
        // LongRoPE's per-pair factors (Phi-3.5), short and long.
        v.push(t(
            "rope_factors_long.weight".into(),
            Role::Vector,
            &[hd / 2],
        ));
        v.push(t(
            "rope_factors_short.weight".into(),
            Role::Vector,
            &[hd / 2],
        ));
    }
    v.push(t("output_norm.weight".into(), Role::Vector, &[d]));
    if !p.tied {
        v.push(t("output.weight".into(), Role::Output, &[p.n_vocab, d]));
    }
    v
}

/// Writes the model to `path` (atomically), quantizing on `threads` threads. `progress(i, n)`
/// is called after each tensor.
pub fn write(
    p: &Preset,
    ft: FileType,
    seed: u64,
    path: &Path,
    threads: usize,
    progress: impl FnMut(usize, usize),
) -> Result<(), SynthError> {
    write_with(p, ft, seed, path, threads, &[], progress)
}

/// [`write`], with `extra` metadata keys set over the preset's (e.g. [`tokenizer_keys`]).
pub fn write_with(
    p: &Preset,
    ft: FileType,
    seed: u64,
    path: &Path,
    threads: usize,
    extra: &[(String, Value)],
    mut progress: impl FnMut(usize, usize),
) -> Result<(), SynthError> {
    let planned = plan(p);
    let mut chooser = Chooser::new(
        ft,
        p.n_layer as usize,
        p.n_head as usize,
        p.n_head_kv as usize,
        p.tied,
    );
    let mut w = GgufWriter::new();
    metadata(&mut w, p, ft);
    extra
        .iter()
        .for_each(|(k, v)| _ = w.set(k.clone(), v.clone()));
    for t in &planned {
        let ty = match (t.name.as_str(), deepseek4::int_tensor(p, &t.name)) {
            ("d2t", _) => quiver_gguf::GgmlType::I64,
            (_, Some((ty, _))) => ty,
            _ => chooser.choose(t.role, *t.shape.last().unwrap_or(&1)),
        };
        w.add_tensor(t.name.clone(), ty, &t.shape);
    }
    let mut weights = Weights::new(seed);
    let mut prequant = Prequant::default();
    let n = planned.len();
    w.write_file(path, |i, info, buf| {
        let cols = info.cols() as usize;
        let rows = info.rows() as usize;
        let scale = match p.init {
            Init::Flat => p.stdev / 0.02,
            Init::Deep => deep::sigma(p, planned[i].role, &planned[i].name, cols as u64) / 0.02,
        };
        let fixed = gemma4::fixed_values(p, &planned[i].name)
            .or_else(|| qwen35::fixed_values(p, &planned[i].name));
        if let Some(ids) = eagle3::d2t(p, &planned[i].name) {
            ids.iter()
                .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
        } else if let Some((_, bytes)) = deepseek4::int_tensor(p, &planned[i].name) {
            buf.extend_from_slice(&bytes);
        } else if let Some(v) = fixed {
            v.iter()
                .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
        } else if planned[i].role == Role::Vector {
            for v in weights::vector(p, &planned[i].name, rows * cols, &mut weights) {
                buf.extend_from_slice(&v.to_le_bytes());
            }
        } else {
            let starts: Vec<usize> = (0..rows).map(|_| weights.row_start()).collect();
            let role = planned[i].role;
            let bytes = if rows * cols >= PREQUANT_MIN
                && slow_quantizer(info.ty)
                && !matches!(role, Role::TokenEmbd | Role::Output)
            {
                prequant.rows(&weights, &starts, cols, scale, info.ty, threads)
            } else {
                quantize_rows(&weights, &starts, cols, scale, info.ty, threads)
            }
            .map_err(|e| GgufError::TensorData {
                name: info.name.clone(),
                detail: format!("quantizing to {}: {e}", info.ty),
            })?;
            buf.extend_from_slice(&bytes);
        }
        progress(i + 1, n);
        Ok(())
    })?;
    Ok(())
}
