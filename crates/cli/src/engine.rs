//! Loading a model for generation, shared by run, chat, perplexity, logprobs and bench.

use anyhow::{Context, Result};
use quiver_backend_cpu::CpuBackend;
use quiver_engine::{Runner, RunnerOptions};
use quiver_gguf::GgufFile;
use std::sync::Arc;

/// Flags every inference command takes.
#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Model path, alias (smollm2-135m, gemma3-270m) or hf:ORG/REPO/FILE.gguf.
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Context length in tokens (default: 4096, or the model's training context if smaller).
    #[arg(short = 'c', long = "ctx-size", value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx_size: Option<u32>,
    /// Tokens per forward step when evaluating a prompt.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// CPU threads (default: QUIVER_THREADS, else all cores).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
}

pub struct Loaded {
    pub runner: Runner<CpuBackend>,
}

pub fn threads(args: &LoadArgs) -> Result<usize> {
    if let Some(t) = args.threads {
        return Ok(t as usize);
    }
    if let Ok(v) = std::env::var("QUIVER_THREADS") {
        let n: usize = v.parse().ok().filter(|&n| n > 0).with_context(|| format!("QUIVER_THREADS={v:?} is not a positive number"))?;
        return Ok(n);
    }
    Ok(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

pub fn open(args: &LoadArgs) -> Result<Arc<GgufFile>> {
    let path = crate::resolve(args.model.as_deref())?;
    Ok(Arc::new(GgufFile::open(&path).with_context(|| path.display().to_string())?))
}

/// The context length a load with these flags gets, rounded up to whole KV blocks.
pub fn n_ctx(args: &LoadArgs, file: &GgufFile) -> usize {
    let train_ctx = file.hparams().ok().and_then(|h| h.u32("context_length").ok().flatten()).unwrap_or(4096) as usize;
    let n = args.ctx_size.map(|c| c as usize).unwrap_or_else(|| train_ctx.min(4096));
    n.div_ceil(quiver_engine::BLOCK_SIZE) * quiver_engine::BLOCK_SIZE
}

/// Loads the model with room for `max_logits` logits rows per step.
pub fn load(args: &LoadArgs, file: Arc<GgufFile>, max_logits: usize) -> Result<Loaded> {
    let t0 = std::time::Instant::now();
    let n_threads = threads(args)?;
    let n_ctx = n_ctx(args, &file);
    let opts = RunnerOptions { n_ctx, n_batch: args.batch_size as usize, max_logits };
    // One sequence per process: batch invariance buys nothing, the GEMM path is faster.
    CpuBackend::set_batch_invariant(false);
    let runner = Runner::new(CpuBackend::new(n_threads), &file, &opts)?;
    let load_secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "quiver: loaded {} ({} layers, {} vocabulary) on cpu with {n_threads} threads, context {} tokens, in {:.2}s",
        runner.model.hp.arch, runner.model.hp.n_layer, runner.model.hp.n_vocab, runner.n_ctx, load_secs
    );
    Ok(Loaded { runner })
}
