//! Generation for one sequence (the CLI's `run` and `chat`): the prompt, then one token a step
//! until an end-of-generation token, a stop string, the token limit or the caller stops it,
//! the text streamed through an [`OutputProcessor`].

use crate::output::OutputProcessor;
use crate::runner::{Session, Want};
use crate::sampler::Sampler;
use crate::types::{EngineError, FinishReason, Result};
use quiver_tokenizer::Tokenizer;

/// What [`generate`] produced.
pub struct Generated {
    pub tokens: Vec<u32>,
    /// How many of `tokens` have their K/V in the cache (the last sampled one may not).
    pub kv_tokens: usize,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub gen_secs: f64,
}

/// Generation settings beyond sampling.
#[derive(Clone, Debug, Default)]
pub struct GenOptions {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
}

/// Where a prompt of `n` tokens is cut into two steps, or 0 for one step. llama-server
/// evaluates the prompt of a model with sliding-window layers with its last 4 tokens in a step
/// of their own (to checkpoint the window's cache before them), and a step's size decides how
/// some of llama.cpp's products round (its repacked Q4_K kernels take tokens four at a time);
/// quiver cuts the same way, so that greedy text equals llama.cpp's bit for bit.
pub fn prompt_split(hp: &quiver_models::Hparams, n: usize) -> usize {
    if hp.sliding_window.is_some() && n > 4 {
        n - 4
    } else {
        0
    }
}

/// Generates from `prompt` at positions `start_pos..` (earlier positions already in the KV),
/// streaming text pieces to `on_text`, which returns false to stop.
pub fn generate(
    r: &mut (impl Session + ?Sized),
    tok: &Tokenizer,
    prompt: &[u32],
    start_pos: usize,
    sampler: &mut Sampler,
    opts: &GenOptions,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generated> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let total = start_pos + prompt.len();
    if total + opts.max_tokens > r.n_ctx() {
        return Err(EngineError::ContextOverflow {
            prompt: total,
            gen: opts.max_tokens,
            ctx: r.n_ctx(),
        });
    }
    let t0 = std::time::Instant::now();
    let mut history: Vec<u32> = prompt.to_vec();
    let split = prompt_split(r.hparams(), prompt.len());
    if split > 0 {
        r.eval(&prompt[..split], start_pos, Want::Last)?;
    }
    let mut next = r.eval_pick(&prompt[split..], start_pos + split, sampler, &history)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let mut out = Vec::new();
    let mut text = OutputProcessor::new(tok, opts.stop.clone());
    let mut finish = FinishReason::Length;
    let mut pos = total;
    let mut kv_tokens = 0;
    while out.len() < opts.max_tokens {
        if !opts.ignore_eos && tok.is_eog(next) {
            finish = FinishReason::Stop;
            break;
        }
        out.push(next);
        history.push(next);
        let emit = text.push(next);
        if !emit.text.is_empty() && !on_text(&emit.text) {
            finish = FinishReason::Abort;
            break;
        }
        if emit.stop {
            finish = FinishReason::Stop;
            break;
        }
        if out.len() == opts.max_tokens {
            break;
        }
        next = r.eval_pick(&[next], pos, sampler, &history)?;
        kv_tokens += 1;
        pos += 1;
    }
    if finish == FinishReason::Length {
        let tail = text.finish();
        if !tail.is_empty() {
            on_text(&tail);
        }
    }
    Ok(Generated {
        tokens: out,
        kv_tokens,
        text: text.into_text(),
        finish,
        prompt_tokens: prompt.len(),
        prompt_secs,
        gen_secs: t1.elapsed().as_secs_f64(),
    })
}
