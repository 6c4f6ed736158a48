//! DeepSeek-V4 (`deepseek4`): hyper-connection streams, attention over a sliding window and a
//! compressed KV (per block ratio 0, 4 with the lightning indexer, or 128), q and the output
//! through low-rank products, hash-routed first layers, then sqrt-softplus routing with a
//! selection bias, each beside a shared expert with clamped SwiGLU; the tensors and keys as
//! llama.cpp's loader reads them (`src/models/deepseek4.cpp`) and its converter writes them
//! (`conversion/deepseek.py`: the hyper-connection and `ape` tensors stay F32, the hash table
//! is I32).

use crate::mix::{FileType, Role};
use crate::{Planned, Preset, TINY};
use quiver_gguf::{Array, GgmlType, GgufWriter, Value};

/// DeepSeek-V4's own shape.
#[derive(Clone, Debug)]
pub struct Shape {
    /// q's low rank.
    pub q_lora: u64,
    /// The output's groups and each group's rank.
    pub o_groups: u64,
    pub o_lora: u64,
    /// Hyper-connection streams, Sinkhorn iterations.
    pub hc: u64,
    pub sinkhorn: u64,
    /// The trunk's compression ratios (0, 4 or 128), repeated over its blocks; the
    /// multi-token-prediction blocks are window-only.
    pub ratios: &'static [u64],
    /// The indexer's heads, head width and top-k (ratio-4 blocks).
    pub indexer: (u64, u64, u64),
    /// The first blocks route by token id (`ffn_gate_tid2eid`; the trunk's at most).
    pub hash_layers: u64,
    /// The SwiGLU limits of the experts and of the shared expert, repeated over the blocks.
    pub clamp_exp: &'static [f32],
    pub clamp_shexp: &'static [f32],
    pub compress_rope_base: f32,
    pub expert_scale: f32,
}

/// Four blocks of 256 (four query heads of 128 over one KV head, a quarter of each rotated): a
/// window-only block, two of ratio 4 around one of ratio 128 (whose first row a 144-token
/// sequence completes); the indexer's top-4 of up to 36 rows, over 16 heads (with a few, a
/// row's score is often exactly 0 — every head's q·k negative — and ties are llama.cpp's
/// `partial_sort`'s to break); the first two blocks route by token id; 8 experts of 128 (2
/// per token) beside a shared one, SwiGLU clamped per block below the gates' spread (σ ≈ 1.6)
/// so that the clamp acts; YaRN on the compressed blocks' rope; Sinkhorn's 20 iterations as
/// the model's config has them (from memory).
pub(crate) const TINY_DEEPSEEK4: Preset = Preset {
    name: "tiny-deepseek4",
    arch: "deepseek4",
    n_head: 4,
    n_head_kv: 1,
    // Heads wider than the indexer's, as the model's (512 and 128): llama.cpp takes a cache
    // whose head is the indexer's width for the indexer's and rotates it (with none of its
    // layers, it divides by zero).
    head_dim: 128,
    n_rot: 32,
    // llama.cpp reads no dense width; the converter writes one where the config has it.
    n_ff: 128,
    n_expert: 8,
    n_expert_used: 2,
    n_ff_exp: 128,
    n_ff_shexp: 128,
    sliding_window: 8,
    yarn: (4.0, 64),
    dsv4: Some(Shape {
        q_lora: 64,
        o_groups: 2,
        o_lora: 32,
        hc: 4,
        sinkhorn: 20,
        ratios: &[0, 4, 128, 4],
        indexer: (16, 64, 4),
        hash_layers: 2,
        clamp_exp: &[2.0, 2.5, 3.0],
        clamp_shexp: &[3.0, 2.0, 2.5],
        compress_rope_base: 160000.0,
        expert_scale: 1.5,
    }),
    ..TINY
};

/// [`TINY_DEEPSEEK4`] and the same with a multi-token-prediction block (window-only,
/// score-routed: llama.cpp runs no hash-routed one).
/// DeepSeek-V4-Flash's shape (284B parameters, 13B active: too large for one H200 at 4 bits;
/// `--layers N` keeps its first N blocks): 43 blocks of 4096 with 64 query heads of 512 over one
/// KV head (64 rotated dims), a window of 128, blocks of ratios 0, 0, 4, then 128 and 4 by
/// turns; 256 experts of 2048 (6 a token) beside a shared one, the
/// first three routed by token id; 4 hyper-connection streams; the output in 8 groups of rank
/// 1024; the indexer's 64 heads of 128; YaRN (×16 over 65,536) on the compressed blocks' rope
/// of base 160,000. Not in the sources read for it (public configs and recipes): q's rank
/// (1024 here), the indexer's top-k (512), the SwiGLU limit (10) and the experts' scale (1.5).
const DEEPSEEK4_FLASH: Preset = Preset {
    name: "deepseek4-flash",
    arch: "deepseek4",
    n_vocab: 129_280,
    n_embd: 4096,
    n_layer: 43,
    n_head: 64,
    n_head_kv: 1,
    n_ff: 2048,
    n_ctx: 1 << 20,
    rope_base: 10000.0,
    head_dim: 512,
    n_rot: 64,
    rms_eps: 1e-6,
    n_expert: 256,
    n_expert_used: 6,
    n_ff_exp: 2048,
    n_ff_shexp: 2048,
    sliding_window: 128,
    yarn: (16.0, 65536),
    dsv4: Some(Shape {
        q_lora: 1024,
        o_groups: 8,
        o_lora: 1024,
        hc: 4,
        sinkhorn: 20,
        ratios: &[
            0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
            4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
        ],
        indexer: (64, 128, 512),
        hash_layers: 3,
        clamp_exp: &[10.0],
        clamp_shexp: &[10.0],
        compress_rope_base: 160000.0,
        expert_scale: 1.5,
    }),
    ..crate::BASE
};

pub(crate) const PRESETS: &[Preset] = &[
    DEEPSEEK4_FLASH,
    TINY_DEEPSEEK4,
    Preset {
        name: "tiny-deepseek4-mtp",
        nextn: 1,
        ..TINY_DEEPSEEK4
    },
];

fn shape(p: &Preset) -> &Shape {
    p.dsv4.as_ref().expect("a deepseek4 preset")
}

/// Block `i`'s compression ratio (any `--layers`).
fn ratio(p: &Preset, i: u64) -> u64 {
    let r = shape(p).ratios;
    if i < p.n_layer {
        r[i as usize % r.len()]
    } else {
        0
    }
}

/// Whether block `i` routes by token id.
fn hashed(p: &Preset, i: u64) -> bool {
    i < shape(p).hash_layers.min(p.n_layer)
}

pub(crate) fn plan(p: &Preset) -> Vec<Planned> {
    let t = |name: String, role, shape: &[u64]| Planned {
        name,
        role,
        shape: shape.to_vec(),
    };
    let s = shape(p);
    let (d, hd, nh, hc) = (p.n_embd, p.head_dim, p.n_head, s.hc);
    let (ql, og, ol) = (s.q_lora, s.o_groups, s.o_lora);
    let (ih, id, _) = s.indexer;
    let mix = (2 + hc) * hc;
    let mut v = vec![t(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        &[p.n_vocab, d],
    )];
    for i in 0..p.n_layer + p.nextn {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        if i >= p.n_layer {
            v.extend(crate::mtp_input(i, d));
        }
        // The hyper-connections (F32, as converted): mixing weights, bases, scales.
        for h in ["attn", "ffn"] {
            v.push(t(b(&format!("hc_{h}_fn")), Role::Router, &[mix, hc * d]));
            v.push(t(b(&format!("hc_{h}_base")), Role::Router, &[mix]));
            v.push(t(b(&format!("hc_{h}_scale")), Role::Vector, &[3]));
        }
        v.push(t(b("attn_norm"), Role::Vector, &[d]));
        v.push(t(b("attn_sinks"), Role::Vector, &[nh]));
        v.push(t(b("attn_q_a"), Role::AttnQ, &[ql, d]));
        v.push(t(b("attn_q_a_norm"), Role::Vector, &[ql]));
        v.push(t(b("attn_q_b"), Role::AttnQ, &[nh * hd, ql]));
        v.push(t(b("attn_kv"), Role::AttnK, &[hd, d]));
        v.push(t(b("attn_kv_a_norm"), Role::Vector, &[hd]));
        // As the file has it: [groups · rank, a group's heads · head dim].
        v.push(t(
            b("attn_output_a"),
            Role::AttnOutput,
            &[og * ol, nh * hd / og],
        ));
        v.push(t(b("attn_output_b"), Role::AttnOutput, &[d, og * ol]));
        let ratio = ratio(p, i);
        if ratio > 0 {
            let c = if ratio == 4 { 2 * hd } else { hd };
            v.push(t(b("attn_compressor_kv"), Role::AttnK, &[c, d]));
            v.push(t(b("attn_compressor_gate"), Role::AttnK, &[c, d]));
            v.push(t(b("attn_compressor_ape"), Role::Router, &[ratio, c]));
            v.push(t(b("attn_compressor_norm"), Role::Vector, &[hd]));
        }
        if ratio == 4 {
            v.push(t(b("indexer.proj"), Role::Router, &[ih, d]));
            v.push(t(b("indexer.attn_q_b"), Role::AttnQ, &[ih * id, ql]));
            v.push(t(b("indexer_compressor_kv"), Role::AttnK, &[2 * id, d]));
            v.push(t(b("indexer_compressor_gate"), Role::AttnK, &[2 * id, d]));
            v.push(t(b("indexer_compressor_ape"), Role::Router, &[4, 2 * id]));
            v.push(t(b("indexer_compressor_norm"), Role::Vector, &[id]));
        }
        let (ne, fe, sf) = (p.n_expert, p.n_ff_exp, p.n_ff_shexp);
        v.push(t(b("ffn_norm"), Role::Vector, &[d]));
        v.push(t(b("ffn_gate_inp"), Role::Router, &[ne, d]));
        if hashed(p, i) {
            v.push(t(
                b("ffn_gate_tid2eid"),
                Role::Router,
                &[p.n_vocab, p.n_expert_used],
            ));
        } else {
            v.push(t(format!("blk.{i}.exp_probs_b.bias"), Role::Vector, &[ne]));
        }
        v.push(t(b("ffn_gate_exps"), Role::FfnGate, &[ne, fe, d]));
        v.push(t(b("ffn_up_exps"), Role::FfnUp, &[ne, fe, d]));
        v.push(t(b("ffn_down_exps"), Role::FfnDown, &[ne, d, fe]));
        v.push(t(b("ffn_gate_shexp"), Role::FfnGate, &[sf, d]));
        v.push(t(b("ffn_up_shexp"), Role::FfnUp, &[sf, d]));
        v.push(t(b("ffn_down_shexp"), Role::FfnDown, &[d, sf]));
    }
    // The head's hyper-connection: the streams mixed into one before the output norm.
    v.push(t("output_hc_fn.weight".into(), Role::Router, &[hc, hc * d]));
    v.push(t("output_hc_base.weight".into(), Role::Router, &[hc]));
    v.push(t("output_hc_scale.weight".into(), Role::Vector, &[1]));
    v.push(t("output_norm.weight".into(), Role::Vector, &[d]));
    v.push(t("output.weight".into(), Role::Output, &[p.n_vocab, d]));
    v
}

pub(crate) fn metadata(w: &mut GgufWriter, p: &Preset, ft: FileType) {
    crate::metadata_common(w, p, ft);
    let s = shape(p);
    let k = |x: &str| format!("deepseek4.{x}");
    let u = |x: u64| Value::U32(x as u32);
    let blocks = (p.n_layer + p.nextn) as usize;
    w.set(k("block_count"), u(blocks as u64));
    if p.nextn > 0 {
        w.set(k("nextn_predict_layers"), u(p.nextn));
    }
    w.set(k("feed_forward_length"), u(p.n_ff));
    w.set(k("attention.head_count_kv"), u(p.n_head_kv));
    w.set(k("attention.key_length"), u(p.head_dim));
    w.set(k("attention.value_length"), u(p.head_dim));
    w.set(k("rope.dimension_count"), u(p.n_rot));
    if p.yarn.0 > 0.0 {
        w.set(k("rope.scaling.type"), Value::String("yarn".into()));
        w.set(k("rope.scaling.factor"), Value::F32(p.yarn.0));
        w.set(k("rope.scaling.original_context_length"), u(p.yarn.1));
    }
    w.set(k("attention.q_lora_rank"), u(s.q_lora));
    w.set(k("attention.sliding_window"), u(p.sliding_window));
    w.set(k("attention.output_group_count"), u(s.o_groups));
    w.set(k("attention.output_lora_rank"), u(s.o_lora));
    let ratios = (0..blocks as u64).map(|i| ratio(p, i) as u32).collect();
    w.set(
        k("attention.compress_ratios"),
        Value::Array(Array::U32(ratios)),
    );
    w.set(
        k("attention.compress_rope_freq_base"),
        Value::F32(s.compress_rope_base),
    );
    let (ih, id, top_k) = s.indexer;
    w.set(k("attention.indexer.head_count"), u(ih));
    w.set(k("attention.indexer.key_length"), u(id));
    w.set(k("attention.indexer.top_k"), u(top_k));
    w.set(k("hyper_connection.count"), u(s.hc));
    w.set(k("hyper_connection.sinkhorn_iterations"), u(s.sinkhorn));
    w.set(k("hyper_connection.epsilon"), Value::F32(1e-6));
    w.set(k("embedding_length_out"), u(s.hc * p.n_embd));
    w.set(k("expert_count"), u(p.n_expert));
    w.set(k("expert_used_count"), u(p.n_expert_used));
    w.set(k("expert_feed_forward_length"), u(p.n_ff_exp));
    w.set(k("expert_shared_count"), u(p.n_ff_shexp / p.n_ff_exp));
    w.set(k("expert_weights_scale"), Value::F32(s.expert_scale));
    w.set(k("expert_weights_norm"), Value::Bool(true));
    // sqrt(softplus) scores, the only gating llama.cpp's loader takes for this architecture.
    w.set(k("expert_gating_func"), u(4));
    w.set(k("hash_layer_count"), u(s.hash_layers.min(p.n_layer)));
    let per_block =
        |v: &[f32]| Value::Array(Array::F32((0..blocks).map(|i| v[i % v.len()]).collect()));
    w.set(k("swiglu_clamp_exp"), per_block(s.clamp_exp));
    w.set(k("swiglu_clamp_shexp"), per_block(s.clamp_shexp));
}

/// Tensors of integers: the hash-routed layers' expert ids per token (`ffn_gate_tid2eid`,
/// [n_vocab, n_used] I32), each token's distinct, drawn per layer and token.
pub(crate) fn int_tensor(p: &Preset, name: &str) -> Option<(GgmlType, Vec<u8>)> {
    if p.dsv4.is_none() || !name.ends_with(".ffn_gate_tid2eid.weight") {
        return None;
    }
    let layer: u64 = name.strip_prefix("blk.")?.split('.').next()?.parse().ok()?;
    // splitmix64's finaliser
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut bytes = Vec::with_capacity((p.n_vocab * p.n_expert_used * 4) as usize);
    let mut row = Vec::new();
    for tok in 0..p.n_vocab {
        row.clear();
        let mut k = 0u64;
        while row.len() < p.n_expert_used as usize {
            k += 1;
            let e = (mix((layer << 48) ^ (tok << 16) ^ k) % p.n_expert) as i32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        row.iter()
            .for_each(|e| bytes.extend_from_slice(&e.to_le_bytes()));
    }
    Some((GgmlType::I32, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset;

    fn names(p: &Preset) -> Vec<(String, Vec<u64>)> {
        plan(p).into_iter().map(|t| (t.name, t.shape)).collect()
    }

    #[test]
    fn every_block_has_what_llama_cpp_loads_for_its_ratio_and_routing() {
        let p = preset("tiny-deepseek4-mtp").unwrap();
        let s = shape(p);
        let all = names(p);
        let has = |n: &str| all.iter().any(|(m, _)| m == n);
        let shape_of = |n: &str| all.iter().find(|(m, _)| m == n).unwrap().1.clone();
        assert_eq!((p.n_layer, p.nextn), (4, 1));
        // Window-only, ratio 4, ratio 128 (and the block after the trunk window-only).
        let ratios: Vec<u64> = (0..5).map(|i| ratio(p, i)).collect();
        assert_eq!(ratios, [0, 4, 128, 4, 0]);
        for i in 0..5 {
            let b = |x: &str| format!("blk.{i}.{x}.weight");
            for x in [
                "attn_norm",
                "attn_sinks",
                "attn_q_a",
                "attn_q_a_norm",
                "attn_q_b",
                "attn_kv",
                "attn_kv_a_norm",
                "attn_output_a",
                "attn_output_b",
                "hc_attn_fn",
                "hc_attn_base",
                "hc_attn_scale",
                "hc_ffn_fn",
                "hc_ffn_base",
                "hc_ffn_scale",
                "ffn_norm",
                "ffn_gate_inp",
                "ffn_gate_exps",
                "ffn_up_exps",
                "ffn_down_exps",
                "ffn_gate_shexp",
                "ffn_up_shexp",
                "ffn_down_shexp",
            ] {
                assert!(has(&b(x)), "{}", b(x));
            }
            let ratio = ratio(p, i as u64);
            assert_eq!(has(&b("attn_compressor_kv")), ratio > 0, "block {i}");
            assert_eq!(has(&b("indexer.attn_q_b")), ratio == 4, "block {i}");
            if ratio > 0 {
                let c = if ratio == 4 {
                    2 * p.head_dim
                } else {
                    p.head_dim
                };
                assert_eq!(shape_of(&b("attn_compressor_ape")), [ratio, c]);
            }
            let hash = hashed(p, i as u64);
            assert_eq!(has(&b("ffn_gate_tid2eid")), hash, "block {i}");
            assert_eq!(
                has(&format!("blk.{i}.exp_probs_b.bias")),
                !hash,
                "block {i}"
            );
            assert_eq!(has(&b("nextn.eh_proj")), i == 4, "block {i}");
        }
        // Both routings in the trunk; the block after it score-routed, as llama.cpp requires.
        assert!(s.hash_layers > 0 && s.hash_layers < p.n_layer);
        assert_eq!(
            shape_of("blk.0.attn_output_a.weight"),
            [2 * 32, 4 * 128 / 2]
        );
        assert_eq!(shape_of("blk.0.hc_attn_fn.weight"), [(2 + 4) * 4, 4 * 256]);
        assert_eq!(shape_of("output_hc_fn.weight"), [4, 4 * 256]);
        for x in ["output_hc_base", "output_hc_scale", "output_norm", "output"] {
            assert!(has(&format!("{x}.weight")), "{x}");
        }
        // The plain model is the same trunk without the block.
        let plain = names(preset("tiny-deepseek4").unwrap());
        assert!(plain.iter().all(|(n, _)| !n.starts_with("blk.4.")));
        // The block: its 4 input and head tensors, and a window-only score-routed layer's 24.
        assert_eq!(all.len() - plain.len(), 4 + 24);
    }

    #[test]
    fn the_hash_table_routes_each_token_to_distinct_experts() {
        let p = preset("tiny-deepseek4").unwrap();
        let ids = |layer: u64| {
            let (ty, b) = int_tensor(p, &format!("blk.{layer}.ffn_gate_tid2eid.weight")).unwrap();
            assert_eq!(ty, GgmlType::I32);
            b.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>()
        };
        let (l0, l1) = (ids(0), ids(1));
        assert_eq!(l0.len() as u64, p.n_vocab * p.n_expert_used);
        for row in l0.chunks_exact(2).chain(l1.chunks_exact(2)) {
            assert!(row.iter().all(|&e| (0..8).contains(&e)) && row[0] != row[1]);
        }
        for e in 0..8 {
            assert!(l0.contains(&e), "expert {e} never chosen");
            // Every pair of experts shares tokens, not only a few fixed pairs.
            let with = |f: i32| l0.chunks_exact(2).any(|r| r.contains(&e) && r.contains(&f));
            assert!((0..8).filter(|&f| f != e).all(with), "expert {e}'s pairs");
        }
        assert_ne!(l0, l1, "the layers route alike");
        assert!(int_tensor(p, "blk.0.ffn_gate_inp.weight").is_none());
    }

    #[test]
    fn per_block_keys_have_one_entry_per_block() {
        for (name, blocks) in [("tiny-deepseek4", 4), ("tiny-deepseek4-mtp", 5)] {
            let p = preset(name).unwrap();
            let mut w = GgufWriter::new();
            metadata(&mut w, p, FileType::F32);
            let k = |x: &str| w.metadata.get(&format!("deepseek4.{x}")).cloned();
            assert_eq!(k("block_count"), Some(Value::U32(blocks)));
            let Some(Value::Array(Array::U32(r))) = k("attention.compress_ratios") else {
                panic!("{name}: compress_ratios")
            };
            assert_eq!(r.len(), blocks as usize, "{name}");
            for key in ["swiglu_clamp_exp", "swiglu_clamp_shexp"] {
                let Some(Value::Array(Array::F32(v))) = k(key) else {
                    panic!("{name}: {key}")
                };
                assert_eq!(v.len(), blocks as usize, "{name}: {key}");
            }
            let nextn = k("nextn_predict_layers");
            assert_eq!(nextn, (blocks == 5).then_some(Value::U32(1)), "{name}");
            assert_eq!(k("expert_gating_func"), Some(Value::U32(4)));
            assert_eq!(k("attention.head_count_kv"), Some(Value::U32(1)));
        }
    }

    #[test]
    fn other_layer_counts_repeat_the_pattern_and_keep_the_block_score_routed() {
        for n_layer in [1, 7] {
            let p = Preset {
                n_layer,
                ..preset("tiny-deepseek4-mtp").unwrap().clone()
            };
            let all = names(&p);
            let has = |n: &str| all.iter().any(|(m, _)| m == n);
            let last = n_layer;
            assert!(has(&format!("blk.{last}.nextn.eh_proj.weight")));
            assert!(has(&format!("blk.{last}.exp_probs_b.bias")));
            assert!(!has(&format!("blk.{last}.attn_compressor_kv.weight")));
            let mut w = GgufWriter::new();
            metadata(&mut w, &p, FileType::F32);
            let k = |x: &str| w.metadata.get(&format!("deepseek4.{x}")).cloned();
            let hash = n_layer.min(2) as u32;
            assert_eq!(k("hash_layer_count"), Some(Value::U32(hash)));
            let Some(Value::Array(Array::U32(r))) = k("attention.compress_ratios") else {
                panic!("compress_ratios")
            };
            let want: &[u32] = if n_layer == 1 {
                &[0, 0]
            } else {
                &[0, 4, 128, 4, 0, 4, 128, 0]
            };
            assert_eq!(r, want);
        }
    }
}
