//! The model runner: a model, its backend and its buffers, with the one batch builder and the
//! one token picker. The single-sequence commands (`run`, `chat`, `perplexity`, `logprobs`,
//! `compare`, `bench`) drive it through [`Session`]; the serving loop runs scheduled steps on
//! it ([`ModelRunner::execute`]) and picks tokens with the same [`Picker`].

use crate::batch::{BatchBuilder, Blocks};
use crate::batched::{batched_bench, BatchedResult};
use crate::embed::{Pool, Pooling};
use crate::picker::{Fetch, Picker};
use crate::sampler::{Sampler, SamplerParams};
use crate::sched::SchedulerOutput;
use crate::types::{EngineError, Result, BLOCK_SIZE};
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use quiver_models::{Model, ModelError, State, TpPeers, TpSizes};
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct RunnerOptions {
    /// KV positions (rounded up to whole blocks): one sequence's context, or the serving pool.
    pub n_ctx: usize,
    /// Largest number of tokens per forward step.
    pub n_batch: usize,
    /// Largest number of logits rows per forward step.
    pub max_logits: usize,
    /// The KV cache's element types.
    pub kv: quiver_backend::KvTypes,
}

impl RunnerOptions {
    /// What the model (each rank's part) and its state are made for: the context's rope
    /// factors, KV positions in whole blocks, tokens and logits rows a step.
    pub(crate) fn model_sizes(&self) -> TpSizes {
        let max_tokens = self.n_batch.max(1);
        TpSizes {
            n_ctx: self.n_ctx,
            kv: self.kv,
            n_slots: self.n_ctx.div_ceil(BLOCK_SIZE) * BLOCK_SIZE,
            max_tokens,
            max_logits: self.max_logits.clamp(1, max_tokens),
        }
    }
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            n_ctx: 4096,
            n_batch: 512,
            max_logits: 1,
            kv: Default::default(),
        }
    }
}

/// A model, its backend and its buffers.
pub struct ModelRunner<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub state: State<B>,
    pub n_ctx: usize,
    pub n_batch: usize,
    batch: BatchBuilder,
    picker: Picker,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    /// The position after the last evaluated token: where a model with recurrent state
    /// continues (its state holds every token before it).
    next_pos: usize,
    /// A draft head reading this runner's steps ([`ModelRunner::attach_eagle3`],
    /// [`ModelRunner::attach_mtp`]).
    pub(crate) eagle: Option<Box<crate::runner_eagle::RunnerEagle<B>>>,
    /// The last verification step's first position and rows (`eval_verify`): where a
    /// recurrent state may be returned to ([`ModelRunner::rewind`]).
    last_verify: Option<(usize, usize)>,
    /// The other ranks of a tensor-parallel model ([`ModelRunner::with_ranks`]): every step
    /// runs on them too. `backend`, `model` and `state` are then rank 0's.
    peers: Option<TpPeers>,
}

/// Which positions of an `eval` need logits.
#[derive(Clone, Copy, Debug)]
pub enum Want {
    Last,
    /// Every position from this index of the evaluated tokens on.
    From(usize),
}

impl Want {
    /// The first of `len` (> 0) evaluated tokens whose logits are wanted.
    pub(crate) fn first(self, len: usize) -> usize {
        match self {
            Want::Last => len - 1,
            Want::From(k) => k.min(len - 1),
        }
    }
}

impl<B: Backend + Send + 'static> ModelRunner<B> {
    /// A model split over tensor-parallel ranks, one of `backends` each (the ranks of one
    /// group, in any order): rank 0 here, the others on threads of their own
    /// ([`TpPeers`]); each holds its heads' share of every KV block. One backend of no group
    /// is [`ModelRunner::new`].
    pub fn with_ranks(
        backends: Vec<B>,
        file: &Arc<GgufFile>,
        opts: &RunnerOptions,
    ) -> Result<Self> {
        if backends.len() == 1 && backends[0].shard().size == 1 {
            let b = backends.into_iter().next().expect("one backend");
            return Self::new(b, file, opts);
        }
        let (backend, peers) = TpPeers::start(backends, file, opts.model_sizes())?;
        let mut r = Self::new(backend, file, opts)?;
        r.peers = Some(peers);
        Ok(r)
    }
}

impl<B: Backend> ModelRunner<B> {
    /// The model on `backend` (or its rank's part, where `backend` is a rank of a group).
    pub fn new(backend: B, file: &Arc<GgufFile>, opts: &RunnerOptions) -> Result<Self> {
        let sizes = opts.model_sizes();
        let (model, state) = sizes.load(&backend, file)?;
        Ok(ModelRunner {
            backend,
            model,
            state,
            n_ctx: sizes.n_slots,
            n_batch: sizes.max_tokens,
            batch: BatchBuilder::default(),
            picker: Picker::default(),
            logits: Vec::new(),
            hidden: Vec::new(),
            next_pos: 0,
            eagle: None,
            last_verify: None,
            peers: None,
        })
    }

    /// The tensor-parallel ranks the model is split over (1: whole here).
    pub fn ranks(&self) -> usize {
        self.peers.as_ref().map_or(1, |p| p.size())
    }

    /// Each rank's weights' bytes as its backend counts them, rank 0 first.
    pub fn weights_bytes(&self) -> Vec<Option<u64>> {
        let mut w = vec![self.backend.weights_bytes()];
        if let Some(p) = &self.peers {
            w.extend_from_slice(p.weights_bytes());
        }
        w
    }

    /// What a tensor-parallel model does not run yet, refused in one line (`what`).
    pub(crate) fn whole_only(&self, what: &str) -> Result<()> {
        match self.ranks() {
            1 => Ok(()),
            n => Err(EngineError::Model(ModelError::Tp(format!(
                "{what} does not run over {n} tensor-parallel ranks yet"
            )))),
        }
    }

    pub fn n_vocab(&self) -> usize {
        self.model.hp.n_vocab
    }

    /// Makes room for `n` sequences at once in the model's recurrent state (models with
    /// recurrent layers, Qwen 3.5: the state is made again, checked against memory; others
    /// need nothing).
    pub fn set_max_seqs(&mut self, n: usize) -> Result<()> {
        let ctx = self.model.seq_ctx;
        self.set_seq_state(n, ctx)
    }

    /// [`ModelRunner::set_max_seqs`], with each sequence's context where the state's size
    /// depends on it (DeepSeek-V4's compressed KV; None: as many positions as the KV slots).
    pub fn set_seq_state(&mut self, n: usize, n_ctx_seq: Option<usize>) -> Result<()> {
        let ctx_changed = self.model.seq_ctx != n_ctx_seq && self.model.hp.dsv4.is_some();
        self.model.set_max_seqs(n);
        self.model.seq_ctx = n_ctx_seq;
        if self.model.hp.has_seq_state() && (self.state.n_seq_states != n.max(1) || ctx_changed) {
            let (n_slots, n_batch, max_logits) = (
                self.state.n_slots,
                self.state.max_tokens,
                self.state.max_logits,
            );
            // The old state goes first: both need not fit at once.
            let (planes, slots) = (self.state.snap_planes, self.state.snap_slots);
            self.state = self.model.state(&self.backend, 0, 1, 1)?;
            self.state = self
                .model
                .state(&self.backend, n_slots, n_batch, max_logits)?;
            self.state
                .keep_states(&self.backend, &self.model.hp, planes, slots)?;
        }
        Ok(())
    }

    /// Makes a model with a per-sequence state (Qwen 3.5's recurrent state, DeepSeek-V4's
    /// rings) keep what the last `planes` rows of up to `seqs` speculating sequences a step
    /// change, so that a step may carry up to `planes` proposed tokens a sequence and roll
    /// rejected ones back (`State::keep_states`). Returns how many proposed tokens a step may
    /// carry (unbounded, `usize::MAX`, for a model without such state).
    pub fn keep_states(&mut self, planes: usize, seqs: usize) -> Result<usize> {
        let hp = &self.model.hp;
        if hp.has_seq_state() {
            self.state.keep_states(&self.backend, hp, planes, seqs)?;
            Ok(planes)
        } else {
            Ok(usize::MAX)
        }
    }

    /// Makes every later step keep the inputs of `layers` (the layer count: the final
    /// pre-norm state) for an EAGLE-3 head.
    pub fn keep_layers(&mut self, layers: &[usize]) -> Result<()> {
        let d = self.model.hp.n_embd;
        self.state.capture_layers(&self.backend, layers, d)?;
        Ok(())
    }

    /// Runs a scheduled step; its sampling rows' logits are then in `state.logits`, in
    /// schedule order.
    pub fn execute(&mut self, out: &SchedulerOutput) -> Result<()> {
        self.batch.build_scheduled(out);
        self.forward_built()
    }

    /// One forward step of the batch just built: on the model's ranks together where it is
    /// split over several.
    fn forward_built(&mut self) -> Result<()> {
        let batch = self.batch.batch();
        match &mut self.peers {
            Some(p) => p.forward(&mut self.backend, &self.model, &mut self.state, batch)?,
            None => self
                .model
                .forward(&mut self.backend, &mut self.state, batch)?,
        }
        Ok(())
    }

    /// Constrained decoding: masks the last step's logits rows on the device, (row, bits)
    /// as [`Backend::mask_rows`] takes them.
    pub fn mask_rows(&mut self, masks: &[(usize, &[u32])]) -> Result<()> {
        let nv = self.n_vocab();
        self.backend
            .mask_rows(&mut self.state.logits, nv, masks)
            .map_err(ModelError::from)?;
        Ok(())
    }

    /// Reads back what the last step's `rows` logits rows need for `how`.
    pub fn fetch(&mut self, rows: usize, how: Fetch) -> Result<&mut Picker> {
        let nv = self.n_vocab();
        self.picker
            .fetch(&self.backend, &self.state.logits, rows, nv, how)
            .map_err(ModelError::from)?;
        Ok(&mut self.picker)
    }

    /// Tokens to evaluate at `start_pos..`: [`check_single`], and a model with recurrent state
    /// continues where it stopped or starts again.
    fn check_tokens(&self, tokens: &[u32], start_pos: usize) -> Result<()> {
        check_single(tokens, start_pos, self.n_ctx, self.n_vocab())?;
        if self.model.hp.has_seq_state() && start_pos != 0 && start_pos != self.next_pos {
            return Err(EngineError::StateRewind {
                at: start_pos,
                next: self.next_pos,
            });
        }
        Ok(())
    }

    /// One single-sequence step over `tokens` at `start_pos..` with logits from index
    /// `logits_from` on.
    fn forward_single(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        logits_from: usize,
    ) -> Result<()> {
        let n_blocks = self.n_ctx / BLOCK_SIZE;
        self.batch.begin().push_seq(
            tokens,
            start_pos,
            Blocks::Identity(n_blocks),
            Some(logits_from),
        );
        self.forward_built()?;
        self.next_pos = start_pos + tokens.len();
        self.last_verify = None;
        self.eagle_absorb(start_pos, tokens.len())
    }

    /// Evaluates `tokens` at positions `start_pos..` (the KV before `start_pos` must hold the
    /// earlier tokens) and returns the wanted logits rows, `[rows, n_vocab]`.
    pub fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]> {
        self.check_tokens(tokens, start_pos)?;
        let nv = self.n_vocab();
        let first_wanted = want.first(tokens.len());
        self.logits.clear();
        let steps = single_steps(
            tokens.len(),
            first_wanted,
            self.n_batch,
            self.state.max_logits,
        );
        for (done, end, from) in steps {
            self.forward_single(&tokens[done..end], start_pos + done, from - done)?;
            let rows = end.saturating_sub(from);
            if rows > 0 {
                self.picker
                    .fetch(&self.backend, &self.state.logits, rows, nv, Fetch::Logits)
                    .map_err(ModelError::from)?;
                let host = &mut self.picker.host;
                if self.logits.is_empty() {
                    // The usual case (one step): take the rows without a second copy.
                    std::mem::swap(&mut self.logits, host);
                    self.logits.truncate(rows * nv);
                } else {
                    self.logits.extend_from_slice(&host[..rows * nv]);
                }
            }
        }
        Ok(&self.logits)
    }

    /// Evaluates `tokens` (the last step of a prompt, or one decode token) and picks the next
    /// token with `sampler` (`history`: the tokens so far).
    pub fn eval_pick(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        if tokens.len() > self.n_batch {
            // A long prompt: whole steps through `eval`, the last (shorter) one here, cut
            // where `eval` would cut it.
            let split = (tokens.len() - 1) / self.n_batch * self.n_batch;
            self.eval(&tokens[..split], start_pos, Want::Last)?;
            return self.eval_pick(&tokens[split..], start_pos + split, sampler, history);
        }
        self.check_tokens(tokens, start_pos)?;
        self.forward_single(tokens, start_pos, tokens.len() - 1)?;
        let how = Fetch::of(sampler.needs(), false);
        Ok(self
            .fetch(1, how)?
            .pick(0, sampler, history, None, None)
            .token)
    }

    /// Evaluates `tokens` (a token, then proposed ones) at `start_pos..` and picks each row's
    /// token in order with `sampler` as `eval_pick` would (`history`: the tokens so far, then
    /// the accepted picks), while the pick equals the next proposed token: `picks` gets the
    /// accepted proposals and the token after them. At most the state's logits rows.
    pub fn eval_verify(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
        picks: &mut Vec<u32>,
    ) -> Result<()> {
        self.check_tokens(tokens, start_pos)?;
        let rows = tokens.len();
        if rows > self.state.max_logits || rows > self.n_batch {
            return Err(ModelError::BatchTooLarge {
                got: rows,
                max: self.state.max_logits.min(self.n_batch),
            }
            .into());
        }
        // Decode rows, as the serving loop's proposals are (`SeqSpan::decode_from`): a backend
        // that routes rows by kind computes each as it computes a one-token decode step.
        let n_blocks = self.n_ctx / BLOCK_SIZE;
        self.batch
            .begin()
            .push_seq(tokens, start_pos, Blocks::Identity(n_blocks), Some(0))
            .decode_from(start_pos)
            .kept_slot(0);
        self.forward_built()?;
        self.next_pos = start_pos + rows;
        self.eagle_absorb(start_pos, rows)?;
        let how = Fetch::of(sampler.needs(), false);
        let picker = self.fetch(rows, how)?;
        verify_picks(tokens, history, picks, |j, h| {
            picker.pick(j, sampler, h, None, None).token
        });
        // A recurrent state returns to the state after the accepted rows.
        self.last_verify = Some((start_pos, rows));
        self.rewind(start_pos + picks.len())
    }

    /// Returns the sequence to position `pos` (the tokens before it kept): a model with a
    /// recurrent state goes back to its state after token `pos − 1`, which it keeps for the
    /// rows of the last verification (`eval_verify`) only; the KV of others needs nothing
    /// (later positions are written again).
    pub fn rewind(&mut self, pos: usize) -> Result<()> {
        if !self.model.hp.has_seq_state() || pos >= self.next_pos {
            return Ok(());
        }
        let Some((start, rows)) = self
            .last_verify
            .filter(|&(s, r)| pos > s && s + r == self.next_pos)
        else {
            return Err(EngineError::StateRewind {
                at: pos,
                next: self.next_pos,
            });
        };
        self.state.rewind(
            &self.backend,
            &self.model.hp,
            0,
            0,
            start,
            rows,
            pos - start - 1,
        )?;
        self.next_pos = pos;
        Ok(())
    }

    /// The last step's first `rows` final hidden states (`[rows, n_embd]`, see
    /// `State::hidden`), read back to the host.
    pub fn hidden(&mut self, rows: usize) -> Result<&[f32]> {
        let n = rows * self.model.hp.n_embd;
        self.backend
            .read(self.state.hidden(), n, &mut self.hidden)
            .map_err(ModelError::from)?;
        Ok(&self.hidden[..n])
    }

    /// The embedding of `tokens` as one sequence from position 0 (its KV overwritten), in
    /// steps of at most `n_batch` tokens: the serving loop's result for the same tokens.
    pub fn embed(&mut self, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        self.check_tokens(tokens, 0)?;
        let d = self.model.hp.n_embd;
        let mut pool = Pool::new(pooling);
        let mut done = 0;
        while done < tokens.len() {
            let end = (done + self.n_batch).min(tokens.len());
            self.forward_single(&tokens[done..end], done, end - done - 1)?;
            let h = self.hidden(end - done)?;
            for (k, row) in h.chunks(d).enumerate() {
                pool.add(done + k, tokens.len(), row);
            }
            done = end;
        }
        Ok(pool.finish())
    }

    /// Like `eval` with `Want::Last`, returning only the argmax of the last position's logits:
    /// the backend computes it, so a GPU sends back one id instead of the logits.
    pub fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        let mut greedy = Sampler::new(SamplerParams::greedy());
        self.eval_pick(tokens, start_pos, &mut greedy, &[])
    }
}

/// Tokens one sequence evaluates at `start_pos..`: not empty, within a context of `n_ctx`
/// positions and a vocabulary of `n_vocab` (a single-sequence session's check).
pub(crate) fn check_single(
    tokens: &[u32],
    start_pos: usize,
    n_ctx: usize,
    n_vocab: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if start_pos + tokens.len() > n_ctx {
        return Err(EngineError::ContextOverflow {
            prompt: start_pos + tokens.len(),
            gen: 0,
            ctx: n_ctx,
        });
    }
    match tokens.iter().find(|&&t| t as usize >= n_vocab) {
        Some(&id) => Err(EngineError::BadToken { id, n_vocab }),
        None => Ok(()),
    }
}

/// The steps of a single-sequence evaluation of `len` tokens whose rows from `first_wanted` on
/// are wanted: each `(done, end, from)`, tokens `done..end` with logits from row `from`, at
/// most `n_batch` tokens and `max_logits` wanted rows a step.
pub(crate) fn single_steps(
    len: usize,
    first_wanted: usize,
    n_batch: usize,
    max_logits: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let mut done = 0;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let mut end = (done + n_batch).min(len);
        let from = first_wanted.max(done);
        if from < end && end - from > max_logits {
            end = from + max_logits;
        }
        let step = (done, end, from);
        done = end;
        Some(step)
    })
}

/// A verification's picks (`eval_verify`): row j's token by `pick(j, history so far)`, in
/// order while it equals the next proposed token of `tokens`; `picks` gets the accepted
/// proposals and the token after them.
pub(crate) fn verify_picks(
    tokens: &[u32],
    history: &[u32],
    picks: &mut Vec<u32>,
    mut pick: impl FnMut(usize, &[u32]) -> u32,
) {
    let mut h = history.to_vec();
    picks.clear();
    for j in 0..tokens.len() {
        let t = pick(j, &h);
        picks.push(t);
        if tokens.get(j + 1) != Some(&t) {
            break;
        }
        h.push(t);
    }
}

/// A loaded model and one sequence, whatever the backend: what the CLI commands drive.
pub trait Session {
    /// See `ModelRunner::eval`.
    fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]>;
    /// See `ModelRunner::eval_argmax`.
    fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32>;
    /// See `ModelRunner::eval_pick`.
    fn eval_pick(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32>;
    /// See `ModelRunner::eval_verify`.
    fn eval_verify(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
        picks: &mut Vec<u32>,
    ) -> Result<()>;
    /// The most tokens `eval_verify` takes at once.
    fn max_verify(&self) -> usize;
    /// See `ModelRunner::keep_states` (for this one sequence).
    fn keep_states(&mut self, planes: usize) -> Result<usize>;
    /// See `ModelRunner::rewind`.
    fn rewind(&mut self, pos: usize) -> Result<()>;
    /// Loads an EAGLE-3 head (`head`) for this session's model (`target`, its file): see
    /// `ModelRunner::attach_eagle3`.
    fn attach_eagle3(&mut self, head: &Arc<GgufFile>, target: &Arc<GgufFile>) -> Result<()>;
    /// Loads the model's own multi-token-prediction block (`file`: the model's file): see
    /// `ModelRunner::attach_mtp`.
    fn attach_mtp(&mut self, file: &Arc<GgufFile>) -> Result<()>;
    /// With a head attached: up to `len` tokens after `tokens` (the sequence by position, the
    /// last one the token the next step computes) into `out`, stopping below `p_min`; without
    /// one, nothing.
    fn propose_head(
        &mut self,
        tokens: &[u32],
        len: usize,
        p_min: f32,
        out: &mut Vec<u32>,
    ) -> Result<()>;
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

impl<B: Backend> Session for ModelRunner<B> {
    fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]> {
        ModelRunner::eval(self, tokens, start_pos, want)
    }
    fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        ModelRunner::eval_argmax(self, tokens, start_pos)
    }
    fn eval_pick(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        ModelRunner::eval_pick(self, tokens, start_pos, sampler, history)
    }
    fn eval_verify(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
        picks: &mut Vec<u32>,
    ) -> Result<()> {
        ModelRunner::eval_verify(self, tokens, start_pos, sampler, history, picks)
    }
    fn max_verify(&self) -> usize {
        let rows = self.state.max_logits.min(self.n_batch);
        match self.model.hp.has_seq_state() {
            // A token and as many proposals as there are states to roll back to.
            true => rows.min(self.state.snap_planes + 1),
            false => rows,
        }
    }
    fn keep_states(&mut self, planes: usize) -> Result<usize> {
        ModelRunner::keep_states(self, planes, 1)
    }
    fn rewind(&mut self, pos: usize) -> Result<()> {
        ModelRunner::rewind(self, pos)
    }
    fn attach_eagle3(&mut self, head: &Arc<GgufFile>, target: &Arc<GgufFile>) -> Result<()> {
        self.whole_only("an EAGLE-3 head")?;
        ModelRunner::attach_eagle3(self, head, target)
    }
    fn attach_mtp(&mut self, file: &Arc<GgufFile>) -> Result<()> {
        self.whole_only("a multi-token-prediction block")?;
        ModelRunner::attach_mtp(self, file)
    }
    fn propose_head(
        &mut self,
        tokens: &[u32],
        len: usize,
        p_min: f32,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        self.eagle_propose(tokens, len, p_min, out)
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
        self.whole_only("the batched bench (--parallel)")?;
        batched_bench(
            &mut self.backend,
            &self.model,
            n_prompt,
            n_gen,
            parallel,
            step_tokens,
        )
    }
}
