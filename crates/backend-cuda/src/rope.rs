//! Rope fused with the KV cache write (ops.cu `rope_kv_write`): q rotated in place, k rotated
//! and written with v into the f16 cache at each token's slot; with per-head q/k norms, each
//! head normed first in the same launch. The fast path only: the parity mode's is in
//! src/exact.rs.

use crate::batch::CudaStep;
use crate::memory::{CudaBuf, CudaKv};
use crate::{check, CudaBackend};
use quiver_backend::{AttnParams, BackendError, Result, RopeMode, RopeParams, Step};

/// The shapes `rope_kv_write` takes, in either mode.
pub(crate) fn check_rope_kv_write(
    q: &CudaBuf,
    k: &CudaBuf,
    v: &CudaBuf,
    rope: &RopeParams,
    a: &AttnParams,
    kv: &CudaKv,
    n: usize,
) -> Result<()> {
    let kv_dim = a.n_head_kv * a.head_dim;
    check("rope_kv_write", kv_dim == kv.kv_dim, || {
        format!("kv_dim {kv_dim} vs cache {}", kv.kv_dim)
    })?;
    check(
        "rope_kv_write",
        q.len >= n * a.n_head * a.head_dim && k.len >= n * kv_dim && v.len >= n * kv_dim,
        || "buffers too small".into(),
    )?;
    check(
        "rope_kv_write",
        rope.n_dims <= a.head_dim && rope.n_dims.is_multiple_of(2),
        || format!("{} rotated dims of {}", rope.n_dims, a.head_dim),
    )
}

impl CudaBackend {
    /// The fast path's rope and KV write over the step's rows (shapes checked by the caller),
    /// q's and k's heads first RMS-normed by `norms` (q's weight, k's, eps) when given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_kv_write_fast(
        &self,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CudaKv,
        norms: Option<(u64, u64, f32)>,
    ) -> Result<()> {
        // A cache of records: rope here (k rotated in place), then kv_encode writes them.
        let (kc, vc) = if kv.packed() {
            (0, 0)
        } else {
            (kv.k.ptr, kv.v.ptr)
        };
        let heads = a.n_head + a.n_head_kv;
        self.rope_launch(
            st,
            [q.ptr(), k.ptr(), v.ptr(), kc, vc],
            heads,
            rope,
            a,
            norms,
        )?;
        if kv.packed() {
            self.kv_encode(st, k, v, a, kv)?;
        }
        Ok(())
    }

    /// The `rope_kv_write` kernel over the step's rows and the first `heads` heads (q's, then
    /// k's): `bufs` = q, k, v and the cache's k and v (0: no cache write); `norms`: q's and k's
    /// per-head RMS norm weights and eps, applied before the rotation.
    pub(crate) fn rope_launch(
        &self,
        st: &Step<CudaStep>,
        bufs: [u64; 5],
        heads: usize,
        rope: &RopeParams,
        a: &AttnParams,
        norms: Option<(u64, u64, f32)>,
    ) -> Result<()> {
        let th = self.theta_ptr(rope)?;
        let mode = i32::from(rope.mode == RopeMode::Neox);
        let [q, k, v, kc, vc] = bufs;
        let (qn, kn, eps) = norms.unwrap_or((0, 0, 0.0));
        self.launch(
            "ops",
            "rope_kv_write",
            (st.rows.max(1) as u32, heads as u32, 1),
            (64, 1, 1),
            args![
                q,
                k,
                v,
                kc,
                vc,
                st.ctx.view.pos,
                st.ctx.view.slot,
                th,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.head_dim as i32,
                rope.n_dims as i32,
                mode,
                rope.mscale(),
                rope.q_temp.map_or(0.0, |t| t.0),
                rope.q_temp.map_or(1.0, |t| t.1),
                qn,
                kn,
                eps
            ],
        )
    }

    /// The rope's angles per pair on the device, made once per distinct table (scratch).
    pub(crate) fn theta_ptr(&self, rope: &RopeParams) -> Result<u64> {
        let th: Vec<f32> = (0..rope.n_dims / 2).map(|i| rope.theta(i)).collect();
        let key: Vec<u32> = th.iter().map(|t| t.to_bits()).collect();
        let mut s = self.scratch.lock().unwrap();
        if let Some(b) = s.thetas.get(&key) {
            return Ok(b.ptr);
        }
        if self.graphs.capturing() {
            return Err(BackendError::Device(
                "rope table made during a graph capture".into(),
            ));
        }
        let b = self.alloc(th.len().max(1) * 4, "rope table")?;
        self.dev
            .htod_sync(b.ptr, &th)
            .map_err(BackendError::Device)?;
        let p = b.ptr;
        s.thetas.insert(key, b);
        Ok(p)
    }
}
