//! Matmul dispatch onto the SIMD kernels of `quiver-cpu-kernels`, with a persistent thread
//! pool and reusable activation scratch (no allocation in steady state), which carries the
//! instance's [`Numerics`] into every call.

use quiver_backend::{BackendError, Result};
use quiver_cpu_kernels::{Numerics, Scratch, ThreadPool};
use quiver_gguf::GgmlType;
use std::sync::Mutex;

pub struct MatMul {
    pool: ThreadPool,
    scratch: Mutex<Scratch>,
    numerics: Numerics,
}

impl MatMul {
    pub fn new(threads: usize, numerics: Numerics) -> Self {
        let pool = ThreadPool::new(threads.max(1)).expect("spawning the CPU worker threads");
        MatMul {
            pool,
            scratch: Mutex::new(Scratch::with_numerics(numerics)),
            numerics,
        }
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn supports(&self, ty: GgmlType) -> bool {
        quiver_cpu_kernels::supports(ty)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        let w = w.get(..rows * rb).ok_or_else(|| BackendError::Shape {
            op: "matmul",
            detail: format!("weight bytes {} < {rows}×{rb}", w.len()),
        })?;
        quiver_cpu_kernels::matmul(&self.pool, ty, w, rows, cols, x, n, out, &mut scratch).map_err(
            |e| BackendError::Shape {
                op: "matmul",
                detail: e.to_string(),
            },
        )
    }
}
