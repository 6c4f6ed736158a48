//! Products with the weights: each runs on the family the kernel table (plan.rs) gives its
//! weight for its rows, through that family's launcher — the matrix-vector kernels (mmv.rs),
//! qmm / qmv (qmm.rs), imm / imv (imm.rs), cuBLAS on F16 weights — over the activations the
//! family reads (f16 on the weight type's int8 grid, ops.cu; or int8, mmv.rs
//! `quantize_act`); `matmul_many` and `matmul_glu` share one copy of the activations between
//! their products. The parity mode's products are in src/exact.rs.

use crate::batch::CudaStep;
use crate::kinds::Kind;
use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::mmv::MMV_TOKENS;
use crate::plan::Product;
use crate::weights::CudaWeight;
use crate::{act_grid, check, derr, registry, CudaBackend};
use quiver_backend::{Activation, Result, Step};
use quiver_gguf::GgmlType;

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

/// The activations a tensor-core product reads: f16 (`to_half`), the same permuted for wmm
/// (`permute_act`), or int8 (`quantize_act`: quants, scales, and for blocks of 256 the per-16
/// sums).
#[derive(Clone, Copy)]
enum Act {
    Half(u64),
    Permuted(u64),
    Int8 {
        q: u64,
        d: u64,
        s: u64,
    },
    /// x itself (f32mm).
    F32(u64),
}

/// Which of [`Act`]'s forms the product `p` of a weight of kernel suffix `kernel` reads on
/// compute capability `arch` (0 f16, 1 permuted, 2 int8, 3 int8 tiled for imm on wgmma, 4 f32):
/// products that read the same form share one copy of x.
fn act_form(p: Product, kernel: &str, arch: u32) -> u8 {
    match p {
        Product::Imm if registry::imm_wgmma(kernel, arch) => 3,
        Product::Imm | Product::Imv => 2,
        Product::Wmm => 1,
        Product::F32 => 4,
        _ => 0,
    }
}

/// What a product of `matmul_many` reads x as: products of one key share one copy. The form
/// ([`act_form`]; the matrix-vector kernels' int8 is form 2, imv's), the width, and what else
/// shapes the copy: the int8 block and Q4_1/Q5_1's f16 offsets, the f16 copy's grid, the
/// permuted copy's type.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ActKey {
    form: u8,
    cols: usize,
    shape: u32,
}

/// The most products `matmul_many` groups (DeepSeek-V4's six of xn; more run one by one).
pub(crate) const MANY_MAX: usize = 8;

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
        Ok(match act_form(tc, w.kernel, self.dev.info.arch) {
            f @ (2 | 3) => {
                let block = registry::int8_activations(w.kernel).unwrap_or(32);
                let (q, d, s) = self.quantize_act_as(x, n, w.cols, block, w.ty, f == 3)?;
                Act::Int8 { q, d, s }
            }
            1 => Act::Permuted(self.permute_act(x, n, w.cols, w.ty)?),
            4 => Act::F32(x),
            _ => Act::Half(self.to_half(x, n, w.cols, w.ty)?),
        })
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

    /// y[n, w.rows] = x[n, w.cols] · Wᵀ on the tensor cores, by family `tc` over the
    /// activations `act` made for it: cuBLAS over F16 weights, qmm / qmv (src/qmm.rs), imm / imv
    /// (src/imm.rs), wmm (src/wmm.rs).
    fn gemm(&self, w: &CudaWeight, tc: Product, a: Act, n: usize, y: u64) -> Result<()> {
        match (tc, a) {
            (Product::Blas, Act::Half(xh)) => {
                let blas = self.blas.as_ref().expect("the table checked cuBLAS");
                self.launches
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                blas.gemm_f16(w.data.ptr, xh, y, w.rows, n, w.cols)
                    .map_err(|e| derr("cublasGemmEx", e))
            }
            (Product::Qmm { split }, Act::Half(xh)) => self.qmm(w, xh, n, y, split),
            (Product::Qmv, Act::Half(xh)) => self.qmv(w, xh, n, y),
            (Product::Imm, Act::Int8 { q, d, s }) => self.imm(w, (q, d, s), n, y),
            (Product::Imv, Act::Int8 { q, d, s }) => self.imv(w, (q, d, s), n, y),
            (Product::Wmm, Act::Permuted(xp)) => self.wmm(w, xp, n, y),
            (Product::F32, Act::F32(x)) => self.f32mm(w, x, n, y, None),
            _ => {
                unreachable!("`act` makes each family's activations; mmv is no tensor-core family")
            }
        }
    }

    /// y[n, w.rows] = x[n, w.cols] · Wᵀ for an F32 weight in f32 (kernels/mmv.cu `f32mm`);
    /// with `also`, a second weight of the same row bytes and columns over the same x in the
    /// same launch.
    fn f32mm(
        &self,
        w: &CudaWeight,
        x: u64,
        n: usize,
        y: u64,
        also: Option<(&CudaWeight, u64)>,
    ) -> Result<()> {
        // Rows a block: 8 warps of 1 row (one token) or 2.
        let per_block = if n == 1 { 8 } else { 16 };
        let (w2, rows2, y2) = also.map_or((0, 0, 0), |(m, y2)| (m.data.ptr, m.rows, y2));
        let blocks = (w.rows.div_ceil(per_block) + rows2.div_ceil(per_block)) as u32;
        self.launch(
            &w.names.module,
            &w.names.f32mm[usize::from(n == 1)],
            (n.div_ceil(if n == 1 { 1 } else { 8 }) as u32, blocks, 1),
            (256, 1, 1),
            args![
                w.data.ptr,
                w.row_bytes as i64,
                w.rows as i32,
                w.cols as i32,
                x,
                y,
                n as i32,
                w2,
                rows2 as i32,
                y2
            ],
        )
    }

    /// The fast path's `matmul_many` (shapes checked by the caller): each product on its
    /// family, the products that read x alike over one copy of it, made once (the scratch holds
    /// one copy of a kind: one key at a time), and the matrix-vector ones of one type and width
    /// up to three a launch. Each product's bits are `mm`'s.
    pub(crate) fn matmul_many_fast(
        &self,
        w: &[&CudaWeight],
        x: u64,
        rows_x: usize,
        out: &[u64],
    ) -> Result<()> {
        // Decode rows and prompt rows together: each product in two ranges (`mm`).
        let Some(kind) = self.kind_of(rows_x) else {
            for (m, &y) in w.iter().zip(out) {
                self.mm(m, x, rows_x, y)?;
            }
            return Ok(());
        };
        // Fixed arrays: a step's products allocate nothing (the caller runs more than
        // MANY_MAX one by one).
        debug_assert!(w.len() <= MANY_MAX);
        let mut tcs = [None; MANY_MAX];
        let mut keys = [None; MANY_MAX];
        for (i, m) in w.iter().enumerate() {
            tcs[i] = self.tensor_core(m, rows_x, kind);
            keys[i] = self.act_key(tcs[i], m, rows_x);
        }
        let mut done = [false; MANY_MAX];
        for i in 0..w.len() {
            if done[i] {
                continue;
            }
            let key = keys[i];
            let act = match (key, tcs[i]) {
                (Some(_), Some(tc)) => Some(self.act(tc, x, rows_x, w[i])?),
                (Some(_), None) => {
                    let block = registry::int8_activations(w[i].kernel).expect("an int8 key");
                    let (q, d, s) = self.quantize_act(x, rows_x, w[i].cols, block, w[i].ty)?;
                    Some(Act::Int8 { q, d, s })
                }
                (None, _) => None,
            };
            // The tensor-core products of this key, then its matrix-vector ones by type and width.
            for j in i..w.len() {
                if let (false, true, Some(tc), Some(a)) = (done[j], keys[j] == key, tcs[j], act) {
                    done[j] = true;
                    // Two F32 products of one shape in one launch.
                    let partner = (j + 1..w.len()).find(|&k| {
                        tc == Product::F32
                            && !done[k]
                            && keys[k] == key
                            && tcs[k] == Some(Product::F32)
                            && w[k].ty == w[j].ty
                            && w[k].row_bytes == w[j].row_bytes
                    });
                    match (a, partner) {
                        (Act::F32(x), Some(k)) => {
                            done[k] = true;
                            self.f32mm(w[j], x, rows_x, out[j], Some((w[k], out[k])))?
                        }
                        _ => self.gemm(w[j], tc, a, rows_x, out[j])?,
                    }
                }
            }
            for j in i..w.len() {
                if done[j] || keys[j] != key || tcs[j].is_some() {
                    continue;
                }
                let mut mats = [(w[j], out[j]); 3];
                let mut nm = 1;
                done[j] = true;
                for k in j + 1..w.len() {
                    let m = w[k];
                    if nm < 3
                        && !done[k]
                        && keys[k] == key
                        && tcs[k].is_none()
                        && m.ty == w[j].ty
                        && m.cols == w[j].cols
                    {
                        mats[nm] = (m, out[k]);
                        nm += 1;
                        done[k] = true;
                    }
                }
                match act {
                    Some(Act::Int8 { q, d, s }) => {
                        self.mmv_quantized(&mats[..nm], x, rows_x, Some((q, d, s)))?
                    }
                    _ => self.mmv(&mats[..nm], x, rows_x)?,
                }
            }
        }
        Ok(())
    }

    /// The copy of x a product of `w` over `n` rows reads (`tc`: its tensor-core family; none:
    /// the matrix-vector kernels, whose int8 activations are shared over at most one launch's
    /// tokens and whose f32 x needs no copy).
    fn act_key(&self, tc: Option<Product>, w: &CudaWeight, n: usize) -> Option<ActKey> {
        let q8_1 = u32::from(matches!(w.ty, GgmlType::Q4_1 | GgmlType::Q5_1));
        let int8 = |block: usize| 2 * block as u32 + q8_1;
        let (form, shape) = match tc {
            None => (
                2,
                int8(registry::int8_activations(w.kernel).filter(|_| n <= MMV_TOKENS)?),
            ),
            Some(tc) => {
                let form = act_form(tc, w.kernel, self.dev.info.arch);
                let shape = match form {
                    2 | 3 => int8(registry::int8_activations(w.kernel).unwrap_or(32)),
                    0 => act_grid(w.ty)
                        .filter(|b| w.cols.is_multiple_of(*b))
                        .unwrap_or(0) as u32,
                    1 => w.ty as u32,
                    _ => 0,
                };
                (form, shape)
            }
        };
        Some(ActKey {
            form,
            cols: w.cols,
            shape,
        })
    }

    /// The fast path's `matmul_glu`: gate·up fused on the matrix-vector kernels, both
    /// products on cuBLAS, or two products then the glu kernel, the activation by its code
    /// (`act_code`, `activation::clamp_code`). Each path checks the buffers it uses (the fused
    /// one never touches `scratch`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_glu_fast(
        &self,
        act: i32,
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
        self.glu_code(act, g.ptr(), u.ptr(), n, out.ptr())
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
                    && act_form(gh, gate.kernel, self.dev.info.arch)
                        == act_form(uh, up.kernel, self.dev.info.arch) =>
            {
                GluPath::Gemm(gh, uh)
            }
            _ => GluPath::Separate,
        }
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
