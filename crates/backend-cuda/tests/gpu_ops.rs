//! Every CUDA op against the scalar reference: the shared op body of
//! `quiver_backend::testing` (the same case table the CPU backend runs: every weight type,
//! product shapes, paged multi-sequence batches of 1 to 151 tokens, GQA, windows, soft-cap,
//! both rope modes, norms, GLU, soft-cap, argmax, top-k) with the CUDA backend's numerical
//! model, on every kernel path: products all on the matrix-vector kernels and with the
//! cut-over to the tensor cores, attention on the split-K kernel (key ranges chosen by the
//! shapes, fixed at one and at three) and on the flash kernel. Then what is the CUDA backend's
//! alone: the parity mode's products and gather give the CPU's bits.
//!
//! Fresh random inputs each run (the seed is printed; `QUIVER_TEST_SEED` replays it), poisoned
//! outputs. Needs a GPU: `#[ignore]`d, so CI reports them as ignored; on a GPU machine run the
//! test binary with `--include-ignored` (docs/GPU.md). (One test checks a host reference and
//! runs everywhere.)

use quiver_backend::testing::batches::batches;
use quiver_backend::testing::cases::{PRODUCT_SHAPES, WEIGHT_TYPES};
use quiver_backend::testing::{
    attention, bits_differ, elementwise, kv_types, poison, products, read, seeded_rng, Bounds,
    Harness, WeightCase,
};
use quiver_backend::{Backend, BackendError, Batch, Numerics};
use quiver_backend_cuda::plan::Product;
use quiver_backend_cuda::{CudaBackend, CudaConfig, CudaKv, ParityBackend, WMM_TILES};
use quiver_gguf::GgmlType;

/// The CUDA backend's part: buffers and caches copied to and from the device, and how its
/// kernels see activations.
struct Cuda;

/// True when products of `ty` weights of `cols` columns over `n` tokens run on the
/// matrix-vector kernels (exact up to f32 rounding), by the backend's kernel table; else on the
/// tensor cores (f16, or int8 for imv / imm).
fn mmv(be: &CudaBackend, ty: GgmlType, cols: usize, n: usize) -> bool {
    be.product_family(ty, cols, n) == Some(Product::Mmv)
}

/// The activation block size when products of `ty` weights on the matrix-vector kernels
/// (`mmv`) take int8 activations.
fn int8_block(ty: GgmlType, mmv: bool) -> Option<usize> {
    quiver_backend_cuda::kernel_suffix(ty)
        .and_then(quiver_backend_cuda::registry::int8_activations)
        .filter(|_| mmv)
}

impl Harness<CudaBackend> for Cuda {
    fn upload(&self, be: &CudaBackend, data: &[f32]) -> quiver_backend_cuda::CudaBuf {
        be.buf_from(data).unwrap()
    }

    fn write_kv(&self, be: &CudaBackend, kv: &mut CudaKv, k: &[half::f16], v: &[half::f16]) {
        let bits = |v: &[half::f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
        be.write_kv(kv, &bits(k), &bits(v)).unwrap();
    }

    fn read_kv(&self, be: &CudaBackend, kv: &CudaKv) -> (Vec<half::f16>, Vec<half::f16>) {
        let (k, v) = be.read_kv(kv).unwrap();
        let f = |v: Vec<u16>| v.into_iter().map(half::f16::from_bits).collect();
        (f(k), f(v))
    }

    fn bounds(&self, be: &CudaBackend) -> Bounds {
        Bounds {
            norm: 1e-6,
            add: 1e-7,
            rope_q: 1e-5,
            kv_write: 1e-3,
            // The split-K kernel is f32 throughout; the flash kernel's q and probabilities
            // meet the tensor cores in f16: ~1e-3 relative.
            attention: if be.config().attention_splits.is_some() {
                1e-5
            } else {
                5e-3
            },
            glu: 1e-3,
            softcap: 1e-6,
            embed: 1e-6,
        }
    }

    /// x as the products see it: on the matrix-vector kernels quantized to int8 blocks (32, or
    /// 256 for the K-quants) for the types with integer kernels; on the tensor cores rounded to
    /// the int8 grid of every quantized type (then to f16, which the bounds cover); both as
    /// the CPU backend quantizes it.
    fn as_seen(&self, be: &CudaBackend, ty: GgmlType, n: usize, x: &[f32]) -> Vec<f32> {
        let mmv = mmv(be, ty, x.len() / n.max(1), n);
        let block = if mmv {
            int8_block(ty, mmv)
        } else {
            quiver_backend_cuda::act_grid(ty)
        };
        match block {
            Some(b) => quiver_cpu_kernels::activation_roundtrip(if b == 32 { 0 } else { 1 }, x),
            None => x.to_vec(),
        }
    }

    /// The f16 offset sums of Q4_1/Q5_1 on int8 activations (ggml's q8_1): on the
    /// matrix-vector kernels, and on imv / imm, which read the same activations.
    fn offsets(&self, be: &CudaBackend, w: &WeightCase, n: usize, x: &[f32]) -> Vec<f32> {
        let int8_mma = matches!(
            be.product_family(w.ty, w.cols, n),
            Some(Product::Imv | Product::Imm)
        );
        if int8_block(w.ty, mmv(be, w.ty, w.cols, n) || int8_mma) == Some(32) {
            quiver_cpu_kernels::activation_offset_terms(w.ty, &w.bytes, w.rows, w.cols, x, n)
                .iter()
                .map(|&v| v as f32)
                .collect()
        } else {
            vec![0.0; n * w.rows]
        }
    }

    fn product_bound(&self, be: &CudaBackend, ty: GgmlType, cols: usize, n: usize) -> f64 {
        // The matrix-vector kernels, and F32 weights on any family (f32 throughout).
        if mmv(be, ty, cols, n) || ty == GgmlType::F32 {
            1e-5
        } else {
            1.5e-3
        }
    }

    /// The decode steps' experts take int8 activations, as the CPU backend's do (its bound,
    /// 3e-2, for the quantized types); the prompts' take f16 (~1e-3). F32 weights (the router,
    /// F32 experts) are f32 throughout.
    /// The reference rounds its running p·v sum to f16 key by key; the kernel sums in f32.
    fn dsv4_attention_bound(&self, _: &CudaBackend) -> f64 {
        4e-3
    }

    fn moe_bound(&self, _: &CudaBackend, ty: GgmlType, _: usize) -> f64 {
        if ty != GgmlType::F32 {
            3e-2
        } else {
            5e-3
        }
    }

    /// The tensor-core path's activations are on the int8 grid, not plain f16: against x
    /// itself the error is the int8 rounding's, several times larger.
    fn activations_rounded(&self, be: &CudaBackend, ty: GgmlType, cols: usize, n: usize) -> bool {
        !mmv(be, ty, cols, n) && quiver_backend_cuda::act_grid(ty).is_some()
    }
}

/// A backend over `config` with graphs off: the body reads results in the middle of its steps,
/// which a captured step would only record.
fn backend_with(config: CudaConfig) -> CudaBackend {
    CudaBackend::new(
        0,
        CudaConfig {
            graphs: false,
            ..config
        },
    )
    .expect("a CUDA GPU")
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_and_embedding_match_reference_for_every_type() {
    let mut rng = seeded_rng();
    // Each numerics' kernel table, then each family pinned for every token count (where the
    // weight's type has it): the matrix-vector kernels (in launches of up to 8 tokens; in the
    // exact-sum order for the int8 types with the invariant numerics), qmm split and whole,
    // qmv, imv (launches of 8 and 16 tokens), imm, wmm (sm_90): a backend each.
    let (fast, inv) = (Numerics::Fast, Numerics::BatchInvariant);
    for (numerics, pin) in [
        (fast, None),
        (inv, None),
        (fast, Some(Product::Mmv)),
        (inv, Some(Product::Mmv)),
        (fast, Some(Product::Qmm { split: true })),
        (inv, Some(Product::Qmv)),
        (inv, Some(Product::Imv)),
        (inv, Some(Product::Imm)),
        (inv, Some(Product::Wmm)),
    ] {
        let mut be = backend_with(CudaConfig {
            pin,
            ..CudaConfig::from_env(numerics)
        });
        let notes = products::products(&mut be, &Cuda, &mut rng);
        notes.print(&format!("products, numerics {numerics}, pinned {pin:?}"));
        // Only types without CUDA kernels would be refused (none are left), at every shape.
        let refused = WEIGHT_TYPES
            .iter()
            .filter(|t| quiver_backend_cuda::kernel_suffix(**t).is_none())
            .count();
        assert_eq!(
            notes.skipped.len(),
            refused * PRODUCT_SHAPES.len(),
            "{:?}",
            notes.skipped
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn products_are_batch_invariant_in_the_invariant_mode() {
    let mut rng = seeded_rng();
    // The table (decode rows), then wmm for every count (prompt rows on sm_90: tiles of 64
    // tokens up to 64, of 128 past it).
    for pin in [None, Some(Product::Wmm)] {
        let be = backend_with(CudaConfig {
            pin,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        });
        products::batch_invariance(
            &be,
            &Cuda,
            &mut rng,
            WEIGHT_TYPES,
            &[1, 2, 3, 8, 9, 17, 64, 65, 150, 300],
        );
    }
}

/// F32 weights at f32 precision (f32mm, every row, both numerics): within f32 rounding of the
/// reference at every count (launches of 8 tokens, partial ones at every edge), and a token's
/// bits whatever the count.
#[test]
#[ignore = "needs a CUDA GPU"]
fn f32_weights_multiply_in_f32() {
    let mut rng = seeded_rng();
    for numerics in [Numerics::BatchInvariant, Numerics::Fast] {
        let be = backend_with(CudaConfig::from_env(numerics));
        let shapes = [(48, 416), (200, 160), (130, 576), (70, 2048)];
        let notes = products::matmuls(
            &be,
            &Cuda,
            &mut rng,
            &shapes,
            &[GgmlType::F32],
            &[1, 9, 63, 70, 150],
        );
        notes.print(&format!("F32 products, numerics {numerics}"));
        assert!(notes.skipped.is_empty(), "{:?}", notes.skipped);
        products::batch_invariance(
            &be,
            &Cuda,
            &mut rng,
            &[GgmlType::F32],
            &[1, 3, 8, 9, 64, 65, 300],
        );
    }
}

/// One of the norms a layer takes into `out`, over `n` rows of `cols`: kind 0 `rms_norm` of x, 1
/// `add_rms_norm` (r += x, then the norm of r), 2 `rms_norm_gated` (xn normed in place, times
/// silu(g)).
#[allow(clippy::too_many_arguments)]
fn norm_of_kind(
    be: &CudaBackend,
    kind: usize,
    nw: &<CudaBackend as Backend>::Weight,
    (x, g): (
        &<CudaBackend as Backend>::Buf,
        &<CudaBackend as Backend>::Buf,
    ),
    r: &mut <CudaBackend as Backend>::Buf,
    xn: &mut <CudaBackend as Backend>::Buf,
    (n, cols): (usize, usize),
    out: &mut <CudaBackend as Backend>::Buf,
) {
    match kind {
        0 => be.rms_norm(x, nw, 1e-5, n, out).unwrap(),
        1 => be.add_rms_norm(r, x, nw, 1e-5, n, out).unwrap(),
        _ => be.rms_norm_gated(xn, nw, 1e-5, n, cols, g, out).unwrap(),
    }
}

/// A norm followed by a product: the norm kernel writes the int8 copy the product read the
/// time before (src/norm.rs), one launch fewer, and every bit is the unfused path's (the norm's
/// output, the residual, the product), for blocks of 32 (q8_0 and Q4_1's q8_1 sums, rows of
/// 544: lanes past the row idle), of 256 (rows, and imm's tiles at 64 decode rows), plain,
/// with the residual and gated norms; a launch between the norm and the product turns it off.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_norms_int8_copy_is_the_quantizers() {
    let mut rng = seeded_rng();
    let be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let mut fused = 0;
    for (ty, cols) in [
        (GgmlType::Q4_0, 544),
        (GgmlType::Q4_1, 544),
        (GgmlType::Q8_0, 512),
        (GgmlType::Q4_K, 512),
        (GgmlType::Q6_K, 768),
    ] {
        let w = WeightCase::random(&mut rng, ty, 96, cols)
            .unwrap()
            .load(&be)
            .unwrap();
        let nw = quiver_backend::testing::vector(&be, &rng.vec(cols));
        for n in [1, 3, 8, 64] {
            let (x0, r0, g0) = (rng.vec(n * cols), rng.vec(n * cols), rng.vec(n * cols));
            let (x, g) = (Cuda.upload(&be, &x0), Cuda.upload(&be, &g0));
            // kind 0 rms_norm, 1 add_rms_norm, 2 rms_norm_gated; `between`: a launch between
            // the norm and the product. Results: (norm, residual, product) and launches.
            let run = |kind: usize, between: bool| {
                let mut r = Cuda.upload(&be, &r0);
                let mut xn = Cuda.upload(&be, &x0);
                let mut out = poison(&be, &Cuda, n * cols);
                let mut y = poison(&be, &Cuda, n * 96);
                let before = be.launch_count();
                norm_of_kind(
                    &be,
                    kind,
                    &nw,
                    (&x, &g),
                    &mut r,
                    &mut xn,
                    (n, cols),
                    &mut out,
                );
                if between {
                    let mut other = Cuda.upload(&be, &[0.0; 4]);
                    be.add(&mut other, &Cuda.upload(&be, &[1.0; 4]), 4).unwrap();
                }
                be.matmul(&w, &out, n, &mut y).unwrap();
                let launches = be.launch_count() - before - u64::from(between);
                (
                    (
                        read(&be, &out, n * cols),
                        read(&be, &r, n * cols),
                        read(&be, &y, n * 96),
                    ),
                    launches,
                )
            };
            for kind in 0..3 {
                let (plain, plain_launches) = run(kind, true);
                let _ = run(kind, false); // learns the form
                let (made, made_launches) = run(kind, false);
                let case = format!("{ty:?} over {cols} columns, {n} rows, norm kind {kind}");
                assert_eq!(bits_differ(&made.0, &plain.0), 0, "the norm: {case}");
                assert_eq!(bits_differ(&made.1, &plain.1), 0, "the residual: {case}");
                assert_eq!(bits_differ(&made.2, &plain.2), 0, "the product: {case}");
                // Decode rows quantize once for any product family: the norm does it.
                if n <= 8 {
                    assert_eq!(made_launches + 1, plain_launches, "{case}");
                } else {
                    assert!(made_launches <= plain_launches, "{case}");
                }
                fused += usize::from(made_launches < plain_launches);
            }
        }
    }
    println!("{fused} of 60 norm-product pairs fused (45 of 1–8 rows)");
}

/// A norm's row gives the same bits alone and among 100 rows: plain, with the residual and
/// gated, rows of one pass (2,048, 4,096) and of two (5,120, 6,144: the second pass read
/// again), with the int8 copy for a product after it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_give_each_row_its_own_bits_at_any_row_count() {
    let mut rng = seeded_rng();
    let be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let n = 100;
    for cols in [2048, 4096, 5120, 6144] {
        let w = WeightCase::random(&mut rng, GgmlType::Q4_K, 32, cols)
            .unwrap()
            .load(&be)
            .unwrap();
        let nw = quiver_backend::testing::vector(&be, &rng.vec(cols));
        let (x0, r0, g0) = (rng.vec(n * cols), rng.vec(n * cols), rng.vec(n * cols));
        // Rows `rows` of the inputs, normed (kind 0 plain, 1 with the residual, 2 gated) and
        // multiplied (the product reads the norm's int8 copy once learnt): (norm, residual).
        let run = |kind: usize, rows: std::ops::Range<usize>| {
            let m = rows.len();
            let part = |v: &[f32]| Cuda.upload(&be, &v[rows.start * cols..rows.end * cols]);
            let (x, g) = (part(&x0), part(&g0));
            let mut out = poison(&be, &Cuda, m * cols);
            let mut y = poison(&be, &Cuda, m * 32);
            // Twice with the product after it (the form learnt, then the copy made), then the
            // norm alone, whose output and residual are read.
            let mut residual = Vec::new();
            for i in 0..3 {
                let (mut r, mut xn) = (part(&r0), part(&x0));
                norm_of_kind(
                    &be,
                    kind,
                    &nw,
                    (&x, &g),
                    &mut r,
                    &mut xn,
                    (m, cols),
                    &mut out,
                );
                if i < 2 {
                    be.matmul(&w, &out, m, &mut y).unwrap();
                }
                residual = read(&be, &r, m * cols);
            }
            (read(&be, &out, m * cols), residual)
        };
        for kind in 0..3 {
            let all = run(kind, 0..n);
            for i in [0, 37, n - 1] {
                let one = run(kind, i..i + 1);
                let row = |v: &[f32]| v[i * cols..(i + 1) * cols].to_vec();
                let case = format!("{cols} columns, norm kind {kind}, row {i} of {n}");
                assert_eq!(bits_differ(&one.0, &row(&all.0)), 0, "the norm: {case}");
                assert_eq!(bits_differ(&one.1, &row(&all.1)), 0, "the residual: {case}");
            }
        }
    }
}

/// wmm over widths past whole stages of 128 columns (the permuted activations padded with
/// zeros) and over row counts past whole tiles, in every tile, against the reference; and the
/// same bits in every tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn wmm_pads_partial_stages_and_tiles() {
    let mut rng = seeded_rng();
    let tiles: Vec<CudaBackend> = (0..WMM_TILES.len())
        .map(|t| {
            backend_with(CudaConfig {
                pin: Some(Product::Wmm),
                wmm_tile: Some(t),
                ..CudaConfig::from_env(Numerics::BatchInvariant)
            })
        })
        .collect();
    // wmm takes weights whose rows are whole 16-byte units (its tensor map steps them): the
    // block types at widths of whole 256-column chunks, the float types at any width (partial
    // stages); rows of 8-byte units in pairs (Q6_K at 1,024 columns: 840 bytes), an odd count
    // of them too.
    use GgmlType::*;
    let blocks = [Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL, Q4_K, Q6_K];
    for (be, tile) in tiles.iter().zip(WMM_TILES) {
        let shapes = [(48, 512), (200, 256), (130, 768), (130, 1024), (129, 1024)];
        let mut notes = products::matmuls(be, &Cuda, &mut rng, &shapes, &blocks, &[1, 63, 70, 150]);
        let shapes = [(48, 416), (200, 160), (130, 576)];
        let floats = products::matmuls(
            be,
            &Cuda,
            &mut rng,
            &shapes,
            &[F16, BF16],
            &[1, 63, 70, 150],
        );
        notes.skipped.extend(floats.skipped);
        notes.print(&format!("wmm {tile:?}, partial stages and tiles"));
        assert!(notes.skipped.is_empty(), "{:?}", notes.skipped);
    }
    products::same_bits(
        &tiles,
        &Cuda,
        &mut rng,
        &[(200, 256)],
        &[Q4_K, Q6_K, Q8_0, F16],
        300,
    );
}

/// Qwen 3.5's gated delta net (kernels/delta.cu) and sigmoid_mul against the reference: three
/// sequences in their own state slots, one fresh over a dirty slot.
#[test]
#[ignore = "needs a CUDA GPU"]
fn delta_net_keeps_each_sequence_in_its_slot_and_matches_reference() {
    let mut rng = seeded_rng();
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let notes = quiver_backend::testing::delta_net::delta_net(&mut be, &Cuda, &mut rng);
    notes.print("delta_net");
    assert!(notes.skipped.is_empty(), "{:?}", notes.skipped);
}

/// DeepSeek-V4's ops (kernels/dsv4.cu) against the reference: the hyper-connections' block
/// input with its Sinkhorn weights, the head's, the block output, the streams' expansion, the
/// clamped SwiGLU, the grouped product, the MoE routed by scores and bias or by token hash, and
/// the attention over the per-sequence state (ratios 0, 4 with the indexer's top-k, and 128):
/// each sequence alone against the reference and against itself in mixed steps, and a rollback.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dsv4_ops_match_reference() {
    let mut rng = seeded_rng();
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let notes = quiver_backend::testing::dsv4::dsv4(&mut be, &Cuda, &mut rng);
    notes.print("dsv4");
    assert!(notes.skipped.is_empty(), "{:?}", notes.skipped);
}

/// Router logits holding NaN: `n_used` distinct experts a token (moe_route), finite output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_routes_around_nan_router_logits() {
    let be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    quiver_backend::testing::moe::moe_nan_router(&be, &Cuda);
}

/// The int8 types are batch invariant on the default path (the invariant numerics): their
/// decode kernels (mmvqc, imv) sum in the order of their int8 tensor-core kernel (imm), so a
/// token's product is the same bits on either side of the cut-overs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_mma_types_are_batch_invariant_on_the_default_path() {
    let mut rng = seeded_rng();
    // The table, then imv for every count (several 16-token launches).
    for pin in [None, Some(Product::Imv)] {
        let be = backend_with(CudaConfig {
            pin,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        });
        products::batch_invariance(
            &be,
            &Cuda,
            &mut rng,
            &[
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q5_0,
                GgmlType::Q8_0,
                GgmlType::IQ4_NL,
                GgmlType::Q4_K,
                GgmlType::Q6_K,
            ],
            &[1, 2, 3, 8, 9, 16, 17, 24, 32, 33, 64, 65, 150],
        );
    }
}

/// The int8 kernels' exact-sum order (kernels/mmvq.cu `fix_of`), computed on the host: x
/// quantized as `quantize_a32` / `quantize_a256` do (the CPU backend's q8_0, q8_1 and Q8_K
/// quantizers, which round alike), each block's term rounded as written — (d_w · d_a) · isum
/// for the 32-blocks (isum over their signed values: Q4_0 q − 8, Q5_0 q − 16, IQ4_NL its
/// levels; Q4_1's unsigned, plus m · s_a, its min against the activations' q8_1 sum), a
/// super-block's da·(d·S1 − dmin·S2) for Q4_K (S1 = Σ sc·isum, S2 = Σ
/// m·asum over its 8 sub-blocks), da·(d·S) for Q6_K (S = Σ sc·isum over its 16); the
/// 32-blocks' terms added in quads of 4 blocks as (t0 + t1) + (t2 + t3) (blocks past the row
/// 0); each quad's sum or super-block's term rounded to a multiple of 2^-32 and summed as an
/// i64, the total back to f32. `ty`'s GGUF blocks in `bytes`, `rows` × `cols`, over `n` rows
/// of `x`.
fn exact_sum_reference(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let fix = |term: f32| ((term * 4294967296.0) as f64).round_ties_even() as i64;
    let k_quant = matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K);
    // (quants, d per block, s per block: the 32-blocks' d·Σq, q8_1's for Q4_1)
    let (aq, ads, ass) = if k_quant {
        let (q, d) = quiver_cpu_kernels::activation_quants_a256(&x[..n * cols]);
        (q, d, vec![])
    } else {
        let (q, ds) = if ty == GgmlType::Q4_1 {
            quiver_cpu_kernels::activation_quants_a32_q8_1(&x[..n * cols])
        } else {
            quiver_cpu_kernels::activation_quants_a32(&x[..n * cols])
        };
        let d = ds.iter().step_by(2).copied().collect();
        let s = ds.iter().skip(1).step_by(2).copied().collect();
        (q, d, s)
    };
    // Values per block, block bytes, and one block's term against activations `a` of scale da.
    let (vals, bb) = match ty {
        GgmlType::Q4_0 | GgmlType::IQ4_NL => (32, 18),
        GgmlType::Q4_1 => (32, 20),
        GgmlType::Q5_0 => (32, 22),
        GgmlType::Q8_0 => (32, 34),
        GgmlType::Q4_K => (256, 144),
        GgmlType::Q6_K => (256, 210),
        _ => panic!("{ty}: no exact-sum kernels"),
    };
    let term = |blk: &[u8], a: &[i8], da: f32, sa: f32| -> f32 {
        let a = |i: usize| a[i] as i32;
        // A 32-block's value i as an integer (its nibble i % 16, low for i < 16).
        let nib = |qs: &[u8], i: usize| {
            let byte = qs[i % 16];
            (if i < 16 { byte & 15 } else { byte >> 4 }) as i32
        };
        match ty {
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL => {
                let isum: i32 = (0..32)
                    .map(|i| {
                        let w = match ty {
                            GgmlType::Q4_0 => nib(&blk[2..], i) - 8,
                            GgmlType::Q4_1 => nib(&blk[4..], i),
                            GgmlType::Q5_0 => {
                                let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
                                (nib(&blk[6..], i) | (((qh >> i) & 1) << 4) as i32) - 16
                            }
                            GgmlType::IQ4_NL => {
                                quiver_quant::iq4::KVALUES_IQ4NL[nib(&blk[2..], i) as usize] as i32
                            }
                            _ => blk[2 + i] as i8 as i32,
                        };
                        w * a(i)
                    })
                    .sum();
                let t = f16(blk) * da * isum as f32;
                if ty == GgmlType::Q4_1 {
                    t + f16(&blk[2..]) * sa
                } else {
                    t
                }
            }
            GgmlType::Q4_K => {
                let scales: &[u8; 12] = blk[4..16].try_into().unwrap();
                let (mut s1, mut s2) = (0i32, 0i32);
                for sub in 0..8 {
                    let (sc, m) = quiver_quant::k_quants::get_scale_min_k4(sub, scales);
                    let (mut isum, mut asum) = (0i32, 0i32);
                    for l in 0..32 {
                        let byte = blk[16 + 32 * (sub / 2) + l];
                        let q = if sub % 2 == 0 { byte & 15 } else { byte >> 4 };
                        isum += q as i32 * a(32 * sub + l);
                        asum += a(32 * sub + l);
                    }
                    s1 += sc as i32 * isum;
                    s2 += m as i32 * asum;
                }
                da * (f16(blk) * s1 as f32 - f16(&blk[2..]) * s2 as f32)
            }
            _ => {
                let mut s = 0i32;
                for sub in 0..16 {
                    let isum: i32 = (16 * sub..16 * sub + 16)
                        .map(|v| {
                            let (h, l) = (v / 128, v % 128);
                            let ql = blk[64 * h + l % 64];
                            let nib = if l < 64 { ql & 15 } else { ql >> 4 };
                            let hb = (blk[128 + 32 * h + l % 32] >> (2 * (l / 32))) & 3;
                            ((nib | hb << 4) as i32 - 32) * a(v)
                        })
                        .sum();
                    s += blk[192 + sub] as i8 as i32 * isum;
                }
                da * (f16(&blk[208..]) * s as f32)
            }
        }
    };
    let nb = cols / vals;
    let quad = if k_quant { 1 } else { 4 };
    let mut y = vec![0f32; n * rows];
    for r in 0..rows {
        for t in 0..n {
            let block_term = |b: usize| {
                if b >= nb {
                    return 0.0;
                }
                let blk = &bytes[(r * nb + b) * bb..][..bb];
                let ab = t * nb + b;
                let sa = ass.get(ab).copied().unwrap_or(0.0);
                term(blk, &aq[vals * ab..][..vals], ads[ab], sa)
            };
            let total: i64 = (0..nb.div_ceil(quad))
                .map(|g| match quad {
                    1 => fix(block_term(g)),
                    _ => {
                        let b = 4 * g;
                        let pair = |b: usize| block_term(b) + block_term(b + 1);
                        fix(pair(b) + pair(b + 2))
                    }
                })
                .sum();
            y[t * rows + r] = total as f32 * (1.0 / 4294967296.0);
        }
    }
    y
}

/// The host reference itself (no GPU needed): the product of the dequantized weights and the
/// q8_0 round trip of x, within f32 rounding.
#[test]
fn exact_sum_reference_is_the_product_within_rounding() {
    let mut rng = seeded_rng();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::IQ4_NL,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let k_quant = matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K);
        // 27 32-blocks: a quad cut short by the row's end.
        let (rows, cols, n) = (24, if k_quant { 512 } else { 864 }, 3);
        let wc = WeightCase::random(&mut rng, ty, rows, cols).unwrap();
        let x = rng.vec(n * cols);
        let mut want = vec![0f32; n * rows];
        let kind = u8::from(k_quant);
        let seen = quiver_cpu_kernels::activation_roundtrip(kind, &x);
        quiver_backend::reference::matmul(&wc.values, rows, cols, &seen, n, &mut want);
        // Q4_1's offset term sees q8_1's sum (the f16 of d·Σq), not the round trip's.
        let offs = quiver_cpu_kernels::activation_offset_terms(ty, &wc.bytes, rows, cols, &x, n);
        for (w, o) in want.iter_mut().zip(offs) {
            *w += o as f32;
        }
        let got = exact_sum_reference(ty, &wc.bytes, rows, cols, &x, n);
        let e = quiver_backend::testing::rel_err(&got, &want);
        assert!(e < 1e-6, "{ty}: rel err {e}");
    }
}

/// With the invariant numerics, the int8 types' decode rows give the exact-sum reference's
/// bits: on the table's families, and on each of them pinned for every count (mmvqc, imv in
/// launches of 8 and 16 tokens, imm).
#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_mma_products_give_the_exact_sum_bits() {
    let mut rng = seeded_rng();
    for pin in [
        None,
        Some(Product::Mmv),
        Some(Product::Imv),
        Some(Product::Imm),
    ] {
        let be = backend_with(CudaConfig {
            pin,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        });
        // Rows of 5, 18 and 27 32-blocks too: quads and chunks cut short by the row's end.
        for &(rows, cols) in PRODUCT_SHAPES
            .iter()
            .chain(&[(40, 160), (72, 576), (24, 864)])
        {
            for ty in [
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q5_0,
                GgmlType::Q8_0,
                GgmlType::IQ4_NL,
                GgmlType::Q4_K,
                GgmlType::Q6_K,
            ] {
                if cols % 256 != 0 && matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
                    continue;
                }
                let wc = WeightCase::random(&mut rng, ty, rows, cols).unwrap();
                let w = wc.load(&be).unwrap();
                for n in [1, 3, 9, 17, 32, 64, 150] {
                    let x = rng.vec(n * cols);
                    let xb = be.buf_from(&x).unwrap();
                    let mut out = poison(&be, &Cuda, n * rows);
                    be.matmul(&w, &xb, n, &mut out).unwrap();
                    let got = read(&be, &out, n * rows);
                    let want = exact_sum_reference(ty, &wc.bytes, rows, cols, &x, n);
                    let d = bits_differ(&got, &want);
                    assert_eq!(
                        d, 0,
                        "{ty} [{rows}, {cols}] × {n} tokens: {d} results differ (pinned {pin:?})"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_and_bias_match_reference() {
    let mut rng = seeded_rng();
    // The prompts' grouped products on the tensor cores, the decode steps' on int8 activations
    // (f32 for the types without int8 decode kernels).
    for numerics in [Numerics::Fast, Numerics::BatchInvariant] {
        let be = backend_with(CudaConfig::from_env(numerics));
        let notes = quiver_backend::testing::moe::moe(&be, &Cuda, &mut rng);
        notes.print(&format!("moe, numerics {numerics}"));
        assert!(notes.skipped.is_empty(), "{:?}", notes.skipped);
    }
}

/// The default numerics' experts: a token's bits whatever the step's other tokens (pair-wise
/// moeqc, imv_g's tiles; the f32 kernels of the other types).
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_is_batch_invariant() {
    let mut rng = seeded_rng();
    let be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    quiver_backend::testing::moe::moe_invariance(&be, &Cuda, &mut rng);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn parity_mode_products_and_gather_give_the_cpu_bits() {
    let mut rng = seeded_rng();
    let mut exact = ParityBackend::new(
        0,
        CudaConfig {
            graphs: false,
            ..CudaConfig::from_env(Numerics::Parity)
        },
    )
    .expect("a CUDA GPU");
    let (rows, cols) = (96, 512);
    let b = Batch::single(&[5, 0, 95, 17], 0, &[0], 16, vec![3]);
    let pool = quiver_cpu_kernels::ThreadPool::new(2).unwrap();
    let mut scratch = quiver_cpu_kernels::Scratch::new();
    for &ty in WEIGHT_TYPES {
        let wc = WeightCase::random(&mut rng, ty, rows, cols).unwrap();
        let w = match wc.load(&exact) {
            Ok(w) => w,
            // Types the parity mode has no product for are refused at load.
            Err(BackendError::Unsupported { .. }) => {
                eprintln!("skipped: the parity mode has no {ty} product");
                continue;
            }
            Err(e) => panic!("{ty}: {e}"),
        };
        // The gather rounds as the CPU's dequantizer: the same bits.
        let st = exact.begin_step(&b, 1, 8, 8).unwrap();
        let mut out = poison(exact.cuda(), &Cuda, b.n_tokens() * cols);
        exact.embed(&st, &w, 1.5, &mut out).unwrap();
        exact.end_step(true).unwrap();
        let got = read(&exact, &out, b.n_tokens() * cols);
        let want: Vec<f32> = b
            .tokens
            .iter()
            .flat_map(|&t| {
                wc.values[t as usize * cols..][..cols]
                    .iter()
                    .map(|v| v * 1.5)
            })
            .collect();
        let differ = bits_differ(&got, &want);
        assert_eq!(
            differ, 0,
            "{ty} embed in the parity mode: {differ} values differ"
        );
        // Its products give the CPU kernels' floats (batch invariant, at the active SIMD level).
        for n in [1usize, 3, 9] {
            let x = rng.vec(n * cols);
            let xb = exact.cuda().buf_from(&x).unwrap();
            let mut y = poison(exact.cuda(), &Cuda, n * rows);
            exact.matmul(&w, &xb, n, &mut y).unwrap();
            let got = read(&exact, &y, n * rows);
            let mut want = vec![0f32; n * rows];
            quiver_cpu_kernels::matmul(
                &pool,
                ty,
                &wc.bytes,
                rows,
                cols,
                &x,
                n,
                &mut want,
                &mut scratch,
            )
            .unwrap();
            let differ = bits_differ(&got, &want);
            assert_eq!(
                differ, 0,
                "{ty} matmul in the parity mode, {n} tokens: {differ} differ"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_matches_reference_with_paging_gqa_window_and_softcap() {
    let mut rng = seeded_rng();
    // The kernel table's families (the KV-group kernel for decode steps, flash for prompts,
    // split-K for head dims the KV-group kernel lacks), then every step on the split-K kernel
    // (f32 throughout) with the key ranges fixed at one per (token, head) (no merge) and at
    // three (merged); the flash kernel has its own test below.
    for attention_splits in [None, Some(1), Some(3)] {
        let mut be = backend_with(CudaConfig {
            attention_splits,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        });
        attention::attention(&mut be, &Cuda, &mut rng)
            .print(&format!("split-K attention, splits {attention_splits:?}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_prefill_matches_reference() {
    let mut rng = seeded_rng();
    // Prefill-shaped steps (the 6-, 9-, 64- and 151-token batches) take the flash kernel; the
    // decode steps beside them the KV-group kernel.
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    for tb in batches(&mut rng, 1000) {
        let b = &tb.batch;
        let st = be.begin_step(b, 0, 256, 256).unwrap();
        let tiles = st.ctx.flash_tiles() > 0;
        be.end_step(true).unwrap();
        let prefill = b.seqs.iter().any(|s| s.len > 1) && b.logits.len() < b.n_tokens();
        assert_eq!(tiles, prefill, "{}: flash tiles {tiles}", tb.name);
    }
    attention::attention(&mut be, &Cuda, &mut rng).print("flash attention");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_rope_kv_write_glu_softcap_argmax_match_reference() {
    let mut rng = seeded_rng();
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    elementwise::elementwise(&be, &Cuda, &mut rng).print("elementwise");
    attention::rope_kv_write(&mut be, &Cuda, &mut rng).print("rope_kv_write");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_kv_type_attends_within_its_codecs_error() {
    let mut rng = seeded_rng();
    // The KV-group decode kernel (its key ranges follow each token's own keys), then the
    // split-K kernel per head with its ranges fixed (one, and three merged), so that the last
    // token alone and in the 40-token step split its keys alike and the body's bit-for-bit
    // check holds. The flash kernel (f16 prompts) is not batch invariant against them.
    // One backend runs every pair: kernels of the same name in the pairs' modules must not be
    // confused.
    let mut failed = Vec::new();
    for attention_splits in [None, Some(1), Some(3)] {
        let mut be = backend_with(CudaConfig {
            attention_splits,
            ..CudaConfig::from_env(Numerics::BatchInvariant)
        });
        for pair in cuda_pairs() {
            let what = format!("splits {attention_splits:?}");
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                kv_types::kv_types(&mut be, &Cuda, &[pair], &mut rng)
            }));
            match r {
                Ok(notes) => notes.iter().for_each(|n| eprintln!("{what}: {n}")),
                Err(_) => failed.push(format!("{what}: {pair}")),
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// The pairs of `kv_types::all_pairs` the CUDA backend has kernels for: all but tq4 keys
/// (per-block records, `quiver_backend::kblock`), which it refuses (`tq4_keys_are_refused`).
fn cuda_pairs() -> Vec<quiver_backend::KvTypes> {
    kv_types::all_pairs()
        .into_iter()
        .filter(|p| !p.k.key_blocks())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tq4_keys_are_refused() {
    use quiver_backend::{KvLayer, KvSpec, KvType};
    let be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let spec = KvSpec {
        k: KvType::Tq4,
        v: KvType::Tq4,
        block_size: quiver_backend::KV_BLOCK_SIZE,
        n_slots: 32,
        layers: vec![KvLayer {
            n_head_kv: 2,
            head_dim: 64,
        }],
    };
    let e = be.kv(&spec, 0).err().expect("tq4 keys refused").to_string();
    assert!(e.contains("no tq4 keys") && !e.contains('\n'), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kv_records_are_the_cpu_encoders_bytes() {
    use quiver_backend::kvcodec::encode_head;
    use quiver_backend::{AttnParams, KvLayer, KvSpec, KvType, RopeMode, RopeParams};
    let mut rng = seeded_rng();
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let (n, bs) = (21usize, quiver_backend::KV_BLOCK_SIZE);
    let tokens: Vec<u32> = (0..n as u32).collect();
    let batch = Batch::single(&tokens, 0, &[1, 0], bs, vec![]);
    for hd in [64usize, 256, 512] {
        let (nh, nkv) = (4usize, 2usize);
        // No rotated dims: k reaches the cache as given, on both sides.
        let rope = RopeParams::plain(RopeMode::Neox, 0, 10000.0);
        let a = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 1.0,
            scale_q: false,
            window: None,
            softcap: None,
        };
        let (kh, vh) = (rng.scaled(n * nkv * hd, 4.0), rng.vec(n * nkv * hd));
        // tq4 keys: no CUDA kernels yet (`cuda_pairs`).
        for ty in KvType::ALL
            .into_iter()
            .filter(|&t| t != KvType::F16 && !t.key_blocks())
        {
            let spec = KvSpec {
                k: ty,
                v: KvType::Tq4,
                block_size: bs,
                n_slots: 2 * bs,
                layers: vec![KvLayer {
                    n_head_kv: nkv,
                    head_dim: hd,
                }],
            };
            let mut kv = be.kv(&spec, 0).unwrap();
            let st = be.begin_step(&batch, 0, 64, 64).unwrap();
            let mut q = be.buf_from(&rng.vec(n * nh * hd)).unwrap();
            let mut k = be.buf_from(&kh).unwrap();
            let v = be.buf_from(&vh).unwrap();
            be.rope_kv_write(&st, &mut q, &mut k, &v, &rope, &a, &mut kv)
                .unwrap();
            be.end_step(true).unwrap();
            let (kb, vb) = be.read_kv_bytes(&kv).unwrap();
            for (src, t, got) in [(&kh, ty, &kb), (&vh, KvType::Tq4, &vb)] {
                let hb = t.head_bytes(hd);
                let mut want = vec![0u8; hb];
                for tok in 0..n {
                    let slot = batch.slots[tok] as usize;
                    for h in 0..nkv {
                        encode_head(t, &src[(tok * nkv + h) * hd..][..hd], &mut want);
                        let rec = &got[(slot * nkv + h) * hb..][..hb];
                        assert_eq!(
                            rec,
                            &want[..],
                            "{} head dim {hd}, token {tok}, head {h}",
                            t.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prompts_over_every_kv_type_at_depth() {
    let mut rng = seeded_rng();
    // The prompt kernels over every pair of cache types (fwg.cu on sm_90 for the pairs of f16,
    // bf16 and q8_0, flash.cu else): 300 positions (one key range: rows
    // written by their block, un-rotated there for TurboQuant values) and 4,500 (two ranges:
    // partials merged by flash_merge).
    let mut be = backend_with(CudaConfig::from_env(Numerics::BatchInvariant));
    let mut failed = Vec::new();
    for len in [300usize, 4500] {
        for pair in cuda_pairs() {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                kv_types::prompt_at_depth(&mut be, &Cuda, &[pair], len, &mut rng)
            }));
            match r {
                Ok(notes) => notes.iter().for_each(|n| eprintln!("{n}")),
                Err(_) => failed.push(format!("{len} positions: {pair}")),
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
