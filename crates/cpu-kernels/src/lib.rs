//! quiver-cpu-kernels: the CPU hot path — matmul over quantized GGUF weights, embedding
//! gather, and the persistent [`ThreadPool`] they run on.
//!
//! [`matmul`] computes `out[t, r] = sum_c W[r, c] * x[t, c]` with `W` `[rows, cols]` in its
//! GGUF type, read in place (borrowed from the mmap; nothing is repacked in memory beyond
//! about 20 KiB of per-task stack). Activations are quantized to 8 bits (symmetric,
//! `d = max|x| / 127`) into the caller's [`Scratch`] and multiplied with integer dot
//! products:
//!
//! - **decode path** (`n_tokens` < [`gemm_min_tokens`]): fused dot products of each weight
//!   row with up to 4 tokens per pass (`gemv`); rows are split over the pool. Activations
//!   are Q8 blocks of 32 for the 32-element types and Q8_K-like blocks of 256 (with sums
//!   per 16) for the K-quants, whose sub-block scales are applied in integers as ggml does.
//! - **prefill path**: activations are quantized (per 32) once into a token-interleaved
//!   panel; each task decodes a group of 16 weight rows, 512 columns at a time, into bytes
//!   on its stack, and a register-blocked micro-kernel multiplies them with a tile of up to
//!   64 tokens, tokens across the SIMD lanes (each row's 4 weight bytes broadcast,
//!   `vpdpbusd` on AVX-512 VNNI), scaling per sub-block with vectors over tokens. Every
//!   weight row is read and decoded once per 64-token tile; tasks are (tile, rows) pairs.
//! - **exact tiles** (from 16 tokens below the GEMM's count; AVX-512: the 32-element types,
//!   and Q4_K and Q6_K in the batch-invariant numerics; AVX2: the 32-element types, and Q4_K): the
//!   prefill path's panel, but each output summed in the decode path's float order (per row
//!   and token the decode path's lane accumulators, fed block by block), so the same bits as
//!   the decode path in 0.3–0.9 of its time on prompts (`x86/xgemm.rs`, `x86/xgemm2.rs`).
//! - F32/F16/BF16 weights: float FMA over 4 rows x up to 4 tokens register blocks.
//!
//! SIMD: a portable path (plain Rust, used off x86), AVX2+FMA+F16C, and AVX-512
//! (F/BW/VL/VNNI), chosen at run time; `QUIVER_CPU_SIMD=portable|avx2|avx512` caps the level
//! ([`SimdLevel::active`]). [`matmul_with_level`] forces a level (tests, benches).
//!
//! **Numerics** are the caller's, per instance: each [`Scratch`] carries a [`Numerics`] and
//! every call through it rounds accordingly, so two callers in one process can differ.
//! [`Numerics::BatchInvariant`] (the default): every call takes the decode path (or its exact
//! tiles), so a token's
//! output row is bit-identical whatever `n_tokens`, the other tokens of the call and the
//! thread count (`tests/batch_invariance.rs`). [`Numerics::Fast`] (single-sequence callers):
//! batches of 64+ tokens take the prefill path (about 2.5-3x faster prefill) and smaller ones
//! round as llama.cpp's kernel for the same batch; not batch invariant ([`gemm_min_tokens`]).

mod act;
mod decode;
mod driver;
pub mod pool;
mod portable;
mod prefetch;
mod shared;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use pool::{default_threads, ThreadPool};
pub use quiver_gguf::GgmlType;

use std::sync::OnceLock;

/// How a caller's products may round, per instance: carried by the caller's [`Scratch`] into
/// every [`matmul`] (and by `quiver-backend-cpu`'s `CpuBackend` into its attention too), never
/// process-wide, so a process can hold a batch-invariant backend and a fast one at once.
/// [`Numerics::Parity`] rounds as [`Numerics::BatchInvariant`] here: that path is the one the
/// CUDA parity mode reproduces.
pub use quiver_backend::Numerics;

/// The smallest batch that takes the prefill (GEMM) path for weights of type `ty` under
/// `numerics`; smaller batches take the decode path (fused dot products, up to 4 tokens per
/// pass over a row).
///
/// [`Numerics::BatchInvariant`]: every batch takes the decode path (`usize::MAX`): that makes
/// [`matmul`] **batch invariant** — the output row of a token is bit-identical whatever the
/// other tokens of the call are, whatever `n_tokens` and whatever the thread count — because
/// the decode path's float operations per (row, token) do not depend on the grouping of
/// tokens (every kernel runs the same per-token operations for 1..=4 tokens; rows are split
/// over threads, never columns). The GEMM path accumulates in another order, so mixing the
/// two would make a token's output depend on the batch size.
///
/// [`Numerics::Fast`] (single-sequence callers): batches of 64 tokens and more take the GEMM
/// path. Below 64, llama.cpp's CPU attention runs query row by query row and its products
/// (vec_dot, tinyBLAS, the repacked Q4_K kernels) round as the decode path does, so short
/// prompts give llama.cpp's floats bit for bit; from 64 its tiled attention rounds otherwise
/// anyway, and the GEMM path is faster (its crossover with the decode path is 7–14 tokens by
/// type).
///
pub fn gemm_min_tokens(_ty: GgmlType, numerics: Numerics) -> usize {
    match numerics {
        Numerics::Fast => 64,
        Numerics::BatchInvariant | Numerics::Parity => usize::MAX,
    }
}

/// Errors of the kernels; every variant names the op, the type and the shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: type {ty} is not supported")]
    Unsupported { op: &'static str, ty: GgmlType },
    #[error("{op} {ty}: cols {cols} is not a multiple of the block size {block_size}")]
    BlockMultiple {
        op: &'static str,
        ty: GgmlType,
        cols: usize,
        block_size: usize,
    },
    #[error("{op} {ty}: {what} has length {got}, expected {expected} (rows {rows}, cols {cols}, n_tokens {n_tokens})")]
    Length {
        op: &'static str,
        ty: GgmlType,
        what: &'static str,
        got: usize,
        expected: usize,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    },
    #[error("{op} {ty}: row id {id} is out of range for {rows} rows (cols {cols})")]
    RowOutOfRange {
        op: &'static str,
        ty: GgmlType,
        id: u32,
        rows: usize,
        cols: usize,
    },
}

/// A SIMD instruction set level, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Plain Rust (auto-vectorised for the target's baseline).
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (on top of AVX2 + FMA + F16C).
    Avx512,
}

impl SimdLevel {
    /// All levels, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The best level this CPU supports.
    pub fn detected() -> SimdLevel {
        static D: OnceLock<SimdLevel> = OnceLock::new();
        *D.get_or_init(detect)
    }

    /// The level kernels use: [`SimdLevel::detected`] capped by `QUIVER_CPU_SIMD`
    /// (`portable`, `avx2` or `avx512`; unset, empty or unknown values leave no cap). The one
    /// place that variable is read: the CPU backend's own SIMD paths (attention, rope, GLU)
    /// follow this level too.
    pub fn active() -> SimdLevel {
        static A: OnceLock<SimdLevel> = OnceLock::new();
        *A.get_or_init(|| {
            let cap = std::env::var("QUIVER_CPU_SIMD")
                .ok()
                .and_then(|v| SimdLevel::parse(&v));
            cap.map_or(SimdLevel::detected(), |c| c.min(SimdLevel::detected()))
        })
    }

    /// Parses `portable`, `avx2` or `avx512` (case-insensitive).
    pub fn parse(s: &str) -> Option<SimdLevel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(SimdLevel::Portable),
            "avx2" => Some(SimdLevel::Avx2),
            "avx512" => Some(SimdLevel::Avx512),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
        SimdLevel::Avx512
    } else if avx2 {
        SimdLevel::Avx2
    } else {
        SimdLevel::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Portable
}

/// A caller's per-instance matmul state: its [`Numerics`], and reusable memory for quantized
/// activations (grows to the largest call and is then reused: a steady-state matmul does not
/// allocate). One per caller that owns a setting (a backend instance, a test, a bench).
#[derive(Default)]
pub struct Scratch {
    numerics: Numerics,
    a32_q: Vec<i8>,
    a32_ds: Vec<f32>,
    a256: Vec<act::A256>,
    panel_q: Vec<u32>,
    panel_a0: Vec<f32>,
    panel_a1: Vec<f32>,
}

impl Scratch {
    /// Empty, with the default numerics ([`Numerics::BatchInvariant`]).
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// Empty, with the given numerics for every call made through it.
    pub fn with_numerics(numerics: Numerics) -> Scratch {
        Scratch {
            numerics,
            ..Scratch::default()
        }
    }

    /// The numerics of every call made through this scratch.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Bytes currently held.
    pub fn capacity_bytes(&self) -> usize {
        self.a32_q.capacity()
            + 4 * self.a32_ds.capacity()
            + self.a256.capacity() * std::mem::size_of::<act::A256>()
            + 4 * (self.panel_q.capacity() + self.panel_a0.capacity() + self.panel_a1.capacity())
    }
}

/// Grows `v` to at least `n` elements (never shrinks).
fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// True for the types [`matmul`] supports.
pub fn supports(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
    )
}

/// `out[t, r] = sum_c W[r, c] * x[t, c]`.
///
/// `w`: `[rows, cols]` in type `ty` (`rows * ty.row_bytes(cols)` bytes); `x`:
/// `[n_tokens, cols]`; `out`: `[n_tokens, rows]`. Runs on `pool` at [`SimdLevel::active`],
/// rounding as `scratch`'s [`Numerics`] say.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<(), KernelError> {
    matmul_with_level(
        SimdLevel::active(),
        pool,
        ty,
        w,
        rows,
        cols,
        x,
        n_tokens,
        out,
        scratch,
    )
}

/// [`matmul`] at a given SIMD level, lowered to what the CPU supports.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_level(
    level: SimdLevel,
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    if !supports(ty) {
        return Err(KernelError::Unsupported { op: OP, ty });
    }
    let bs = ty.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(KernelError::BlockMultiple {
            op: OP,
            ty,
            cols,
            block_size: bs,
        });
    }
    let row_bytes = cols / bs * ty.type_size();
    let len_err = |what, got, expected| KernelError::Length {
        op: OP,
        ty,
        what,
        got,
        expected,
        rows,
        cols,
        n_tokens,
    };
    let checks = [
        ("w", w.len(), rows.checked_mul(row_bytes)),
        ("x", x.len(), n_tokens.checked_mul(cols)),
        ("out", out.len(), n_tokens.checked_mul(rows)),
    ];
    for (what, got, expected) in checks {
        match expected {
            Some(e) if e == got => {}
            _ => return Err(len_err(what, got, expected.unwrap_or(usize::MAX))),
        }
    }
    if rows == 0 || n_tokens == 0 {
        return Ok(());
    }
    let level = level.min(SimdLevel::detected());
    let job = driver::Job {
        level,
        ty,
        w,
        rows,
        cols,
        row_bytes,
        x,
        n_tokens,
        numerics: scratch.numerics,
    };
    driver::matmul(pool, &job, out, scratch);
    Ok(())
}

/// Which activation quantization a call uses (for tests): 0 = blocks of 32 (32-element
/// types, decode and GEMM paths), 1 = blocks of 256 (K-quants, both paths: the GEMM panel
/// shares each 256's scale), 2 = none (float weights). The same for every token count.
#[doc(hidden)]
pub fn activation_kind(ty: GgmlType, n_tokens: usize) -> u8 {
    driver::activation_kind(ty, n_tokens)
}

/// `x` quantized and dequantized as [`activation_kind`] `kind` does it (for tests).
#[doc(hidden)]
pub fn activation_roundtrip(kind: u8, x: &[f32]) -> Vec<f32> {
    match kind {
        0 | 1 => act::roundtrip(kind, x),
        _ => x.to_vec(),
    }
}

/// `x` quantized per 32 as the Q4_0 / Q8_0 products take it (ggml's q8_0, for tests): the
/// quants and each block's (d as f16, d·Σq).
#[doc(hidden)]
pub fn activation_quants_a32(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    act::quants_a32(x)
}

/// `x` quantized per 32 as the Q4_1 / Q5_1 products take it (ggml's q8_1, for tests): the
/// quants and per block (d, s), s the f16 of d·Σq.
#[doc(hidden)]
pub fn activation_quants_a32_q8_1(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    act::quants_a32_q8_1(x)
}

/// `x` quantized per 256 as the K-quant products take it (ggml's Q8_K, for tests): the
/// quants and each block's d.
#[doc(hidden)]
pub fn activation_quants_a256(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    act::quants_a256(x)
}

/// Per 32-element block of `x`: how much the offset sum of a Q4_1/Q5_1 product (ggml's q8_1
/// `s`, the f16 of `d·Σq`) differs from `d16·Σq`, the sum [`activation_roundtrip`] implies.
#[doc(hidden)]
pub fn activation_offset_correction(x: &[f32]) -> Vec<f32> {
    act::offset_correction(x)
}

/// For tests: what an exact reference (dequantized weights times [`activation_roundtrip`])
/// misses of a product of `ty` weights `w` (`rows × cols`) with `n` rows of `x`: for Q4_1 and
/// Q5_1, `Σ_b min_b · correction_b` per output (`[n, rows]`, see
/// [`activation_offset_correction`]); zeros for every other type.
#[doc(hidden)]
pub fn activation_offset_terms(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Vec<f64> {
    let mut out = vec![0f64; n * rows];
    if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
        return out;
    }
    // Both block layouts start with the f16 scale and the f16 min.
    let (nb, bsize) = (cols / 32, ty.type_size());
    for t in 0..n {
        let corr = act::offset_correction(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            out[t * rows + r] = (0..nb)
                .map(|b| {
                    let o = (r * nb + b) * bsize + 2;
                    let m = half::f16::from_le_bytes([w[o], w[o + 1]]).to_f32();
                    m as f64 * corr[b] as f64
                })
                .sum();
        }
    }
    out
}

/// Embedding gather: `out[i, :] = dequantize(W[ids[i], :])` for `W` `[rows, cols]` of type
/// `ty`; `out` is `[ids.len(), cols]`.
pub fn get_rows(
    ty: GgmlType,
    w: &[u8],
    cols: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "get_rows";
    if !quiver_quant::can_dequantize(ty) {
        return Err(KernelError::Unsupported { op: OP, ty });
    }
    let bs = ty.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(KernelError::BlockMultiple {
            op: OP,
            ty,
            cols,
            block_size: bs,
        });
    }
    let row_bytes = cols / bs * ty.type_size();
    let rows = w.len().checked_div(row_bytes).unwrap_or(0);
    let n = ids.len();
    if row_bytes == 0 || !w.len().is_multiple_of(row_bytes) {
        let expected = rows * row_bytes;
        return Err(KernelError::Length {
            op: OP,
            ty,
            what: "w",
            got: w.len(),
            expected,
            rows,
            cols,
            n_tokens: n,
        });
    }
    if out.len() != n * cols {
        return Err(KernelError::Length {
            op: OP,
            ty,
            what: "out",
            got: out.len(),
            expected: n * cols,
            rows,
            cols,
            n_tokens: n,
        });
    }
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(cols)) {
        let r = id as usize;
        if r >= rows {
            return Err(KernelError::RowOutOfRange {
                op: OP,
                ty,
                id,
                rows,
                cols,
            });
        }
        let src = &w[r * row_bytes..(r + 1) * row_bytes];
        // Lengths were checked above, so this cannot fail.
        if quiver_quant::dequantize(ty, src, o).is_err() {
            return Err(KernelError::Unsupported { op: OP, ty });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_levels_parse_and_order() {
        assert_eq!(SimdLevel::parse("portable"), Some(SimdLevel::Portable));
        assert_eq!(SimdLevel::parse(" AVX2 "), Some(SimdLevel::Avx2));
        assert_eq!(SimdLevel::parse("avx512"), Some(SimdLevel::Avx512));
        assert_eq!(SimdLevel::parse("sse"), None);
        assert!(SimdLevel::Portable < SimdLevel::Avx2 && SimdLevel::Avx2 < SimdLevel::Avx512);
        assert!(SimdLevel::active() <= SimdLevel::detected());
        for l in SimdLevel::ALL {
            assert_eq!(SimdLevel::parse(l.name()), Some(l));
        }
    }

    #[test]
    fn every_supported_type_has_a_crossover() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ] {
            for n in [Numerics::BatchInvariant, Numerics::Fast] {
                assert!(supports(ty) && gemm_min_tokens(ty, n) >= 1);
            }
        }
        assert!(!supports(GgmlType::IQ2_XXS) && !supports(GgmlType::Q8_K));
    }
}
