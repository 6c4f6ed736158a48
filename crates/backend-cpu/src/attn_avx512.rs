//! attn.rs's f16 path with AVX-512: 16 lanes a register where its `F16c` takes 8, the same
//! operations on the same elements, and the dot's additions in the same order (its eight
//! 8-lane sums are the halves of four 16-lane ones), so the same bits; half the instructions a
//! key. Only run where the active SIMD level is AVX-512 (which implies AVX2, FMA and F16C).

use crate::attn::{softmax_group, with_zeros, Keys, Task};
use quiver_backend::{AttnParams, Batch};
use std::arch::x86_64::*;

/// The heads' queries and accumulators, as attn.rs's `F16c`.
struct F16z<'a> {
    q: &'a [f32],
    acc: &'a mut [f32],
    hd: usize,
    r16: bool,
}

/// `acc ← v · w + acc` (MAD) or `acc · w`, each element rounded to f16 when R16: 16 at a time,
/// the rest one by one (a fused multiply-add and a rounding to nearest each, as in the
/// registers).
#[inline(always)]
fn update_row<const MAD: bool, const R16: bool>(acc: &mut [f32], v: &[half::f16], w: f32) {
    let n = acc.len();
    let full = n / 16 * 16;
    assert!(!MAD || v.len() >= n);
    // SAFETY: AVX-512F and F16C per the module's contract; loads and stores of 16 elements
    // below `full` <= the lengths of `acc` and (with MAD) `v`.
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
    for i in full..n {
        let mut y = if MAD {
            v[i].to_f32().mul_add(w, acc[i])
        } else {
            acc[i] * w
        };
        if R16 {
            y = half::f16::from_f32(y).to_f32();
        }
        acc[i] = y;
    }
}

impl F16z<'_> {
    #[inline(always)]
    fn update(&mut self, j: usize, v: Option<&[half::f16]>, w: f32) {
        let acc = &mut self.acc[j * self.hd..][..self.hd];
        match (v, self.r16) {
            (Some(v), true) => update_row::<true, true>(acc, v, w),
            (Some(v), false) => update_row::<true, false>(acc, v, w),
            (None, true) => update_row::<false, true>(acc, &[], w),
            (None, false) => update_row::<false, false>(acc, &[], w),
        }
    }
}

impl Keys for F16z<'_> {
    #[inline(always)]
    fn dot(&mut self, j: usize, b: &[half::f16]) -> f32 {
        let a = &self.q[j * self.hd..][..self.hd];
        let n = a.len().min(b.len());
        let full = n / 64 * 64;
        // SAFETY: AVX-512F and F16C per the module's contract; every load reads 16 elements
        // below `full` <= the length of both slices.
        let reduced = unsafe {
            // z[k] holds attn.rs's v[2k] (lanes 0–7) and v[2k + 1] (lanes 8–15).
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
            // attn.rs: lo = (v0 + v4) + (v2 + v6), hi = (v1 + v5) + (v3 + v7): the low and the
            // high half of (z0 + z2) + (z1 + z3); then the same steps.
            let s = _mm512_add_ps(_mm512_add_ps(z[0], z[2]), _mm512_add_ps(z[1], z[3]));
            let lo = _mm512_castps512_ps256(s);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
            let t3 = _mm256_add_ps(lo, hi);
            let t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps::<1>(t3));
            let u = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
            _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
        };
        let mut sum = reduced as f64;
        for i in full..n {
            sum += (a[i] * b[i].to_f32()) as f64;
        }
        sum as f32
    }
    #[inline(always)]
    fn rescale(&mut self, j: usize, r: f32) {
        self.update(j, None, r);
    }
    #[inline(always)]
    fn mad(&mut self, j: usize, v: &[half::f16], w: f32) {
        self.update(j, Some(v), w);
    }
    #[inline(always)]
    fn finish(&mut self, j: usize, row: &mut [f32], inv: f32) {
        for (r, x) in row.iter_mut().zip(&self.acc[j * self.hd..][..self.hd]) {
            *r = x * inv;
        }
    }
}

/// One task on [`F16z`].
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
    let hd = a.head_dim;
    with_zeros(task.g * hd, |acc| {
        let mut ks = F16z {
            q: task.q,
            acc,
            hd,
            r16,
        };
        softmax_group(
            &mut ks, task.t, task.h0, task.g, k, v, b, a, tiled, task.rows,
        );
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attn::F16c;

    /// The key operations of both widths, one after another on the same inputs: each dot
    /// product, then each update of the accumulators (MAD with and without the f16 rounding,
    /// and the rescale), at head widths with and without a remainder of 64 and of 16.
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
        let mut out = [Vec::new(), Vec::new()];
        let (mut a16, mut a8) = (vec![0f32; hd], vec![0f32; hd]);
        let mut z = F16z {
            q: &q,
            acc: &mut a16,
            hd,
            r16,
        };
        for (k, &w) in keys.iter().zip(&ws) {
            out[0].push(z.dot(0, k).to_bits());
            z.mad(0, k, w);
            z.rescale(0, 0.75 + 0.5 * w.abs());
        }
        let mut c = F16c {
            q: &q,
            acc: &mut a8,
            hd,
            r16,
        };
        for (k, &w) in keys.iter().zip(&ws) {
            out[1].push(c.dot(0, k).to_bits());
            c.mad(0, k, w);
            c.rescale(0, 0.75 + 0.5 * w.abs());
        }
        out[0].extend(a16.iter().map(|x| x.to_bits()));
        out[1].extend(a8.iter().map(|x| x.to_bits()));
        out
    }

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
