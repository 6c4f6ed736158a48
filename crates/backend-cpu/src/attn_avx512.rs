//! attn.rs's f16 path with AVX-512: 16 lanes a register where its [`Avx2`] takes 8, the same
//! operations on the same elements, and the dot's additions in the same order (AVX2's eight
//! 8-lane sums are the halves of four 16-lane ones), so the same bits with half the
//! instructions a key. Only run where the active SIMD level is AVX-512 (which implies AVX2,
//! FMA and F16C).

#[cfg(doc)]
use crate::attn::Avx2;
use crate::attn::{quarter_sums, task_f16, with_zeros, Lanes, Task};
use quiver_backend::{AttnParams, Batch};
use std::arch::x86_64::*;

/// AVX-512F + F16C: 16 lanes.
pub(crate) struct Avx512;

impl Lanes for Avx512 {
    #[inline(always)]
    unsafe fn update<const MAD: bool, const R16: bool>(
        acc: &mut [f32],
        v: &[half::f16],
        w: f32,
    ) -> usize {
        let full = acc.len() / 16 * 16;
        // SAFETY: the features per the contract; loads and stores of 16 elements below `full`
        // <= the lengths of `acc` and (with MAD) `v`.
        unsafe {
            let wv = _mm512_set1_ps(w);
            let pa = acc.as_mut_ptr();
            let mut i = 0;
            while i < full {
                let x = _mm512_loadu_ps(pa.add(i));
                let mut y = if MAD {
                    let h = _mm256_loadu_si256(v.as_ptr().add(i) as *const __m256i);
                    _mm512_fmadd_ps(_mm512_cvtph_ps(h), wv, x)
                } else {
                    _mm512_mul_ps(x, wv)
                };
                if R16 {
                    y = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
                }
                _mm512_storeu_ps(pa.add(i), y);
                i += 16;
            }
        }
        full
    }
    #[inline(always)]
    unsafe fn dot64(a: &[f32], b: &[half::f16], full: usize) -> f32 {
        // SAFETY: the features per the contract; every load reads 16 elements below `full`.
        unsafe {
            // z[k] holds AVX2's v[2k] (lanes 0–7) and v[2k + 1] (lanes 8–15).
            let mut z = [_mm512_setzero_ps(); 4];
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut c = 0;
            while c < full {
                for (k, zk) in z.iter_mut().enumerate() {
                    let x = _mm512_loadu_ps(pa.add(c + 16 * k));
                    let h = _mm256_loadu_si256(pb.add(c + 16 * k) as *const __m256i);
                    *zk = _mm512_add_ps(*zk, _mm512_mul_ps(x, _mm512_cvtph_ps(h)));
                }
                c += 64;
            }
            // AVX2's lo = (v0 + v4) + (v2 + v6) and hi = (v1 + v5) + (v3 + v7) are the low and
            // the high half of (z0 + z2) + (z1 + z3).
            let s = _mm512_add_ps(_mm512_add_ps(z[0], z[2]), _mm512_add_ps(z[1], z[3]));
            let lo = _mm512_castps512_ps256(s);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
            quarter_sums(_mm256_add_ps(lo, hi))
        }
    }
}

/// One task on `F16c` with AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn task(
    task: Task<'_>,
    k: &[half::f16],
    v: &[half::f16],
    b: &Batch,
    a: &AttnParams,
    r16: bool,
    tiled: bool,
) {
    with_zeros(task.g * a.head_dim, |acc| {
        task_f16::<Avx512>(task, acc, k, v, b, a, r16, tiled)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attn::{Avx2, F16c, Keys};

    /// A head's key operations at width `W` on the given inputs: each dot product, then the
    /// MAD and a rescale of the accumulator; the dots' bits, then the accumulator's.
    #[inline(always)]
    fn run<W: Lanes>(
        hd: usize,
        r16: bool,
        q: &[f32],
        keys: &[Vec<half::f16>],
        ws: &[f32],
    ) -> Vec<u32> {
        let mut acc = vec![0f32; hd];
        let mut c = F16c::<W> {
            q,
            acc: &mut acc,
            hd,
            r16,
            lanes: std::marker::PhantomData,
        };
        let mut out = Vec::new();
        for (k, &w) in keys.iter().zip(ws) {
            out.push(c.dot(0, k).to_bits());
            c.mad(0, k, w);
            c.rescale(0, 0.75 + 0.5 * w.abs());
        }
        out.extend(acc.iter().map(|x| x.to_bits()));
        out
    }

    /// Both widths on the same inputs.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn both(hd: usize, r16: bool, rng: &mut quiver_backend::testing::Rng) -> [Vec<u32>; 2] {
        let q = rng.scaled(hd, 3.0);
        let keys: Vec<Vec<half::f16>> = (0..6)
            .map(|_| {
                rng.scaled(hd, 2.0)
                    .iter()
                    .map(|&x| half::f16::from_f32(x))
                    .collect()
            })
            .collect();
        let ws: Vec<f32> = (0..6).map(|_| rng.f()).collect();
        [
            run::<Avx512>(hd, r16, &q, &keys, &ws),
            run::<Avx2>(hd, r16, &q, &keys, &ws),
        ]
    }

    /// Each key's dot product and each update of the accumulator (MAD with and without the f16
    /// rounding, the rescale) at 16 lanes give the 8-lane bits, at head widths with and without
    /// a remainder of 64 and of 16.
    #[test]
    fn sixteen_lanes_give_the_eight_lane_bits() {
        use quiver_cpu_kernels::SimdLevel;
        if SimdLevel::detected() < SimdLevel::Avx512 {
            println!("skipped: no AVX-512 here");
            return;
        }
        let mut rng = quiver_backend::testing::Rng(0x7f4a_7c15_9e37_79b9);
        for hd in [64, 128, 256, 80, 40] {
            for r16 in [true, false] {
                // SAFETY: the AVX-512 level implies every feature `both` names.
                let [wide, narrow] = unsafe { both(hd, r16, &mut rng) };
                assert_eq!(wide, narrow, "head width {hd}, f16 accumulator {r16}");
            }
        }
    }
}
