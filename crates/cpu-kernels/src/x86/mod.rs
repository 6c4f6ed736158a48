//! x86-64 levels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL/VNNI).
//!
//! Each level has `#[target_feature]` entry points that call the generic drivers with the
//! level's [`Kernel`]; the drivers and kernels are `#[inline(always)]`, so every path is
//! compiled with the level's instructions. The entries are only handed out by
//! `driver::entry` for a level at or below `SimdLevel::detected()`.

mod gemm;
mod kern;
pub(crate) mod unpack;
mod xgemm;
mod xgemm2;

use crate::act::{quantize_a256, quantize_a32, A32Mut, PanelShape, A256, A32};
use crate::decode::{KQuant, Legacy};
use crate::driver::{self, Acc, Acts, Dec, Entry, FloatW, Job, Kernel, Panel, PanelOut, TileIn};
use crate::shared::SharedMut;
use kern::AvxQuant;
use kern::F16c;

pub(crate) struct Avx2;
pub(crate) struct Avx512;

// SAFETY: every method needs AVX2 + FMA + F16C; the drivers only run this kernel inside the
// `avx2` entry points below, which are only used when the CPU has those features.
unsafe impl Kernel for Avx2 {
    type H = F16c;
    type Q = AvxQuant;
    const GEMM_R: usize = gemm::R256;
    #[inline(always)]
    unsafe fn dot_legacy<T: Legacy, const NT: usize>(w: &[T::B], a: &[A32<'_>; NT]) -> [f32; NT] {
        // SAFETY: forwarded.
        // One kernel for every NT, so that a token's result does not depend on how many
        // tokens share the pass (batch invariance).
        unsafe { kern::dot_legacy_multi::<false, T, NT>(w, a) }
    }
    #[inline(always)]
    unsafe fn dot_k<T: KQuant, const NT: usize>(
        w: &[T::B],
        a: &[&[A256]; NT],
        form: u8,
    ) -> [f32; NT] {
        // SAFETY: forwarded.
        unsafe { kern::dot_k_form::<false, T, NT>(w, a, form) }
    }
    #[inline(always)]
    unsafe fn dec_legacy<T: Legacy>(b: &T::B, vals: &mut [u8]) -> (f32, f32) {
        // SAFETY: forwarded.
        unsafe { kern::dec_legacy::<false, T>(b, vals) }
    }
    #[inline(always)]
    unsafe fn dec_k<T: KQuant>(b: &T::B, vals: &mut [u8]) {
        // SAFETY: forwarded.
        unsafe { kern::dec_k::<T>(b, vals) }
    }
    #[inline(always)]
    unsafe fn tile<const SUB: usize, const WIDE: bool>(
        dec: &Dec,
        row0: usize,
        kc: usize,
        t: &TileIn<'_>,
        acc: &mut Acc,
    ) {
        // SAFETY: forwarded.
        unsafe { gemm::tile256::<SUB, WIDE>(dec, row0, kc, t, acc) }
    }
    #[inline(always)]
    unsafe fn float_block<F: FloatW, const NT: usize>(
        w: [&[u8]; 4],
        x: [&[f32]; NT],
        cols: usize,
    ) -> [[f32; NT]; 4] {
        // SAFETY: forwarded.
        unsafe { gemm::float_block256::<F, NT>(w, x, cols) }
    }
}

// SAFETY: every method needs AVX2 + FMA + F16C + AVX-512 F/BW/VL/VNNI; the drivers only run
// this kernel inside the `avx512` entry points below, used only when the CPU has them.
unsafe impl Kernel for Avx512 {
    type H = F16c;
    type Q = AvxQuant;
    const GEMM_R: usize = gemm::R512;
    #[inline(always)]
    unsafe fn dot_legacy<T: Legacy, const NT: usize>(w: &[T::B], a: &[A32<'_>; NT]) -> [f32; NT] {
        // SAFETY: forwarded.
        unsafe { kern::dot_legacy512::<T, NT>(w, a) }
    }
    #[inline(always)]
    unsafe fn dot_k<T: KQuant, const NT: usize>(
        w: &[T::B],
        a: &[&[A256]; NT],
        form: u8,
    ) -> [f32; NT] {
        // SAFETY: forwarded.
        // One kernel for every NT (batch invariance) unless a llama.cpp GEMM form is asked for.
        unsafe { kern::dot_k_form::<true, T, NT>(w, a, form) }
    }
    #[inline(always)]
    unsafe fn dec_legacy<T: Legacy>(b: &T::B, vals: &mut [u8]) -> (f32, f32) {
        // SAFETY: forwarded.
        unsafe { kern::dec_legacy::<true, T>(b, vals) }
    }
    #[inline(always)]
    unsafe fn dec_k<T: KQuant>(b: &T::B, vals: &mut [u8]) {
        // SAFETY: forwarded.
        unsafe { kern::dec_k::<T>(b, vals) }
    }
    #[inline(always)]
    unsafe fn tile<const SUB: usize, const WIDE: bool>(
        dec: &Dec,
        row0: usize,
        kc: usize,
        t: &TileIn<'_>,
        acc: &mut Acc,
    ) {
        // SAFETY: forwarded.
        unsafe { gemm::tile512::<SUB, WIDE>(dec, row0, kc, t, acc) }
    }
    #[inline(always)]
    unsafe fn float_block<F: FloatW, const NT: usize>(
        w: [&[u8]; 4],
        x: [&[f32]; NT],
        cols: usize,
    ) -> [[f32; NT]; 4] {
        // SAFETY: forwarded.
        unsafe { gemm::float_block512::<F, NT>(w, x, cols) }
    }
}

/// Defines one level's `#[target_feature]` entry points and its `Entry` table.
/// `$x`: the level's exact tiles (a module with `xgemm_rows` and `takes`).
macro_rules! level_entries {
    ($entry:ident, $k:ty, $feat:literal, $x:ident) => {
        pub(crate) fn $entry() -> Entry {
            #[target_feature(enable = $feat)]
            unsafe fn qa32(x: &[f32], o: A32Mut<'_>) {
                // SAFETY: this function has the level's features.
                unsafe { quantize_a32::<AvxQuant>(x, o) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn qa256(x: &[f32], o: &mut [A256]) {
                // SAFETY: this function has the level's features.
                unsafe { quantize_a256::<AvxQuant>(x, o) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn pack(j: &Job<'_>, s: &PanelShape, t0: usize, t1: usize, po: &PanelOut<'_>) {
                // SAFETY: this function has the level's features; tokens t0..t1 are this
                // task's.
                unsafe { driver::pack_tokens::<$k>(j, s, t0, t1, po) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn gemv(
                j: &Job<'_>,
                a: &Acts<'_>,
                r0: usize,
                r1: usize,
                o: &SharedMut<'_, f32>,
            ) {
                // SAFETY: this function has the level's features.
                unsafe { driver::gemv_rows::<$k>(j, a, r0, r1, o) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn gemm(
                j: &Job<'_>,
                p: &Panel<'_>,
                t: usize,
                r0: usize,
                r1: usize,
                o: &SharedMut<'_, f32>,
            ) {
                // SAFETY: this function has the level's features.
                unsafe { driver::gemm_rows::<$k>(j, p, t, r0, r1, o) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn float(j: &Job<'_>, r0: usize, r1: usize, o: &SharedMut<'_, f32>) {
                // SAFETY: this function has the level's features.
                unsafe { driver::float_rows::<$k>(j, r0, r1, o) }
            }
            #[target_feature(enable = $feat)]
            unsafe fn exact(
                j: &Job<'_>,
                p: &Panel<'_>,
                t: usize,
                r0: usize,
                r1: usize,
                o: &SharedMut<'_, f32>,
            ) {
                // SAFETY: this function has the level's features.
                unsafe { $x::xgemm_rows(j, p, t, r0, r1, o) }
            }
            // SAFETY (all closures below): `driver::entry` returns this table only for a
            // level the CPU supports (`SimdLevel::detected()` checked these features).
            Entry {
                quantize_a32: |x, o| unsafe { qa32(x, o) },
                quantize_a256: |x, o| unsafe { qa256(x, o) },
                pack: |j, s, t0, t1, po| unsafe { pack(j, s, t0, t1, po) },
                gemv: |j, a, r0, r1, o| unsafe { gemv(j, a, r0, r1, o) },
                gemm: |j, p, t, r0, r1, o| unsafe { gemm(j, p, t, r0, r1, o) },
                float: |j, r0, r1, o| unsafe { float(j, r0, r1, o) },
                xgemm: Some((
                    |j, p, t, r0, r1, o| unsafe { exact(j, p, t, r0, r1, o) },
                    $x::takes,
                )),
            }
        }
    };
}

level_entries!(entry_avx2, Avx2, "avx2,fma,f16c", xgemm2);
level_entries!(
    entry_avx512,
    Avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    xgemm
);
