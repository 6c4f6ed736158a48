//! Level-independent drivers: work splitting over the pool, per-type dispatch, the GEMM
//! decode-and-tile loop. Each SIMD level supplies the primitives of [`Kernel`]; the drivers
//! are `#[inline(always)]` so that a level's `#[target_feature]` entry points compile the
//! whole tree with that level's instructions.
//!
//! The paths live in submodules: [`gemv`] (decode: fused dot products), [`gemm`] (prefill:
//! panel packing, the decode-and-tile loop) and [`float`] (F32/F16/BF16 weights).

use crate::act::{self, A32Mut, PanelShape, A256, A32, TILE};
use crate::decode::*;
use crate::shared::SharedMut;
use crate::{gemm_min_tokens, grow, Numerics, Scratch, SimdLevel, ThreadPool};
use quiver_gguf::GgmlType;
use quiver_quant::{Block, QK_K};

/// Calls `$f::<T>` with the marker type of a quantized `$ty` (legacy family in `$legacy`,
/// K family in `$k`). Defined before the `mod` lines below: a `macro_rules!` macro is
/// visible only in the code after it.
macro_rules! by_type {
    ($ty:expr, legacy: $l:ident($($la:expr),*), k: $k:ident($($ka:expr),*)) => {{
        use quiver_gguf::GgmlType as G;
        match $ty {
            G::Q4_0 => $l::<K, TQ4_0>($($la),*),
            G::Q4_1 => $l::<K, TQ4_1>($($la),*),
            G::Q5_0 => $l::<K, TQ5_0>($($la),*),
            G::Q5_1 => $l::<K, TQ5_1>($($la),*),
            G::Q8_0 => $l::<K, TQ8_0>($($la),*),
            G::IQ4_NL => $l::<K, TIq4Nl>($($la),*),
            G::Q2_K => $k::<K, TQ2K>($($ka),*),
            G::Q3_K => $k::<K, TQ3K>($($ka),*),
            G::Q4_K => $k::<K, TQ4K>($($ka),*),
            G::Q5_K => $k::<K, TQ5K>($($ka),*),
            G::Q6_K => $k::<K, TQ6K>($($ka),*),
            G::IQ4_XS => $k::<K, TIq4Xs>($($ka),*),
            _ => {}
        }
    }};
}

mod float;
mod gemm;
mod gemv;

pub(crate) use float::float_rows;
pub(crate) use gemm::{gemm_rows, pack_tokens};
pub(crate) use gemv::gemv_rows;

/// Columns decoded per GEMM step (a multiple of 256). With [`TILE`] tokens the panel slice
/// of one step is 32 KiB, so it stays in L1 while every row of a group runs over it.
pub(crate) const KC: usize = 512;
/// Rows decoded per GEMM step (a row group), a multiple of every kernel's `GEMM_R`.
pub(crate) const RG: usize = 16;
/// Tokens from which a 32-element type's product takes exact tiles ([`Entry::xgemm`]) instead
/// of the decode path, where the level has them.
pub(crate) const XGEMM_MIN: usize = 16;

pub(crate) struct Job<'a> {
    pub level: SimdLevel,
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub x: &'a [f32],
    pub n_tokens: usize,
    /// The caller's setting (from its [`Scratch`]).
    pub numerics: Numerics,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Float,
    Legacy,
    K,
}

fn family(ty: GgmlType) -> Family {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 => Family::Float,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Family::K,
        _ => Family::Legacy,
    }
}

pub(crate) fn activation_kind(ty: GgmlType, _n_tokens: usize) -> u8 {
    // The K-quants' GEMM panel holds the same q8_K activations as their decode path.
    match family(ty) {
        Family::Float => 2,
        Family::Legacy => 0,
        Family::K => 1,
    }
}

/// How the activation scales of a product with weights of type `ty` are rounded (see
/// [`act::Scales`]).
fn act_scales(ty: GgmlType) -> act::Scales {
    match (family(ty), ty) {
        (Family::K, _) => act::Scales::Q8K,
        (_, GgmlType::Q4_1 | GgmlType::Q5_1) => act::Scales::Q8_1,
        _ => act::Scales::Q8_0,
    }
}

/// Sub-block size of the GEMM path for a quantized type.
fn gemm_sub(ty: GgmlType) -> usize {
    use GgmlType::*;
    match ty {
        Q2_K | Q3_K | Q6_K => 16,
        _ => 32,
    }
}

/// Rows per task, a multiple of `align`: aim at `want_tasks` tasks, but keep each task
/// between `lo_bytes` and `hi_bytes` of weights (tiny tasks cost more in scheduling than
/// they gain in balance, huge ones balance badly on a shared machine), and leave at least
/// `n_threads` tasks when the rows allow.
fn row_chunk(
    rows: usize,
    bytes_per_row: usize,
    n_threads: usize,
    want_tasks: usize,
    lo_bytes: usize,
    hi_bytes: usize,
    align: usize,
) -> usize {
    let bpr = bytes_per_row.max(1);
    let lo = (lo_bytes / bpr).max(1);
    let hi = (hi_bytes / bpr).max(lo);
    let c = rows.div_ceil(want_tasks.max(1)).clamp(lo, hi);
    let c = c.min(rows.div_ceil(n_threads.max(1))).max(1);
    c.div_ceil(align) * align
}

/// Decoded weights of a row group: [`RG`] rows and [`KC`] columns.
pub(crate) struct Dec {
    pub vals: [[u8; KC]; RG],
    pub s: [[f32; KC / 16]; RG],
    pub m: [[f32; KC / 16]; RG],
}

/// One token tile of the panel, offset to the current column chunk.
pub(crate) struct TileIn<'a> {
    /// `[cols / 4][tpad]` quant words.
    pub q: &'a [u32],
    /// `[cols / sub][tpad]`.
    pub a0: &'a [f32],
    pub a1: &'a [f32],
    pub tpad: usize,
}

/// Float accumulators of a row group and token tile: `[row][token]`.
pub(crate) type Acc = [[f32; TILE]; RG];

/// Float weight element types.
pub(crate) trait FloatW: 'static {
    /// 0 = f32, 1 = f16, 2 = bf16.
    const ID: u8;
    const BYTES: usize;
}
pub(crate) struct WF32;
pub(crate) struct WF16;
pub(crate) struct WBF16;
impl FloatW for WF32 {
    const ID: u8 = 0;
    const BYTES: usize = 4;
}
impl FloatW for WF16 {
    const ID: u8 = 1;
    const BYTES: usize = 2;
}
impl FloatW for WBF16 {
    const ID: u8 = 2;
    const BYTES: usize = 2;
}

/// The primitives a SIMD level provides.
///
/// # Safety
/// Implementations may use instructions of their level: callers must only use a kernel on
/// a CPU that supports its level, from a context compiled with its features.
pub(crate) unsafe trait Kernel {
    /// The f16 conversion of this level.
    type H: Half;
    /// The activation quantizer of this level.
    type Q: act::Quant;
    /// Rows per GEMM micro-kernel call (divides [`RG`]).
    const GEMM_R: usize;
    /// `sum_c w[c] a_t[c]` over one row of 32-element blocks, for `NT` (1..=4) tokens.
    unsafe fn dot_legacy<T: Legacy, const NT: usize>(w: &[T::B], a: &[A32<'_>; NT]) -> [f32; NT];
    /// Two rows against one token, each exactly as [`Kernel::dot_legacy`] computes it: one
    /// token's sums are one dependency chain per row (llama.cpp's order allows no second
    /// accumulator), and two rows' calls back to back in one loop body let the core overlap
    /// them (SmolLM2 matmul decode 2.47 -> 2.2 ms/token; interleaving the two rows block by
    /// block measured 3.4).
    #[inline(always)]
    unsafe fn dot_legacy_rows2<T: Legacy>(w: [&[T::B]; 2], a: &A32<'_>) -> [f32; 2] {
        // SAFETY: forwarded.
        unsafe {
            [
                Self::dot_legacy::<T, 1>(w[0], &[*a])[0],
                Self::dot_legacy::<T, 1>(w[1], &[*a])[0],
            ]
        }
    }
    /// `sum_c w[c] a_t[c]` over one row of K-quant super-blocks, for `NT` (1..=4) tokens.
    /// `form`: which llama.cpp kernel's rounding to follow ([`crate::decode::FORM_VEC`] and
    /// its siblings); only the x86 kernels read it.
    unsafe fn dot_k<T: KQuant, const NT: usize>(
        w: &[T::B],
        a: &[&[A256]; NT],
        form: u8,
    ) -> [f32; NT];
    /// Decodes one 32-element block; returns `(s, m)`.
    unsafe fn dec_legacy<T: Legacy>(b: &T::B, vals: &mut [u8]) -> (f32, f32);
    /// Decodes one super-block's values (256 bytes).
    unsafe fn dec_k<T: KQuant>(b: &T::B, vals: &mut [u8]);
    /// Adds `kc` columns of the products of rows `row0..row0 + GEMM_R` of `dec` with the
    /// tile into the same rows of `acc` (rows past the real ones have `s = m = 0`).
    unsafe fn tile<const SUB: usize, const WIDE: bool>(
        dec: &Dec,
        row0: usize,
        kc: usize,
        t: &TileIn<'_>,
        acc: &mut Acc,
    );
    /// Dot products of 4 weight rows with `NT` activation rows of `cols` elements.
    unsafe fn float_block<F: FloatW, const NT: usize>(
        w: [&[u8]; 4],
        x: [&[f32]; NT],
        cols: usize,
    ) -> [[f32; NT]; 4];
}

/// The level entry points, each compiled for its level.
pub(crate) struct Entry {
    pub quantize_a32: fn(&[f32], A32Mut<'_>),
    pub quantize_a256: fn(&[f32], &mut [A256]),
    pub pack: fn(&Job<'_>, &PanelShape, usize, usize, &PanelOut<'_>),
    pub gemv: fn(&Job<'_>, &Acts<'_>, usize, usize, &SharedMut<'_, f32>),
    pub gemm: GemmFn,
    pub float: fn(&Job<'_>, usize, usize, &SharedMut<'_, f32>),
    /// Exact tiles (products on the panel in the decode path's order), where the level has
    /// them, and the types they take.
    pub xgemm: Option<(GemmFn, TypeFilter)>,
}

/// Which weight types a path takes.
pub(crate) type TypeFilter = fn(GgmlType) -> bool;

/// A level's GEMM over one token tile and a range of rows.
pub(crate) type GemmFn = fn(&Job<'_>, &Panel<'_>, usize, usize, usize, &SharedMut<'_, f32>);

fn entry(level: SimdLevel) -> Entry {
    #[cfg(target_arch = "x86_64")]
    match level {
        SimdLevel::Avx512 => return crate::x86::entry_avx512(),
        SimdLevel::Avx2 => return crate::x86::entry_avx2(),
        SimdLevel::Portable => {}
    }
    let _ = level;
    crate::portable::entry()
}

/// The panel being written by the packing tasks.
pub(crate) struct PanelOut<'a> {
    pub q: SharedMut<'a, u32>,
    pub a0: SharedMut<'a, f32>,
    pub a1: SharedMut<'a, f32>,
}

pub(crate) enum Acts<'a> {
    A32(A32<'a>),
    A256(&'a [A256]),
}

pub(crate) struct Panel<'a> {
    pub shape: PanelShape,
    pub q: &'a [u32],
    pub a0: &'a [f32],
    pub a1: &'a [f32],
}

/// One token tile of the panel: its quants `[cols / 4][tpad]` and scales `[cols / sub][tpad]`,
/// its first token, tokens and padded tokens.
pub(crate) struct TileView<'a> {
    pub q: &'a [u32],
    pub a0: &'a [f32],
    pub a1: &'a [f32],
    pub t0: usize,
    pub nt: usize,
    pub tpad: usize,
}

impl<'a> Panel<'a> {
    /// Tile `tile`, or None where the panel is short of it.
    pub fn tile_view(&self, tile: usize) -> Option<TileView<'a>> {
        let shape = &self.shape;
        let (t0, nt, tpad) = shape.tile(tile);
        let (qo, so) = (shape.q_offset(tile), shape.s_offset(tile));
        let (q_len, s_len) = (tpad * shape.cols / 4, tpad * shape.cols / shape.sub);
        Some(TileView {
            q: self.q.get(qo..qo + q_len)?,
            a0: self.a0.get(so..so + s_len)?,
            a1: self.a1.get(so..so + s_len)?,
            t0,
            nt,
            tpad,
        })
    }
}

pub(crate) fn matmul(pool: &ThreadPool, job: &Job<'_>, out: &mut [f32], scratch: &mut Scratch) {
    let e = entry(job.level);
    let nth = pool.n_threads();
    let (rows, cols, n) = (job.rows, job.cols, job.n_tokens);
    let fam = family(job.ty);
    // Rows r with r % 16 == out_align start a cache line of every token's output row (when
    // rows * 4 is a multiple of 64, as in every real model).
    let out_align = out.as_ptr().align_offset(64).min(15);
    let out = SharedMut::new(out);
    if fam == Family::Float {
        // As the decode path below: few tasks (one per thread unless the matrix is big).
        let chunk = row_chunk(
            rows,
            job.row_bytes * n.min(8),
            nth,
            nth,
            1 << 20,
            2 << 20,
            4,
        );
        pool.run(rows.div_ceil(chunk), &|i| {
            (e.float)(job, i * chunk, ((i + 1) * chunk).min(rows), &out)
        });
        return;
    }
    // Below the fast GEMM's count, exact tiles where the level has them for the type: the
    // decode path's bits in a half to a fifth of its time (x86/xgemm.rs). The K-quants' only
    // in the batch-invariant numerics (the fast one rounds them as llama.cpp's batch kernels).
    let gemm_min = gemm_min_tokens(job.ty, job.numerics);
    let exact = e
        .xgemm
        .filter(|&(_, takes)| {
            takes(job.ty)
                && (fam == Family::Legacy || job.numerics.is_batch_invariant())
                && (XGEMM_MIN..gemm_min).contains(&n)
        })
        .map(|(f, _)| f);
    if n < gemm_min && exact.is_none() {
        let acts = if fam == Family::Legacy {
            let nb = n * cols / 32;
            grow(&mut scratch.a32_q, nb * 32);
            grow(&mut scratch.a32_ds, 2 * nb);
            let (q, ds) = (&mut scratch.a32_q[..nb * 32], &mut scratch.a32_ds[..2 * nb]);
            (e.quantize_a32)(
                job.x,
                A32Mut {
                    q,
                    ds,
                    scales: act_scales(job.ty),
                },
            );
            Acts::A32(A32 {
                q: &scratch.a32_q[..nb * 32],
                ds: &scratch.a32_ds[..2 * nb],
            })
        } else {
            grow(&mut scratch.a256, n * cols / QK_K);
            let a = &mut scratch.a256[..n * cols / QK_K];
            (e.quantize_a256)(job.x, a);
            Acts::A256(a)
        };
        // One task per thread for the layer matrices (every claim of a task moves a cache
        // line between cores, which is slow on the dev VMs: 4+ tasks per thread cost up to a
        // third of decode speed), more only for big ones (output heads) to keep the balance.
        let chunk = row_chunk(rows, job.row_bytes * n, nth, nth, 1 << 20, 2 << 20, 4);
        pool.run(rows.div_ceil(chunk), &|i| {
            (e.gemv)(job, &acts, i * chunk, ((i + 1) * chunk).min(rows), &out)
        });
        return;
    }
    // Prefill: quantize into the panel (parallel over tokens), then tiles x row chunks.
    let shape = PanelShape {
        cols,
        sub: gemm_sub(job.ty),
        n_tokens: n,
    };
    // Each buffer starts on a cache line, and each packing task owns whole groups of 16
    // tokens, so the 16 lanes of a line are written by one task only (no line ping-pongs
    // between cores while packing).
    grow(&mut scratch.panel_q, shape.q_len() + 16);
    grow(&mut scratch.panel_a0, shape.s_len() + 16);
    grow(&mut scratch.panel_a1, shape.s_len() + 16);
    let oq = scratch.panel_q.as_ptr().align_offset(64).min(16);
    let o0 = scratch.panel_a0.as_ptr().align_offset(64).min(16);
    let o1 = scratch.panel_a1.as_ptr().align_offset(64).min(16);
    {
        let po = PanelOut {
            q: SharedMut::new(&mut scratch.panel_q[oq..]),
            a0: SharedMut::new(&mut scratch.panel_a0[o0..]),
            a1: SharedMut::new(&mut scratch.panel_a1[o1..]),
        };
        let per_task = act::LANES;
        pool.run(n.div_ceil(per_task), &|i| {
            (e.pack)(job, &shape, i * per_task, ((i + 1) * per_task).min(n), &po)
        });
    }
    let panel = Panel {
        shape,
        q: &scratch.panel_q[oq..],
        a0: &scratch.panel_a0[o0..],
        a1: &scratch.panel_a1[o1..],
    };
    let n_tiles = shape.n_tiles();
    // A GEMM row costs ~64x a decode-path row, so the byte bounds are smaller.
    // About 2 tasks per thread (measured best on the whole-model sweep of bench_matmul).
    let want = (2 * nth).div_ceil(n_tiles);
    let chunk = row_chunk(
        rows,
        job.row_bytes,
        nth.div_ceil(n_tiles),
        want,
        16 << 10,
        256 << 10,
        RG,
    );
    // Shift the chunk boundaries onto cache-line starts of the output, so that no line of
    // the output is written by two tasks (which may run on different cores).
    let shift = (RG - out_align % RG) % RG;
    let n_chunks = (rows + shift).div_ceil(chunk);
    pool.run(n_tiles * n_chunks, &|i| {
        let (tile, c) = (i / n_chunks, i % n_chunks);
        let (r0, r1) = (
            (c * chunk).saturating_sub(shift),
            ((c + 1) * chunk - shift).min(rows),
        );
        if r0 < r1 {
            exact.unwrap_or(e.gemm)(job, &panel, tile, r0, r1, &out)
        }
    });
}

/// The row data of a block slice (for element loaders).
#[allow(dead_code)]
pub(crate) fn block_bytes<B: Block>(b: &B) -> &[u8] {
    quiver_quant::blocks_as_bytes(std::slice::from_ref(b))
}
