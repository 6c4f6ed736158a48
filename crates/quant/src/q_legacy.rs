//! The legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Nibble order (all 4- and 5-bit types): byte `j` of `qs` holds element `j` in its low nibble
//! and element `j + 16` in its high nibble. The 5-bit types keep bit 4 of element `j` in bit
//! `j` of the little-endian u32 `qh`.
//!
//! The quantizers reproduce `gguf.quants` (0.19.0) bit for bit; Q8_1, which gguf-py lacks,
//! follows ggml's `quantize_row_q8_1_ref`.

use crate::{f16_to_f32, f32_to_f16, impl_block, GgmlType};

pub const QK4_0: usize = 32;
pub const QK4_1: usize = 32;
pub const QK5_0: usize = 32;
pub const QK5_1: usize = 32;
pub const QK8_0: usize = 32;
pub const QK8_1: usize = 32;

/// `x = d * (q - 8)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ4_0 {
    /// f16 scale.
    pub d: [u8; 2],
    pub qs: [u8; QK4_0 / 2],
}

/// `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ4_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 minimum.
    pub m: [u8; 2],
    pub qs: [u8; QK4_1 / 2],
}

/// `x = d * (q - 16)`, q 5 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ5_0 {
    pub d: [u8; 2],
    /// Bit 4 of each quant, element `j` in bit `j` (little-endian u32).
    pub qh: [u8; 4],
    pub qs: [u8; QK5_0 / 2],
}

/// `x = d * q + m`, q 5 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK5_1 / 2],
}

/// `x = d * q`, q signed 8 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK8_0],
}

/// `x = d * q`; `s = d * sum(q)` (f16) is kept for dot products.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8_1 {
    pub d: [u8; 2],
    pub s: [u8; 2],
    pub qs: [u8; QK8_1],
}

impl_block!(BlockQ4_0, GgmlType::Q4_0, QK4_0, 18);
impl_block!(BlockQ4_1, GgmlType::Q4_1, QK4_1, 20);
impl_block!(BlockQ5_0, GgmlType::Q5_0, QK5_0, 22);
impl_block!(BlockQ5_1, GgmlType::Q5_1, QK5_1, 24);
impl_block!(BlockQ8_0, GgmlType::Q8_0, QK8_0, 34);
impl_block!(BlockQ8_1, GgmlType::Q8_1, QK8_1, 36);

// ---------------------------------------------------------------- dequantize

pub fn dequantize_q4_0(blocks: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK4_0)) {
        let d = f16_to_f32(b.d);
        let (lo, hi) = y.split_at_mut(QK4_0 / 2);
        for j in 0..QK4_0 / 2 {
            lo[j] = d * ((b.qs[j] & 0xf) as i32 - 8) as f32;
            hi[j] = d * ((b.qs[j] >> 4) as i32 - 8) as f32;
        }
    }
}

pub fn dequantize_q4_1(blocks: &[BlockQ4_1], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK4_1)) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.m);
        let (lo, hi) = y.split_at_mut(QK4_1 / 2);
        for j in 0..QK4_1 / 2 {
            lo[j] = d * (b.qs[j] & 0xf) as f32 + m;
            hi[j] = d * (b.qs[j] >> 4) as f32 + m;
        }
    }
}

/// The 5-bit quants of a Q5 block, in element order.
#[inline(always)]
fn q5_values(qh: [u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0xf) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
    q
}

pub fn dequantize_q5_0(blocks: &[BlockQ5_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK5_0)) {
        let d = f16_to_f32(b.d);
        let q = q5_values(b.qh, &b.qs);
        for (y, &q) in y.iter_mut().zip(q.iter()) {
            *y = d * (q as i32 - 16) as f32;
        }
    }
}

pub fn dequantize_q5_1(blocks: &[BlockQ5_1], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK5_1)) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.m);
        let q = q5_values(b.qh, &b.qs);
        for (y, &q) in y.iter_mut().zip(q.iter()) {
            *y = d * q as f32 + m;
        }
    }
}

pub fn dequantize_q8_0(blocks: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK8_0)) {
        let d = f16_to_f32(b.d);
        for (y, &q) in y.iter_mut().zip(b.qs.iter()) {
            *y = d * (q as i8) as f32;
        }
    }
}

pub fn dequantize_q8_1(blocks: &[BlockQ8_1], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK8_1)) {
        let d = f16_to_f32(b.d);
        for (y, &q) in y.iter_mut().zip(b.qs.iter()) {
            *y = d * (q as i8) as f32;
        }
    }
}

// ---------------------------------------------------------------- quantize

/// The element of largest magnitude, first one on ties (numpy's `argmax(abs(x))`).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = x[0];
    for &v in &x[1..] {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    for &v in &x[1..] {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// `1 / d`, or 0 for a zero scale.
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Truncates like C's float-to-integer conversion and clamps to `0..=max` (saturating for
/// out-of-range and NaN input, which finite blocks never produce).
#[inline(always)]
fn trunc_clamp(v: f32, max: u8) -> u8 {
    (v as i32).clamp(0, max as i32) as u8
}

/// Packs 32 nibble values (low 4 bits used) in the legacy order.
fn pack_nibbles(q: &[u8; 32], out: &mut Vec<u8>) {
    for j in 0..16 {
        out.push((q[j] & 0xf) | ((q[j + 16] & 0xf) << 4));
    }
}

/// Bit 4 of each quant as the little-endian `qh` field.
fn high_bits(q: &[u8; 32]) -> [u8; 4] {
    let mut qh = 0u32;
    for (j, &v) in q.iter().enumerate() {
        qh |= (((v >> 4) & 1) as u32) << j;
    }
    qh.to_le_bytes()
}

/// Symmetric 4/5-bit: `d = max / -half`, `q = trunc(x / d + half + 0.5)` clamped.
fn quantize_symmetric(x: &[f32], half: f32, qmax: u8) -> (f32, [u8; 32]) {
    let max = signed_absmax(x);
    let d = max / -half;
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = trunc_clamp(v * id + (half + 0.5), qmax);
    }
    (d, q)
}

/// Affine 4/5-bit: `d = (max - min) / qmax`, `q = trunc((x - min) / d + 0.5)` clamped.
fn quantize_affine(x: &[f32], qmax: u8) -> (f32, f32, [u8; 32]) {
    let (min, max) = min_max(x);
    let d = (max - min) / qmax as f32;
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = trunc_clamp((v - min) * id + 0.5, qmax);
    }
    (d, min, q)
}

pub fn quantize_block_q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = quantize_symmetric(x, 8.0, 15);
    out.extend_from_slice(&f32_to_f16(d));
    pack_nibbles(&q, out);
}

pub fn quantize_block_q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (d, min, q) = quantize_affine(x, 15);
    out.extend_from_slice(&f32_to_f16(d));
    out.extend_from_slice(&f32_to_f16(min));
    pack_nibbles(&q, out);
}

pub fn quantize_block_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = quantize_symmetric(x, 16.0, 31);
    out.extend_from_slice(&f32_to_f16(d));
    out.extend_from_slice(&high_bits(&q));
    pack_nibbles(&q, out);
}

pub fn quantize_block_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (d, min, q) = quantize_affine(x, 31);
    out.extend_from_slice(&f32_to_f16(d));
    out.extend_from_slice(&f32_to_f16(min));
    out.extend_from_slice(&high_bits(&q));
    pack_nibbles(&q, out);
}

/// Scale and rounded 8-bit quants shared by Q8_0 and Q8_1 (`roundf`: half away from zero).
fn quantize_8bit(x: &[f32]) -> (f32, [i8; 32]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    let mut q = [0i8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    (d, q)
}

pub fn quantize_block_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = quantize_8bit(x);
    out.extend_from_slice(&f32_to_f16(d));
    out.extend(q.iter().map(|&v| v as u8));
}

pub fn quantize_block_q8_1(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = quantize_8bit(x);
    let sum: i32 = q.iter().map(|&v| v as i32).sum();
    out.extend_from_slice(&f32_to_f16(d));
    out.extend_from_slice(&f32_to_f16(sum as f32 * d));
    out.extend(q.iter().map(|&v| v as u8));
}
