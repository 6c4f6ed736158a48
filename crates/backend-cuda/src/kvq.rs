//! Attention over the KV cache of any element types (kernels/kvq.cu, one module per (K type,
//! V type); f16 is a record type like the others): the write after rope for the types other
//! than f16 (`kv_encode`), the KV-group decode kernel (`kvd_attention`) and the split-K kernel
//! per head (`kvq_attention`). Prompts over an f16 cache take the tensor-core flash kernel
//! (attention.rs); over the other types, the split-K kernel.

use crate::batch::{BatchView, CudaStep};
use crate::memory::{CudaBuf, CudaKv};
use crate::CudaBackend;
use quiver_backend::turboquant::{signs, TQ4_LEVELS, TQ8_LEVELS};
use quiver_backend::{AttnParams, BackendError, KvType, Result, Step};

/// The kernels' number for a type (kvq.cu's KV_*).
pub(crate) fn kv_type_id(t: KvType) -> u32 {
    match t {
        KvType::F16 => 0,
        KvType::Bf16 => 1,
        KvType::Q8_0 => 2,
        KvType::Tq8 => 3,
        KvType::Tq4 => 4,
    }
}

/// The module of a (K, V) pair of types.
pub(crate) fn module(k: KvType, v: KvType) -> String {
    format!("kvq_{}_{}", k.name(), v.name())
}

/// Head dims the kvq kernels are built for.
pub(crate) const KVQ_HEAD_DIMS: &[usize] = &[64, 96, 128, 256, 512];

/// `{kernel}_{head dim}` for each of [`KVQ_HEAD_DIMS`], as static names: a launch allocates
/// nothing.
macro_rules! per_head_dim {
    ($k:literal) => {
        [
            concat!($k, "_64"),
            concat!($k, "_96"),
            concat!($k, "_128"),
            concat!($k, "_256"),
            concat!($k, "_512"),
        ]
    };
}
const KVQ_ATTENTION: [&str; 5] = per_head_dim!("kvq_attention");
const KVQ_MERGE: [&str; 5] = per_head_dim!("kvq_merge");
const KVD_ATTENTION: [&str; 5] = per_head_dim!("kvd_attention");
const KVD_MERGE: [&str; 5] = per_head_dim!("kvd_merge");

/// The name of `names` for head dim `hd` (one of [`KVQ_HEAD_DIMS`]; checked by the callers).
fn named(names: &[&'static str; 5], hd: usize) -> &'static str {
    let i = KVQ_HEAD_DIMS.iter().position(|&d| d == hd).unwrap_or(0);
    names[i]
}
/// Most rows of one kvd launch (its partials take `KVD_MAX_SPLITS` ranges per (row, head));
/// a step of more takes several, over the rows listed at `row_ids`.
pub(crate) const KVD_MAX_ROWS: usize = 64;

/// kvd's grid x for a launch of `rows` rows: each block takes the key ranges x, x + X, … of its
/// row, so the grid is wide for few rows (a long context's 64 ranges in parallel) and narrow for
/// many (a short context's one range without 63 empty blocks). A row's ranges, and so its bits,
/// do not depend on X.
pub(crate) fn kvd_grid_x(rows: usize) -> usize {
    (256 / rows.max(1)).clamp(4, KVD_MAX_SPLITS)
}
/// kvq.cu's KVD_MAX_SPLITS.
pub(crate) const KVD_MAX_SPLITS: usize = 64;
/// kvq.cu's KVD_G: query heads per block.
const KVD_G: usize = 4;

impl CudaBackend {
    /// The TurboQuant tables on the device (made once, with the first cache).
    pub(crate) fn tq_tables(&self) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        if let Some(b) = &s.tq {
            return Ok(b.ptr);
        }
        let mut t = signs(quiver_backend::turboquant::MAX_DIM);
        t.extend_from_slice(&TQ8_LEVELS);
        t.extend_from_slice(&TQ4_LEVELS);
        let b = self.alloc(t.len() * 4, "TurboQuant tables")?;
        self.dev
            .htod_sync(b.ptr, &t)
            .map_err(BackendError::Device)?;
        let p = b.ptr;
        s.tq = Some(b);
        Ok(p)
    }

    /// K (after rope) and V of the step's rows into their records.
    pub(crate) fn kv_encode(
        &self,
        st: &Step<CudaStep>,
        k: &CudaBuf,
        v: &CudaBuf,
        a: &AttnParams,
        kv: &mut CudaKv,
    ) -> Result<()> {
        self.launch(
            &kv.module,
            "kv_encode",
            (st.rows.max(1) as u32, a.n_head_kv as u32, 2),
            (128, 1, 1),
            args![
                k.ptr(),
                v.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                st.ctx.view.slot,
                kv.tq,
                a.n_head_kv as i32,
                a.head_dim as i32,
                kv_type_id(kv.types.k) as i32,
                kv_type_id(kv.types.v) as i32
            ],
        )
    }

    /// The KV-group decode kernel over the cache (f16 or records), ranges merged by kvd_merge:
    /// over every row of the step, or over the `rows.1` rows listed at `rows.0`; launches of at
    /// most [`KVD_MAX_ROWS`] rows.
    pub(crate) fn attention_kvd(
        &self,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
        rows: Option<(u64, usize)>,
    ) -> Result<()> {
        let hd = a.head_dim;
        let mut view = st.ctx.view;
        let (list, n) = match rows {
            Some(r) => r,
            // One launch needs no list.
            None if st.rows <= KVD_MAX_ROWS => (0, st.rows),
            None => (self.row_ids(st.rows)?, st.rows),
        };
        let part = self.scratch_ptr(
            |s| &mut s.part,
            n.min(KVD_MAX_ROWS) * a.n_head * KVD_MAX_SPLITS * (hd + 2) * 4,
            "attention partials",
        )?;
        let g = a.n_head / a.n_head_kv.max(1);
        let blocks_y = a.n_head_kv * g.div_ceil(KVD_G);
        let window = a.window.map(|w| w as i32).unwrap_or(0);
        for r0 in (0..n).step_by(KVD_MAX_ROWS) {
            let c = (n - r0).min(KVD_MAX_ROWS);
            view.drows = if list == 0 { 0 } else { list + 4 * r0 as u64 };
            let grid = (kvd_grid_x(c) as u32, blocks_y as u32, c as u32);
            self.launch_over_records(view, q, kv, a, out, part, &KVD_ATTENTION, grid)?;
            self.launch(
                &kv.module,
                named(&KVD_MERGE, hd),
                (a.n_head as u32, c as u32, 1),
                (hd as u32, 1, 1),
                args![part, out.ptr(), kv.tq, view, a.n_head as i32, window],
            )?;
        }
        Ok(())
    }

    /// Split-K attention per head (every row of the step), its key ranges merged by kvq_merge.
    pub(crate) fn attention_kvq(
        &self,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let (n, hd) = (st.rows, a.head_dim);
        let ns = self.n_split(n, a.n_head, kv.n_slots);
        let part = if ns > 1 {
            self.scratch_ptr(
                |s| &mut s.part,
                n * a.n_head * ns * (hd + 2) * 4,
                "attention partials",
            )?
        } else {
            0
        };
        let grid = (ns as u32, a.n_head as u32, n as u32);
        self.launch_over_records(st.ctx.view, q, kv, a, out, part, &KVQ_ATTENTION, grid)?;
        if ns > 1 {
            self.launch(
                &kv.module,
                named(&KVQ_MERGE, hd),
                (a.n_head as u32, n as u32, 1),
                (hd as u32, 1, 1),
                args![part, out.ptr(), kv.tq, a.n_head as i32, ns as i32],
            )?;
        }
        Ok(())
    }

    /// Launches `kernel`'s name for the head dim from the pair's module (block (32, 4)) with
    /// the arguments kvq_attention and kvd_attention share.
    #[allow(clippy::too_many_arguments)]
    fn launch_over_records(
        &self,
        view: BatchView,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
        part: u64,
        kernel: &[&'static str; 5],
        grid: (u32, u32, u32),
    ) -> Result<()> {
        self.launch(
            &kv.module,
            named(kernel, a.head_dim),
            grid,
            (32, 4, 1),
            args![
                q.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                out.ptr(),
                part,
                view,
                kv.tq,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.scale,
                a.window.map(|w| w as i32).unwrap_or(0),
                a.softcap.unwrap_or(0.0)
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    /// kvq.cu decodes tq8 with the codec's step, to the bit.
    #[test]
    fn the_kernels_tq8_step_is_the_codecs() {
        let src = crate::registry::module_source("kvq_tq8_tq8").unwrap();
        let step = crate::exact::tests::define(&src, "TQ8_STEP");
        assert_eq!(step, quiver_backend::turboquant::TQ8_STEP as f64);
    }
}
