//! A CUDA backend as one rank of a tensor-parallel group (quiver_models::tp): its link to the
//! other ranks and the backend's exchanges over it ([`Backend::all_reduce`],
//! [`Backend::all_gather_cols`]).
//!
//! - **NCCL** (one GPU a rank, `CudaBackend::with_nccl`): an all-gather of the ranks' values into
//!   a scratch buffer on the stream, then `tp_sum_ranks` (or `tp_gather_cols`) there, captured in
//!   the decode graphs like any launch;
//! - **through the host** (`CudaBackend::with_comm`, any [`Comm`], e.g. `LocalComm` between
//!   backends of one GPU in the tests): each exchange copies the values to the host, exchanges
//!   them there and copies the result back. It synchronizes the stream, so a backend so linked
//!   runs without graphs.
//!
//! Both sum in rank order, `((x_0 + x_1) + x_2) + …`, so the two give the same bits.
//!
//! [`Backend::all_reduce`]: quiver_backend::Backend::all_reduce
//! [`Backend::all_gather_cols`]: quiver_backend::Backend::all_gather_cols

use crate::graph;
use crate::memory::CudaBuf;
use crate::nccl::{self, NcclRank, UniqueId};
use crate::CudaBackend;
use quiver_backend::{BackendError, Comm, Result, Shard};
use std::sync::Arc;

/// How a rank reaches the others.
pub(crate) enum Link {
    Nccl(NcclRank),
    Host(Arc<dyn Comm>),
}

impl Link {
    pub(crate) fn shard(&self) -> Shard {
        match self {
            Link::Nccl(r) => r.shard(),
            Link::Host(c) => c.shard(),
        }
    }
}

/// A new NCCL group's id: every rank of the group starts from it ([`CudaBackend::with_nccl`]).
pub fn nccl_group() -> Result<UniqueId> {
    nccl::unique_id().map_err(BackendError::Device)
}

fn err(what: &str, e: String) -> BackendError {
    BackendError::Device(format!("{what}: {e}"))
}

impl CudaBackend {
    /// This backend as rank `shard.rank` of the NCCL group `id` (one GPU a rank). Collective:
    /// every rank of the group calls it at once, each on its own thread.
    pub fn with_nccl(mut self, id: UniqueId, shard: Shard) -> Result<Self> {
        self.dev.bind().map_err(BackendError::Device)?;
        let r = NcclRank::init(id, shard).map_err(|e| err("tensor parallelism", e))?;
        self.link = Some(Link::Nccl(r));
        Ok(self)
    }

    /// This backend as a rank of `comm`'s group, its exchanges through the host (no graphs).
    pub fn with_comm(mut self, comm: Arc<dyn Comm>) -> Self {
        self.link = Some(Link::Host(comm));
        self.graphs = graph::Graphs::new(false);
        self
    }

    /// The all-gather's scratch for a step's exchanges of at most `values` f32 a rank.
    pub(crate) fn tp_scratch_bytes(&self, values: usize) -> usize {
        match &self.link {
            Some(Link::Nccl(r)) => r.shard().size * values * 4,
            _ => 0,
        }
    }

    /// x[..n] ← the ranks' x[..n] summed in rank order.
    pub(crate) fn tp_all_reduce(&self, x: &mut CudaBuf, n: usize) -> Result<()> {
        let Some(link) = &self.link else {
            return Ok(());
        };
        if n == 0 {
            return Ok(());
        }
        let size = link.shard().size;
        match link {
            Link::Nccl(r) => {
                let g = self.tp_gather(r, x, n, "all_reduce")?;
                self.launch(
                    "ops",
                    "tp_sum_ranks",
                    (crate::launch::grid1(n, 256, 4096), 1, 1),
                    (256, 1, 1),
                    args![g, x.ptr(), n as i64, size as i32],
                )
            }
            Link::Host(c) => {
                let mut guard = self.tp_host.lock().unwrap_or_else(|e| e.into_inner());
                let h = &mut guard.0;
                if h.len() < n {
                    h.resize(n, 0.0);
                }
                let h = &mut h[..n];
                self.dev.dtoh(h, x.ptr()).map_err(BackendError::Device)?;
                c.all_reduce_sum(h)?;
                self.dev.htod_sync(x.ptr(), h).map_err(BackendError::Device)
            }
        }
    }

    /// x ← every rank's rows × width values as its columns of rows of size · width.
    pub(crate) fn tp_all_gather_cols(
        &self,
        x: &mut CudaBuf,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let Some(link) = &self.link else {
            return Ok(());
        };
        let size = link.shard().size;
        let (part, all) = (rows * width, rows * width * size);
        if x.len < all {
            return Err(BackendError::Shape {
                op: "all_gather_cols",
                detail: format!("{} values for {size} ranks of {rows}×{width}", x.len),
            });
        }
        if part == 0 {
            return Ok(());
        }
        match link {
            Link::Nccl(r) => {
                let g = self.tp_gather(r, x, part, "all_gather_cols")?;
                self.launch(
                    "ops",
                    "tp_gather_cols",
                    (crate::launch::grid1(all, 256, 4096), 1, 1),
                    (256, 1, 1),
                    args![g, x.ptr(), all as i64, rows as i32, width as i32],
                )
            }
            Link::Host(c) => {
                // The host's copy of x and the gathered values (kept: no allocation once the
                // largest step has run).
                let mut guard = self.tp_host.lock().unwrap_or_else(|e| e.into_inner());
                let (h, gathered) = &mut *guard;
                if h.len() < all {
                    h.resize(all, 0.0);
                }
                let h = &mut h[..all];
                self.dev
                    .dtoh(&mut h[..part], x.ptr())
                    .map_err(BackendError::Device)?;
                quiver_backend::comm::all_gather_cols(c.as_ref(), h, rows, width, gathered)?;
                self.dev.htod_sync(x.ptr(), h).map_err(BackendError::Device)
            }
        }
    }

    /// This rank leaves its group after a failed step: the others' exchanges fail.
    pub(crate) fn tp_leave(&self) {
        match &self.link {
            Some(Link::Nccl(r)) => r.abort(),
            Some(Link::Host(c)) => c.leave(),
            None => {}
        }
    }

    /// Every rank's x[..n] gathered over NCCL, rank after rank, into the scratch reserved at
    /// load (scratch.rs); its pointer.
    fn tp_gather(&self, r: &NcclRank, x: &CudaBuf, n: usize, op: &str) -> Result<u64> {
        let size = r.shard().size;
        let g = self.scratch_ptr(|s| &mut s.tp, size * n * 4, "the ranks' gathered values")?;
        r.all_gather(x.ptr(), g, n, self.dev.stream as *mut _)
            .map_err(|e| err(op, e))?;
        Ok(g)
    }
}
