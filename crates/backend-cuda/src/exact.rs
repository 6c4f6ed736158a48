//! The parity mode (`--numerics parity`, `Numerics::Parity`): every op through the "exact"
//! module's kernels, which compute what the CPU backend computes for a batch-invariant step,
//! operation for operation (kernels/exact.cu). The two backends then give the same logits, bit
//! for bit — and, where the CPU reproduces llama.cpp's CPU floats, those too. Graphs are off
//! and every product runs one thread per output: a reference-grade path, far slower than the
//! default one.
//!
//! [`ParityBackend`](crate::ParityBackend) (src/parity.rs) runs each op through [`Parity`]'s
//! entry point, one per op; the fast backend has no parity branch. An entry point either
//! launches this mode's kernel or, where the fast path's
//! kernel already computes what the CPU computes, says so and runs that kernel (the residual
//! add: one f32 add; argmax and top-k: comparisons; the logits rows gather: a copy). An op
//! added later without a kernel here returns [`missing`]'s error, naming the op: never a
//! silent fall back to the fast path.
//!
//! What comes from the host: the rope's sines and cosines (the CPU backend's own
//! [`RopeAngles`], uploaded per step), GELU's table (as ggml's) and which SIMD level the CPU
//! backend runs (the Q2_K/Q3_K/Q5_K forms depend on it). The activation quantizers of the fast
//! path already round as the CPU does and are shared. Soft-capping (Gemma 2) is the fast path's
//! kernel (libm's tanhf is not reproduced).

use crate::batch::CudaStep;
use crate::dev::DevBuf;
use crate::launch::grid1;
use crate::memory::{CudaBuf, CudaKv};
use crate::norm::Norm;
use crate::products::{act_code, check_glu, check_matmul};
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::{
    reference, Activation, AttnParams, BackendError, Result, RopeAngles, RopeMode, RopeParams,
    Step, WeightBytes,
};
use quiver_cpu_kernels::SimdLevel;
use quiver_gguf::GgmlType;
use std::sync::Mutex;

/// The activation blocks of the parity mode's product for `ty` (32: the legacy types, 256:
/// the K-quants), or None when it has none.
pub(crate) fn act_block(ty: GgmlType) -> Option<usize> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => Some(32),
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Some(256),
        _ => None,
    }
}

/// The parity mode's state: its scratch (the fast path's is src/scratch.rs) and entry points.
#[derive(Default)]
pub(crate) struct Parity {
    scratch: Mutex<ParityScratch>,
}

#[derive(Default)]
struct ParityScratch {
    /// The rope sines and cosines of the step, and their host staging (reused step to step).
    sincos: Option<DevBuf>,
    sincos_host: Vec<f32>,
    /// GELU of every f16, as ggml's table, uploaded once.
    gelu: Option<DevBuf>,
    gelu_filled: bool,
}

impl Parity {
    /// A matrix weight: the GGUF bytes only (no f16 copies); types without a product here are
    /// refused.
    pub(crate) fn weight(
        &self,
        be: &CudaBackend,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &WeightBytes,
    ) -> Result<CudaWeight> {
        let w = be.matrix_weight(name, ty, rows, cols, bytes)?;
        if act_block(ty).is_none() {
            return Err(BackendError::Unsupported {
                op: "matmul (--numerics parity)",
                ty,
                backend: "cuda",
            });
        }
        Ok(w)
    }

    /// The gather, rounding as the CPU's dequantizer (shapes checked by the caller).
    pub(crate) fn embed(
        &self,
        be: &CudaBackend,
        st: &Step<CudaStep>,
        table: &CudaWeight,
        scale: f32,
        out: &mut CudaBuf,
    ) -> Result<()> {
        be.launch_embed(st, ("exact", &table.names.x_embed), table, 0, scale, out)
    }

    /// The norm of `n.rows` > 0 rows, f64-summed as the CPU's (shapes checked by the caller).
    pub(crate) fn norm(&self, be: &CudaBackend, n: &Norm) -> Result<()> {
        be.launch(
            "exact",
            "x_rms_norm",
            (n.rows.div_ceil(64) as u32, 1, 1),
            (64, 1, 1),
            args![
                n.residual_ptr(),
                n.x.0,
                n.w.data.ptr,
                n.out.0,
                n.rows as i32,
                n.w.cols as i32,
                n.eps
            ],
        )
    }

    /// The residual add: one f32 add per element, which the fast path's kernel already is.
    pub(crate) fn add(&self, be: &CudaBackend, a: u64, b: u64, n: usize) -> Result<()> {
        be.add_kernel(a, b, n)
    }

    /// y[t, r] = W[r] · x[t] for `n` tokens, rounded as the CPU's decode path rounds.
    pub(crate) fn mm(
        &self,
        be: &CudaBackend,
        w: &CudaWeight,
        x: u64,
        n: usize,
        y: u64,
    ) -> Result<()> {
        let block = act_block(w.ty).ok_or(BackendError::Unsupported {
            op: "matmul (--numerics parity)",
            ty: w.ty,
            backend: "cuda",
        })?;
        if n == 0 {
            return Ok(());
        }
        let (q, d, bs) = be.quantize_act(x, n, w.cols, block, w.ty)?;
        be.launch(
            "exact",
            &w.names.x_mm,
            (w.rows.div_ceil(128) as u32, n as u32, 1),
            (128, 1, 1),
            args![
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                (w.cols / block) as i32,
                q,
                d,
                bs,
                y,
                i32::from(quiver_cpu_kernels::SimdLevel::active() == SimdLevel::Avx512)
            ],
        )
    }

    /// The two products into `scratch`, then the glu (the CPU's order).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_glu(
        &self,
        be: &CudaBackend,
        act: Activation,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: &CudaBuf,
        rows_x: usize,
        scratch: [&mut CudaBuf; 2],
        out: &mut CudaBuf,
    ) -> Result<()> {
        let [g, u] = scratch;
        check_matmul(gate, x, rows_x, g)?;
        self.mm(be, gate, x.ptr(), rows_x, g.ptr())?;
        check_matmul(up, x, rows_x, u)?;
        self.mm(be, up, x.ptr(), rows_x, u.ptr())?;
        let n = rows_x * gate.rows;
        check_glu(g, u, n, out)?;
        self.glu(be, act, g, u, n, out)
    }

    /// The product over the step's `n` > 0 logits rows (gathered as the fast path gathers
    /// them: a copy).
    pub(crate) fn matmul_logits(
        &self,
        be: &CudaBackend,
        st: &Step<CudaStep>,
        w: &CudaWeight,
        x: &CudaBuf,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let rows = be.logits_input(st, w, x, n)?;
        self.mm(be, w, rows, n, out.ptr())
    }

    /// Rope with the CPU's angles, q scaled (where the model says) and rounded to f16, k and v
    /// into the cache.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_kv_write(
        &self,
        be: &CudaBackend,
        st: &Step<CudaStep>,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        rope: &RopeParams,
        a: &AttnParams,
        kv: &mut CudaKv,
    ) -> Result<()> {
        let n = st.rows;
        if n == 0 {
            return Ok(());
        }
        check(
            "rope_kv_write",
            rope.n_dims / 2 <= quiver_backend::ROPE_MAX_PAIRS,
            || format!("{} rotated dims", rope.n_dims),
        )?;
        check("rope_kv_write", rope.q_temp.is_none(), || {
            "the parity mode has no attention temperature (Mistral 3)".into()
        })?;
        let angles = RopeAngles::new(rope);
        let half = angles.pairs();
        let mut s = self.scratch.lock().unwrap();
        let s = &mut *s;
        let table = &mut s.sincos_host;
        table.clear();
        table.resize(n * 2 * half, 0.0);
        for (t, row) in table.chunks_exact_mut(2 * half.max(1)).enumerate() {
            let (sin, cos) = row.split_at_mut(half);
            angles.at(st.batch.positions[t], sin, cos);
        }
        let sc = be.grow(&mut s.sincos, table.len().max(1) * 4, "rope angles")?;
        be.dev.htod_sync(sc, table).map_err(BackendError::Device)?;
        let q_scale = if a.scale_q { a.scale } else { 1.0 };
        be.launch(
            "exact",
            "x_rope_kv_write",
            (n as u32, (a.n_head + a.n_head_kv) as u32, 1),
            (32, 1, 1),
            args![
                q.ptr(),
                k.ptr(),
                v.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                sc,
                st.ctx.view,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.head_dim as i32,
                rope.n_dims as i32,
                i32::from(rope.mode == RopeMode::Neox),
                q_scale
            ],
        )
    }

    /// One thread per (token, head) over the step's `n` > 0 rows, as the CPU's one-row
    /// attention (the shared shapes checked by the caller).
    pub(crate) fn attention(
        &self,
        be: &CudaBackend,
        st: &Step<CudaStep>,
        q: &CudaBuf,
        kv: &CudaKv,
        a: &AttnParams,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n = st.rows;
        check("attention", a.head_dim <= 256 && a.n_head <= 1024, || {
            format!(
                "head dim {} / {} heads (--numerics parity takes up to 256 / 1024)",
                a.head_dim, a.n_head
            )
        })?;
        let scale = if a.scale_q { 1.0 } else { a.scale };
        be.launch(
            "exact",
            "x_attention",
            (n as u32, 1, 1),
            (a.n_head as u32, 1, 1),
            args![
                q.ptr(),
                kv.k.ptr,
                kv.v.ptr,
                out.ptr(),
                st.ctx.view,
                a.n_head as i32,
                a.n_head_kv as i32,
                a.head_dim as i32,
                scale,
                a.window.map(|w| w as i32).unwrap_or(0),
                a.softcap.unwrap_or(0.0)
            ],
        )
    }

    /// out = act(gate) · up with ggml's GELU table (shapes checked by the caller).
    pub(crate) fn glu(
        &self,
        be: &CudaBackend,
        act: Activation,
        gate: &CudaBuf,
        up: &CudaBuf,
        n: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let table = {
            let mut s = self.scratch.lock().unwrap();
            let table = be.grow(&mut s.gelu, 65536 * 4, "gelu table")?;
            if !s.gelu_filled {
                let t: Vec<f32> = (0..=u16::MAX)
                    .map(|b| reference::gelu_tanh_f16(quiver_quant::f16_to_f32(b.to_le_bytes())))
                    .collect();
                be.dev.htod_sync(table, &t).map_err(BackendError::Device)?;
                s.gelu_filled = true;
            }
            table
        };
        be.launch(
            "exact",
            "x_glu",
            (grid1(n, 256, 8192), 1, 1),
            (256, 1, 1),
            args![
                gate.ptr(),
                up.ptr(),
                out.ptr(),
                n as i64,
                act_code(act),
                table
            ],
        )
    }

    /// Soft-capping (Gemma 2): the fast path's kernel, deliberately (libm's tanhf is not
    /// reproduced).
    pub(crate) fn softcap(
        &self,
        be: &CudaBackend,
        x: &mut CudaBuf,
        cap: f32,
        n: usize,
    ) -> Result<()> {
        be.softcap_kernel(x, cap, n)
    }

    /// Top-k: comparisons, which the fast path's kernel already makes as the CPU does.
    pub(crate) fn top_k(
        &self,
        be: &CudaBackend,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<()> {
        be.top_k_rows(x, rows, cols, k, out)
    }

    /// Argmax: comparisons, which the fast path's kernel already makes as the CPU does.
    pub(crate) fn argmax(
        &self,
        be: &CudaBackend,
        x: &CudaBuf,
        rows: usize,
        cols: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        be.argmax_rows(x, rows, cols, out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// A C hex float literal (`0x1.8p+52`) to f64, exactly.
    fn hex_float(s: &str) -> f64 {
        let s = s.trim().trim_start_matches("0x").trim_end_matches('f');
        let (mant, exp) = s.split_once('p').expect("a binary exponent");
        let (int, frac) = mant.split_once('.').unwrap_or((mant, ""));
        let digits = format!("{int}{frac}");
        let m = u64::from_str_radix(&digits, 16).expect("hex digits") as f64;
        let e: i32 = exp.parse().expect("an exponent");
        m * 2f64.powi(e - 4 * frac.len() as i32)
    }

    /// The value of `#define NAME (A / B)` or `#define NAME A` in the kernel source (A a hex
    /// float, with an `f` suffix or none).
    pub(crate) fn define(src: &str, name: &str) -> f64 {
        let line = src
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("no {name}"));
        let v = line[format!("#define {name} ").len()..]
            .trim()
            .trim_matches(|c| c == '(' || c == ')');
        match v.split_once(" / ") {
            Some((a, b)) => hex_float(a) / b.parse::<f64>().unwrap(),
            None => hex_float(v),
        }
    }

    /// The parity mode's e^x (exact.cu `exp_f32`), run on the host with the constants read from
    /// the kernel source, gives the host libm's expf — what the CPU backend's attention calls —
    /// for every input tried (a correctly rounded e^x differs on ~7 in 10,000).
    #[test]
    fn the_parity_modes_exp_is_the_host_expf() {
        let src = crate::registry::module_source("exact").unwrap();
        let at = src.find("EXPF_TAB[32] = {").expect("the table") + 16;
        let tab: Vec<u64> = src[at..src[at..].find("};").unwrap() + at]
            .split(',')
            .map(|v| v.trim().trim_end_matches("ull").trim_start_matches("0x"))
            .filter(|v| !v.is_empty())
            .map(|v| u64::from_str_radix(v, 16).unwrap())
            .collect();
        assert_eq!(tab.len(), 32);
        let (inv, shift) = (define(&src, "EXPF_INV_LN2_32"), define(&src, "EXPF_SHIFT"));
        let c = [
            define(&src, "EXPF_C0"),
            define(&src, "EXPF_C1"),
            define(&src, "EXPF_C2"),
        ];
        let exp = |x: f32| -> f32 {
            if x.is_nan() {
                return x + x;
            }
            if x < -103.972_08 {
                return 0.0;
            }
            if x > 88.722_83 {
                return f32::INFINITY;
            }
            let z = inv * x as f64;
            let kd = z + shift;
            let ki = kd.to_bits();
            let r = z - (kd - shift);
            let s = f64::from_bits(tab[(ki % 32) as usize].wrapping_add(ki << 47));
            let y = c[0].mul_add(r, c[1]).mul_add(r * r, c[2].mul_add(r, 1.0));
            (y * s) as f32
        };
        let (mut x, mut n, mut rounded_differs) = (0x1234_5678u32, 0, 0);
        for i in 0..400_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = match i % 4 {
                0 => -(x as f32 / u32::MAX as f32) * 104.0,
                1 => (x as f32 / u32::MAX as f32) * 177.0 - 88.0,
                2 => -(x as f32 / u32::MAX as f32) * 4.0,
                _ => -(x as f32 / u32::MAX as f32) * 0.01,
            };
            let want = v.exp();
            assert_eq!(
                exp(v).to_bits(),
                want.to_bits(),
                "e^{v:e}: {} vs {want}",
                exp(v)
            );
            rounded_differs += usize::from(((v as f64).exp() as f32).to_bits() != want.to_bits());
            n += 1;
        }
        for v in [0.0f32, -0.0, f32::NEG_INFINITY, -103.9, -87.5, 88.7, -1e-30] {
            assert_eq!(exp(v).to_bits(), v.exp().to_bits(), "e^{v:e}");
        }
        // The point of the exercise: a correctly rounded e^x would not do.
        assert!(rounded_differs > 0, "{rounded_differs} of {n}");
    }
}
