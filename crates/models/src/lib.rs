//! Model architectures. Each architecture file reads its hyperparameters and tensor map from
//! GGUF; `decoder` runs the forward over a flat batch on any backend.
//! Adding an architecture is one file plus one line in [`load`].

mod decoder;
mod gemma3;
mod hparams;
mod llama;

pub use decoder::{Layer, Model, State};
pub use hparams::Hparams;

use quiver_backend::{Backend, BackendError, WeightBytes};
use quiver_gguf::{GgufError, GgufFile};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown architecture {0:?} (supported: llama, gemma3)")]
    UnknownArch(String),
    #[error("tensor {name} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    WrongShape {
        name: String,
        got: Vec<u64>,
        expected: Vec<u64>,
    },
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
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// Loads the model of the file's architecture onto a backend.
pub fn load<B: Backend>(backend: &B, file: &Arc<GgufFile>) -> Result<Model<B>> {
    decoder::load(backend, file, hparams(file)?)
}

/// The hyperparameters of the file's architecture, without loading any weight (sizing a KV
/// pool before the load, say).
pub fn hparams(file: &GgufFile) -> Result<Hparams> {
    match file.arch()? {
        "llama" => llama::hparams(file),
        "gemma3" => gemma3::hparams(file),
        other => Err(ModelError::UnknownArch(other.into())),
    }
}

/// Fetches a tensor, checks its shape, and hands its bytes to the backend.
pub(crate) fn weight<B: Backend>(
    backend: &B,
    file: &Arc<GgufFile>,
    name: &str,
    shape: &[u64],
) -> Result<B::Weight> {
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
    Ok(backend.weight(
        name,
        t.ty,
        shape,
        WeightBytes {
            file: file.clone(),
            tensor: idx,
        },
    )?)
}
