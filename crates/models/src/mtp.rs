//! A model's own multi-token-prediction block (`nextn_predict_layers`, the file's last block:
//! Qwen 3.5's and DeepSeek-V4's) run as a draft head for speculative decoding, as llama.cpp's
//! `draft-mtp` runs it. At position P it reads the token at P + 1 and the target's hidden state
//! at P (`State::head_hidden`): `eh_proj` over [enorm(embedding) | hnorm(h)] makes the block's
//! input, then one block of the architecture, the shared head's norm (else the model's output
//! norm) and its output matrix (else the model's). Its hidden state is the h of the position it
//! drafts next.
//!
//! Qwen 3.5's h is the final state normed by the output norm, its block full attention over its
//! own paged KV. DeepSeek-V4's h is the hc streams before the head mixes them (each stream
//! normed and projected beside the embedding), its block window-only attention over a state
//! slot per sequence (the target request's slot number) whose ring has [`DRAFT_SPARE`] rows
//! beyond the window: drafted positions then overwrite no row a verified position reads, and
//! the verified ones are written again.
//!
//! The block loads from a view of the target's file ([`quiver_gguf::GgufFile::view`]): the
//! block as layer 0 of a one-layer model of the same architecture, the shared head's tensors
//! in place of the output's, the trunk's blocks left out; no byte is copied. A sidecar file
//! holding the block alone ([`is_sidecar`]) loads the same way.

use crate::{weight, Model, ModelError, Result, State};
use quiver_backend::Backend;
use quiver_gguf::{Array, GgufFile, Value};
use std::sync::Arc;

/// The block's input stage.
pub struct Mtp<B: Backend> {
    /// [n_embd, 2 · n_embd]
    pub eh_proj: B::Weight,
    pub enorm: B::Weight,
    pub hnorm: B::Weight,
}

/// Positions a DeepSeek-V4 block's ring holds beyond its window: a draft of at most this many
/// positions past the last verified one overwrites nothing a later position reads (a longer
/// one costs acceptance, never a token).
pub const DRAFT_SPARE: usize = 64;

/// The multi-token-prediction blocks `f` carries (0: none, or an architecture whose blocks
/// quiver does not run as a head).
pub fn blocks(f: &GgufFile) -> usize {
    match f.arch() {
        Ok(a @ ("qwen35" | "qwen35moe" | "deepseek4")) => {
            match f.get(&format!("{a}.nextn_predict_layers")) {
                Some(Value::U32(n)) => *n as usize,
                Some(Value::I32(n)) => (*n).max(0) as usize,
                _ => 0,
            }
        }
        _ => 0,
    }
}

/// Whether `f` holds a multi-token-prediction block without the model it belongs to (a
/// sidecar file, as llama.cpp's converter can write one: `-md` with `--spec-type mtp`).
pub fn is_sidecar(f: &GgufFile) -> bool {
    blocks(f) > 0 && f.tensor("blk.0.attn_norm.weight").is_none()
}

/// The hyperparameters of `target`'s first multi-token-prediction block as a draft head (its
/// KV cache's shape, say).
pub fn hparams(target: &Arc<GgufFile>) -> Result<crate::Hparams> {
    let mut hp = crate::hparams(&*view(target)?)?;
    hp.mtp = true;
    Ok(hp)
}

/// Loads the first multi-token-prediction block of `target` as a draft head.
pub fn load<B: Backend>(b: &B, target: &Arc<GgufFile>) -> Result<Model<B>> {
    let view = view(target)?;
    let mut hp = crate::hparams(&view)?;
    hp.mtp = true;
    let d = hp.n_embd as u64;
    let input = Mtp {
        eh_proj: weight(b, &view, "mtp.eh_proj.weight", &[d, 2 * d])?,
        enorm: weight(b, &view, "mtp.enorm.weight", &[d])?,
        hnorm: weight(b, &view, "mtp.hnorm.weight", &[d])?,
    };
    if let Some(ds) = hp.dsv4.as_mut() {
        ds.spare = DRAFT_SPARE;
    }
    let mut m = crate::load_with(b, &view, hp)?;
    m.mtp = Some(input);
    Ok(m)
}

/// `target` as a one-layer model of its first multi-token-prediction block.
fn view(target: &Arc<GgufFile>) -> Result<Arc<GgufFile>> {
    let arch = target.arch()?.to_string();
    let bad = |detail: String| ModelError::BadHparam {
        key: format!("{arch}.nextn_predict_layers"),
        detail,
    };
    let nextn = blocks(target);
    if nextn == 0 {
        return Err(bad(match arch.as_str() {
            "qwen35" | "qwen35moe" | "deepseek4" => {
                "0: the model has no multi-token-prediction block".into()
            }
            _ => format!(
                "a multi-token-prediction block of {arch} is not run as a draft head (Qwen 3.5's and DeepSeek-V4's are)"
            ),
        }));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let n_all = match target.get(&key("block_count")) {
        Some(Value::U32(n)) => *n as usize,
        _ => return Err(bad("without block_count".into())),
    };
    let n = n_all - nextn.min(n_all);
    // The metadata of a one-layer model: per-layer arrays cut to the block's entry, the block
    // full attention.
    let mut meta = target.metadata.clone();
    for (k, v) in meta.iter_mut() {
        if let Value::Array(a) = v {
            if k.starts_with(&format!("{arch}.")) && a.len() == n_all {
                *a = a.slice(n, n + 1);
            }
        }
    }
    meta.insert(key("block_count"), Value::U32(1));
    meta.insert(key("nextn_predict_layers"), Value::U32(0));
    if arch == "deepseek4" {
        // As llama.cpp runs it: window-only attention, experts routed by score.
        let ratio = match meta.get(&key("attention.compress_ratios")) {
            Some(Value::Array(Array::U32(v))) => v.first().map(|&x| x as u64),
            Some(Value::Array(Array::I32(v))) => v.first().map(|&x| x as u64),
            _ => None,
        };
        if ratio.is_some_and(|r| r != 0) {
            return Err(bad(format!(
                "the block's compress ratio is {} (llama.cpp runs window-only blocks)",
                ratio.unwrap_or(0)
            )));
        }
        let hashed = match target.get(&key("hash_layer_count")) {
            Some(Value::U32(h)) => *h as usize,
            Some(Value::I32(h)) => (*h).max(0) as usize,
            _ => 0,
        };
        if n < hashed {
            return Err(bad(format!(
                "the block is hash-routed ({hashed} such layers; llama.cpp runs score-routed blocks)"
            )));
        }
        meta.insert(key("hash_layer_count"), Value::U32(0));
    } else {
        meta.insert(
            key("attention.recurrent_layers"),
            Value::Array(Array::Bool(vec![false])),
        );
    }
    let own = format!("blk.{n}.");
    let has = |s: &str| target.tensor(&format!("{own}nextn.{s}.weight")).is_some();
    let (embd, head, norm) = (
        has("embed_tokens"),
        has("shared_head_head"),
        has("shared_head_norm"),
    );
    let tied = target.tensor("output.weight").is_none();
    let view = target.view(meta, |name| {
        if let Some(rest) = name.strip_prefix(&own) {
            return Some(match rest.strip_prefix("nextn.") {
                Some("embed_tokens.weight") => "token_embd.weight".into(),
                Some("shared_head_head.weight") => "output.weight".into(),
                Some("shared_head_norm.weight") => "output_norm.weight".into(),
                Some(part) => format!("mtp.{part}"),
                None => format!("blk.0.{rest}"),
            });
        }
        if name.starts_with("blk.") {
            return None;
        }
        // The trunk's embedding, output and norm where the block has none of its own (the
        // block's come later in the file, and a name given twice keeps the later); a tied
        // output stays the trunk's embedding where the block brings its own.
        match name {
            "token_embd.weight" if embd && !head && tied => Some("output.weight".into()),
            "token_embd.weight" if embd => None,
            "output.weight" if head => None,
            "output_norm.weight" if norm => None,
            _ => Some(name.to_string()),
        }
    });
    Ok(Arc::new(view))
}

/// The block's input over a step: tokens and their h rows (the head's g buffer, as
/// [`Model::head_input`] writes it) in, the projected rows in `s.x`.
pub(crate) fn input<B: Backend>(
    b: &mut B,
    m: &Model<B>,
    w: &Mtp<B>,
    s: &mut State<B>,
    step: &quiver_backend::Step<B::StepCtx>,
) -> Result<()> {
    let (n, hp) = (step.rows, &m.hp);
    let (d, eps) = (hp.n_embd, hp.rms_eps);
    let ea = s.ea.as_mut().expect("a draft head's state");
    b.embed(step, &m.tok_embd, hp.embed_scale, &mut s.x)?;
    b.rms_norm(&s.x, &w.enorm, eps, n, &mut s.xn)?;
    b.rms_norm(&ea.g, &w.hnorm, eps, n, &mut s.o)?;
    b.put_cols(&s.xn, d, n, &mut ea.cat, 2 * d, 0)?;
    b.put_cols(&s.o, d, n, &mut ea.cat, 2 * d, d)?;
    b.matmul(&w.eh_proj, &ea.cat, n, &mut s.x)?;
    Ok(())
}
