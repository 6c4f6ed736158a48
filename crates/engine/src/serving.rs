//! The serving loop (vLLM v1's engine core) on the engine thread. It takes new requests and
//! aborts from the inbox ([`shared`]), then runs steps, each in four stages:
//!
//! 1. `Scheduler::schedule` decides the step's rows: decode tokens, prefill chunks,
//!    admissions (with their prefix-cache hits) and preemptions;
//! 2. the runner ([`execute`]) runs the forward pass and picks each sampling row's token
//!    (sampler, constraint masks, log-probabilities);
//! 3. `Scheduler::update` applies the tokens to the sequences: it advances them, caches their
//!    full blocks and ends those that drew an end-of-generation token or reached their limit;
//! 4. the output stage ([`emit`]) sends each client its events (text through the output
//!    processor, which finds stop strings) and names the requests that end.
//!
//! The policy (budget, chunked prefill, prefix cache, preemption) is the scheduler's; this
//! file only moves data between the stages. A request's own state beside the scheduler's is
//! its [`live::Live`].

mod emit;
mod execute;
mod live;
pub(crate) mod shared;

use crate::draft::{DraftModel, OnBackend};
use crate::phases::{Phase, Phases};
use crate::runner::ModelRunner;
use crate::sched::Scheduler;
use crate::serving::execute::StepRunner;
use crate::serving::live::{Live, Requests};
use crate::serving::shared::Shared;
use crate::types::{EngineError, Event, FinishReason};
use quiver_backend::Backend;
use std::time::{Duration, Instant};

pub(crate) struct Engine<'a, B: Backend> {
    sh: &'a Shared,
    sched: Scheduler,
    runner: StepRunner<B>,
    reqs: Requests<'a>,
    /// The step's requests that end, and why (kept from step to step).
    ended: Vec<(u64, FinishReason)>,
    /// `QUIVER_SERVE_PROFILE`'s phase times.
    phases: Phases,
    /// Speculative decoding's draft model (`-md`).
    draft: Option<DraftModel<B>>,
}

enum Inbound {
    Work,
    Exit,
}

impl<'a, B: Backend> Engine<'a, B> {
    pub fn new(
        sh: &'a Shared,
        runner: ModelRunner<B>,
        sched: Scheduler,
        draft: Option<DraftModel<B>>,
    ) -> Self {
        Engine {
            sh,
            sched,
            runner: StepRunner::new(runner),
            reqs: Requests::default(),
            ended: Vec::new(),
            phases: Phases::from_env(),
            draft,
        }
    }

    /// Runs until shutdown.
    pub fn run(mut self) {
        loop {
            if let Inbound::Exit = self.take_inbox() {
                break;
            }
            if let Err(e) = self.step() {
                // A failed step fails every request in it; the engine goes on.
                for (id, _) in self.sched.finish_running() {
                    if let Some(d) = self.draft.as_mut() {
                        d.forget(id);
                    }
                    if let Some(mut l) = self.reqs.live.remove(&id) {
                        l.send(Event::Error(format!("internal error: {e}")));
                    }
                }
            }
            self.sh.publish(&self.sched);
        }
        // Abort whatever is left.
        for (id, _) in self.sched.finish_all() {
            self.ended(id, FinishReason::Abort);
        }
        self.sh.publish(&self.sched);
    }

    /// One step: schedule → runner.execute → scheduler.update → output stage.
    fn step(&mut self) -> Result<(), EngineError> {
        let t0 = Instant::now();
        self.phases.start();
        match self.draft.as_mut() {
            Some(draft) => {
                let mut d = OnBackend {
                    backend: self.runner.backend_mut(),
                    draft,
                };
                self.sched.schedule_with(Some(&mut d))?;
                if let Some(e) = draft.take_error() {
                    return Err(e);
                }
            }
            None => {
                self.sched.schedule()?;
            }
        }
        // Gauges as of this step's admissions and preemptions, before any client hears of them.
        self.sh.publish(&self.sched);
        let out = self.sched.output();
        if out.is_empty() {
            return Ok(());
        }
        self.reqs.dead.clear();
        emit::started(self.sh, out, &mut self.reqs);
        self.phases.mark(Phase::Schedule);
        let mo = self
            .runner
            .execute(out, &self.sched, &mut self.reqs, &mut self.phases)?;
        let decoding = out
            .scheduled
            .iter()
            .filter(|s| s.start_pos >= s.decode_from)
            .count();
        let outcomes = self.sched.update(&mo.sampled);
        emit::emit(self.sh, outcomes, mo, &mut self.reqs, &mut self.ended);
        let rows = mo.rows.len();
        // (Before the ended requests are forgotten; not in a step of more requests decoding
        // than may propose: none did, and the next step will likely not either.)
        if let Some(d) = self
            .draft
            .as_mut()
            .filter(|_| decoding <= self.sched.spec_limit())
        {
            let (b, target) = self.runner.backend_and_state();
            d.absorb(b, target, self.sched.output())?;
        }
        // The step's time, for what proposed rows cost (the drafting included).
        self.sched.note_step(t0.elapsed().as_secs_f64());
        for i in 0..self.ended.len() {
            let (id, reason) = self.ended[i];
            self.end(id, reason);
        }
        self.phases.mark(Phase::Emit);
        self.phases.step_done(rows);
        Ok(())
    }

    /// Takes new requests and aborts; blocks while there is nothing to do.
    fn take_inbox(&mut self) -> Inbound {
        let sh = self.sh;
        let mut inbox = sh.inbox();
        loop {
            while let Some(p) = inbox.new.pop_front() {
                let (req, live) = Live::admit(p.id, p.req, p.sink, &sh.tokenizer);
                self.sched.add(req);
                self.reqs.live.insert(p.id, live);
            }
            for id in std::mem::take(&mut inbox.aborts) {
                self.end(id, FinishReason::Abort);
            }
            if let Some(d) = inbox.deadline {
                if Instant::now() >= d || !self.sched.has_work() {
                    inbox.stopped = true;
                    return Inbound::Exit;
                }
                // Draining: nothing new is admitted.
                for (id, _) in self.sched.finish_waiting() {
                    self.ended(id, FinishReason::Abort);
                }
            }
            if self.sched.has_work() {
                return Inbound::Work;
            }
            self.sh.publish(&self.sched);
            inbox = sh
                .cv
                .wait_timeout(inbox, Duration::from_millis(200))
                .map(|r| r.0)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Ends a request wherever it is.
    fn end(&mut self, id: u64, reason: FinishReason) {
        self.sched.finish(id);
        self.ended(id, reason);
    }

    /// Tells the client of a request the scheduler no longer holds that it ended.
    fn ended(&mut self, id: u64, reason: FinishReason) {
        if let Some(d) = self.draft.as_mut() {
            d.forget(id);
        }
        let Some(mut l) = self.reqs.live.remove(&id) else {
            return;
        };
        // Blocks and stats first, so that a client that sees Finished sees them.
        self.sh.publish(&self.sched);
        let c = l.counts;
        l.send(Event::Finished {
            reason,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            cached_tokens: c.cached_tokens,
        });
    }
}
