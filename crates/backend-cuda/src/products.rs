//! Products with the weights (kernels/quant.cu, mmvq.cu, qmm.cu, imm.cu, the activation
//! conversions of ops.cu, and cuBLAS): the launchers of each family of the kernel table
//! (plan.rs) — the matrix-vector kernels (up to three matrices and 8 tokens per launch, or
//! gate·up with the activation fused), qmm / qmv over the GGUF blocks, imm / imv on int8
//! activations, cuBLAS on F16 weights — and how `matmul_qkv` and `matmul_glu` share one copy of
//! the activations between them. The parity mode's products are in src/exact.rs.

use crate::batch::CudaStep;
use crate::kinds::Kind;
use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::plan::Product;
use crate::split::Parts;
use crate::weights::CudaWeight;
use crate::{act_grid, check, derr, registry, CudaBackend};
use quiver_backend::{Activation, Result, Step};
use quiver_gguf::GgmlType;

/// Tokens per matrix-vector launch (the kernels keep one accumulator per token).
pub(crate) const MMV_TOKENS: usize = 8;

/// Matrix-vector launches over at most this many weight bytes prefetch their rows into L2
/// before waiting for the previous kernel (quant.cu `MMV_BEGIN`): measured on the H200, tg128
/// +5% on the SmolLM2 shape and +2% on the Gemma3 shape, neutral on the 8B shapes, whose larger
/// launches lose with it (8B Q4_0 −12% with every launch prefetching, −4% with launches up to
/// 24 MiB doing it; BENCHMARKS.md).
const MMV_PREFETCH_MAX: usize = 4 << 20;

/// The variant of a matrix-vector kernel for `nt` tokens over `bytes` of weights.
fn mmv_name(names: &[String; 4], nt: usize, bytes: usize) -> &str {
    &names[usize::from(nt == 1) + 2 * usize::from(bytes <= MMV_PREFETCH_MAX)]
}

/// One matrix of an `mmv` launch (mirrors `MmvMat` in quant.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MmvMat {
    pub(crate) w: u64,
    pub(crate) y: u64,
    pub(crate) row_bytes: i64,
    pub(crate) rows: i32,
}

/// The `act` argument of the glu kernels.
pub(crate) fn act_code(act: Activation) -> i32 {
    match act {
        Activation::SwiGlu => 0,
        Activation::GeGlu => 1,
    }
}

/// The shapes of `out[rows_x, w.rows] = x[rows_x, w.cols] · Wᵀ`.
pub(crate) fn check_matmul(
    w: &CudaWeight,
    x: &CudaBuf,
    rows_x: usize,
    out: &CudaBuf,
) -> Result<()> {
    check(
        "matmul",
        x.len >= rows_x * w.cols && out.len >= rows_x * w.rows,
        || {
            format!(
                "x {} for {rows_x}×{}, out {} for {rows_x}×{}",
                x.len, w.cols, out.len, w.rows
            )
        },
    )
}

/// Tokens and weight rows of a qmm tile (kernels/qmm.cu `QMM_BN`, `QMM_BM`), threads of its
/// block.
pub(crate) const QMM_BN: usize = 64;
pub(crate) const QMM_BM: usize = 64;
const QMM_THREADS: u32 = 128;

/// Whether a tensor-core product reads int8 activations (`quantize_act`) rather than f16.
fn reads_int8(p: Product) -> bool {
    matches!(p, Product::Imm | Product::Imv)
}

/// The activations a tensor-core product reads: f16 (`to_half`), or int8 (`quantize_act`:
/// quants, scales, and for blocks of 256 the per-16 sums).
#[derive(Clone, Copy)]
enum Act {
    Half(u64),
    Int8 { q: u64, d: u64, s: u64 },
}

/// Tokens per qmv launch (kernels/qmm.cu: one n8 tile).
const QMV_TOKENS: usize = 8;
/// Tokens per imv launch (kernels/imm.cu: up to two n8 tiles).
const IMV_TOKENS: usize = 16;

/// Stages in flight (kernels/qmm.cu `QMM_NST`) and a staged activation row in bytes
/// (`QMM_XLD` halves).
const QMM_NST: usize = 3;
const QMM_XLD_BYTES: usize = 144 * 2;

/// Shared memory a block may take (H100/H200: 227 KiB); a weight whose qmv block would need
/// more (rows of more than ~32k–64k columns) is not batch invariant.
pub(crate) const MAX_SMEM: usize = 227 * 1024;

/// Warps of a qmv block (kernels/qmm.cu `QMV_WARPS`): 8, or 4 for a chunk window over 384 bytes.
fn qmv_warps(winc: usize) -> usize {
    if winc > 384 {
        4
    } else {
        8
    }
}

/// An int8 activation tile's token row in bytes (kernels/qmm.cu `IMM_XLD`).
const IMM_XLD_BYTES: usize = 144;

/// Dynamic shared memory of the imm kernel and of the imv kernel of `nt` n8 tiles for `w`: per
/// stage the int8 activations, their scales (32-blocks: 4 (d, s) pairs per token; the K-quants:
/// the 32-sums split and one d per token) and the weights' windows.
fn imm_smem(w: &CudaWeight, nt: usize) -> (usize, usize) {
    let (win, winc) =
        registry::qmm_window(w.kernel).expect("every CUDA weight type has a qmm window");
    let scales = if registry::int8_activations(w.kernel) == Some(256) {
        5 * QMM_BN * 4
    } else {
        // (d, s) of 4 blocks per token.
        4 * QMM_BN * 8
    };
    let imm = QMM_NST * (QMM_BN * IMM_XLD_BYTES + scales + QMM_BM * win);
    // Two chunk copies per warp, then each warp's sums: 16 rows × 8·nt tokens of i64.
    let imv = 8 * 2 * 16 * winc + 8 * 128 * nt * 8;
    (imm, imv)
}

/// Dynamic shared memory of the qmm and qmv kernels for `w`, and qmv's threads per block.
fn qmm_smem(w: &CudaWeight) -> (usize, usize, u32) {
    let (qmm, qmv, warps) = qmm_smem_of(w.kernel, w.cols);
    (qmm, qmv, 32 * warps as u32)
}

/// [`qmm_smem`] of a weight of type `kernel` and `cols` columns, qmv's warps last.
pub(crate) fn qmm_smem_of(kernel: &str, cols: usize) -> (usize, usize, usize) {
    let (win, winc) =
        registry::qmm_window(kernel).expect("every CUDA weight type has a qmm window");
    let qmm = QMM_NST * (QMM_BN * QMM_XLD_BYTES + QMM_BM * win);
    let warps = qmv_warps(winc);
    // Two chunk copies per warp, then the chunk sums: 16 rows × 8 tokens per 256 columns.
    let qmv = warps * 2 * 16 * winc + cols.div_ceil(256) * 512;
    (qmm, qmv, warps)
}

/// How the fast path runs `matmul_qkv`.
enum QkvPath {
    /// All three on the tensor cores over one f16 copy of x.
    Gemm([Product; 3]),
    /// One matrix-vector launch per 8 tokens for the three (one type, one width).
    Fused,
    /// Three products, each as `matmul` runs it.
    Separate,
}

/// How the fast path runs `matmul_glu`.
enum GluPath {
    /// gate·up with the activation in one matrix-vector launch per 8 tokens.
    Fused,
    /// Both products on the tensor cores over one f16 copy of x, then the glu kernel.
    Gemm(Product, Product),
    /// Two products, each as `matmul` runs it, then the glu kernel.
    Separate,
}

impl CudaBackend {
    /// y[t, r] = W[r, :] · x[t, :] for `n` rows of x at `x`, into `y`, on the family the kernel
    /// table gives the weight for `n` rows; a step's decode rows and prompt rows each on their
    /// kind's family (kinds.rs).
    pub(crate) fn mm(&self, w: &CudaWeight, x: u64, n: usize, y: u64) -> Result<()> {
        if let Some(kind) = self.kind_of(n) {
            return self.mm_as(w, x, n, y, kind);
        }
        let d = self.decode_rows(n);
        self.mm_as(w, x, d, y, Kind::Decode)?;
        let (xo, yo) = ((d * w.cols * 4) as u64, (d * w.rows * 4) as u64);
        self.mm_as(w, x + xo, n - d, y + yo, Kind::Prompt)
    }

    /// `mm` over rows of one kind.
    pub(crate) fn mm_as(&self, w: &CudaWeight, x: u64, n: usize, y: u64, kind: Kind) -> Result<()> {
        if let Some(tc) = self.tensor_core(w, n, kind) {
            let a = self.act(tc, x, n, w)?;
            return self.gemm(w, tc, a, n, y);
        }
        self.mmv(&[(w, y)], x, n)
    }

    /// The tensor-core family of a product of `w` over `n` rows of `kind` (None: the
    /// matrix-vector kernels), from the weight's row of the kernel table.
    fn tensor_core(&self, w: &CudaWeight, n: usize, kind: Kind) -> Option<Product> {
        Some(w.plan.get(kind, n)).filter(|&p| p != Product::Mmv)
    }

    /// x (`n` rows of `w.cols`) as the product `tc` of `w` reads it.
    fn act(&self, tc: Product, x: u64, n: usize, w: &CudaWeight) -> Result<Act> {
        Ok(if reads_int8(tc) {
            let block = registry::int8_activations(w.kernel).unwrap_or(32);
            let (q, d, s) = self.quantize_act(x, n, w.cols, block, w.ty)?;
            Act::Int8 { q, d, s }
        } else {
            Act::Half(self.to_half(x, n, w.cols, w.ty)?)
        })
    }

    /// The experts' grouped product (MoE prompts, `moe_qmm`): for every tile of the list at
    /// `tiles` (kernels/ops.cu `moe_tiles`), 64 sorted pairs of one expert, y = xh · that
    /// expert's `rows` × `w.cols` weights (kernels/qmm.cu `qmm_g_T`); at most `max_tiles`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qmm_grouped(
        &self,
        w: &CudaWeight,
        rows: usize,
        xh: u64,
        y: u64,
        off: u64,
        tiles: u64,
        max_tiles: usize,
    ) -> Result<()> {
        self.launch_smem(
            &w.names.module,
            &w.names.qmm_g,
            (max_tiles as u32, rows.div_ceil(QMM_BM) as u32, 1),
            (QMM_THREADS, 1, 1),
            qmm_smem(w).0 as u32,
            args![
                w.data.ptr,
                w.row_bytes as i64,
                rows as i32,
                w.cols as i32,
                xh,
                y,
                off,
                tiles
            ],
        )
    }

    /// `len` f32 at `x` as f16 at `xh` (no grid rounding).
    pub(crate) fn to_half_plain(&self, x: u64, xh: u64, len: usize) -> Result<()> {
        self.launch(
            "ops",
            "f32_to_f16",
            (grid1(len.div_ceil(4), 256, 8192), 1, 1),
            (256, 1, 1),
            args![x, xh, len as i64],
        )
    }

    /// `rows` × `cols` f32 at `x` as f16 in the activation scratch, for products with weights
    /// of type `ty`: on the int8 grid of that type (see [`act_grid`]).
    fn to_half(&self, x: u64, rows: usize, cols: usize, ty: GgmlType) -> Result<u64> {
        let len = rows * cols;
        let xh = self.scratch_ptr(|s| &mut s.xbf, len * 2, "f16 activations")?;
        match act_grid(ty).filter(|b| cols.is_multiple_of(*b)) {
            Some(block) => {
                let nb = len / block;
                let (name, grid, threads) = if block == 32 {
                    ("f32_to_f16_q32", len.div_ceil(1024), (256, 1, 1))
                } else {
                    ("f32_to_f16_q256", nb.div_ceil(8), (32, 8, 1))
                };
                self.launch(
                    "ops",
                    name,
                    (grid as u32, 1, 1),
                    threads,
                    args![x, xh, nb as i64],
                )?;
            }
            None => self.launch(
                "ops",
                "f32_to_f16",
                (grid1(len.div_ceil(4), 256, 8192), 1, 1),
                (256, 1, 1),
                args![x, xh, len as i64],
            )?,
        }
        Ok(xh)
    }

    /// y[n, w.rows] = x[n, w.cols] · Wᵀ on the tensor cores, by family `tc`: cuBLAS over F16
    /// weights, the qmm kernels over the GGUF blocks (kernels/qmm.cu), the int8 ones
    /// (kernels/imm.cu).
    fn gemm(&self, w: &CudaWeight, tc: Product, a: Act, n: usize, y: u64) -> Result<()> {
        let (xh, q, d, s) = match a {
            Act::Half(xh) => (xh, 0, 0, 0),
            Act::Int8 { q, d, s } => (0, q, d, s),
        };
        match tc {
            Product::Blas => {
                let blas = self.blas.as_ref().expect("the table checked cuBLAS");
                blas.gemm_f16(w.data.ptr, xh, y, w.rows, n, w.cols)
                    .map_err(|e| derr("cublasGemmEx", e))
            }
            Product::Qmm { split } => {
                let splits = if split {
                    self.splits(w, n, Parts::Float)
                } else {
                    1
                };
                let out = self.split_out(splits, n, w.rows, y)?;
                self.launch_smem(
                    &w.names.module,
                    &w.names.qmm,
                    (
                        n.div_ceil(QMM_BN) as u32,
                        w.rows.div_ceil(QMM_BM) as u32,
                        splits as u32,
                    ),
                    (QMM_THREADS, 1, 1),
                    qmm_smem(w).0 as u32,
                    args![
                        w.data.ptr,
                        w.row_bytes as i64,
                        w.rows as i32,
                        w.cols as i32,
                        xh,
                        out,
                        n as i32
                    ],
                )?;
                self.split_sum(splits, n, w.rows, out, y)
            }
            Product::Qmv => {
                let (_, smem, threads) = qmm_smem(w);
                for t in (0..n).step_by(QMV_TOKENS) {
                    let nt = (n - t).min(QMV_TOKENS);
                    self.launch_smem(
                        &w.names.module,
                        &w.names.qmv,
                        (w.rows.div_ceil(16) as u32, 1, 1),
                        (threads, 1, 1),
                        smem as u32,
                        args![
                            w.data.ptr,
                            w.row_bytes as i64,
                            w.rows as i32,
                            w.cols as i32,
                            xh + (t * w.cols * 2) as u64,
                            y + (t * w.rows * 4) as u64,
                            nt as i32
                        ],
                    )?;
                }
                Ok(())
            }
            Product::Imm => {
                let (splits, part, cnt) = self.exact_splits(w, n)?;
                self.launch_smem(
                    &w.names.module,
                    &w.names.imm,
                    (
                        n.div_ceil(QMM_BN) as u32,
                        w.rows.div_ceil(QMM_BM) as u32,
                        splits as u32,
                    ),
                    (QMM_THREADS, 1, 1),
                    imm_smem(w, 1).0 as u32,
                    args![
                        w.data.ptr,
                        w.row_bytes as i64,
                        w.rows as i32,
                        w.cols as i32,
                        q,
                        d,
                        s,
                        y,
                        n as i32,
                        part,
                        cnt
                    ],
                )
            }
            Product::Imv => {
                // Bytes of one token's scales: (d, d·Σq) per 32, or d per 256.
                let d_row = if s == 0 {
                    w.cols / 32 * 8
                } else {
                    w.cols / 256 * 4
                };
                for t in (0..n).step_by(IMV_TOKENS) {
                    let nt = (n - t).min(IMV_TOKENS);
                    // One or two n8 tiles.
                    let k = usize::from(nt > 8);
                    self.launch_smem(
                        &w.names.module,
                        &w.names.imv[k],
                        (w.rows.div_ceil(16) as u32, 1, 1),
                        (256, 1, 1),
                        imm_smem(w, 1 << k).1 as u32,
                        args![
                            w.data.ptr,
                            w.row_bytes as i64,
                            w.rows as i32,
                            w.cols as i32,
                            q + (t * w.cols) as u64,
                            d + (t * d_row) as u64,
                            if s == 0 {
                                0
                            } else {
                                s + (t * w.cols / 4) as u64
                            },
                            y + (t * w.rows * 4) as u64,
                            nt as i32
                        ],
                    )?;
                }
                Ok(())
            }
            Product::Mmv => unreachable!("the matrix-vector kernels are not a tensor-core family"),
        }
    }

    /// Matrix-vector products of up to three matrices of one type over the same x, in one
    /// launch per 8 tokens.
    fn mmv(&self, mats: &[(&CudaWeight, u64)], x: u64, n: usize) -> Result<()> {
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
                    let (q, d, bs) = self.quantize_act(xo, nt, w0.cols, block, w0.ty)?;
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
        let q = self.scratch_ptr(|s| &mut s.aq, n * cols, "int8 activations")?;
        let nb = (n * cols / block) as i64;
        let grid = ((nb as usize).div_ceil(8) as u32, 1, 1);
        if block == 32 {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 32 * 8, "activation scales")?;
            let q8_1 = i32::from(matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1));
            self.launch(
                "ops",
                "quantize_a32",
                grid,
                (32, 8, 1),
                args![x, q, d, nb, q8_1],
            )?;
            Ok((q, d, 0))
        } else {
            let d = self.scratch_ptr(|s| &mut s.ad, n * cols / 256 * 4, "activation scales")?;
            let bs = self.scratch_ptr(
                |s| &mut s.abs,
                crate::scratch::act_sums_bytes(n, cols),
                "activation sums",
            )?;
            self.launch(
                "ops",
                "quantize_a256",
                grid,
                (32, 8, 1),
                args![x, q, d, bs, nb],
            )?;
            Ok((q, d, bs))
        }
    }

    /// The fast path's `matmul_qkv` (shapes checked by the caller).
    pub(crate) fn matmul_qkv_fast(
        &self,
        w: [&CudaWeight; 3],
        x: &CudaBuf,
        rows_x: usize,
        out: [&mut CudaBuf; 3],
    ) -> Result<()> {
        match self.qkv_path(&w, rows_x) {
            QkvPath::Gemm(tcs) => {
                // One copy of x (f16 or int8) for the three products.
                let a = self.act(tcs[0], x.ptr(), rows_x, w[0])?;
                for ((m, o), tc) in w.iter().zip(out).zip(tcs) {
                    self.gemm(m, tc, a, rows_x, o.ptr())?;
                }
                Ok(())
            }
            QkvPath::Fused => self.mmv(
                &[
                    (w[0], out[0].ptr()),
                    (w[1], out[1].ptr()),
                    (w[2], out[2].ptr()),
                ],
                x.ptr(),
                rows_x,
            ),
            QkvPath::Separate => {
                for (m, o) in w.iter().zip(out) {
                    self.mm(m, x.ptr(), rows_x, o.ptr())?;
                }
                Ok(())
            }
        }
    }

    fn qkv_path(&self, w: &[&CudaWeight; 3], rows_x: usize) -> QkvPath {
        // Decode rows and prompt rows: each product in two ranges (`mm`).
        let Some(kind) = self.kind_of(rows_x) else {
            return QkvPath::Separate;
        };
        let same_width = w
            .iter()
            .all(|m| m.cols == w[0].cols && act_grid(m.ty) == act_grid(w[0].ty));
        if let [Some(q), Some(k), Some(v)] = w.map(|m| self.tensor_core(m, rows_x, kind)) {
            if same_width && reads_int8(q) == reads_int8(k) && reads_int8(q) == reads_int8(v) {
                return QkvPath::Gemm([q, k, v]);
            }
        }
        if rows_x <= MMV_TOKENS && w.iter().all(|m| m.ty == w[0].ty && m.cols == w[0].cols) {
            QkvPath::Fused
        } else {
            QkvPath::Separate
        }
    }

    /// The fast path's `matmul_glu`: gate·up fused on the matrix-vector kernels, both
    /// products on cuBLAS, or two products then the glu kernel. Each path checks the buffers
    /// it uses (the fused one never touches `scratch`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_glu_fast(
        &self,
        act: Activation,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: &CudaBuf,
        rows_x: usize,
        scratch: [&mut CudaBuf; 2],
        out: &mut CudaBuf,
    ) -> Result<()> {
        let n_ff = gate.rows;
        let [g, u] = scratch;
        match self.glu_path(gate, up, rows_x) {
            GluPath::Fused => {
                check(
                    "matmul_glu",
                    x.len >= rows_x * gate.cols && out.len >= rows_x * n_ff,
                    || format!("{rows_x} rows"),
                )?;
                return self.mmv_glu(act, gate, up, x.ptr(), rows_x, out.ptr());
            }
            GluPath::Gemm(gh, uh) => {
                check(
                    "matmul_glu",
                    x.len >= rows_x * gate.cols
                        && g.len >= rows_x * n_ff
                        && u.len >= rows_x * up.rows,
                    || format!("{rows_x} rows"),
                )?;
                // One copy of x (f16 or int8) for both products.
                let a = self.act(gh, x.ptr(), rows_x, gate)?;
                self.gemm(gate, gh, a, rows_x, g.ptr())?;
                self.gemm(up, uh, a, rows_x, u.ptr())?;
            }
            GluPath::Separate => {
                check_matmul(gate, x, rows_x, g)?;
                self.mm(gate, x.ptr(), rows_x, g.ptr())?;
                check_matmul(up, x, rows_x, u)?;
                self.mm(up, x.ptr(), rows_x, u.ptr())?;
            }
        }
        let n = rows_x * n_ff;
        check_glu(g, u, n, out)?;
        self.glu_fast(act, g, u, n, out)
    }

    fn glu_path(&self, gate: &CudaWeight, up: &CudaWeight, rows_x: usize) -> GluPath {
        let Some(kind) = self.kind_of(rows_x) else {
            return GluPath::Separate;
        };
        let gh = self.tensor_core(gate, rows_x, kind);
        let fusable = rows_x <= MMV_TOKENS
            && gh.is_none()
            && gate.ty == up.ty
            && gate.rows == up.rows
            && gate.cols == up.cols;
        if fusable {
            return GluPath::Fused;
        }
        match (gh, self.tensor_core(up, rows_x, kind)) {
            (Some(gh), Some(uh))
                if gate.cols == up.cols
                    && act_grid(gate.ty) == act_grid(up.ty)
                    && reads_int8(gh) == reads_int8(uh) =>
            {
                GluPath::Gemm(gh, uh)
            }
            _ => GluPath::Separate,
        }
    }

    /// out = act(x·gateᵀ) · (x·upᵀ) in one matrix-vector launch per 8 tokens (gate and up of
    /// one type and shape).
    fn mmv_glu(
        &self,
        act: Activation,
        gate: &CudaWeight,
        up: &CudaWeight,
        x: u64,
        rows_x: usize,
        out: u64,
    ) -> Result<()> {
        let n_ff = gate.rows;
        let a = act_code(act);
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

    /// The rows of x `matmul_logits` multiplies: x itself when the step's logits rows are
    /// 0..n, else those rows gathered into scratch (shared by the parity mode).
    pub(crate) fn logits_input(
        &self,
        st: &Step<CudaStep>,
        w: &CudaWeight,
        x: &CudaBuf,
        n: usize,
    ) -> Result<u64> {
        if st.ctx.logits_identity {
            return Ok(x.ptr());
        }
        let g = self.scratch_ptr(|s| &mut s.gather, n * w.cols * 4, "logits rows")?;
        self.launch(
            "ops",
            "gather_rows",
            (n as u32, 1, 1),
            (256, 1, 1),
            args![x.ptr(), st.ctx.view.logit_rows, g, w.cols as i32],
        )?;
        Ok(g)
    }
}

/// The shapes of `glu` over `n` elements.
pub(crate) fn check_glu(gate: &CudaBuf, up: &CudaBuf, n: usize, out: &CudaBuf) -> Result<()> {
    check("glu", gate.len >= n && up.len >= n && out.len >= n, || {
        format!("{n} elements")
    })
}
