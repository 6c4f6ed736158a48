//! The types the engine's modules share: errors, why a generation ended, log-probabilities, and
//! the serving engine's request, events, limits and stats (what the HTTP server sees of it:
//! re-exported by [`crate::serve`]). Everything here is data; it imports no other module of the
//! engine but the leaves that define a request's parts (sampler, constraint, pooling).

use quiver_models::ModelError;

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = quiver_backend::KV_BLOCK_SIZE;

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
    #[error("the model keeps a recurrent state: evaluation continues at position {next} or starts again at 0, not at {at}")]
    StateRewind { at: usize, next: usize },
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error("the tokenizer has {tokenizer} tokens, the model {model}")]
    VocabMismatch { tokenizer: usize, model: usize },
    #[error("engine thread: {0}")]
    Thread(String),
    #[error("draft model: {0}")]
    Draft(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// The scheduler's error: a step it cannot plan.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SchedError {
    #[error("the KV pool of {blocks} blocks cannot hold a single sequence of {tokens} tokens")]
    PoolTooSmall { blocks: usize, tokens: usize },
}

/// Why a generation ended: the one reason the scheduler, the serving loop, [`crate::generate`]
/// and the server all use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, a stop string, or the end of the request's grammar.
    Stop,
    /// The token limit (`max_tokens`).
    Length,
    /// Ended from outside: an abort, the client gone, shutdown, the caller of `generate`.
    Abort,
}

impl FinishReason {
    /// The name OpenAI's and vLLM's `finish_reason` give it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// log-softmax of the raw logits at the chosen token.
    pub logprob: f32,
    /// The best `n` tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// One generation request, already tokenized.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: crate::sampler::SamplerParams,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Top-N log-probabilities per generated token (None: no logprobs; Some(0): the chosen
    /// token's only).
    pub logprobs: Option<usize>,
    /// Top-N log-probabilities of every prompt token after the first (echo with logprobs):
    /// the prompt is then computed whole, without the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Generate past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// The grammar the output must follow (constrained decoding), compiled by the caller
    /// ([`crate::constraint::Grammars`]).
    pub constraint: Option<crate::constraint::Constraint>,
    /// An embedding instead of text: the prompt is computed whole (no prefix cache), its
    /// hidden states pooled so, and the request ends with `Event::Embedding` (`max_tokens`,
    /// the sampler and the rest unused).
    pub embed: Option<crate::embed::Pooling>,
    /// The prefix-cache namespace (vLLM's `cache_salt`, per tenant): the request reuses and
    /// leaves cached blocks only for requests with the same salt, so `cached_tokens` tells it
    /// nothing of another namespace's prompts. None: the shared namespace.
    pub cache_salt: Option<String>,
    /// Its own speculative-decoding settings (llama-server's `speculative.*` fields).
    pub speculative: crate::spec::RequestSpec,
}

/// What a request's sink receives, in order: `Started`, `PromptLogprobs` when asked for, zero
/// or more `Token` (or, for an embedding request, one `Embedding`), then exactly one of
/// `Finished` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    /// The prompt was scheduled; `cached_tokens` of it were reused from the prefix cache.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// The prompt's log-probabilities (`Request::prompt_logprobs`), before the first `Token`:
    /// entry i is prompt token i + 1's given the tokens before it.
    PromptLogprobs(Vec<TokenLogprob>),
    /// One generated token and the text it completes (may be empty while a UTF-8 sequence or
    /// a possible stop string is held back).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// An embedding request's vector (unit length).
    Embedding(Vec<f32>),
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

/// Receives a request's events on the engine thread. Returning false means the receiver is
/// gone (client disconnected): the engine aborts the request within one step.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum SubmitError {
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context of {ctx} tokens")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        ctx: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error("the queue is full ({0} requests waiting)")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Counters and gauges for `/metrics` and `stats()`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub running: usize,
    /// The running requests, oldest first (llama-server's `/slots`).
    pub requests: Vec<RunningRequest>,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub prompt_tokens_total: u64,
    pub generated_tokens_total: u64,
    pub prefix_cache_hit_tokens_total: u64,
    pub preemptions_total: u64,
    pub steps_total: u64,
    /// Speculative decoding: tokens proposed and accepted.
    pub spec_proposed_tokens_total: u64,
    pub spec_accepted_tokens_total: u64,
}

/// One running request as the last step left it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunningRequest {
    pub id: u64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Positions whose K/V are in the cache.
    pub n_past: usize,
}

/// Limits of the serving engine.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Context length per sequence.
    pub n_ctx: usize,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// KV blocks in the pool (each `BLOCK_SIZE` tokens).
    pub kv_blocks: usize,
    /// Most tokens per forward step (prefill chunks and decode tokens together).
    pub max_batch_tokens: usize,
    /// Most requests waiting before `submit` answers `QueueFull`.
    pub max_waiting: usize,
    /// The KV cache's element types.
    pub kv: quiver_backend::KvTypes,
    /// Speculative decoding.
    pub spec: crate::spec::SpecConfig,
}

/// What the server needs to know about the loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub n_ctx: usize,
    pub n_vocab: usize,
}
