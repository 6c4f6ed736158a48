//! A request's side of the serving loop while the engine holds it: where its events go, how
//! its tokens are picked (sampler, constraint) and shown (output processor), and what it has
//! asked for beyond text (log-probabilities, an embedding).

use crate::constraint::Constraint;
use crate::embed::Pool;
use crate::output::OutputProcessor;
use crate::sampler::Sampler;
use crate::sched::{Counts, SchedRequest};
use crate::types::{Event, Request, Sink, TokenLogprob};
use quiver_tokenizer::Tokenizer;
use std::collections::HashMap;

/// One request's state beside the scheduler's.
pub(crate) struct Live<'t> {
    sink: Sink,
    pub sampler: Sampler,
    pub out: OutputProcessor<'t>,
    pub logprobs: Option<usize>,
    /// Prompt log-probabilities asked for (taken when they are sent), and those computed so
    /// far (by prompt position).
    pub prompt_logprobs: Option<usize>,
    pub prompt_lps: Vec<Option<TokenLogprob>>,
    pub counts: Counts,
    pub constraint: Option<Constraint>,
    /// An embedding request's pooled hidden states so far.
    pub pool: Option<Pool>,
}

impl<'t> Live<'t> {
    /// A new request: what the scheduler takes of it, and the rest.
    pub fn admit(id: u64, req: Request, sink: Sink, tok: &'t Tokenizer) -> (SchedRequest, Self) {
        let sched = SchedRequest {
            id,
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            prompt_logits: req.prompt_logprobs.is_some(),
            whole_prompt: req.embed.is_some(),
            cache_salt: req.cache_salt,
            // A constraint's matcher takes one token a step: no proposals to check.
            speculate: req.constraint.is_none() && req.embed.is_none(),
            spec: req.speculative,
            prompt: req.prompt,
        };
        let live = Live {
            sink,
            sampler: Sampler::new(req.sampling),
            out: OutputProcessor::new(tok, req.stop),
            logprobs: req.logprobs,
            prompt_logprobs: req.prompt_logprobs,
            prompt_lps: Vec::new(),
            counts: Counts {
                prompt_tokens: sched.prompt.len(),
                ..Counts::default()
            },
            constraint: req.constraint,
            pool: req.embed.map(Pool::new),
        };
        (sched, live)
    }

    /// Sends an event; false when the client is gone.
    pub fn send(&mut self, e: Event) -> bool {
        (self.sink)(e)
    }
}

/// The requests the engine holds, and those a step ends by abort.
#[derive(Default)]
pub(crate) struct Requests<'t> {
    pub live: HashMap<u64, Live<'t>>,
    /// This step's requests to end with `Abort`: their client left, or their constraint
    /// failed. The runner picks no token for them.
    pub dead: Vec<u64>,
}

impl Requests<'_> {
    /// Whether the request makes an embedding (and samples nothing).
    pub fn embeds(&self, id: u64) -> bool {
        self.live.get(&id).is_some_and(|l| l.pool.is_some())
    }
}
