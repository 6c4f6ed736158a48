//! Generation for one sequence (the CLI's `run` and `chat`): the prompt, then one token a step
//! until an end-of-generation token, a stop string, the token limit or the caller stops it,
//! the text streamed through an [`OutputProcessor`].

use crate::output::OutputProcessor;
use crate::runner::{Session, Want};
use crate::sampler::Sampler;
use crate::spec_gen::Speculator;
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
    on_text: impl FnMut(&str) -> bool,
) -> Result<Generated> {
    generate_spec(r, None, tok, prompt, start_pos, sampler, opts, on_text)
}

/// `generate` with speculative decoding when `spec` is given: each step scores the last token
/// and a proposal (`Speculator`) in one forward pass; the tokens are those of `generate`.
#[allow(clippy::too_many_arguments)]
pub fn generate_spec(
    r: &mut (impl Session + ?Sized),
    mut spec: Option<&mut Speculator>,
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
    if let Some(s) = spec.as_deref_mut() {
        s.begin(prompt, start_pos);
    }
    let t0 = std::time::Instant::now();
    let mut history: Vec<u32> = prompt.to_vec();
    let split = prompt_split(r.hparams(), prompt.len());
    if split > 0 {
        r.eval(&prompt[..split], start_pos, Want::Last)?;
    }
    let next = r.eval_pick(&prompt[split..], start_pos + split, sampler, &history)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let mut out = Vec::new();
    let mut text = OutputProcessor::new(tok, opts.stop.clone());
    let mut finish = FinishReason::Length;
    // The position of the first token without K/V; the tokens picked and not yet output (the
    // accepted proposals of a step have their K/V, the last pick not).
    let mut pos = total;
    let mut queue = std::collections::VecDeque::from([next]);
    let (mut proposal, mut step, mut picks) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(next) = queue.pop_front() {
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
        if !queue.is_empty() {
            continue;
        }
        // `next` is the last token: this step computes it, with a proposal if one is made.
        let t_step = std::time::Instant::now();
        let len = match spec.as_deref_mut() {
            Some(s) => {
                s.seq.push(next);
                let room = (opts.max_tokens - out.len() - 1)
                    .min(r.n_ctx() - pos - 1)
                    .min(r.max_verify() - 1);
                let len = s.next_len(room);
                s.propose(r, len, &mut proposal)?;
                proposal.len()
            }
            None => 0,
        };
        if len == 0 {
            queue.push_back(r.eval_pick(&[next], pos, sampler, &history)?);
            pos += 1;
            if let Some(s) = spec.as_deref_mut() {
                s.timed(1, t_step.elapsed().as_secs_f64());
            }
            continue;
        }
        step.clear();
        step.push(next);
        step.extend_from_slice(&proposal);
        r.eval_verify(&step, pos, sampler, &history, &mut picks)?;
        let accepted = picks.len() - 1;
        pos += accepted + 1;
        if let Some(s) = spec.as_deref_mut() {
            s.timed(step.len(), t_step.elapsed().as_secs_f64());
            s.record(len, accepted, pos);
            s.seq.extend_from_slice(&picks[..accepted]);
        }
        queue.extend(&picks);
    }
    if finish == FinishReason::Length {
        let tail = text.finish();
        if !tail.is_empty() {
            on_text(&tail);
        }
    }
    // A stop inside a step's accepted proposals: the sequence keeps the output's tokens only
    // (a recurrent state must hold what the next turn continues from).
    let kv_tokens = out.len().min(pos - total);
    r.rewind(total + kv_tokens)?;
    Ok(Generated {
        kv_tokens,
        tokens: out,
        text: text.into_text(),
        finish,
        prompt_tokens: prompt.len(),
        prompt_secs,
        gen_secs: t1.elapsed().as_secs_f64(),
    })
}
