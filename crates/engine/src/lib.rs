//! The model runner for one sequence (CLI run / chat / perplexity / logprobs / bench) and the
//! sampler. The batched scheduler of the server builds on the same `forward`.

mod batched;
mod kv;
pub mod sampler;
mod scheduler;
pub mod serve;

pub use batched::{batched_bench, bench_prompt, BatchedResult};
pub use scheduler::start as start_serving;

pub use sampler::{argmax, logprobs, Needs, Sampler, SamplerParams};

use quiver_backend::{Backend, Batch};
use quiver_gguf::GgufFile;
use quiver_models::{Model, ModelError, State};
use quiver_tokenizer::{Detokenizer, Tokenizer};
use std::sync::Arc;

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(
        "prompt of {prompt} tokens plus {gen} to generate exceeds the context of {ctx} tokens"
    )]
    ContextOverflow {
        prompt: usize,
        gen: usize,
        ctx: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
}

pub type Result<T> = std::result::Result<T, EngineError>;

#[derive(Clone, Debug)]
pub struct RunnerOptions {
    /// Context length in tokens (rounded up to whole KV blocks).
    pub n_ctx: usize,
    /// Largest number of tokens per forward step.
    pub n_batch: usize,
    /// Largest number of logits rows per forward step.
    pub max_logits: usize,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            n_ctx: 4096,
            n_batch: 512,
            max_logits: 1,
        }
    }
}

/// A model, its backend and one sequence's state.
pub struct Runner<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub state: State<B>,
    pub n_ctx: usize,
    pub n_batch: usize,
    logits: Vec<f32>,
    host: Vec<f32>,
    /// The last `eval_top_k` result.
    top: Vec<(u32, f32)>,
    /// The last `eval_argmax` result.
    ids: Vec<u32>,
    batch: Batch,
}

/// Which positions of an `eval` need logits.
#[derive(Clone, Copy, Debug)]
pub enum Want {
    Last,
    /// Every position from this index of the evaluated tokens on.
    From(usize),
}

impl<B: Backend> Runner<B> {
    pub fn new(backend: B, file: &Arc<GgufFile>, opts: &RunnerOptions) -> Result<Self> {
        let model = quiver_models::load(&backend, file)?;
        let n_ctx = opts.n_ctx.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let n_batch = opts.n_batch.max(1);
        let max_logits = opts.max_logits.clamp(1, n_batch);
        let state = model.state(&backend, n_ctx, n_batch, max_logits)?;
        Ok(Runner {
            backend,
            model,
            state,
            n_ctx,
            n_batch,
            logits: Vec::new(),
            host: Vec::new(),
            top: Vec::new(),
            ids: Vec::new(),
            batch: Batch::default(),
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.model.hp.n_vocab
    }

    /// Tokens to evaluate at `start_pos..`: not empty, within the context and the vocabulary.
    fn check_tokens(&self, tokens: &[u32], start_pos: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if start_pos + tokens.len() > self.n_ctx {
            return Err(EngineError::ContextOverflow {
                prompt: start_pos + tokens.len(),
                gen: 0,
                ctx: self.n_ctx,
            });
        }
        let nv = self.n_vocab();
        match tokens.iter().find(|&&t| t as usize >= nv) {
            Some(&id) => Err(EngineError::BadToken { id, n_vocab: nv }),
            None => Ok(()),
        }
    }

    /// Evaluates `tokens` at positions `start_pos..` (the KV before `start_pos` must hold the
    /// earlier tokens) and returns the wanted logits rows, `[rows, n_vocab]`.
    pub fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]> {
        self.check_tokens(tokens, start_pos)?;
        let nv = self.n_vocab();
        let first_wanted = match want {
            Want::Last => tokens.len() - 1,
            Want::From(k) => k.min(tokens.len() - 1),
        };
        self.logits.clear();
        let n_blocks = self.n_ctx / BLOCK_SIZE;
        let mut done = 0;
        while done < tokens.len() {
            // One step: at most n_batch tokens and at most max_logits wanted rows.
            let mut end = (done + self.n_batch).min(tokens.len());
            let from = first_wanted.max(done);
            if from < end && end - from > self.state.max_logits {
                end = from + self.state.max_logits;
            }
            self.batch.fill_single(
                &tokens[done..end],
                start_pos + done,
                n_blocks,
                BLOCK_SIZE,
                from - done,
            );
            self.model
                .forward(&mut self.backend, &mut self.state, &self.batch)?;
            let rows = self.batch.logits.len();
            if rows > 0 {
                if self.logits.is_empty() {
                    // The usual case (one step): take the rows without a second copy.
                    self.backend
                        .read(&self.state.logits, rows * nv, &mut self.logits)
                        .map_err(ModelError::from)?;
                } else {
                    self.backend
                        .read(&self.state.logits, rows * nv, &mut self.host)
                        .map_err(ModelError::from)?;
                    self.logits.extend_from_slice(&self.host);
                }
            }
            done = end;
        }
        Ok(&self.logits)
    }
}

impl<B: Backend> Runner<B> {
    /// Like `eval` with `Want::Last`, returning only the argmax of the last position's logits:
    /// the backend computes it, so a GPU sends back one id instead of the logits.
    pub fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        let nv = self.n_vocab();
        if tokens.len() > self.n_batch {
            let l = self.eval(tokens, start_pos, Want::Last)?;
            return Ok(sampler::argmax(&l[..nv]));
        }
        self.forward_last(tokens, start_pos)?;
        self.backend
            .argmax(&self.state.logits, 1, nv, &mut self.ids)
            .map_err(ModelError::from)?;
        Ok(self.ids[0])
    }

    /// Like `eval` with `Want::Last`, returning only the `k` largest logits of the last
    /// position as (id, logit), best first: what a top-k sampler needs (a GPU sends back k
    /// pairs instead of the logits).
    pub fn eval_top_k(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        k: usize,
    ) -> Result<&[(u32, f32)]> {
        let nv = self.n_vocab();
        if tokens.len() > self.n_batch {
            let l = self.eval(tokens, start_pos, Want::Last)?;
            let mut top = Vec::with_capacity(k);
            quiver_backend::reference::top_k(&l[..nv], k, &mut top);
            self.top = top;
            return Ok(&self.top);
        }
        self.forward_last(tokens, start_pos)?;
        self.backend
            .top_k(&self.state.logits, 1, nv, k, &mut self.top)
            .map_err(ModelError::from)?;
        Ok(&self.top)
    }

    /// One step over `tokens` (at most a batch) with logits for the last one.
    fn forward_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<()> {
        self.check_tokens(tokens, start_pos)?;
        let n_blocks = self.n_ctx / BLOCK_SIZE;
        self.batch
            .fill_single(tokens, start_pos, n_blocks, BLOCK_SIZE, tokens.len() - 1);
        self.model
            .forward(&mut self.backend, &mut self.state, &self.batch)?;
        Ok(())
    }
}

/// A loaded model and one sequence, whatever the backend: what the CLI commands drive.
pub trait Session {
    /// See `Runner::eval`.
    fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]>;
    /// See `Runner::eval_argmax`.
    fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32>;
    /// See `Runner::eval_top_k`.
    fn eval_top_k(&mut self, tokens: &[u32], start_pos: usize, k: usize) -> Result<&[(u32, f32)]>;
    fn n_vocab(&self) -> usize;
    fn n_ctx(&self) -> usize;
    fn hparams(&self) -> &quiver_models::Hparams;
    /// The backend's name ("cpu", "cuda").
    fn backend_name(&self) -> &'static str;
    /// The backend's counters (graph captures and replays, kernels compiled, …).
    fn counters(&self) -> Vec<(&'static str, u64)>;
    /// See `batched_bench` (its own KV pool; this session's sequence is untouched).
    fn batched_bench(
        &mut self,
        n_prompt: usize,
        n_gen: usize,
        parallel: usize,
        step_tokens: usize,
    ) -> Result<BatchedResult>;
}

impl<B: Backend> Session for Runner<B> {
    fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]> {
        Runner::eval(self, tokens, start_pos, want)
    }
    fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        Runner::eval_argmax(self, tokens, start_pos)
    }
    fn eval_top_k(&mut self, tokens: &[u32], start_pos: usize, k: usize) -> Result<&[(u32, f32)]> {
        Runner::eval_top_k(self, tokens, start_pos, k)
    }
    fn n_vocab(&self) -> usize {
        self.model.hp.n_vocab
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn hparams(&self) -> &quiver_models::Hparams {
        &self.model.hp
    }
    fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.backend.counters()
    }
    fn batched_bench(
        &mut self,
        n_prompt: usize,
        n_gen: usize,
        parallel: usize,
        step_tokens: usize,
    ) -> Result<BatchedResult> {
        batched::batched_bench(
            &mut self.backend,
            &self.model,
            n_prompt,
            n_gen,
            parallel,
            step_tokens,
        )
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// The token limit.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

pub struct Generated {
    pub tokens: Vec<u32>,
    /// How many of `tokens` have their K/V in the cache (the last sampled one may not).
    pub kv_tokens: usize,
    pub text: String,
    pub finish: Finish,
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
    let mut next = eval_and_pick(r, &prompt[split..], start_pos + split, sampler, &history)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let mut out = Vec::new();
    let mut text = String::new();
    let mut detok = Detokenizer::new(tok, true);
    let mut finish = Finish::Length;
    let mut pos = total;
    let mut kv_tokens = 0;
    while out.len() < opts.max_tokens {
        if !opts.ignore_eos && tok.is_eog(next) {
            finish = Finish::Stop;
            break;
        }
        out.push(next);
        history.push(next);
        let piece = detok.push(next);
        let before = text.len();
        text.push_str(&piece);
        if let Some(cut) = stop_at(&text, &opts.stop, before) {
            let emit = text[before..cut.max(before)].to_string();
            text.truncate(cut);
            if !emit.is_empty() {
                on_text(&emit);
            }
            finish = Finish::Stop;
            break;
        }
        // Hold back a tail that could still become a stop string.
        if !piece.is_empty() && !on_text(&piece) {
            finish = Finish::Cancelled;
            break;
        }
        if out.len() == opts.max_tokens {
            break;
        }
        next = eval_and_pick(r, &[next], pos, sampler, &history)?;
        kv_tokens += 1;
        pos += 1;
    }
    if finish == Finish::Length {
        let tail = detok.flush();
        if !tail.is_empty() {
            text.push_str(&tail);
            on_text(&tail);
        }
    }
    Ok(Generated {
        tokens: out,
        kv_tokens,
        text,
        finish,
        prompt_tokens: prompt.len(),
        prompt_secs,
        gen_secs: t1.elapsed().as_secs_f64(),
    })
}

/// Evaluates `tokens` and picks the next token. Plain greedy decoding takes the backend's
/// argmax, a top-k sampler the backend's k best logits (a GPU sends back one id, or k pairs,
/// instead of the logits); the draw itself stays on the host, so a seed gives the same text
/// whatever the device.
fn eval_and_pick(
    r: &mut (impl Session + ?Sized),
    tokens: &[u32],
    pos: usize,
    sampler: &mut Sampler,
    history: &[u32],
) -> Result<u32> {
    match sampler.needs() {
        Needs::Argmax => r.eval_argmax(tokens, pos),
        Needs::TopK(k) => {
            let top = r.eval_top_k(tokens, pos, k)?;
            Ok(sampler.sample_top(top))
        }
        Needs::Logits => Ok(sampler.sample(r.eval(tokens, pos, Want::Last)?, history)),
    }
}

/// The byte offset where the earliest stop string starts, if one ends in the new text.
pub(crate) fn stop_at(text: &str, stops: &[String], new_from: usize) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let from = new_from.saturating_sub(s.len() - 1);
            let from = (0..=from)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            text[from..].find(s.as_str()).map(|i| from + i)
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::stop_at;

    #[test]
    fn stop_strings_are_found_across_pieces() {
        let stops = vec!["END".to_string(), "\n\n".into()];
        assert_eq!(stop_at("hello EN", &stops, 6), None);
        assert_eq!(stop_at("hello END", &stops, 8), Some(6));
        assert_eq!(stop_at("a\n\nb", &stops, 2), Some(1));
        assert_eq!(stop_at("ünï", &["ï".to_string()], 3), Some(3));
    }
}
