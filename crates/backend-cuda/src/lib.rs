//! The CUDA backend, the seed system's GPU context carried to CUDA: one context per loaded
//! model with its stream, a kernel registry (NVRTC → cubin for the device's architecture,
//! cached on disk), a graph executor that captures decode steps and replays them, weights
//! copied from the mapped GGUF straight to device memory, and a kernel table built at load
//! that names the kernel family of every product and attention call (`plan`).
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the binary builds and runs on
//! machines without CUDA, where `probe` says why there is no GPU.
//!
//! The files mirror the kernels: `config` (the numerics and the kill switches, read once),
//! `plan` (the kernel table), `context` (device,
//! registry, the backend struct), `launch`, `memory` (buffers, KV caches), `weights`,
//! `scratch`, `batch` (the step's upload), `graph`; the ops of the fast path in `products`,
//! `attention`, `norm`, `rope`, `activation`, `embed`, `sampling`, `moe`, `extras`, and
//! `backend` (the `Backend` impl of [`CudaBackend`]); the parity mode, [`ParityBackend`], in
//! `parity` (its `Backend` impl) over `exact` (its ops).

#[macro_use]
mod launch;

mod activation;
mod attention;
mod backend;
mod batch;
mod config;
mod context;
mod delta;
mod dev;
mod dsv4;
mod embed;
mod exact;
mod extras;
mod graph;
mod imm;
mod kinds;
mod kvq;
pub mod libs;
mod memory;
mod mmv;
mod moe;
mod nccl;
mod norm;
mod parity;
pub mod plan;
mod products;
mod qmm;
pub mod registry;
mod rope;
mod sampling;
mod scratch;
mod split;
mod tp;
mod weights;
mod wmm;

use quiver_backend::{BackendError, Result};
use quiver_gguf::GgmlType;

pub use batch::CudaStep;
pub use config::CudaConfig;
pub use context::CudaBackend;
pub use dev::{probe, DeviceInfo};
pub use graph::{GraphStats, MAX_GRAPH_TOKENS};
pub use memory::{CudaBuf, CudaKv, MemStats};
pub use nccl::UniqueId;
pub use parity::ParityBackend;
pub use tp::nccl_group;
pub use weights::CudaWeight;
pub use wmm::WMM_TILES;

/// The int8 grid the CPU backend (like ggml) quantizes activations to for products with weights
/// of type `ty`: blocks of 32 for the legacy quantized types, of 256 for the K-quants, none for
/// float weights. The tensor-core products round their f16 activations to the same grid.
pub fn act_grid(ty: GgmlType) -> Option<usize> {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 => None,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Some(256),
        _ => Some(32),
    }
}

/// The kernel-name suffix of a weight type with CUDA kernels.
pub fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::IQ4_NL => "iq4_nl",
        GgmlType::IQ4_XS => "iq4_xs",
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        _ => return None,
    })
}

fn derr(what: impl std::fmt::Display, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op,
            detail: detail(),
        })
    }
}
