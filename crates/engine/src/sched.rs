//! The scheduling policy (vLLM v1's contract), pure bookkeeping over request ids, token ids and
//! KV block numbers: it never touches a device, a tokenizer or a client.
//!
//! Each step, [`Scheduler::schedule`] gives every running request a number of tokens within a
//! token budget (decode tokens and prefill chunks of running requests first, oldest first,
//! then newly admitted requests, whose cached prefix blocks are reused), allocating KV blocks
//! for them; when the pool runs dry the newest running request is preempted (its blocks freed,
//! requeued at the front for recompute). The caller runs the step and hands the sampled tokens
//! to [`Scheduler::update`], which advances the requests, registers their full blocks in the
//! prefix cache and finishes those that hit an end-of-generation token or their token limit.
//! Stop strings are text, so the output processor finds them and calls [`Scheduler::finish`].

use crate::kv::{chain_hash, BlockPool};
use crate::spec::{
    batch_cap, ngram_propose, DraftJob, Drafter, RequestSpec, SpecConfig, SpecState, SpecType,
};
use crate::spec_cost::StepCost;
use crate::types::{FinishReason, SchedError, BLOCK_SIZE};
use std::collections::VecDeque;

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Most tokens per step (prefill chunks and decode tokens together).
    pub max_batch_tokens: usize,
    /// Most requests running at once.
    pub max_seqs: usize,
    /// Most logits rows per step (one per sampling request, plus the prompt rows of requests
    /// that want prompt log-probabilities): what the runner's buffer holds.
    pub max_logits: usize,
    /// KV blocks in the pool (each [`BLOCK_SIZE`] tokens).
    pub kv_blocks: usize,
    /// Seeds the prefix-cache hash chain (per model, so two models never share blocks).
    pub hash_seed: u64,
    /// End-of-generation token ids.
    pub eog: Vec<u32>,
    /// Speculative decoding (proposals for the requests that allow it).
    pub spec: SpecConfig,
    /// The model keeps a per-sequence state (Qwen 3.5, DeepSeek-V4): each running request
    /// holds one of `max_seqs` state slots; prefixes are never taken from the prefix cache
    /// (the state at a block's end is not kept: the prompt is computed whole), and a
    /// preempted request is computed again from its first token.
    pub recurrent: bool,
    /// With `recurrent`: the most proposed tokens one request's step may carry, as many as
    /// the states the model keeps to roll a rejected proposal back (`State::keep_states`);
    /// 0: none (the state cannot be taken back).
    pub rollback: usize,
}

/// What the scheduler needs of a request.
#[derive(Clone, Debug)]
pub struct SchedRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Logits for every prompt position (prompt log-probabilities): the prompt is computed
    /// whole, never taken from the prefix cache.
    pub prompt_logits: bool,
    /// The prompt is computed whole, never taken from the prefix cache (embeddings).
    pub whole_prompt: bool,
    /// The request's prefix-cache namespace: its blocks are found only by requests with the
    /// same salt (None: the shared namespace).
    pub cache_salt: Option<String>,
    /// Its decode steps may carry proposed tokens (`SchedConfig::spec`).
    pub speculate: bool,
    /// Its own speculation settings (in place of `SchedConfig::spec`'s).
    pub spec: RequestSpec,
}

/// One request's part of a step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scheduled {
    pub id: u64,
    /// Position of the first token of this step.
    pub start_pos: usize,
    /// `SchedulerOutput::tokens[tokens.0..tokens.1]` are this step's token ids.
    pub tokens: (usize, usize),
    /// `SchedulerOutput::blocks[blocks.0..blocks.1]` is the request's whole block table.
    pub blocks: (usize, usize),
    /// The step reaches the end of the request's known tokens: its last token's logits pick
    /// the next token.
    pub sample: bool,
    /// Logits rows of this step's tokens from this index on (the sampling row last): the
    /// last token's when sampling, every prompt token's for `prompt_logits` requests.
    pub logits_from: Option<usize>,
    /// The request's prompt length: its tokens from this position on are generated ones
    /// (decode rows, whichever step computes them: a recompute after preemption too).
    pub decode_from: usize,
    /// The step's last `draft` tokens are proposed ones: every row samples (logits from 0),
    /// and row j's pick is checked against token j + 1.
    pub draft: usize,
    /// The request's slot of the model's recurrent state (`SchedConfig::recurrent`).
    pub state_slot: u32,
}

impl Scheduled {
    pub fn n_tokens(&self) -> usize {
        self.tokens.1 - self.tokens.0
    }

    /// Logits rows this request takes in the step.
    pub fn logit_rows(&self) -> usize {
        self.logits_from.map_or(0, |f| self.n_tokens() - f)
    }
}

/// A request scheduled for the first time (or again after a preemption, with `resumed`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    pub id: u64,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV blocks came from the prefix cache.
    pub cached_tokens: usize,
    /// Scheduled before and preempted since (no new `Started` event for the client).
    pub resumed: bool,
}

/// What one step runs. Self-contained: a model runner needs nothing else to build the batch.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    /// In batch order.
    pub scheduled: Vec<Scheduled>,
    /// The step's token ids, request after request.
    pub tokens: Vec<u32>,
    /// The block tables, request after request.
    pub blocks: Vec<u32>,
    /// Requests admitted this step.
    pub started: Vec<Started>,
    /// Requests preempted this step (blocks freed, back in the queue).
    pub preempted: Vec<u64>,
}

impl SchedulerOutput {
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }

    /// The step's tokens and block table of one scheduled request.
    pub fn parts(&self, s: &Scheduled) -> (&[u32], &[u32]) {
        (
            &self.tokens[s.tokens.0..s.tokens.1],
            &self.blocks[s.blocks.0..s.blocks.1],
        )
    }

    fn clear(&mut self) {
        self.scheduled.clear();
        self.tokens.clear();
        self.blocks.clear();
        self.started.clear();
        self.preempted.clear();
    }
}

/// What `update` made of one sampled token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub id: u64,
    pub token: u32,
    /// Its index in `update`'s `sampled`.
    pub index: usize,
    /// The token joined the request's output (false for an end-of-generation token, which ends
    /// the request without being output).
    pub appended: bool,
    /// The request ended with this token (it is no longer in the scheduler).
    pub finish: Option<FinishReason>,
}

/// A request's counts when it ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

struct Entry {
    id: u64,
    /// Admission order: the oldest runs first, the newest is preempted first.
    arrived: u64,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    ignore_eos: bool,
    prompt_logits: bool,
    whole_prompt: bool,
    /// Tokens whose K/V are in the cache.
    n_computed: usize,
    /// Its slot of the recurrent state while running (`SchedConfig::recurrent`).
    slot: u32,
    blocks: Vec<u32>,
    /// Full blocks registered (or found) in the prefix cache, and the hash of the last.
    hashed: usize,
    last_hash: u64,
    /// The hash chain's seed: the model's, salted by the request's `cache_salt`.
    seed: u64,
    cached_tokens: usize,
    started: bool,
    /// Tokens scheduled this step (with `proposal`).
    step: usize,
    speculate: bool,
    /// This step's proposed tokens (after `tokens`).
    proposal: Vec<u32>,
    spec: SpecState,
    /// (draft_max, draft_min, p_min) of this request.
    limits: (usize, usize, f32),
    /// Tokens whose K/V the draft model holds (its KV in the same blocks as the target's).
    draft_done: usize,
    /// Tokens reserved this step for the draft model's proposal (drafted after the loop).
    draft_len: usize,
}

impl Entry {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// This step's part of the prompt has every row's logits.
    fn prompt_rows(&self) -> bool {
        self.prompt_logits && self.n_computed < self.prompt_len
    }

    /// Tokens to schedule now within the token budget and, for prompt rows, the rows left;
    /// never across the prompt's end (a request recomputed after a preemption takes its
    /// prompt, then its generated tokens), so that each step's part of a request is all prompt
    /// rows or all decode rows (`Scheduled::decode_from`).
    fn want(&self, budget: usize, prompt_rows: &mut usize) -> usize {
        let mut left = self.tokens.len() - self.n_computed;
        if self.n_computed < self.prompt_len {
            left = left.min(self.prompt_len - self.n_computed);
        }
        let want = left.min(budget);
        if !self.prompt_rows() {
            return want;
        }
        let want = want.min(*prompt_rows);
        *prompt_rows -= want;
        want
    }

    /// Decoding: one known token past those in the cache, beyond the prompt.
    fn decoding(&self) -> bool {
        self.n_computed >= self.prompt_len && self.n_computed + 1 == self.tokens.len()
    }

    /// Full blocks whose tokens are known join the prefix cache (never a block holding a
    /// proposed token that was not accepted: `tokens` holds accepted ones only).
    fn register(&mut self, pool: &mut BlockPool) {
        while (self.hashed + 1) * BLOCK_SIZE <= self.n_computed.min(self.tokens.len()) {
            let h = block_hash(self, self.hashed);
            pool.register(self.blocks[self.hashed], h);
            self.hashed += 1;
            self.last_hash = h;
        }
    }

    fn counts(&self) -> Counts {
        Counts {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens,
        }
    }
}

pub struct Scheduler {
    cfg: SchedConfig,
    pool: BlockPool,
    running: Vec<Entry>,
    waiting: VecDeque<Entry>,
    next_arrival: u64,
    out: SchedulerOutput,
    outcomes: Vec<Outcome>,
    spec_counts: SpecCounts,
    /// The engine's step times, for the cost of proposed rows (`note_step`).
    cost: StepCost,
}

/// Proposed and accepted tokens since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecCounts {
    pub proposed: u64,
    pub accepted: u64,
    /// Request-steps that carried a proposal.
    pub steps: u64,
}

/// The prefix-cache hash of full block `b` of `e`'s tokens, chained on the blocks before it.
/// A block that holds generated tokens (positions from the prompt's length on) hashes with
/// that length too: a backend may compute decode rows otherwise than prompt rows (the CUDA
/// backend: attention on the KV-group kernel, issue 18), so such a block is found only by a
/// request with the same prompt and the same generated tokens (itself, resumed after a
/// preemption), never by one whose prompt holds those tokens: that one computes them as
/// prompt rows, as it would alone.
fn block_hash(e: &Entry, b: usize) -> u64 {
    let end = (b + 1) * BLOCK_SIZE;
    let tokens = &e.tokens[b * BLOCK_SIZE..end];
    if end > e.prompt_len {
        chain_hash(
            e.last_hash ^ (e.prompt_len as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            tokens,
        )
    } else {
        chain_hash(e.last_hash, tokens)
    }
}

/// The seed of a request's hash chain: the model's, or for a salted request the model's and
/// the salt hashed together (no two salts, and no salt and the unsalted chain, share a block).
fn salted_seed(model: u64, salt: Option<&str>) -> u64 {
    use std::hash::{Hash, Hasher};
    let Some(salt) = salt else { return model };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (model, "cache_salt", salt).hash(&mut h);
    h.finish()
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Scheduler {
        Scheduler {
            pool: BlockPool::new(cfg.kv_blocks),
            cfg,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_arrival: 0,
            out: SchedulerOutput::default(),
            outcomes: Vec::new(),
            spec_counts: SpecCounts::default(),
            cost: StepCost::default(),
        }
    }

    /// Queues a request behind the waiting ones.
    pub fn add(&mut self, r: SchedRequest) {
        let arrived = self.next_arrival;
        self.next_arrival += 1;
        let seed = salted_seed(self.cfg.hash_seed, r.cache_salt.as_deref());
        self.waiting.push_back(Entry {
            id: r.id,
            arrived,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            max_tokens: r.max_tokens,
            ignore_eos: r.ignore_eos,
            prompt_logits: r.prompt_logits,
            whole_prompt: r.whole_prompt || self.cfg.recurrent,
            n_computed: 0,
            slot: 0,
            blocks: Vec::new(),
            hashed: 0,
            last_hash: seed,
            seed,
            cached_tokens: 0,
            started: false,
            step: 0,
            speculate: r.speculate && (!self.cfg.recurrent || self.cfg.rollback > 0),
            proposal: Vec::new(),
            spec: SpecState::default(),
            limits: r.spec.resolve(&self.cfg.spec),
            draft_done: 0,
            draft_len: 0,
        });
    }

    /// Ends a request wherever it is (abort, client gone, stop string), freeing its blocks.
    /// None when the scheduler does not know it (it already ended).
    pub fn finish(&mut self, id: u64) -> Option<Counts> {
        let mut e = if let Some(i) = self.running.iter().position(|e| e.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|e| e.id == id)?;
            self.waiting.remove(i)?
        };
        self.pool.release_all(&mut e.blocks);
        Some(e.counts())
    }

    /// Ends every request (shutdown); returns their ids and counts.
    pub fn finish_all(&mut self) -> Vec<(u64, Counts)> {
        let mut all = release(&mut self.pool, self.running.drain(..));
        all.extend(release(&mut self.pool, self.waiting.drain(..)));
        all
    }

    /// Ends every running request (a failed step).
    pub fn finish_running(&mut self) -> Vec<(u64, Counts)> {
        release(&mut self.pool, self.running.drain(..))
    }

    /// Ends every waiting request (draining before shutdown: nothing new is admitted).
    pub fn finish_waiting(&mut self) -> Vec<(u64, Counts)> {
        release(&mut self.pool, self.waiting.drain(..))
    }

    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    /// Each running request, oldest first: its id, counts, and the tokens whose K/V are cached.
    pub fn running(&self) -> impl Iterator<Item = (u64, Counts, usize)> + '_ {
        self.running
            .iter()
            .map(|e| (e.id, e.counts(), e.n_computed))
    }

    /// The most requests decoding in a step that proposes (`SpecConfig::max_decoding`).
    pub fn spec_limit(&self) -> usize {
        self.cfg.spec.max_decoding
    }

    pub fn spec_counts(&self) -> SpecCounts {
        self.spec_counts
    }

    /// The last scheduled step took `secs` from its planning to its tokens (debug log).
    pub fn note_step(&mut self, secs: f64) {
        tracing::debug!(rows = self.out.n_tokens(), ms = secs * 1e3, "step");
        if self.cfg.spec.timed {
            self.cost.record(self.out.n_tokens(), secs);
        }
    }

    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn kv_blocks_total(&self) -> usize {
        self.pool.total()
    }

    pub fn kv_blocks_used(&self) -> usize {
        self.pool.used()
    }

    /// The prompt and generated tokens of a running request.
    pub fn tokens(&self, id: u64) -> Option<&[u32]> {
        self.running
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.tokens.as_slice())
    }

    /// Makes sure `e` has blocks for positions up to `upto` (exclusive). False if the pool is
    /// dry.
    fn grow(pool: &mut BlockPool, e: &mut Entry, upto: usize) -> bool {
        while e.blocks.len() * BLOCK_SIZE < upto {
            match pool.alloc() {
                Some(b) => e.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Frees the newest running request and puts it back at the front of the queue.
    fn preempt_newest(&mut self) {
        let Some(i) = (0..self.running.len()).max_by_key(|&i| self.running[i].arrived) else {
            return;
        };
        let mut e = self.running.remove(i);
        self.pool.release_all(&mut e.blocks);
        (e.n_computed, e.hashed, e.last_hash, e.step) = (0, 0, e.seed, 0);
        (e.draft_done, e.draft_len) = (0, 0);
        e.proposal.clear();
        self.out.preempted.push(e.id);
        self.waiting.push_front(e);
    }

    /// Reuses cached full blocks (`block_hash`) of the request's known tokens (never the last
    /// token, which must be computed to get logits).
    fn reuse_prefix(pool: &mut BlockPool, e: &mut Entry) {
        while !e.prompt_logits && !e.whole_prompt && (e.hashed + 1) * BLOCK_SIZE < e.tokens.len() {
            let h = block_hash(e, e.hashed);
            match pool.lookup(h) {
                Some(b) => {
                    e.blocks.push(b);
                    e.hashed += 1;
                    e.last_hash = h;
                }
                None => break,
            }
        }
        e.n_computed = e.hashed * BLOCK_SIZE;
    }

    /// Plans the next step. The output is empty when there is nothing to run.
    pub fn schedule(&mut self) -> Result<&SchedulerOutput, SchedError> {
        self.schedule_with(None)
    }

    /// Plans the next step, a draft model proposing for the requests that may (with
    /// [`SpecType::Draft`]; without a drafter they propose nothing).
    pub fn schedule_with(
        &mut self,
        drafter: Option<&mut dyn Drafter>,
    ) -> Result<&SchedulerOutput, SchedError> {
        self.out.clear();
        let mut budget = self.cfg.max_batch_tokens;
        // Logits rows for prompt log-probabilities, beyond one sampling row per request.
        let mut prompt_rows = self.cfg.max_logits.saturating_sub(self.cfg.max_seqs);
        // 1. Running requests: decode tokens and prefill chunks, oldest first.
        self.running.sort_by_key(|e| e.arrived);
        let spec = self.cfg.spec.clone();
        let n_decoding = self.running.iter().filter(|e| e.decoding()).count();
        let mut i = 0;
        while i < self.running.len() {
            let e = &mut self.running[i];
            let mut want = e.want(budget, &mut prompt_rows);
            e.proposal.clear();
            e.draft_len = 0;
            if want == 0 {
                e.step = 0;
                i += 1;
                continue;
            }
            let (draft_max, draft_min, _) = e.limits;
            let mut cap = batch_cap(&spec, draft_max, n_decoding);
            if self.cfg.recurrent {
                cap = cap.min(self.cfg.rollback);
            }
            if cap > 0 && e.speculate && !e.prompt_logits && e.decoding() {
                let room = (budget - want)
                    .min(prompt_rows)
                    .min(e.max_tokens.saturating_sub(e.generated() + 1))
                    .min(cap);
                let len = e.spec.next_len(draft_max, n_decoding, &self.cost).min(room);
                match spec.kind {
                    SpecType::Ngram => {
                        let p = ngram_propose(&e.tokens, spec.ngram_max, spec.ngram_min, len);
                        if p.len() >= draft_min.max(1) {
                            e.proposal.extend_from_slice(p);
                        }
                    }
                    // The proposal's rows are reserved and its blocks allocated (the draft
                    // writes its K/V there); the draft proposes after this loop, for every
                    // request at once (`draft_all`).
                    SpecType::Draft | SpecType::Eagle3 | SpecType::Mtp
                        if drafter.is_some()
                            && len > 0
                            && len >= draft_min
                            && Self::grow(&mut self.pool, e, e.n_computed + want + len) =>
                    {
                        e.draft_len = len;
                    }
                    _ => {}
                }
                let reserved = e.proposal.len() + e.draft_len;
                want += reserved;
                prompt_rows -= reserved;
            }
            let mut upto = e.n_computed + want;
            if !e.proposal.is_empty() && !Self::grow(&mut self.pool, e, upto) {
                // No blocks for the proposal: the step decodes one token.
                prompt_rows += e.proposal.len();
                (want, upto) = (want - e.proposal.len(), upto - e.proposal.len());
                e.proposal.clear();
            }
            if Self::grow(&mut self.pool, e, upto) {
                e.step = want;
                budget -= want;
                i += 1;
            } else if self.running.len() > 1 {
                // Sorted by arrival, so the newest is last: it is preempted, which may be this
                // one (then the loop ends) or a later one (then this one retries).
                self.preempt_newest();
            } else {
                return Err(SchedError::PoolTooSmall {
                    blocks: self.pool.total(),
                    tokens: upto,
                });
            }
        }
        if let Some(d) = drafter {
            // (Above the decoding limit nothing is proposed, and nothing is caught up.)
            let catch_up = spec.kind.uses_head() && n_decoding <= spec.max_decoding;
            let (b, p) = self.draft_all(d, catch_up);
            budget += b;
            prompt_rows += p;
        }
        // 2. Admit waiting requests while there is room.
        while budget > 0 && self.running.len() < self.cfg.max_seqs {
            let Some(mut e) = self.waiting.pop_front() else {
                break;
            };
            Self::reuse_prefix(&mut self.pool, &mut e);
            let want = e.want(budget, &mut prompt_rows);
            if want == 0 {
                // Its prompt rows wait for the next step.
                self.waiting.push_front(e);
                break;
            }
            let upto = e.n_computed + want;
            if !Self::grow(&mut self.pool, &mut e, upto) {
                self.pool.release_all(&mut e.blocks);
                (e.n_computed, e.hashed, e.last_hash) = (0, 0, e.seed);
                if self.running.is_empty() {
                    let tokens = upto;
                    self.waiting.push_front(e);
                    return Err(SchedError::PoolTooSmall {
                        blocks: self.pool.total(),
                        tokens,
                    });
                }
                self.waiting.push_front(e);
                break;
            }
            let resumed = e.started;
            if !e.started {
                e.started = true;
                e.cached_tokens = e.n_computed;
            }
            self.out.started.push(Started {
                id: e.id,
                prompt_tokens: e.prompt_len,
                cached_tokens: if resumed { 0 } else { e.cached_tokens },
                resumed,
            });
            // The lowest state slot no running request holds (there is one: fewer than
            // max_seqs run).
            e.slot = (0..self.cfg.max_seqs as u32)
                .find(|s| self.running.iter().all(|r| r.slot != *s))
                .unwrap_or(0);
            e.step = want;
            budget -= want;
            self.running.push(e);
        }
        // 3. The step in running order, decode rows first: its requests past their prompt, then
        // the prompt chunks.
        let out = &mut self.out;
        let part = |d: bool| move |e: &&Entry| e.step > 0 && (e.n_computed >= e.prompt_len) == d;
        let (dec, pre) = (
            self.running.iter().filter(part(true)),
            self.running.iter().filter(part(false)),
        );
        for e in dec.chain(pre) {
            let t0 = out.tokens.len();
            let draft = e.proposal.len();
            out.tokens
                .extend_from_slice(&e.tokens[e.n_computed..e.n_computed + e.step - draft]);
            out.tokens.extend_from_slice(&e.proposal);
            let b0 = out.blocks.len();
            out.blocks.extend_from_slice(&e.blocks);
            let sample = e.n_computed + e.step - draft == e.tokens.len();
            out.scheduled.push(Scheduled {
                id: e.id,
                start_pos: e.n_computed,
                tokens: (t0, out.tokens.len()),
                blocks: (b0, out.blocks.len()),
                sample,
                decode_from: e.prompt_len,
                state_slot: e.slot,
                draft,
                logits_from: if e.prompt_rows() || draft > 0 {
                    Some(0)
                } else {
                    sample.then(|| e.step - 1)
                },
            });
        }
        Ok(&self.out)
    }

    /// The draft model's proposals for the requests that reserved rows for one this step; the
    /// rows and budget they leave unused go back: returns (budget, logits rows) returned.
    /// With `catch_up` (an EAGLE-3 head) the head also catches up with the states the target
    /// computed for every other running request (`len` 0), so that few wait in its buffer.
    fn draft_all(&mut self, d: &mut dyn Drafter, catch_up: bool) -> (usize, usize) {
        let mut jobs: Vec<DraftJob> = self
            .running
            .iter_mut()
            .filter(|e| {
                (e.draft_len > 0 && e.step > 0) || (catch_up && e.n_computed > e.draft_done)
            })
            .map(|e| DraftJob {
                id: e.id,
                tokens: &e.tokens,
                done: &mut e.draft_done,
                blocks: &e.blocks,
                slot: e.slot,
                len: e.draft_len,
                p_min: e.limits.2,
                out: &mut e.proposal,
            })
            .collect();
        if !jobs.is_empty() {
            d.draft(&mut jobs);
        }
        drop(jobs);
        let mut unused = 0;
        for e in self.running.iter_mut().filter(|e| e.draft_len > 0) {
            if e.proposal.len() < e.limits.1.max(1) {
                e.proposal.clear();
            }
            let u = e.draft_len - e.proposal.len().min(e.draft_len);
            e.proposal.truncate(e.draft_len);
            e.step -= u;
            unused += u;
            e.draft_len = 0;
        }
        (unused, unused)
    }

    /// The last `schedule()`'s output.
    pub fn output(&self) -> &SchedulerOutput {
        &self.out
    }

    /// Consumes the step's results: every scheduled request advances by its step (its full
    /// blocks join the prefix cache), and each `(id, token)` sampled from a `sample` row is
    /// appended or ends its request. A request whose step carried a proposal has one token
    /// per accepted proposed token and one more, in order: it advances past the accepted
    /// ones, and the blocks past them go back to the pool. Requests that ended are no longer
    /// in the scheduler (their later tokens are dropped). Outcomes come in the order of
    /// `sampled`.
    pub fn update(&mut self, sampled: &[(u64, u32)]) -> &[Outcome] {
        for e in self.running.iter_mut() {
            let draft_max = e.limits.0;
            let mut step = std::mem::take(&mut e.step);
            let proposed = e.proposal.len();
            if proposed > 0 {
                // Its picks: the accepted proposals, then the one that differed (or followed).
                let picks = sampled.iter().filter(|s| s.0 == e.id).count();
                let accepted = picks.saturating_sub(1).min(proposed);
                step -= proposed - accepted;
                e.spec.record(proposed, accepted, draft_max);
                self.spec_counts.proposed += proposed as u64;
                self.spec_counts.accepted += accepted as u64;
                self.spec_counts.steps += 1;
                e.proposal.clear();
            }
            e.n_computed += step;
            // The draft's K/V past the accepted tokens are of rejected ones.
            e.draft_done = e.draft_done.min(e.n_computed);
            // Blocks past the computed tokens (a rejected proposal's) go back to the pool.
            while e.blocks.len() > e.n_computed.div_ceil(BLOCK_SIZE) {
                if let Some(b) = e.blocks.pop() {
                    self.pool.release(b);
                }
            }
            e.register(&mut self.pool);
        }
        self.outcomes.clear();
        for (index, &(id, token)) in sampled.iter().enumerate() {
            let Some(i) = self.running.iter().position(|e| e.id == id) else {
                continue;
            };
            let e = &mut self.running[i];
            let finish = if !e.ignore_eos && self.cfg.eog.contains(&token) {
                Some((false, FinishReason::Stop))
            } else {
                e.tokens.push(token);
                e.register(&mut self.pool);
                (e.generated() >= e.max_tokens).then_some((true, FinishReason::Length))
            };
            let (appended, finish) = match finish {
                Some((appended, reason)) => {
                    let mut e = self.running.remove(i);
                    self.pool.release_all(&mut e.blocks);
                    (appended, Some(reason))
                }
                None => (true, None),
            };
            self.outcomes.push(Outcome {
                id,
                token,
                index,
                appended,
                finish,
            });
        }
        &self.outcomes
    }
}

/// Frees the blocks of ended requests; their ids and counts.
fn release(pool: &mut BlockPool, ended: impl Iterator<Item = Entry>) -> Vec<(u64, Counts)> {
    ended
        .map(|mut e| {
            pool.release_all(&mut e.blocks);
            (e.id, e.counts())
        })
        .collect()
}

#[cfg(test)]
mod spec_tests;
#[cfg(test)]
mod tests;
