//! The draft model of speculative decoding (`-md`): a second, smaller model of the target's
//! vocabulary on the target's backend (the same device), proposing greedily.
//!
//! Its KV cache is a second pool with the target's block numbering: the serving loop sizes it
//! at the target pool's block count, and a sequence's block table addresses both, so the
//! scheduler's one block manager allocates, frees and shares blocks for the two models at once
//! (a block's memory is the target's K/V plus the draft's; `quiver serve` divides its KV
//! budget by the sum and logs both). The scheduler keeps per sequence how many of its tokens
//! the draft's KV holds; before drafting the draft computes the rest (the prompt the first
//! time, then the tokens accepted since), then one token at a time. The draft's K/V never
//! decide a token — the target verifies every proposal — so blocks a prefix-cache hit shares
//! are rewritten with the draft's K/V of the same tokens, and a wrong entry only costs
//! acceptance.

use crate::batch::{BatchBuilder, Blocks};
use crate::picker::{Fetch, Picker};
use crate::sampler::{Sampler, SamplerParams};
use crate::spec::Drafter;
use crate::types::{EngineError, Result};
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use quiver_models::{Model, ModelError, State};
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

/// Vocabularies may differ in size by this many tokens (padding rows), as llama.cpp allows.
const VOCAB_SIZE_SLACK: usize = 128;

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
    /// Proposals stop before a token the target's vocabulary does not have.
    target_vocab: usize,
    /// The first error a draft step met (the serving loop fails its step with it).
    error: Option<EngineError>,
}

impl<B: Backend> DraftModel<B> {
    /// Loads the draft on `backend` with a KV cache of `n_slots` positions and steps of at most
    /// `n_batch` tokens.
    pub fn load(
        backend: &B,
        file: &Arc<GgufFile>,
        n_slots: usize,
        n_batch: usize,
        kv: quiver_backend::KvTypes,
        target_vocab: usize,
    ) -> Result<Self> {
        let mut model = quiver_models::load(backend, file)?;
        model.for_context(n_slots);
        model.set_kv_types(kv)?;
        let n_batch = n_batch.max(1);
        let state = model.state(backend, n_slots, n_batch, 1)?;
        Ok(DraftModel {
            model,
            state,
            batch: BatchBuilder::default(),
            picker: Picker::default(),
            greedy: Sampler::new(SamplerParams::greedy()),
            n_batch,
            target_vocab,
            error: None,
        })
    }

    /// The error a draft step met since the last call, if any.
    pub fn take_error(&mut self) -> Option<EngineError> {
        self.error.take()
    }

    /// One step: `tokens` at `start_pos..`, the last row's logits kept.
    fn forward(
        &mut self,
        b: &mut B,
        tokens: &[u32],
        start_pos: usize,
        blocks: Blocks,
    ) -> Result<()> {
        let batch = self
            .batch
            .begin()
            .push_seq(tokens, start_pos, blocks, Some(tokens.len() - 1))
            .batch();
        self.model.forward(b, &mut self.state, batch)?;
        Ok(())
    }

    /// The last step's top token and (with `p_min` above 0) its probability.
    fn top(&mut self, b: &B, p_min: f32) -> Result<(u32, f32)> {
        let nv = self.model.hp.n_vocab;
        let how = if p_min > 0.0 {
            Fetch::Logits
        } else {
            Fetch::Argmax
        };
        self.picker
            .fetch(b, &self.state.logits, 1, nv, how)
            .map_err(ModelError::from)?;
        let token = self.picker.pick(0, &mut self.greedy, &[], None, None).token;
        let p = match self.picker.row(0) {
            Some(row) => {
                let max = row[token as usize];
                1.0 / row.iter().map(|&l| (l - max).exp()).sum::<f32>()
            }
            None => 1.0,
        };
        Ok((token, p))
    }

    /// Proposes up to `len` tokens after `tokens` into `out` (see [`Drafter::draft`]), its KV
    /// in `blocks`.
    #[allow(clippy::too_many_arguments)]
    pub fn propose(
        &mut self,
        b: &mut B,
        tokens: &[u32],
        done: &mut usize,
        blocks: Blocks,
        len: usize,
        p_min: f32,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        if len == 0 || tokens.is_empty() {
            return Ok(());
        }
        // The tokens its KV lacks (at least the last, whose logits give the first proposal).
        let mut d = (*done).min(tokens.len() - 1);
        *done = d;
        while d < tokens.len() {
            let end = (d + self.n_batch).min(tokens.len());
            self.forward(b, &tokens[d..end], d, blocks)?;
            d = end;
            *done = d;
        }
        loop {
            let (t, p) = self.top(b, p_min)?;
            if p < p_min || t as usize >= self.target_vocab {
                return Ok(());
            }
            out.push(t);
            if out.len() == len {
                return Ok(());
            }
            self.forward(b, &[t], *done, blocks)?;
            *done += 1;
        }
    }
}

/// The serving loop's drafter: the draft model on the target's backend.
pub(crate) struct OnBackend<'a, B: Backend> {
    pub backend: &'a mut B,
    pub draft: &'a mut DraftModel<B>,
}

impl<B: Backend> Drafter for OnBackend<'_, B> {
    fn draft(
        &mut self,
        tokens: &[u32],
        done: &mut usize,
        blocks: &[u32],
        len: usize,
        p_min: f32,
        out: &mut Vec<u32>,
    ) {
        if self.draft.error.is_some() {
            out.clear();
            return;
        }
        let r = self.draft.propose(
            self.backend,
            tokens,
            done,
            Blocks::Table(blocks),
            len,
            p_min,
            out,
        );
        if let Err(e) = r {
            out.clear();
            *done = 0;
            self.draft.error = Some(e);
        }
    }
}
