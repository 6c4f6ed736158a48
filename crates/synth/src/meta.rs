//! The GGUF metadata of a preset: the keys llama.cpp reads for its architecture, and
//! `tokenizer.ggml.model = none`.

use crate::{gemma4, qwen35, FileType, Preset};
use quiver_gguf::{GgufWriter, Value};

pub(crate) fn metadata_common(w: &mut GgufWriter, p: &Preset, ft: FileType) {
    let k = |s: &str| format!("{}.{s}", p.arch);
    w.set("general.architecture", Value::String(p.arch.into()));
    w.set(
        "general.name",
        Value::String(format!("quiver-synth {} {}", p.name, ft.name())),
    );
    w.set("general.file_type", Value::U32(ft.id()));
    w.set("general.quantization_version", Value::U32(2));
    w.set(k("context_length"), Value::U32(p.n_ctx as u32));
    w.set(k("embedding_length"), Value::U32(p.n_embd as u32));
    w.set(k("block_count"), Value::U32(p.n_layer as u32));
    w.set(k("attention.head_count"), Value::U32(p.n_head as u32));
    w.set(k("rope.freq_base"), Value::F32(p.rope_base));
    w.set(k("attention.layer_norm_rms_epsilon"), Value::F32(p.rms_eps));
    w.set(k("vocab_size"), Value::U32(p.n_vocab as u32));
    w.set("tokenizer.ggml.model", Value::String("none".into()));
}

pub(crate) fn metadata(w: &mut GgufWriter, p: &Preset, ft: FileType) {
    if p.arch == "gemma4" {
        return gemma4::metadata(w, p, ft);
    }
    if p.ssm_heads.0 > 0 {
        return qwen35::metadata(w, p, ft);
    }
    if p.dsv4.is_some() {
        return crate::deepseek4::metadata(w, p, ft);
    }
    if let Some(h) = &p.eagle3 {
        return crate::eagle3::metadata(w, p, h, ft);
    }
    let a = p.arch;
    let k = |s: &str| format!("{a}.{s}");
    w.set("general.architecture", Value::String(a.into()));
    w.set(
        "general.name",
        Value::String(format!("quiver-synth {} {}", p.name, ft.name())),
    );
    w.set("general.file_type", Value::U32(ft.id()));
    w.set("general.quantization_version", Value::U32(2));
    w.set(k("context_length"), Value::U32(p.n_ctx as u32));
    w.set(k("embedding_length"), Value::U32(p.n_embd as u32));
    w.set(k("block_count"), Value::U32(p.n_layer as u32));
    w.set(k("feed_forward_length"), Value::U32(p.n_ff as u32));
    w.set(k("attention.head_count"), Value::U32(p.n_head as u32));
    w.set(k("attention.head_count_kv"), Value::U32(p.n_head_kv as u32));
    w.set(k("rope.freq_base"), Value::F32(p.rope_base));
    w.set(k("attention.layer_norm_rms_epsilon"), Value::F32(p.rms_eps));
    w.set(k("vocab_size"), Value::U32(p.n_vocab as u32));
    w.set(k("attention.key_length"), Value::U32(p.head_dim as u32));
    w.set(k("attention.value_length"), Value::U32(p.head_dim as u32));
    w.set(k("rope.dimension_count"), Value::U32(p.head_dim as u32));
    if p.sliding_window > 0 {
        w.set(
            k("attention.sliding_window"),
            Value::U32(p.sliding_window as u32),
        );
    }
    if p.yarn.0 > 0.0 {
        w.set(k("rope.scaling.type"), Value::String("yarn".into()));
        w.set(k("rope.scaling.factor"), Value::F32(p.yarn.0));
        w.set(
            k("rope.scaling.original_context_length"),
            Value::U32(p.yarn.1 as u32),
        );
        if a == "mistral3" {
            w.set(k("rope.scaling.yarn_beta_fast"), Value::F32(32.0));
            w.set(k("rope.scaling.yarn_beta_slow"), Value::F32(1.0));
            w.set(k("rope.scaling.yarn_log_multiplier"), Value::F32(1.0));
            // Llama-4-style attention temperature, as Ministral 3 has it.
            w.set(k("attention.temperature_scale"), Value::F32(0.1));
        }
    }
    if a == "phi3" && p.random_vectors {
        // LongRoPE past an original context of 512 (the parity harness runs 1024).
        w.set(k("rope.scaling.original_context_length"), Value::U32(512));
        w.set(k("rope.scaling.attn_factor"), Value::F32(1.19));
    }
    if a == "gemma2" {
        w.set(k("attn_logit_softcapping"), Value::F32(50.0));
        w.set(k("final_logit_softcapping"), Value::F32(30.0));
    }
    if p.n_expert > 0 {
        w.set(k("expert_count"), Value::U32(p.n_expert as u32));
        w.set(k("expert_used_count"), Value::U32(p.n_expert_used as u32));
        w.set(
            k("expert_feed_forward_length"),
            Value::U32(p.n_ff_exp as u32),
        );
    }
    w.set("tokenizer.ggml.model", Value::String("none".into()));
}
