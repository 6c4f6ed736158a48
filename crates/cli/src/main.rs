//! The `quiver` binary: parses flags and wires the crates together.

mod compare;
mod dropin;
mod engine;
mod env;
mod gen;
mod info;
mod score;
mod serve;
mod spec;
mod tp;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "quiver",
    version,
    about = "GGUF inference engine and OpenAI-compatible server"
)]
struct Cli {
    /// Log line format on stderr: text or json (one JSON object a line). Levels: RUST_LOG.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// Levels when RUST_LOG is unset (or unparsable): info for quiver's crates, warn for others.
const DEFAULT_LOG_FILTER: &str = "warn,quiver=info,quiver_server=info,quiver_engine=info,quiver_hub=info,quiver_backend_cuda=info,quiver_backend_cpu=info";

/// Logs (`tracing` events: the server's lifecycle and request lines) go to stderr in the
/// chosen format, filtered by RUST_LOG (`info`, `quiver_server=debug,warn`, ...).
fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => EnvFilter::try_new(&s).unwrap_or_else(|e| {
            eprintln!("warning: ignoring RUST_LOG={s:?}: {e}");
            EnvFilter::new(DEFAULT_LOG_FILTER)
        }),
        _ => EnvFilter::new(DEFAULT_LOG_FILTER),
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
}

#[derive(Subcommand)]
enum Cmd {
    /// Describe a model: architecture, hyperparameters, tokenizer, tensors.
    Info {
        /// Model path, alias (smollm2-135m, gemma3-270m) or hf:ORG/REPO/FILE.gguf.
        #[arg(short = 'm', long = "model")]
        model: Option<String>,
        /// The model as a positional argument (same as -m).
        #[arg(conflicts_with = "model")]
        path: Option<String>,
        /// Print JSON (format documented in docs/CLI.md).
        #[arg(long)]
        json: bool,
    },
    /// Tokenize text and print the ids as a JSON array.
    Tokenize {
        #[arg(short = 'm', long = "model")]
        model: Option<String>,
        /// Do not add BOS/EOS even if the model asks for them.
        #[arg(long)]
        no_add_special: bool,
        /// Recognise special-token text such as <|im_start|> as special tokens.
        #[arg(long)]
        parse_special: bool,
        /// The text to tokenize.
        text: String,
    },
    /// Write a GGUF with random weights of a named shape.
    Synth {
        /// Architecture (checked against the preset's; optional).
        #[arg(long)]
        arch: Option<String>,
        /// Shape preset: smollm2-135m, llama3-1b, llama3-8b, gemma3-270m, gemma2-2b,
        /// qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen2.5-7b, qwen2.5-32b, phi3-mini,
        /// gemma4-e2b, gemma4-26b-a4b, qwen3.5-0.8b, qwen3.5-0.8b-mtp, deepseek4-flash (`--layers N`
        /// to fit one GPU), or a tiny parity model: tiny-llama,
        /// tiny-mistral3, tiny-qwen2, tiny-qwen3, tiny-qwen3moe, tiny-qwen35, tiny-qwen35moe, tiny-qwen35-mtp, tiny-qwen35moe-mtp,
        /// tiny-gemma2, tiny-gemma3, tiny-gemma4, tiny-gemma4moe, tiny-phi3, tiny-deepseek4,
        /// tiny-deepseek4-mtp; EAGLE-3 heads:
        /// tiny-eagle3, tiny-eagle3-norms (over tiny-llama), smollm2-135m-eagle3,
        /// llama3-8b-eagle3; or a deep parity model (real depth, `--weights deep`): deep-llama,
        /// deep-mistral3, deep-qwen2, deep-qwen3, deep-qwen3moe, deep-gemma2, deep-gemma3,
        /// deep-gemma4, deep-gemma4moe, deep-phi3, deep-qwen35, deep-qwen35moe.
        #[arg(long)]
        preset: String,
        /// File type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K_S/M/L,
        /// Q4_K_S/M, Q5_K_S/M, Q6_K, IQ4_NL, IQ4_XS.
        #[arg(long = "type")]
        ty: String,
        /// Output file.
        #[arg(short = 'o', long)]
        output: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Threads for quantization (default: all cores).
        #[arg(short = 't', long)]
        threads: Option<usize>,
        /// Copy this model's tokenizer (every tokenizer.* key; a path or alias of the preset's
        /// vocabulary size, or of any size for a tiny-* preset, which takes it): a random draft
        /// of its vocabulary for `--spec-type draft -md`, a tiny model that reads text.
        #[arg(long = "vocab-from", value_name = "MODEL")]
        vocab_from: Option<String>,
        /// Layers, instead of the preset's (a smaller model of the same vocabulary).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=4096))]
        layers: Option<u64>,
        /// How the weights are drawn: `flat` (one σ for every matrix) or `deep` (σ per tensor
        /// by role, fan-in and depth: deep models stay well conditioned). Default: the
        /// preset's (`deep` for the deep-* presets).
        #[arg(long, value_name = "flat|deep")]
        weights: Option<String>,
    },
    /// Generate text from a prompt, streamed to stdout (stats on stderr).
    Run {
        #[command(flatten)]
        load: engine::LoadArgs,
        #[command(flatten)]
        sample: gen::SampleArgs,
        /// The prompt.
        #[arg(short = 'p', long)]
        prompt: Option<String>,
        /// Read the prompt from a file.
        #[arg(short = 'f', long)]
        file: Option<PathBuf>,
        /// A system message (chat models).
        #[arg(long)]
        system: Option<String>,
        /// Feed the prompt as is: no chat template; BOS as the model asks; special-token text parsed.
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        spec: spec::SpecArgs,
    },
    /// Interactive multi-turn chat: /reset, /exit; Ctrl-C stops the current answer.
    Chat {
        #[command(flatten)]
        load: engine::LoadArgs,
        #[command(flatten)]
        sample: gen::SampleArgs,
        /// A system message.
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        spec: spec::SpecArgs,
    },
    /// Perplexity of a text file, by llama-perplexity's method.
    Perplexity {
        #[command(flatten)]
        load: engine::LoadArgs,
        /// The text file.
        #[arg(short = 'f', long)]
        file: PathBuf,
        /// Chunk length in tokens (default: -c/--ctx-size as llama-perplexity takes it, else
        /// 512).
        #[arg(long = "chunk", value_parser = clap::value_parser!(u32).range(4..))]
        chunk: Option<u32>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evaluate token ids in one pass; print the top-N next-token log-probabilities per position.
    Logprobs {
        #[command(flatten)]
        load: engine::LoadArgs,
        /// Token ids as a JSON array, e.g. [1, 2, 3].
        #[arg(long)]
        ids: String,
        /// How many predictions per position.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
        top: u32,
    },
    /// Run the same tokens on the CPU and on --device; report logits error and top-1 agreement.
    Compare(compare::CompareArgs),
    /// Prompt-processing and generation speed, like llama-bench.
    Bench {
        #[command(flatten)]
        load: engine::LoadArgs,
        /// Prompt tokens (0: skip).
        #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
        n_prompt: u32,
        /// Generated tokens (0: skip).
        #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
        n_gen: u32,
        /// Repetitions.
        #[arg(short = 'r', long = "repetitions", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        reps: u32,
        /// Context depth, as llama-bench's -d: this many tokens are in the KV cache before each
        /// test (prompt tokens follow them, generation starts after them).
        #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
        depth: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Batched mode, like llama-batched-bench: for each count, that many sequences of -p
        /// prompt tokens prefilled together, then -n decode steps of one token per sequence;
        /// reports prompt and generation t/s summed over the sequences (e.g. 1,8,32,64).
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=4096))]
        parallel: Vec<u32>,
        /// With --spec ngram: generation through the serving engine with speculation off, then
        /// on, on prompts that quote themselves (-p tokens: a random block twice; or -f FILE),
        /// for each --parallel count (default 1): t/s, proposals accepted and tokens per step
        /// (of the decode steps: each sequence's first token comes from its prompt's steps).
        #[command(flatten)]
        spec: spec::SpecArgs,
        /// With --spec: the prompt is this file's text (instead of -p random tokens), tokenized
        /// as `run --raw` does (BOS as the model asks, special-token text parsed), as
        /// llama.cpp's -f; each of --parallel's sequences gets it.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// OpenAI-compatible HTTP server with continuous batching (docs/SERVER.md).
    Serve(Box<serve::ServeArgs>),
    /// List the CUDA devices quiver can use (or say why there are none), and where NVRTC and
    /// cuBLAS were found.
    Devices {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Print the kernel table of a model instead: the kernel family of each product
        /// (weight type, decode or prompt rows, token count) and attention call, for the first
        /// GPU (sm_90 when there is none).
        #[arg(long, requires = "model")]
        kernels: bool,
        /// The model of `--kernels`.
        #[arg(short = 'm', long = "model")]
        model: Option<String>,
        /// The numerics of `--kernels`.
        #[arg(long, value_name = "MODE", default_value = "invariant", value_parser = engine::parse_numerics)]
        numerics: quiver_backend::Numerics,
    },
    /// Fetch a known model into the cache (it is fetched on first use anyway).
    Fetch {
        /// Aliases to fetch; all known models when none are given.
        aliases: Vec<String>,
    },
}

/// llama-server's multi-letter short flags, which clap would read as letters (`-cb` as
/// `-c b`), as their long forms. Flags quiver refuses, and any other single-dash word of two or
/// more letters, are one line of error (exit 2): never split into letters. Values (the token
/// after a flag that takes one, everything after `--`, negative numbers, `-`) are left alone.
fn llama_server_aliases(args: impl Iterator<Item = String>) -> Result<Vec<String>, String> {
    let takes_value = value_flags(&Cli::command());
    let mut out: Vec<String> = Vec::new();
    let (mut value_next, mut rest) = (false, false);
    for a in args {
        if out.is_empty() || rest || value_next {
            value_next = false;
            out.push(a);
            continue;
        }
        let long = match a.as_str() {
            "--" => {
                rest = true;
                "--"
            }
            "-ngl" => "--n-gpu-layers",
            "-np" => "--parallel",
            "-fa" => "--flash-attn",
            "-to" => "--timeout",
            "-ctk" => "--cache-type-k",
            "-ctv" => "--cache-type-v",
            "-hf" | "-hfr" => "--hf-repo",
            "-mu" => "--model-url",
            "-cb" => "--cont-batching",
            "-tb" => "--threads-batch",
            "-ub" => "--ubatch-size",
            "-kvu" => "--kv-unified",
            "-dev" => "--device",
            "-sm" => "--split-mode",
            "-ts" => "--tensor-split",
            "-tp" => "--tensor-parallel",
            "-md" => "--model-draft",
            "-ngld" => "--n-gpu-layers-draft",
            "-cd" => "--ctx-size-draft",
            "-nocb" | "--no-cont-batching" => return Err(format!(
                "{a}: quiver always batches continuously (it has no other mode); to run one request at a time use --max-seqs 1 (-np 1)"
            )),
            "--reranking" | "--rerank" => return Err(format!(
                "{a}: quiver serves no rerank endpoint; embeddings are served at /v1/embeddings (--pooling mean|cls|last)"
            )),
            w if is_flag_word(w) => {
                return Err(format!(
                    "unknown flag '{w}' (quiver's flags are a dash and one letter, or two dashes and a word; see quiver --help)"
                ))
            }
            _ => "",
        };
        let a = if long.is_empty() { a } else { long.to_string() };
        value_next = takes_value.contains(a.as_str());
        out.push(a);
    }
    Ok(out)
}

/// `-` then a letter, then letters, digits, `-` or `_`, with two letters or more: a flag
/// written with one dash (not `-c4096`, a negative number or `-`).
fn is_flag_word(a: &str) -> bool {
    let Some(w) = a.strip_prefix('-') else {
        return false;
    };
    w.starts_with(|c: char| c.is_ascii_alphabetic())
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && w.chars().filter(char::is_ascii_alphabetic).count() >= 2
}

/// Every spelling (`--long`, `-s`, aliases) of the flags that take a value, in any command.
fn value_flags(cmd: &clap::Command) -> std::collections::HashSet<String> {
    let mut set = std::collections::HashSet::new();
    let mut stack = vec![cmd];
    while let Some(c) = stack.pop() {
        for a in c.get_arguments().filter(|a| {
            !a.is_positional()
                && a.get_action().takes_values()
                && a.get_num_args().is_none_or(|n| n.min_values() > 0)
        }) {
            set.extend(
                a.get_long_and_visible_aliases()
                    .into_iter()
                    .flatten()
                    .map(|l| format!("--{l}")),
            );
            set.extend(
                a.get_all_aliases()
                    .into_iter()
                    .flatten()
                    .map(|l| format!("--{l}")),
            );
            set.extend(
                a.get_short_and_visible_aliases()
                    .into_iter()
                    .flatten()
                    .map(|s| format!("-{s}")),
            );
        }
        stack.extend(c.get_subcommands());
    }
    set
}

fn main() {
    let args = llama_server_aliases(std::env::args()).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2);
    });
    let mut cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                std::process::exit(0);
            }
            // One line: clap's first line names the problem, then its "did you mean" tips (a
            // similar subcommand or flag); the rest is usage.
            let text = e.to_string();
            let first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid arguments");
            let tips: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("tip: a similar"))
                .collect();
            let tips = if tips.is_empty() {
                String::new()
            } else {
                format!("; {}", tips.join("; "))
            };
            eprintln!("{}{tips} (see quiver --help)", first.trim());
            std::process::exit(2);
        }
    };
    if let Some(load) = cli.cmd.load_args() {
        load.fold_llama_flags();
    }
    if let Cmd::Serve(a) = &cli.cmd {
        if let Err(e) = a.check() {
            eprintln!("error: {e} (see quiver --help)");
            std::process::exit(2);
        }
    }
    let log_format = cli.log_format;
    let _ = LOG_FORMAT.set(log_format);
    init_logging(log_format);
    env::warn_unknown();
    if let Err(e) = run(cli) {
        // A closed pipe (`quiver info | head`) is not an error.
        if e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        }) {
            std::process::exit(0);
        }
        // Every error is one line on stderr.
        let msg = format!("{e:#}").replace('\n', " ");
        if log_format == LogFormat::Json && tracing::enabled!(tracing::Level::ERROR) {
            tracing::error!(error = %msg, "fatal");
        } else {
            eprintln!("error: {msg}");
        }
        std::process::exit(1);
    }
}

impl Cmd {
    /// The model-loading flags of the commands that load a model for inference.
    fn load_args(&mut self) -> Option<&mut engine::LoadArgs> {
        match self {
            Cmd::Run { load, .. }
            | Cmd::Chat { load, .. }
            | Cmd::Perplexity { load, .. }
            | Cmd::Logprobs { load, .. }
            | Cmd::Bench { load, .. } => Some(load),
            Cmd::Compare(a) => Some(&mut a.load),
            Cmd::Serve(a) => Some(&mut a.load),
            _ => None,
        }
    }
}

/// The `--log-format` in effect (set once at start).
static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// A writer that hands each line written to it to `emit` (a fetch's progress as log events
/// with `--log-format json`, so that the log stays one JSON object a line); `\r` ends a line
/// too (progress bars).
struct LogLines<F: FnMut(&str)>(Vec<u8>, F);

impl<F: FnMut(&str)> Write for LogLines<F> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        while let Some(i) = self.0.iter().position(|&b| b == b'\n' || b == b'\r') {
            let line: Vec<u8> = self.0.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line);
            if !line.trim().is_empty() {
                (self.1)(line.trim());
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Where a fetch writes its progress: stderr, or log events with `--log-format json`.
fn fetch_log() -> Box<dyn Write> {
    if LOG_FORMAT.get() == Some(&LogFormat::Json) {
        Box::new(LogLines(
            Vec::new(),
            |l: &str| tracing::info!(target: "quiver::fetch", "{l}"),
        ))
    } else {
        Box::new(std::io::stderr())
    }
}

fn resolve(model: Option<&str>) -> Result<PathBuf> {
    Ok(quiver_hub::resolve(model, &mut fetch_log())?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Info { model, path, json } => {
            let path = resolve(model.as_deref().or(path.as_deref()))?;
            let f = quiver_gguf::GgufFile::open(&path)?;
            info::check(&path, &f)?;
            let report = info::report(&path, &f);
            let mut out = std::io::stdout().lock();
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                info::print_text(&report, &mut out)?;
            }
        }
        Cmd::Tokenize {
            model,
            no_add_special,
            parse_special,
            text,
        } => {
            let path = resolve(model.as_deref())?;
            let f = quiver_gguf::GgufFile::open(&path)?;
            let tok = quiver_tokenizer::Tokenizer::from_gguf(&f)?;
            let ids = tok.encode(&text, !no_add_special, parse_special)?;
            println!("{}", serde_json::to_string(&ids)?);
        }
        Cmd::Synth {
            arch,
            preset,
            ty,
            output,
            seed,
            threads,
            vocab_from,
            layers,
            weights,
        } => {
            let mut p = quiver_synth::preset(&preset)?.clone();
            p.n_layer = layers.unwrap_or(p.n_layer);
            let vocab = match &vocab_from {
                Some(m) => Some(engine::open_path(&resolve(Some(m))?)?),
                None => None,
            };
            // A tiny parity model takes the vocabulary's size (a real shape keeps its own).
            if let Some(v) = vocab.as_ref().filter(|_| p.name.starts_with("tiny-")) {
                p.n_vocab = quiver_synth::vocab_size(v)?;
            }
            if let Some(w) = weights {
                p.init = quiver_synth::Init::parse(&w)
                    .with_context(|| format!("unknown --weights {w:?} (known: flat, deep)"))?;
            }
            let p = &p;
            let arch = arch.unwrap_or_else(|| p.arch.to_string());
            if p.arch != arch {
                anyhow::bail!(quiver_synth::SynthError::ArchMismatch {
                    preset: preset.clone(),
                    preset_arch: p.arch.into(),
                    arch
                });
            }
            let ft = quiver_synth::file_type(&ty)?;
            let threads = threads.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            });
            let mut bar = quiver_hub::Progress::count(quiver_synth::plan(p).len() as u64);
            let mut err = std::io::stderr();
            let extra = match &vocab {
                Some(v) => quiver_synth::tokenizer_keys(v, p)?,
                None => vec![],
            };
            let t0 = std::time::Instant::now();
            quiver_synth::write_with(p, ft, seed, &output, threads, &extra, |i, _| {
                bar.update(i as u64, &mut err)
            })
            .with_context(|| format!("writing {}", output.display()))?;
            bar.finish(&mut err);
            let size = std::fs::metadata(&output).map(|m| m.len()).unwrap_or(0);
            eprintln!(
                "wrote {} ({} {}, {:.1} MiB) in {:.1}s",
                output.display(),
                p.name,
                ft.name(),
                size as f64 / 1048576.0,
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Run {
            load,
            sample,
            prompt,
            file,
            system,
            raw,
            spec,
        } => gen::run(&load, &sample, &spec, prompt, file, system, raw)?,
        Cmd::Chat {
            load,
            sample,
            system,
            spec,
        } => gen::chat(&load, &sample, &spec, system)?,
        Cmd::Perplexity {
            load,
            file,
            chunk,
            json,
        } => {
            let chunk = chunk.or(load.ctx_size).unwrap_or(512);
            score::perplexity(&load, &file, chunk as usize, json)?
        }
        Cmd::Logprobs { load, ids, top } => score::logprobs_cmd(&load, &ids, top as usize)?,
        Cmd::Bench {
            load,
            n_prompt,
            n_gen,
            reps,
            json,
            parallel,
            depth,
            spec,
            file,
        } if spec.kind() != quiver_engine::spec::SpecType::None => {
            if depth > 0 {
                anyhow::bail!("--n-depth with --spec: the prompt (-p) is what the proposals quote");
            }
            let prompt = match file {
                Some(f) => spec::bench::Prompt::File(f),
                None => spec::bench::Prompt::Random(n_prompt as usize),
            };
            let n = n_gen as usize;
            spec::bench::run(&load, &spec, prompt, n, &parallel, reps as usize, json)?
        }
        Cmd::Bench { file: Some(_), .. } => {
            anyhow::bail!("-f/--file goes with --spec ngram|draft (the prompt the proposals quote)")
        }
        Cmd::Bench {
            load,
            n_prompt,
            n_gen,
            reps: _,
            json,
            parallel,
            depth,
            ..
        } if !parallel.is_empty() => {
            if depth > 0 {
                anyhow::bail!(
                    "--n-depth with --parallel: the prompt (-p) is each sequence's depth there"
                );
            }
            score::batched(&load, n_prompt as usize, n_gen as usize, &parallel, json)?
        }
        Cmd::Bench {
            load,
            n_prompt,
            n_gen,
            reps,
            json,
            depth,
            ..
        } => score::bench(
            &load,
            score::BenchShape {
                n_prompt: n_prompt as usize,
                n_gen: n_gen as usize,
                depth: depth as usize,
            },
            reps as usize,
            json,
        )?,
        Cmd::Compare(a) => compare::compare(a)?,
        Cmd::Serve(a) => serve::run(*a)?,
        Cmd::Devices {
            kernels: true,
            model,
            numerics,
            ..
        } => engine::kernels(&resolve(model.as_deref())?, numerics)?,
        Cmd::Devices { json, .. } => engine::devices(json)?,
        Cmd::Fetch { aliases } => {
            let list: Vec<String> = if aliases.is_empty() {
                quiver_hub::KNOWN_MODELS
                    .iter()
                    .map(|m| m.alias.to_string())
                    .collect()
            } else {
                aliases
            };
            for a in list {
                let m = quiver_hub::known(&a).with_context(|| {
                    format!(
                        "unknown alias {a:?} (known: {})",
                        quiver_hub::KNOWN_MODELS
                            .iter()
                            .map(|m| m.alias)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })?;
                let path = quiver_hub::alias_path(m.alias);
                if path.is_file() {
                    eprintln!("{}: already in the cache at {}", m.alias, path.display());
                } else {
                    quiver_hub::fetch(m, &mut fetch_log())?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_letter_single_dash_flags_are_never_split_into_letters() {
        let args =
            |a: &[&str]| llama_server_aliases(a.iter().map(|s| s.to_string())).map(|v| v.join(" "));
        assert_eq!(
            args(&["quiver", "serve", "-cb", "-tb", "2", "-ub", "64", "-kvu", "-dev", "CUDA0", "-sm", "layer", "-np", "4"]).unwrap(),
            "quiver serve --cont-batching --threads-batch 2 --ubatch-size 64 --kv-unified --device CUDA0 --split-mode layer --parallel 4"
        );
        // Values stay values: negative numbers, `-`, a flag's value, everything after `--`.
        assert_eq!(
            args(&[
                "quiver",
                "serve",
                "-n",
                "-1",
                "--api-key",
                "-kvu",
                "-f",
                "-",
                "-c4096",
                "--",
                "-cb"
            ])
            .unwrap(),
            "quiver serve -n -1 --api-key -kvu -f - -c4096 -- -cb"
        );
        for (a, says) in [
            ("-nocb", "--max-seqs 1"),
            ("--no-cont-batching", "--max-seqs 1"),
            ("--reranking", "/v1/embeddings"),
            ("-xyz", "unknown flag '-xyz'"),
            ("-tsx", "unknown flag '-tsx'"),
            ("-no-cnv", "unknown flag"),
        ] {
            let e = args(&["quiver", "serve", a]).unwrap_err();
            assert!(e.contains(says) && !e.contains('\n'), "{a}: {e}");
        }
    }

    #[test]
    fn log_lines_split_on_newlines_and_carriage_returns() {
        let mut got = Vec::new();
        {
            let mut w = LogLines(Vec::new(), |l: &str| got.push(l.to_string()));
            w.write_all(b"fetch a: part 1/2\n\r[##   ]  8%").unwrap();
            w.write_all(b"\r[#####] 20%\r\n  \npartial").unwrap();
        }
        assert_eq!(got, ["fetch a: part 1/2", "[##   ]  8%", "[#####] 20%"]);
    }
}
