//! Float weights (F32/F16/BF16): float FMA over 4 rows x up to 4 tokens register blocks.

use super::{FloatW, Job, Kernel, WBF16, WF16, WF32};
use crate::shared::SharedMut;
use quiver_gguf::GgmlType;

/// Rows `r0..r1` of a float-weight matmul, all tokens, in 4 x 4 blocks.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn float_rows<K: Kernel>(
    job: &Job<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match job.ty {
            GgmlType::F32 => float_rows_t::<K, WF32>(job, r0, r1, out),
            GgmlType::F16 => float_rows_t::<K, WF16>(job, r0, r1, out),
            GgmlType::BF16 => float_rows_t::<K, WBF16>(job, r0, r1, out),
            _ => {}
        }
    }
}

#[inline(always)]
unsafe fn float_rows_t<K: Kernel, F: FloatW>(
    job: &Job<'_>,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let (cols, rb) = (job.cols, job.row_bytes);
    if job.w.len() < job.rows * rb || job.x.len() < job.n_tokens * cols {
        return;
    }
    let row = |r: usize| &job.w[r * rb..(r + 1) * rb];
    let tok = |t: usize| &job.x[t * cols..(t + 1) * cols];
    // A single token under the fast numerics, f32 weights: the order of ggml's `vec_dot_f32`
    // on AVX-512, llama.cpp's product for one token (its tinyBLAS, whose order the blocks below
    // follow, takes two and more), at every SIMD level: the same bits on any CPU.
    if F::ID == 0 && job.n_tokens == 1 && !job.numerics.is_batch_invariant() {
        // SAFETY: any 4 bytes are an f32; the slice is used only where it covers the rows.
        let (pre, w, _) = unsafe { job.w[r0 * rb..r1 * rb].align_to::<f32>() };
        if pre.is_empty() && w.len() >= (r1 - r0) * cols {
            for (r, w) in (r0..r1).zip(w.chunks_exact(cols)) {
                let v = quiver_backend::numerics::f32_dot(w, tok(0));
                // SAFETY: this task owns rows r0..r1.
                unsafe { out.write(r, v) };
            }
            return;
        }
    }
    let mut r = r0;
    while r < r1 {
        let nr = 4.min(r1 - r);
        // Missing rows repeat the last one; their results are dropped.
        let w = [
            row(r),
            row(r + 1.min(nr - 1)),
            row(r + 2.min(nr - 1)),
            row(r + 3.min(nr - 1)),
        ];
        let mut t = 0;
        while t < job.n_tokens {
            let nt = 4.min(job.n_tokens - t);
            let mut put = |i: usize, j: usize, v: f32| {
                // SAFETY: this task owns rows r0..r1.
                unsafe { out.write((t + j) * job.rows + r + i, v) };
            };
            // SAFETY (all four): forwarded from the caller.
            match nt {
                4 => {
                    let v = unsafe {
                        K::float_block::<F, 4>(
                            w,
                            [tok(t), tok(t + 1), tok(t + 2), tok(t + 3)],
                            cols,
                        )
                    };
                    put_block(&v, nr, &mut put);
                }
                3 => {
                    // SAFETY: as above.
                    let v = unsafe {
                        K::float_block::<F, 3>(w, [tok(t), tok(t + 1), tok(t + 2)], cols)
                    };
                    put_block(&v, nr, &mut put);
                }
                2 => {
                    // SAFETY: as above.
                    let v = unsafe { K::float_block::<F, 2>(w, [tok(t), tok(t + 1)], cols) };
                    put_block(&v, nr, &mut put);
                }
                _ => {
                    // SAFETY: as above.
                    let v = unsafe { K::float_block::<F, 1>(w, [tok(t)], cols) };
                    put_block(&v, nr, &mut put);
                }
            }
            t += nt;
        }
        r += nr;
    }
}

/// Hands the first `nr` rows of a float block result to `put(row, token, value)`.
#[inline(always)]
fn put_block<const NT: usize>(
    v: &[[f32; NT]; 4],
    nr: usize,
    put: &mut impl FnMut(usize, usize, f32),
) {
    for (i, v) in v.iter().enumerate().take(nr) {
        for (j, &v) in v.iter().enumerate() {
            put(i, j, v);
        }
    }
}
