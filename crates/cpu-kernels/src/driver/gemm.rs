//! The prefill path: activations packed into a token-interleaved panel, weight rows decoded
//! [`KC`] columns at a time and multiplied with a token tile by the level's micro-kernel.

use super::{act_scales, Acc, Dec, Job, Kernel, Panel, PanelOut, TileIn, TileView, KC, RG};
use crate::act::{self, PanelShape, TILE};
use crate::decode::*;
use crate::shared::SharedMut;
use quiver_quant::{as_blocks, QK_K};

/// Packs tokens `t0..t1` into the panel.
///
/// # Safety
/// `K`'s level is supported by the CPU; no other task packs these tokens concurrently.
#[inline(always)]
pub(crate) unsafe fn pack_tokens<K: Kernel>(
    job: &Job<'_>,
    shape: &PanelShape,
    t0: usize,
    t1: usize,
    po: &PanelOut<'_>,
) {
    let cols = shape.cols;
    for t in t0..t1.min(job.x.len() / cols.max(1)) {
        let tile = t / TILE;
        let (_, _, tpad) = shape.tile(tile);
        let (qo, so) = (shape.q_offset(tile), shape.s_offset(tile));
        let x = &job.x[t * cols..(t + 1) * cols];
        // SAFETY (level): forwarded from the caller. SAFETY (writes): token `t` owns lane
        // `t % TILE` of its tile, and only this task packs token `t`.
        unsafe {
            act::pack_panel_token::<K::Q>(
                x,
                shape.sub,
                act_scales(job.ty),
                tpad,
                t % TILE,
                |k, w| po.q.write(qo + k, w),
                |k, s0, s1| {
                    po.a0.write(so + k, s0);
                    po.a1.write(so + k, s1);
                },
            )
        };
    }
}

/// Rows `r0..r1` of token tile `tile` of a prefill-path matmul.
///
/// # Safety
/// `K`'s level is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn gemm_rows<K: Kernel>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    by_type!(job.ty, legacy: gemm_legacy(job, p, tile, r0, r1, out), k: gemm_k(job, p, tile, r0, r1, out));
}

/// Dispatches the micro-kernel on the sub-block size and wideness.
#[inline(always)]
unsafe fn tile_call<K: Kernel>(
    sub: usize,
    wide: bool,
    dec: &Dec,
    row0: usize,
    kc: usize,
    t: &TileIn<'_>,
    acc: &mut Acc,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (sub, wide) {
            (16, false) => K::tile::<16, false>(dec, row0, kc, t, acc),
            (16, true) => K::tile::<16, true>(dec, row0, kc, t, acc),
            (_, false) => K::tile::<32, false>(dec, row0, kc, t, acc),
            (_, true) => K::tile::<32, true>(dec, row0, kc, t, acc),
        }
    }
}

/// The shared GEMM loop: for each block of `GEMM_R` rows, decode `KC` columns at a time
/// with `decode(row, first block, blocks, dec row index, dec)` and run the micro-kernel.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_loop<K: Kernel>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
    qk: usize,
    sub: usize,
    wide: bool,
    decoder: &impl RowDecoder<K>,
) {
    let Some(TileView {
        q,
        a0,
        a1,
        t0,
        nt,
        tpad,
    }) = p.tile_view(tile)
    else {
        return;
    };
    let mut dec = Dec {
        vals: [[0; KC]; RG],
        s: [[0.0; KC / 16]; RG],
        m: [[0.0; KC / 16]; RG],
    };
    let mut acc: Acc = [[0.0; TILE]; RG];
    // Results per token as contiguous runs of rows (one store run per token and group
    // instead of one scattered store per row and token).
    let mut obuf = [[0f32; RG]; TILE];
    let bpc = KC / qk;
    let nb = job.cols / qk;
    let mut g0 = r0;
    while g0 < r1 {
        let nrg = RG.min(r1 - g0);
        // Row pairs (or whatever GEMM_R is) covering the group; rows past nrg are padding.
        let nr_pad = nrg.div_ceil(K::GEMM_R) * K::GEMM_R;
        for a in acc.iter_mut().take(nr_pad) {
            a.fill(0.0);
        }
        let mut b0 = 0;
        while b0 < nb {
            let nbc = bpc.min(nb - b0);
            for i in 0..nr_pad {
                if i < nrg {
                    // SAFETY: forwarded from the caller.
                    unsafe { decoder.decode(g0 + i, b0, nbc, i, &mut dec) };
                } else {
                    dec.s[i].fill(0.0);
                    dec.m[i].fill(0.0);
                }
            }
            let (c0, kc) = (b0 * qk, nbc * qk);
            let t = TileIn {
                q: &q[c0 / 4 * tpad..],
                a0: &a0[c0 / sub * tpad..],
                a1: &a1[c0 / sub * tpad..],
                tpad,
            };
            let mut row0 = 0;
            while row0 < nr_pad {
                // SAFETY: forwarded from the caller.
                unsafe { tile_call::<K>(sub, wide, &dec, row0, kc, &t, &mut acc) };
                row0 += K::GEMM_R;
            }
            b0 += nbc;
        }
        for (i, a) in acc.iter().enumerate().take(nrg) {
            for (o, &v) in obuf.iter_mut().zip(a.iter()).take(nt) {
                o[i] = v;
            }
        }
        for (lt, o) in obuf.iter().enumerate().take(nt) {
            // SAFETY: this task owns rows r0..r1 of this tile's tokens.
            unsafe { out.write_slice((t0 + lt) * job.rows + g0, &o[..nrg]) };
        }
        g0 += nrg;
    }
}

/// Decodes blocks `b0..b0 + nbc` of weight row `r` into row `i` of a [`Dec`]. A trait
/// rather than a closure: closures are separate functions that would be compiled without
/// the entry point's target features unless inlined.
pub(crate) trait RowDecoder<K: Kernel> {
    /// # Safety
    /// `K`'s level is supported by the CPU.
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec);
}

struct LegacyRows<'a, T: Legacy> {
    w: &'a [T::B],
    nb: usize,
}

impl<K: Kernel, T: Legacy> RowDecoder<K> for LegacyRows<'_, T> {
    #[inline(always)]
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec) {
        let start = r * self.nb + b0;
        let Some(blocks) = self.w.get(start..start + nbc) else {
            return;
        };
        for (j, b) in blocks.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            let (s, m) = unsafe { K::dec_legacy::<T>(b, &mut dec.vals[i][32 * j..32 * j + 32]) };
            dec.s[i][j] = s;
            dec.m[i][j] = m;
        }
    }
}

struct KRows<'a, T: KQuant> {
    w: &'a [T::B],
    nb: usize,
}

impl<K: Kernel, T: KQuant> RowDecoder<K> for KRows<'_, T> {
    #[inline(always)]
    unsafe fn decode(&self, r: usize, b0: usize, nbc: usize, i: usize, dec: &mut Dec) {
        let per = QK_K / T::SUB;
        let start = r * self.nb + b0;
        let Some(blocks) = self.w.get(start..start + nbc) else {
            return;
        };
        for (j, b) in blocks.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            unsafe { K::dec_k::<T>(b, &mut dec.vals[i][QK_K * j..QK_K * (j + 1)]) };
            let ks = T::scales::<K::H>(b);
            k_sub_scales::<T>(
                &ks,
                &mut dec.s[i][per * j..per * (j + 1)],
                &mut dec.m[i][per * j..per * (j + 1)],
            );
        }
    }
}

#[inline(always)]
unsafe fn gemm_legacy<K: Kernel, T: Legacy>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let Some(w) = as_blocks::<T::B>(job.w) else {
        return;
    };
    let d = LegacyRows::<T> {
        w,
        nb: job.cols / 32,
    };
    // SAFETY: forwarded from the caller.
    unsafe { gemm_loop::<K>(job, p, tile, r0, r1, out, 32, 32, T::WIDE, &d) };
}

#[inline(always)]
unsafe fn gemm_k<K: Kernel, T: KQuant>(
    job: &Job<'_>,
    p: &Panel<'_>,
    tile: usize,
    r0: usize,
    r1: usize,
    out: &SharedMut<'_, f32>,
) {
    let Some(w) = as_blocks::<T::B>(job.w) else {
        return;
    };
    let d = KRows::<T> {
        w,
        nb: job.cols / QK_K,
    };
    // SAFETY: forwarded from the caller.
    unsafe { gemm_loop::<K>(job, p, tile, r0, r1, out, QK_K, T::SUB, T::WIDE, &d) };
}
