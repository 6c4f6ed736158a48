//! Model architectures. Each architecture file reads its hyperparameters and tensor map from
//! GGUF; `decoder` runs the forward over a flat batch on any backend.
//! Adding an architecture is one file plus one line in [`load`].

mod decoder;
mod deepseek4;
mod eagle3;
mod extras;
mod gemma2;
mod gemma3;
mod gemma4;
mod hparams;
mod llama;
pub mod mtp;
mod phi3;
mod qwen;
mod qwen35;
mod state;
mod tp;
mod tp_peers;

pub use decoder::{Experts, Ffn, Layer, Model, Scales};
pub use deepseek4::Dsv4Hp;
pub use eagle3::{check_target as eagle3_check_target, load as load_eagle3, Eagle3Hp};
pub use hparams::{Hparams, LayerHp};
pub use state::State;
pub use tp::{load_reduce_chunks, load_shard, ReduceParts};
pub use tp_peers::{TpPeers, TpSizes};

use quiver_backend::{Backend, BackendError, WeightBytes};
use quiver_gguf::{GgufError, GgufFile};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown architecture {0:?} (supported: {list})", list = SUPPORTED.join(", "))]
    UnknownArch(String),
    #[error("tensor {name} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    WrongShape {
        name: String,
        got: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("{0}")]
    UnsupportedKv(String),
    #[error("bad hyperparameter {key}: {detail}")]
    BadHparam { key: String, detail: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("batch of {got} tokens exceeds the workspace of {max}")]
    BatchTooLarge { got: usize, max: usize },
    #[error("{got} logits rows requested, the workspace holds {max}")]
    TooManyLogits { got: usize, max: usize },
    #[error("tensor parallelism: {0}")]
    Tp(String),
    #[error("cannot roll the recurrent state back by {back} tokens: it keeps {planes} states")]
    Rollback { back: usize, planes: usize },
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// The architectures [`load`] knows (GGUF `general.architecture`).
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral3",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "qwen35",
    "qwen35moe",
    "gemma2",
    "gemma3",
    "gemma4",
    "phi3",
    "deepseek4",
    "eagle3",
];

/// Loads the model of the file's architecture onto a backend.
pub fn load<B: Backend>(backend: &B, file: &Arc<GgufFile>) -> Result<Model<B>> {
    let hp = hparams(file)?;
    if hp.eagle3.is_some() {
        return Err(ModelError::UnknownArch(
            "eagle3 (an EAGLE-3 draft head runs beside its target: --spec-type eagle3 -md FILE)"
                .into(),
        ));
    }
    decoder::load(backend, file, hp, tp::Tp::NONE)
}

/// Loads the file's tensors under the given hyperparameters (what [`load`] does after reading
/// them): every tensor is checked against them.
pub fn load_with<B: Backend>(backend: &B, file: &Arc<GgufFile>, hp: Hparams) -> Result<Model<B>> {
    decoder::load(backend, file, hp, tp::Tp::NONE)
}

/// The hyperparameters of the file's architecture, without loading any weight (sizing a KV
/// pool before the load, say).
pub fn hparams(file: &GgufFile) -> Result<Hparams> {
    let hp = match file.arch()? {
        "llama" | "mistral3" => llama::hparams(file),
        "gemma2" => gemma2::hparams(file),
        "gemma3" => gemma3::hparams(file),
        "gemma4" => gemma4::hparams(file),
        "phi3" => phi3::hparams(file),
        "qwen2" | "qwen3" | "qwen3moe" => qwen::hparams(file),
        "qwen35" | "qwen35moe" => qwen35::hparams(file),
        "deepseek4" => deepseek4::hparams(file),
        "eagle3" => eagle3::hparams(file),
        other => Err(ModelError::UnknownArch(other.into())),
    }?;
    hp.check_ffn()?;
    Ok(hp)
}

/// Fetches a tensor, checks its shape, and hands its bytes to the backend.
pub(crate) fn weight<B: Backend>(
    backend: &B,
    file: &Arc<GgufFile>,
    name: &str,
    shape: &[u64],
) -> Result<B::Weight> {
    let (idx, ty) = find(file, name, shape)?;
    Ok(backend.weight(name, ty, shape, WeightBytes::whole(file.clone(), idx))?)
}

/// Entries `first..first + n` of the outermost dimension of the tensor `name` of `shape` as
/// a weight of its own, in place (rows of a 2-D tensor: one part of a fused tensor, whose
/// products are the fused product's rows, bit for bit; experts of a 3-D one).
pub(crate) fn weight_rows<B: Backend>(
    backend: &B,
    file: &Arc<GgufFile>,
    name: &str,
    shape: &[u64],
    first: u64,
    n: u64,
) -> Result<B::Weight> {
    let (idx, ty) = find(file, name, shape)?;
    let (last, inner) = (shape[shape.len() - 1], &shape[1..shape.len() - 1]);
    let entry = ty.row_bytes(last).unwrap_or(0) as usize * inner.iter().product::<u64>() as usize;
    let mut bytes = WeightBytes::whole(file.clone(), idx);
    bytes.range = Some((first as usize * entry, n as usize * entry));
    let part = format!("{name}[{first}..{}]", first + n);
    let part_shape: Vec<u64> = std::iter::once(n)
        .chain(shape[1..].iter().copied())
        .collect();
    Ok(backend.weight(&part, ty, &part_shape, bytes)?)
}

pub(crate) fn find(
    file: &GgufFile,
    name: &str,
    shape: &[u64],
) -> Result<(usize, quiver_gguf::GgmlType)> {
    let idx = file
        .tensors
        .iter()
        .position(|t| t.name == name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
    let t = &file.tensors[idx];
    if t.shape != shape {
        return Err(ModelError::WrongShape {
            name: name.into(),
            got: t.shape.clone(),
            expected: shape.to_vec(),
        });
    }
    Ok((idx, t.ty))
}
