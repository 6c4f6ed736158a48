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

/// One layer's K and V cache: `n_slots` rows of `kv_dim` values each, as f16 or as the head
/// records of `types` (kernels/kvq.cu).
pub struct CudaKv {
    pub(crate) k: DevBuf,
    pub(crate) v: DevBuf,
    pub(crate) types: quiver_backend::KvTypes,
    /// The kvq module of the types (kernels/kvq.cu), and the TurboQuant tables' address.
    pub(crate) module: String,
    pub(crate) tq: u64,
    pub(crate) kv_dim: usize,
    pub(crate) n_slots: usize,
}

impl CudaKv {
    /// Whether the cache holds records (kernels/kvq.cu) rather than f16.
    pub(crate) fn packed(&self) -> bool {
        self.types != quiver_backend::KvTypes::default()
    }
}

/// Device memory held, by use.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemStats {
    pub weights: u64,
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
    pub(crate) fn zeroed_kv(
        &self,
        n_slots: usize,
        layer: quiver_backend::KvLayer,
        types: quiver_backend::KvTypes,
    ) -> Result<CudaKv> {
        self.dev.bind().map_err(BackendError::Device)?;
        let zeroed = |t: quiver_backend::KvType| -> Result<DevBuf> {
            let bytes = n_slots.max(1) * t.row_bytes(layer.n_head_kv, layer.head_dim) as usize;
            let b = self.alloc(bytes, "the KV cache")?;
            self.dev
                .memset_zero(b.ptr, bytes)
                .map_err(BackendError::Device)?;
            self.mem.lock().unwrap().kv += bytes as u64;
            Ok(b)
        };
        Ok(CudaKv {
            k: zeroed(types.k)?,
            v: zeroed(types.v)?,
            types,
            module: crate::kvq::module(types.k, types.v),
            tq: self.tq_tables()?,
            kv_dim: layer.dim(),
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

    /// Overwrites the first `data.len()` values of `x`.
    pub(crate) fn write_buf(&self, x: &mut CudaBuf, data: &[f32]) -> Result<()> {
        check("write", data.len() <= x.len, || {
            format!("{} values into {}", data.len(), x.len)
        })?;
        // Ordered on the stream after the ops before it (pageable memory: staged at once).
        self.dev
            .htod_async(x.ptr(), data)
            .map_err(BackendError::Device)
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
            !kv.packed() && k.len() == kv.n_slots * kv.kv_dim && v.len() == k.len(),
            || "sizes (an f16 cache)".into(),
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
        check("read_kv", !kv.packed(), || "an f16 cache".into())?;
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

    /// The whole cache as bytes, K and V (any element types: f16 values or head records).
    pub fn read_kv_bytes(&self, kv: &CudaKv) -> Result<(Vec<u8>, Vec<u8>)> {
        let bytes = |b: &crate::dev::DevBuf| -> Result<Vec<u8>> {
            let mut out = vec![0u8; b.bytes];
            self.dev
                .dtoh(&mut out, b.ptr)
                .map_err(BackendError::Device)?;
            Ok(out)
        };
        Ok((bytes(&kv.k)?, bytes(&kv.v)?))
    }
}
