//! Times `matmul` on the real models' weight shapes at n_tokens = 1 (decode) and 64
//! (prefill), prints the best ms of many runs, weight GB/s and GFLOP/s, next to the machine's read bandwidth and
//! the pool's dispatch overhead.
//!
//! cargo run --release -p quiver-cpu-kernels --example bench_matmul [-- THREADS [LEVEL] [FILTER]]
//!
//! THREADS defaults to the available cores (0 = default); LEVEL is portable|avx2|avx512|all
//! (default: the active level); FILTER keeps shapes whose label contains it.
//! `BENCH_NS=1,2,3,8` prints ms per call for those token counts instead of the table
//! (`BENCH_FAST=1`: in the fast numerics, else the batch-invariant default).
//! `BENCH_MODEL=1` instead runs every weight matrix of the two real models (distinct
//! buffers, so the weights stream from memory as in real decoding) once per token: matmul
//! time per generated token (n = 1) and per 64-token prompt (n = 64; the output head for
//! the last token only, as llama.cpp does).

use quiver_cpu_kernels::{matmul_with_level, GgmlType, Scratch, SimdLevel, ThreadPool};
use std::time::{Duration, Instant};

struct Shape {
    label: &'static str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

const SHAPES: &[Shape] = &[
    // SmolLM2-135M Q4_1 (n_embd 576, n_ff 1536, 3 KV heads of 64; output tied to the Q8_0
    // token embedding).
    Shape {
        label: "smollm2 attn_q/o",
        ty: GgmlType::Q4_1,
        rows: 576,
        cols: 576,
    },
    Shape {
        label: "smollm2 attn_k/v",
        ty: GgmlType::Q4_1,
        rows: 192,
        cols: 576,
    },
    Shape {
        label: "smollm2 ffn_up/gate",
        ty: GgmlType::Q4_1,
        rows: 1536,
        cols: 576,
    },
    Shape {
        label: "smollm2 ffn_down",
        ty: GgmlType::Q4_1,
        rows: 576,
        cols: 1536,
    },
    Shape {
        label: "smollm2 output",
        ty: GgmlType::Q8_0,
        rows: 49152,
        cols: 576,
    },
    // Gemma3-270M Q4_K_M as stored (640 columns cannot be K-quants, so those are Q5_0).
    Shape {
        label: "gemma3 attn_q",
        ty: GgmlType::Q5_0,
        rows: 1024,
        cols: 640,
    },
    Shape {
        label: "gemma3 attn_v",
        ty: GgmlType::Q8_0,
        rows: 256,
        cols: 640,
    },
    Shape {
        label: "gemma3 attn_output",
        ty: GgmlType::Q4_K,
        rows: 640,
        cols: 1024,
    },
    Shape {
        label: "gemma3 ffn_up/gate",
        ty: GgmlType::Q5_0,
        rows: 2048,
        cols: 640,
    },
    Shape {
        label: "gemma3 ffn_down",
        ty: GgmlType::Q6_K,
        rows: 640,
        cols: 2048,
    },
    Shape {
        label: "gemma3 ffn_down Q4_K",
        ty: GgmlType::Q4_K,
        rows: 640,
        cols: 2048,
    },
    Shape {
        label: "gemma3 output",
        ty: GgmlType::Q8_0,
        rows: 262144,
        cols: 640,
    },
    // Fixed per-call cost: a matmul with hardly any work.
    Shape {
        label: "overhead 4x576",
        ty: GgmlType::Q4_1,
        rows: 4,
        cols: 576,
    },
    Shape {
        label: "overhead 4x1536",
        ty: GgmlType::Q4_1,
        rows: 4,
        cols: 1536,
    },
    // The other supported types on one square-ish shape.
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::Q4_0,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::Q5_1,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::IQ4_NL,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::Q2_K,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::Q3_K,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::Q5_K,
        rows: 1024,
        cols: 2048,
    },
    // Qwen3.5-0.8B Q4_K_M's delta layers' in-projection (q, k, v channels).
    Shape {
        label: "qwen3.5 attn_qkv",
        ty: GgmlType::Q5_K,
        rows: 6144,
        cols: 1024,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::IQ4_XS,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "other 1024x2048",
        ty: GgmlType::F32,
        rows: 1024,
        cols: 2048,
    },
    Shape {
        label: "synth ffn_up F16",
        ty: GgmlType::F16,
        rows: 2048,
        cols: 640,
    },
    Shape {
        label: "synth ffn_up BF16",
        ty: GgmlType::BF16,
        rows: 2048,
        cols: 640,
    },
];

/// Random weights: 256 distinct quantized rows, repeated to fill the matrix.
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let distinct = rows.min(256);
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let f: Vec<f32> = (0..distinct * cols)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let mut q = Vec::new();
    quiver_quant::quantize(ty, &f, &mut q).expect("quantize");
    let mut w = Vec::with_capacity(q.len() / distinct * rows);
    while w.len() < q.len() / distinct * rows {
        let take = (q.len() / distinct * rows - w.len()).min(q.len());
        w.extend_from_slice(&q[..take]);
    }
    w
}

/// Fastest seconds per call of `f`, over at least `min_runs` runs and about `budget`. The
/// minimum, not the median: the dev machines are shared, and other processes preempting a
/// worker only ever add time.
fn time(mut f: impl FnMut(), min_runs: usize, budget: Duration) -> f64 {
    for _ in 0..2 {
        f();
    }
    let start = Instant::now();
    let mut v = Vec::new();
    while v.len() < min_runs || start.elapsed() < budget {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64());
        if v.len() > 100_000 {
            break;
        }
    }
    v.sort_by(f64::total_cmp);
    v[0]
}

/// One layer's matrices (type, rows, cols, count per layer) and the output head.
struct Model {
    name: &'static str,
    layers: usize,
    mats: &'static [(GgmlType, usize, usize)],
    output: (GgmlType, usize, usize),
}

const MODELS: &[Model] = &[
    Model {
        name: "smollm2-135m Q4_1",
        layers: 30,
        mats: &[
            (GgmlType::Q4_1, 576, 576),
            (GgmlType::Q4_1, 192, 576),
            (GgmlType::Q4_1, 192, 576),
            (GgmlType::Q4_1, 576, 576),
            (GgmlType::Q4_1, 1536, 576),
            (GgmlType::Q4_1, 1536, 576),
            (GgmlType::Q4_1, 576, 1536),
        ],
        output: (GgmlType::Q8_0, 49152, 576),
    },
    Model {
        name: "gemma3-270m Q4_K_M",
        layers: 18,
        mats: &[
            (GgmlType::Q5_0, 1024, 640),
            (GgmlType::Q5_0, 256, 640),
            (GgmlType::Q8_0, 256, 640),
            (GgmlType::Q4_K, 640, 1024),
            (GgmlType::Q5_0, 2048, 640),
            (GgmlType::Q5_0, 2048, 640),
            (GgmlType::Q6_K, 640, 2048),
        ],
        output: (GgmlType::Q8_0, 262144, 640),
    },
];

fn model_sweep(pool: &ThreadPool, level: SimdLevel) {
    let mut scratch = Scratch::new();
    for m in MODELS {
        // Distinct buffers per layer: copies of one quantized matrix per shape.
        let mut layers: Vec<Vec<Vec<u8>>> = Vec::new();
        let protos: Vec<Vec<u8>> = m.mats.iter().map(|&(ty, r, c)| weights(ty, r, c)).collect();
        let same = std::env::var("BENCH_MODEL").is_ok_and(|v| v == "same");
        for _ in 0..if same { 1 } else { m.layers } {
            layers.push(protos.clone());
        }
        let reps = if same { m.layers } else { 1 };
        let (oty, orows, ocols) = m.output;
        let out_w = weights(oty, orows, ocols);
        let maxc = m.mats.iter().map(|x| x.2).max().unwrap_or(1).max(ocols);
        let maxr = m.mats.iter().map(|x| x.1).max().unwrap_or(1).max(orows);
        let x: Vec<f32> = (0..64 * maxc)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        let mut out = vec![0f32; 64 * maxr];
        let mut pass = |n: usize| {
            for layer in layers.iter().cycle().take(layers.len() * reps) {
                for (w, &(ty, r, c)) in layer.iter().zip(m.mats) {
                    matmul_with_level(
                        level,
                        pool,
                        ty,
                        w,
                        r,
                        c,
                        &x[..n * c],
                        n,
                        &mut out[..n * r],
                        &mut scratch,
                    )
                    .expect("matmul");
                }
            }
            matmul_with_level(
                level,
                pool,
                oty,
                &out_w,
                orows,
                ocols,
                &x[..ocols],
                1,
                &mut out[..orows],
                &mut scratch,
            )
            .expect("matmul");
        };
        let tg = time(|| pass(1), 5, Duration::from_millis(1500));
        let pp = time(|| pass(64), 3, Duration::from_millis(1500));
        let bytes: usize = protos.iter().map(Vec::len).sum::<usize>() * m.layers + out_w.len();
        let name = if same {
            format!("{} (cached)", m.name)
        } else {
            m.name.to_string()
        };
        println!(
            "{:<28} {:>8} | weights {:>6.1} MB | n=1: {:>6.3} ms/token ({:>6.1} GB/s, {:>6.0} t/s) | n=64: {:>7.2} ms ({:>6.0} t/s)",
            name,
            level.name(),
            bytes as f64 / 1e6,
            tg * 1e3,
            bytes as f64 / tg / 1e9,
            1.0 / tg,
            pp * 1e3,
            64.0 / pp
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let levels: Vec<SimdLevel> = match args.get(2).map(String::as_str) {
        Some("all") => SimdLevel::ALL
            .into_iter()
            .filter(|&l| l <= SimdLevel::detected())
            .collect(),
        Some(s) => vec![SimdLevel::parse(s).expect("level: portable|avx2|avx512|all")],
        None => vec![SimdLevel::active()],
    };
    let filter = args.get(3).cloned().unwrap_or_default();
    let pool = ThreadPool::new(threads).expect("thread pool");
    println!(
        "threads {}, detected {}, levels {:?}",
        pool.n_threads(),
        SimdLevel::detected().name(),
        levels.iter().map(|l| l.name()).collect::<Vec<_>>()
    );

    let empty = time(
        || pool.run(pool.n_threads(), &|_| {}),
        20_000,
        Duration::from_millis(300),
    );
    println!(
        "pool dispatch (empty run, {} tasks): {:.2} us",
        pool.n_threads(),
        empty * 1e6
    );

    // Read bandwidth: sum 512 MiB of f32 split over the pool.
    let big = vec![1.0f32; 128 << 20];
    let chunk = big.len() / (8 * pool.n_threads());
    let sums: Vec<std::sync::Mutex<f32>> = (0..8 * pool.n_threads())
        .map(|_| std::sync::Mutex::new(0.0))
        .collect();
    let bw = time(
        || {
            pool.run(sums.len(), &|i| {
                let s: f32 = big[i * chunk..(i + 1) * chunk]
                    .chunks_exact(16)
                    .map(|c| c.iter().sum::<f32>())
                    .sum();
                if let Ok(mut g) = sums[i].lock() {
                    *g += s;
                }
            })
        },
        5,
        Duration::from_millis(500),
    );
    println!(
        "memory read bandwidth (512 MiB f32 sum): {:.1} GB/s",
        (big.len() * 4) as f64 / bw / 1e9
    );
    drop(big);

    if std::env::var("BENCH_MODEL").is_ok() {
        for &level in &levels {
            model_sweep(&pool, level);
        }
        return;
    }
    if let Ok(ns) = std::env::var("BENCH_NS") {
        let ns: Vec<usize> = ns
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect();
        // BENCH_FAST=1: the fast numerics (the GEMM path from its token count).
        let mut scratch = if std::env::var("BENCH_FAST").is_ok() {
            Scratch::with_numerics(quiver_cpu_kernels::Numerics::Fast)
        } else {
            Scratch::new()
        };
        print!("{:<22} {:>6} {:>8} |", "shape", "type", "level");
        for n in &ns {
            print!(" {:>9}", format!("n={n} us"));
        }
        println!();
        for s in SHAPES.iter().filter(|s| s.label.contains(filter.as_str())) {
            let w = weights(s.ty, s.rows, s.cols);
            let nmax = ns.iter().copied().max().unwrap_or(1);
            let x: Vec<f32> = (0..nmax * s.cols)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
                .collect();
            let mut out = vec![0f32; nmax * s.rows];
            for &level in &levels {
                print!("{:<22} {:>6} {:>8} |", s.label, s.ty.name(), level.name());
                for &n in &ns {
                    let t = time(
                        || {
                            matmul_with_level(
                                level,
                                &pool,
                                s.ty,
                                &w,
                                s.rows,
                                s.cols,
                                &x[..n * s.cols],
                                n,
                                &mut out[..n * s.rows],
                                &mut scratch,
                            )
                            .expect("matmul")
                        },
                        5,
                        Duration::from_millis(200),
                    );
                    print!(" {:>9.1}", t * 1e6);
                }
                println!();
            }
        }
        return;
    }
    println!(
        "{:<22} {:>6} {:>7} {:>6} {:>8} | {:>9} {:>7} {:>7} | {:>9} {:>8} {:>9}",
        "shape",
        "type",
        "rows",
        "cols",
        "level",
        "n=1 ms",
        "GB/s",
        "GFLOP/s",
        "n=64 ms",
        "GFLOP/s",
        "tok/s"
    );
    let mut scratch = Scratch::new();
    for s in SHAPES.iter().filter(|s| s.label.contains(filter.as_str())) {
        let w = weights(s.ty, s.rows, s.cols);
        let x: Vec<f32> = (0..64 * s.cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        let mut out = vec![0f32; 64 * s.rows];
        for &level in &levels {
            let mut run = |n: usize| {
                let budget = Duration::from_millis(if s.rows > 50_000 { 1500 } else { 400 });
                time(
                    || {
                        matmul_with_level(
                            level,
                            &pool,
                            s.ty,
                            &w,
                            s.rows,
                            s.cols,
                            &x[..n * s.cols],
                            n,
                            &mut out[..n * s.rows],
                            &mut scratch,
                        )
                        .expect("matmul")
                    },
                    5,
                    budget,
                )
            };
            let t1 = run(1);
            let t64 = run(64);
            let flop = 2.0 * (s.rows * s.cols) as f64;
            println!(
                "{:<22} {:>6} {:>7} {:>6} {:>8} | {:>9.4} {:>7.1} {:>7.1} | {:>9.3} {:>8.1} {:>9.0}",
                s.label,
                s.ty.name(),
                s.rows,
                s.cols,
                level.name(),
                t1 * 1e3,
                w.len() as f64 / t1 / 1e9,
                flop / t1 / 1e9,
                t64 * 1e3,
                64.0 * flop / t64 / 1e9,
                64.0 / t64
            );
        }
    }
}
