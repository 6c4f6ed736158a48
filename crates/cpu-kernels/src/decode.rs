//! The weight types as the kernels see them, portable code shared by every SIMD level.
//!
//! Every quantized block decodes to one byte per element plus a float scale `s` and offset
//! `m` per sub-block, with `w = s * v + m`. For "narrow" types `v` is the byte read as
//! unsigned and small (at most 63), so it can be the unsigned operand of `maddubs`/`dpbusd`;
//! for "wide" types (Q8_0, IQ4_NL, IQ4_XS) `v` is the byte read as signed (-128..127) and
//! `m` is zero.
//!
//! | type   | v                 | s            | m                   | sub-block |
//! |--------|-------------------|--------------|---------------------|-----------|
//! | Q4_0   | q (0..15)         | d            | -8 d                | 32        |
//! | Q4_1   | q (0..15)         | d            | m                   | 32        |
//! | Q5_0   | q (0..31)         | d            | -16 d               | 32        |
//! | Q5_1   | q (0..31)         | d            | m                   | 32        |
//! | Q8_0   | q (signed)        | d            | 0                   | 32        |
//! | IQ4_NL | kvalue (signed)   | d            | 0                   | 32        |
//! | Q2_K   | q (0..3)          | d sc         | -dmin mn            | 16        |
//! | Q3_K   | q + 4 hbit (0..7) | d sc         | -4 d sc             | 16        |
//! | Q4_K   | q (0..15)         | d sc         | -dmin mn            | 32        |
//! | Q5_K   | q (0..31)         | d sc         | -dmin mn            | 32        |
//! | Q6_K   | q (0..63)         | d sc         | -32 d sc            | 16        |
//! | IQ4_XS | kvalue (signed)   | d (ls - 32)  | 0                   | 32        |
//!
//! For the K-quants the integer sub-block scales are also given per 16 elements
//! ([`KScales`]) so that dot products can scale in integers, as ggml does: per super-block,
//! `sum w a = d da sum_h sc[h] dot_h + cd da sum_h corr[h] bsum_h` over the 16 halves `h`.

use quiver_quant::{
    f16_to_f32, iq4::iq4_xs_scale, Block, BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K,
    BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, KVALUES_IQ4NL, QK_K,
};

/// f16 to f32 conversion, chosen per SIMD level.
pub(crate) trait Half {
    fn f32(bits: [u8; 2]) -> f32;
}

/// The portable, branch-free exact conversion.
pub(crate) struct SoftHalf;

impl Half for SoftHalf {
    #[inline(always)]
    fn f32(bits: [u8; 2]) -> f32 {
        f16_to_f32(bits)
    }
}

/// A 32-element block type ("legacy" family, and IQ4_NL).
pub(crate) trait Legacy: 'static {
    type B: Block;
    /// Values are signed bytes (see the module doc).
    const WIDE: bool;
    /// The offset is the f16 right after `d` (Q4_1, Q5_1) ...
    const M_FIELD: bool = false;
    /// ... else `m = M_MUL * d`; for wide types this is the -128 that goes with reading
    /// `v ^ 0x80` as unsigned (the AVX-512 decode path does).
    const M_MUL: f32 = -128.0;
    /// Scale and offset: `w = d * v + m`.
    fn dm<H: Half>(b: &Self::B) -> (f32, f32);
    /// The 32 element values.
    fn values(b: &Self::B, out: &mut [u8; 32]);
    /// The 32 element values in a register (AVX2; with `V`, AVX-512 BW/VL may be used).
    ///
    /// # Safety
    /// The CPU supports AVX2, and AVX-512 BW/VL when `V`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack<const V: bool>(b: &Self::B) -> X;
    /// Two blocks' values in one 512-bit register, `a` then `b`.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F/BW.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack2(a: &Self::B, b: &Self::B) -> std::arch::x86_64::__m512i;
}

/// Integer sub-block scales of a K-quant super-block, per 16 elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KScales {
    pub d: f32,
    /// Coefficient of the correction term.
    pub cd: f32,
    pub sc: [i8; 16],
    pub corr: [i8; 16],
}

/// [`KQuant::GGML`]: eight i32 lane sums fused per super-block, the correction in a second
/// accumulator.
pub(crate) const GGML_LANES: u8 = 0;
/// As ggml's `ggml_vec_dot_q6_K_q8_K`: the correction (`−32 · Σ sc · bsum`, per lane) taken
/// from the lane sums in integers, one fused multiply-add per lane and super-block.
pub(crate) const GGML_Q6K: u8 = 1;
/// As ggml's repacked Q4_K product (`q4_K_8x8`, used for rows in multiples of 8): per
/// super-block the whole integer sum and the whole correction, each fused into its own scalar
/// accumulator; the result is their difference.
pub(crate) const GGML_Q4K: u8 = 2;

/// How a decode-path product of K-quant rows rounds, after the llama.cpp kernel that the same
/// batch would take (single-sequence commands; batch-invariant runs always take
/// [`FORM_VEC`]): its dot product for one token ([`KQuant::GGML`]) ...
pub(crate) const FORM_VEC: u8 = 0;
/// ... its repacked Q4_K GEMM, for the tokens it takes four at a time (per 64 elements, the
/// integer sum and the correction each fused into its own accumulator) ...
pub(crate) const FORM_GEMM4: u8 = 1;
/// ... or its tiled kernel for batches of 8+ tokens: per super-block the whole integer sums,
/// `r = S1 · d` then `r − dmin · S2` fused, and `out + r · d_a` fused.
pub(crate) const FORM_TILED: u8 = 2;

/// A 256-element super-block type.
pub(crate) trait KQuant: 'static {
    type B: Block;
    const WIDE: bool;
    /// Elements per float sub-block for the GEMM path (16 or 32).
    const SUB: usize;
    /// Whether the correction term is non-zero.
    const HAS_CORR: bool;
    /// How the decode kernels combine the integer sums, to give llama.cpp's floats on x86:
    /// [`GGML_LANES`] (the default: eight lane sums and the correction in two float
    /// accumulators), [`GGML_Q6K`] or [`GGML_Q4K`].
    const GGML: u8 = GGML_LANES;
    /// Whether llama.cpp runs batches of 8+ tokens of this type through its tiled K-quant
    /// kernel ([`FORM_TILED`]) — Q5_K and Q6_K (Q4_K rows are repacked instead).
    const TILED: bool = false;
    fn scales<H: Half>(b: &Self::B) -> KScales;
    fn values(b: &Self::B, out: &mut [u8; QK_K]);
    /// Elements `64 p .. 64 p + 64` in two registers (AVX2).
    ///
    /// # Safety
    /// The CPU supports AVX2; `p < 4`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn pair(b: &Self::B, p: usize) -> [X; 2];
    /// The integer scales as registers (AVX2): i16 scales of the 16 halves, even halves in
    /// the low 128 bits and odd in the high; i16 correction coefficients in order; `d`, `cd`.
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_x86(b: &Self::B) -> (X, X, f32, f32) {
        // SAFETY: forwarded from the caller.
        unsafe { xu::k_scales_generic::<Self>(b) }
    }
}

#[cfg(target_arch = "x86_64")]
type X = std::arch::x86_64::__m256i;
#[cfg(target_arch = "x86_64")]
use crate::x86::unpack as xu;

/// Implements the x86 unpackers of a type by delegating to `crate::x86::unpack`.
macro_rules! x86_unpack {
    (legacy $f:ident, $f2:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn unpack<const V: bool>(b: &Self::B) -> X {
            // SAFETY: forwarded from the caller.
            unsafe { xu::$f::<V>(b) }
        }
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn unpack2(a: &Self::B, b: &Self::B) -> std::arch::x86_64::__m512i {
            // SAFETY: forwarded from the caller.
            unsafe { xu::$f2(a, b) }
        }
    };
    (k $f:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn pair(b: &Self::B, p: usize) -> [X; 2] {
            // SAFETY: forwarded from the caller.
            unsafe { xu::$f(b, p) }
        }
    };
}

pub(crate) struct TQ4_0;
pub(crate) struct TQ4_1;
pub(crate) struct TQ5_0;
pub(crate) struct TQ5_1;
pub(crate) struct TQ8_0;
pub(crate) struct TIq4Nl;
pub(crate) struct TQ2K;
pub(crate) struct TQ3K;
pub(crate) struct TQ4K;
pub(crate) struct TQ5K;
pub(crate) struct TQ6K;
pub(crate) struct TIq4Xs;

#[inline(always)]
fn nibbles(qs: &[u8; 16], out: &mut [u8; 32]) {
    for j in 0..16 {
        out[j] = qs[j] & 0xf;
        out[j + 16] = qs[j] >> 4;
    }
}

#[inline(always)]
fn add_high_bits(qh: [u8; 4], out: &mut [u8; 32]) {
    let qh = u32::from_le_bytes(qh);
    for (j, o) in out.iter_mut().enumerate() {
        *o |= (((qh >> j) & 1) << 4) as u8;
    }
}

impl Legacy for TQ4_0 {
    x86_unpack!(legacy q4_0, q4_0_x2);
    const M_MUL: f32 = -8.0;
    type B = BlockQ4_0;
    const WIDE: bool = false;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockQ4_0) -> (f32, f32) {
        let d = H::f32(b.d);
        (d, -8.0 * d)
    }
    #[inline(always)]
    fn values(b: &BlockQ4_0, out: &mut [u8; 32]) {
        nibbles(&b.qs, out);
    }
}

impl Legacy for TQ4_1 {
    x86_unpack!(legacy q4_1, q4_1_x2);
    const M_FIELD: bool = true;
    type B = BlockQ4_1;
    const WIDE: bool = false;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockQ4_1) -> (f32, f32) {
        (H::f32(b.d), H::f32(b.m))
    }
    #[inline(always)]
    fn values(b: &BlockQ4_1, out: &mut [u8; 32]) {
        nibbles(&b.qs, out);
    }
}

impl Legacy for TQ5_0 {
    x86_unpack!(legacy q5_0, q5_0_x2);
    const M_MUL: f32 = -16.0;
    type B = BlockQ5_0;
    const WIDE: bool = false;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockQ5_0) -> (f32, f32) {
        let d = H::f32(b.d);
        (d, -16.0 * d)
    }
    #[inline(always)]
    fn values(b: &BlockQ5_0, out: &mut [u8; 32]) {
        nibbles(&b.qs, out);
        add_high_bits(b.qh, out);
    }
}

impl Legacy for TQ5_1 {
    x86_unpack!(legacy q5_1, q5_1_x2);
    const M_FIELD: bool = true;
    type B = BlockQ5_1;
    const WIDE: bool = false;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockQ5_1) -> (f32, f32) {
        (H::f32(b.d), H::f32(b.m))
    }
    #[inline(always)]
    fn values(b: &BlockQ5_1, out: &mut [u8; 32]) {
        nibbles(&b.qs, out);
        add_high_bits(b.qh, out);
    }
}

impl Legacy for TQ8_0 {
    x86_unpack!(legacy q8_0, q8_0_x2);
    type B = BlockQ8_0;
    const WIDE: bool = true;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockQ8_0) -> (f32, f32) {
        (H::f32(b.d), 0.0)
    }
    #[inline(always)]
    fn values(b: &BlockQ8_0, out: &mut [u8; 32]) {
        *out = b.qs;
    }
}

impl Legacy for TIq4Nl {
    x86_unpack!(legacy iq4_nl, iq4_nl_x2);
    type B = BlockIq4Nl;
    const WIDE: bool = true;
    #[inline(always)]
    fn dm<H: Half>(b: &BlockIq4Nl) -> (f32, f32) {
        (H::f32(b.d), 0.0)
    }
    #[inline(always)]
    fn values(b: &BlockIq4Nl, out: &mut [u8; 32]) {
        for j in 0..16 {
            out[j] = KVALUES_IQ4NL[(b.qs[j] & 0xf) as usize] as u8;
            out[j + 16] = KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as u8;
        }
    }
}

/// 8 scales and 8 mins (6 bits each) of a Q4_K/Q5_K block, unpacked with word operations:
/// sub-blocks 0..4 keep them in the low 6 bits of bytes 0..4 / 4..8, sub-blocks 4..8 in the
/// nibbles of bytes 8..12 plus the top two bits of bytes 0..4 / 4..8.
#[inline(always)]
pub(crate) fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a, b, c) = (w(0), w(1), w(2));
    let sc_lo = a & 0x3f3f_3f3f;
    let sc_hi = (c & 0x0f0f_0f0f) | ((a >> 2) & 0x3030_3030);
    let mn_lo = b & 0x3f3f_3f3f;
    let mn_hi = ((c >> 4) & 0x0f0f_0f0f) | ((b >> 2) & 0x3030_3030);
    let sc = (sc_lo as u64 | (sc_hi as u64) << 32).to_le_bytes();
    let mn = (mn_lo as u64 | (mn_hi as u64) << 32).to_le_bytes();
    (sc, mn)
}

/// The 16 signed 6-bit scales of a Q3_K block with word operations (see
/// `quiver_quant::k_quants::q3_k_scales` for the layout): low nibbles of bytes 0..8 then
/// their high nibbles, plus two bits from bytes 8..12, minus 32.
#[inline(always)]
pub(crate) fn q3_scales_fast(s: &[u8; 12]) -> [i8; 16] {
    let a = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
    let c = u32::from_le_bytes([s[8], s[9], s[10], s[11]]) as u64;
    const NIB: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const TWO: u64 = 0x0303_0303;
    let hi0 = (c & TWO) | ((c >> 2) & TWO) << 32;
    let hi1 = ((c >> 4) & TWO) | ((c >> 6) & TWO) << 32;
    let v0 = ((a & NIB) | hi0 << 4).to_le_bytes();
    let v1 = (((a >> 4) & NIB) | hi1 << 4).to_le_bytes();
    let mut out = [0i8; 16];
    for i in 0..8 {
        out[i] = v0[i].wrapping_sub(32) as i8;
        out[i + 8] = v1[i].wrapping_sub(32) as i8;
    }
    out
}

#[inline(always)]
fn dup8(x: [u8; 8]) -> [i8; 16] {
    let mut o = [0i8; 16];
    for (i, v) in o.iter_mut().enumerate() {
        *v = x[i / 2] as i8;
    }
    o
}

/// The 2-bit field `j` (0..4) of the 128-element half `n` of a Q2_K/Q3_K `qs`.
#[inline(always)]
fn two_bit_values(qs: &[u8; 64], out: &mut [u8; QK_K]) {
    for n in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                out[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
            }
        }
    }
}

impl KQuant for TQ2K {
    x86_unpack!(k q2_k);
    type B = BlockQ2K;
    const WIDE: bool = false;
    const SUB: usize = 16;
    const HAS_CORR: bool = true;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockQ2K) -> KScales {
        let mut sc = [0i8; 16];
        let mut corr = [0i8; 16];
        for i in 0..16 {
            sc[i] = (b.scales[i] & 0xf) as i8;
            corr[i] = (b.scales[i] >> 4) as i8;
        }
        KScales {
            d: H::f32(b.d),
            cd: -H::f32(b.dmin),
            sc,
            corr,
        }
    }
    #[inline(always)]
    fn values(b: &BlockQ2K, out: &mut [u8; QK_K]) {
        two_bit_values(&b.qs, out);
    }
}

impl KQuant for TQ3K {
    x86_unpack!(k q3_k);
    type B = BlockQ3K;
    const WIDE: bool = false;
    const SUB: usize = 16;
    const HAS_CORR: bool = true;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockQ3K) -> KScales {
        let sc = q3_scales_fast(&b.scales);
        let d = H::f32(b.d);
        KScales {
            d,
            cd: -4.0 * d,
            sc,
            corr: sc,
        }
    }
    #[inline(always)]
    fn values(b: &BlockQ3K, out: &mut [u8; QK_K]) {
        two_bit_values(&b.qs, out);
        for n in 0..2 {
            for j in 0..4 {
                for l in 0..32 {
                    out[128 * n + 32 * j + l] |= ((b.hmask[l] >> (4 * n + j)) & 1) << 2;
                }
            }
        }
    }
}

impl KQuant for TQ4K {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_x86(b: &Self::B) -> (X, X, f32, f32) {
        // SAFETY: forwarded from the caller.
        unsafe { xu::q4_k_scales(b) }
    }
    x86_unpack!(k q4_k);
    type B = BlockQ4K;
    const WIDE: bool = false;
    const SUB: usize = 32;
    const HAS_CORR: bool = true;
    const GGML: u8 = GGML_Q4K;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockQ4K) -> KScales {
        let (sc, mn) = k4_scales_mins(&b.scales);
        KScales {
            d: H::f32(b.d),
            cd: -H::f32(b.dmin),
            sc: dup8(sc),
            corr: dup8(mn),
        }
    }
    #[inline(always)]
    fn values(b: &BlockQ4K, out: &mut [u8; QK_K]) {
        for j in 0..4 {
            for l in 0..32 {
                out[64 * j + l] = b.qs[32 * j + l] & 0xf;
                out[64 * j + 32 + l] = b.qs[32 * j + l] >> 4;
            }
        }
    }
}

impl KQuant for TQ5K {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_x86(b: &Self::B) -> (X, X, f32, f32) {
        // SAFETY: forwarded from the caller.
        unsafe { xu::q5_k_scales(b) }
    }
    x86_unpack!(k q5_k);
    type B = BlockQ5K;
    const WIDE: bool = false;
    const SUB: usize = 32;
    const HAS_CORR: bool = true;
    const TILED: bool = true;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockQ5K) -> KScales {
        let (sc, mn) = k4_scales_mins(&b.scales);
        KScales {
            d: H::f32(b.d),
            cd: -H::f32(b.dmin),
            sc: dup8(sc),
            corr: dup8(mn),
        }
    }
    #[inline(always)]
    fn values(b: &BlockQ5K, out: &mut [u8; QK_K]) {
        for j in 0..4 {
            for l in 0..32 {
                let h = b.qh[l] >> (2 * j);
                out[64 * j + l] = (b.qs[32 * j + l] & 0xf) | ((h & 1) << 4);
                out[64 * j + 32 + l] = (b.qs[32 * j + l] >> 4) | ((h & 2) << 3);
            }
        }
    }
}

impl KQuant for TQ6K {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_x86(b: &Self::B) -> (X, X, f32, f32) {
        // SAFETY: forwarded from the caller.
        unsafe { xu::q6_k_scales(b) }
    }
    x86_unpack!(k q6_k);
    type B = BlockQ6K;
    const WIDE: bool = false;
    const SUB: usize = 16;
    const HAS_CORR: bool = true;
    const GGML: u8 = GGML_Q6K;
    const TILED: bool = true;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockQ6K) -> KScales {
        let sc = b.scales.map(|x| x as i8);
        let d = H::f32(b.d);
        KScales {
            d,
            cd: -32.0 * d,
            sc,
            corr: sc,
        }
    }
    #[inline(always)]
    fn values(b: &BlockQ6K, out: &mut [u8; QK_K]) {
        for n in 0..2 {
            for k in 0..4 {
                let shift = 4 * (k / 2);
                for l in 0..32 {
                    let lo = (b.ql[64 * n + 32 * (k % 2) + l] >> shift) & 0xf;
                    let hi = (b.qh[32 * n + l] >> (2 * k)) & 3;
                    out[128 * n + 32 * k + l] = lo | (hi << 4);
                }
            }
        }
    }
}

impl KQuant for TIq4Xs {
    x86_unpack!(k iq4_xs);
    type B = BlockIq4Xs;
    const WIDE: bool = true;
    const SUB: usize = 32;
    const HAS_CORR: bool = false;
    #[inline(always)]
    fn scales<H: Half>(b: &BlockIq4Xs) -> KScales {
        let mut ls = [0u8; 8];
        for (ib, l) in ls.iter_mut().enumerate() {
            *l = (iq4_xs_scale(b, ib) - 32) as i8 as u8;
        }
        KScales {
            d: H::f32(b.d),
            cd: 0.0,
            sc: dup8(ls),
            corr: [0; 16],
        }
    }
    #[inline(always)]
    fn values(b: &BlockIq4Xs, out: &mut [u8; QK_K]) {
        for ib in 0..8 {
            for j in 0..16 {
                let q = b.qs[16 * ib + j];
                out[32 * ib + j] = KVALUES_IQ4NL[(q & 0xf) as usize] as u8;
                out[32 * ib + j + 16] = KVALUES_IQ4NL[(q >> 4) as usize] as u8;
            }
        }
    }
}

/// Float sub-block scales and offsets of a K-quant super-block for the GEMM path:
/// `QK_K / SUB` entries of `s` and `m` are written.
#[inline(always)]
pub(crate) fn k_sub_scales<T: KQuant>(k: &KScales, s: &mut [f32], m: &mut [f32]) {
    let step = T::SUB / 16;
    for (j, (s, m)) in s
        .iter_mut()
        .zip(m.iter_mut())
        .take(QK_K / T::SUB)
        .enumerate()
    {
        *s = k.d * k.sc[j * step] as f32;
        *m = k.cd * k.corr[j * step] as f32;
    }
}

/// Cross-checks the unpacked scales against quiver-quant's per-sub-block helper.
#[cfg(test)]
mod tests {
    use super::*;
    use quiver_quant::k_quants::{get_scale_min_k4, q3_k_scales};

    #[test]
    fn k4_and_q3_scale_unpacking_match_the_reference() {
        let mut s = [0u8; 12];
        let mut x = 0x1234_5678u32;
        for _ in 0..1000 {
            for b in s.iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            let (sc, mn) = k4_scales_mins(&s);
            for j in 0..8 {
                assert_eq!((sc[j], mn[j]), get_scale_min_k4(j, &s));
            }
            assert_eq!(q3_scales_fast(&s), q3_k_scales(&s));
        }
    }
}
