//! The serving loop (vLLM v1's engine core): one thread takes new requests and aborts, asks the
//! [`Scheduler`] for a step, runs it on the [`ModelRunner`], picks each sampling row's token
//! with the request's sampler, hands the tokens back to the scheduler, and streams text
//! through each request's [`OutputProcessor`]. The policy (budget, chunked prefill, prefix
//! cache, preemption) is the scheduler's; this file only moves data between the parts.

use crate::constraint::Constraint;
use crate::kv::chain_hash;
use crate::output::OutputProcessor;
use crate::picker::{Fetch, Mask};
use crate::runner::{ModelRunner, RunnerOptions};
use crate::sched::{Counts, SchedConfig, SchedRequest, Scheduler};
use crate::serve::*;
use crate::workers::Workers;
use crate::{EngineError, Sampler, BLOCK_SIZE};
use quiver_backend::reference::mask_row;
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Pending {
    id: u64,
    req: Request,
    sink: Sink,
}

#[derive(Default)]
struct Inbox {
    new: VecDeque<Pending>,
    aborts: Vec<u64>,
    /// Set by shutdown: finish running requests until this instant, then abort.
    deadline: Option<Instant>,
    stopped: bool,
}

pub(crate) struct Shared {
    pub info: ModelInfo,
    pub tokenizer: Tokenizer,
    inbox: Mutex<Inbox>,
    cv: Condvar,
    stats: Mutex<Stats>,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    opts: ServeOptions,
}

impl Shared {
    pub fn submit(&self, req: Request, sink: Sink) -> Result<u64, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.info.n_vocab)
        {
            return Err(SubmitError::BadToken {
                id,
                n_vocab: self.info.n_vocab,
            });
        }
        // A sequence must fit the context and the whole pool on its own.
        let ctx = self.info.n_ctx.min(self.opts.kv_blocks * BLOCK_SIZE);
        if req.prompt.len() + req.max_tokens > ctx {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                ctx,
            });
        }
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.deadline.is_some() || inbox.stopped {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = inbox.new.len() + self.stats.lock().map(|s| s.waiting).unwrap_or(0);
        if waiting >= self.opts.max_waiting {
            return Err(SubmitError::QueueFull(waiting));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        inbox.new.push_back(Pending { id, req, sink });
        self.cv.notify_one();
        Ok(id)
    }

    pub fn abort(&self, id: u64) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        inbox.aborts.push(id);
        self.cv.notify_one();
    }

    pub fn stats(&self) -> Stats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn shutdown(&self, grace: Duration) {
        {
            let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
            // A later call can only bring the deadline closer (a second SIGTERM).
            let d = Instant::now() + grace;
            inbox.deadline = Some(inbox.deadline.map_or(d, |old| old.min(d)));
            self.cv.notify_one();
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// Loads the model on the engine thread (the backend is made there by `make`) and starts the
/// loop. Returns once the model is loaded, or with the load error.
pub fn start<B, F>(
    make: F,
    file: Arc<GgufFile>,
    tokenizer: Tokenizer,
    opts: ServeOptions,
    name: String,
) -> Result<EngineHandle, EngineError>
where
    B: Backend + 'static,
    F: FnOnce() -> B + Send + 'static,
{
    let n_vocab = tokenizer.n_vocab();
    let shared = Arc::new(Shared {
        info: ModelInfo {
            name,
            n_ctx: opts.n_ctx,
            n_vocab,
        },
        tokenizer,
        inbox: Mutex::new(Inbox::default()),
        cv: Condvar::new(),
        stats: Mutex::new(Stats {
            kv_blocks_total: opts.kv_blocks,
            ..Default::default()
        }),
        next_id: AtomicU64::new(1),
        thread: Mutex::new(None),
        opts: opts.clone(),
    });
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), EngineError>>();
    let sh = shared.clone();
    let t = std::thread::Builder::new()
        .name("quiver-engine".into())
        .spawn(move || {
            let runner_opts = RunnerOptions {
                n_ctx: opts.kv_blocks * BLOCK_SIZE,
                n_batch: opts.max_batch_tokens,
                max_logits: opts.max_seqs + PROMPT_LOGIT_ROWS,
                kv: opts.kv,
            };
            let runner = match ModelRunner::new(make(), &file, &runner_opts) {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            if runner.n_vocab() != sh.info.n_vocab {
                let _ = ready_tx.send(Err(EngineError::VocabMismatch {
                    tokenizer: sh.info.n_vocab,
                    model: runner.n_vocab(),
                }));
                return;
            }
            let _ = ready_tx.send(Ok(()));
            let sched = Scheduler::new(SchedConfig {
                max_batch_tokens: opts.max_batch_tokens,
                max_seqs: opts.max_seqs,
                max_logits: opts.max_seqs + PROMPT_LOGIT_ROWS,
                kv_blocks: opts.kv_blocks,
                // The model and the cache's codecs (with their layout version): a block
                // written under one codec is never found as another's.
                hash_seed: chain_hash(
                    0x7175697665,
                    &[
                        file.file_len() as u32,
                        file.tensors.len() as u32,
                        opts.kv.k as u32,
                        opts.kv.v as u32,
                        quiver_backend::kvcodec::LAYOUT_VERSION,
                    ],
                ),
                eog: sh.tokenizer.eog_ids().collect(),
            });
            Engine {
                sh: &sh,
                runner,
                sched,
                live: HashMap::new(),
                sampled: Vec::new(),
                rows: Vec::new(),
                dead: Vec::new(),
                phases: crate::phases::Phases::from_env(),
                workers: None,
            }
            .run();
        })
        .map_err(|e| EngineError::Thread(e.to_string()))?;
    *shared.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(EngineHandle { inner: shared }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(EngineError::Thread(
            "the engine thread stopped while loading".into(),
        )),
    }
}

/// A request's side of the loop: where its events go and how its tokens are picked and shown.
struct Live<'t> {
    sink: Sink,
    sampler: Sampler,
    out: OutputProcessor<'t>,
    logprobs: Option<usize>,
    /// Prompt log-probabilities asked for, and those computed so far (by prompt position).
    prompt_logprobs: Option<usize>,
    prompt_lps: Vec<Option<TokenLogprob>>,
    counts: Counts,
    constraint: Option<crate::constraint::Constraint>,
    /// An embedding request's pooled hidden states so far.
    pool: Option<crate::embed::Pool>,
}

impl Live<'_> {
    fn send(&mut self, e: Event) -> bool {
        (self.sink)(e)
    }
}

/// Logits rows a step gives to prompt log-probabilities, beyond one per running request.
const PROMPT_LOGIT_ROWS: usize = 64;

struct Engine<'a, B: Backend> {
    sh: &'a Shared,
    runner: ModelRunner<B>,
    sched: Scheduler,
    live: HashMap<u64, Live<'a>>,
    /// Per-step scratch: the sampled (id, token) pairs, the ids of the sampling rows, and
    /// requests whose client left while starting.
    sampled: Vec<(u64, u32)>,
    /// (request, logits row) of the step's sampling rows.
    rows: Vec<(u64, usize)>,
    dead: Vec<u64>,
    /// `QUIVER_SERVE_PROFILE`'s phase times.
    phases: Option<crate::phases::Phases>,
    /// Threads for the constraints' work, started with the first constrained request.
    workers: Option<Workers>,
}

enum Inbound {
    Work,
    Exit,
}

impl<'a, B: Backend> Engine<'a, B> {
    fn run(mut self) {
        loop {
            if let Inbound::Exit = self.take_inbox() {
                break;
            }
            if let Err(e) = self.step() {
                // A failed step fails every request in it; the engine goes on.
                for (id, _) in self.sched.finish_running() {
                    if let Some(mut l) = self.live.remove(&id) {
                        l.send(Event::Error(format!("internal error: {e}")));
                    }
                }
            }
            self.publish();
        }
        // Abort whatever is left.
        for (id, _) in self.sched.finish_all() {
            self.ended(id, FinishReason::Abort);
        }
        self.publish();
    }

    /// Takes new requests and aborts; blocks while there is nothing to do.
    fn take_inbox(&mut self) -> Inbound {
        let sh = self.sh;
        let mut inbox = sh.inbox.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            while let Some(p) = inbox.new.pop_front() {
                let counts = Counts {
                    prompt_tokens: p.req.prompt.len(),
                    ..Counts::default()
                };
                self.sched.add(SchedRequest {
                    id: p.id,
                    prompt: p.req.prompt,
                    max_tokens: p.req.max_tokens,
                    ignore_eos: p.req.ignore_eos,
                    prompt_logits: p.req.prompt_logprobs.is_some(),
                    whole_prompt: p.req.embed.is_some(),
                });
                self.live.insert(
                    p.id,
                    Live {
                        sink: p.sink,
                        sampler: Sampler::new(p.req.sampling),
                        out: OutputProcessor::new(&sh.tokenizer, p.req.stop),
                        logprobs: p.req.logprobs,
                        prompt_logprobs: p.req.prompt_logprobs,
                        prompt_lps: Vec::new(),
                        counts,
                        constraint: p.req.constraint,
                        pool: p.req.embed.map(crate::embed::Pool::new),
                    },
                );
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
            self.publish();
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
        let Some(mut l) = self.live.remove(&id) else {
            return;
        };
        // Blocks and stats first, so that a client that sees Finished sees them.
        self.publish();
        let c = l.counts;
        l.send(Event::Finished {
            reason,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            cached_tokens: c.cached_tokens,
        });
    }

    fn step(&mut self) -> Result<(), EngineError> {
        let Engine {
            sh,
            runner,
            sched,
            live,
            sampled,
            rows,
            dead,
            phases,
            workers,
        } = self;
        if let Some(p) = phases.as_mut() {
            p.start();
        }
        let mut mark = |i: usize| {
            if let Some(p) = phases.as_mut() {
                p.mark(i);
            }
        };
        sched.schedule()?;
        // Gauges as of this step's admissions and preemptions, before any client hears of them.
        publish(sh, sched);
        let out = sched.output();
        if out.is_empty() {
            return Ok(());
        }
        dead.clear();
        {
            let mut st = sh.stats.lock().unwrap_or_else(|e| e.into_inner());
            st.steps_total += 1;
            st.preemptions_total += out.preempted.len() as u64;
            for s in out.started.iter().filter(|s| !s.resumed) {
                st.prefix_cache_hit_tokens_total += s.cached_tokens as u64;
                st.prompt_tokens_total += s.prompt_tokens as u64;
            }
        }
        for s in out.started.iter().filter(|s| !s.resumed) {
            let Some(l) = live.get_mut(&s.id) else {
                continue;
            };
            l.counts.prompt_tokens = s.prompt_tokens;
            l.counts.cached_tokens = s.cached_tokens;
            if !l.send(Event::Started {
                prompt_tokens: s.prompt_tokens,
                cached_tokens: s.cached_tokens,
            }) {
                dead.push(s.id);
            }
        }
        // The constrained requests' masks are computed on the workers while the forward pass
        // runs (they depend only on the tokens taken so far).
        mark(0);
        let nv = runner.n_vocab() as u32;
        let jobs: Vec<(u64, u32)> = live
            .iter()
            .filter(|(_, l)| l.constraint.is_some())
            .filter(|(id, _)| out.scheduled.iter().any(|s| s.sample && s.id == **id))
            .map(|(id, _)| (*id, nv))
            .collect();
        let mask = |(id, mut c, nv): (u64, Constraint, u32)| {
            let m = c.next_mask(nv as usize);
            (id, c, m)
        };
        let (r, masks) = on_workers(workers, live, jobs, 0, mask, || runner.execute(out))?;
        r?;
        let masks: HashMap<u64, Result<Vec<u32>, String>> = masks.into_iter().collect();
        mark(1);
        // Embedding requests: their rows' hidden states pooled; at the prompt's end the vector
        // goes out and the request ends (it takes no sampling row).
        let mut embedded = Vec::new();
        // A preempted request is computed again from its first token: its pool starts over.
        for id in &out.preempted {
            if let Some(p) = live.get_mut(id).and_then(|l| l.pool.as_mut()) {
                p.reset();
            }
        }
        // Rows up to the last embedding request's are read back, no further.
        let (mut end, mut r) = (0, 0);
        for s in &out.scheduled {
            r += s.n_tokens();
            if live.get(&s.id).is_some_and(|l| l.pool.is_some()) {
                end = r;
            }
        }
        if end > 0 {
            let d = runner.model.hp.n_embd;
            let hidden = runner.hidden(end)?;
            let mut r0 = 0;
            for s in &out.scheduled {
                if let Some(l) = live.get_mut(&s.id) {
                    if let Some(pool) = l.pool.as_mut() {
                        let len = l.counts.prompt_tokens;
                        for k in 0..s.n_tokens() {
                            pool.add(
                                s.start_pos + k,
                                len,
                                &hidden[(r0 + k) * d..(r0 + k + 1) * d],
                            );
                        }
                        if s.sample {
                            let v = pool.finish();
                            if l.send(Event::Embedding(v)) {
                                embedded.push(s.id);
                            } else {
                                dead.push(s.id);
                            }
                        }
                    }
                }
                r0 += s.n_tokens();
            }
        }
        // What the step's rows need from the logits, merged: plain greedy rows need the
        // device's argmax, top-k-only rows its k best (a GPU sends back k pairs per row);
        // prompt rows and logprobs need every logit.
        rows.clear();
        let mut n_rows = 0;
        let mut how = Fetch::Argmax;
        for s in &out.scheduled {
            n_rows += s.logit_rows();
            let embeds = live.get(&s.id).is_some_and(|l| l.pool.is_some());
            if s.sample && !embeds {
                rows.push((s.id, n_rows - 1));
            }
            if let Some(l) = live.get(&s.id).filter(|_| !embeds) {
                let prompt = s.logits_from == Some(0) && l.prompt_logprobs.is_some();
                // A constraint masks on the device (below) unless log-probabilities are
                // wanted: those read the whole row anyway, and the host masks it.
                let f = Fetch::of(l.sampler.needs(), l.logprobs.is_some() || prompt);
                how = how.merge(if s.sample || prompt { f } else { Fetch::Argmax });
            }
        }
        // The constrained rows without log-probabilities are masked where the logits are.
        let on_device: Vec<(usize, &[u32])> = rows
            .iter()
            .filter(|(id, _)| live.get(id).is_some_and(|l| l.logprobs.is_none()))
            .filter_map(|(id, r)| match masks.get(id) {
                Some(Ok(bits)) => Some((*r, &bits[..])),
                _ => None,
            })
            .collect();
        if !on_device.is_empty() {
            runner.mask_rows(&on_device)?;
        }
        mark(2);
        let picker = runner.fetch(n_rows, how)?;
        mark(3);
        // Prompt log-probabilities: row k of a prompt chunk at position j predicts token j + 1.
        let mut r0 = 0;
        for s in &out.scheduled {
            let (Some(l), Some(tokens)) = (live.get_mut(&s.id), sched.tokens(s.id)) else {
                r0 += s.logit_rows();
                continue;
            };
            if let (Some(n), Some(0)) = (l.prompt_logprobs, s.logits_from) {
                let prompt_len = l.counts.prompt_tokens;
                l.prompt_lps.resize(prompt_len.saturating_sub(1), None);
                for k in 0..s.logit_rows() {
                    let j = s.start_pos + k;
                    if let (true, Some(row)) = (j + 1 < prompt_len, picker.row(r0 + k)) {
                        let (logprob, top) = crate::logprobs(row, tokens[j + 1], n);
                        l.prompt_lps[j] = Some(TokenLogprob { logprob, top });
                    }
                }
            }
            r0 += s.logit_rows();
        }
        let mut lps = Vec::new();
        let mut commits = Vec::new();
        sampled.clear();
        for &(id, r) in rows.iter() {
            let (Some(l), Some(history)) = (live.get_mut(&id), sched.tokens(id)) else {
                continue;
            };
            if dead.contains(&id) {
                continue;
            }
            if l.prompt_logprobs.take().is_some() {
                let all = std::mem::take(&mut l.prompt_lps);
                if !l.send(Event::PromptLogprobs(all.into_iter().flatten().collect())) {
                    dead.push(id);
                    continue;
                }
            }
            let p = if l.constraint.is_none() {
                picker.pick(r, &mut l.sampler, history, l.logprobs, None)
            } else {
                let Some(Ok(bits)) = masks.get(&id) else {
                    // The matcher failed (an internal error, not the model's doing): the
                    // request ends rather than produce text the grammar does not allow.
                    dead.push(id);
                    continue;
                };
                let mut mask = |row: &mut [f32]| mask_row(row, bits);
                // Masked on the device already unless log-probabilities are wanted.
                let host = l.logprobs.is_some().then_some(&mut mask as Mask);
                let p = picker.pick(r, &mut l.sampler, history, l.logprobs, host);
                commits.push((id, p.token));
                p
            };
            sampled.push((id, p.token));
            lps.push(p.logprob);
        }
        mark(4);
        // The constrained requests take their tokens (a matcher takes ~10 µs a token over a
        // large vocabulary: beyond 16, on the workers); one that fails ends as above.
        let take = |(id, mut c, t): (u64, Constraint, u32)| {
            let ok = c.commit(t).is_ok();
            (id, c, ok)
        };
        let (_, took) = on_workers(workers, live, commits, 16, take, || ())?;
        for (id, _) in took.into_iter().filter(|t| !t.1) {
            if let Some(i) = sampled.iter().position(|s| s.0 == id) {
                sampled.remove(i);
                lps.remove(i);
            }
            dead.push(id);
        }
        mark(5);
        let outcomes = sched.update(sampled).to_vec();
        let mut generated = 0;
        let mut ended = Vec::new();
        for (o, lp) in outcomes.into_iter().zip(lps) {
            let Some(l) = live.get_mut(&o.id) else {
                continue;
            };
            if !o.appended {
                ended.push((o.id, FinishReason::Stop));
                continue;
            }
            generated += 1;
            l.counts.completion_tokens += 1;
            let emit = l.out.push(o.token);
            let mut text = emit.text;
            let grammar_done = l.constraint.as_ref().is_some_and(|c| c.done());
            let reason = if emit.stop {
                Some(FinishReason::Stop)
            } else if grammar_done && o.finish.is_none() {
                text.push_str(&l.out.finish());
                Some(FinishReason::Stop)
            } else if let Some(r) = o.finish {
                text.push_str(&l.out.finish());
                Some(r)
            } else {
                None
            };
            let alive = l.send(Event::Token {
                id: o.token,
                text,
                logprob: lp,
            });
            match (alive, reason) {
                (false, _) => ended.push((o.id, FinishReason::Abort)),
                (true, Some(r)) => ended.push((o.id, r)),
                (true, None) => {}
            }
        }
        sh.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generated_tokens_total += generated;
        ended.extend(dead.iter().map(|&id| (id, FinishReason::Abort)));
        ended.extend(embedded.into_iter().map(|id| (id, FinishReason::Stop)));
        for (id, reason) in ended {
            self.end(id, reason);
        }
        if let Some(p) = self.phases.as_mut() {
            p.mark(6);
            p.step_done(self.rows.len());
        }
        Ok(())
    }

    fn publish(&self) {
        publish(self.sh, &self.sched);
    }
}

/// The gauges, as the scheduler stands now.
fn publish(sh: &Shared, sched: &Scheduler) {
    let mut st = sh.stats.lock().unwrap_or_else(|e| e.into_inner());
    st.running = sched.n_running();
    st.requests.clear();
    st.requests.extend(
        sched
            .running()
            .map(|(id, c, n_past)| crate::serve::RunningRequest {
                id,
                prompt_tokens: c.prompt_tokens,
                cached_tokens: c.cached_tokens,
                generated_tokens: c.completion_tokens,
                n_past,
            }),
    );
    st.waiting = sched.n_waiting();
    st.kv_blocks_total = sched.kv_blocks_total();
    st.kv_blocks_used = sched.kv_blocks_used();
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
