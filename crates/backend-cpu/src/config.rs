//! How a [`CpuBackend`] is built.

use crate::{matmul, CpuBackend, Numerics};

/// How a [`CpuBackend`] is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Threads of the instance's pool (at least 1).
    pub threads: usize,
    /// How its products and attention round: [`Numerics::BatchInvariant`] (the default) gives
    /// every token the same bits whatever its batch (matmuls on the decode path, one-row
    /// attention); [`Numerics::Fast`] takes the GEMM path and llama.cpp's tiled attention for
    /// steps of 64+ tokens and rounds as llama.cpp does for one sequence
    /// (`quiver_cpu_kernels::gemm_min_tokens`).
    pub numerics: Numerics,
}

impl CpuConfig {
    /// `threads` threads, the default numerics (batch invariant).
    pub fn new(threads: usize) -> Self {
        CpuConfig {
            threads,
            numerics: Numerics::default(),
        }
    }
}

impl CpuBackend {
    /// `threads` threads, batch invariant (as [`CpuConfig::new`]).
    pub fn new(threads: usize) -> Self {
        CpuBackend::with_config(CpuConfig::new(threads))
    }

    pub fn with_config(config: CpuConfig) -> Self {
        CpuBackend {
            mm: matmul::MatMul::new(config.threads, config.numerics),
            packed: Default::default(),
            routing: Default::default(),
            extra: Default::default(),
            resident: Default::default(),
            comm: None,
            weights_made: Default::default(),
        }
    }

    /// This instance as one rank of a tensor-parallel group: [`Backend::all_reduce`] sums over
    /// the group through `comm` (each rank's model holds its part of every layer).
    ///
    /// [`Backend::all_reduce`]: quiver_backend::Backend::all_reduce
    pub fn with_comm(mut self, comm: std::sync::Arc<dyn quiver_backend::Comm>) -> Self {
        self.comm = Some(comm);
        self
    }

    /// Every weight read from the file's mapping, none copied into huge pages
    /// (`resident.rs`): for `--mlock`, which locks the mapping (with `mapped` true).
    pub fn weights_mapped(mut self, mapped: bool) -> Self {
        self.resident.mapped = mapped;
        self
    }

    pub fn threads(&self) -> usize {
        self.mm.threads()
    }

    /// This instance's numerics (fixed at construction).
    pub fn numerics(&self) -> Numerics {
        self.mm.numerics()
    }
}
