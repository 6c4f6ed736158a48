//! EAGLE-3 draft heads (`eagle3`) for a preset's target, as llama.cpp's converter writes them:
//! `fc` over three target layers' states, one llama layer reading twice the width, and
//! optionally a draft vocabulary (`d2t`, absolute target ids) with an output matrix of its own.

use crate::mix::{FileType, Role};
use crate::{Planned, Preset};
use quiver_gguf::{GgufWriter, Value};

/// A head's target and form.
#[derive(Clone, Debug)]
pub struct Head {
    pub target_layers: [u64; 3],
    /// Tokens of the draft vocabulary (0: the target's, and the target's output matrix).
    pub draft_vocab: u64,
    /// `norm_before_fc` and `norm_before_residual`.
    pub norms: bool,
}

pub(crate) fn plan(p: &Preset, h: &Head) -> Vec<Planned> {
    let t = |name: &str, role, shape: &[u64]| Planned {
        name: name.into(),
        role,
        shape: shape.to_vec(),
    };
    let (d, hd) = (p.n_embd, p.head_dim);
    let (qd, kvd) = (p.n_head * hd, p.n_head_kv * hd);
    let mut v = vec![t("fc.weight", Role::AttnQ, &[d, 3 * d])];
    if h.norms {
        v.push(t("enc.output_norm.weight", Role::Vector, &[3 * d]));
    }
    v.push(t("blk.0.attn_norm.weight", Role::Vector, &[d]));
    v.push(t("blk.0.attn_norm_2.weight", Role::Vector, &[d]));
    v.push(t("blk.0.attn_q.weight", Role::AttnQ, &[qd, 2 * d]));
    v.push(t("blk.0.attn_k.weight", Role::AttnK, &[kvd, 2 * d]));
    v.push(t("blk.0.attn_v.weight", Role::AttnV, &[kvd, 2 * d]));
    v.push(t("blk.0.attn_output.weight", Role::AttnOutput, &[d, qd]));
    v.push(t("blk.0.ffn_norm.weight", Role::Vector, &[d]));
    v.push(t("blk.0.ffn_gate.weight", Role::FfnGate, &[p.n_ff, d]));
    v.push(t("blk.0.ffn_up.weight", Role::FfnUp, &[p.n_ff, d]));
    v.push(t("blk.0.ffn_down.weight", Role::FfnDown, &[d, p.n_ff]));
    v.push(t("output_norm.weight", Role::Vector, &[d]));
    if h.draft_vocab > 0 {
        v.push(t("d2t", Role::Vector, &[h.draft_vocab]));
        v.push(t("output.weight", Role::Output, &[h.draft_vocab, d]));
    }
    v
}

/// The draft vocabulary's target ids (`d2t`): every other token first, then the rest, so that
/// the mapping is neither the identity nor a prefix.
pub(crate) fn d2t(p: &Preset, name: &str) -> Option<Vec<i64>> {
    let h = p.eagle3.as_ref().filter(|_| name == "d2t")?;
    let n = p.n_vocab as i64;
    let order = (0..n).step_by(2).chain((1..n).step_by(2));
    Some(order.take(h.draft_vocab as usize).collect())
}

pub(crate) fn metadata(w: &mut GgufWriter, p: &Preset, h: &Head, ft: FileType) {
    crate::meta::metadata_common(w, p, ft);
    let k = |s: &str| format!("eagle3.{s}");
    w.set(k("feed_forward_length"), Value::U32(p.n_ff as u32));
    w.set(k("attention.head_count_kv"), Value::U32(p.n_head_kv as u32));
    w.set(k("attention.key_length"), Value::U32(p.head_dim as u32));
    w.set(k("attention.value_length"), Value::U32(p.head_dim as u32));
    w.set(k("rope.dimension_count"), Value::U32(p.head_dim as u32));
    let layers = h.target_layers.iter().map(|&l| l as i32).collect();
    w.set(
        k("target_layers"),
        Value::Array(quiver_gguf::Array::I32(layers)),
    );
    w.set(k("target_hidden_size"), Value::U32(p.n_embd as u32));
    w.set(k("norm_before_residual"), Value::Bool(h.norms));
    w.set(k("norm_before_fc"), Value::Bool(h.norms));
}
