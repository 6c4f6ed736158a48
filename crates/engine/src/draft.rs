//! The draft model of speculative decoding (`-md`): a second, smaller model of the target's
//! vocabulary on the target's backend (the same device), proposing greedily.
//!
//! Its KV cache is a second pool with the target's block numbering: the serving loop sizes it
//! at the target pool's block count, and a sequence's block table addresses both, so the
//! scheduler's one block manager allocates, frees and shares blocks for the two models at once
//! (a block's memory is the target's K/V plus the draft's; `quiver serve` divides its KV
//! budget by the sum and logs both). The scheduler keeps per sequence how many of its tokens
//! the draft's KV holds; each step the draft computes the rest for every request that
//! proposes (the prompt the first time, then the tokens accepted since), then proposes one
//! position at a time, a forward pass with a row per request still drafting. The draft's K/V
//! never decide a token — the target verifies every proposal — so blocks a prefix-cache hit
//! shares are rewritten with the draft's K/V of the same tokens, and a wrong entry only costs
//! acceptance.

use crate::batch::{BatchBuilder, Blocks};
use crate::picker::{Fetch, Picker};
use crate::sampler::{Sampler, SamplerParams};
use crate::spec::{DraftJob, Drafter};
use crate::types::{EngineError, Result};
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use quiver_models::{Model, ModelError, State};
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

/// Vocabularies may differ in size by this many tokens (padding rows), as llama.cpp allows.
const VOCAB_SIZE_SLACK: usize = 128;

/// A draft model's state must roll back past a rejected proposal: one with recurrent layers
/// (Qwen 3.5's gated delta net) is refused.
pub fn check_rollback(draft: &GgufFile) -> std::result::Result<(), String> {
    let hp = quiver_models::hparams(draft).map_err(|e| format!("the draft model: {e}"))?;
    if hp.layers.iter().any(|l| l.recurrent) {
        return Err("the draft model has recurrent layers, whose state cannot be rolled back after a rejected proposal: choose a draft without them".into());
    }
    Ok(())
}

/// Whether the draft's vocabulary is the target's: the same text for every token id both
/// have, sizes within [`VOCAB_SIZE_SLACK`]. Err: one line saying where they differ.
pub fn check_vocab(target: &GgufFile, draft: &GgufFile) -> std::result::Result<(), String> {
    let tok = |f: &GgufFile, what: &str| {
        Tokenizer::from_gguf(f).map_err(|e| format!("the {what} model's tokenizer: {e}"))
    };
    let (t, d) = (tok(target, "target")?, tok(draft, "draft")?);
    let (nt, nd) = (t.n_vocab(), d.n_vocab());
    if nt.abs_diff(nd) > VOCAB_SIZE_SLACK {
        return Err(format!(
            "the draft model's vocabulary has {nd} tokens, the target's {nt}: not the same vocabulary"
        ));
    }
    if t.kind() != d.kind() {
        return Err(format!(
            "the draft model's tokenizer is {:?}, the target's {:?}: not the same vocabulary",
            d.kind(),
            t.kind()
        ));
    }
    for id in 0..nt.min(nd) as u32 {
        let (a, b) = (t.token_bytes(id), d.token_bytes(id));
        if a != b {
            let show = |x: Option<&[u8]>| {
                x.map_or("none".into(), |x| {
                    format!("{:?}", String::from_utf8_lossy(x))
                })
            };
            return Err(format!(
                "token {id} is {} in the draft model's vocabulary, {} in the target's: not the same vocabulary",
                show(b),
                show(a)
            ));
        }
    }
    Ok(())
}

/// A draft model, its buffers and its KV cache.
pub struct DraftModel<B: Backend> {
    model: Model<B>,
    state: State<B>,
    batch: BatchBuilder,
    picker: Picker,
    greedy: Sampler,
    n_batch: usize,
    /// Sequences drafted together (logits rows per step).
    max_rows: usize,
    /// Proposals stop before a token the target's vocabulary does not have.
    target_vocab: usize,
    /// The first error a draft step met (the serving loop fails its step with it).
    error: Option<EngineError>,
    /// The jobs still drafting and the token each feeds next (kept: no allocation a step).
    active: Vec<usize>,
    feed: Vec<u32>,
    /// A draft head's side (`--spec-type eagle3`, `mtp`).
    eagle: Option<crate::eagle::Eagle>,
}

impl<B: Backend> DraftModel<B> {
    /// Loads the draft on `backend` with a KV cache of `n_slots` positions, steps of at most
    /// `n_batch` tokens, and `max_rows` sequences drafted at once.
    pub fn load(
        backend: &B,
        file: &Arc<GgufFile>,
        n_slots: usize,
        n_batch: usize,
        max_rows: usize,
        kv: quiver_backend::KvTypes,
        target_vocab: usize,
    ) -> Result<Self> {
        let model = quiver_models::load(backend, file)?;
        Self::with_model(backend, model, n_slots, n_batch, max_rows, kv, target_vocab)
    }

    /// Loads an EAGLE-3 head for `target` (whose runner must then keep the layers
    /// [`DraftModel::eagle3_layers`] names), as [`DraftModel::load`].
    #[allow(clippy::too_many_arguments)]
    pub fn load_eagle3(
        backend: &B,
        file: &Arc<GgufFile>,
        target: &Arc<GgufFile>,
        n_slots: usize,
        n_batch: usize,
        max_rows: usize,
        kv: quiver_backend::KvTypes,
        target_vocab: usize,
    ) -> Result<Self> {
        let model = quiver_models::load_eagle3(backend, file, target)?;
        let mut d = Self::with_model(backend, model, n_slots, n_batch, max_rows, kv, target_vocab)?;
        d.eagle = Some(Default::default());
        Ok(d)
    }

    /// A multi-token-prediction block (of `file`: the target's own, or a sidecar of the block
    /// alone) as a draft head for a target of `target_vocab` tokens, as [`DraftModel::load`].
    #[allow(clippy::too_many_arguments)]
    pub fn load_mtp(
        backend: &B,
        file: &Arc<GgufFile>,
        n_slots: usize,
        n_batch: usize,
        max_rows: usize,
        kv: quiver_backend::KvTypes,
        target_vocab: usize,
    ) -> Result<Self> {
        let model = quiver_models::mtp::load(backend, file)?;
        let nv = model.hp.n_vocab;
        if nv != target_vocab {
            return Err(EngineError::Draft(format!(
                "the multi-token-prediction block has {nv} tokens, the target {target_vocab}"
            )));
        }
        let mut d = Self::with_model(backend, model, n_slots, n_batch, max_rows, kv, nv)?;
        d.eagle = Some(Default::default());
        Ok(d)
    }

    /// The target layers an EAGLE-3 head reads (None: a draft model).
    pub fn eagle3_layers(&self) -> Option<[usize; 3]> {
        self.model.hp.eagle3.as_ref().map(|e| e.target_layers)
    }

    /// A draft head (EAGLE-3, multi-token prediction) keeps the g of the target's last step
    /// (`out`, run over `target`).
    pub fn absorb(
        &mut self,
        b: &mut B,
        target: &State<B>,
        out: &crate::sched::SchedulerOutput,
    ) -> Result<()> {
        match self.eagle.as_mut() {
            Some(e) => e.absorb(b, &self.model, &mut self.state, target, out),
            None => Ok(()),
        }
    }

    /// [`DraftModel::absorb`] of a single-sequence step: `rows` rows at `start_pos..`, as
    /// sequence 0.
    pub(crate) fn absorb_one(
        &mut self,
        b: &mut B,
        target: &State<B>,
        start_pos: usize,
        rows: usize,
    ) -> Result<()> {
        let Some(e) = self.eagle.as_mut() else {
            return Ok(());
        };
        let span = crate::eagle::Span {
            id: 0,
            start_pos,
            rows: 0..rows,
        };
        e.absorb_spans(
            b,
            &self.model,
            &mut self.state,
            target,
            rows,
            std::iter::once(span),
        )
    }

    /// A request ended: what the draft kept for it goes.
    pub fn forget(&mut self, id: u64) {
        if let Some(e) = self.eagle.as_mut() {
            e.forget(id);
        }
    }

    fn with_model(
        backend: &B,
        mut model: Model<B>,
        n_slots: usize,
        n_batch: usize,
        max_rows: usize,
        kv: quiver_backend::KvTypes,
        target_vocab: usize,
    ) -> Result<Self> {
        model.for_context(n_slots);
        model.set_kv_types(kv)?;
        // A head with a per-sequence state (DeepSeek-V4's block) uses the target's slots.
        model.set_max_seqs(max_rows);
        let n_batch = n_batch.max(1);
        // A power of two: a drafting step's rows then fit a CUDA graph bucket.
        let max_rows = max_rows.next_power_of_two().clamp(1, n_batch);
        let state = model.state(backend, n_slots, n_batch, max_rows)?;
        Ok(DraftModel {
            model,
            state,
            batch: BatchBuilder::default(),
            picker: Picker::default(),
            greedy: Sampler::new(SamplerParams::greedy()),
            n_batch,
            max_rows,
            target_vocab,
            error: None,
            active: Vec::with_capacity(max_rows),
            feed: Vec::with_capacity(max_rows),
            eagle: None,
        })
    }

    /// The error a draft step met since the last call, if any.
    pub fn take_error(&mut self) -> Option<EngineError> {
        self.error.take()
    }

    /// Runs the batch built since `batch.begin()`.
    fn forward(&mut self, b: &mut B) -> Result<()> {
        let batch = self.batch.batch();
        self.model.forward(b, &mut self.state, batch)?;
        Ok(())
    }

    /// Drafts for every job (see [`DraftJob`]): the tokens their KV lacks first (packed into
    /// steps of `n_batch` tokens), then one step per proposed position with a row for each
    /// job still drafting.
    pub fn propose(&mut self, b: &mut B, jobs: &mut [DraftJob<'_>]) -> Result<()> {
        for j in jobs.iter_mut() {
            j.out.clear();
        }
        if let Some(e) = self.eagle.as_mut() {
            // Every job at once: the catching up is one step (the proposals' rows are few).
            let (hs, batch, picker) = (&mut self.state, &mut self.batch, &mut self.picker);
            let (greedy, tv) = (&mut self.greedy, self.target_vocab);
            return e.propose(b, &self.model, hs, batch, picker, greedy, tv, jobs);
        }
        let rows = self.max_rows;
        for group in jobs.chunks_mut(rows) {
            self.propose_group(b, group)?;
        }
        Ok(())
    }

    fn propose_group(&mut self, b: &mut B, jobs: &mut [DraftJob<'_>]) -> Result<()> {
        if jobs.iter().all(|j| j.len == 0) {
            return Ok(());
        }
        // 1. Each sequence's tokens but the last, where the draft's KV lacks them.
        self.batch.begin();
        let mut n = 0;
        for j in jobs.iter_mut().filter(|j| !j.tokens.is_empty()) {
            let end = j.tokens.len() - 1;
            let mut d = (*j.done).min(end);
            while d < end {
                let take = (end - d).min(self.n_batch - n);
                self.batch
                    .push_seq(&j.tokens[d..d + take], d, Blocks::Table(j.blocks), None);
                (n, d) = (n + take, d + take);
                if n == self.n_batch {
                    self.forward(b)?;
                    self.batch.begin();
                    n = 0;
                }
            }
            *j.done = end;
        }
        if n > 0 {
            self.forward(b)?;
        }
        // 2. The last token, then each proposed one, a row per sequence still drafting.
        let (mut active, mut feed) = (
            std::mem::take(&mut self.active),
            std::mem::take(&mut self.feed),
        );
        active.clear();
        active.extend((0..jobs.len()).filter(|&k| jobs[k].len > 0 && !jobs[k].tokens.is_empty()));
        feed.clear();
        feed.extend(
            active
                .iter()
                .map(|&k| jobs[k].tokens[jobs[k].tokens.len() - 1]),
        );
        let nv = self.model.hp.n_vocab;
        while !active.is_empty() {
            self.batch.begin();
            for (i, &k) in active.iter().enumerate() {
                let j = &jobs[k];
                self.batch
                    .push_seq(&feed[i..i + 1], *j.done, Blocks::Table(j.blocks), Some(0));
            }
            self.forward(b)?;
            let probs = active.iter().any(|&k| jobs[k].p_min > 0.0);
            let how = if probs { Fetch::Logits } else { Fetch::Argmax };
            self.picker
                .fetch(b, &self.state.logits, active.len(), nv, how)
                .map_err(ModelError::from)?;
            // The jobs that go on, compacted in place (row i is read before slot i is
            // written: w ≤ i).
            let mut w = 0;
            for i in 0..active.len() {
                let k = active[i];
                let j = &mut jobs[k];
                *j.done += 1;
                let t = self.picker.pick(i, &mut self.greedy, &[], None, None).token;
                let p = match self.picker.row(i) {
                    Some(row) => {
                        let max = row[t as usize];
                        1.0 / row.iter().map(|&l| (l - max).exp()).sum::<f32>()
                    }
                    None => 1.0,
                };
                if p < j.p_min || t as usize >= self.target_vocab {
                    continue;
                }
                j.out.push(t);
                if j.out.len() < j.len {
                    (active[w], feed[w]) = (k, t);
                    w += 1;
                }
            }
            active.truncate(w);
            feed.truncate(w);
        }
        // (An error above drops them: the next call makes them again.)
        (self.active, self.feed) = (active, feed);
        Ok(())
    }
}

/// The serving loop's drafter: the draft model on the target's backend.
pub(crate) struct OnBackend<'a, B: Backend> {
    pub backend: &'a mut B,
    pub draft: &'a mut DraftModel<B>,
}

impl<B: Backend> Drafter for OnBackend<'_, B> {
    fn draft(&mut self, jobs: &mut [DraftJob<'_>]) {
        if self.draft.error.is_some() {
            jobs.iter_mut().for_each(|j| j.out.clear());
            return;
        }
        if let Err(e) = self.draft.propose(self.backend, jobs) {
            for j in jobs.iter_mut() {
                j.out.clear();
                *j.done = 0;
            }
            self.draft.error = Some(e);
        }
    }
}
