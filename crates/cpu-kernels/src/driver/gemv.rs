//! The decode path: fused dot products of each weight row with up to 4 tokens per pass.

use super::{Acts, Job, Kernel};
use crate::decode::*;
use crate::prefetch;
use crate::shared::SharedMut;
use quiver_quant::{as_blocks, QK_K};

/// Rows `r0..r1` of a decode-path matmul.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn gemv_rows<K: Kernel>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    by_type!(job.ty, legacy: gemv_legacy(job, acts, r0, r1, out), k: gemv_k(job, acts, r0, r1, out));
}

#[inline(always)]
unsafe fn gemv_legacy<K: Kernel, T: Legacy>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (Some(w), Acts::A32(a)) = (as_blocks::<T::B>(job.w), acts) else {
        return;
    };
    let nb = job.cols / 32;
    let n = job.n_tokens;
    if a.len() < n * nb || w.len() < r1 * nb {
        return;
    }
    // No closures around kernel calls here: a closure is its own function, compiled without
    // the entry point's target features unless LLVM happens to inline it.
    let (ahead, row_bytes) = (prefetch::distance(), std::mem::size_of::<T::B>() * nb);
    let mut r = r0;
    if n == 1 {
        let a0 = a.blocks(0, nb);
        while r + 2 <= r1 {
            prefetch::rows(job.w, r * row_bytes, (r + 2) * row_bytes, ahead);
            let rows = [&w[r * nb..(r + 1) * nb], &w[(r + 1) * nb..(r + 2) * nb]];
            // SAFETY: the caller guarantees the level; the calling task owns rows r0..r1.
            unsafe {
                let v = K::dot_legacy_rows2::<T>(rows, &a0);
                out.write(r, v[0]);
                out.write(r + 1, v[1]);
            }
            r += 2;
        }
    }
    for r in r..r1 {
        prefetch::rows(job.w, r * row_bytes, (r + 1) * row_bytes, ahead);
        let w = &w[r * nb..(r + 1) * nb];
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            let tok = |j: usize| a.blocks((t + j) * nb, (t + j + 1) * nb);
            // SAFETY: the caller guarantees the level.
            let v = unsafe {
                match nt {
                    4 => pad(K::dot_legacy::<T, 4>(w, &[tok(0), tok(1), tok(2), tok(3)])),
                    3 => pad(K::dot_legacy::<T, 3>(w, &[tok(0), tok(1), tok(2)])),
                    2 => pad(K::dot_legacy::<T, 2>(w, &[tok(0), tok(1)])),
                    _ => pad(K::dot_legacy::<T, 1>(w, &[tok(0)])),
                }
            };
            put_group(out, &v, t, nt, job.rows, r);
            t += nt;
        }
    }
}

#[inline(always)]
unsafe fn gemv_k<K: Kernel, T: KQuant>(
    job: &Job<'_>,
    acts: &Acts<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (Some(w), Acts::A256(a)) = (as_blocks::<T::B>(job.w), acts) else {
        return;
    };
    let nb = job.cols / QK_K;
    let n = job.n_tokens;
    if a.len() < n * nb || w.len() < r1 * nb {
        return;
    }
    // Single-sequence callers (`Numerics::Fast`) round as the llama.cpp kernel the same
    // batch takes: its tiled kernel from 8 tokens for the types it covers, its repacked Q4_K
    // GEMM for each whole group of four tokens (the rest through its GEMV); batch-invariant
    // runs take the one-token form throughout.
    use crate::decode::{FORM_GEMM4, FORM_TILED, FORM_VEC, GGML_Q4K};
    let mirror = !job.numerics.is_batch_invariant();
    let form = |nt: usize| {
        if mirror && T::TILED && n >= 8 {
            FORM_TILED
        } else if mirror && nt == 4 && T::GGML == GGML_Q4K {
            FORM_GEMM4
        } else {
            FORM_VEC
        }
    };
    let (ahead, row_bytes) = (prefetch::distance(), std::mem::size_of::<T::B>() * nb);
    for r in r0..r1 {
        prefetch::rows(job.w, r * row_bytes, (r + 1) * row_bytes, ahead);
        let w = &w[r * nb..(r + 1) * nb];
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            let tok = |j: usize| &a[(t + j) * nb..(t + j + 1) * nb];
            // SAFETY: the caller guarantees the level.
            let v = unsafe {
                match nt {
                    4 => pad(K::dot_k::<T, 4>(
                        w,
                        &[tok(0), tok(1), tok(2), tok(3)],
                        form(4),
                    )),
                    3 => pad(K::dot_k::<T, 3>(w, &[tok(0), tok(1), tok(2)], form(3))),
                    2 => pad(K::dot_k::<T, 2>(w, &[tok(0), tok(1)], form(2))),
                    _ => pad(K::dot_k::<T, 1>(w, &[tok(0)], form(1))),
                }
            };
            put_group(out, &v, t, nt, job.rows, r);
            t += nt;
        }
    }
}

/// Stores `out[t + j, r] = v[j]` for `j < nt`.
#[inline(always)]
fn put_group(out: &SharedMut<'_, f32>, v: &[f32; 4], t: usize, nt: usize, rows: usize, r: usize) {
    for (j, &v) in v.iter().enumerate().take(nt) {
        // SAFETY: the calling task owns row r (for every token).
        unsafe { out.write((t + j) * rows + r, v) };
    }
}

/// Up to 4 results as a 4-array.
#[inline(always)]
fn pad<const N: usize>(v: [f32; N]) -> [f32; 4] {
    let mut o = [0f32; 4];
    for (o, v) in o.iter_mut().zip(v) {
        *o = v;
    }
    o
}
