//! Speculative decoding's flags, as llama-server spells them.

use quiver_engine::spec::{DraftFile, SpecConfig, SpecType, MAX_DRAFT};

#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: none (the default), ngram (prompt lookup: the tokens that
    /// followed the latest earlier occurrence of the last 4, 3 or 2 tokens of the prompt and
    /// text so far are proposed), draft (a draft model, -md, proposes greedily), eagle3 (an
    /// EAGLE-3 head, -md, reads the target's hidden states) or mtp (the model's own
    /// multi-token-prediction block, Qwen 3.5's or DeepSeek-V4's, reads its hidden states); the
    /// proposals are checked in the step's one forward pass, and the tokens are those of plain
    /// decoding, greedy or seeded. -md alone means draft (eagle3 for an EAGLE-3 file, mtp for
    /// a file of a multi-token-prediction block alone; mtp takes the model's own block
    /// without -md).
    #[arg(long = "spec-type", visible_alias = "spec", value_name = "none|ngram|draft|eagle3|mtp", value_parser = parse_spec_type)]
    pub spec_type: Option<SpecType>,
    /// The draft model (llama-server's -md): a GGUF path or alias of the target's vocabulary,
    /// run on the target's device, its KV beside the target's in the same blocks.
    #[arg(long = "model-draft", value_name = "PATH")]
    pub model_draft: Option<String>,
    /// Most tokens proposed per request and step (llama-server's --draft-max, --draft).
    #[arg(long = "draft-max", visible_aliases = ["draft", "draft-n"], value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=MAX_DRAFT as i64))]
    pub draft_max: u32,
    /// A proposal shorter than this is not made (llama-server's --draft-min).
    #[arg(long = "draft-min", visible_alias = "draft-n-min", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=MAX_DRAFT as i64))]
    pub draft_min: u32,
    /// The draft model drafts while its top token's probability is at least P (llama-server's
    /// --draft-p-min; 0 to 1).
    #[arg(
        long = "draft-p-min",
        visible_alias = "spec-draft-p-min",
        value_name = "P",
        default_value_t = 0.0,
        value_parser = crate::gen::unit
    )]
    pub draft_p_min: f32,
    /// on: each request's proposal length is cut to what pays by the engine's measured step
    /// times (a CPU's rows cost their arithmetic: short proposals, or none); off: by acceptance
    /// alone (to measure the machinery, e.g. a model as its own draft).
    #[arg(long = "spec-timing", value_name = "on|off", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub spec_timing: bool,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?} is neither on nor off")),
    }
}

fn parse_spec_type(s: &str) -> Result<SpecType, String> {
    SpecType::parse(s).ok_or_else(|| {
        format!("unknown speculative decoding type {s:?}: none, ngram, draft, eagle3 or mtp")
    })
}

impl SpecArgs {
    /// The type asked for: --spec-type, else draft with -md, else none.
    pub fn kind(&self) -> SpecType {
        match (self.spec_type, &self.model_draft) {
            (Some(k), _) => k,
            (None, Some(_)) => SpecType::Draft,
            (None, None) => SpecType::None,
        }
    }

    /// The settings without the draft model's file (for checking the flags before loading).
    pub fn check(&self) -> Result<SpecConfig, String> {
        let c = SpecConfig {
            kind: self.kind(),
            draft_max: self.draft_max as usize,
            draft_min: self.draft_min as usize,
            p_min: self.draft_p_min,
            timed: self.spec_timing,
            ..Default::default()
        };
        if c.kind.uses_model() && self.model_draft.is_none() {
            return Err(format!(
                "--spec-type {} needs a draft model (-md/--model-draft)",
                c.kind.name()
            ));
        }
        if !c.kind.uses_model() && c.kind != SpecType::Mtp && self.model_draft.is_some() {
            return Err(format!(
                "-md/--model-draft goes with --spec-type draft, eagle3 or mtp, not {}",
                self.spec_type.map_or("none", SpecType::name)
            ));
        }
        if !(0.0..=1.0).contains(&self.draft_p_min) {
            return Err(format!(
                "--draft-p-min {} is not between 0 and 1",
                self.draft_p_min
            ));
        }
        // (The draft model's file is checked with it in `config`.)
        SpecConfig {
            kind: SpecType::Ngram,
            ..c.clone()
        }
        .validate()?;
        Ok(c)
    }

    /// The engine's settings, the draft model's file opened; Err names the flags that disagree
    /// or the file that does not open.
    pub fn config(&self) -> anyhow::Result<SpecConfig> {
        let mut c = self.check().map_err(anyhow::Error::msg)?;
        if let Some(m) = &self.model_draft {
            let path = crate::resolve(Some(m))?;
            let f = crate::engine::open_path(&path)?;
            let eagle = f.arch().ok() == Some("eagle3");
            let sidecar = quiver_models::mtp::is_sidecar(&f);
            match (self.spec_type, eagle, sidecar) {
                (None, true, _) => c.kind = SpecType::Eagle3,
                (None, _, true) => c.kind = SpecType::Mtp,
                (Some(SpecType::Draft), true, _) => anyhow::bail!(
                    "the draft model {m} is an EAGLE-3 head: use --spec-type eagle3"
                ),
                (Some(SpecType::Draft), _, true) => anyhow::bail!(
                    "the draft model {m} is a multi-token-prediction block alone: use --spec-type mtp"
                ),
                (Some(SpecType::Eagle3), false, _) => anyhow::bail!(
                    "--spec-type eagle3: the draft model {m} is not an EAGLE-3 head (architecture {})",
                    f.arch().unwrap_or("unknown")
                ),
                _ => {}
            }
            c.draft_model = Some(DraftFile(f));
        }
        Ok(c)
    }
}

/// `quiver bench --spec TYPE` (ngram, or draft with `-md`): generation through the serving
/// engine with speculation off and on, for each sequence count: t/s, proposals accepted and
/// tokens per step.
pub mod bench {
    use super::SpecArgs;
    use crate::engine::{self, Device, LoadArgs};
    use anyhow::{anyhow, bail, Result};
    use quiver_backend::Numerics;
    use quiver_backend_cpu::{CpuBackend, CpuConfig};
    use quiver_engine::serve::{EngineHandle, Event, ServeOptions};
    use quiver_engine::spec::SpecConfig;
    use quiver_engine::{SamplerParams, BLOCK_SIZE};
    use serde_json::json;
    use std::path::PathBuf;
    use std::sync::mpsc;
    use std::time::Instant;

    /// What one run measured.
    struct Measured {
        tokens_per_second: f64,
        proposed: u64,
        accepted: u64,
        /// Tokens of the decode steps (all but each sequence's first) and those steps.
        decoded: u64,
        steps: u64,
    }

    /// The prompt each sequence gets.
    pub enum Prompt {
        /// This many tokens: a random block, then the block again.
        Random(usize),
        /// A text file, tokenized as `run --raw` and llama.cpp's `-f` do.
        File(PathBuf),
    }

    fn start(load: &LoadArgs, opts: ServeOptions) -> Result<EngineHandle> {
        let file = engine::open(load)?;
        let tok = quiver_tokenizer::Tokenizer::from_gguf(&file)?;
        let (device, _) = engine::choose_device(&load.device)?;
        let (threads, numerics) = (engine::threads(load)?, load.numerics);
        let name = "bench".to_string();
        let h = match device {
            Device::Cpu => quiver_engine::start_serving(
                move || CpuBackend::with_config(CpuConfig { threads, numerics }),
                file,
                tok,
                opts,
                name,
            ),
            Device::Cuda(n) => {
                let config = quiver_backend_cuda::CudaConfig::from_env(numerics);
                if numerics == Numerics::Parity {
                    let be = quiver_backend_cuda::ParityBackend::new(n, config)?;
                    quiver_engine::start_serving(move || be, file, tok, opts, name)
                } else {
                    let be = quiver_backend_cuda::CudaBackend::new(n, config)?;
                    quiver_engine::start_serving(move || be, file, tok, opts, name)
                }
            }
        };
        h.map_err(|e| anyhow!("{e}"))
    }

    /// `parallel` requests of `prompts` at once, `n_gen` greedy tokens each: generation t/s
    /// from the moment every request has its first token. `batch`: the most tokens a step
    /// takes, to tell the prompt's steps from the decode steps.
    fn measure(
        h: &EngineHandle,
        prompts: &[Vec<u32>],
        n_gen: usize,
        batch: usize,
    ) -> Result<Measured> {
        let before = h.stats();
        let rxs = prompts
            .iter()
            .map(|p| {
                let (tx, rx) = mpsc::channel();
                let req = quiver_engine::serve::Request {
                    prompt: p.clone(),
                    sampling: SamplerParams::greedy(),
                    max_tokens: n_gen,
                    stop: vec![],
                    logprobs: None,
                    prompt_logprobs: None,
                    ignore_eos: true,
                    constraint: None,
                    embed: None,
                    cache_salt: None,
                    speculative: Default::default(),
                };
                let sink = move |e: Event| tx.send((Instant::now(), e)).is_ok();
                h.submit(req, Box::new(sink)).map_err(|e| anyhow!("{e}"))?;
                Ok(rx)
            })
            .collect::<Result<Vec<_>>>()?;
        // Each request's token times.
        let mut times = Vec::new();
        for rx in rxs {
            let mut t = Vec::new();
            for (at, e) in rx {
                match e {
                    Event::Token { .. } => t.push(at),
                    Event::Finished { .. } => break,
                    Event::Error(e) => bail!("engine error: {e}"),
                    _ => {}
                }
            }
            times.push(t);
        }
        let after = h.stats();
        let t0 = times.iter().filter_map(|t| t.first()).max();
        let t1 = times.iter().filter_map(|t| t.last()).max();
        let (Some(&t0), Some(&t1)) = (t0, t1) else {
            bail!("no tokens generated");
        };
        let later = times.iter().flatten().filter(|&&t| t > t0).count();
        // The prompt's steps (its tokens the prefix cache did not hold, `batch` a step) give
        // each sequence its first token; the decode steps give the rest.
        let computed = (after.prompt_tokens_total - before.prompt_tokens_total).saturating_sub(
            after.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total,
        );
        let steps = after.steps_total - before.steps_total;
        let generated = after.generated_tokens_total - before.generated_tokens_total;
        Ok(Measured {
            tokens_per_second: later as f64 / (t1 - t0).as_secs_f64().max(1e-9),
            proposed: after.spec_proposed_tokens_total - before.spec_proposed_tokens_total,
            accepted: after.spec_accepted_tokens_total - before.spec_accepted_tokens_total,
            decoded: generated.saturating_sub(prompts.len() as u64),
            steps: steps.saturating_sub(computed.div_ceil(batch.max(1) as u64)),
        })
    }

    /// Prompts that quote themselves: a pseudo-random block of token ids, then the block
    /// again (`n_prompt` tokens in all), one block per sequence.
    fn prompts(n: usize, n_prompt: usize, n_vocab: usize) -> Vec<Vec<u32>> {
        let mut x = 0x2545F4914F6CDD1Du64;
        (0..n)
            .map(|_| {
                let half = n_prompt.div_ceil(2);
                let block: Vec<u32> = (0..half)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % n_vocab as u64) as u32
                    })
                    .collect();
                block.iter().chain(&block).take(n_prompt).copied().collect()
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(
        load: &LoadArgs,
        spec: &SpecArgs,
        prompt: Prompt,
        n_gen: usize,
        parallel: &[u32],
        reps: usize,
        json_out: bool,
    ) -> Result<()> {
        let cfg = spec.config()?;
        // The file's tokens and its name, or None for random tokens.
        let (text, file) = match &prompt {
            Prompt::Random(_) => (None, None),
            Prompt::File(f) => {
                let t = std::fs::read_to_string(f)
                    .map_err(|e| anyhow!("reading the prompt file {}: {e}", f.display()))?;
                let tok = quiver_tokenizer::Tokenizer::from_gguf(&*engine::open(load)?)?;
                (
                    Some(tok.encode(&t, true, true)?),
                    Some(f.display().to_string()),
                )
            }
        };
        let n_prompt = match (&prompt, &text) {
            (_, Some(ids)) => ids.len(),
            (Prompt::Random(n), None) => *n,
            (Prompt::File(_), None) => 0,
        };
        if n_prompt < 2 || n_gen == 0 {
            bail!("--spec needs a prompt of 2 tokens or more (-p, or -f FILE) and -n above 0");
        }
        let parallel: Vec<usize> = if parallel.is_empty() {
            vec![1]
        } else {
            parallel.iter().map(|&p| p as usize).collect()
        };
        let most = parallel.iter().copied().max().unwrap_or(1);
        let per_seq = (n_prompt + n_gen + cfg.draft_max).div_ceil(BLOCK_SIZE) + 1;
        let batch = (load.batch_size as usize).max(most);
        let opts = |spec: SpecConfig| ServeOptions {
            n_ctx: n_prompt + n_gen + 1,
            max_seqs: most,
            kv_blocks: most * per_seq,
            max_batch_tokens: batch,
            max_waiting: most,
            kv: load.kv_types(),
            spec,
        };
        let seq_prompts = |p: usize, nv: usize| match &text {
            Some(ids) => vec![ids.clone(); p],
            None => prompts(p, n_prompt, nv),
        };
        let mut rows = Vec::new();
        for (label, c) in [
            ("none", SpecConfig::default()),
            (cfg.kind.name(), cfg.clone()),
        ] {
            let h = start(load, opts(c))?;
            let nv = h.info().n_vocab;
            // Warm-up: the real prompt (the runs then find it in the prefix cache alike), or
            // a short random one.
            match &text {
                Some(ids) => measure(&h, std::slice::from_ref(ids), n_gen.min(32), batch)?,
                None => measure(&h, &prompts(1, n_prompt.min(64), nv), n_gen.min(8), batch)?,
            };
            for &p in &parallel {
                let ps = seq_prompts(p, nv);
                let runs = (0..reps)
                    .map(|_| measure(&h, &ps, n_gen, batch))
                    .collect::<Result<Vec<_>>>()?;
                let tps: Vec<f64> = runs.iter().map(|m| m.tokens_per_second).collect();
                let (m, sd) = crate::score::mean_sd(&tps);
                let sum = |f: fn(&Measured) -> u64| runs.iter().map(f).sum::<u64>();
                let (proposed, accepted) = (sum(|m| m.proposed), sum(|m| m.accepted));
                let (decoded, steps) = (sum(|m| m.decoded), sum(|m| m.steps));
                rows.push(json!({
                    "spec": label, "parallel": p, "n_prompt": n_prompt, "n_gen": n_gen,
                    "prompt_file": file,
                    "tokens_per_second": m, "sd": sd, "samples": tps,
                    "proposed": proposed, "accepted": accepted,
                    "acceptance": accepted as f64 / proposed.max(1) as f64,
                    "tokens_per_step": decoded as f64 / (steps.max(1) * p as u64) as f64,
                }));
            }
            h.shutdown(std::time::Duration::from_secs(10));
        }
        if json_out {
            let j = json!({"draft_max": cfg.draft_max, "draft_min": cfg.draft_min, "draft_p_min": cfg.p_min, "model_draft": spec.model_draft, "repetitions": reps, "results": rows});
            println!("{}", serde_json::to_string_pretty(&j)?);
            return Ok(());
        }
        println!("| spec | B | test | t/s | accepted | tokens/step |");
        println!("|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {}tg{} | {:.2} ± {:.2} | {}/{} ({:.0}%) | {:.2} |",
                r["spec"].as_str().unwrap_or(""),
                r["parallel"],
                file.as_ref()
                    .map_or(String::new(), |f| format!("{f} ({n_prompt} tokens) ")),
                n_gen,
                r["tokens_per_second"].as_f64().unwrap_or(0.0),
                r["sd"].as_f64().unwrap_or(0.0),
                r["accepted"],
                r["proposed"],
                100.0 * r["acceptance"].as_f64().unwrap_or(0.0),
                r["tokens_per_step"].as_f64().unwrap_or(0.0),
            );
        }
        Ok(())
    }
}
