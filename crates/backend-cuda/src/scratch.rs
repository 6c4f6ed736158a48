//! Scratch buffers the ops grow on demand. Never during a capture: a key's first step runs
//! eagerly and sizes them; a buffer that moves bumps the graphs' generation.

use crate::dev::DevBuf;
use crate::CudaBackend;
use quiver_backend::{BackendError, Result};
use std::collections::HashMap;

/// The fast path's scratch (the parity mode keeps its own, src/exact.rs).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Split-K attention partials.
    pub(crate) part: Option<DevBuf>,
    /// `top_k` and `argmax` results.
    pub(crate) top_ids: Option<DevBuf>,
    pub(crate) top_vals: Option<DevBuf>,
    pub(crate) ids: Option<DevBuf>,
    /// int8 activations: quants, scales, per-16 sums.
    pub(crate) aq: Option<DevBuf>,
    pub(crate) ad: Option<DevBuf>,
    pub(crate) abs: Option<DevBuf>,
    /// f16 activations of the cuBLAS products.
    pub(crate) xbf: Option<DevBuf>,
    /// The logits rows gathered for `matmul_logits`.
    pub(crate) gather: Option<DevBuf>,
    /// Rope angle tables, by their f32 bits.
    pub(crate) thetas: HashMap<Vec<u32>, DevBuf>,
}

impl CudaBackend {
    /// Grows scratch buffer `slot` to at least `bytes`; a move invalidates captured graphs.
    pub(crate) fn scratch_ptr(
        &self,
        pick: fn(&mut Scratch) -> &mut Option<DevBuf>,
        bytes: usize,
        what: &str,
    ) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        self.grow(pick(&mut s), bytes, what)
    }

    /// Grows `cur` to at least `bytes` (a power of two), counted as workspace; a move
    /// invalidates captured graphs.
    pub(crate) fn grow(&self, cur: &mut Option<DevBuf>, bytes: usize, what: &str) -> Result<u64> {
        if cur.as_ref().is_none_or(|b| b.bytes < bytes) {
            if self.graphs.capturing() {
                return Err(BackendError::Device(format!(
                    "{what}: scratch grew during a graph capture"
                )));
            }
            let nb = self.alloc(bytes.next_power_of_two(), what)?;
            let old = cur.replace(nb);
            let mut m = self.mem.lock().unwrap();
            m.workspace += cur.as_ref().unwrap().bytes as u64;
            if let Some(o) = old {
                m.workspace -= o.bytes as u64;
                // Graphs captured over the old buffer must never run again.
                self.bump_generation();
                drop(o);
            }
        }
        Ok(cur.as_ref().unwrap().ptr)
    }
}
