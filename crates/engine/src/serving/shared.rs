//! What the engine's handle and its thread share: the inbox of new requests and aborts (with
//! the shutdown deadline), the stats, and what the server reads of the model. The handle's
//! calls ([`Shared::submit`], `abort`, `stats`, `shutdown`) run on the callers' threads; the
//! loop takes the inbox and publishes the stats.

use crate::sched::Scheduler;
use crate::types::{
    ModelInfo, Request, RunningRequest, ServeOptions, Sink, Stats, SubmitError, BLOCK_SIZE,
};
use quiver_tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `grace` after `now`, or the furthest instant within a factor of two of it when that is past
/// what an `Instant` can hold (a grace of `Duration::MAX` waits as long as anything can).
fn deadline(now: Instant, grace: Duration) -> Instant {
    let mut g = grace;
    loop {
        if let Some(d) = now.checked_add(g) {
            return d;
        }
        g /= 2;
    }
}

/// A submitted request the loop has not taken yet.
pub(crate) struct Pending {
    pub id: u64,
    pub req: Request,
    pub sink: Sink,
}

#[derive(Default)]
pub(crate) struct Inbox {
    pub new: VecDeque<Pending>,
    pub aborts: Vec<u64>,
    /// Set by shutdown: finish running requests until this instant, then abort.
    pub deadline: Option<Instant>,
    pub stopped: bool,
}

pub(crate) struct Shared {
    pub info: ModelInfo,
    pub tokenizer: Tokenizer,
    inbox: Mutex<Inbox>,
    /// Wakes the loop when the inbox changes.
    pub cv: Condvar,
    stats: Mutex<Stats>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    opts: ServeOptions,
}

impl Shared {
    pub fn new(info: ModelInfo, tokenizer: Tokenizer, opts: ServeOptions) -> Shared {
        Shared {
            info,
            tokenizer,
            inbox: Mutex::new(Inbox::default()),
            cv: Condvar::new(),
            stats: Mutex::new(Stats {
                kv_blocks_total: opts.kv_blocks,
                ..Default::default()
            }),
            next_id: AtomicU64::new(1),
            thread: Mutex::new(None),
            opts,
        }
    }

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
        let mut inbox = self.inbox();
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
        self.inbox().aborts.push(id);
        self.cv.notify_one();
    }

    pub fn stats(&self) -> Stats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn shutdown(&self, grace: Duration) {
        {
            let mut inbox = self.inbox();
            // A later call can only bring the deadline closer (a second SIGTERM).
            let d = deadline(Instant::now(), grace);
            inbox.deadline = Some(inbox.deadline.map_or(d, |old| old.min(d)));
            self.cv.notify_one();
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// The engine thread, joined by `shutdown`.
    pub fn set_thread(&self, t: JoinHandle<()>) {
        *self.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
    }

    pub fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stats, for the loop's counters.
    pub fn stats_mut(&self) -> MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gauges, as the scheduler stands now.
    pub fn publish(&self, sched: &Scheduler) {
        let mut st = self.stats_mut();
        st.running = sched.n_running();
        st.requests.clear();
        st.requests
            .extend(sched.running().map(|(id, c, n_past)| RunningRequest {
                id,
                prompt_tokens: c.prompt_tokens,
                cached_tokens: c.cached_tokens,
                generated_tokens: c.completion_tokens,
                n_past,
            }));
        st.waiting = sched.n_waiting();
        st.kv_blocks_total = sched.kv_blocks_total();
        st.kv_blocks_used = sched.kv_blocks_used();
        let spec = sched.spec_counts();
        st.spec_proposed_tokens_total = spec.proposed;
        st.spec_accepted_tokens_total = spec.accepted;
    }
}
