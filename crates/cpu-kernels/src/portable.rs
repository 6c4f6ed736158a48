//! The portable level: plain Rust over the shared decoders. Used off x86 and as the
//! baseline every SIMD level is tested against (besides the f64 reference).

use crate::act::{quantize_a256, quantize_a32, SoftQuant, A256, A32};
use crate::decode::{KQuant, Legacy, SoftHalf};
use crate::driver::{self, Acc, Dec, Entry, FloatW, Kernel, TileIn};
use quiver_quant::QK_K;

pub(crate) struct Portable;

pub(crate) fn entry() -> Entry {
    Entry {
        // SAFETY (all): the portable level runs on every CPU.
        quantize_a32: |x, o| unsafe { quantize_a32::<SoftQuant>(x, o) },
        quantize_a256: |x, o| unsafe { quantize_a256::<SoftQuant>(x, o) },
        pack: |j, s, t0, t1, po| unsafe { driver::pack_tokens::<Portable>(j, s, t0, t1, po) },
        gemv: |j, a, r0, r1, o| unsafe { driver::gemv_rows::<Portable>(j, a, r0, r1, o) },
        gemm: |j, p, t, r0, r1, o| unsafe { driver::gemm_rows::<Portable>(j, p, t, r0, r1, o) },
        float: |j, r0, r1, o| unsafe { driver::float_rows::<Portable>(j, r0, r1, o) },
        xgemm: None,
    }
}

/// A decoded value as a signed integer.
#[inline(always)]
fn val<const WIDE: bool>(v: u8) -> i32 {
    if WIDE {
        v as i8 as i32
    } else {
        v as i32
    }
}

#[inline(always)]
fn dot_vals<const WIDE: bool>(v: &[u8], q: &[i8]) -> i32 {
    v.iter()
        .zip(q)
        .map(|(&v, &q)| val::<WIDE>(v) * q as i32)
        .sum()
}

/// Element `i` of a float weight row.
#[inline(always)]
pub(crate) fn float_elem<F: FloatW>(w: &[u8], i: usize) -> f32 {
    match F::ID {
        0 => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        1 => quiver_quant::f16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
        _ => f32::from_bits((u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16),
    }
}

/// Float weights to f32, written so that the loops vectorise.
#[inline(always)]
fn convert_row<F: FloatW>(bytes: &[u8], out: &mut [f32]) {
    match F::ID {
        0 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        1 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = quiver_quant::f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
    }
}

#[inline(always)]
fn dot_legacy1<T: Legacy>(w: &[T::B], a: &A32<'_>) -> f32 {
    let mut v = [0u8; 32];
    let mut sum = 0f32;
    let acts = a.q.chunks_exact(32).zip(a.ds.chunks_exact(2));
    for (b, (q, ds)) in w.iter().zip(acts) {
        let (da, sa) = (ds[0], ds[1]);
        T::values(b, &mut v);
        let (d, m) = T::dm::<SoftHalf>(b);
        let dot = if T::WIDE {
            dot_vals::<true>(&v, q)
        } else {
            dot_vals::<false>(&v, q)
        };
        sum += d * da * dot as f32 + m * sa;
    }
    sum
}

#[inline(always)]
fn dot_k1<T: KQuant>(w: &[T::B], a: &[A256]) -> f32 {
    let mut v = [0u8; QK_K];
    let mut sum = 0f32;
    for (b, a) in w.iter().zip(a) {
        T::values(b, &mut v);
        let k = T::scales::<SoftHalf>(b);
        let (mut isum, mut corr) = (0i32, 0i32);
        for h in 0..16 {
            let (v, q) = (&v[16 * h..16 * h + 16], &a.qs[16 * h..16 * h + 16]);
            let dot = if T::WIDE {
                dot_vals::<true>(v, q)
            } else {
                dot_vals::<false>(v, q)
            };
            isum += k.sc[h] as i32 * dot;
            corr += k.corr[h] as i32 * a.bsums[h] as i32;
        }
        sum += a.d * (k.d * isum as f32 + k.cd * corr as f32);
    }
    sum
}

// SAFETY: plain Rust; no instruction-set requirements.
unsafe impl Kernel for Portable {
    type H = SoftHalf;
    type Q = SoftQuant;
    const GEMM_R: usize = 2;

    #[inline(always)]
    unsafe fn dot_legacy<T: Legacy, const NT: usize>(w: &[T::B], a: &[A32<'_>; NT]) -> [f32; NT] {
        a.map(|a| dot_legacy1::<T>(w, &a))
    }

    #[inline(always)]
    unsafe fn dot_k<T: KQuant, const NT: usize>(
        w: &[T::B],
        a: &[&[A256]; NT],
        _form: u8,
    ) -> [f32; NT] {
        a.map(|a| dot_k1::<T>(w, a))
    }

    #[inline(always)]
    unsafe fn dec_legacy<T: Legacy>(b: &T::B, vals: &mut [u8]) -> (f32, f32) {
        let mut v = [0u8; 32];
        T::values(b, &mut v);
        vals[..32].copy_from_slice(&v);
        T::dm::<SoftHalf>(b)
    }

    #[inline(always)]
    unsafe fn dec_k<T: KQuant>(b: &T::B, vals: &mut [u8]) {
        let mut v = [0u8; QK_K];
        T::values(b, &mut v);
        vals[..QK_K].copy_from_slice(&v);
    }

    #[inline(always)]
    unsafe fn tile<const SUB: usize, const WIDE: bool>(
        dec: &Dec,
        row0: usize,
        kc: usize,
        t: &TileIn<'_>,
        acc: &mut Acc,
    ) {
        let tpad = t.tpad;
        for j in 0..kc / SUB {
            for i in row0..(row0 + Self::GEMM_R).min(acc.len()) {
                let mut dots = [0i32; crate::act::TILE];
                for g in 0..SUB / 4 {
                    let c = j * SUB + 4 * g;
                    let w = &dec.vals[i][c..c + 4];
                    let q = &t.q[(c / 4) * tpad..(c / 4 + 1) * tpad];
                    for (d, &word) in dots.iter_mut().zip(q) {
                        let a = word.to_le_bytes();
                        for b in 0..4 {
                            *d += val::<WIDE>(w[b]) * a[b] as i8 as i32;
                        }
                    }
                }
                let (s, m) = (dec.s[i][j], dec.m[i][j]);
                let (a0, a1) = (
                    &t.a0[j * tpad..(j + 1) * tpad],
                    &t.a1[j * tpad..(j + 1) * tpad],
                );
                for (lt, acc) in acc[i].iter_mut().enumerate().take(tpad) {
                    *acc += s * a0[lt] * dots[lt] as f32 + m * a1[lt];
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn float_block<F: FloatW, const NT: usize>(
        w: [&[u8]; 4],
        x: [&[f32]; NT],
        cols: usize,
    ) -> [[f32; NT]; 4] {
        // Columns in chunks of 64: convert the weights once, then 8-lane partial sums that
        // the compiler can keep in vector registers.
        const C: usize = 64;
        let mut part = [[[0f32; 8]; NT]; 4];
        let mut wf = [[0f32; C]; 4];
        let mut c0 = 0;
        while c0 < cols {
            let n = C.min(cols - c0);
            for (wf, w) in wf.iter_mut().zip(w) {
                let bytes = w.get(c0 * F::BYTES..(c0 + n) * F::BYTES).unwrap_or(&[]);
                wf.fill(0.0);
                convert_row::<F>(bytes, &mut wf[..n]);
            }
            for (j, x) in x.iter().enumerate() {
                let mut xf = [0f32; C];
                xf[..n].copy_from_slice(&x[c0..c0 + n]);
                for i in 0..4 {
                    for (wc, xc) in wf[i].chunks_exact(8).zip(xf.chunks_exact(8)) {
                        for l in 0..8 {
                            part[i][j][l] += wc[l] * xc[l];
                        }
                    }
                }
            }
            c0 += n;
        }
        let mut out = [[0f32; NT]; 4];
        for i in 0..4 {
            for j in 0..NT {
                out[i][j] = part[i][j].iter().sum();
            }
        }
        out
    }
}
