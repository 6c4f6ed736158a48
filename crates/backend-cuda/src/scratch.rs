//! Scratch buffers the ops grow on demand. Never during a capture: a key's first step runs
//! eagerly and sizes them; a buffer that moves bumps the graphs' generation.

use crate::dev::DevBuf;
use crate::CudaBackend;
use quiver_backend::{BackendError, Result, WorkspaceSpec};
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
    /// `argmax_rows`' partials and counters (src/sampling.rs).
    pub(crate) amax: Option<DevBuf>,
    /// Constrained decoding's masks: each mask's row, then its bits.
    pub(crate) masks: Option<DevBuf>,
    /// int8 activations: quants, scales, per-16 sums.
    pub(crate) aq: Option<DevBuf>,
    pub(crate) ad: Option<DevBuf>,
    pub(crate) abs: Option<DevBuf>,
    /// Split-K products' partial sums (src/split.rs).
    pub(crate) qpart: Option<DevBuf>,
    /// f16 activations of the tensor-core products.
    pub(crate) xbf: Option<DevBuf>,
    /// The same permuted for wmm (src/wmm.rs).
    pub(crate) xperm: Option<DevBuf>,
    /// The logits rows gathered for `matmul_logits`.
    pub(crate) gather: Option<DevBuf>,
    /// Rope angle tables, by their f32 bits.
    pub(crate) thetas: HashMap<Vec<u32>, DevBuf>,
    /// The TurboQuant tables (kernels/kvq.cu): 512 signs, the tq8 and the tq4 levels.
    pub(crate) tq: Option<DevBuf>,
    /// 0, 1, 2, … (u32): the row list of a launch over rows r0.. of a step (`row_ids`).
    pub(crate) row_ids: Option<DevBuf>,
    /// imm's split partials and tile counters (`exact_parts`).
    pub(crate) epart: Option<DevBuf>,
    pub(crate) ecnt: Option<DevBuf>,
    /// Tensor parallelism over NCCL: the ranks' values an all-gather brings (src/tp.rs).
    pub(crate) tp: Option<DevBuf>,
}

/// Bytes of quantize_a256's sums for `n` rows of `cols`: the per-16 sums (i32), then the
/// 32-sums split as two int8 (kernels/ops.cu).
pub(crate) fn act_sums_bytes(n: usize, cols: usize) -> usize {
    n * cols / 16 * 4 + n * cols / 32 * 2
}

/// A scratch buffer, its size for a workspace, and what it is for.
type Plan = (fn(&mut Scratch) -> &mut Option<DevBuf>, usize, &'static str);

/// The largest top-k the engine asks of the device (`quiver_engine`'s `MAX_DEVICE_TOP_K`).
const MAX_TOP_K: usize = 64;

impl CudaBackend {
    /// The fast path's scratch for steps of at most `ws`: what `reserve_workspace` allocates
    /// at load so that no step grows a buffer (the sizes the ops ask for, at their largest).
    fn scratch_plan(&self, ws: &WorkspaceSpec) -> Vec<Plan> {
        let (n, cols) = (ws.max_tokens.max(1), ws.max_product_cols);
        let part = (1..=n)
            .flat_map(|r| ws.attention.iter().map(move |&(nh, hd)| (r, nh, hd)))
            .map(|(r, nh, hd)| {
                let kvd = r.min(crate::kvq::KVD_MAX_ROWS) * crate::kvq::KVD_MAX_SPLITS;
                (r * self.n_split(r, nh, ws.n_slots)).max(kvd) * nh * (hd + 2) * 4
            })
            .max()
            .unwrap_or(0);
        let mut plan: Vec<Plan> = vec![
            (|s| &mut s.part, part, "attention partials"),
            (
                |s| &mut s.top_ids,
                ws.max_logits * MAX_TOP_K * 4,
                "top-k ids",
            ),
            (
                |s| &mut s.top_vals,
                ws.max_logits * MAX_TOP_K * 4,
                "top-k values",
            ),
            (|s| &mut s.ids, ws.max_logits.max(1) * 4, "argmax ids"),
            (
                |s| &mut s.masks,
                crate::sampling::mask_bytes(ws.max_logits, ws.n_vocab),
                "token masks",
            ),
            (|s| &mut s.aq, n * cols, "int8 activations"),
            (|s| &mut s.ad, n * cols / 4, "activation scales"),
            (|s| &mut s.abs, act_sums_bytes(n, cols), "activation sums"),
            (
                |s| &mut s.gather,
                ws.max_logits * ws.n_embd * 4,
                "logits rows",
            ),
        ];
        plan.push((|s| &mut s.xbf, n * cols * 2, "f16 activations"));
        if crate::wmm::wmm_arch(self.dev.info.arch) {
            let colsp = crate::wmm::permuted_cols(cols);
            plan.push((|s| &mut s.xperm, n * colsp * 2, "permuted activations"));
        }
        if self.split_scratch() {
            plan.push((
                |s| &mut s.qpart,
                crate::split::QSPLIT_BYTES,
                "product partials",
            ));
        }
        // The widest exchange: a step's rows of n_embd (all_reduce) or its logits rows of the
        // whole vocabulary (all_gather_cols of each rank's rows).
        let exchange = (n * ws.n_embd).max(ws.max_logits * ws.n_vocab);
        plan.push((
            |s| &mut s.tp,
            self.tp_scratch_bytes(exchange),
            "the ranks' gathered values",
        ));
        plan.retain(|p| p.1 > 0);
        plan
    }

    /// Bytes of `scratch_plan` (allocations round up to powers of two).
    pub(crate) fn scratch_bytes(&self, ws: &WorkspaceSpec) -> u64 {
        let argmax = crate::sampling::argmax_bytes(ws.max_logits.max(1));
        self.scratch_plan(ws)
            .iter()
            .map(|p| p.1.next_power_of_two() as u64)
            .sum::<u64>()
            + argmax.next_power_of_two() as u64
    }

    /// Allocates `scratch_plan` now.
    pub(crate) fn reserve_scratch(&self, ws: &WorkspaceSpec) -> Result<()> {
        for (pick, bytes, what) in self.scratch_plan(ws) {
            self.scratch_ptr(pick, bytes, what)?;
        }
        self.row_ids(ws.max_tokens.max(1))?;
        self.argmax_parts(ws.max_logits.max(1))?;
        if self.cfg.numerics == quiver_backend::Numerics::BatchInvariant {
            self.exact_parts()?;
        }
        Ok(())
    }

    /// The device's list 0, 1, … of at least `n` row ids (made or grown outside graph captures).
    pub(crate) fn row_ids(&self, n: usize) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        if let Some(b) = s.row_ids.as_ref().filter(|b| b.bytes >= n * 4) {
            return Ok(b.ptr);
        }
        let len = n.next_power_of_two();
        let ptr = self.grow(&mut s.row_ids, len * 4, "row ids")?;
        let ids: Vec<u32> = (0..len as u32).collect();
        self.dev
            .htod_sync(ptr, &ids)
            .map_err(BackendError::Device)?;
        Ok(ptr)
    }

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

    /// [`scratch_ptr`](Self::scratch_ptr) for counters: zeroed whenever (re)made (their users
    /// leave them at zero). The pointer and the buffer's bytes.
    pub(crate) fn zeroed_scratch(
        &self,
        pick: fn(&mut Scratch) -> &mut Option<DevBuf>,
        bytes: usize,
        what: &str,
    ) -> Result<(u64, usize)> {
        let mut s = self.scratch.lock().unwrap();
        let slot = pick(&mut s);
        let fresh = slot.as_ref().is_none_or(|b| b.bytes < bytes);
        let p = self.grow(slot, bytes, what)?;
        let len = slot.as_ref().map_or(0, |b| b.bytes);
        if fresh {
            self.dev.memset_zero(p, len).map_err(BackendError::Device)?;
        }
        Ok((p, len))
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
