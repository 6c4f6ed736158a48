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
    /// tq4 keys: the exact keys of the blocks written lately (`kblock::ExactKeys`).
    pub exact: Option<quiver_backend::kblock::ExactKeys>,
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
            exact: None,
        };
        if kv.packed() {
            let bytes = |n: u64| vec![0u8; n_slots * n as usize];
            kv.kb = bytes(spec.k.key_row_bytes(l.n_head_kv, l.head_dim));
            kv.vb = bytes(spec.v.row_bytes(l.n_head_kv, l.head_dim));
            if spec.k.key_blocks() {
                let keep = quiver_backend::kblock::ExactKeys::keep_for(n_slots / spec.block_size);
                kv.exact = Some(quiver_backend::kblock::ExactKeys::new(l.dim(), keep));
            }
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

    /// Keys `k` and values `v` of the step's rows (`kv_dim` each, k after rope) at `slots`.
    pub(crate) fn write(&mut self, slots: &[u32], k: &[f32], v: &[f32]) -> Result<()> {
        use half::slice::HalfFloatSliceExt;
        if let Some(&slot) = slots.iter().find(|&&s| s as usize >= self.n_slots) {
            return Err(BackendError::Shape {
                op: "rope_kv_write",
                detail: format!("slot {slot} ≥ {}", self.n_slots),
            });
        }
        let (kd, hd, nkv) = (self.kv_dim, self.head_dim, self.n_head_kv);
        if let Some(x) = self.exact.as_mut() {
            // tq4 keys: by blocks (each touched block's record encoded again).
            x.write(slots, k, &mut self.kb, nkv, hd);
        }
        for (t, &slot) in slots.iter().enumerate() {
            let slot = slot as usize;
            let (kt, vt) = (&k[t * kd..][..kd], &v[t * kd..][..kd]);
            if !self.packed() {
                self.k[slot * kd..][..kd].convert_from_f32_slice(kt);
                self.v[slot * kd..][..kd].convert_from_f32_slice(vt);
                continue;
            }
            // (tq4 keys were written by blocks above.)
            let keys = (self.exact.is_none()).then_some((kt, self.types.k, &mut self.kb));
            for (src, ty, dst) in keys.into_iter().chain([(vt, self.types.v, &mut self.vb)]) {
                let hb = ty.head_bytes(hd);
                let row = &mut dst[slot * nkv * hb..][..nkv * hb];
                for (x, rec) in src.chunks_exact(hd).zip(row.chunks_exact_mut(hb)) {
                    quiver_backend::kvcodec::encode_head(ty, x, rec);
                }
            }
        }
        Ok(())
    }
}

/// The extra ops' buffers, grown to the largest step seen and kept (`CpuBackend::extra`).
#[derive(Default)]
pub(crate) struct ExtraScratch {
    pub(crate) dn: crate::delta_net::Scratch,
    pub(crate) ds: crate::dsv4::Scratch,
}
