//! quiver-quant: GGML block layouts and scalar reference codecs.
//!
//! [`dequantize`] is bit-identical to the Python `gguf` package (0.19.0) for every type it
//! covers; [`quantize`] matches `gguf.quants.quantize` bit for bit where that package has a
//! quantizer (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and otherwise follows ggml's
//! reference quantizers (`quantize_row_*_ref`, and for IQ4_NL/IQ4_XS the best-scale search
//! that `llama-quantize` runs without an importance matrix), reproducing them bit for bit.
//!
//! Block layouts live in one module per family: [`simple`] (F32/F16/BF16), [`q_legacy`]
//! (Q4_0..Q8_1), [`k_quants`] (Q2_K..Q8_K, with the search routines in `k_search`) and
//! [`iq4`] (IQ4_NL, IQ4_XS). Every block struct is `#[repr(C)]` over byte arrays (alignment
//! 1), so a byte slice can be viewed as a block slice with [`as_blocks`].

pub mod iq4;
pub mod k_quants;
mod k_search;
pub mod q_legacy;
pub mod simple;

pub use iq4::{BlockIq4Nl, BlockIq4Xs, KVALUES_IQ4NL, QK4_NL};
pub use k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, K_SCALE_SIZE, QK_K,
};
pub use q_legacy::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, QK4_0, QK4_1, QK5_0, QK5_1,
    QK8_0, QK8_1,
};
pub use quiver_gguf::GgmlType;

/// Errors of the codecs. Every variant names the type and the lengths involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("dequantize: type {ty} is not supported")]
    DequantizeUnsupported { ty: GgmlType },
    #[error("quantize: type {ty} is not supported")]
    QuantizeUnsupported { ty: GgmlType },
    #[error("{op} {ty}: {n_elements} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        op: &'static str,
        ty: GgmlType,
        n_elements: usize,
        block_size: usize,
    },
    #[error("dequantize {ty}: {n_elements} elements need {expected_bytes} bytes, got {got_bytes}")]
    ByteCountMismatch {
        ty: GgmlType,
        n_elements: usize,
        expected_bytes: usize,
        got_bytes: usize,
    },
}

/// A block layout: a plain-old-data struct of byte arrays that is exactly one GGML block.
///
/// # Safety
/// Implementors must be `#[repr(C)]`, have alignment 1, contain only `u8` arrays (so every
/// bit pattern is valid) and have `size_of::<Self>() == Self::TYPE.type_size()`.
pub unsafe trait Block: Copy + 'static {
    /// The GGML type whose block this is.
    const TYPE: GgmlType;
    /// Elements per block.
    const ELEMENTS: usize;
}

/// Views `bytes` as a slice of blocks, or `None` if the length is not a whole number of blocks.
pub fn as_blocks<B: Block>(bytes: &[u8]) -> Option<&[B]> {
    let size = std::mem::size_of::<B>();
    if size == 0 || !bytes.len().is_multiple_of(size) {
        return None;
    }
    debug_assert_eq!(std::mem::align_of::<B>(), 1);
    // SAFETY: `Block` guarantees alignment 1, no padding and that every bit pattern is valid;
    // the length is a whole number of blocks and the lifetime is tied to `bytes`.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), bytes.len() / size) })
}

/// The bytes of a block slice.
pub fn blocks_as_bytes<B: Block>(blocks: &[B]) -> &[u8] {
    // SAFETY: blocks are plain bytes without padding (see `Block`).
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

/// Implements [`Block`] for a layout struct and checks its size against the GGUF table.
macro_rules! impl_block {
    ($t:ty, $ty:expr, $elements:expr, $bytes:expr) => {
        // SAFETY: the struct is repr(C) over u8 arrays only; the size is asserted below and
        // against `GgmlType::type_size` by a unit test.
        unsafe impl $crate::Block for $t {
            const TYPE: quiver_gguf::GgmlType = $ty;
            const ELEMENTS: usize = $elements;
        }
        const _: () = assert!(std::mem::size_of::<$t>() == $bytes);
        const _: () = assert!(std::mem::align_of::<$t>() == 1);
    };
}
pub(crate) use impl_block;

/// Reads a little-endian f16 field as f32 (exact).
#[inline(always)]
pub fn f16_to_f32(b: [u8; 2]) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes(b))
}

/// f16 bits to f32, exact and branch-free so that loops over it vectorise. NaNs come out
/// quiet with their payload kept, as F16C's `vcvtph2ps` (and the `half` crate) do.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = h & 0x7c00;
    // Exponent and mantissa moved into place; rebias the exponent by 127 - 15 = 112.
    let em = (h & 0x7fff) << 13;
    let normal = em + (112 << 23);
    // Inf/NaN: exponent all ones; NaNs are made quiet.
    let inf_nan = em | 0x7f80_0000 | if h & 0x3ff != 0 { 0x0040_0000 } else { 0 };
    // Subnormal (or zero): mantissa * 2^-24, exactly, via 2^-14 * (1 + m/1024) - 2^-14.
    let magic = 113 << 23;
    let sub = (f32::from_bits(em + magic) - f32::from_bits(magic)).to_bits();
    let bits = if exp == 0x7c00 {
        inf_nan
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// Rounds f32 to f16 (round to nearest even, as numpy and ggml do) as little-endian bytes.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// True if [`dequantize`] supports `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
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
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | IQ4_NL
            | IQ4_XS
    )
}

/// True if [`quantize`] supports `ty` (currently the same set as [`can_dequantize`]).
pub fn can_quantize(ty: GgmlType) -> bool {
    can_dequantize(ty)
}

/// Bytes needed for `n_elements` of `ty`, checking that it is a whole number of blocks.
pub fn byte_len(ty: GgmlType, n_elements: usize, op: &'static str) -> Result<usize, QuantError> {
    let bs = ty.block_size();
    if !n_elements.is_multiple_of(bs) {
        return Err(QuantError::NotBlockMultiple {
            op,
            ty,
            n_elements,
            block_size: bs,
        });
    }
    Ok((n_elements / bs) * ty.type_size())
}

/// Views `src` as blocks of `B` and runs `f` on them.
fn with_blocks<B: Block>(src: &[u8], dst: &mut [f32], f: fn(&[B], &mut [f32])) {
    // Lengths were checked by the caller.
    if let Some(blocks) = as_blocks::<B>(src) {
        f(blocks, dst);
    }
}

/// Decodes `src` into `dst`. `dst.len()` is the element count (a multiple of
/// `ty.block_size()`); `src.len()` must be exactly the matching byte count.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    use GgmlType::*;
    if !can_dequantize(ty) {
        return Err(QuantError::DequantizeUnsupported { ty });
    }
    let expected = byte_len(ty, dst.len(), "dequantize")?;
    if src.len() != expected {
        return Err(QuantError::ByteCountMismatch {
            ty,
            n_elements: dst.len(),
            expected_bytes: expected,
            got_bytes: src.len(),
        });
    }
    match ty {
        F32 => simple::dequantize_f32(src, dst),
        F16 => simple::dequantize_f16(src, dst),
        BF16 => simple::dequantize_bf16(src, dst),
        Q4_0 => with_blocks(src, dst, q_legacy::dequantize_q4_0),
        Q4_1 => with_blocks(src, dst, q_legacy::dequantize_q4_1),
        Q5_0 => with_blocks(src, dst, q_legacy::dequantize_q5_0),
        Q5_1 => with_blocks(src, dst, q_legacy::dequantize_q5_1),
        Q8_0 => with_blocks(src, dst, q_legacy::dequantize_q8_0),
        Q8_1 => with_blocks(src, dst, q_legacy::dequantize_q8_1),
        Q2_K => with_blocks(src, dst, k_quants::dequantize_q2_k),
        Q3_K => with_blocks(src, dst, k_quants::dequantize_q3_k),
        Q4_K => with_blocks(src, dst, k_quants::dequantize_q4_k),
        Q5_K => with_blocks(src, dst, k_quants::dequantize_q5_k),
        Q6_K => with_blocks(src, dst, k_quants::dequantize_q6_k),
        Q8_K => with_blocks(src, dst, k_quants::dequantize_q8_k),
        IQ4_NL => with_blocks(src, dst, iq4::dequantize_iq4_nl),
        IQ4_XS => with_blocks(src, dst, iq4::dequantize_iq4_xs),
        _ => return Err(QuantError::DequantizeUnsupported { ty }),
    }
    Ok(())
}

/// Appends the encoding of `src` (length a multiple of the block size) to `dst`.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), QuantError> {
    use GgmlType::*;
    if !can_quantize(ty) {
        return Err(QuantError::QuantizeUnsupported { ty });
    }
    let n_bytes = byte_len(ty, src.len(), "quantize")?;
    let start = dst.len();
    dst.reserve(n_bytes);
    let bs = ty.block_size();
    match ty {
        F32 => simple::quantize_f32(src, dst),
        F16 => simple::quantize_f16(src, dst),
        BF16 => simple::quantize_bf16(src, dst),
        _ => {
            let encode: fn(&[f32], &mut Vec<u8>) = match ty {
                Q4_0 => q_legacy::quantize_block_q4_0,
                Q4_1 => q_legacy::quantize_block_q4_1,
                Q5_0 => q_legacy::quantize_block_q5_0,
                Q5_1 => q_legacy::quantize_block_q5_1,
                Q8_0 => q_legacy::quantize_block_q8_0,
                Q8_1 => q_legacy::quantize_block_q8_1,
                Q2_K => k_search::quantize_block_q2_k,
                Q3_K => k_search::quantize_block_q3_k,
                Q4_K => k_search::quantize_block_q4_k,
                Q5_K => k_search::quantize_block_q5_k,
                Q6_K => k_search::quantize_block_q6_k,
                Q8_K => k_search::quantize_block_q8_k,
                IQ4_NL => iq4::quantize_block_iq4_nl,
                IQ4_XS => iq4::quantize_block_iq4_xs,
                _ => return Err(QuantError::QuantizeUnsupported { ty }),
            };
            for block in src.chunks_exact(bs) {
                encode(block, dst);
            }
        }
    }
    debug_assert_eq!(dst.len() - start, n_bytes);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<B: Block>() {
        assert_eq!(std::mem::size_of::<B>(), B::TYPE.type_size(), "{}", B::TYPE);
        assert_eq!(B::ELEMENTS, B::TYPE.block_size(), "{}", B::TYPE);
    }

    #[test]
    fn block_structs_match_the_gguf_table() {
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
        check::<BlockIq4Nl>();
        check::<BlockIq4Xs>();
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
        }
    }

    #[test]
    fn as_blocks_rejects_partial_blocks() {
        assert!(as_blocks::<BlockQ4_0>(&[0u8; 17]).is_none());
        assert_eq!(as_blocks::<BlockQ4_0>(&[0u8; 36]).map(|b| b.len()), Some(2));
    }
}
