//! Speculative decoding with an EAGLE-3 head (`--spec-type eagle3 -md HEAD`), or with the
//! target's own multi-token-prediction block (`--spec-type mtp`: the same flow, its g the
//! target's final hidden state, its own normed output the g it drafts on): the draft model's
//! side of it ([`crate::draft::DraftModel`] holds an [`Eagle`] beside the head).
//!
//! After each target step the head encodes the target's hidden states of the step's rows
//! (`State::features`, three layers side by side) into one g row per token and keeps them by
//! request and position ([`Eagle::absorb`]: a request's rows from a position on replace what
//! it kept from there, so the rows of rejected proposals are overwritten by the next step's).
//! When the scheduler plans a step, the head writes its KV for the positions it lacks — at
//! position P the pair (token P + 1, g of P), the last such pair's logits giving the first
//! proposal — for every request that proposes, and for the others once [`CATCH_UP_ROWS`] of
//! their rows wait (as many as the step holds; the rest the next time). Then it drafts one
//! position at a time, each drafted token at the next position with the head's own pre-norm
//! state as its g. The head's KV of drafted positions is written again from the target's
//! states once those positions are verified (`done` stays at the last position with a target
//! state).
//! Under load (more requests decoding than may propose, `SpecConfig::max_decoding`) the head
//! neither keeps states nor catches up: its cost stops with its proposals, and a request keeps
//! at most [`MAX_KEPT`] rows.

use crate::batch::{BatchBuilder, Blocks};
use crate::picker::{Fetch, Picker};
use crate::sampler::Sampler;
use crate::sched::SchedulerOutput;
use crate::spec::DraftJob;
use crate::types::Result;
use quiver_backend::Backend;
use quiver_models::{Model, ModelError, State};
use std::collections::HashMap;

/// The most rows a request keeps: beyond, the oldest go (their positions' KV in the head is
/// then never written: only acceptance suffers). A request's rows wait while it does not
/// propose in steps of more requests decoding than may.
const MAX_KEPT: usize = 4096;

/// A request that does not propose this step is caught up only once this many of its rows
/// wait (a paused request's rows go in with its next proposal, in one pass).
const CATCH_UP_ROWS: usize = 64;

/// A request's rows in a target step: its first position, and its rows of the step.
pub(crate) struct Span {
    pub id: u64,
    pub start_pos: usize,
    pub rows: std::ops::Range<usize>,
}

/// A request's g rows not yet in the head's KV: positions `first..first + rows`.
#[derive(Default)]
struct Rows {
    first: usize,
    g: Vec<f32>,
}

/// The head's per-request rows and its step buffers (kept: no allocation a step but growth).
#[derive(Default)]
pub(crate) struct Eagle {
    seqs: HashMap<u64, Rows>,
    /// The g rows of the step being built, and what the device sent back.
    feed: Vec<f32>,
    host: Vec<f32>,
    /// Per job: its last row in the step (-1: none), the jobs still drafting.
    last_row: Vec<Option<usize>>,
    active: Vec<usize>,
}

impl Eagle {
    /// Keeps the g of each row of the target's last step (`out`; the target's `state` kept
    /// the layers an EAGLE-3 head reads, or its hidden states for a multi-token-prediction
    /// block).
    pub(crate) fn absorb<B: Backend>(
        &mut self,
        b: &mut B,
        head: &Model<B>,
        hs: &mut State<B>,
        target: &State<B>,
        out: &SchedulerOutput,
    ) -> Result<()> {
        let spans = out.scheduled.iter().map(|s| Span {
            id: s.id,
            start_pos: s.start_pos,
            rows: s.tokens.0..s.tokens.1,
        });
        self.absorb_spans(b, head, hs, target, out.tokens.len(), spans)
    }

    /// [`Eagle::absorb`] of a step of `rows` rows whose requests are `spans`.
    pub(crate) fn absorb_spans<B: Backend>(
        &mut self,
        b: &mut B,
        head: &Model<B>,
        hs: &mut State<B>,
        target: &State<B>,
        rows: usize,
        spans: impl Iterator<Item = Span>,
    ) -> Result<()> {
        let feat = match head.head_reads_hidden() {
            true => Some(target.head_hidden()),
            false => target.features(),
        };
        let feat = feat.ok_or_else(|| ModelError::BadHparam {
            key: "eagle3".into(),
            detail: "the target keeps no hidden states for the head".into(),
        })?;
        if rows == 0 {
            return Ok(());
        }
        let d = head.head_width();
        // (The head's steps are as long as the target's.)
        head.head_encode(b, hs, feat, rows)?;
        head.head_g(b, hs, rows, &mut self.host)?;
        for s in spans {
            let r = self.seqs.entry(s.id).or_default();
            let kept = r.g.len() / d;
            if r.g.is_empty() || s.start_pos < r.first || s.start_pos > r.first + kept {
                // A new request, a recompute, or a gap (a prefix-cache hit): start here.
                r.first = s.start_pos;
                r.g.clear();
            } else {
                r.g.truncate((s.start_pos - r.first) * d);
            }
            r.g.extend_from_slice(&self.host[s.rows.start * d..s.rows.end * d]);
            let over = (r.g.len() / d).saturating_sub(MAX_KEPT);
            if over > 0 {
                r.g.drain(..over * d);
                r.first += over;
            }
        }
        Ok(())
    }

    /// A request that ended: its rows go.
    pub(crate) fn forget(&mut self, id: u64) {
        self.seqs.remove(&id);
    }

    /// Catches every job up with its kept rows and drafts for those with `len` > 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn propose<B: Backend>(
        &mut self,
        b: &mut B,
        head: &Model<B>,
        hs: &mut State<B>,
        batch: &mut BatchBuilder,
        picker: &mut Picker,
        greedy: &mut Sampler,
        target_vocab: usize,
        jobs: &mut [DraftJob<'_>],
    ) -> Result<()> {
        let d = head.head_width();
        let nv = head.hp.n_vocab;
        // A multi-token-prediction block's pair (token P + 1, h of P) is at position P + 1,
        // and position 0 holds (token 0, zeros), as llama.cpp's draft-mtp writes them.
        let shift = usize::from(head.head_reads_hidden());
        // 1. Each job's pairs (token P + 1, g of P) from `done` to the last kept position
        //    (which the last token follows), logits at the last where the job drafts.
        batch.begin();
        self.feed.clear();
        self.last_row.clear();
        let mut n = 0;
        for j in jobs.iter_mut() {
            self.last_row.push(None);
            let Some(r) = self.seqs.get_mut(&j.id) else {
                continue;
            };
            let kept_end = r.first + r.g.len() / d;
            // The pairs need the token after each position.
            let mut end = kept_end.min(j.tokens.len().saturating_sub(1));
            let from = (*j.done).max(r.first);
            if from >= end || (j.len == 0 && end - from < CATCH_UP_ROWS) {
                // Nothing new, or a request that does not propose now with few rows waiting:
                // they go in with its next proposal's pass (a paused request costs no pass).
                continue;
            }
            // (The zero pair first where a multi-token-prediction block starts a sequence.)
            let zero = usize::from(shift == 1 && from == 0);
            // What the step has room for; the rest waits for the next call.
            end = end.min(from + (hs.max_tokens - n).saturating_sub(zero));
            if end == from {
                continue;
            }
            let wants = j.len > 0 && end + 1 == j.tokens.len();
            let logits = wants.then_some(end - from - 1 + zero);
            batch
                .push_seq(
                    &j.tokens[from + 1 - zero..end + 1],
                    from + shift - zero,
                    Blocks::Table(j.blocks),
                    logits,
                )
                .state_slot(j.slot);
            self.feed.resize(self.feed.len() + zero * d, 0.0);
            self.feed
                .extend_from_slice(&r.g[(from - r.first) * d..(end - r.first) * d]);
            n += end - from + zero;
            if wants {
                self.last_row.pop();
                self.last_row.push(Some(n - 1));
            }
            *j.done = end;
            // The rows now in the KV go (the last kept one too: a later step's rows start
            // after it).
            r.g.drain(..(end - r.first) * d);
            r.first = end;
        }
        if n == 0 {
            return Ok(());
        }
        head.head_input(b, hs, &self.feed)?;
        head.forward(b, hs, batch.batch())?;
        // 2. Draft: each job still drafting feeds its token at the next position, with its
        //    last row's state as g (`Model::head_next_g`).
        self.active.clear();
        self.active
            .extend((0..jobs.len()).filter(|&k| self.last_row[k].is_some()));
        let mut rows = n;
        let mut drafted = 0;
        while !self.active.is_empty() {
            let probs = self.active.iter().any(|&k| jobs[k].p_min > 0.0);
            let how = if probs { Fetch::Logits } else { Fetch::Argmax };
            picker
                .fetch(b, &hs.logits, self.active.len(), nv, how)
                .map_err(ModelError::from)?;
            head.head_next_g(b, hs, rows, &mut self.host)?;
            batch.begin();
            self.feed.clear();
            let mut w = 0;
            for i in 0..self.active.len() {
                let k = self.active[i];
                let j = &mut jobs[k];
                let t = picker.pick(i, greedy, &[], None, None).token;
                let p = match picker.row(i) {
                    Some(row) => {
                        let max = row[t as usize];
                        1.0 / row.iter().map(|&l| (l - max).exp()).sum::<f32>()
                    }
                    None => 1.0,
                };
                let t = head.head_target_id(t);
                if p < j.p_min || t as usize >= target_vocab {
                    continue;
                }
                j.out.push(t);
                if j.out.len() >= j.len {
                    continue;
                }
                let row = self.last_row[k].expect("an active job's row");
                self.feed
                    .extend_from_slice(&self.host[row * d..(row + 1) * d]);
                // (The last pass's row was at done - 1 + drafted, shifted.)
                let pos = *j.done + drafted + shift;
                batch
                    .push_seq(&[t], pos, Blocks::Table(j.blocks), Some(0))
                    .state_slot(j.slot);
                self.last_row[k] = Some(w);
                self.active[w] = k;
                w += 1;
            }
            self.active.truncate(w);
            if w == 0 {
                break;
            }
            head.head_input(b, hs, &self.feed)?;
            head.forward(b, hs, batch.batch())?;
            rows = w;
            drafted += 1;
        }
        Ok(())
    }
}
