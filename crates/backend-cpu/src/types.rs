//! The CPU's weights and K/V caches.

use quiver_backend::{BackendError, Result};
use quiver_gguf::GgmlType;

pub struct CpuWeight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub(crate) bytes: crate::resident::Bytes,
    /// Vectors (norm weights) as f32, converted once at load: they are tiny.
    pub(crate) vector: Option<Vec<f32>>,
}

impl CpuWeight {
    pub fn bytes(&self) -> &[u8] {
        self.bytes.bytes()
    }

    pub(crate) fn vector(&self, op: &'static str) -> Result<&[f32]> {
        self.vector.as_deref().ok_or_else(|| BackendError::Shape {
            op,
            detail: format!(
                "expected a vector weight, got [{}, {}]",
                self.rows, self.cols
            ),
        })
    }
}

/// One layer's K and V: `n_slots` rows of `kv_dim` values. An f16 cache (both types f16, the
/// default) is held in `k` and `v` for llama.cpp's attention; any other pair of types as
/// records of [`quiver_backend::kvcodec`] in `kb` and `vb` (an f16 side as well).
pub struct CpuKv {
    pub k: Vec<half::f16>,
    pub v: Vec<half::f16>,
    pub kb: Vec<u8>,
    pub vb: Vec<u8>,
    pub types: quiver_backend::KvTypes,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub kv_dim: usize,
    pub n_slots: usize,
}

impl CpuKv {
    /// Layer `layer`'s K and V of the cache `spec` describes, zeroed.
    pub(crate) fn new(spec: &quiver_backend::KvSpec, layer: usize) -> Result<CpuKv> {
        let l = spec.layers[layer];
        spec.check()
            .map_err(|detail| BackendError::Shape { op: "kv", detail })?;
        let n_slots = spec.n_slots;
        let types = quiver_backend::KvTypes {
            k: spec.k,
            v: spec.v,
        };
        let mut kv = CpuKv {
            k: Vec::new(),
            v: Vec::new(),
            kb: Vec::new(),
            vb: Vec::new(),
            types,
            n_head_kv: l.n_head_kv,
            head_dim: l.head_dim,
            kv_dim: l.dim(),
            n_slots,
        };
        if kv.packed() {
            let bytes = |t: quiver_backend::KvType| {
                vec![0u8; n_slots * t.row_bytes(l.n_head_kv, l.head_dim) as usize]
            };
            kv.kb = bytes(spec.k);
            kv.vb = bytes(spec.v);
        } else {
            kv.k = vec![half::f16::ZERO; n_slots * l.dim()];
            kv.v = vec![half::f16::ZERO; n_slots * l.dim()];
        }
        Ok(kv)
    }

    /// Whether the cache is held as records (not the f16 vectors).
    pub(crate) fn packed(&self) -> bool {
        self.types != quiver_backend::KvTypes::default()
    }
}

/// The extra ops' buffers, grown to the largest step seen and kept (`CpuBackend::extra`).
#[derive(Default)]
pub(crate) struct ExtraScratch {
    pub(crate) dn: crate::delta_net::Scratch,
    pub(crate) ds: crate::dsv4::Scratch,
}
