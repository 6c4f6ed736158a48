//! Activation buffers and KV caches: allocation, the memory accounting, and copies to and
//! from the host.

use crate::dev::DevBuf;
use crate::{check, CudaBackend};
use quiver_backend::{BackendError, Result};

/// An activation buffer of f32.
pub struct CudaBuf {
    pub(crate) mem: DevBuf,
    pub(crate) len: usize,
}

impl CudaBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.mem.ptr
    }
}

/// One layer's K and V cache: `n_slots` rows of `kv_dim` f16 each.
pub struct CudaKv {
    pub(crate) k: DevBuf,
    pub(crate) v: DevBuf,
    pub(crate) kv_dim: usize,
    pub(crate) n_slots: usize,
}

/// Device memory held, by use.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemStats {
    pub weights: u64,
    pub f16_copies: u64,
    pub kv: u64,
    pub workspace: u64,
}

impl CudaBackend {
    /// A zeroed buffer of `n` f32 (`Backend::buf`).
    pub(crate) fn zeroed_buf(&self, n: usize) -> Result<CudaBuf> {
        self.dev.bind().map_err(BackendError::Device)?;
        let mem = self.alloc(n.max(1) * 4, "activations")?;
        self.dev
            .memset_zero(mem.ptr, mem.bytes)
            .map_err(BackendError::Device)?;
        self.mem.lock().unwrap().workspace += mem.bytes as u64;
        Ok(CudaBuf { mem, len: n })
    }

    /// A zeroed KV cache (`Backend::kv`).
    pub(crate) fn zeroed_kv(&self, n_slots: usize, kv_dim: usize) -> Result<CudaKv> {
        self.dev.bind().map_err(BackendError::Device)?;
        let bytes = n_slots.max(1) * kv_dim * 2;
        let k = self.alloc(bytes, "the KV cache")?;
        let v = self.alloc(bytes, "the KV cache")?;
        self.dev
            .memset_zero(k.ptr, bytes)
            .map_err(BackendError::Device)?;
        self.dev
            .memset_zero(v.ptr, bytes)
            .map_err(BackendError::Device)?;
        self.mem.lock().unwrap().kv += 2 * bytes as u64;
        Ok(CudaKv {
            k,
            v,
            kv_dim,
            n_slots,
        })
    }

    /// The first `n` values of `x` (`Backend::read`), after everything queued.
    pub(crate) fn read_buf(&self, x: &CudaBuf, n: usize, out: &mut Vec<f32>) -> Result<()> {
        check("read", n <= x.len, || format!("{n} > {}", x.len))?;
        out.resize(n, 0.0);
        self.dev.dtoh(out, x.ptr()).map_err(|e| {
            BackendError::Device(format!(
                "{e} (a kernel of this step failed; QUIVER_CUDA_SYNC=1 names it)"
            ))
        })
    }

    /// A buffer holding `data` (tests, tools).
    pub fn buf_from(&self, data: &[f32]) -> Result<CudaBuf> {
        let b = self.zeroed_buf(data.len())?;
        self.dev
            .htod_sync(b.ptr(), data)
            .map_err(BackendError::Device)?;
        Ok(b)
    }

    /// Overwrites a KV cache with f16 bit patterns (tests).
    pub fn write_kv(&self, kv: &mut CudaKv, k: &[u16], v: &[u16]) -> Result<()> {
        check(
            "write_kv",
            k.len() == kv.n_slots * kv.kv_dim && v.len() == k.len(),
            || "sizes".into(),
        )?;
        self.dev
            .htod_sync(kv.k.ptr, k)
            .map_err(BackendError::Device)?;
        self.dev
            .htod_sync(kv.v.ptr, v)
            .map_err(BackendError::Device)
    }

    /// The KV cache as f16 bit patterns (tests).
    pub fn read_kv(&self, kv: &CudaKv) -> Result<(Vec<u16>, Vec<u16>)> {
        let mut k = vec![0u16; kv.n_slots * kv.kv_dim];
        let mut v = k.clone();
        self.dev
            .dtoh(&mut k, kv.k.ptr)
            .map_err(BackendError::Device)?;
        self.dev
            .dtoh(&mut v, kv.v.ptr)
            .map_err(BackendError::Device)?;
        Ok((k, v))
    }
}
