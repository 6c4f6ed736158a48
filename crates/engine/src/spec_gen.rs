//! Speculative decoding for one sequence (`quiver run`, `quiver chat`): the proposer of
//! [`crate::spec`] (prompt lookup, a draft model as a second [`Session`] on the target's
//! device, or a draft head the target's session holds: `Session::attach_eagle3`,
//! `Session::attach_mtp`) and the same verification as the serving loop's, through
//! [`Session::eval_verify`]: the target scores the last token and the proposal in one step
//! and each row's token is picked with the request's sampler while it equals the proposal,
//! so the tokens are those of plain decoding, greedy or seeded.

use crate::runner::{Session, Want};
use crate::spec::{ngram_propose, SpecConfig, SpecState, SpecType};
use crate::spec_cost::StepCost;
use crate::types::Result;

/// A sequence's proposer and policy, kept from call to call of `generate_spec` (a chat's
/// turns), with the tokens at the target's KV positions so far.
pub struct Speculator<'a> {
    cfg: SpecConfig,
    draft: Option<&'a mut dyn Session>,
    /// The sequence's tokens by position (what the target's KV holds, then the next token).
    pub(crate) seq: Vec<u32>,
    /// Tokens whose K/V the draft holds (a prefix of `seq`).
    draft_done: usize,
    policy: SpecState,
    /// The sequence's step times by rows, for what a proposal costs.
    cost: StepCost,
    /// Tokens proposed and accepted, and steps that verified a proposal, so far.
    pub proposed: u64,
    pub accepted: u64,
    pub steps: u64,
}

impl<'a> Speculator<'a> {
    /// `draft` is the draft model's session for [`SpecType::Draft`] (its context at least the
    /// target's), None for prompt lookup.
    pub fn new(cfg: SpecConfig, draft: Option<&'a mut dyn Session>) -> Speculator<'a> {
        Speculator {
            cfg,
            draft,
            seq: Vec::new(),
            draft_done: 0,
            policy: SpecState::default(),
            cost: StepCost::default(),
            proposed: 0,
            accepted: 0,
            steps: 0,
        }
    }

    /// A new call's prompt at `start_pos` (the target's KV holds the positions before it).
    pub(crate) fn begin(&mut self, prompt: &[u32], start_pos: usize) {
        if self.seq.len() < start_pos {
            // Earlier positions this speculator never saw: the draft cannot know them.
            self.draft = None;
        }
        self.seq.truncate(start_pos);
        self.seq.extend_from_slice(prompt);
        self.draft_done = self.draft_done.min(start_pos);
    }

    /// Proposal length for the next step, within `room` (0: none).
    pub(crate) fn next_len(&mut self, room: usize) -> usize {
        if !self.cfg.on() {
            return 0;
        }
        self.policy
            .next_len(self.cfg.draft_max, 1, &self.cost)
            .min(room)
    }

    /// A step of `rows` rows (the last token and the proposal) took `secs`, its proposing
    /// included.
    pub(crate) fn timed(&mut self, rows: usize, secs: f64) {
        if self.cfg.timed {
            self.cost.record(rows, secs);
        }
    }

    /// Up to `len` tokens after `seq` into `out` (`target`: the model, whose draft head
    /// proposes for [`SpecType::Eagle3`] and [`SpecType::Mtp`]).
    pub(crate) fn propose(
        &mut self,
        target: &mut (impl Session + ?Sized),
        len: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        if len == 0 {
            return Ok(());
        }
        let n_vocab = target.n_vocab();
        match self.cfg.kind {
            SpecType::None => {}
            SpecType::Eagle3 | SpecType::Mtp => {
                target.propose_head(&self.seq, len, self.cfg.p_min, out)?;
            }
            SpecType::Ngram => out.extend_from_slice(ngram_propose(
                &self.seq,
                self.cfg.ngram_max,
                self.cfg.ngram_min,
                len,
            )),
            SpecType::Draft => {
                let Some(d) = self.draft.as_deref_mut() else {
                    return Ok(());
                };
                let p_min = self.cfg.p_min;
                // The tokens its KV lacks, at least the last.
                let from = self.draft_done.min(self.seq.len() - 1);
                self.draft_done = from;
                let mut top = draft_top(d, &self.seq[from..], from, p_min)?;
                self.draft_done = self.seq.len();
                while top.1 >= p_min && (top.0 as usize) < n_vocab {
                    out.push(top.0);
                    if out.len() == len {
                        break;
                    }
                    top = draft_top(d, &[top.0], self.draft_done, p_min)?;
                    self.draft_done += 1;
                }
            }
        }
        if out.len() < self.cfg.draft_min.max(1) {
            out.clear();
        }
        Ok(())
    }

    /// A step's result: `accepted` of `proposed`, the target's KV now holding `kv` positions.
    pub(crate) fn record(&mut self, proposed: usize, accepted: usize, kv: usize) {
        self.policy.record(proposed, accepted, self.cfg.draft_max);
        self.proposed += proposed as u64;
        self.accepted += accepted as u64;
        self.steps += 1;
        self.draft_done = self.draft_done.min(kv);
    }
}

/// The draft's top token after `tokens` at `pos..`, and its probability (1 when `p_min` is 0:
/// then only the argmax is read back).
fn draft_top(d: &mut dyn Session, tokens: &[u32], pos: usize, p_min: f32) -> Result<(u32, f32)> {
    if p_min <= 0.0 {
        return Ok((d.eval_argmax(tokens, pos)?, 1.0));
    }
    let row = d.eval(tokens, pos, Want::Last)?;
    let token = crate::sampler::argmax(row);
    let max = row[token as usize];
    let p = 1.0 / row.iter().map(|&l| (l - max).exp()).sum::<f32>();
    Ok((token, p))
}
