//! Level-independent drivers: work splitting over the pool, per-type dispatch, the GEMM
//! decode-and-tile loop. Each SIMD level supplies the primitives of [`Kernel`]; the drivers
//! are `#[inline(always)]` so that a level's `#[target_feature]` entry points compile the
//! whole tree with that level's instructions.

use crate::act::{self, A32Mut, PanelShape, A256, A32, TILE};
use crate::decode::*;
use crate::shared::SharedMut;
use crate::{gemm_min_tokens, grow, Scratch, SimdLevel, ThreadPool};
use quiver_gguf::GgmlType;
use quiver_quant::{as_blocks, Block, QK_K};

/// Columns decoded per GEMM step (a multiple of 256). With [`TILE`] tokens the panel slice
/// of one step is 32 KiB, so it stays in L1 while every row of a group runs over it.
pub(crate) const KC: usize = 512;
/// Rows decoded per GEMM step (a row group), a multiple of every kernel's `GEMM_R`.
pub(crate) const RG: usize = 16;

pub(crate) struct Job<'a> {
    pub level: SimdLevel,
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub x: &'a [f32],
    pub n_tokens: usize,
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
    pub gemm: fn(&Job<'_>, &Panel<'_>, usize, usize, usize, &SharedMut<'_, f32>),
    pub float: fn(&Job<'_>, usize, usize, &SharedMut<'_, f32>),
}

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

/// Packs tokens `t0..t1` into the panel.
///
/// # Safety
/// `K`'s level is supported by the CPU; no other task packs these tokens concurrently.
#[inline(always)]
pub(crate) unsafe fn pack_tokens<K: Kernel>(
    job: &Job<'_>,
    shape: &PanelShape,
    t0: usize,
    t1: usize,
    po: &PanelOut<'_>,
) {
    let cols = shape.cols;
    for t in t0..t1.min(job.x.len() / cols.max(1)) {
        let tile = t / TILE;
        let (_, _, tpad) = shape.tile(tile);
        let (qo, so) = (shape.q_offset(tile), shape.s_offset(tile));
        let x = &job.x[t * cols..(t + 1) * cols];
        // SAFETY (level): forwarded from the caller. SAFETY (writes): token `t` owns lane
        // `t % TILE` of its tile, and only this task packs token `t`.
        unsafe {
            act::pack_panel_token::<K::Q>(
                x,
                shape.sub,
                act_scales(job.ty),
                tpad,
                t % TILE,
                |k, w| po.q.write(qo + k, w),
                |k, s0, s1| {
                    po.a0.write(so + k, s0);
                    po.a1.write(so + k, s1);
                },
            )
        };
    }
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
    if n < gemm_min_tokens(job.ty) {
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
            (e.gemm)(job, &panel, tile, r0, r1, &out)
        }
    });
}

/// Calls `$f::<T>` with the marker type of a quantized `$ty` (legacy family in `$legacy`,
/// K family in `$k`).
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

/// Rows `r0..r1` of a decode-path matmul.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn gemv_rows<K: Kernel>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    by_type!(job.ty, legacy: gemv_legacy(job, acts, r0, r1, out), k: gemv_k(job, acts, r0, r1, out));
}

#[inline(always)]
unsafe fn gemv_legacy<K: Kernel, T: Legacy>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (Some(w), Acts::A32(a)) = (as_blocks::<T::B>(job.w), acts) else {
        return;
    };
    let nb = job.cols / 32;
    let n = job.n_tokens;
    if a.len() < n * nb || w.len() < r1 * nb {
        return;
    }
    // No closures around kernel calls here: a closure is its own function, compiled without
    // the entry point's target features unless LLVM happens to inline it.
    let mut r = r0;
    if n == 1 {
        let a0 = a.blocks(0, nb);
        while r + 2 <= r1 {
            let rows = [&w[r * nb..(r + 1) * nb], &w[(r + 1) * nb..(r + 2) * nb]];
            // SAFETY: the caller guarantees the level; the calling task owns rows r0..r1.
            unsafe {
                let v = K::dot_legacy_rows2::<T>(rows, &a0);
                out.write(r, v[0]);
                out.write(r + 1, v[1]);
            }
            r += 2;
        }
    }
    for r in r..r1 {
        let w = &w[r * nb..(r + 1) * nb];
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            let tok = |j: usize| a.blocks((t + j) * nb, (t + j + 1) * nb);
            // SAFETY: the caller guarantees the level.
            let v = unsafe {
                match nt {
                    4 => pad(K::dot_legacy::<T, 4>(w, &[tok(0), tok(1), tok(2), tok(3)])),
                    3 => pad(K::dot_legacy::<T, 3>(w, &[tok(0), tok(1), tok(2)])),
                    2 => pad(K::dot_legacy::<T, 2>(w, &[tok(0), tok(1)])),
                    _ => pad(K::dot_legacy::<T, 1>(w, &[tok(0)])),
                }
            };
            put_group(out, &v, t, nt, job.rows, r);
            t += nt;
        }
    }
}

#[inline(always)]
unsafe fn gemv_k<K: Kernel, T: KQuant>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (Some(w), Acts::A256(a)) = (as_blocks::<T::B>(job.w), acts) else {
        return;
    };
    let nb = job.cols / QK_K;
    let n = job.n_tokens;
    if a.len() < n * nb || w.len() < r1 * nb {
        return;
    }
    // Single-sequence commands (not batch invariant) round as the llama.cpp kernel the same
    // batch takes: its tiled kernel from 8 tokens for the types it covers, its repacked Q4_K
    // GEMM for each whole group of four tokens (the rest through its GEMV); batch-invariant
    // runs take the one-token form throughout.
    use crate::decode::{FORM_GEMM4, FORM_TILED, FORM_VEC, GGML_Q4K};
    let mirror = !crate::batch_invariant();
    let form = |nt: usize| {
        if mirror && T::TILED && n >= 8 {
            FORM_TILED
        } else if mirror && nt == 4 && T::GGML == GGML_Q4K {
            FORM_GEMM4
        } else {
            FORM_VEC
        }
    };
    for r in r0..r1 {
        let w = &w[r * nb..(r + 1) * nb];
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            let tok = |j: usize| &a[(t + j) * nb..(t + j + 1) * nb];
            // SAFETY: the caller guarantees the level.
            let v = unsafe {
                match nt {
                    4 => pad(K::dot_k::<T, 4>(
                        w,
                        &[tok(0), tok(1), tok(2), tok(3)],
                        form(4),
                    )),
                    3 => pad(K::dot_k::<T, 3>(w, &[tok(0), tok(1), tok(2)], form(3))),
                    2 => pad(K::dot_k::<T, 2>(w, &[tok(0), tok(1)], form(2))),
                    _ => pad(K::dot_k::<T, 1>(w, &[tok(0)], form(1))),
                }
            };
            put_group(out, &v, t, nt, job.rows, r);
            t += nt;
        }
    }
}

/// Stores `out[t + j, r] = v[j]` for `j < nt`.
#[inline(always)]
fn put_group(out: &SharedMut<'_, f32>, v: &[f32; 4], t: usize, nt: usize, rows: usize, r: usize) {
    for (j, &v) in v.iter().enumerate().take(nt) {
        // SAFETY: the calling task owns row r (for every token).
        unsafe { out.write((t + j) * rows + r, v) };
    }
}

/// Up to 4 results as a 4-array.
#[inline(always)]
fn pad<const N: usize>(v: [f32; N]) -> [f32; 4] {
    let mut o = [0f32; 4];
    for (o, v) in o.iter_mut().zip(v) {
        *o = v;
    }
    o
}

/// Rows `r0..r1` of token tile `tile` of a prefill-path matmul.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn gemm_rows<K: Kernel>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    by_type!(job.ty, legacy: gemm_legacy(job, p, tile, r0, r1, out), k: gemm_k(job, p, tile, r0, r1, out));
}

/// Dispatches the micro-kernel on the sub-block size and wideness.
#[inline(always)]
unsafe fn tile_call<K: Kernel>(
    sub: usize,
    wide: bool,
    dec: &Dec,
    row0: usize,
    kc: usize,
    t: &TileIn<'_>,
    acc: &mut Acc,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (sub, wide) {
            (16, false) => K::tile::<16, false>(dec, row0, kc, t, acc),
            (16, true) => K::tile::<16, true>(dec, row0, kc, t, acc),
            (_, false) => K::tile::<32, false>(dec, row0, kc, t, acc),
            (_, true) => K::tile::<32, true>(dec, row0, kc, t, acc),
        }
    }
}

/// The shared GEMM loop: for each block of `GEMM_R` rows, decode `KC` columns at a time
/// with `decode(row, first block, blocks, dec row index, dec)` and run the micro-kernel.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_loop<K: Kernel>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
    qk: usize,
    sub: usize,
    wide: bool,
    decoder: &impl RowDecoder<K>,
) {
    let shape = &p.shape;
    let (t0, nt, tpad) = shape.tile(tile);
    let (qo, so) = (shape.q_offset(tile), shape.s_offset(tile));
    let cols = job.cols;
    let (q_len, s_len) = (tpad * cols / 4, tpad * cols / sub);
    if p.q.len() < qo + q_len || p.a0.len() < so + s_len || p.a1.len() < so + s_len {
        return;
    }
    let (q, a0, a1) = (
        &p.q[qo..qo + q_len],
        &p.a0[so..so + s_len],
        &p.a1[so..so + s_len],
    );
    let mut dec = Dec {
        vals: [[0; KC]; RG],
        s: [[0.0; KC / 16]; RG],
        m: [[0.0; KC / 16]; RG],
    };
    let mut acc: Acc = [[0.0; TILE]; RG];
    // Results per token as contiguous runs of rows (one store run per token and group
    // instead of one scattered store per row and token).
    let mut obuf = [[0f32; RG]; TILE];
    let bpc = KC / qk;
    let nb = cols / qk;
    let mut g0 = r0;
    while g0 < r1 {
        let nrg = RG.min(r1 - g0);
        // Row pairs (or whatever GEMM_R is) covering the group; rows past nrg are padding.
        let nr_pad = nrg.div_ceil(K::GEMM_R) * K::GEMM_R;
        for a in acc.iter_mut().take(nr_pad) {
            a.fill(0.0);
        }
        let mut b0 = 0;
        while b0 < nb {
            let nbc = bpc.min(nb - b0);
            for i in 0..nr_pad {
                if i < nrg {
                    // SAFETY: forwarded from the caller.
                    unsafe { decoder.decode(g0 + i, b0, nbc, i, &mut dec) };
                } else {
                    dec.s[i].fill(0.0);
                    dec.m[i].fill(0.0);
                }
            }
            let (c0, kc) = (b0 * qk, nbc * qk);
            let t = TileIn {
                q: &q[c0 / 4 * tpad..],
                a0: &a0[c0 / sub * tpad..],
                a1: &a1[c0 / sub * tpad..],
                tpad,
            };
            let mut row0 = 0;
            while row0 < nr_pad {
                // SAFETY: forwarded from the caller.
                unsafe { tile_call::<K>(sub, wide, &dec, row0, kc, &t, &mut acc) };
                row0 += K::GEMM_R;
            }
            b0 += nbc;
        }
        for (i, a) in acc.iter().enumerate().take(nrg) {
            for (o, &v) in obuf.iter_mut().zip(a.iter()).take(nt) {
                o[i] = v;
            }
        }
        for (lt, o) in obuf.iter().enumerate().take(nt) {
            // SAFETY: this task owns rows r0..r1 of this tile's tokens.
            unsafe { out.write_slice((t0 + lt) * job.rows + g0, &o[..nrg]) };
        }
        g0 += nrg;
    }
}

/// Decodes blocks `b0..b0 + nbc` of weight row `r` into row `i` of a [`Dec`]. A trait
/// rather than a closure: closures are separate functions that would be compiled without
/// the entry point's target features unless inlined.
pub(crate) trait RowDecoder<K: Kernel> {
    /// # Safety
    /// `K`'s level is supported by the CPU.
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec);
}

struct LegacyRows<'a, T: Legacy> {
    w: &'a [T::B],
    nb: usize,
}

impl<K: Kernel, T: Legacy> RowDecoder<K> for LegacyRows<'_, T> {
    #[inline(always)]
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec) {
        let start = r * self.nb + b0;
        let Some(blocks) = self.w.get(start..start + nbc) else {
            return;
        };
        for (j, b) in blocks.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            let (s, m) = unsafe { K::dec_legacy::<T>(b, &mut dec.vals[i][32 * j..32 * j + 32]) };
            dec.s[i][j] = s;
            dec.m[i][j] = m;
        }
    }
}

struct KRows<'a, T: KQuant> {
    w: &'a [T::B],
    nb: usize,
}

impl<K: Kernel, T: KQuant> RowDecoder<K> for KRows<'_, T> {
    #[inline(always)]
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec) {
        let per = QK_K / T::SUB;
        let start = r * self.nb + b0;
        let Some(blocks) = self.w.get(start..start + nbc) else {
            return;
        };
        for (j, b) in blocks.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            unsafe { K::dec_k::<T>(b, &mut dec.vals[i][QK_K * j..QK_K * (j + 1)]) };
            let ks = T::scales::<K::H>(b);
            k_sub_scales::<T>(
                &ks,
                &mut dec.s[i][per * j..per * (j + 1)],
                &mut dec.m[i][per * j..per * (j + 1)],
            );
        }
    }
}

#[inline(always)]
unsafe fn gemm_legacy<K: Kernel, T: Legacy>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let Some(w) = as_blocks::<T::B>(job.w) else {
        return;
    };
    let d = LegacyRows::<T> {
        w,
        nb: job.cols / 32,
    };
    // SAFETY: forwarded from the caller.
    unsafe { gemm_loop::<K>(job, p, tile, r0, r1, out, 32, 32, T::WIDE, &d) };
}

#[inline(always)]
unsafe fn gemm_k<K: Kernel, T: KQuant>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let Some(w) = as_blocks::<T::B>(job.w) else {
        return;
    };
    let d = KRows::<T> {
        w,
        nb: job.cols / QK_K,
    };
    // SAFETY: forwarded from the caller.
    unsafe { gemm_loop::<K>(job, p, tile, r0, r1, out, QK_K, T::SUB, T::WIDE, &d) };
}

/// Rows `r0..r1` of a float-weight matmul, all tokens, in 4 x 4 blocks.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn float_rows<K: Kernel>(
    job: &Job<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match job.ty {
            GgmlType::F32 => float_rows_t::<K, WF32>(job, r0, r1, out),
            GgmlType::F16 => float_rows_t::<K, WF16>(job, r0, r1, out),
            GgmlType::BF16 => float_rows_t::<K, WBF16>(job, r0, r1, out),
            _ => {}
        }
    }
}

#[inline(always)]
unsafe fn float_rows_t<K: Kernel, F: FloatW>(
    job: &Job<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (cols, rb) = (job.cols, job.row_bytes);
    if job.w.len() < job.rows * rb || job.x.len() < job.n_tokens * cols {
        return;
    }
    let row = |r: usize| &job.w[r * rb..(r + 1) * rb];
    let tok = |t: usize| &job.x[t * cols..(t + 1) * cols];
    let mut r = r0;
    while r < r1 {
        let nr = 4.min(r1 - r);
        // Missing rows repeat the last one; their results are dropped.
        let w = [
            row(r),
            row(r + 1.min(nr - 1)),
            row(r + 2.min(nr - 1)),
            row(r + 3.min(nr - 1)),
        ];
        let mut t = 0;
        while t < job.n_tokens {
            let nt = 4.min(job.n_tokens - t);
            let mut put = |i: usize, j: usize, v: f32| {
                // SAFETY: this task owns rows r0..r1.
                unsafe { out.write((t + j) * job.rows + r + i, v) };
            };
            // SAFETY (all four): forwarded from the caller.
            match nt {
                4 => {
                    let v = unsafe {
                        K::float_block::<F, 4>(
                            w,
                            [tok(t), tok(t + 1), tok(t + 2), tok(t + 3)],
                            cols,
                        )
                    };
                    put_block(&v, nr, &mut put);
                }
                3 => {
                    // SAFETY: as above.
                    let v = unsafe {
                        K::float_block::<F, 3>(w, [tok(t), tok(t + 1), tok(t + 2)], cols)
                    };
                    put_block(&v, nr, &mut put);
                }
                2 => {
                    // SAFETY: as above.
                    let v = unsafe { K::float_block::<F, 2>(w, [tok(t), tok(t + 1)], cols) };
                    put_block(&v, nr, &mut put);
                }
                _ => {
                    // SAFETY: as above.
                    let v = unsafe { K::float_block::<F, 1>(w, [tok(t)], cols) };
                    put_block(&v, nr, &mut put);
                }
            }
            t += nt;
        }
        r += nr;
    }
}

/// Hands the first `nr` rows of a float block result to `put(row, token, value)`.
#[inline(always)]
fn put_block<const NT: usize>(
    v: &[[f32; NT]; 4],
    nr: usize,
    put: &mut impl FnMut(usize, usize, f32),
) {
    for (i, v) in v.iter().enumerate().take(nr) {
        for (j, &v) in v.iter().enumerate() {
            put(i, j, v);
        }
    }
}

/// The row data of a block slice (for element loaders).
#[allow(dead_code)]
pub(crate) fn block_bytes<B: Block>(b: &B) -> &[u8] {
    quiver_quant::blocks_as_bytes(std::slice::from_ref(b))
}
