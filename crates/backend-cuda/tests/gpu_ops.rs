//! Every CUDA op against the scalar reference on fresh random inputs (poisoned outputs, so an
//! unwritten element fails). Needs a GPU: `#[ignore]`d, so CI reports them as ignored; on a
//! GPU machine run the test binary with `--include-ignored` (docs/GPU.md).

use quiver_backend::testing::{kv_spec, rel_err, two_sequence_batch, Rng};
use quiver_backend::{
    reference, Activation, AttnParams, Backend, Batch, RopeMode, RopeParams, SeqSpan, WeightBytes,
};
use quiver_backend_cuda::{CudaBackend, CudaConfig};
use quiver_gguf::{GgmlType, GgufFile, GgufWriter};
use std::sync::Arc;

fn seed() -> u64 {
    // Fresh inputs every run; the seed is printed so a failure can be replayed.
    let s = std::env::var("QUIVER_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("seed {s}");
    s
}

/// The activation block size when products of `ty` weights on the matrix-vector kernels
/// (`mmv`) take int8 activations.
fn int8_block(ty: GgmlType, mmv: bool) -> Option<usize> {
    quiver_backend_cuda::kernel_suffix(ty)
        .and_then(quiver_backend_cuda::registry::int8_activations)
        .filter(|_| mmv && std::env::var("QUIVER_CUDA_INT8").as_deref() != Ok("0"))
}

/// x as the products see it: on the matrix-vector kernels quantized to int8 blocks (32, or 256
/// for the K-quants) for the types with integer kernels; on the tensor cores (`mmv` false)
/// rounded to the int8 grid of every quantized type (then to f16, which the bounds cover); both
/// as the CPU backend quantizes it.
fn as_seen(ty: GgmlType, mmv: bool, x: &[f32]) -> Vec<f32> {
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

/// What a reference over `as_seen` activations misses of a product on the matrix-vector
/// kernels: the f16 offset sums of Q4_1/Q5_1 on int8 activations (ggml's q8_1), `[n, rows]`.
fn offsets(
    ty: GgmlType,
    mmv: bool,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    if int8_block(ty, mmv) == Some(32) {
        quiver_cpu_kernels::activation_offset_terms(ty, w, rows, cols, x, n)
            .iter()
            .map(|&v| v as f32)
            .collect()
    } else {
        vec![0.0; n * rows]
    }
}

fn backend_with(config: CudaConfig) -> CudaBackend {
    CudaBackend::new(0, config).expect("a CUDA GPU")
}

fn tensor(ty: GgmlType, shape: &[u64], bytes: &[u8]) -> WeightBytes {
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, shape);
    let f = GgufFile::from_bytes(w.to_bytes(&[bytes]).unwrap()).unwrap();
    WeightBytes {
        file: Arc::new(f),
        tensor: 0,
    }
}

/// How many values of `a` and `b` are not the same bits.
fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn poison(be: &CudaBackend, n: usize) -> quiver_backend_cuda::CudaBuf {
    be.buf_from(&vec![f32::NAN; n]).unwrap()
}

fn read(be: &CudaBackend, b: &quiver_backend_cuda::CudaBuf, n: usize) -> Vec<f32> {
    let mut v = Vec::new();
    be.read(b, n, &mut v).unwrap();
    v
}

const MATMUL_TYPES: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_and_embedding_match_reference_for_every_type() {
    let mut rng = Rng(seed());
    // Every count on the matrix-vector kernels (in launches of up to 8 tokens), then with
    // the default cut-over, where 3 tokens and more take the tensor-core path: a backend each.
    let gemm_mins = [usize::MAX, 3];
    let mut bes = gemm_mins.map(|gemm_min_tokens| {
        backend_with(CudaConfig {
            gemm_min_tokens,
            ..CudaConfig::from_env()
        })
    });
    let (rows, cols) = (96, 512);
    for &ty in MATMUL_TYPES {
        let wf = rng.vec(rows * cols);
        let mut q = Vec::new();
        quiver_quant::quantize(ty, &wf, &mut q).unwrap();
        let mut wd = vec![0f32; rows * cols];
        quiver_quant::dequantize(ty, &q, &mut wd).unwrap();
        let load = |be: &CudaBackend| {
            be.weight(
                "w",
                ty,
                &[rows as u64, cols as u64],
                tensor(ty, &[rows as u64, cols as u64], &q),
            )
            .unwrap()
        };
        for (be, &gemm_min) in bes.iter().zip(&gemm_mins) {
            let w = load(be);
            // True when `n` tokens run on the matrix-vector kernels (exact up to f32 rounding).
            let mmv = |be: &CudaBackend, n: usize| n < gemm_min || !be.has_cublas();
            for n in [1usize, 3, 8, 17, 40] {
                let x = rng.vec(n * cols);
                let xb = be.buf_from(&x).unwrap();
                let mut out = poison(be, n * rows);
                be.matmul(&w, &xb, n, &mut out).unwrap();
                let got = read(be, &out, n * rows);
                let mut want = vec![0f32; n * rows];
                reference::matmul(&wd, rows, cols, &as_seen(ty, mmv(be, n), &x), n, &mut want);
                let off = offsets(ty, mmv(be, n), &q, rows, cols, &x, n);
                want.iter_mut().zip(&off).for_each(|(w, o)| *w += o);
                let e = rel_err(&got, &want);
                let bound = if mmv(be, n) { 1e-5 } else { 1.5e-3 };
                assert!(e < bound, "{ty} matmul, {n} tokens: relative error {e}");
                if !mmv(be, n) && quiver_backend_cuda::act_grid(ty).is_some() {
                    // The tensor-core path's activations are on the int8 grid, not plain f16:
                    // against x itself the error is the int8 rounding's, several times larger.
                    let mut plain = vec![0f32; n * rows];
                    reference::matmul(&wd, rows, cols, &x, n, &mut plain);
                    let ep = rel_err(&got, &plain);
                    eprintln!("{ty} cuBLAS, {n} tokens: error {e:.2e} (grid), {ep:.2e} (plain x)");
                    assert!(
                        ep > 3.0 * e,
                        "{ty} cuBLAS, {n} tokens: activations not on the int8 grid ({e} vs {ep})"
                    );
                }
            }
            // Fused: q/k/v in one launch (three matrices of the type), gate·up with the activation.
            let w2f = rng.vec(rows * cols);
            let mut q2 = Vec::new();
            quiver_quant::quantize(ty, &w2f, &mut q2).unwrap();
            let mut wd2 = vec![0f32; rows * cols];
            quiver_quant::dequantize(ty, &q2, &mut wd2).unwrap();
            let w2 = be
                .weight(
                    "w2",
                    ty,
                    &[rows as u64, cols as u64],
                    tensor(ty, &[rows as u64, cols as u64], &q2),
                )
                .unwrap();
            for n in [1usize, 5, 12] {
                let x = rng.vec(n * cols);
                let xb = be.buf_from(&x).unwrap();
                let (mut a, mut b2, mut c) = (
                    poison(be, n * rows),
                    poison(be, n * rows),
                    poison(be, n * rows),
                );
                be.matmul_qkv([&w, &w2, &w], &xb, n, [&mut a, &mut b2, &mut c])
                    .unwrap();
                let (mut wa, mut wb) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                reference::matmul(&wd, rows, cols, &as_seen(ty, mmv(be, n), &x), n, &mut wa);
                reference::matmul(&wd2, rows, cols, &as_seen(ty, mmv(be, n), &x), n, &mut wb);
                let (oa, ob) = (
                    offsets(ty, mmv(be, n), &q, rows, cols, &x, n),
                    offsets(ty, mmv(be, n), &q2, rows, cols, &x, n),
                );
                wa.iter_mut().zip(&oa).for_each(|(w, o)| *w += o);
                wb.iter_mut().zip(&ob).for_each(|(w, o)| *w += o);
                let bound = if mmv(be, n) { 1e-5 } else { 1.5e-3 };
                assert!(
                    rel_err(&read(be, &a, n * rows), &wa) < bound,
                    "{ty} qkv[0], {n} tokens"
                );
                assert!(
                    rel_err(&read(be, &b2, n * rows), &wb) < bound,
                    "{ty} qkv[1], {n} tokens"
                );
                assert!(
                    rel_err(&read(be, &c, n * rows), &wa) < bound,
                    "{ty} qkv[2], {n} tokens"
                );
                for act in [Activation::SwiGlu, Activation::GeGlu] {
                    let (mut s1, mut s2, mut o) = (
                        poison(be, n * rows),
                        poison(be, n * rows),
                        poison(be, n * rows),
                    );
                    be.matmul_glu(act, &w, &w2, &xb, n, [&mut s1, &mut s2], &mut o)
                        .unwrap();
                    let mut want = vec![0f32; n * rows];
                    reference::glu(act, &wa, &wb, &mut want);
                    let e = rel_err(&read(be, &o, n * rows), &want);
                    // GeGLU goes through f16 (as ggml's): a rounding step can move an element by 1e-3.
                    assert!(
                        e < bound.max(2e-3),
                        "{ty} matmul_glu {act:?}, {n} tokens: {e}"
                    );
                }
            }
        }
        // Embedding gather: token ids from a batch, scaled (with the default cut-over).
        let be = &mut bes[1];
        let w = load(be);
        let mut b = Batch::single(&[5, 0, 95, 17], 0, &[0], 16, vec![3]);
        b.tokens = vec![5, 0, 95, 17];
        let st = be.begin_step(&b, 1, 8, 8).unwrap();
        let mut out = poison(be, 4 * cols);
        be.embed(&st, &w, 1.5, &mut out).unwrap();
        be.end_step(true).unwrap();
        let got = read(be, &out, 4 * cols);
        let want: Vec<f32> = b
            .tokens
            .iter()
            .flat_map(|&t| wd[t as usize * cols..][..cols].iter().map(|v| v * 1.5))
            .collect();
        assert!(rel_err(&got, &want) < 1e-6, "{ty} embed");
        // The parity mode's gather rounds as the CPU's dequantizer: the same bits.
        let mut exact = backend_with(CudaConfig {
            exact: true,
            ..CudaConfig::from_env()
        });
        let wx = match exact.weight(
            "w",
            ty,
            &[rows as u64, cols as u64],
            tensor(ty, &[rows as u64, cols as u64], &q),
        ) {
            Ok(w) => w,
            // Types the parity mode has no product for are refused at load.
            Err(quiver_backend::BackendError::Unsupported { .. }) => continue,
            Err(e) => panic!("{ty}: {e}"),
        };
        let xst = exact.begin_step(&b, 1, 8, 8).unwrap();
        let mut out = poison(&exact, 4 * cols);
        exact.embed(&xst, &wx, 1.5, &mut out).unwrap();
        exact.end_step(true).unwrap();
        let got = read(&exact, &out, 4 * cols);
        let differ = bits_differ(&got, &want);
        assert_eq!(
            differ, 0,
            "{ty} embed in the parity mode: {differ} values differ"
        );
        // Its products give the CPU kernels' floats (batch invariant, at the active SIMD level).
        let pool = quiver_cpu_kernels::ThreadPool::new(2).unwrap();
        let mut scratch = quiver_cpu_kernels::Scratch::new();
        for n in [1usize, 3, 9] {
            let x = rng.vec(n * cols);
            let xb = exact.buf_from(&x).unwrap();
            let mut y = poison(&exact, n * rows);
            exact.matmul(&wx, &xb, n, &mut y).unwrap();
            let got = read(&exact, &y, n * rows);
            let mut want = vec![0f32; n * rows];
            quiver_cpu_kernels::matmul(&pool, ty, &q, rows, cols, &x, n, &mut want, &mut scratch)
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
    let mut rng = Rng(seed());
    let b = two_sequence_batch();
    // The split-K kernel (f32 throughout); the flash kernel has its own test below. With the
    // key ranges chosen by the shapes, and fixed at one per (token, head) (no merge) and at
    // three (merged).
    let config = |attention_splits| CudaConfig {
        graphs: false,
        flash: false,
        attention_splits,
        ..CudaConfig::from_env()
    };
    let mut be = backend_with(config(None));
    let mut fixed = [1, 3].map(|splits| {
        let mut fb = backend_with(config(Some(splits)));
        let st = fb.begin_step(&b, 2, 64, 64).unwrap();
        (splits, fb, st)
    });
    let st = be.begin_step(&b, 2, 64, 64).unwrap();
    for n_slots in [48usize, 4096] {
        for (hd, nh, nkv, window, softcap) in [
            (64, 4, 2, None, None),
            (256, 4, 1, Some(3), None),
            (128, 6, 3, None, Some(30.0f32)),
            (128, 32, 8, None, None),
        ] {
            let a = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                scale_q: false,
                window,
                softcap,
            };
            let (kv, kf, vf) = random_kv(&be, &mut rng, n_slots, nkv * hd);
            let q: Vec<f32> = rng
                .vec(b.n_tokens() * nh * hd)
                .iter()
                .map(|x| x * 3.0)
                .collect();
            let qb = be.buf_from(&q).unwrap();
            let mut out = poison(&be, q.len());
            be.attention(&st, &qb, &kv, &a, &mut out).unwrap();
            let got = read(&be, &out, q.len());
            let mut want = vec![0.0; q.len()];
            reference::attention(&q, &kf, &vf, &b, &a, &mut want);
            let e = rel_err(&got, &want);
            assert!(
                e < 1e-5,
                "hd {hd} heads {nh}/{nkv} slots {n_slots}: relative error {e}"
            );
            // One range per (token, head) (no merge) and three (merged) agree with the reference.
            let (kc, vc) = be.read_kv(&kv).unwrap();
            for (splits, fb, fst) in &fixed {
                let mut kv2 = fb.kv(&kv_spec(n_slots, nkv * hd), 0).unwrap();
                fb.write_kv(&mut kv2, &kc, &vc).unwrap();
                let qb2 = fb.buf_from(&q).unwrap();
                let mut o2 = poison(fb, q.len());
                fb.attention(fst, &qb2, &kv2, &a, &mut o2).unwrap();
                let e = rel_err(&read(fb, &o2, q.len()), &want);
                assert!(e < 1e-5, "hd {hd} slots {n_slots}, {splits} splits: {e}");
            }
        }
    }
    be.end_step(true).unwrap();
    for (_, fb, _) in &mut fixed {
        fb.end_step(true).unwrap();
    }
}

/// A KV cache of random f16 values (K scaled up, so that softmax is not flat), and the same
/// values as f32 for the reference.
fn random_kv(
    be: &CudaBackend,
    rng: &mut Rng,
    n_slots: usize,
    kv_dim: usize,
) -> (quiver_backend_cuda::CudaKv, Vec<f32>, Vec<f32>) {
    let mut kv = be.kv(&kv_spec(n_slots, kv_dim), 0).unwrap();
    let kh: Vec<half::f16> = rng
        .vec(n_slots * kv_dim)
        .iter()
        .map(|x| half::f16::from_f32(x * 3.0))
        .collect();
    let vh: Vec<half::f16> = rng
        .vec(n_slots * kv_dim)
        .iter()
        .map(|x| half::f16::from_f32(*x))
        .collect();
    let bits = |v: &[half::f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
    be.write_kv(&mut kv, &bits(&kh), &bits(&vh)).unwrap();
    let f = |v: &[half::f16]| v.iter().map(|h| h.to_f32()).collect::<Vec<_>>();
    (kv, f(&kh), f(&vh))
}

fn vector(be: &CudaBackend, v: &[f32]) -> quiver_backend_cuda::CudaWeight {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    be.weight(
        "w",
        GgmlType::F32,
        &[v.len() as u64],
        tensor(GgmlType::F32, &[v.len() as u64], &bytes),
    )
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_rope_kv_write_glu_softcap_argmax_match_reference() {
    let mut rng = Rng(seed());
    let b = two_sequence_batch();
    let mut be = backend_with(CudaConfig {
        graphs: false,
        ..CudaConfig::from_env()
    });
    let st = be.begin_step(&b, 3, 64, 64).unwrap();
    let (n, d) = (b.n_tokens(), 96);
    let g = rng.vec(d);
    let w = vector(&be, &g);
    let x = rng.vec(n * d);
    let xb = be.buf_from(&x).unwrap();
    let mut out = poison(&be, n * d);
    be.rms_norm(&xb, &w, 1e-6, n, &mut out).unwrap();
    let mut want = vec![0.0; n * d];
    reference::rms_norm(&x, &g, 1e-6, &mut want);
    assert!(rel_err(&read(&be, &out, n * d), &want) < 1e-6, "rms_norm");
    let mut inplace = be.buf_from(&x).unwrap();
    be.rms_norm_inplace(&mut inplace, &w, 1e-6, n).unwrap();
    assert!(
        rel_err(&read(&be, &inplace, n * d), &want) < 1e-6,
        "rms_norm_inplace"
    );
    let resid = rng.vec(n * d);
    let addv = rng.vec(n * d);
    let sum: Vec<f32> = resid.iter().zip(&addv).map(|(a, b)| a + b).collect();
    let mut rb = be.buf_from(&resid).unwrap();
    let ab = be.buf_from(&addv).unwrap();
    be.add_rms_norm(&mut rb, &ab, &w, 1e-6, n, &mut out)
        .unwrap();
    reference::rms_norm(&sum, &g, 1e-6, &mut want);
    assert!(
        rel_err(&read(&be, &rb, n * d), &sum) < 1e-7,
        "add_rms_norm residual"
    );
    assert!(
        rel_err(&read(&be, &out, n * d), &want) < 1e-6,
        "add_rms_norm out"
    );
    let mut ab2 = be.buf_from(&resid).unwrap();
    be.add(&mut ab2, &ab, n * d).unwrap();
    assert!(rel_err(&read(&be, &ab2, n * d), &sum) < 1e-7, "add");

    // rope (both modes, llama3 scaling) fused with the KV write
    for (mode, hd, n_dims) in [
        (RopeMode::Normal, 64, 64),
        (RopeMode::Neox, 128, 128),
        (RopeMode::Neox, 128, 64),
    ] {
        let (nh, nkv, n_slots) = (4, 2, 48);
        let a = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 1.0,
            scale_q: false,
            window: None,
            softcap: None,
        };
        let llama3 = (mode == RopeMode::Normal).then_some(quiver_backend::Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 64.0,
        });
        let rope = RopeParams {
            mode,
            n_dims,
            base: 10000.0,
            freq_scale: 1.0,
            llama3,
            freq_factors: None,
        };
        let q = rng.vec(n * nh * hd);
        let k = rng.vec(n * nkv * hd);
        let v = rng.vec(n * nkv * hd);
        let (mut qb, mut kb, vb) = (
            be.buf_from(&q).unwrap(),
            be.buf_from(&k).unwrap(),
            be.buf_from(&v).unwrap(),
        );
        let mut kv = be.kv(&kv_spec(n_slots, nkv * hd), 0).unwrap();
        be.rope_kv_write(&st, &mut qb, &mut kb, &vb, &rope, &a, &mut kv)
            .unwrap();
        let (mut qw, mut kw) = (q.clone(), k.clone());
        reference::rope(&mut qw, &b.positions, nh, hd, &rope);
        reference::rope(&mut kw, &b.positions, nkv, hd, &rope);
        assert!(
            rel_err(&read(&be, &qb, q.len()), &qw) < 1e-5,
            "rope q {mode:?}"
        );
        let (kc, vc) = be.read_kv(&kv).unwrap();
        let kvd = nkv * hd;
        for t in 0..n {
            let s = b.slots[t] as usize;
            let kgot: Vec<f32> = kc[s * kvd..][..kvd]
                .iter()
                .map(|&h| half::f16::from_bits(h).to_f32())
                .collect();
            let vgot: Vec<f32> = vc[s * kvd..][..kvd]
                .iter()
                .map(|&h| half::f16::from_bits(h).to_f32())
                .collect();
            assert!(
                rel_err(&kgot, &kw[t * kvd..][..kvd]) < 1e-3,
                "k cache token {t}"
            );
            assert!(
                rel_err(&vgot, &v[t * kvd..][..kvd]) < 1e-3,
                "v cache token {t}"
            );
        }
    }

    // glu: both activations
    let m = 1000;
    let (gate, up) = (
        rng.vec(m).iter().map(|x| x * 6.0).collect::<Vec<_>>(),
        rng.vec(m),
    );
    let (gb, ub) = (be.buf_from(&gate).unwrap(), be.buf_from(&up).unwrap());
    for act in [Activation::SwiGlu, Activation::GeGlu] {
        let mut ob = poison(&be, m);
        be.glu(act, &gb, &ub, m, &mut ob).unwrap();
        let mut want = vec![0.0; m];
        reference::glu(act, &gate, &up, &mut want);
        assert!(rel_err(&read(&be, &ob, m), &want) < 1e-3, "glu {act:?}");
    }

    // softcap and argmax
    let rows = 3;
    let cols = 50_000;
    let mut logits = rng.vec(rows * cols);
    logits[cols + 777] = 9.0;
    logits[2 * cols + 5] = 9.0;
    logits[2 * cols + 6] = 9.0;
    let mut lb = be.buf_from(&logits).unwrap();
    let mut ids = Vec::new();
    be.argmax(&lb, rows, cols, &mut ids).unwrap();
    let want_ids: Vec<u32> = logits.chunks(cols).map(reference::argmax).collect();
    assert_eq!(ids, want_ids);
    // top-k: ties go to the smaller index, NaN never counts, every row gets k pairs.
    let mut tl = logits.clone();
    tl[7] = f32::NAN;
    tl[cols + 778] = 9.0;
    let tb = be.buf_from(&tl).unwrap();
    for k in [1usize, 5, 40, 64] {
        let mut got = Vec::new();
        be.top_k(&tb, rows, cols, k, &mut got).unwrap();
        let mut want = Vec::new();
        for row in tl.chunks(cols) {
            reference::top_k(row, k, &mut want);
        }
        assert_eq!(got, want, "top_k {k}");
    }
    be.softcap(&mut lb, 5.0, rows * cols).unwrap();
    let want: Vec<f32> = logits.iter().map(|x| 5.0 * (x / 5.0).tanh()).collect();
    assert!(
        rel_err(&read(&be, &lb, rows * cols), &want) < 1e-6,
        "softcap"
    );
    be.end_step(true).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_prefill_matches_reference() {
    let mut rng = Rng(seed());
    let mut be = backend_with(CudaConfig {
        graphs: false,
        flash: true,
        ..CudaConfig::from_env()
    });
    // A 150-token prefill (3 query tiles, 3 key tiles) and a 1-token decode at position 70
    // beside it; 16-slot blocks, scattered.
    let bs = 16;
    let n_slots = 32 * bs;
    let mut perm: Vec<u32> = (0..32).collect();
    for i in (1..perm.len()).rev() {
        let j = (rng.f().abs() * (i + 1) as f32) as usize % (i + 1);
        perm.swap(i, j);
    }
    let seqs = vec![
        SeqSpan {
            start: 0,
            len: 150,
            kv_len: 150,
            block_table: perm[..10].to_vec(),
        },
        SeqSpan {
            start: 150,
            len: 1,
            kv_len: 71,
            block_table: perm[10..15].to_vec(),
        },
    ];
    let n = 151;
    let mut b = Batch {
        tokens: vec![1; n],
        positions: (0..150).chain([70]).collect(),
        seq_of: [vec![0; 150], vec![1]].concat(),
        seqs,
        logits: vec![150],
        block_size: bs,
        slots: vec![],
    };
    b.slots = (0..n)
        .map(|t| b.slot(b.seq_of[t] as usize, b.positions[t] as usize) as u32)
        .collect();
    let st = be.begin_step(&b, 4, 256, 256).unwrap();
    for (hd, nh, nkv, window, softcap) in [
        (64, 4, 2, None, None),
        (128, 8, 2, None, None),
        (128, 4, 4, Some(40u32), None),
        (64, 4, 1, Some(100), Some(20.0f32)),
        (256, 4, 1, Some(40), None),
        (256, 8, 2, None, Some(30.0)),
        (256, 2, 2, None, None),
    ] {
        let a = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            scale_q: false,
            window,
            softcap,
        };
        let (kv, kf, vf) = random_kv(&be, &mut rng, n_slots, nkv * hd);
        let q: Vec<f32> = rng.vec(n * nh * hd).iter().map(|x| x * 3.0).collect();
        let qb = be.buf_from(&q).unwrap();
        let mut out = poison(&be, q.len());
        be.attention(&st, &qb, &kv, &a, &mut out).unwrap();
        let got = read(&be, &out, q.len());
        let mut want = vec![0.0; q.len()];
        reference::attention(&q, &kf, &vf, &b, &a, &mut want);
        let e = rel_err(&got, &want);
        // q and the probabilities meet the tensor cores in f16: ~1e-3 relative.
        assert!(e < 5e-3, "flash hd {hd} heads {nh}/{nkv} window {window:?} softcap {softcap:?}: relative error {e}");
    }
    be.end_step(true).unwrap();
}
