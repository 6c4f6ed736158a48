//! Plain element types: F32, F16 and BF16 (one element per "block").

/// Copies little-endian f32 bytes (NaN payloads are kept bit for bit).
pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = crate::f16_to_f32([s[0], s[1]]);
    }
}

/// A bf16 value as f32: the 16 bits become the high half.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits as ggml (`ggml_compute_fp32_to_bf16`) and gguf-py do it: NaNs are made
/// quiet, everything else rounds to nearest even.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 0x40) as u16;
    }
    ((n as u64 + 0x7fff + ((n >> 16) & 1) as u64) >> 16) as u16
}

pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub fn quantize_f32(src: &[f32], dst: &mut Vec<u8>) {
    for &x in src {
        dst.extend_from_slice(&x.to_le_bytes());
    }
}

pub fn quantize_f16(src: &[f32], dst: &mut Vec<u8>) {
    for &x in src {
        dst.extend_from_slice(&crate::f32_to_f16(x));
    }
}

pub fn quantize_bf16(src: &[f32], dst: &mut Vec<u8>) {
    for &x in src {
        dst.extend_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_quiets_nans() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: even mantissa wins.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }
}
