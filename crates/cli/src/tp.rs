//! `-tp N`: a model split over N tensor-parallel ranks (`ModelRunner::with_ranks`), each a
//! CPU backend of `--threads / N` threads in one group (`LocalComm`); GPUs are refused. The
//! flags that ask for several devices (`-tp`, `-sm`, `-ts`) are read here.

use crate::engine::{self, Device, LoadArgs, Loaded};
use anyhow::{bail, Result};
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
    if let Device::Cuda(_) = device {
        bail!("-tp {ranks} on {desc}: {NO_TP}");
    }
    let threads = (engine::threads(args)? / ranks).max(1);
    let backends = cpu_ranks(ranks, threads, args.numerics, args.mlock);
    let s = ModelRunner::with_ranks(backends, file, opts)?;
    let hp = s.model.hp.clone();
    eprintln!(
        "quiver: loaded {} ({} layers, {} vocabulary) on {desc} as {ranks} tensor-parallel ranks of {threads} thread{}, context {} tokens, in {:.2}s",
        hp.arch,
        hp.n_layer,
        hp.n_vocab,
        if threads == 1 { "" } else { "s" },
        s.n_ctx,
        t0.elapsed().as_secs_f64()
    );
    eprintln!("quiver: {}", engine::cpu_invariance(args.numerics));
    let kv = hp.kv_spec(s.n_ctx, opts.kv);
    for (rank, w) in s.weights_bytes().iter().enumerate() {
        eprintln!(
            "quiver: rank {rank}: weights {}, {}",
            w.map_or("not counted".into(), human_bytes),
            engine::kv_summary(&kv)
        );
    }
    Ok(Loaded {
        runner: Box::new(s),
    })
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
/// tensor parallelism, which quiver does not have.
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

/// What a request for several GPUs is told.
pub const NO_TP: &str = "quiver has no tensor parallelism over GPUs yet (a model runs whole on one GPU: --device cuda:N picks it; -tp N --device cpu splits it over CPU ranks)";
