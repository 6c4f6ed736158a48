//! The kernel table: which kernel family runs each product and each attention call, decided
//! once at load from the numerics, the device's compute capability and the weight's type, as a
//! chain of per-architecture thresholds (not switches). A product looks its family up by the
//! kind of its rows (decode or prompt, kinds.rs) and a token-count bucket; attention by the
//! shape of the step and the head dim. `quiver devices --kernels` and the load log's `-v` print
//! the table ([`describe`]), and the load log's invariance line is read from it
//! ([`invariance`]).

use crate::kinds::Kind;
use crate::registry;
use quiver_backend::{KvType, KvTypes, Numerics};
use std::fmt::Write;

/// A family of product kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// The matrix-vector kernels, up to 8 tokens a launch (kernels/mmv.cu, mmvq.cu): on int8
    /// activations (dp4a) where the type has them, in the exact-sum order with
    /// [`Numerics::BatchInvariant`] for the int8 tensor-core types (mmvqc).
    Mmv,
    /// The f16 tensor-core kernel's decode form, up to 8 tokens a launch: qmm's bits.
    Qmv,
    /// The f16 tensor-core kernel over the GGUF blocks (kernels/qmm.cu); `split`: over the
    /// columns, partials added by a second kernel, when its tiles do not fill the device (its
    /// bits then follow the token count).
    Qmm { split: bool },
    /// The int8 tensor-core decode kernel, 8 or 16 tokens a launch (kernels/imm.cu), in the
    /// exact-sum order.
    Imv,
    /// The int8 tensor-core kernel (kernels/imm.cu), split over whole 256-column chunks, in the
    /// exact-sum order.
    Imm,
    /// Hopper's warpgroup kernel over the GGUF blocks (kernels/wmm.cu, wgmma), prompt rows.
    Wmm,
    /// cuBLAS over F16 weights.
    Blas,
    /// F32 weights at f32 precision on the CUDA cores (kernels/mmv.cu `f32mm`), every row.
    F32,
}

impl Product {
    pub fn name(self) -> &'static str {
        match self {
            Product::Mmv => "mmv",
            Product::Qmv => "qmv",
            Product::Qmm { split: true } => "qmm (split)",
            Product::Qmm { split: false } => "qmm",
            Product::Imv => "imv",
            Product::Imm => "imm",
            Product::Wmm => "wmm",
            Product::Blas => "cublas",
            Product::F32 => "f32mm",
        }
    }

    /// Its launch shape, as the launcher (src/mmv.rs, qmm.rs, imm.rs) makes it.
    pub fn shape(self) -> &'static str {
        match self {
            Product::Mmv => "4 rows a block of 4 warps, up to 3 matrices and 8 tokens a launch",
            Product::Qmv => "16 rows a block of 4 or 8 warps, 8 tokens a launch",
            Product::Qmm { split: true } => {
                "64 tokens x 64 rows a block of 4 warps, split over the columns to ~2 blocks an SM"
            }
            Product::Qmm { split: false } => "64 tokens x 64 rows a block of 4 warps",
            Product::Imv => "16 rows a block of 8 warps, 8 or 16 tokens a launch",
            Product::Imm => {
                "64 tokens x 64 rows a block of 4 warps (Q4_K on sm_90: a warpgroup on wgmma, TMA), split over 256-column chunks to 2 blocks an SM"
            }
            Product::Wmm => {
                "64 or 128 rows x 64 to 256 tokens a block of 1 or 2 warpgroups and a producer (wgmma), the tile of fewest waves"
            }
            Product::Blas => "cublasGemmEx, f16 in, f32 out",
            Product::F32 => "16 rows x 8 tokens a block of 8 warps, lane-strided f32 fma chains",
        }
    }
}

/// The order a family adds a token's products in, when that order does not depend on the
/// other tokens of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    /// Each 32-block (or super-block) term rounded to 2^-32 and added as an integer
    /// (mmvq.cu `fix_of`): mmvqc, imv, imm.
    ExactSum,
    /// qmm's tile order, which qmv reproduces.
    Tile,
    /// wmm's: the stages in order into one accumulator.
    Stages,
    /// f32mm's: a lane's fmaf chain over its columns, then the warp's butterfly.
    Lanes,
}

/// Token-count buckets of a product row: the most tokens of each.
pub const BUCKETS: [usize; 6] = [1, 2, 8, 16, 128, usize::MAX];

fn bucket(n: usize) -> usize {
    BUCKETS
        .iter()
        .position(|&b| n <= b)
        .unwrap_or(BUCKETS.len() - 1)
}

/// The thresholds of one GPU architecture.
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// Products of at least this many tokens go to the tensor cores; fewer to the
    /// matrix-vector kernels (8 tokens a launch).
    pub gemm_min_tokens: usize,
    /// Token counts the int8 tensor-core decode kernel takes (the int8 types).
    pub imv_tokens: (usize, usize),
    /// Products of at least this many tokens take Hopper's wmm in the fast numerics too (the
    /// invariant numerics take it for every prompt row).
    pub wmm_min_tokens: usize,
}

/// The thresholds for compute capability `arch`. Measured on the H200 (sm_90): a qmm launch
/// costs about the same from 2 to 16 tokens, the matrix-vector kernels take 8 a launch
/// (Qwen3-8B Q4_K_M S_TG at 2 / 4 / 8 / 16 sequences: 397 / 608 / 794 / 771 t/s against qmm's
/// 191 / 377 / 742 / 1,423), so qmm from 9 tokens; imv beats dp4a from 3 tokens and qmm up to
/// 16 (8B Q4_K_M at 3 / 8 sequences 478 / 829 against 493 / 1,117; at 12 / 16 qmm 1,094 /
/// 1,431 against 1,359 / 1,769). Other architectures take the same until measured.
pub fn thresholds(_arch: u32) -> Thresholds {
    Thresholds {
        gemm_min_tokens: 9,
        imv_tokens: (3, 16),
        wmm_min_tokens: 129,
    }
}

/// What the table needs to know of a weight.
#[derive(Clone, Copy, Debug)]
pub struct WeightKey {
    /// Its kernel suffix (`registry::QUANT_TYPES`).
    pub kernel: &'static str,
    /// cuBLAS is loaded and the weight is F16.
    pub blas: bool,
    /// qmv's shared memory fits the device for the weight's width.
    pub qmv_fits: bool,
    /// wmm's tensor map can step the weight's rows (`wmm::wmm_fits`).
    pub wmm_fits: bool,
}

/// A weight's row of the table: the family of each (kind, bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProductRow {
    by: [[Product; BUCKETS.len()]; 2],
    /// Its matrix-vector kernels sum in the exact-sum order (mmvqc).
    exact_mmv: bool,
}

fn kind_index(kind: Kind) -> usize {
    match kind {
        Kind::Decode => 0,
        Kind::Prompt => 1,
    }
}

impl ProductRow {
    /// The row of a weight under `numerics` on compute capability `arch`, every entry `pin`
    /// where the weight's type has that family (tests: `CudaConfig::pin`).
    pub fn pinned(numerics: Numerics, arch: u32, w: WeightKey, pin: Option<Product>) -> Self {
        let mut row = Self::new(numerics, arch, w);
        // F32 weights have the matrix-vector kernels and f32mm only.
        let f32 = w.kernel == "f32";
        let has = |p: Product| match p {
            Product::Mmv => true,
            Product::F32 => f32,
            _ if f32 => false,
            Product::Imv | Product::Imm => registry::int8_mma(w.kernel),
            Product::Blas => w.blas,
            Product::Qmv => w.qmv_fits,
            Product::Wmm => crate::wmm::wmm_arch(arch) && w.wmm_fits,
            Product::Qmm { .. } => true,
        };
        if let Some(p) = pin.filter(|&p| has(p)) {
            row.by = [[p; BUCKETS.len()]; 2];
        }
        row
    }

    /// The row of a weight under `numerics` on compute capability `arch`.
    pub fn new(numerics: Numerics, arch: u32, w: WeightKey) -> Self {
        if w.kernel == "f32" {
            // F32 weights at f32 precision in every mode, as llama.cpp computes them (a
            // router's near ties then fall as its do), every row in f32mm's one order.
            return ProductRow {
                by: [[Product::F32; BUCKETS.len()]; 2],
                exact_mmv: false,
            };
        }
        let th = thresholds(arch);
        let int8 = registry::int8_mma(w.kernel);
        let invariant = numerics != Numerics::Fast;
        let exact_mmv = invariant && int8;
        let mut by = [[Product::Mmv; BUCKETS.len()]; 2];
        for (b, &n) in BUCKETS.iter().enumerate() {
            let (lo, hi) = th.imv_tokens;
            let imv = (lo..=hi).contains(&n);
            let fast = if w.blas {
                if n >= th.gemm_min_tokens {
                    Product::Blas
                } else {
                    Product::Mmv
                }
            } else if imv && registry::imv_default(w.kernel) {
                Product::Imv
            } else if n >= th.wmm_min_tokens && crate::wmm::wmm_arch(arch) && w.wmm_fits {
                Product::Wmm
            } else if n >= th.gemm_min_tokens {
                Product::Qmm { split: true }
            } else {
                Product::Mmv
            };
            let (decode, prompt) = match (invariant, int8) {
                (false, _) => (fast, fast),
                // The exact-sum order for decode rows, qmm unsplit for prompt rows.
                (true, true) => {
                    let d = if imv {
                        Product::Imv
                    } else if n >= th.gemm_min_tokens {
                        Product::Imm
                    } else {
                        Product::Mmv
                    };
                    (d, Product::Qmm { split: false })
                }
                // qmm's order for every row, where qmv fits.
                (true, false) if w.qmv_fits => {
                    let p = if n <= 8 {
                        Product::Qmv
                    } else {
                        Product::Qmm { split: false }
                    };
                    (p, p)
                }
                (true, false) => (fast, fast),
            };
            // Prompt rows (a kind of their own only with the invariant numerics) on Hopper's
            // warpgroup kernel at every count: one order however a prompt is chunked.
            let prompt = if invariant && crate::wmm::wmm_arch(arch) && w.wmm_fits {
                Product::Wmm
            } else {
                prompt
            };
            by[0][b] = decode;
            by[1][b] = prompt;
        }
        ProductRow { by, exact_mmv }
    }

    /// The family for `n` rows of `kind`.
    pub(crate) fn get(&self, kind: Kind, n: usize) -> Product {
        self.by[kind_index(kind)][bucket(n)]
    }

    fn order(&self, p: Product) -> Option<Order> {
        match p {
            Product::Mmv if self.exact_mmv => Some(Order::ExactSum),
            Product::F32 => Some(Order::Lanes),
            Product::Imv | Product::Imm => Some(Order::ExactSum),
            Product::Qmv | Product::Qmm { split: false } => Some(Order::Tile),
            Product::Wmm => Some(Order::Stages),
            Product::Mmv | Product::Qmm { split: true } | Product::Blas => None,
        }
    }

    /// Whether a token's products of each kind come out the same whatever the token count:
    /// every bucket of the kind in one order.
    pub fn invariant(&self) -> bool {
        self.by.iter().all(|row| {
            let o = self.order(row[0]);
            o.is_some() && row.iter().all(|&p| self.order(p) == o)
        })
    }
}

/// A family of attention kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// Prompt tiles on the tensor cores (kernels/flash.cu), key ranges of fixed absolute
    /// positions merged in order.
    Flash,
    /// A KV group's query heads in one block (kvq.cu `kvd_attention`), key ranges by the row's
    /// own key count.
    Kvd,
    /// One block per (token, head, key range), ranges by the step's shape (kvq.cu
    /// `kvq_attention`).
    SplitK,
}

impl Attention {
    pub fn name(self) -> &'static str {
        match self {
            Attention::Flash => "flash",
            Attention::Kvd => "kvd",
            Attention::SplitK => "split-k",
        }
    }

    /// Its launch shape (src/attention.rs, kvq.rs).
    pub fn shape(self) -> &'static str {
        match self {
            Attention::Flash => {
                "64-row prompt tiles per head (sm_90 with f16 K and V: wgmma, a KV group's heads \
                 128 rows a block), key ranges of 4,096 positions"
            }
            Attention::Kvd => {
                "a KV group's heads a block, up to 64 rows a launch, ranges by own keys"
            }
            Attention::SplitK => "a block per (token, head, key range), ranges by the step's shape",
        }
    }

    /// Whether a row's result does not depend on the other rows of its step.
    pub fn invariant(self) -> bool {
        self != Attention::SplitK
    }
}

/// Head dims of the flash kernel and of the KV-group kernel.
pub const FLASH_HEAD_DIMS: &[usize] = &[64, 96, 128, 256];
pub const KVD_HEAD_DIMS: &[usize] = &[64, 128, 256, 512];

/// Whether prompt attention runs on the wgmma kernel (kernels/fwg.cu): Hopper, over a cache of
/// any type CUDA holds (its producer decodes all but f16 to f16; TurboQuant's rotation is applied
/// to q and undone on the output).
pub fn flash_on_wgmma(arch: u32, types: KvTypes) -> bool {
    arch == 90 && fwg_pair(types)
}

/// Whether fwg.cu reads caches of these types (its kernels are in their kvq module): all but
/// tq4 keys (per-block records, which CUDA does not hold).
pub fn fwg_pair(types: KvTypes) -> bool {
    !types.k.key_blocks()
}

/// fwg.cu's dynamic shared memory at head dim `hd` over caches of `types` (`FwgCfg::BYTES`):
/// 128 q rows, and stages of a K and a V tile (128 keys; 64 at head dim 256) with three
/// mbarriers each — three stages where they fit in 227 KiB, else two — tq4's 16 levels, a
/// tile's raw records of each cache that comes raw ([`fwg_raw`]), and 1 KiB to align
/// the swizzled tiles.
pub fn fwg_smem(hd: usize, types: KvTypes) -> usize {
    let kt = if hd == 256 { 64 } else { 128 };
    let raw = |t: KvType| {
        if fwg_raw(t, hd) {
            kt * t.head_bytes(hd)
        } else {
            0
        }
    };
    let fixed = 128 * hd * 2 + 16 * 4 + raw(types.k) + raw(types.v) + 1024;
    let bytes = |stages: usize| fixed + stages * (2 * kt * hd * 2 + 3 * 8);
    if bytes(3) <= 227 * 1024 {
        bytes(3)
    } else {
        bytes(2)
    }
}

/// Whether fwg.cu's producer brings a cache of type `t` at head dim `hd` raw first (fwg.cu
/// `fwg_raw`): every type but f16 at head dims 64 and 128, the TurboQuant types at 256; a
/// tile's records in flight at once by cp.async, then decoded from shared memory.
pub fn fwg_raw(t: KvType, hd: usize) -> bool {
    (t != KvType::F16 && matches!(hd, 64 | 128)) || (t.tq().is_some() && hd == 256)
}

/// The attention family of a step's rows of head dim `hd`: `prompt` for a step with prompt
/// tiles (a mixed step's decode rows are decode rows), else decode.
pub fn attention(hd: usize, prompt: bool) -> Attention {
    let kvd = KVD_HEAD_DIMS.contains(&hd);
    if prompt && FLASH_HEAD_DIMS.contains(&hd) {
        Attention::Flash
    } else if kvd {
        Attention::Kvd
    } else {
        Attention::SplitK
    }
}

/// Why serving under this table would not give each request the same answer alone and under
/// load (None: it would): the weights' rows (`(type name, row)`), the head dims. (MoE experts
/// run by row kind as the table's products do: moe.rs.)
pub fn invariance(
    numerics: Numerics,
    rows: &[(String, ProductRow)],
    head_dims: &[usize],
) -> Option<String> {
    match numerics {
        Numerics::Fast => return Some("--numerics fast".into()),
        Numerics::Parity => return None,
        Numerics::BatchInvariant => {}
    }
    let mut other: Vec<&str> = rows
        .iter()
        .filter(|(_, r)| !r.invariant())
        .map(|(t, _)| t.as_str())
        .collect();
    other.sort();
    other.dedup();
    if !other.is_empty() {
        return Some(format!(
            "{} products follow the token count (a weight too wide for qmv)",
            other.join(", ")
        ));
    }
    if let Some(hd) = head_dims
        .iter()
        .find(|&&hd| !attention(hd, false).invariant() || !attention(hd, true).invariant())
    {
        return Some(format!(
            "attention of head dim {hd} has no KV-group kernel (split-K ranges follow the step)"
        ));
    }
    None
}

/// The table as text: a line per weight type (its family per bucket, decode and prompt rows)
/// and per head dim (decode, prompt).
pub fn describe(
    numerics: Numerics,
    arch: u32,
    rows: &[(String, ProductRow)],
    head_dims: &[usize],
) -> String {
    let mut s = format!("kernel table (numerics {numerics}, sm_{arch})\n");
    if numerics == Numerics::Parity {
        s.push_str("  every op on the parity kernels (kernels/exact.cu)\n");
        return s;
    }
    let heads = ["1", "2", "3-8", "9-16", "17-128", "129+"];
    let head: String = heads.map(|h| format!("{h:<12}")).join("");
    let _ = writeln!(s, "  {:<8} {:<7} {}", "weights", "rows", head.trim_end());
    for (t, r) in rows {
        for kind in [Kind::Decode, Kind::Prompt] {
            let cells: String = BUCKETS
                .iter()
                .map(|&n| format!("{:<12}", r.get(kind, n).name()))
                .collect();
            let k = if kind == Kind::Decode {
                "decode"
            } else {
                "prompt"
            };
            let _ = writeln!(s, "  {t:<8} {k:<7} {}", cells.trim_end());
        }
    }
    let mut used: Vec<Product> = Vec::new();
    for r in rows.iter().map(|(_, r)| r) {
        for p in r.by.iter().flatten() {
            if !used.contains(p) {
                used.push(*p);
            }
        }
    }
    for p in used {
        let _ = writeln!(s, "  {:<12} {}", p.name(), p.shape());
    }
    let mut attn: Vec<Attention> = Vec::new();
    for &hd in head_dims {
        let (d, p) = (attention(hd, false), attention(hd, true));
        let _ = writeln!(
            s,
            "  attention hd {hd} (any KV types, window, soft-cap): decode {}, prompt {}",
            d.name(),
            p.name()
        );
        for a in [d, p] {
            if !attn.contains(&a) {
                attn.push(a);
            }
        }
    }
    for a in attn {
        let _ = writeln!(s, "  {:<12} {}", a.name(), a.shape());
    }
    s
}

/// The table of a model: its text ([`describe`]) and why it is not batch invariant, if not
/// ([`invariance`]).
pub struct Table {
    pub text: String,
    pub variance: Option<String>,
}

/// The table for a model whose products have weights of these (type, columns) and attention
/// these head dims, under `numerics` on compute capability `arch`
/// (`blas`: cuBLAS loaded).
pub fn table(
    numerics: Numerics,
    arch: u32,
    blas: bool,
    weights: &[(quiver_gguf::GgmlType, usize)],
    head_dims: &[usize],
) -> Table {
    let mut rows: Vec<(String, ProductRow)> = Vec::new();
    for &(ty, cols) in weights {
        let Some(kernel) = crate::kernel_suffix(ty) else {
            continue;
        };
        let qmv_fits = crate::qmm::qmv_fits(kernel, cols);
        let key = WeightKey {
            kernel,
            blas: blas && ty == quiver_gguf::GgmlType::F16,
            qmv_fits,
            wmm_fits: crate::wmm::wmm_fits(ty.row_bytes(cols as u64).unwrap_or(0) as usize),
        };
        let label = if qmv_fits {
            ty.to_string()
        } else {
            format!("{ty}*")
        };
        let row = ProductRow::new(numerics, arch, key);
        if !rows.iter().any(|(l, _)| *l == label) {
            rows.push((label, row));
        }
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let mut dims = head_dims.to_vec();
    dims.sort_unstable();
    dims.dedup();
    let variance = invariance(numerics, &rows, &dims);
    let mut text = describe(numerics, arch, &rows, &dims);
    if rows.iter().any(|(l, _)| l.ends_with('*')) {
        text.push_str("  (* weights too wide for qmv)\n");
    }
    Table { text, variance }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Product::*;

    fn row(n: Numerics, kernel: &'static str) -> ProductRow {
        ProductRow::new(
            n,
            90,
            WeightKey {
                kernel,
                blas: kernel == "f16",
                qmv_fits: true,
                wmm_fits: true,
            },
        )
    }

    fn decode(r: &ProductRow) -> Vec<Product> {
        BUCKETS.iter().map(|&n| r.get(Kind::Decode, n)).collect()
    }

    #[test]
    fn fwg_shared_memory_fits_a_block_at_every_pair_and_head_dim() {
        // A block may take 227 KiB.
        for k in KvType::ALL {
            for v in KvType::ALL {
                let types = KvTypes { k, v };
                for &hd in FLASH_HEAD_DIMS {
                    let b = fwg_smem(hd, types);
                    assert!(b <= 227 * 1024, "fwg {types} hd {hd}: {b}");
                }
            }
        }
        // Head dim 128: three stages over f16 (with tq4's levels); over q8_0 two, and the raw
        // K and V records of a tile (136 bytes a key each).
        let pair = |t| KvTypes { k: t, v: t };
        let stage = 2 * 128 * 256 + 24;
        assert_eq!(
            fwg_smem(128, pair(KvType::F16)),
            128 * 256 + 3 * stage + 16 * 4 + 1024
        );
        assert_eq!(
            fwg_smem(128, pair(KvType::Q8_0)),
            128 * 256 + 2 * stage + 16 * 4 + 2 * 128 * 136 + 1024
        );
        // Head dim 256: q8_0 comes decoded as it is read (no raw rows), tq8 raw (64 keys of
        // 260 bytes a cache).
        assert_eq!(
            fwg_smem(256, pair(KvType::Q8_0)),
            fwg_smem(256, pair(KvType::F16))
        );
        assert_eq!(
            fwg_smem(256, pair(KvType::Tq8)),
            fwg_smem(256, pair(KvType::F16)) + 2 * 64 * 260
        );
    }

    #[test]
    fn f32_weights_stay_f32_in_every_mode() {
        for n in [Numerics::BatchInvariant, Numerics::Fast] {
            let r = row(n, "f32");
            assert_eq!(decode(&r), [F32; BUCKETS.len()]);
            assert!(BUCKETS.iter().all(|&b| r.get(Kind::Prompt, b) == F32));
            assert!(r.invariant());
            // No pin moves them to the f16 tensor cores.
            let key = WeightKey {
                kernel: "f32",
                blas: false,
                qmv_fits: true,
                wmm_fits: true,
            };
            for pin in [Wmm, Qmv, Qmm { split: true }, Imv] {
                assert_eq!(ProductRow::pinned(n, 90, key, Some(pin)), r, "{pin:?}");
            }
        }
    }

    #[test]
    fn invariant_rows_keep_one_order_per_kind() {
        let inv = Numerics::BatchInvariant;
        let q4k = row(inv, "q4_k");
        assert_eq!(decode(&q4k), [Mmv, Mmv, Imv, Imv, Imm, Imm]);
        // Prompt rows on wgmma on Hopper, at every count; qmm unsplit before it.
        assert_eq!(q4k.get(Kind::Prompt, 1), Wmm);
        assert_eq!(q4k.get(Kind::Prompt, 512), Wmm);
        assert!(q4k.invariant());
        let ada = ProductRow::new(
            inv,
            89,
            WeightKey {
                kernel: "q4_k",
                blas: false,
                qmv_fits: true,
                wmm_fits: true,
            },
        );
        assert_eq!(ada.get(Kind::Prompt, 1), Qmm { split: false });
        assert_eq!(ada.get(Kind::Prompt, 512), Qmm { split: false });
        assert!(ada.invariant());
        let q5k = row(inv, "q5_k");
        assert_eq!(
            decode(&q5k),
            [
                Qmv,
                Qmv,
                Qmv,
                Qmm { split: false },
                Qmm { split: false },
                Qmm { split: false }
            ]
        );
        assert!(q5k.invariant());
        // Too wide for qmv: the fast families, and the table says so.
        let wide = ProductRow::new(
            inv,
            90,
            WeightKey {
                kernel: "q5_k",
                blas: false,
                qmv_fits: false,
                wmm_fits: true,
            },
        );
        assert!(!wide.invariant());
        let why = invariance(inv, &[("Q5_K".into(), wide)], &[128]).unwrap();
        assert!(why.starts_with("Q5_K products"), "{why}");
        // A model's table: the wide weight marked, the reason read from its rows.
        use quiver_gguf::GgmlType;
        let t = table(
            inv,
            90,
            true,
            &[(GgmlType::Q4_K, 4096), (GgmlType::Q5_K, 1 << 20)],
            &[128, 128],
        );
        assert!(t.text.contains("Q5_K*") && t.variance.unwrap().starts_with("Q5_K* products"));
        let t = table(
            inv,
            90,
            true,
            &[(GgmlType::Q4_K, 4096), (GgmlType::Q6_K, 14336)],
            &[128],
        );
        assert_eq!(t.variance, None, "{}", t.text);
    }

    #[test]
    fn fast_rows_take_the_fastest_family_per_bucket() {
        let f = Numerics::Fast;
        let q4k = row(f, "q4_k");
        let qmm = Qmm { split: true };
        // Wmm from 129 tokens on Hopper, qmm (split where the tiles are few) before.
        assert_eq!(decode(&q4k), [Mmv, Mmv, Imv, Imv, qmm, Wmm]);
        assert_eq!(q4k.get(Kind::Prompt, 512), Wmm);
        assert_eq!(q4k.get(Kind::Prompt, 128), qmm);
        assert!(!q4k.invariant());
        let q4_1 = row(f, "q4_1");
        assert_eq!(decode(&q4_1), [Mmv, Mmv, Mmv, qmm, qmm, Wmm]);
        assert_eq!(decode(&row(f, "f16")), [Mmv, Mmv, Mmv, Blas, Blas, Blas]);
        assert_eq!(
            invariance(f, &[("Q4_K".into(), q4k)], &[]).as_deref(),
            Some("--numerics fast")
        );
    }

    #[test]
    fn attention_families_and_what_breaks_invariance() {
        assert_eq!(attention(128, true), Attention::Flash);
        assert_eq!(attention(128, false), Attention::Kvd);
        assert_eq!(attention(512, true), Attention::Kvd);
        assert_eq!(attention(96, false), Attention::SplitK);
        let inv = Numerics::BatchInvariant;
        let q4k = vec![("Q4_K".to_string(), row(inv, "q4_k"))];
        assert_eq!(invariance(inv, &q4k, &[64, 128, 256, 512]), None);
        assert!(invariance(inv, &q4k, &[96])
            .unwrap()
            .contains("head dim 96"));
        assert_eq!(invariance(Numerics::Parity, &q4k, &[96]), None);
        let text = describe(inv, 90, &q4k, &[128]);
        assert!(text.contains("Q4_K     decode  mmv"), "{text}");
        assert!(text.contains(": decode kvd, prompt flash"), "{text}");
        assert!(text.contains("imm          64 tokens x 64 rows"), "{text}");
        assert!(text.lines().all(|l| l == l.trim_end()), "{text}");
    }
}
