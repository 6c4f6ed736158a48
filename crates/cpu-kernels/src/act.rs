//! Activation quantization: rows of f32 to signed 8-bit blocks.
//!
//! Both formats are symmetric with `d = max|x| / 127`, so every quant lies in -127..=127 (the
//! integer dot products rely on that: `|a| <= 127` keeps `maddubs` from saturating and lets
//! `sign` negate any value). Rounding is to nearest, ties to even (what `vroundps` does).
//! The scales are rounded as ggml's activation blocks store them (llama.cpp parity, see
//! [`Scales`]): quants from `x · 127/max`, per-32 `d` in f16, per-256 `d = 1 / (127/max)`.
//!
//! - [`A32`]: per 32 elements, for the 32-element weight types; `s = d * sum(q)` serves the
//!   offset terms.
//! - [`A256`]: per 256 elements (ggml's Q8_K), for the K-quants; `bsums` are the sums of
//!   each 16 quants.
//! - The GEMM panel: per 32 elements like [`A32`], but the quants of a tile of up to
//!   [`TILE`] tokens are interleaved by token in 4-byte groups (see [`pack_panel_token`]).

use quiver_quant::QK_K;

/// Tokens per GEMM tile.
pub(crate) const TILE: usize = 64;
/// Token lanes per panel vector (one 512-bit register of 32-bit lanes).
pub(crate) const LANES: usize = 16;

/// Activations quantized per 32 elements, quants and scales in separate arrays:
/// `q[32 i..32 i + 32]`, `ds[2 i] = d`, `ds[2 i + 1] = s = d * sum(q of block i)` (so that
/// the scales of two blocks are one 16-byte load).
#[derive(Clone, Copy, Debug)]
pub(crate) struct A32<'a> {
    pub q: &'a [i8],
    pub ds: &'a [f32],
}

impl<'a> A32<'a> {
    /// Blocks `b0..b1`.
    pub fn blocks(&self, b0: usize, b1: usize) -> A32<'a> {
        A32 {
            q: &self.q[32 * b0..32 * b1],
            ds: &self.ds[2 * b0..2 * b1],
        }
    }
    /// Whole blocks present in both arrays.
    pub fn len(&self) -> usize {
        (self.q.len() / 32).min(self.ds.len() / 2)
    }
}

/// The destination of [`quantize_a32`].
pub(crate) struct A32Mut<'a> {
    pub q: &'a mut [i8],
    pub ds: &'a mut [f32],
    pub scales: Scales,
}

/// How a per-32 (or per-16) block's `(d, s = d·Σq)` are rounded, as ggml's activation block
/// for the weight type holds them: `Q8_0` (Q4_0, Q5_0, Q8_0, IQ4_NL) keeps `d` in f16, and `s`
/// follows from it exactly (an f16 times a sum of at most 32·127 needs 23 bits); `Q8_1` (Q4_1,
/// Q5_1) keeps `d` and `s` each in f16, `s` made from the unrounded `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scales {
    Q8_0,
    Q8_1,
    /// The K-quants' GEMM panel: every block of a 256-element group shares the group's q8_K
    /// scale (`d = 1/(127/max)` over the 256), so the panel holds exactly the activations the
    /// decode path's [`A256`] (and ggml's q8_K) holds, in blocks of 32 or 16.
    Q8K,
}

impl Scales {
    /// The scales a block of quants with scale `d` and quant sum `sum` carries.
    #[inline(always)]
    pub fn of(self, d: f32, sum: i32) -> (f32, f32) {
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        match self {
            Scales::Q8_0 => {
                let d16 = f16(d);
                (d16, d16 * sum as f32)
            }
            Scales::Q8_1 => (f16(d), f16(d * sum as f32)),
            Scales::Q8K => (d, d * sum as f32),
        }
    }
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct A256 {
    pub d: f32,
    pub bsums: [i16; 16],
    pub qs: [i8; QK_K],
}

impl Default for A256 {
    fn default() -> A256 {
        A256 {
            d: 0.0,
            bsums: [0; 16],
            qs: [0; QK_K],
        }
    }
}

/// The two primitives of activation quantization, per SIMD level.
pub(crate) trait Quant {
    /// `max |x|` over a whole number of 32-element blocks.
    ///
    /// # Safety
    /// The CPU supports the implementor's level.
    unsafe fn amax(x: &[f32]) -> f32;
    /// `q = round_ties_even(x * id)` (|x * id| <= 127); returns the sums of `q[..16]` and
    /// `q[16..]`.
    ///
    /// # Safety
    /// As for `amax`.
    unsafe fn quant32(x: &[f32; 32], id: f32, q: &mut [i8; 32]) -> [i32; 2];
}

/// Plain Rust quantization.
pub(crate) struct SoftQuant;

impl Quant for SoftQuant {
    #[inline(always)]
    unsafe fn amax(x: &[f32]) -> f32 {
        x.iter().fold(0f32, |m, v| m.max(v.abs()))
    }
    #[inline(always)]
    unsafe fn quant32(x: &[f32; 32], id: f32, q: &mut [i8; 32]) -> [i32; 2] {
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i8;
        }
        let sum = |q: &[i8]| q.iter().map(|&v| v as i32).sum::<i32>();
        [sum(&q[..16]), sum(&q[16..])]
    }
}

/// `(d, 1/d)` of a block whose largest magnitude is `amax` (0 for an all-zero block), the
/// inverse computed as ggml computes it (`127/max`, not `1/d`: they differ in the last bit for
/// some values).
#[inline(always)]
fn scale(amax: f32) -> (f32, f32) {
    (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 })
}

/// The same for ggml's q8_K, whose `d` is the inverse of the inverse: `1 / (127/max)`.
#[inline(always)]
fn scale_k(amax: f32) -> (f32, f32) {
    let (_, id) = scale(amax);
    (if id > 0.0 { 1.0 / id } else { 0.0 }, id)
}

/// `x.len() == out.q.len() == 16 * out.ds.len()`.
///
/// # Safety
/// The CPU supports `Q`'s level.
#[inline(always)]
pub(crate) unsafe fn quantize_a32<Q: Quant>(x: &[f32], out: A32Mut<'_>) {
    let blocks = x
        .chunks_exact(32)
        .zip(out.q.chunks_exact_mut(32))
        .zip(out.ds.chunks_exact_mut(2));
    for ((x, q), ds) in blocks {
        if let (Ok(x), Ok(q)) = (<&[f32; 32]>::try_from(x), <&mut [i8; 32]>::try_from(q)) {
            // SAFETY: forwarded from the caller.
            let (d, id) = scale(unsafe { Q::amax(x) });
            let sums = unsafe { Q::quant32(x, id, q) };
            (ds[0], ds[1]) = out.scales.of(d, sums[0] + sums[1]);
        }
    }
}

/// `x.len() == 256 * out.len()`.
///
/// # Safety
/// The CPU supports `Q`'s level.
#[inline(always)]
pub(crate) unsafe fn quantize_a256<Q: Quant>(x: &[f32], out: &mut [A256]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        // SAFETY: forwarded from the caller.
        let (d, id) = scale_k(unsafe { Q::amax(x) });
        b.d = d;
        for (i, (x, q)) in x
            .chunks_exact(32)
            .zip(b.qs.chunks_exact_mut(32))
            .enumerate()
        {
            if let (Ok(x), Ok(q)) = (<&[f32; 32]>::try_from(x), <&mut [i8; 32]>::try_from(q)) {
                // SAFETY: forwarded from the caller.
                let s = unsafe { Q::quant32(x, id, q) };
                b.bsums[2 * i] = s[0] as i16;
                b.bsums[2 * i + 1] = s[1] as i16;
            }
        }
    }
}

/// Layout of the GEMM panel for `n_tokens` tokens of `cols` columns and sub-blocks of `sub`
/// elements. Tile `i` covers tokens `64 i ..`; its token count is padded to a multiple of
/// [`LANES`] (`tpad`). Quants: `[tile][cols / 4][tpad]` u32 words, each the 4 quants of one
/// token at one group of 4 columns. Scales: `a0 = d` and `a1 = d * sum(q over the
/// sub-block)` as `[tile][cols / sub][tpad]` f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PanelShape {
    pub cols: usize,
    pub sub: usize,
    pub n_tokens: usize,
}

impl PanelShape {
    pub fn n_tiles(&self) -> usize {
        self.n_tokens.div_ceil(TILE)
    }
    /// (first token, tokens, padded tokens) of tile `i`.
    pub fn tile(&self, i: usize) -> (usize, usize, usize) {
        let t0 = i * TILE;
        let nt = (self.n_tokens - t0).min(TILE);
        (t0, nt, nt.div_ceil(LANES) * LANES)
    }
    /// Offset of tile `i` in the quant words (tiles before it are full except the last).
    pub fn q_offset(&self, i: usize) -> usize {
        i * TILE * (self.cols / 4)
    }
    pub fn s_offset(&self, i: usize) -> usize {
        i * TILE * (self.cols / self.sub)
    }
    pub fn q_len(&self) -> usize {
        let (_, _, tpad) = self.tile(self.n_tiles() - 1);
        self.q_offset(self.n_tiles() - 1) + tpad * (self.cols / 4)
    }
    pub fn s_len(&self) -> usize {
        let (_, _, tpad) = self.tile(self.n_tiles() - 1);
        self.s_offset(self.n_tiles() - 1) + tpad * (self.cols / self.sub)
    }
}

/// Writes token `lt` (lane within its tile) of a tile: `x` is that token's row, `q` the
/// tile's quant words, `a0`/`a1` the tile's scales. `set_q(index, word)` and
/// `set_s(index, a0, a1)` write at tile-relative indices.
///
/// # Safety
/// The CPU supports `Q`'s level.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_panel_token<Q: Quant>(
    x_row: &[f32],
    sub: usize,
    scales: Scales,
    tpad: usize,
    lt: usize,
    mut set_q: impl FnMut(usize, u32),
    mut set_s: impl FnMut(usize, f32, f32),
) {
    let mut q = [0i8; 32];
    let mut group = (0f32, 0f32);
    for (blk, x) in x_row.chunks_exact(32).enumerate() {
        let Ok(x) = <&[f32; 32]>::try_from(x) else {
            continue;
        };
        // SAFETY (all three): forwarded from the caller; a K-quant row is whole 256s.
        let (d, id) = if scales == Scales::Q8K {
            if blk % 8 == 0 {
                let g = &x_row[blk * 32..(blk * 32 + QK_K).min(x_row.len())];
                group = scale_k(unsafe { Q::amax(g) });
            }
            group
        } else {
            scale(unsafe { Q::amax(x) })
        };
        let sums = unsafe { Q::quant32(x, id, &mut q) };
        for g in 0..8 {
            let w = u32::from_le_bytes([
                q[4 * g] as u8,
                q[4 * g + 1] as u8,
                q[4 * g + 2] as u8,
                q[4 * g + 3] as u8,
            ]);
            set_q((8 * blk + g) * tpad + lt, w);
        }
        if sub == 16 {
            let (a0, a1) = scales.of(d, sums[0]);
            set_s(2 * blk * tpad + lt, a0, a1);
            let (a0, a1) = scales.of(d, sums[1]);
            set_s((2 * blk + 1) * tpad + lt, a0, a1);
        } else {
            let (a0, a1) = scales.of(d, sums[0] + sums[1]);
            set_s(blk * tpad + lt, a0, a1);
        }
    }
}

/// `x` in blocks of 32 by the portable quantizer: (quants, `(d, s)` pairs).
fn quantize_a32_vecs(x: &[f32], scales: Scales) -> (Vec<i8>, Vec<f32>) {
    let nb = x.len() / 32;
    let (mut q, mut ds) = (vec![0i8; 32 * nb], vec![0f32; 2 * nb]);
    // SAFETY: the portable quantizer runs anywhere.
    unsafe {
        quantize_a32::<SoftQuant>(
            x,
            A32Mut {
                q: &mut q,
                ds: &mut ds,
                scales,
            },
        )
    };
    (q, ds)
}

/// Per block: the q8_1 offset sum minus the q8_0 one (see `activation_offset_correction`).
pub(crate) fn offset_correction(x: &[f32]) -> Vec<f32> {
    let ((_, a), (_, b)) = (
        quantize_a32_vecs(x, Scales::Q8_1),
        quantize_a32_vecs(x, Scales::Q8_0),
    );
    (0..x.len() / 32)
        .map(|i| a[2 * i + 1] - b[2 * i + 1])
        .collect()
}

/// `x` in blocks of 32 as ggml's q8_0 (for tests).
pub(crate) fn quants_a32(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    quantize_a32_vecs(x, Scales::Q8_0)
}

/// `x` in blocks of 32 as ggml's q8_1 (for tests): s is the f16 of d·Σq.
pub(crate) fn quants_a32_q8_1(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    quantize_a32_vecs(x, Scales::Q8_1)
}

/// `x` in blocks of 256 as ggml's Q8_K (for tests): the quants and each block's d.
pub(crate) fn quants_a256(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut b = vec![A256::default(); x.len() / QK_K];
    // SAFETY: the portable quantizer runs anywhere.
    unsafe { quantize_a256::<SoftQuant>(x, &mut b) };
    (
        b.iter().flat_map(|b| b.qs.iter().copied()).collect(),
        b.iter().map(|b| b.d).collect(),
    )
}

/// Dequantized activations as a path sees them (for tests): `kind` 0 = A32/panel, 1 = A256.
pub(crate) fn roundtrip(kind: u8, x: &[f32]) -> Vec<f32> {
    let (q, d, block) = if kind == 0 {
        let (q, ds) = quantize_a32_vecs(x, Scales::Q8_0);
        (q, ds.into_iter().step_by(2).collect::<Vec<_>>(), 32)
    } else {
        let (q, d) = quants_a256(x);
        (q, d, QK_K)
    };
    q.iter()
        .enumerate()
        .map(|(i, &q)| d[i / block] * q as f32)
        .collect()
}
