//! Loading a model for generation, shared by run, chat, perplexity, logprobs and bench.

use anyhow::{bail, Context, Result};
use quiver_backend::{KvType, KvTypes, Numerics};
use quiver_backend_cpu::{CpuBackend, CpuConfig};
use quiver_backend_cuda::{CudaBackend, CudaConfig, ParityBackend};
use quiver_engine::{ModelRunner, RunnerOptions, Session};
use quiver_gguf::{GgmlType, GgufFile};
use std::sync::Arc;

/// Flags every inference command takes.
#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Model path, alias (smollm2-135m, gemma3-270m), hf:ORG/REPO[:QUANT], hf:ORG/REPO/FILE.gguf
    /// or an http(s) URL (downloaded into the cache, resumed after an interruption).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// A Hugging Face Hub repository, ORG/REPO[:QUANT] (default quantization Q4_K_M):
    /// llama-server's -hf; the same as -m hf:ORG/REPO[:QUANT].
    #[arg(long = "hf-repo", value_name = "ORG/REPO[:QUANT]", conflicts_with_all = ["model", "model_url"])]
    pub hf_repo: Option<String>,
    /// A GGUF file's URL (llama-server's -mu); the same as -m URL.
    #[arg(long = "model-url", value_name = "URL", conflicts_with = "model")]
    pub model_url: Option<String>,
    /// Context length in tokens (default: 4096, or the model's training context if smaller).
    /// On serve with -np, llama-server's meaning: the total, each sequence gets -c / -np
    /// tokens and the KV pool holds -c (with -kvu each sequence may use all of it).
    #[arg(short = 'c', long = "ctx-size", value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx_size: Option<u32>,
    /// Tokens per forward step when evaluating a prompt.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// llama-server's -ub/--ubatch-size: a forward step takes at most the smaller of -b and
    /// -ub tokens.
    #[arg(long = "ubatch-size", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub ubatch_size: Option<u32>,
    /// CPU threads (default: QUIVER_THREADS, else all cores).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// llama-server's -tb/--threads-batch: quiver has one thread pool for prompts and decode,
    /// so this is its size when -t is not given.
    #[arg(long = "threads-batch", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub threads_batch: Option<u32>,
    /// Where to run: auto (CUDA when a usable GPU exists, else CPU), cpu, cuda or cuda:N;
    /// llama-server's -dev names too (CUDA0 is cuda:0, none is cpu).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: String,
    /// llama-server's -sm/--split-mode: none and layer are accepted (a model runs whole on one
    /// device); row is refused (over GPUs quiver has no tensor parallelism yet; -tp N runs
    /// CPU ranks).
    #[arg(long = "split-mode", value_name = "none|layer", value_parser = crate::tp::parse_split_mode)]
    pub split_mode: Option<String>,
    /// vLLM's -tp/--tensor-parallel-size: the model's heads and FFN split over N ranks, the
    /// ranks' partial products summed in rank order (the same tokens as one rank). N > 1 runs
    /// N CPU ranks of --threads / N threads each (--device cpu; over GPUs it is not built yet)
    /// for run, chat, bench, perplexity and logprobs; serve runs one rank.
    #[arg(long = "tensor-parallel", visible_alias = "tensor-parallel-size", value_name = "N", value_parser = crate::tp::parse_tensor_parallel)]
    pub tensor_parallel: Option<u32>,
    /// llama-server's -ts/--tensor-split: a split that gives everything to one device is
    /// accepted; one over several devices is refused.
    #[arg(long = "tensor-split", value_name = "P0,P1,...", value_parser = crate::tp::parse_tensor_split)]
    pub tensor_split: Option<String>,
    /// Lock the model's mapped weights in memory (mlock) so that they are never paged out; on
    /// CUDA the weights live in device memory and nothing is locked. A lock the system refuses
    /// (ulimit -l) is a warning, as in llama-server.
    #[arg(long)]
    pub mlock: bool,
    /// llama-server's --no-mmap: accepted; quiver always maps the file read-only (the CPU copies
    /// its weights of 2 MiB and more into huge pages, CUDA to the device, at load); --mlock
    /// keeps the CPU's weights in the mapping and locks it.
    #[arg(long)]
    pub no_mmap: bool,
    /// Print backend counters (graph captures and replays, kernels compiled) at the end.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// KV cache element type of K and V: f16 (default), bf16, q8_0, tq8 or tq4 (TurboQuant;
    /// tq4 stores K as tq8 and V as tq4, ~0.39 of f16's bytes: 4-bit keys and values miss
    /// passkey retrieval on Gemma 3; --kv-type-k tq4 asks for them, CPU only for now).
    #[arg(long = "kv-type", value_name = "TYPE", value_parser = parse_kv_type)]
    pub kv_type: Option<KvType>,
    /// K's type, over --kv-type (llama-server's -ctk/--cache-type-k).
    #[arg(long = "kv-type-k", visible_alias = "cache-type-k", value_name = "TYPE", value_parser = parse_kv_type)]
    pub kv_type_k: Option<KvType>,
    /// V's type, over --kv-type (llama-server's -ctv/--cache-type-v).
    #[arg(long = "kv-type-v", visible_alias = "cache-type-v", value_name = "TYPE", value_parser = parse_kv_type)]
    pub kv_type_v: Option<KvType>,
    /// How the backend may round: invariant (a sequence's results do not depend on what shares
    /// its step or how its prompt is chunked), fast (the fastest kernels per step), parity
    /// (CUDA: the CPU's floats bit for bit, slow).
    #[arg(long, value_name = "MODE", default_value = "invariant", value_parser = parse_numerics)]
    pub numerics: Numerics,
}

/// `--numerics`' values.
pub fn parse_numerics(s: &str) -> std::result::Result<Numerics, String> {
    Numerics::parse(s).ok_or_else(|| "unknown numerics (known: fast, invariant, parity)".into())
}

/// `--device`'s values in quiver's spelling: auto, cpu, cuda, cuda:N; llama-server's `CUDA0`
/// (any case) is cuda:0, `none` and `CPU` are cpu.
pub fn parse_device(s: &str) -> std::result::Result<String, String> {
    let l = s.trim().to_ascii_lowercase();
    if l.contains(',') {
        return Err(
            "quiver runs a model whole on one device: give one (e.g. --device cuda:0)".into(),
        );
    }
    let n = |d: &str| d.parse::<usize>().ok().map(|n| format!("cuda:{n}"));
    match l.as_str() {
        "auto" | "cpu" | "cuda" => Ok(l),
        "none" => Ok("cpu".into()),
        _ => l
            .strip_prefix("cuda:")
            .and_then(n)
            .or_else(|| l.strip_prefix("cuda").and_then(n))
            .ok_or_else(|| {
                "use auto, cpu, cuda or cuda:N (llama-server's CUDA0 and none are taken too)".into()
            }),
    }
}

impl LoadArgs {
    /// Folds llama-server's spellings into quiver's flags: -ub caps -b, -tb is -t where -t
    /// is not given.
    pub fn fold_llama_flags(&mut self) {
        if let Some(ub) = self.ubatch_size {
            self.batch_size = self.batch_size.min(ub);
        }
        if self.threads.is_none() {
            self.threads = self.threads_batch;
        }
    }

    /// The model these flags name (`-m`, `--hf-repo` or `--model-url`; None: the default).
    pub fn model_spec(&self) -> Option<String> {
        self.model
            .clone()
            .or_else(|| self.hf_repo.as_ref().map(|r| format!("hf:{r}")))
            .or_else(|| self.model_url.clone())
    }

    /// The KV cache's element types these flags choose.
    pub fn kv_types(&self) -> KvTypes {
        let named = KvTypes::named(self.kv_type.unwrap_or(KvType::F16));
        KvTypes {
            k: self.kv_type_k.unwrap_or(named.k),
            v: self.kv_type_v.unwrap_or(named.v),
        }
    }
}

fn parse_kv_type(s: &str) -> std::result::Result<KvType, String> {
    let l = s.to_ascii_lowercase();
    KvType::parse(&l).ok_or_else(|| {
        let names: Vec<&str> = KvType::ALL.iter().map(|t| t.name()).collect();
        // llama.cpp's cache types quiver lacks, and the nearest it has.
        let nearest = match l.as_str() {
            "q4_0" | "q4_1" | "iq4_nl" => {
                Some("use tq4 (4-bit TurboQuant; --kv-type tq4 keeps keys at 8 bits: about 0.4 of f16's bytes)")
            }
            "q5_0" | "q5_1" => Some(
                "use q8_0 (the nearest in quality, about half of f16's bytes) or tq4 (smaller)",
            ),
            "f32" => Some("use f16 or bf16"),
            _ => None,
        };
        match nearest {
            Some(n) => format!(
                "unknown KV type (quiver has no {l} cache: {n}; known: {})",
                names.join(", ")
            ),
            None => format!("unknown KV type (known: {})", names.join(", ")),
        }
    })
}

/// The load log's KV line: the types, bytes per token (each layer and all), the pool's tokens
/// and bytes; for a model with no paged attention (DeepSeek-V4: its state line says what each
/// sequence holds), that it has none.
pub fn kv_summary(spec: &quiver_backend::KvSpec) -> String {
    let per_token = spec.bytes_per_token();
    if per_token == 0 {
        return "KV cache: none (no layer attends over paged KV)".into();
    }
    let layers = spec.layers.len().max(1) as u64;
    let kv = KvTypes {
        k: spec.k,
        v: spec.v,
    };
    format!(
        "KV cache {kv}: {} bytes per token per layer ({} per token over {layers} layers), {} tokens in {}",
        per_token.div_ceil(layers),
        quiver_backend::human_bytes(per_token),
        spec.n_slots,
        quiver_backend::human_bytes(spec.bytes()),
    )
}

/// The load log's line on the per-sequence state of models with one (Qwen 3.5's gated delta
/// net; DeepSeek-V4's window and compressed KV for up to `n_slots` positions per sequence,
/// as `Model::state` sizes it): bytes per sequence over its layers, and for `n_seqs` sequences;
/// with `kept` (rows, sequences), what that many rows of that many speculating sequences a
/// step change, kept for speculative decoding's rollback (`State::keep_states`). None for
/// others.
pub fn state_summary(
    hp: &quiver_models::Hparams,
    n_seqs: usize,
    n_slots: usize,
    kept: (usize, usize),
) -> Option<String> {
    let s = if n_seqs == 1 { "" } else { "s" };
    let kept = match kept {
        (0, _) | (_, 0) => String::new(),
        (planes, seqs) => format!(
            ", and what {planes} rows change kept for {seqs} speculating sequences (speculative decoding's rollback: {})",
            quiver_backend::human_bytes(hp.kept_state_bytes(planes).saturating_mul(seqs as u64))
        ),
    };
    if let Some(ds) = &hp.dsv4 {
        let n_ctx = n_slots.max(1);
        let per_seq = ds.state_bytes(hp, n_ctx);
        return Some(format!(
            "compressed KV state f32: {} per sequence ({n_ctx} positions: a window of {}, compressed rows and compressor rings over {} layers), {n_seqs} sequence{s} in {}{kept}",
            quiver_backend::human_bytes(per_seq),
            ds.n_swa,
            hp.n_layer,
            quiver_backend::human_bytes(per_seq.saturating_mul(n_seqs as u64)),
        ));
    }
    let p = hp.delta_net?;
    let per_seq = hp.state_bytes_per_seq();
    let layers = hp.n_recurrent() as u64;
    Some(format!(
        "recurrent state f32: {} per sequence ({} convolution + {} matrices per layer, {layers} layers), {n_seqs} sequence{} in {}{kept}",
        quiver_backend::human_bytes(per_seq),
        quiver_backend::human_bytes(4 * p.conv_floats() as u64),
        quiver_backend::human_bytes(4 * p.matrix_floats() as u64),
        s,
        quiver_backend::human_bytes(per_seq.saturating_mul(n_seqs as u64)),
    ))
}

pub struct Loaded {
    pub runner: Box<dyn Session + Send>,
}

impl Loaded {
    /// Prints the backend's counters on stderr (with --verbose).
    pub fn report_counters(&self, args: &LoadArgs) {
        if args.verbose {
            let c: Vec<String> = self
                .runner
                .counters()
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            eprintln!(
                "quiver: {} counters: {}",
                self.runner.backend_name(),
                if c.is_empty() {
                    "none".into()
                } else {
                    c.join(", ")
                }
            );
        }
    }
}

/// The backend's counters as a JSON object (bench and compare output).
pub fn counters_json(s: &(dyn Session + Send)) -> serde_json::Value {
    serde_json::Value::Object(
        s.counters()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect(),
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// Resolves --device. `auto` falls back to the CPU and says why (returned for the load line);
/// an explicit `cuda` without a usable GPU is an error.
pub fn choose_device(spec: &str) -> Result<(Device, String)> {
    let cuda = |n: usize| -> Result<(Device, String)> {
        let info =
            quiver_backend_cuda::probe(n).map_err(|e| anyhow::anyhow!("--device {spec}: {e}"))?;
        Ok((
            Device::Cuda(n),
            format!(
                "cuda:{n} ({}, sm_{}, {} SMs, {:.0} GiB)",
                info.name,
                info.arch,
                info.sms,
                info.total_mem as f64 / 1073741824.0
            ),
        ))
    };
    match spec {
        "cpu" => Ok((Device::Cpu, "cpu".into())),
        "cuda" => cuda(0),
        "auto" => match quiver_backend_cuda::probe(0) {
            Ok(_) => cuda(0),
            Err(e) => Ok((Device::Cpu, format!("cpu (auto: {e})"))),
        },
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => cuda(n),
            _ => bail!("unknown --device {spec:?}: use auto, cpu, cuda or cuda:N"),
        },
    }
}

/// `--mlock`: locks the pages of the model's tensors in memory where the weights are read from
/// the file's mapping (the CPU). The line to log, and whether it is a warning: a lock the
/// system refuses (the locked-memory limit, `ulimit -l`) leaves the model unlocked, as
/// llama-server goes on then too. On CUDA the weights live in device memory: nothing is locked.
pub fn mlock(file: &GgufFile, device: Device) -> (String, bool) {
    if let Device::Cuda(n) = device {
        return (
            format!(
                "--mlock: the weights live in cuda:{n}'s memory; the file's mapping is not locked"
            ),
            false,
        );
    }
    let total: u64 = file.tensors.iter().map(|t| t.n_bytes).sum();
    let size = quiver_backend::human_bytes(total);
    for t in &file.tensors {
        if let Err(e) = lock_pages(file.tensor_data(t)) {
            return (
                format!("--mlock: could not lock the model's {size} in memory ({e}); it stays unlocked: raise the locked-memory limit (ulimit -l) or give the process CAP_IPC_LOCK"),
                true,
            );
        }
    }
    (
        format!("--mlock: the model's {size} are locked in memory"),
        false,
    )
}

/// Pins the pages of `bytes` (part of a mapping this process holds) in memory.
#[cfg(target_os = "linux")]
fn lock_pages(bytes: &[u8]) -> std::io::Result<()> {
    extern "C" {
        fn mlock(addr: *const std::ffi::c_void, len: usize) -> std::ffi::c_int;
    }
    if bytes.is_empty() {
        return Ok(());
    }
    // SAFETY: mlock(2) only pins the pages of a range this process has mapped (`bytes` borrows
    // it for the call) and reads or writes no memory; Linux rounds the range out to whole
    // pages, and the lock ends when the mapping is unmapped.
    match unsafe { mlock(bytes.as_ptr().cast(), bytes.len()) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn lock_pages(_: &[u8]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "not on this platform",
    ))
}

/// The most CPU threads quiver starts (one pool thread each).
pub const MAX_THREADS: usize = 1024;

pub fn threads(args: &LoadArgs) -> Result<usize> {
    let check = |n: usize, what: String| {
        if n > MAX_THREADS {
            bail!(
                "{what}: at most {MAX_THREADS} threads (this machine has {} CPUs)",
                cores()
            );
        }
        Ok(n)
    };
    if let Some(t) = args.threads {
        return check(t as usize, format!("--threads {t}"));
    }
    if let Ok(v) = std::env::var("QUIVER_THREADS") {
        let n: usize = v
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("QUIVER_THREADS={v:?} is not a positive number"))?;
        return check(n, format!("QUIVER_THREADS={n}"));
    }
    Ok(cores())
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub fn open(args: &LoadArgs) -> Result<Arc<GgufFile>> {
    open_path(&crate::resolve(args.model_spec().as_deref())?)
}

pub fn open_path(path: &std::path::Path) -> Result<Arc<GgufFile>> {
    match GgufFile::open(path) {
        Ok(f) => Ok(Arc::new(f)),
        // An I/O error names the path already.
        Err(e @ quiver_gguf::GgufError::Io { .. }) => Err(e.into()),
        Err(e) => Err(anyhow::Error::new(e).context(path.display().to_string())),
    }
}

/// The context length a load with these flags gets, rounded up to whole KV blocks.
pub fn n_ctx(args: &LoadArgs, file: &GgufFile) -> usize {
    let n = args
        .ctx_size
        .map(|c| c as usize)
        .unwrap_or_else(|| default_ctx(file));
    n.div_ceil(quiver_engine::BLOCK_SIZE) * quiver_engine::BLOCK_SIZE
}

/// The context without -c: 4096, or the model's training context if smaller.
pub fn default_ctx(file: &GgufFile) -> usize {
    let train_ctx = file
        .hparams()
        .ok()
        .and_then(|h| h.u32("context_length").ok().flatten())
        .unwrap_or(4096) as usize;
    train_ctx.min(4096)
}

/// Loads the model with room for `max_logits` logits rows per step, for one sequence, with the
/// flags' numerics.
pub fn load(args: &LoadArgs, file: Arc<GgufFile>, max_logits: usize) -> Result<Loaded> {
    let t0 = std::time::Instant::now();
    let n_threads = threads(args)?;
    let n_ctx = n_ctx(args, &file);
    let opts = RunnerOptions {
        kv: args.kv_types(),
        n_ctx,
        n_batch: args.batch_size as usize,
        max_logits,
    };
    let (device, desc) = choose_device(&args.device)?;
    if args.mlock {
        let (line, warn) = mlock(&file, device);
        eprintln!("{}: {line}", if warn { "warning" } else { "quiver" });
    }
    if let Some(ranks @ 2..) = args.tensor_parallel {
        return crate::tp::load(args, &file, &opts, ranks as usize, (device, &desc), t0);
    }
    // (ModelRunner::new refuses types the model's heads cannot take.)
    let kv_spec = quiver_models::hparams(&file)?.kv_spec(n_ctx, opts.kv);
    let runner: Box<dyn Session + Send> = match device {
        Device::Cpu => {
            let be = CpuBackend::with_config(CpuConfig {
                threads: n_threads,
                numerics: args.numerics,
            })
            .weights_mapped(args.mlock);
            let r = ModelRunner::new(be, &file, &opts)?;
            eprintln!(
                "quiver: loaded {} ({} layers, {} vocabulary) on {desc} with {n_threads} threads, context {} tokens, in {:.2}s",
                r.model.hp.arch, r.model.hp.n_layer, r.model.hp.n_vocab, r.n_ctx, t0.elapsed().as_secs_f64()
            );
            eprintln!("quiver: {}", cpu_invariance(args.numerics));
            Box::new(r)
        }
        Device::Cuda(n) => {
            let config = CudaConfig {
                load_total: Some(
                    file.tensors
                        .iter()
                        .map(|t| file.tensor_data(t).len() as u64)
                        .sum(),
                ),
                ..CudaConfig::from_env(args.numerics)
            };
            // Each numerics' backend, then the same load log.
            let log = |cuda: &CudaBackend, r: (&quiver_models::Hparams, usize)| {
                eprintln!(
                    "quiver: loaded {} ({} layers, {} vocabulary) on {desc}, context {} tokens, in {:.2}s",
                    r.0.arch, r.0.n_layer, r.0.n_vocab, r.1, t0.elapsed().as_secs_f64()
                );
                eprintln!("quiver: {}", cuda_summary(cuda));
                let table = kernel_table(cuda, &file, &kv_spec.layers);
                if args.verbose {
                    eprint!("quiver: {}", table.text);
                }
                eprintln!("quiver: {}", invariance_line(args.numerics, table.variance));
            };
            if args.numerics == Numerics::Parity {
                let r = ModelRunner::new(ParityBackend::new(n, config)?, &file, &opts)?;
                log(r.backend.cuda(), (&r.model.hp, r.n_ctx));
                Box::new(r)
            } else {
                let r = ModelRunner::new(CudaBackend::new(n, config)?, &file, &opts)?;
                log(&r.backend, (&r.model.hp, r.n_ctx));
                Box::new(r)
            }
        }
    };
    eprintln!("quiver: {}", kv_summary(&kv_spec));
    if let Some(line) = state_summary(runner.hparams(), 1, kv_spec.n_slots, (0, 0)) {
        eprintln!("quiver: {line}");
    }
    Ok(Loaded { runner })
}

/// The load log's line on batch invariance: whether a request's answer is the same alone and
/// under load with this model and numerics, and if not why (`variance`, from the kernel table).
pub fn invariance_line(numerics: Numerics, variance: Option<String>) -> String {
    match variance {
        None => format!(
            "numerics {numerics}: batch invariant, a request's answer is the same alone and under any load"
        ),
        Some(why) => format!("numerics {numerics}: not batch invariant: {why}"),
    }
}

/// The CPU's load line on batch invariance.
pub fn cpu_invariance(numerics: Numerics) -> String {
    invariance_line(
        numerics,
        (!numerics.is_batch_invariant()).then(|| "--numerics fast".to_string()),
    )
}

/// The kernel table of `file` on `be` (its products' weights and its layers' head dims).
pub fn kernel_table(
    be: &CudaBackend,
    file: &GgufFile,
    layers: &[quiver_backend::KvLayer],
) -> quiver_backend_cuda::plan::Table {
    let weights = product_weights(file);
    let dims: Vec<usize> = layers.iter().map(|l| l.head_dim).collect();
    be.kernel_table(&weights, &dims)
}

/// The (type, columns) of `file`'s products' weights: its matrices (MoE experts' 3-D tensors
/// too), less the embeddings gathered by row (token_embd counts when the output shares it).
pub fn product_weights(file: &GgufFile) -> Vec<(GgmlType, usize)> {
    let tied = !file.tensors.iter().any(|t| t.name == "output.weight");
    let mut types = Vec::new();
    for t in &file.tensors {
        let gathered = t.name.contains("_embd") && !(tied && t.name == "token_embd.weight");
        let cols = *t.shape.last().unwrap_or(&1) as usize;
        match t.shape.len() {
            2 if !gathered => types.push((t.ty, cols)),
            3 => types.push((t.ty, cols)),
            _ => {}
        }
    }
    types
}

/// Device memory and kernel cache line for the load log.
pub fn cuda_summary(be: &CudaBackend) -> String {
    let m = be.mem_stats();
    let mib = |b: u64| b as f64 / 1048576.0;
    let (compiled, cached) = be.kernel_counts();
    format!(
        "device memory: weights {:.1} MiB, KV {:.1} MiB, workspace {:.1} MiB; kernel modules compiled {compiled}, from cache {cached}{}",
        mib(m.weights),
        mib(m.kv),
        mib(m.workspace),
        if be.has_cublas() { "" } else { "; cuBLAS not found: F16 weights' prefill uses the qmm kernel" },
    )
}

/// `quiver devices --kernels -m MODEL`: the model's kernel table under `numerics` on the first
/// GPU (sm_90 with cuBLAS when there is none), and whether it is batch invariant.
pub fn kernels(path: &std::path::Path, numerics: Numerics) -> Result<()> {
    let file = open_path(path)?;
    let layers = quiver_models::hparams(&file)?
        .kv_spec(quiver_engine::BLOCK_SIZE, KvTypes::default())
        .layers;
    let weights = product_weights(&file);
    let dims: Vec<usize> = layers.iter().map(|l| l.head_dim).collect();
    let (arch, blas, note) = match quiver_backend_cuda::probe(0) {
        Ok(i) => (
            i.arch,
            quiver_backend_cuda::libs::cublas().is_ok(),
            String::new(),
        ),
        Err(e) => (
            90,
            true,
            format!(" (no GPU: {e}; sm_90 with cuBLAS assumed)"),
        ),
    };
    let t = quiver_backend_cuda::plan::table(numerics, arch, blas, &weights, &dims);
    print!("{}", t.text);
    println!("{}{note}", invariance_line(numerics, t.variance));
    Ok(())
}

/// `quiver devices`: every CUDA device with its properties, or why there is none; the
/// libraries found. Exit 0 either way (a machine without a GPU is a valid answer).
pub fn devices(json_out: bool) -> Result<()> {
    use quiver_backend_cuda::libs;
    let lib = |r: std::result::Result<&std::path::Path, String>| match r {
        Ok(p) => serde_json::json!({"found": true, "path": p.display().to_string()}),
        Err(e) => serde_json::json!({"found": false, "error": e}),
    };
    let mut devs = Vec::new();
    let mut why = None;
    for n in 0.. {
        match quiver_backend_cuda::probe(n) {
            Ok(i) => devs.push(serde_json::json!({
                "device": format!("cuda:{n}"), "name": i.name, "sm": i.arch, "multiprocessors": i.sms,
                "memory_bytes": i.total_mem, "driver_cuda_version": format!("{}.{}", i.driver_version / 1000, i.driver_version % 1000 / 10),
            })),
            Err(e) => {
                if n == 0 {
                    why = Some(e);
                }
                break;
            }
        }
    }
    let j = serde_json::json!({
        "devices": devs,
        "none_because": why,
        "libraries": {"cuda": lib(libs::driver()), "nvrtc": lib(libs::nvrtc()), "cublas": lib(libs::cublas())},
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    match &why {
        Some(e) => println!("no usable CUDA device: {e}"),
        None => {
            for d in &devs {
                println!(
                    "{}: {} (sm_{}, {} multiprocessors, {:.1} GiB, driver for CUDA {})",
                    d["device"].as_str().unwrap_or(""),
                    d["name"].as_str().unwrap_or(""),
                    d["sm"],
                    d["multiprocessors"],
                    d["memory_bytes"].as_f64().unwrap_or(0.0) / 1073741824.0,
                    d["driver_cuda_version"].as_str().unwrap_or("")
                );
            }
        }
    }
    for (name, v) in j["libraries"].as_object().into_iter().flatten() {
        match v["path"].as_str() {
            Some(p) => println!("{name}: {p}"),
            None => println!("{name}: not found ({})", v["error"].as_str().unwrap_or("")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth(preset: &str, ty: &str) -> GgufFile {
        let dir = std::env::temp_dir().join(format!("quiver-cli-engine-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{preset}-{ty}.gguf"));
        let p = quiver_synth::preset(preset).unwrap();
        let ft = quiver_synth::file_type(ty).unwrap();
        quiver_synth::write(p, ft, 1, &path, 2, |_, _| {}).unwrap();
        GgufFile::open(&path).unwrap()
    }

    /// A model with no paged attention (DeepSeek-V4) says so, not "0 bytes per token".
    #[test]
    fn the_kv_line_says_when_no_layer_attends_over_paged_kv() {
        let spec = |layers| quiver_backend::KvSpec {
            k: quiver_backend::KvType::F16,
            v: quiver_backend::KvType::F16,
            block_size: 16,
            n_slots: 64,
            layers,
        };
        let none = kv_summary(&spec(Vec::new()));
        assert_eq!(none, "KV cache: none (no layer attends over paged KV)");
        let one = kv_summary(&spec(vec![quiver_backend::KvLayer {
            n_head_kv: 2,
            head_dim: 64,
        }]));
        assert!(
            one.starts_with("KV cache f16: 512 bytes per token per layer"),
            "{one}"
        );
    }

    #[test]
    fn the_load_log_says_whether_serving_is_batch_invariant() {
        use quiver_backend_cuda::plan::table;
        let inv = Numerics::BatchInvariant;
        let line = |n: Numerics, f: &GgufFile| {
            invariance_line(n, table(n, 90, true, &product_weights(f), &[64]).variance)
        };
        let f = synth("tiny-llama", "Q4_K_M");
        let weights = product_weights(&f);
        assert!(weights.iter().any(|w| w.0 == GgmlType::Q4_K), "{weights:?}");
        // Norms and the row-gathered embedding (when the output has its own) are no products.
        assert!(!weights.iter().any(|w| w.0 == GgmlType::F32), "{weights:?}");
        assert!(
            line(inv, &f).contains(": batch invariant"),
            "{}",
            line(inv, &f)
        );
        let fast = line(Numerics::Fast, &f);
        assert!(
            fast.ends_with("not batch invariant: --numerics fast"),
            "{fast}"
        );
        // Q5_K has no exact-sum kernels: invariant on qmv / qmm.
        let f = synth("tiny-llama", "Q5_K_M");
        assert!(
            line(inv, &f).contains(": batch invariant"),
            "{}",
            line(inv, &f)
        );
        // MoE experts by row kind (moe.rs): invariant.
        let f = synth("tiny-qwen3moe", "Q4_0");
        let moe = line(inv, &f);
        assert!(moe.contains(": batch invariant"), "{moe}");
        assert!(cpu_invariance(Numerics::Parity).contains(": batch invariant"));
    }

    #[test]
    fn kv_type_tq4_names_tq8_keys_and_tq4_values() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            load: LoadArgs,
        }
        let kv = |args: &[&str]| {
            use clap::Parser;
            Cli::try_parse_from(std::iter::once("quiver").chain(args.iter().copied()))
                .unwrap()
                .load
                .kv_types()
        };
        let t = |k, v| KvTypes { k, v };
        assert_eq!(kv(&[]), t(KvType::F16, KvType::F16));
        assert_eq!(kv(&["--kv-type", "tq8"]), t(KvType::Tq8, KvType::Tq8));
        assert_eq!(kv(&["--kv-type", "tq4"]), t(KvType::Tq8, KvType::Tq4));
        // Naming K's type asks for tq4 keys.
        assert_eq!(
            kv(&["--kv-type", "tq4", "--kv-type-k", "tq4"]),
            t(KvType::Tq4, KvType::Tq4)
        );
        assert_eq!(kv(&["--kv-type-v", "tq4"]), t(KvType::F16, KvType::Tq4));
        assert_eq!(format!("{}", kv(&["--kv-type", "tq4"])), "K tq8, V tq4");
    }
}
