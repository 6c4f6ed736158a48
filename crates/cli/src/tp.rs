//! `-tp N`: a model split over N tensor-parallel ranks (`ModelRunner::with_ranks`): on the CPU
//! each a backend of `--threads / N` threads in one group (`LocalComm`), on CUDA each a GPU
//! (`--device cuda:K`: GPUs K … K + N − 1) in one NCCL group. The flags that ask for several
//! devices (`-tp`, `-sm`, `-ts`) are read here.

use crate::engine::{self, Device, LoadArgs, Loaded};
use anyhow::Result;
use quiver_backend::{human_bytes, Comm, LocalComm};
use quiver_backend_cpu::{CpuBackend, CpuConfig};
use quiver_engine::{ModelRunner, RunnerOptions};
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// Loads `file` over `ranks` CPU ranks for one sequence (what [`engine::load`] does for one
/// rank), and logs each rank's weights and KV cache.
pub fn load(
    args: &LoadArgs,
    file: &Arc<GgufFile>,
    opts: &RunnerOptions,
    ranks: usize,
    (device, desc): (Device, &str),
    t0: std::time::Instant,
) -> Result<Loaded> {
    match device {
        Device::Cpu => {
            let threads = (engine::threads(args)? / ranks).max(1);
            let backends = cpu_ranks(ranks, threads, args.numerics, args.mlock);
            let s = ModelRunner::with_ranks(backends, file, opts)?;
            let plural = if threads == 1 { "" } else { "s" };
            let on = format!("{desc} as {ranks} tensor-parallel ranks of {threads} thread{plural}");
            Ok(logged(
                s,
                &on,
                engine::cpu_invariance(args.numerics),
                opts,
                t0,
            ))
        }
        Device::Cuda(first) => {
            let config = quiver_backend_cuda::CudaConfig::from_env(args.numerics);
            let backends = cuda_ranks(ranks, first, config).map_err(anyhow::Error::msg)?;
            let s = ModelRunner::with_ranks(backends, file, opts)?;
            let last = first + ranks - 1;
            let on = format!("GPUs {first} to {last} as {ranks} tensor-parallel ranks over NCCL");
            let note = engine::cuda_summary(&s.backend);
            Ok(logged(s, &on, note, opts, t0))
        }
    }
}

/// The load log of a model over ranks (`on`: where; `note`: the backend's line), each rank's
/// weights and KV cache, and the session.
fn logged<B>(
    s: ModelRunner<B>,
    on: &str,
    note: String,
    opts: &RunnerOptions,
    t0: std::time::Instant,
) -> Loaded
where
    B: quiver_backend::Backend,
    ModelRunner<B>: quiver_engine::Session + Send + 'static,
{
    let hp = &s.model.hp;
    eprintln!(
        "quiver: loaded {} ({} layers, {} vocabulary) on {on}, context {} tokens, in {:.2}s",
        hp.arch,
        hp.n_layer,
        hp.n_vocab,
        s.n_ctx,
        t0.elapsed().as_secs_f64()
    );
    eprintln!("quiver: {note}");
    let kv = hp.kv_spec(s.n_ctx, opts.kv);
    for (rank, w) in s.weights_bytes().iter().enumerate() {
        eprintln!(
            "quiver: rank {rank}: weights {}, {}",
            w.map_or("not counted".into(), human_bytes),
            engine::kv_summary(&kv)
        );
    }
    Loaded {
        runner: Box::new(s),
    }
}

/// The CUDA backends of `ranks` tensor-parallel ranks on GPUs `first` … `first + ranks − 1`,
/// one NCCL group. Each rank joins the group on a thread of its own: joining is collective.
pub fn cuda_ranks(
    ranks: usize,
    first: usize,
    config: quiver_backend_cuda::CudaConfig,
) -> std::result::Result<Vec<quiver_backend_cuda::CudaBackend>, String> {
    use quiver_backend_cuda::CudaBackend;
    if config.numerics == quiver_backend::Numerics::Parity {
        return Err(format!(
            "-tp {ranks}: the parity numerics run on one GPU; use --numerics invariant or fast"
        ));
    }
    let last = first + ranks - 1;
    let fail = |rank: usize, e: quiver_backend::BackendError| {
        format!(
            "-tp {ranks} runs on GPUs {first} to {last}: GPU {}: {e}",
            first + rank
        )
    };
    // Every GPU's context first: a GPU that cannot start must not leave the others waiting
    // in NCCL's collective start.
    let backends = (0..ranks)
        .map(|r| CudaBackend::new(first + r, config.clone()).map_err(|e| fail(r, e)))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let id = quiver_backend_cuda::nccl_group().map_err(|e| format!("-tp {ranks}: {e}"))?;
    let joined: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = backends
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                sc.spawn(move || b.with_nccl(id, quiver_backend::Shard { rank, size: ranks }))
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    joined
        .into_iter()
        .enumerate()
        .map(|(rank, j)| match j {
            Ok(b) => b.map_err(|e| fail(rank, e)),
            Err(_) => Err(format!(
                "-tp {ranks}: rank {rank} panicked joining the group"
            )),
        })
        .collect()
}

/// The CPU backends of `ranks` tensor-parallel ranks of `threads` threads each, in one group
/// (one rank: a backend of no group, the whole model).
pub fn cpu_ranks(
    ranks: usize,
    threads: usize,
    numerics: quiver_backend::Numerics,
    mlock: bool,
) -> Vec<CpuBackend> {
    let backend = || CpuBackend::with_config(CpuConfig { threads, numerics }).weights_mapped(mlock);
    if ranks == 1 {
        return vec![backend()];
    }
    LocalComm::group(ranks)
        .into_iter()
        .map(|c| {
            let c: Arc<dyn Comm> = Arc::new(c);
            backend().with_comm(c)
        })
        .collect()
}

/// `--split-mode`: none and layer (one device holds the whole model either way); row asks for
/// tensor parallelism, which `-tp N` gives (the number of GPUs is not in the flag).
pub fn parse_split_mode(s: &str) -> std::result::Result<String, String> {
    match s {
        "none" | "layer" => Ok(s.into()),
        "row" => Err(format!(
            "rows over several GPUs: {NO_TP}; use --split-mode layer or none"
        )),
        _ => Err("use none or layer".into()),
    }
}

/// The most tensor-parallel ranks `-tp` takes.
pub const MAX_RANKS: u32 = 64;

/// `--tensor-parallel`: the ranks, 1 to [`MAX_RANKS`].
pub fn parse_tensor_parallel(s: &str) -> std::result::Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n @ 1..=MAX_RANKS) => Ok(n),
        _ => Err(format!(
            "use a number of ranks from 1 to {MAX_RANKS} (1: the whole model on one device)"
        )),
    }
}

/// `--tensor-split`: proportions separated by `,` or `/`, exactly one of them above zero.
pub fn parse_tensor_split(s: &str) -> std::result::Result<String, String> {
    let parts: Vec<f64> = s
        .split([',', '/'])
        .map(|p| p.trim().parse::<f64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            "use proportions such as 1 or 1,0 (numbers separated by , or /)".to_string()
        })?;
    if parts.iter().any(|p| !p.is_finite() || *p < 0.0) || parts.iter().all(|p| *p == 0.0) {
        return Err(
            "use proportions such as 1 or 1,0 (numbers, not negative, one above zero)".into(),
        );
    }
    match parts.iter().filter(|p| **p > 0.0).count() {
        1 => Ok(s.into()),
        _ => Err(format!("a split over several devices: {NO_TP}")),
    }
}

/// What a request for several GPUs by llama.cpp's flags is told.
pub const NO_TP: &str = "quiver splits a model over GPUs by tensor parallelism: -tp N (--tensor-parallel-size N) over GPUs K to K + N - 1 of --device cuda:K, each holding part of every layer";
