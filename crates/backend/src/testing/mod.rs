//! The op-parity test body every backend runs: one table of op cases ([`cases`]) checked
//! against the scalar reference ([`crate::reference`]) over the paged batches of [`batches`],
//! generic over [`Backend`]. The CPU backend runs it always (crates/backend-cpu/tests/ops.rs),
//! the CUDA backend where a GPU exists (crates/backend-cuda/tests/gpu_ops.rs, `#[ignore]`d
//! elsewhere).
//!
//! Inputs are fresh random numbers every run ([`seeded_rng`] prints the seed;
//! `QUIVER_TEST_SEED` replays it) and every output is poisoned with NaN before its op, so an
//! element an op leaves unwritten fails. What differs between backends is given by a
//! [`Harness`]: how host data gets into its buffers and caches, how its products see their
//! activations (the int8 blocks of the quantized products) and the error each op may make.
//! A weight type a backend refuses is skipped with a note (the body's [`Notes`]).

pub mod attention;
pub mod batches;
pub mod cases;
pub mod delta_net;
pub mod dsv4;
pub mod elementwise;
pub mod kv_types;
pub mod moe;
pub mod products;

pub use batches::{two_sequence_batch, TestBatch};

use crate::{Backend, KvSpec, KvType, WeightBytes, KV_BLOCK_SIZE};
use quiver_gguf::{GgmlType, GgufFile, GgufWriter};
use std::sync::Arc;

/// An f16 cache of one layer: `n_slots` positions of `n_head_kv` heads of `head_dim`.
pub fn kv_spec(n_slots: usize, n_head_kv: usize, head_dim: usize) -> KvSpec {
    KvSpec {
        k: KvType::F16,
        v: KvType::F16,
        block_size: KV_BLOCK_SIZE,
        n_slots,
        layers: vec![crate::KvLayer {
            n_head_kv,
            head_dim,
        }],
    }
}

/// xorshift64 floats in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    /// `n` values in [-scale, scale).
    pub fn scaled(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    /// An integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.f();
        (self.0 >> 11) as usize % n
    }
}

/// The seed of a test's random inputs: `QUIVER_TEST_SEED` where set (to replay a failure),
/// else the clock. Printed, so that a failing run can be replayed.
pub fn seed() -> u64 {
    let s = std::env::var("QUIVER_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64)
        });
    // xorshift never leaves 0.
    let s = if s == 0 { 1 } else { s };
    eprintln!("seed {s} (QUIVER_TEST_SEED={s} replays it)");
    s
}

/// A generator seeded by [`seed`].
pub fn seeded_rng() -> Rng {
    Rng(seed())
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// An error within its bound: below it, or exactly 0 where the bound is 0 (the same values).
/// NaN (an unwritten, poisoned element) never is.
pub fn within(e: f64, bound: f64) -> bool {
    if bound == 0.0 {
        e == 0.0
    } else {
        e < bound
    }
}

/// How many values of `a` and `b` are not the same bits.
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// A one-tensor GGUF file in memory holding `bytes` as a tensor of `ty` and `shape`.
pub fn tensor(ty: GgmlType, shape: &[u64], bytes: &[u8]) -> WeightBytes {
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, shape);
    let f = GgufFile::from_bytes(w.to_bytes(&[bytes]).expect("a GGUF in memory"))
        .expect("the GGUF just written");
    WeightBytes::whole(Arc::new(f), 0)
}

/// The error bounds of the ops whose bound does not depend on the weight type (products:
/// [`Harness::product_bound`]): relative L2 errors against the reference, 0 meaning the same
/// values.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// `rms_norm`, `rms_norm_inplace` and the output of `add_rms_norm`.
    pub norm: f64,
    /// `add_rms_norm`'s updated residual and `add`.
    pub add: f64,
    /// q after `rope_kv_write`.
    pub rope_q: f64,
    /// K and V as written to the (f16) cache.
    pub kv_write: f64,
    /// `attention`.
    pub attention: f64,
    /// `glu`.
    pub glu: f64,
    /// `softcap`.
    pub softcap: f64,
    /// `embed`.
    pub embed: f64,
}

/// What the body needs of a backend besides the [`Backend`] trait: host data into its buffers
/// and K/V caches and back, and its numerical model — how its products see their activations
/// and the error each op may make. (The trait has no op that fills a buffer or a cache from
/// the host; the CPU's harness copies into its vectors, the CUDA one calls the backend's own
/// `buf_from`, `write_kv` and `read_kv`.)
pub trait Harness<B: Backend> {
    /// A buffer holding `data`.
    fn upload(&self, be: &B, data: &[f32]) -> B::Buf;
    /// Overwrites the whole cache (`n_slots × kv_dim` values each of K and V).
    fn write_kv(&self, be: &B, kv: &mut B::Kv, k: &[half::f16], v: &[half::f16]);
    /// The whole cache, K and V.
    fn read_kv(&self, be: &B, kv: &B::Kv) -> (Vec<half::f16>, Vec<half::f16>);

    /// The bounds of the ops other than products.
    fn bounds(&self, be: &B) -> Bounds;
    /// `x` (`n` rows) as a product with `ty` weights sees it (quantized to int8 blocks and
    /// back, for the backends and types that quantize activations).
    fn as_seen(&self, be: &B, ty: GgmlType, n: usize, x: &[f32]) -> Vec<f32> {
        let _ = (be, ty, n);
        x.to_vec()
    }
    /// What a reference over [`as_seen`](Self::as_seen) activations misses of a product of
    /// `w` with the `n` rows of `x` (the f16 offset sums of Q4_1/Q5_1 on int8 activations),
    /// `[n, w.rows]`; added to the reference.
    fn offsets(&self, be: &B, w: &WeightCase, n: usize, x: &[f32]) -> Vec<f32> {
        let _ = (be, x);
        vec![0.0; n * w.rows]
    }
    /// The relative error a product of `ty` weights of `cols` columns over `n` tokens may make
    /// against the reference over `as_seen` activations (plus `offsets`).
    fn product_bound(&self, be: &B, ty: GgmlType, cols: usize, n: usize) -> f64;
    /// The relative error the MoE op may have over `n` tokens of experts of `ty`, against the
    /// f32 reference (activations rounded to the int8 grid where the backend does so).
    /// The gated delta net's and `sigmoid_mul`'s relative error (the CPU runs the reference).
    fn delta_net_bound(&self, be: &B) -> f64 {
        let _ = be;
        1e-5
    }
    /// DeepSeek-V4's attention's relative error against the reference (which rounds q and the
    /// running p·v sum to f16 as llama.cpp's CPU form does).
    fn dsv4_attention_bound(&self, be: &B) -> f64 {
        self.delta_net_bound(be)
    }
    fn moe_bound(&self, be: &B, ty: GgmlType, n: usize) -> f64 {
        let _ = (be, n);
        if ty == GgmlType::F32 {
            1e-4
        } else {
            3e-2
        }
    }
    /// Products whose activations must measurably be what `as_seen` says rather than plain x
    /// (a rounding that is there, not merely allowed for by the bound): the body then also
    /// checks that the error against plain x is several times larger.
    fn activations_rounded(&self, be: &B, ty: GgmlType, cols: usize, n: usize) -> bool {
        let _ = (be, ty, cols, n);
        false
    }
}

/// A weight of the product table: its type, shape, GGUF bytes and dequantized values.
pub struct WeightCase {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
    /// Dequantized, `[rows, cols]`.
    pub values: Vec<f32>,
}

impl WeightCase {
    /// Random values in [-1, 1) quantized to `ty`; None where `ty` has no quantizer.
    pub fn random(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Option<WeightCase> {
        let f = rng.vec(rows * cols);
        let mut bytes = Vec::new();
        quiver_quant::quantize(ty, &f, &mut bytes).ok()?;
        let mut values = vec![0f32; rows * cols];
        quiver_quant::dequantize(ty, &bytes, &mut values).ok()?;
        Some(WeightCase {
            ty,
            rows,
            cols,
            bytes,
            values,
        })
    }

    /// The weight on `be`; `Err` where the backend refuses it (a note says why).
    pub fn load<B: Backend>(&self, be: &B) -> crate::Result<B::Weight> {
        let shape = [self.rows as u64, self.cols as u64];
        be.weight("w", self.ty, &shape, tensor(self.ty, &shape, &self.bytes))
    }
}

/// An f32 vector weight (norm weights).
pub fn vector<B: Backend>(be: &B, v: &[f32]) -> B::Weight {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let shape = [v.len() as u64];
    be.weight(
        "w",
        GgmlType::F32,
        &shape,
        tensor(GgmlType::F32, &shape, &bytes),
    )
    .expect("an f32 vector weight")
}

/// A buffer of `n` NaN: an element the op leaves unwritten fails its check.
pub fn poison<B: Backend, H: Harness<B>>(be: &B, h: &H, n: usize) -> B::Buf {
    h.upload(be, &vec![f32::NAN; n])
}

/// The first `n` values of `x`.
pub fn read<B: Backend>(be: &B, x: &B::Buf, n: usize) -> Vec<f32> {
    let mut v = Vec::new();
    be.read(x, n, &mut v).expect("reading a buffer back");
    v
}

/// What a body checked and what it skipped (a backend refusing a weight type), printed by
/// [`Notes::print`] with the largest error of each op relative to its bound (how much room the
/// bounds leave).
#[derive(Debug, Default)]
pub struct Notes {
    /// Checks made.
    pub checked: usize,
    /// One line per skipped case.
    pub skipped: Vec<String>,
    /// Per op, the largest error / bound seen.
    pub worst: Vec<(&'static str, f64)>,
}

impl Notes {
    pub fn skip(&mut self, why: String) {
        eprintln!("skipped: {why}");
        self.skipped.push(why);
    }

    /// Asserts that `op`'s error `e` is within `bound` ([`within`]); `case` names the case in
    /// the failure.
    pub fn check(&mut self, op: &'static str, e: f64, bound: f64, case: impl FnOnce() -> String) {
        assert!(
            within(e, bound),
            "{op}, {}: relative error {e:e} (bound {bound:e})",
            case()
        );
        let r = if bound == 0.0 { 0.0 } else { e / bound };
        match self.worst.iter_mut().find(|w| w.0 == op) {
            Some(w) => w.1 = w.1.max(r),
            None => self.worst.push((op, r)),
        }
        self.checked += 1;
    }

    /// A summary line on stderr.
    pub fn print(&self, what: &str) {
        let worst: Vec<String> = self
            .worst
            .iter()
            .map(|(op, r)| format!("{op} {r:.2}"))
            .collect();
        eprintln!(
            "{what}: {} checks, {} skipped; largest error / bound: {}",
            self.checked,
            self.skipped.len(),
            worst.join(", ")
        );
    }
}
