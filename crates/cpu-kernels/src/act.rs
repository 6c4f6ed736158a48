//! Activation quantization: rows of f32 to signed 8-bit blocks.
//!
//! Both formats are symmetric with `d = max|x| / 127`, so every quant lies in -127..=127 (the
//! integer dot products rely on that: `|a| <= 127` keeps `maddubs` from saturating and lets
//! `sign` negate any value). Rounding is to nearest, ties to even (what `vroundps` does).
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

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct A32 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
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
        A256 { d: 0.0, bsums: [0; 16], qs: [0; QK_K] }
    }
}

/// Quantizes `x` (len a multiple of N) with one scale, returning `d`.
#[inline(always)]
fn quantize_block<const N: usize>(x: &[f32; N], q: &mut [i8; N]) -> f32 {
    let mut amax = 0f32;
    for &v in x {
        amax = amax.max(v.abs());
    }
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
    }
    d
}

#[inline(always)]
fn sum_i8(q: &[i8]) -> i32 {
    q.iter().map(|&v| v as i32).sum()
}

/// `x.len() == 32 * out.len()`.
#[inline(always)]
pub(crate) fn quantize_a32(x: &[f32], out: &mut [A32]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        if let Ok(x) = <&[f32; 32]>::try_from(x) {
            b.d = quantize_block(x, &mut b.qs);
            b.s = b.d * sum_i8(&b.qs) as f32;
        }
    }
}

/// `x.len() == 256 * out.len()`.
#[inline(always)]
pub(crate) fn quantize_a256(x: &[f32], out: &mut [A256]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        if let Ok(x) = <&[f32; QK_K]>::try_from(x) {
            b.d = quantize_block(x, &mut b.qs);
            for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                *s = sum_i8(q) as i16;
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
#[inline(always)]
pub(crate) fn pack_panel_token(
    x: &[f32],
    sub: usize,
    tpad: usize,
    lt: usize,
    mut set_q: impl FnMut(usize, u32),
    mut set_s: impl FnMut(usize, f32, f32),
) {
    let mut q = [0i8; 32];
    for (blk, x) in x.chunks_exact(32).enumerate() {
        let Ok(x) = <&[f32; 32]>::try_from(x) else { continue };
        let d = quantize_block(x, &mut q);
        for g in 0..8 {
            let w = u32::from_le_bytes([q[4 * g] as u8, q[4 * g + 1] as u8, q[4 * g + 2] as u8, q[4 * g + 3] as u8]);
            set_q((8 * blk + g) * tpad + lt, w);
        }
        for (h, qs) in q.chunks_exact(sub).enumerate() {
            let j = blk * (32 / sub) + h;
            set_s(j * tpad + lt, d, d * sum_i8(qs) as f32);
        }
    }
}

/// Dequantized activations as a path sees them (for tests): `kind` 0 = A32/panel, 1 = A256.
pub(crate) fn roundtrip(kind: u8, x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    if kind == 0 {
        let mut b = vec![A32::default(); x.len() / 32];
        quantize_a32(x, &mut b);
        for b in &b {
            out.extend(b.qs.iter().map(|&q| b.d * q as f32));
        }
    } else {
        let mut b = vec![A256::default(); x.len() / QK_K];
        quantize_a256(x, &mut b);
        for b in &b {
            out.extend(b.qs.iter().map(|&q| b.d * q as f32));
        }
    }
    out
}
