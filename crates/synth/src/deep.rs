//! Weights that keep deep random models well conditioned (`Init::Deep`), and the `deep-*`
//! presets: each architecture at the depth and layer pattern of its smallest published model.
//!
//! With one σ for every matrix (`Init::Flat`) a deep random model is ill conditioned: the
//! residual stream grows layer by layer, attention logits grow with the head dim (Gemma 4's
//! attention scale of 1 over normed q and k makes them near one-hot), and the rounding of one
//! layer decides the next layer's softmax, so two correct implementations disagree on most
//! top-1 tokens after 30 layers. `Init::Deep` draws each matrix with σ by its role and fan-in,
//! as models are initialised to train:
//! - inputs of a product (q, k, v, gate, up, routers, the delta net's projections): σ =
//!   1/√fan-in, so every product's output has unit variance;
//! - residual-branch outputs (attn_output, ffn_down, ssm_out, experts' down): σ =
//!   [`LOGIT_SD`]/√(fan-in · 2·n_layer), so that the branches add up to a stream of about
//!   [`LOGIT_SD`], not √n_layer times one branch, and outweigh the embedding: with tied
//!   embeddings a stream made mostly of the input token's embedding predicts that token
//!   (measured: 114–124 of 144 positions on deep-llama, deep-qwen2 and deep-qwen3 with branches
//!   of 1); where a norm follows the branch (Gemma's post norms) that norm's weights carry the
//!   factor, times √n_embd, Gemma's scale of the embedding;
//! - the embedding and output: logits of standard deviation [`LOGIT_SD`], clear winners without
//!   a near one-hot softmax;
//! - Gemma 4's q and k norms (attention scale 1): weights around hd^(-1/4), so that q·k has unit
//!   variance as 1/√hd gives the other architectures; its router (input scaled by 1/√n_embd):
//!   σ 1, router logits of unit variance.
//!
//! Norm weights are 1 + N(0, 0.1²) and biases N(0, 0.1²), as the tiny presets have them.

use crate::{Preset, Role, BASE};

/// How the random weights are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// Every matrix N(0, stdev²).
    Flat,
    /// σ per tensor by role, fan-in and depth, for deep models that stay well conditioned
    /// (`deep.rs`).
    Deep,
}

impl Init {
    pub fn parse(s: &str) -> Option<Init> {
        match s.to_ascii_lowercase().as_str() {
            "flat" => Some(Init::Flat),
            "deep" => Some(Init::Deep),
            _ => None,
        }
    }
}

/// The standard deviation of the output logits over the vocabulary.
pub const LOGIT_SD: f32 = 3.0;

/// The standard deviation of the expert routers' logits: the softmax over them peaked, so that
/// the last expert chosen weighs little, and two near-equal router logits (which one rounding
/// ranks one way and another the other) swap experts of little weight.
pub const ROUTER_SD: f32 = 4.0;

/// An expert router (`ffn_gate_inp`, not the shared expert's gate `ffn_gate_inp_shexp`).
fn is_router(name: &str) -> bool {
    name.contains(".ffn_gate_inp.") && !name.contains("shexp")
}

/// σ of a matrix of `Init::Deep`: by role, name and fan-in (`cols`, the row length).
pub(crate) fn sigma(p: &Preset, role: Role, name: &str, cols: u64) -> f32 {
    let fan_in = (cols.max(1)) as f32;
    let d = p.n_embd as f32;
    let branch = (2.0 * p.n_layer.max(1) as f32).sqrt();
    let post_norms = matches!(p.arch, "gemma2" | "gemma3" | "gemma4");
    if name == "per_layer_token_embd.weight" {
        // Scaled by √n_embd_per_layer in the graph: unit variance.
        return 1.0 / (p.n_embd_per_layer.max(1) as f32).sqrt();
    }
    match role {
        Role::TokenEmbd if p.tied => LOGIT_SD / d.sqrt(),
        Role::TokenEmbd => 1.0,
        Role::Output => LOGIT_SD / d.sqrt(),
        // Gemma 4 scales the router's input by 1/√n_embd.
        Role::Router if is_router(name) && p.arch == "gemma4" => ROUTER_SD,
        Role::Router if is_router(name) => ROUTER_SD / fan_in.sqrt(),
        Role::AttnOutput | Role::FfnDown if !post_norms => LOGIT_SD / (fan_in.sqrt() * branch),
        _ => 1.0 / fan_in.sqrt(),
    }
}

/// The factor on a norm weight vector (1 + N(0, 0.1²)) of `Init::Deep`; `len` its length.
pub(crate) fn norm_factor(p: &Preset, name: &str, len: usize) -> f32 {
    let branch = (2.0 * p.n_layer.max(1) as f32).sqrt();
    let gemma = matches!(p.arch, "gemma2" | "gemma3" | "gemma4");
    let branch_out = [".post_attention_norm.", ".post_ffw_norm.", ".post_norm."];
    if gemma && branch_out.iter().any(|s| name.contains(s)) {
        // Gemma scales the embedding by √n_embd: the branches scale with it.
        return LOGIT_SD * (p.n_embd as f32).sqrt() / branch;
    }
    if p.arch == "gemma4" && (name.contains(".attn_q_norm.") || name.contains(".attn_k_norm.")) {
        // The layer's head dim is the vector's length.
        return (len.max(1) as f32).powf(-0.25);
    }
    1.0
}

/// The deep parity models' common settings: `Init::Deep`, random norms and biases, a small
/// vocabulary (the product of the output row is not what depth tests).
const DEEP: Preset = Preset {
    n_vocab: 4096,
    init: Init::Deep,
    random_vectors: true,
    rms_eps: 1e-6,
    ..BASE
};

/// Each architecture at the depth and layer pattern (sliding-window period, shared-KV layers,
/// delta-net interval, experts per token) of its smallest published model, with its head dims;
/// widths (n_embd, heads, FFN, expert count) cut where the real model would not run in a test
/// on 2 cores, as each comment says.
pub const PRESETS: &[Preset] = &[
    // SmolLM2-135M's shape exactly (30 layers of 576, 9 heads of 64 over 3).
    Preset {
        name: "deep-llama",
        n_vocab: 49152,
        n_embd: 576,
        n_layer: 30,
        n_head: 9,
        n_head_kv: 3,
        n_ff: 1536,
        rope_base: 100000.0,
        head_dim: 64,
        tied: true,
        rms_eps: 1e-5,
        ..DEEP
    },
    // Ministral 3 3B's depth (26 layers), heads of 128 in GQA 4 and YaRN by 16 over 16384, as
    // remembered (not checked against a file); width 3072 cut to 512.
    Preset {
        name: "deep-mistral3",
        arch: "mistral3",
        n_embd: 512,
        n_layer: 26,
        n_head: 8,
        n_head_kv: 2,
        n_ff: 1536,
        rope_base: 1_000_000.0,
        head_dim: 128,
        yarn: (16.0, 16384),
        rms_eps: 1e-5,
        ..DEEP
    },
    // Qwen2.5-0.5B's depth (24 layers), heads of 64 in GQA 7, q/k/v biases; width 896 → 448.
    Preset {
        name: "deep-qwen2",
        arch: "qwen2",
        n_embd: 448,
        n_layer: 24,
        n_head: 7,
        n_head_kv: 1,
        n_ff: 1216,
        rope_base: 1_000_000.0,
        head_dim: 64,
        tied: true,
        ..DEEP
    },
    // Qwen3-0.6B's depth (28 layers), heads of 128 in GQA 2 (q wider than n_embd); width
    // 1024 → 512, 16 query heads → 8.
    Preset {
        name: "deep-qwen3",
        arch: "qwen3",
        n_embd: 512,
        n_layer: 28,
        n_head: 8,
        n_head_kv: 4,
        n_ff: 1536,
        rope_base: 1_000_000.0,
        head_dim: 128,
        tied: true,
        ..DEEP
    },
    // Qwen3-30B-A3B's depth (48 layers), heads of 128 in GQA 8, 8 experts per token; width
    // 2048 → 256, 128 experts of 768 → 32 of 64.
    Preset {
        name: "deep-qwen3moe",
        arch: "qwen3moe",
        n_embd: 256,
        n_layer: 48,
        n_head: 8,
        n_head_kv: 1,
        n_ff: 768,
        rope_base: 1_000_000.0,
        head_dim: 128,
        n_expert: 32,
        n_expert_used: 8,
        n_ff_exp: 64,
        ..DEEP
    },
    // Gemma 2 2B's depth (26 layers, sliding window 4096 every other), heads of 256 in GQA 2,
    // soft-capping; width 2304 → 512, 8 query heads → 4.
    Preset {
        name: "deep-gemma2",
        arch: "gemma2",
        n_embd: 512,
        n_layer: 26,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 1536,
        head_dim: 256,
        tied: true,
        sliding_window: 4096,
        ..DEEP
    },
    // Gemma 3 270M's shape (18 layers of 640, 4 heads of 256 over 1, 5:1 sliding window of
    // 512), the vocabulary cut from 262144.
    Preset {
        name: "deep-gemma3",
        arch: "gemma3",
        n_embd: 640,
        n_layer: 18,
        n_head: 4,
        n_head_kv: 1,
        n_ff: 2048,
        rope_base: 1_000_000.0,
        head_dim: 256,
        tied: true,
        sliding_window: 512,
        ..DEEP
    },
    // Gemma 4 E2B's depth and pattern (35 layers, a global layer every fifth, the last 20
    // sharing KV with double-wide FFNs, per-layer embeddings of 256, 8 heads of 256 / 512
    // over 1); width 1536 → 256, FFN 6144 → 512.
    Preset {
        name: "deep-gemma4",
        arch: "gemma4",
        n_embd: 256,
        n_layer: 35,
        n_head: 8,
        n_head_kv: 1,
        n_ff: 512,
        rope_base: 1_000_000.0,
        head_dim: 512,
        head_dim_swa: 256,
        swa_period: 5,
        sliding_window: 512,
        n_kv_shared: 20,
        n_embd_per_layer: 256,
        double_wide_shared: true,
        tied: true,
        ..DEEP
    },
    // Gemma 4 26B-A4B's depth and pattern (30 layers, a global layer every sixth, k = v on
    // them, 16 heads of 256 over 8 / of 512 over 2, 8 experts per token beside the MLP);
    // width 2816 → 256, 128 experts of 704 → 32 of 64, MLP 2112 → 256.
    Preset {
        name: "deep-gemma4moe",
        arch: "gemma4",
        n_embd: 256,
        n_layer: 30,
        n_head: 16,
        n_head_kv: 8,
        n_head_kv_global: 2,
        n_ff: 256,
        rope_base: 1_000_000.0,
        head_dim: 512,
        head_dim_swa: 256,
        swa_period: 6,
        sliding_window: 1024,
        n_expert: 32,
        n_expert_used: 8,
        n_ff_exp: 64,
        k_eq_v: true,
        tied: true,
        ..DEEP
    },
    // Phi-3 mini's depth (32 layers), heads of 96 without GQA, fused QKV and gate/up, with
    // LongRoPE (Phi-3.5); width 3072 → 384.
    Preset {
        name: "deep-phi3",
        arch: "phi3",
        n_embd: 384,
        n_layer: 32,
        n_head: 4,
        n_head_kv: 4,
        n_ff: 1024,
        head_dim: 96,
        rms_eps: 1e-5,
        ..DEEP
    },
    // Qwen 3.5 0.8B's depth and pattern (24 layers, full attention every fourth: 8 heads of
    // 256 over 2, a quarter rotated; delta-net heads of 128); width 1024 → 256, 16 delta-net
    // key and value heads → 4.
    Preset {
        name: "deep-qwen35",
        arch: "qwen35",
        n_embd: 256,
        n_layer: 24,
        n_head: 8,
        n_head_kv: 2,
        n_ff: 768,
        rope_base: 10_000_000.0,
        head_dim: 256,
        n_rot: 64,
        ssm_heads: (4, 4, 128),
        full_attn_interval: 4,
        tied: true,
        ..DEEP
    },
    // Qwen 3.5 35B-A3B's depth and pattern as remembered (40 layers, full attention every
    // fourth, 8 experts per token beside a shared expert); width 2048 → 256, 256 experts of
    // 512 → 32 of 64, delta-net heads 16/32 of 128 → 4/8.
    Preset {
        name: "deep-qwen35moe",
        arch: "qwen35moe",
        n_embd: 256,
        n_layer: 40,
        n_head: 8,
        n_head_kv: 2,
        n_ff: 512,
        rope_base: 10_000_000.0,
        head_dim: 256,
        n_rot: 64,
        ssm_heads: (4, 8, 128),
        full_attn_interval: 4,
        n_expert: 32,
        n_expert_used: 8,
        n_ff_exp: 64,
        n_ff_shexp: 64,
        ..DEEP
    },
];

#[cfg(test)]
mod tests {
    use crate::{file_type, preset, write, Init};
    use quiver_gguf::GgufFile;

    /// The written F32 weights' standard deviation.
    fn sd(f: &GgufFile, name: &str) -> f64 {
        let t = f.tensor(name).unwrap();
        let v: Vec<f64> = f
            .tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
            .collect();
        let m = v.iter().sum::<f64>() / v.len() as f64;
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64).sqrt()
    }

    #[test]
    fn deep_weights_have_the_sigma_of_their_role() {
        let mut p = preset("deep-qwen3").unwrap().clone();
        assert_eq!(p.init, Init::Deep);
        p.n_layer = 2;
        let path = std::env::temp_dir().join(format!("quiver-deep-{}.gguf", std::process::id()));
        write(&p, file_type("F32").unwrap(), 1, &path, 2, |_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let (d, q) = (512f64, 1024f64);
        let branch = (2.0 * 2f64).sqrt();
        for (name, want) in [
            ("token_embd.weight", 3.0 / d.sqrt()),
            ("blk.0.attn_q.weight", 1.0 / d.sqrt()),
            ("blk.1.ffn_up.weight", 1.0 / d.sqrt()),
            ("blk.0.attn_output.weight", 3.0 / (q.sqrt() * branch)),
            ("blk.1.ffn_down.weight", 3.0 / (1536f64.sqrt() * branch)),
            // Norm weights 1 + N(0, 0.1²).
            ("blk.0.attn_norm.weight", 0.1),
        ] {
            let got = sd(&f, name);
            assert!((got / want - 1.0).abs() < 0.1, "{name}: σ {got} vs {want}");
        }
    }

    #[test]
    fn gemma_post_norms_and_gemma4_qk_norms_carry_the_scales() {
        let mut p = preset("deep-gemma3").unwrap().clone();
        p.n_layer = 2;
        let path = std::env::temp_dir().join(format!("quiver-deepg-{}.gguf", std::process::id()));
        write(&p, file_type("F32").unwrap(), 1, &path, 2, |_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let mean = |name: &str| {
            let t = f.tensor(name).unwrap();
            let v = f.tensor_data(t);
            v.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                .sum::<f64>()
                / (v.len() / 4) as f64
        };
        let post = super::LOGIT_SD as f64 * 640f64.sqrt() / 2.0;
        assert!((mean("blk.0.post_attention_norm.weight") / post - 1.0).abs() < 0.05);
        assert!((mean("blk.1.post_ffw_norm.weight") / post - 1.0).abs() < 0.05);
        assert!((mean("blk.0.attn_q_norm.weight") - 1.0).abs() < 0.05);
        // Gemma 4 (attention scale 1): q and k norms around hd^(-1/4).
        let g4 = preset("deep-gemma4").unwrap();
        assert!((super::norm_factor(g4, "blk.0.attn_q_norm.weight", 256) - 0.25).abs() < 1e-6);
        assert!((super::norm_factor(g4, "blk.4.attn_k_norm.weight", 512) - 0.2102).abs() < 1e-3);
        assert_eq!(super::norm_factor(g4, "blk.0.attn_norm.weight", 256), 1.0);
    }

    #[test]
    fn deep_weights_scale_the_plain_norms_of_real_shapes() {
        // gemma4-e2b (norm weights of exactly 1 when flat), cut to 5 layers, no PLE.
        let mut p = preset("gemma4-e2b").unwrap().clone();
        (p.n_layer, p.n_kv_shared, p.n_embd_per_layer, p.n_vocab) = (5, 0, 0, 512);
        p.init = Init::Deep;
        let path = std::env::temp_dir().join(format!("quiver-deepe-{}.gguf", std::process::id()));
        write(&p, file_type("F32").unwrap(), 1, &path, 2, |_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let first = |name: &str| {
            let d = f.tensor_data(f.tensor(name).unwrap());
            f32::from_le_bytes(d[..4].try_into().unwrap())
        };
        assert_eq!(first("blk.0.attn_q_norm.weight"), 0.25); // head dim 256
        assert_eq!(first("blk.4.attn_k_norm.weight"), 512f32.powf(-0.25));
        assert_eq!(first("blk.0.attn_norm.weight"), 1.0);
        let post = super::LOGIT_SD * 1536f32.sqrt() / 10f32.sqrt();
        assert_eq!(first("blk.3.post_ffw_norm.weight"), post);
    }

    #[test]
    fn only_the_deep_presets_draw_deep_weights() {
        for p in crate::presets() {
            assert_eq!(
                p.init == Init::Deep,
                p.name.starts_with("deep-"),
                "{}",
                p.name
            );
        }
    }
}
