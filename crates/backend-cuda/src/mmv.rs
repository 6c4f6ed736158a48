//! The matrix-vector products (kernels/mmv.cu, mmvq.cu): up to three matrices of one type
//! over the same x in one launch per 8 tokens, or gate·up with the activation fused; on int8
//! activations (dp4a; the exact-sum order for the int8 tensor-core types with the
//! batch-invariant numerics) where the type has them, else on f32. And the activation
//! quantizer the int8 kernels read.

use crate::norm::ActForm;
use crate::weights::CudaWeight;
use crate::{registry, CudaBackend};
use quiver_backend::Result;
use quiver_gguf::GgmlType;

/// Tokens per matrix-vector launch (the kernels keep one accumulator per token).
pub(crate) const MMV_TOKENS: usize = 8;
/// Matrix-vector launches over at most this many weight bytes prefetch their rows into L2
/// before waiting for the previous kernel (mmv.cu `MMV_BEGIN`): measured on the H200, tg128
/// +5% on the SmolLM2 shape and +2% on the Gemma3 shape, neutral on the 8B shapes, whose larger
/// launches lose with it (8B Q4_0 −12% with every launch prefetching, −4% with launches up to
/// 24 MiB doing it; BENCHMARKS.md).
const MMV_PREFETCH_MAX: usize = 4 << 20;
/// The variant of a matrix-vector kernel for `nt` tokens over `bytes` of weights.
fn mmv_name(names: &[String; 4], nt: usize, bytes: usize) -> &str {
    &names[usize::from(nt == 1) + 2 * usize::from(bytes <= MMV_PREFETCH_MAX)]
}
/// One matrix of an `mmv` launch (mirrors `MmvMat` in mmv.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MmvMat {
    pub(crate) w: u64,
    pub(crate) y: u64,
    pub(crate) row_bytes: i64,
    pub(crate) rows: i32,
}

impl CudaBackend {
    /// Matrix-vector products of up to three matrices of one type over the same x, in one
    /// launch per 8 tokens.
    pub(crate) fn mmv(&self, mats: &[(&CudaWeight, u64)], x: u64, n: usize) -> Result<()> {
        self.mmv_quantized(mats, x, n, None)
    }

    /// [`mmv`](Self::mmv), the int8 activations of an int8 type from `made` where
    /// `quantize_act` has made them (`n` ≤ 8 tokens: one launch's).
    pub(crate) fn mmv_quantized(
        &self,
        mats: &[(&CudaWeight, u64)],
        x: u64,
        n: usize,
        made: Option<(u64, u64, u64)>,
    ) -> Result<()> {
        debug_assert!(made.is_none() || n <= MMV_TOKENS);
        let w0 = mats[0].0;
        let module = &w0.names.module;
        let int8 = self.int8_block(w0);
        let total_rows: usize = mats.iter().map(|(w, _)| w.rows).sum();
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(MMV_TOKENS);
            let mut m = [MmvMat::default(); 3];
            for (i, (w, y)) in mats.iter().enumerate() {
                m[i] = MmvMat {
                    w: w.data.ptr,
                    y: y + (t * w.rows * 4) as u64,
                    row_bytes: w.row_bytes as i64,
                    rows: w.rows as i32,
                };
            }
            let xo = x + (t * w0.cols * 4) as u64;
            let grid = (total_rows.div_ceil(4) as u32, 1, 1);
            let bytes = mats.iter().map(|(w, _)| w.rows * w.row_bytes).sum();
            let name = mmv_name(&w0.names.mmv, nt, bytes);
            match int8 {
                Some(block) => {
                    let (q, d, bs) = match made {
                        Some(q) => q,
                        None => self.quantize_act(xo, nt, w0.cols, block, w0.ty)?,
                    };
                    self.launch(
                        module,
                        name,
                        grid,
                        (32, 4, 1),
                        args![m[0], m[1], m[2], q, d, bs, w0.cols as i32, nt as i32],
                    )?;
                }
                None => self.launch(
                    module,
                    name,
                    grid,
                    (32, 4, 1),
                    args![m[0], m[1], m[2], xo, w0.cols as i32, nt as i32],
                )?,
            }
            t += nt;
        }
        Ok(())
    }

    /// out = act(x·gateᵀ) · (x·upᵀ) in one matrix-vector launch per 8 tokens (gate and up of
    /// one type and shape).
    pub(crate) fn mmv_glu(
        &self,
        a: i32,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: u64,
        rows_x: usize,
        out: u64,
    ) -> Result<()> {
        let n_ff = gate.rows;
        let module = &gate.names.module;
        let int8 = self.int8_block(gate);
        let grid = (n_ff.div_ceil(4) as u32, 1, 1);
        let mut t = 0;
        while t < rows_x {
            let nt = (rows_x - t).min(MMV_TOKENS);
            let xo = x + (t * gate.cols * 4) as u64;
            let oo = out + (t * n_ff * 4) as u64;
            let name = mmv_name(&gate.names.glu, nt, 2 * gate.rows * gate.row_bytes);
            match int8 {
                Some(block) => {
                    let (q, d, bs) = self.quantize_act(xo, nt, gate.cols, block, gate.ty)?;
                    self.launch(
                        module,
                        name,
                        grid,
                        (32, 4, 1),
                        args![
                            gate.data.ptr,
                            up.data.ptr,
                            gate.row_bytes as i64,
                            q,
                            d,
                            bs,
                            oo,
                            n_ff as i32,
                            gate.cols as i32,
                            nt as i32,
                            a
                        ],
                    )?;
                }
                None => self.launch(
                    module,
                    name,
                    grid,
                    (32, 4, 1),
                    args![
                        gate.data.ptr,
                        up.data.ptr,
                        gate.row_bytes as i64,
                        xo,
                        oo,
                        n_ff as i32,
                        gate.cols as i32,
                        nt as i32,
                        a
                    ],
                )?,
            }
            t += nt;
        }
        Ok(())
    }

    /// The activation block size when `w`'s decode kernels take int8 activations.
    fn int8_block(&self, w: &CudaWeight) -> Option<usize> {
        registry::int8_activations(w.kernel)
    }

    /// Quantizes `n` rows of `cols` f32 at `x` to int8 blocks of `block` (32 or 256) in the
    /// activation scratch: (quants, scales, per-16 sums).
    /// The scales are rounded as the CPU backend (and ggml) rounds them for weights of type
    /// `ty`: per-32 `d` in f16, and for Q4_1/Q5_1 the offset sum `s` in f16 too. (The parity
    /// mode's products take the same activations.)
    pub(crate) fn quantize_act(
        &self,
        x: u64,
        n: usize,
        cols: usize,
        block: usize,
        ty: GgmlType,
    ) -> Result<(u64, u64, u64)> {
        self.quantize_act_as(x, n, cols, block, ty, false)
    }

    /// [`quantize_act`](Self::quantize_act) with, for blocks of 256 and `tiled`, the quants in
    /// imm on wgmma's tiles (ops.cu `quantize_a256`: piece c of 16 values of token t at
    /// (c · n + t) · 16 bytes).
    pub(crate) fn quantize_act_as(
        &self,
        x: u64,
        n: usize,
        cols: usize,
        block: usize,
        ty: GgmlType,
        tiled: bool,
    ) -> Result<(u64, u64, u64)> {
        let form = ActForm::new(block, ty, tiled);
        if let Some(made) = self.norm_made(x, n, cols, form)? {
            return Ok(made);
        }
        let (q, d, bs) = self.act_scratch(n, cols, block)?;
        let nb = (n * cols / block) as i64;
        let grid = ((nb as usize).div_ceil(8) as u32, 1, 1);
        if block == 32 {
            self.launch(
                "ops",
                "quantize_a32",
                grid,
                (32, 8, 1),
                args![x, q, d, nb, i32::from(form.q8_1)],
            )?;
        } else {
            self.launch(
                "ops",
                "quantize_a256",
                grid,
                (32, 8, 1),
                args![
                    x,
                    q,
                    d,
                    bs,
                    nb,
                    (cols / 256) as i32,
                    if tiled { n as i32 } else { 0 }
                ],
            )?;
        }
        Ok((q, d, bs))
    }

    /// The activation scratch for `n` rows of `cols` in int8 blocks of `block`: (quants,
    /// scales, per-16 sums; 0 for blocks of 32).
    pub(crate) fn act_scratch(
        &self,
        n: usize,
        cols: usize,
        block: usize,
    ) -> Result<(u64, u64, u64)> {
        let q = self.scratch_ptr(|s| &mut s.aq, n * cols, "int8 activations")?;
        if block == 32 {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 32 * 8, "activation scales")?;
            Ok((q, d, 0))
        } else {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 256 * 4, "activation scales")?;
            let bs = self.scratch_ptr(
                |s| &mut s.abs,
                crate::scratch::act_sums_bytes(n, cols),
                "activation sums",
            )?;
            Ok((q, d, bs))
        }
    }
}
