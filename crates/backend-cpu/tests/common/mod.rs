//! The CPU backend's [`Harness`] for the shared op body, used by `ops` (batch invariant, the
//! default) and `ops_prefill` (the prefill paths).

use quiver_backend::testing::{Bounds, Harness, WeightCase};
use quiver_backend::Backend;
use quiver_backend_cpu::{CpuBackend, CpuConfig, CpuKv, Numerics};
use quiver_gguf::GgmlType;

/// The CPU backend's part: buffers are host vectors, the cache is two f16 vectors, and its
/// products quantize activations as ggml does (int8 blocks of 32, or 256 for the K-quants;
/// Q4_1/Q5_1 with q8_1's f16 offset sums).
pub struct Cpu;

impl Harness<CpuBackend> for Cpu {
    fn upload(&self, _: &CpuBackend, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn write_kv(&self, _: &CpuBackend, kv: &mut CpuKv, k: &[half::f16], v: &[half::f16]) {
        kv.k.copy_from_slice(k);
        kv.v.copy_from_slice(v);
    }

    fn read_kv(&self, _: &CpuBackend, kv: &CpuKv) -> (Vec<half::f16>, Vec<half::f16>) {
        (kv.k.clone(), kv.v.clone())
    }

    fn bounds(&self, _: &CpuBackend) -> Bounds {
        Bounds {
            // The reference's rounding (four rows at a time, the same sums).
            norm: 1e-6,
            add: 0.0,
            // q meets the f16 cache rounded to f16; K and V are stored as f16.
            rope_q: 1e-3,
            kv_write: 1e-3,
            // The p·v accumulator is rounded to f16 after every key (as llama.cpp does): f16
            // rounding noise, ~1e-3 relative. A wrong mask, slot or head mapping gives errors
            // of order 1.
            attention: 3e-3,
            glu: 1e-6,
            softcap: 0.0,
            // The CPU's dequantizer, scaled: the reference's values.
            embed: 0.0,
        }
    }

    fn as_seen(&self, _: &CpuBackend, ty: GgmlType, n: usize, x: &[f32]) -> Vec<f32> {
        quiver_cpu_kernels::activation_roundtrip(quiver_cpu_kernels::activation_kind(ty, n), x)
    }

    fn offsets(&self, _: &CpuBackend, w: &WeightCase, n: usize, x: &[f32]) -> Vec<f32> {
        quiver_cpu_kernels::activation_offset_terms(w.ty, &w.bytes, w.rows, w.cols, x, n)
            .iter()
            .map(|&v| v as f32)
            .collect()
    }

    fn product_bound(&self, _: &CpuBackend, _: GgmlType, _: usize, _: usize) -> f64 {
        // Integer dot products on the int8 grid, f32 sums: exact up to f32 rounding.
        1e-5
    }
}

pub fn backend(numerics: Numerics) -> CpuBackend {
    let be = CpuBackend::with_config(CpuConfig {
        threads: 2,
        numerics,
    });
    eprintln!(
        "{} backend, {} threads, numerics {}",
        be.name(),
        be.threads(),
        be.numerics().name()
    );
    be
}
