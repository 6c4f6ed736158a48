//! The runner stage of a serving step: the forward pass over the scheduled rows (the
//! constrained requests' masks computed on worker threads meanwhile), the embedding requests'
//! rows pooled, the logits read back as the step's rows need them, and each sampling row's
//! token picked with its request's sampler under its constraint's mask; the constrained
//! requests' matchers then take their tokens. It sends no event: what it produced
//! ([`ModelOutput`]) goes to `Scheduler::update` and the output stage.

use crate::constraint::Constraint;
use crate::phases::{Phase, Phases};
use crate::picker::{Fetch, Mask, Picker};
use crate::runner::ModelRunner;
use crate::sampler::logprobs;
use crate::sched::{Scheduler, SchedulerOutput};
use crate::serving::live::{Live, Requests};
use crate::types::{EngineError, TokenLogprob};
use crate::workers::Workers;
use quiver_backend::reference::mask_row;
use quiver_backend::Backend;
use std::collections::HashMap;

/// What a step's forward pass and picks produced. Kept from step to step (its vectors reused).
#[derive(Default)]
pub(crate) struct ModelOutput {
    /// The step's sampling rows, (request, logits row), in schedule order: one per request,
    /// or with a proposal one per proposed token and one more.
    pub rows: Vec<(u64, usize)>,
    /// Each row's proposed token (`rows`' index), which its pick is checked against.
    pub proposed: Vec<Option<u32>>,
    /// (request, token) of each row picked, in row order: `Scheduler::update`'s input.
    pub sampled: Vec<(u64, u32)>,
    /// The log-probabilities of each of `sampled`, where its request asked for them.
    pub logprobs: Vec<Option<TokenLogprob>>,
    /// The embedding requests whose prompt ended this step, with their vectors.
    pub embeddings: Vec<(u64, Vec<f32>)>,
}

/// A constrained request's next mask (as bits), or why its matcher failed.
type Masks = HashMap<u64, Result<Vec<u32>, String>>;

/// The model runner with what the serving loop adds around it: the constraint workers and
/// the step's output.
pub(crate) struct StepRunner<B: Backend> {
    runner: ModelRunner<B>,
    /// Threads for the constraints' work, started with the first constrained request.
    workers: Option<Workers>,
    out: ModelOutput,
}

impl<B: Backend> StepRunner<B> {
    pub fn new(runner: ModelRunner<B>) -> Self {
        StepRunner {
            runner,
            workers: None,
            out: ModelOutput::default(),
        }
    }

    /// The target's backend (the draft model runs on it too).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.runner.backend
    }

    /// The backend and the target's buffers after a step (an EAGLE-3 head reads them).
    /// Returns the recurrent state of every request whose step's proposals were not all
    /// accepted to the state after its accepted ones (the step's picks: one per accepted
    /// proposal and one more). Models without a recurrent state need nothing.
    fn roll_back(&mut self, out: &SchedulerOutput) -> Result<(), EngineError> {
        let (r, sampled) = (&mut self.runner, &self.out.sampled);
        if !r.model.hp.has_seq_state() {
            return Ok(());
        }
        let kept = crate::batch::kept_slots(out);
        for (s, k) in out.scheduled.iter().zip(kept).filter(|(s, _)| s.draft > 0) {
            let picks = sampled.iter().filter(|x| x.0 == s.id).count();
            let accepted = picks.saturating_sub(1).min(s.draft);
            let len = s.n_tokens();
            r.state.rewind(
                &r.backend,
                &r.model.hp,
                s.state_slot as usize,
                k as usize,
                s.start_pos,
                len,
                len - 1 - (s.draft - accepted),
            )?;
        }
        Ok(())
    }

    pub fn backend_and_state(&mut self) -> (&mut B, &quiver_models::State<B>) {
        (&mut self.runner.backend, &self.runner.state)
    }

    /// Runs the scheduled step `out` and picks its tokens (`sched` gives each request's
    /// tokens so far). Err: the forward pass or a constraint worker failed, and the step fails
    /// with every request in it.
    pub fn execute(
        &mut self,
        out: &SchedulerOutput,
        sched: &Scheduler,
        reqs: &mut Requests,
        phases: &mut Phases,
    ) -> Result<&mut ModelOutput, EngineError> {
        let masks = self.forward(out, reqs)?;
        phases.mark(Phase::ForwardAndMasks);
        self.pool_embeddings(out, reqs)?;
        let (n_rows, how) = self.plan_rows(out, reqs);
        self.mask_on_device(reqs, &masks)?;
        phases.mark(Phase::DeviceMasks);
        let picker = self.runner.fetch(n_rows, how)?;
        phases.mark(Phase::Fetch);
        prompt_logprobs(out, sched, reqs, picker);
        let commits = pick(picker, sched, reqs, &masks, &mut self.out);
        phases.mark(Phase::Pick);
        self.commit(commits, reqs)?;
        self.roll_back(out)?;
        phases.mark(Phase::Constraints);
        Ok(&mut self.out)
    }

    /// The constrained requests take their tokens (a matcher takes ~10 µs a token over a
    /// large vocabulary: beyond 16, on the workers); one whose matcher fails leaves
    /// `sampled` and ends as one whose mask failed.
    fn commit(&mut self, commits: Vec<(u64, u32)>, reqs: &mut Requests) -> Result<(), EngineError> {
        let take = |(id, mut c, t): (u64, Constraint, u32)| {
            let ok = c.commit(t).is_ok();
            (id, c, ok)
        };
        let (_, took) = on_workers(&mut self.workers, &mut reqs.live, commits, 16, take, || ())?;
        for (id, _) in took.into_iter().filter(|t| !t.1) {
            if let Some(i) = self.out.sampled.iter().position(|s| s.0 == id) {
                self.out.sampled.remove(i);
                self.out.logprobs.remove(i);
            }
            reqs.dead.push(id);
        }
        Ok(())
    }

    /// The forward pass, with the masks of the constrained requests that sample this step
    /// computed on the workers meanwhile (they depend only on the tokens taken so far).
    fn forward(
        &mut self,
        out: &SchedulerOutput,
        reqs: &mut Requests,
    ) -> Result<Masks, EngineError> {
        let nv = self.runner.n_vocab() as u32;
        let jobs: Vec<(u64, u32)> = reqs
            .live
            .iter()
            .filter(|(_, l)| l.constraint.is_some())
            .filter(|(id, _)| out.scheduled.iter().any(|s| s.sample && s.id == **id))
            .map(|(id, _)| (*id, nv))
            .collect();
        let mask = |(id, mut c, nv): (u64, Constraint, u32)| {
            let m = c.next_mask(nv as usize);
            (id, c, m)
        };
        let runner = &mut self.runner;
        let (r, masks) = on_workers(&mut self.workers, &mut reqs.live, jobs, 0, mask, || {
            runner.execute(out)
        })?;
        r?;
        Ok(masks.into_iter().collect())
    }

    /// Embedding requests: their rows' hidden states pooled; at the prompt's end (the row that
    /// would sample) the vector goes to `ModelOutput::embeddings`.
    fn pool_embeddings(
        &mut self,
        out: &SchedulerOutput,
        reqs: &mut Requests,
    ) -> Result<(), EngineError> {
        self.out.embeddings.clear();
        // A preempted request is computed again from its first token: its pool starts over.
        for id in &out.preempted {
            if let Some(p) = reqs.live.get_mut(id).and_then(|l| l.pool.as_mut()) {
                p.reset();
            }
        }
        // Rows up to the last embedding request's are read back, no further.
        let (mut end, mut r) = (0, 0);
        for s in &out.scheduled {
            r += s.n_tokens();
            if reqs.embeds(s.id) {
                end = r;
            }
        }
        if end == 0 {
            return Ok(());
        }
        let d = self.runner.model.hp.n_embd;
        let hidden = self.runner.hidden(end)?;
        let mut r0 = 0;
        for s in &out.scheduled {
            let (r, n) = (r0, s.n_tokens());
            r0 += n;
            let Some(l) = reqs.live.get_mut(&s.id) else {
                continue;
            };
            let len = l.counts.prompt_tokens;
            let Some(pool) = l.pool.as_mut() else {
                continue;
            };
            for k in 0..n {
                pool.add(s.start_pos + k, len, &hidden[(r + k) * d..][..d]);
            }
            if s.sample {
                self.out.embeddings.push((s.id, pool.finish()));
            }
        }
        Ok(())
    }

    /// The step's sampling rows (into `ModelOutput::rows`), how many logits rows it has, and
    /// what they need from the logits, merged: plain greedy rows need the device's argmax,
    /// top-k-only rows its k best (a GPU sends back k pairs per row); prompt rows and
    /// log-probabilities need every logit.
    fn plan_rows(&mut self, out: &SchedulerOutput, reqs: &Requests) -> (usize, Fetch) {
        let (rows, proposed) = (&mut self.out.rows, &mut self.out.proposed);
        rows.clear();
        proposed.clear();
        let mut n_rows = 0;
        let mut how = Fetch::Argmax;
        for s in &out.scheduled {
            n_rows += s.logit_rows();
            let embeds = reqs.embeds(s.id);
            if s.sample && !embeds {
                let (tokens, _) = out.parts(s);
                let draft = &tokens[tokens.len() - s.draft..];
                for j in 0..=s.draft {
                    rows.push((s.id, n_rows - 1 - s.draft + j));
                    proposed.push(draft.get(j).copied());
                }
            }
            if let Some(l) = reqs.live.get(&s.id).filter(|_| !embeds) {
                let prompt = s.logits_from == Some(0) && l.prompt_logprobs.is_some();
                // A constraint masks on the device (below) unless log-probabilities are
                // wanted: those read the whole row anyway, and the host masks it.
                let f = Fetch::of(l.sampler.needs(), l.logprobs.is_some() || prompt);
                how = how.merge(if s.sample || prompt { f } else { Fetch::Argmax });
            }
        }
        (n_rows, how)
    }

    /// The constrained rows without log-probabilities are masked where the logits are.
    fn mask_on_device(&mut self, reqs: &Requests, masks: &Masks) -> Result<(), EngineError> {
        let on_device: Vec<(usize, &[u32])> = self
            .out
            .rows
            .iter()
            .filter(|(id, _)| reqs.live.get(id).is_some_and(|l| l.logprobs.is_none()))
            .filter_map(|(id, r)| match masks.get(id) {
                Some(Ok(bits)) => Some((*r, &bits[..])),
                _ => None,
            })
            .collect();
        if !on_device.is_empty() {
            self.runner.mask_rows(&on_device)?;
        }
        Ok(())
    }
}

/// Prompt log-probabilities: row k of a prompt chunk at position j predicts token j + 1.
fn prompt_logprobs(out: &SchedulerOutput, sched: &Scheduler, reqs: &mut Requests, picker: &Picker) {
    let mut r0 = 0;
    for s in &out.scheduled {
        let (r, rows) = (r0, s.logit_rows());
        r0 += rows;
        let (Some(l), Some(tokens)) = (reqs.live.get_mut(&s.id), sched.tokens(s.id)) else {
            continue;
        };
        let (Some(n), Some(0)) = (l.prompt_logprobs, s.logits_from) else {
            continue;
        };
        let prompt_len = l.counts.prompt_tokens;
        l.prompt_lps.resize(prompt_len.saturating_sub(1), None);
        for k in 0..rows {
            let j = s.start_pos + k;
            if let (true, Some(row)) = (j + 1 < prompt_len, picker.row(r + k)) {
                let (logprob, top) = logprobs(row, tokens[j + 1], n);
                l.prompt_lps[j] = Some(TokenLogprob { logprob, top });
            }
        }
    }
}

/// Each sampling row's token, with its request's sampler (its tokens so far for penalties)
/// under its constraint's mask, into `mo.sampled` and `mo.logprobs`. A request's rows with
/// proposed tokens are picked in order while each pick equals its row's proposal (the
/// tokens before a row, accepted proposals included, are its history): the picks are the
/// accepted proposals and the token after them. A constrained request
/// whose matcher failed (an internal error, not the model's doing) ends rather than produce
/// text the grammar does not allow. Returns the constrained requests' tokens, for their
/// matchers.
fn pick(
    picker: &mut Picker,
    sched: &Scheduler,
    reqs: &mut Requests,
    masks: &Masks,
    mo: &mut ModelOutput,
) -> Vec<(u64, u32)> {
    mo.sampled.clear();
    mo.logprobs.clear();
    let mut commits = Vec::new();
    // The request whose picks this step are over (a pick differed from its proposal), and the
    // accepted proposals of the current request.
    let mut over = None;
    let (mut current, mut accepted) = (None, 0);
    let mut longer = Vec::new();
    for (i, &(id, r)) in mo.rows.iter().enumerate() {
        let (Some(l), Some(mut history)) = (reqs.live.get_mut(&id), sched.tokens(id)) else {
            continue;
        };
        if reqs.dead.contains(&id) || over == Some(id) {
            continue;
        }
        if current != Some(id) {
            (current, accepted) = (Some(id), 0);
        }
        if accepted > 0 {
            longer.clear();
            longer.extend_from_slice(history);
            let picks = &mo.sampled[mo.sampled.len() - accepted..];
            longer.extend(picks.iter().map(|s| s.1));
            history = &longer;
        }
        let p = if l.constraint.is_none() {
            picker.pick(r, &mut l.sampler, history, l.logprobs, None)
        } else {
            let Some(Ok(bits)) = masks.get(&id) else {
                reqs.dead.push(id);
                continue;
            };
            let mut mask = |row: &mut [f32]| mask_row(row, bits);
            // Masked on the device already unless log-probabilities are wanted.
            let host = l.logprobs.is_some().then_some(&mut mask as Mask);
            let p = picker.pick(r, &mut l.sampler, history, l.logprobs, host);
            commits.push((id, p.token));
            p
        };
        mo.sampled.push((id, p.token));
        mo.logprobs.push(p.logprob);
        if mo.proposed[i] == Some(p.token) {
            accepted += 1;
        } else {
            over = Some(id);
        }
    }
    commits
}

/// A request's constraint and an argument (the vocabulary, a token) in, the constraint and
/// a result out.
type ConstraintJob<R> = fn((u64, Constraint, u32)) -> (u64, Constraint, R);

/// Runs `f` over the constraints of `jobs` (request, argument) on the workers while `work`
/// runs here (at most `inline` jobs: here, after `work`), and puts the constraints back: the
/// results by request. Err: a worker failed, and the step fails with every request in it (none
/// may go on without its constraint).
fn on_workers<R: Send + 'static, W>(
    workers: &mut Option<Workers>,
    live: &mut HashMap<u64, Live>,
    jobs: Vec<(u64, u32)>,
    inline: usize,
    f: ConstraintJob<R>,
    work: impl FnOnce() -> W,
) -> Result<(W, Vec<(u64, R)>), EngineError> {
    let failed = || EngineError::Thread("constraints".into());
    let items: Vec<(u64, Constraint, u32)> = jobs
        .into_iter()
        .filter_map(|(id, a)| Some((id, live.get_mut(&id)?.constraint.take()?, a)))
        .collect();
    let (w, done) = if items.len() <= inline {
        (work(), items.into_iter().map(f).collect())
    } else {
        if workers.is_none() {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get() / 2);
            *workers = Some(Workers::new(n.clamp(1, 8)).ok_or_else(failed)?);
        }
        let pending = workers.as_ref().ok_or_else(failed)?.map(items, f);
        let w = work();
        (w, pending.wait().ok_or_else(failed)?)
    };
    let mut out = Vec::with_capacity(done.len());
    for (id, c, r) in done {
        if let Some(l) = live.get_mut(&id) {
            l.constraint = Some(c);
        }
        out.push((id, r));
    }
    Ok((w, out))
}
