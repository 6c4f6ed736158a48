//! Gated-activation functions computed as ggml's CPU path computes them (llama.cpp parity):
//! GELU through its f16 table, SiLU through its AVX-512 e^x.

use crate::attn::has_avx2;

/// GELU through a table indexed by the f16 bits of the input, as ggml's CPU path computes it
/// (input and output rounded to f16, saturating outside ±10): the same values as
/// `quiver_backend::reference::gelu_tanh_f16`, at a table lookup each.
pub fn gelu_table() -> &'static [f32] {
    static T: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| quiver_backend::reference::gelu_tanh_f16(half::f16::from_bits(b).to_f32()))
            .collect()
    })
}

/// out = gelu(gate) · up through [`gelu_table`] (0 at or below −10, the input at or above 10),
/// the table indexed by the gate's f16 bits; with AVX2 + F16C the conversions run 8 at a time.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked AVX2, FMA and F16C.
        unsafe { geglu_f16c(gate, up, out) };
        return;
    }
    geglu_tail(gate, up, out);
}

#[inline(always)]
fn gelu_of(t: &[f32], g: f32, bits: u16) -> f32 {
    if g <= -10.0 {
        0.0
    } else if g >= 10.0 {
        g
    } else {
        t[bits as usize]
    }
}

#[inline(always)]
fn geglu_tail(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let t = gelu_table();
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_of(t, g, half::f16::from_f32(g).to_bits()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn geglu_f16c(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let t = gelu_table();
    let n = gate.len().min(up.len()).min(out.len());
    let full = n / 8 * 8;
    let mut bits = [0u16; 8];
    for c in (0..full).step_by(8) {
        // SAFETY: 8 elements of `gate` at c < full <= its length; `bits` holds 8 u16.
        unsafe {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(gate.as_ptr().add(c)));
            _mm_storeu_si128(bits.as_mut_ptr() as *mut __m128i, h);
        }
        for (j, &b) in bits.iter().enumerate() {
            out[c + j] = gelu_of(t, gate[c + j], b) * up[c + j];
        }
    }
    geglu_tail(&gate[full..n], &up[full..n], &mut out[full..n]);
}

/// e^x as ggml's AVX-512 `ggml_v_expf` computes it, lane for lane (the same fused
/// multiply-adds and constants; max error ~1.5 ulp), for llama.cpp parity of SiLU. Branch-free
/// so that loops over it vectorise; results that ggml makes subnormal (x below about −87.3)
/// are 0 here, which no use of it can tell apart (SiLU adds 1).
#[inline(always)]
pub fn ggml_expf(x: f32) -> f32 {
    let r = 12_582_912.0f32; // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // 0x1.715476p+0
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010) // 0x1.0e4020p-7
        .mul_add(b, f32::from_bits(0x3d2b_9f17)) // 0x1.573e2ep-5
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0)); // 0x1.ffffecp-1
                                                                  // j · 2^n (vscalefps) for the normal range, one rounding.
    let ni = n as i32;
    let res = j * f32::from_bits(((ni.clamp(-126, 127) + 127) as u32) << 23);
    if ni > 127 {
        f32::INFINITY
    } else if ni < -126 {
        0.0
    } else {
        res
    }
}

/// SiLU as ggml's vectorised SwiGLU computes it: x / (1 + e^(0 − x)).
#[inline(always)]
pub fn ggml_silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(0.0 - x))
}

/// out = silu(gate) · up, element by element ([`ggml_silu`]); compiled with FMA where the CPU
/// has it (the fused multiply-adds are otherwise library calls).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked AVX2, FMA and F16C.
        unsafe { swiglu_fma(gate, up, out) };
        return;
    }
    swiglu_body(gate, up, out);
}

#[inline(always)]
fn swiglu_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = ggml_silu(g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_body(gate, up, out);
}

#[cfg(test)]
mod ggml_math_tests {
    use super::*;

    #[test]
    fn swiglu_with_and_without_fma_agree_with_the_reference() {
        let g: Vec<f32> = (0..999).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let u: Vec<f32> = (0..999).map(|i| 1.0 + i as f32 * 0.001).collect();
        let (mut a, mut b) = (vec![0f32; 999], vec![0f32; 999]);
        swiglu(&g, &u, &mut a);
        swiglu_body(&g, &u, &mut b);
        for i in 0..999 {
            // The same fused operations either way: bit for bit.
            assert_eq!(a[i].to_bits(), b[i].to_bits(), "{i}");
            let want = quiver_backend::reference::silu(g[i]) * u[i];
            assert!(
                (a[i] - want).abs() <= 4.0 * f32::EPSILON * want.abs().max(1e-30),
                "{i}"
            );
        }
    }

    #[test]
    fn geglu_with_and_without_f16c_agree_bit_for_bit() {
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.0371).collect();
        let u: Vec<f32> = (0..1003).map(|i| 1.0 - i as f32 * 0.0017).collect();
        let (mut a, mut b) = (vec![0f32; 1003], vec![0f32; 1003]);
        geglu(&g, &u, &mut a);
        geglu_tail(&g, &u, &mut b);
        for i in 0..1003 {
            assert_eq!(a[i].to_bits(), b[i].to_bits(), "{i}");
            let want = quiver_backend::reference::gelu_tanh_f16(g[i]) * u[i];
            assert_eq!(
                b[i].to_bits(),
                want.to_bits(),
                "{i}: the table is the reference's"
            );
        }
    }

    #[test]
    fn ggml_expf_is_within_two_ulp_of_exp() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (ggml_expf(x), x.exp());
            let ulp = (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32;
            worst = worst.max(ulp);
            x += 0.0137;
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(200.0), f32::INFINITY);
        assert_eq!(ggml_expf(0.0), 1.0);
    }
}
