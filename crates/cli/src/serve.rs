//! `quiver serve`: the OpenAI-compatible server (crate quiver-server) over the serving engine.

use crate::engine::{self, LoadArgs};
use anyhow::{bail, Context, Result};
use quiver_backend::Numerics;
use quiver_engine::serve::ServeOptions;
use quiver_tokenizer::chat::ChatTemplate;
use std::path::PathBuf;
use std::sync::Arc;

/// Longest duration a flag takes, in seconds (a day): past it a timer's deadline could
/// overflow, and no timeout or grace needs more.
const MAX_SECS: u64 = 86_400;
/// Most connections or waiting requests a flag allows.
const MAX_COUNT: i64 = 1_000_000;
/// Most sequences at once (`--max-seqs`).
pub(crate) const MAX_SEQS: i64 = 65_536;

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub dropin: crate::dropin::ServeDropin,
    #[command(flatten)]
    pub spec: crate::spec::SpecArgs,
    /// The model as a positional argument (vLLM's `vllm serve MODEL`): what -m takes.
    #[arg(value_name = "MODEL", conflicts_with_all = ["model", "hf_repo", "model_url"])]
    pub model_arg: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the "listening on" line tells which).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// An accepted API key (repeatable); clients send `Authorization: Bearer KEY`.
    #[arg(long = "api-key")]
    pub api_keys: Vec<String>,
    /// A file of accepted API keys, one a line.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Who shares the prefix cache: `shared` (every request, but those with different
    /// `cache_salt`s), or `key` (each API key its own, salted further by `cache_salt`; needs
    /// --api-key or --api-key-file).
    #[arg(long, default_value = "shared", value_parser = ["shared", "key"])]
    pub cache_isolation: String,
    /// Tests: wait this long before loading the model (the port answers 503 meanwhile).
    #[arg(long, hide = true, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub load_delay_ms: u64,
    /// Most sequences running at once (vLLM's `--max-num-seqs`; llama-server's `-np/--parallel`
    /// is the same count, and divides -c among the sequences).
    #[arg(long, visible_alias = "max-num-seqs", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=MAX_SEQS))]
    pub max_seqs: u32,
    /// How `/v1/embeddings` pools a text's hidden states: mean, cls or last (llama-server's
    /// `--pooling`; default: the file's `pooling_type`, else last, as vLLM does for
    /// generative models).
    #[arg(long, value_parser = ["mean", "cls", "last"])]
    pub pooling: Option<String>,
    /// Origins a browser page may call the server from (CORS), comma-separated; `*`: any
    /// (vLLM's `--allowed-origins`; `--cors` too; llama-server allows any).
    #[arg(
        long,
        visible_alias = "cors",
        value_delimiter = ',',
        default_value = "*"
    )]
    pub allowed_origins: Vec<String>,
    /// Most requests waiting before the server answers 429.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=MAX_COUNT))]
    pub max_waiting: u32,
    /// KV blocks in the pool (16 tokens each).
    #[arg(long, conflicts_with = "kv_mem")]
    pub kv_blocks: Option<u32>,
    /// KV pool size in bytes (default: enough for every sequence's full context, at most 2 GiB).
    #[arg(long)]
    pub kv_mem: Option<u64>,
    /// The model name clients use (default: the file's stem, e.g. smollm2-135m; llama-server's
    /// `-a/--alias`).
    #[arg(long, short = 'a', visible_aliases = ["alias", "served-model-name"])]
    pub model_name: Option<String>,
    /// A chat template instead of the model's: Jinja source or a built-in name (llama3,
    /// mistral, mistral-v7, mistral-v7-tekken, phi3, qwen, gemma, chatml).
    #[arg(long, conflicts_with = "chat_template_file", value_parser = parse_chat_template)]
    pub chat_template: Option<String>,
    /// A file holding a Jinja chat template instead of the model's.
    #[arg(long)]
    pub chat_template_file: Option<PathBuf>,
    /// llama-server's `-ngl/--n-gpu-layers`: 0 runs on the CPU; any other number leaves
    /// `--device` (quiver runs a model wholly on one device).
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers", value_name = "N")]
    pub n_gpu_layers: Option<String>,
    /// llama-server's `-fa/--flash-attn [on|off|auto]`: accepted; quiver's CUDA attention is
    /// always its flash kernels where the head dim has them.
    #[arg(long = "flash-attn", num_args = 0..=1, default_missing_value = "on", value_name = "on|off|auto")]
    pub flash_attn: Option<String>,
    /// llama-server's `--jinja`: accepted (quiver always renders the Jinja template).
    #[arg(long)]
    pub jinja: bool,
    /// llama-server's `--metrics`: accepted (`/metrics` is always served).
    #[arg(long)]
    pub metrics: bool,
    /// Serve no web chat page at `/` (llama-server's `--no-webui`).
    #[arg(long)]
    pub no_webui: bool,
    /// llama-server's `-to/--timeout SECONDS`: sets `--timeout-read-secs`.
    #[arg(long = "timeout", value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub timeout: Option<u64>,
    /// Seconds running requests may go on after SIGTERM before they are aborted.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=MAX_SECS))]
    pub shutdown_grace: u64,
    /// Seconds a client has to send a request's headers (from connecting, or from the request's
    /// first byte), and then its body.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub timeout_read_secs: u64,
    /// Seconds a keep-alive connection may wait between requests before it is closed.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub timeout_idle_secs: u64,
    /// Most open connections; at the cap a new one replaces the longest-waiting connection
    /// without a request in progress, or is answered 503 when all are busy.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=MAX_COUNT))]
    pub max_connections: u32,
}

impl ServeArgs {
    /// Flags that contradict each other, in one line (a flag error: exit 2).
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.cache_isolation == "key" && self.api_keys.is_empty() && self.api_key_file.is_none()
        {
            return Err("--cache-isolation key keeps the prefix cache apart per API key: give keys with --api-key or --api-key-file".into());
        }
        self.spec.check()?;
        Ok(())
    }
}

/// `--chat-template`: Jinja source, or the name of a built-in template.
fn parse_chat_template(s: &str) -> std::result::Result<String, String> {
    if ChatTemplate::is_source(s) || quiver_tokenizer::chat::BUILTIN_NAMES.contains(&s) {
        Ok(s.into())
    } else {
        Err(format!(
            "unknown chat template: give Jinja source (or a file with --chat-template-file), or a built-in name: {}",
            quiver_tokenizer::chat::BUILTIN_NAMES.join(", ")
        ))
    }
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    if let Some(n) = &a.n_gpu_layers {
        let n: i64 = n
            .parse()
            .map_err(|_| anyhow::anyhow!("--n-gpu-layers {n}: not a number"))?;
        if n == 0 {
            a.load.device = "cpu".into();
        }
    }
    if let Some(t) = a.timeout {
        a.timeout_read_secs = t;
    }
    if let Some(m) = a.model_arg.take() {
        a.load.model = Some(m);
    }
    let path = crate::resolve(a.load.model_spec().as_deref())?;
    let file = engine::open_path(&path)?;
    let tok = quiver_tokenizer::Tokenizer::from_gguf(&file)?;
    let tmpl = match (&a.chat_template, &a.chat_template_file) {
        (Some(t), _) => ChatTemplate::user(&file, t)?,
        (None, Some(p)) => {
            let src =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            ChatTemplate::user(&file, &src)?
        }
        (None, None) => ChatTemplate::for_model(&file)?,
    };
    let bs = quiver_engine::BLOCK_SIZE;
    let max_seqs = a.dropin.parallel.unwrap_or(a.max_seqs);
    // -c with -np as llama-server means it: the total, divided among the sequences.
    let (n_ctx, pool) = crate::dropin::context(
        a.load.ctx_size,
        a.dropin.parallel,
        a.dropin.kv_unified,
        a.dropin.max_model_len,
        engine::default_ctx(&file),
        bs,
    );
    // Bytes of one block of the pool, as the model's KV cache asks.
    let hp = quiver_models::hparams(&file)?;
    let kv = a.load.kv_types();
    let block = hp.kv_spec(bs, kv);
    block.check().map_err(anyhow::Error::msg)?;
    // A draft model's KV sits beside the target's in the same blocks: a block costs both.
    let spec = a.spec.config()?;
    // (The target's own multi-token-prediction block is such a draft.)
    let mtp = spec.kind == quiver_engine::spec::SpecType::Mtp;
    let draft_hp = match &spec.draft_model {
        _ if mtp => {
            let f = spec.draft_model.as_ref().map_or(&file, |d| &d.0);
            let hp = quiver_models::mtp::hparams(f);
            Some(hp.map_err(|e| anyhow::anyhow!("--spec-type mtp: {e}"))?)
        }
        Some(d) => Some(quiver_models::hparams(&d.0)?),
        None => None,
    };
    let draft_block = match draft_hp {
        Some(hp) => {
            let b = hp.kv_spec(bs, kv);
            b.check()
                .map_err(|e| anyhow::anyhow!("the draft model: {e}"))?;
            Some(b)
        }
        None => None,
    };
    // (max 1: a model of recurrent layers only would have no KV cache.)
    let per_block =
        ((block.bytes() + draft_block.as_ref().map_or(0, |b| b.bytes())) as usize).max(1);
    let want = max_seqs as usize * n_ctx.div_ceil(bs);
    let kv_blocks = match (a.kv_blocks, a.kv_mem, pool) {
        (Some(n), _, _) => n as usize,
        (None, Some(m), _) => (m as usize / per_block).max(1),
        (None, None, Some(tokens)) => tokens / bs,
        (None, None, None) => want.min((2usize << 30) / per_block),
    };
    let layers = block.layers.clone();
    let verbose = a.load.verbose;
    let mut kv_line = engine::kv_summary(&quiver_backend::KvSpec {
        n_slots: kv_blocks * bs,
        ..block
    });
    if let Some(d) = draft_block {
        let d = engine::kv_summary(&quiver_backend::KvSpec {
            n_slots: kv_blocks * bs,
            ..d
        });
        kv_line = format!("{kv_line}; the draft model's, in the same blocks: {d}");
    }
    let planes = match spec.kind {
        quiver_engine::spec::SpecType::None => 0,
        _ => spec.draft_max,
    };
    // (As the engine keeps them: for the most requests that propose in one step.)
    let kept = (planes, spec.max_decoding.min(max_seqs as usize));
    if let Some(state) =
        engine::state_summary(&hp, max_seqs as usize, n_ctx.min(kv_blocks * bs), kept)
    {
        kv_line = format!("{kv_line}; {state}");
    }
    if kv_blocks * bs < n_ctx {
        bail!("the KV pool of {kv_blocks} blocks ({} tokens) cannot hold one full context of {n_ctx} tokens", kv_blocks * bs);
    }
    let mut keys = a.api_keys.clone();
    if let Some(f) = &a.api_key_file {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
        if keys.len() == before {
            // Starting without its keys would serve everyone: the operator meant keys.
            bail!(
                "--api-key-file {} holds no key (only comments or blank lines): give a key, or drop the flag to serve without authentication",
                f.display()
            );
        }
    }
    if let Some(i) = keys.iter().position(|k| k.trim().is_empty()) {
        bail!(
            "API key {} is empty: an empty key would refuse every request; give a non-empty key or none",
            i + 1
        );
    }
    let name = a.model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let pooling = a
        .pooling
        .as_deref()
        .and_then(quiver_engine::embed::Pooling::parse)
        .or_else(|| quiver_engine::embed::Pooling::of_file(&file))
        .unwrap_or(quiver_engine::embed::Pooling::Last);
    let ranks = a.load.tensor_parallel.unwrap_or(1) as usize;
    // -tp N splits the threads over the ranks.
    let threads = (engine::threads(&a.load)? / ranks).max(1);
    let numerics = a.load.numerics;
    let load_delay_ms = a.load_delay_ms;
    let opts = ServeOptions {
        kv,
        n_ctx,
        max_seqs: max_seqs as usize,
        kv_blocks,
        max_batch_tokens: (a.load.batch_size as usize).max(max_seqs as usize),
        max_waiting: a.max_waiting as usize,
        spec,
    };
    let (device, desc) = engine::choose_device(&a.load.device)?;
    if let Some(n) = &a.dropin.n_gpu_layers_draft {
        let n: i64 = n
            .parse()
            .map_err(|_| anyhow::anyhow!("--n-gpu-layers-draft {n}: not a number"))?;
        if n == 0 && device != engine::Device::Cpu {
            bail!("--n-gpu-layers-draft 0: the draft model runs on the model's device ({desc}); run both on the CPU with --device cpu");
        }
    }
    let mlock = a.load.mlock;
    let model_name = name.clone();
    let what = path.display().to_string();
    // The port answers (503 while loading) from before the model loads.
    let load = move || -> Result<quiver_engine::serve::EngineHandle, String> {
        let t0 = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(load_delay_ms));
        if mlock {
            match engine::mlock(&file, device) {
                (line, true) => tracing::warn!("{line}"),
                (line, false) => tracing::info!("{line}"),
            }
        }
        // The kernel table and invariance lines, logged once the model has loaded.
        let mut notes = Vec::new();
        let handle = match device {
            engine::Device::Cpu => {
                notes.push(engine::cpu_invariance(numerics));
                quiver_engine::start_serving_ranks(
                    move || crate::tp::cpu_ranks(ranks, threads, numerics, mlock),
                    file,
                    tok,
                    opts,
                    name.clone(),
                )
            }
            engine::Device::Cuda(n) => {
                let config = quiver_backend_cuda::CudaConfig::from_env(numerics);
                let mut note = |be: &quiver_backend_cuda::CudaBackend| {
                    let table = engine::kernel_table(be, &file, &layers);
                    if verbose {
                        notes.push(table.text.trim_end().to_string());
                    }
                    notes.push(engine::invariance_line(numerics, table.variance));
                };
                let failed = |e| format!("loading {what}: {e}");
                if ranks > 1 {
                    let bes = crate::tp::cuda_ranks(ranks, n, config)
                        .map_err(|e| format!("loading {what}: {e}"))?;
                    note(&bes[0]);
                    quiver_engine::start_serving_ranks(move || bes, file, tok, opts, name.clone())
                } else if numerics == Numerics::Parity {
                    let be = quiver_backend_cuda::ParityBackend::new(n, config).map_err(failed)?;
                    note(be.cuda());
                    quiver_engine::start_serving(move || be, file, tok, opts, name.clone())
                } else {
                    let be = quiver_backend_cuda::CudaBackend::new(n, config).map_err(failed)?;
                    note(&be);
                    quiver_engine::start_serving(move || be, file, tok, opts, name.clone())
                }
            }
        }
        .map_err(|e| format!("loading {what}: {e}"))?;
        for line in notes {
            tracing::info!("{line}");
        }
        let with_threads = if ranks > 1 && device != engine::Device::Cpu {
            format!(" as {ranks} tensor-parallel ranks over NCCL")
        } else if ranks > 1 {
            let s = if threads == 1 { "" } else { "s" };
            format!(" as {ranks} tensor-parallel ranks of {threads} thread{s}")
        } else if device == engine::Device::Cpu {
            format!(" with {threads} threads")
        } else {
            String::new()
        };
        let load_secs = t0.elapsed().as_secs_f64();
        tracing::info!(
            model = %name,
            load_secs,
            "serving {name} on {desc}{with_threads}: context {n_ctx}, {max_seqs} sequences, {kv_blocks} KV blocks, loaded in {load_secs:.2}s; {kv_line}",
        );
        Ok(handle)
    };
    let cfg = quiver_server::ServerConfig {
        host: a.host,
        port: a.port,
        api_keys: keys,
        cache_by_key: a.cache_isolation == "key",
        model_name,
        shutdown_grace: std::time::Duration::from_secs(a.shutdown_grace),
        chat_template: Some(Arc::new(tmpl)),
        read_timeout: std::time::Duration::from_secs(a.timeout_read_secs),
        idle_timeout: std::time::Duration::from_secs(a.timeout_idle_secs),
        max_connections: a.max_connections as usize,
        max_seqs: max_seqs as usize,
        pooling,
        allowed_origins: a.allowed_origins.clone(),
        defaults: a.dropin.request_defaults(),
        webui: !a.no_webui,
        ..Default::default()
    };
    quiver_server::run(quiver_server::Engine::Load(Box::new(load)), cfg)?;
    Ok(())
}
