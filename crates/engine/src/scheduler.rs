//! The serving loop (vLLM v1 style): each step gives every running sequence a number of tokens
//! within a token budget (decode tokens first, then prefill chunks, then newly admitted
//! requests), runs one forward over the flat batch, samples, streams, and frees finished or
//! aborted sequences. KV lives in a paged pool with prefix caching; when blocks run out the
//! newest running sequence is preempted (blocks freed, requeued for recompute).

use crate::kv::{chain_hash, BlockPool};
use crate::serve::*;
use crate::{logprobs, stop_at, Needs, Sampler, BLOCK_SIZE};
use quiver_backend::{Backend, Batch, SeqSpan};
use quiver_gguf::GgufFile;
use quiver_models::{Model, State};
use quiver_tokenizer::{Detokenizer, Tokenizer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Pending {
    id: u64,
    req: Request,
    sink: Sink,
    arrived: u64,
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
        inbox.new.push_back(Pending {
            id,
            req,
            sink,
            arrived: id,
        });
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
            if inbox.deadline.is_none() {
                inbox.deadline = Some(Instant::now() + grace);
            }
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
) -> Result<EngineHandle, String>
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
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let sh = shared.clone();
    let t = std::thread::Builder::new()
        .name("quiver-engine".into())
        .spawn(move || {
            let mut backend = make();
            let model = match quiver_models::load(&backend, &file) {
                Ok(m) => m,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let state = match model.state(
                &backend,
                opts.kv_blocks * BLOCK_SIZE,
                opts.max_batch_tokens,
                opts.max_seqs,
            ) {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            if model.hp.n_vocab != sh.info.n_vocab {
                let _ = ready_tx.send(Err(format!(
                    "the tokenizer has {} tokens, the model {}",
                    sh.info.n_vocab, model.hp.n_vocab
                )));
                return;
            }
            let _ = ready_tx.send(Ok(()));
            let seed = chain_hash(
                0x7175697665,
                &[file.file_len() as u32, file.tensors.len() as u32],
            );
            Engine {
                sh: &sh,
                tok: &sh.tokenizer,
                model,
                state,
                pool: BlockPool::new(opts.kv_blocks),
                seed,
                running: Vec::new(),
                waiting: VecDeque::new(),
                batch: Batch::default(),
                host: Vec::new(),
                ids: Vec::new(),
                top: Vec::new(),
                rows: Vec::new(),
                done: Vec::new(),
            }
            .run(&mut backend);
        })
        .map_err(|e| e.to_string())?;
    *shared.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(EngineHandle { inner: shared }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread stopped while loading".into()),
    }
}

struct Seq<'t> {
    id: u64,
    arrived: u64,
    req: Request,
    sink: Sink,
    sampler: Sampler,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    n_computed: usize,
    blocks: Vec<u32>,
    /// Hash of the last registered full block (chain state) and how many blocks are hashed.
    hashed: usize,
    last_hash: u64,
    cached_tokens: usize,
    started: bool,
    detok: Detokenizer<'t>,
    text: String,
    emitted: usize,
    /// Tokens scheduled this step.
    step: usize,
}

impl Seq<'_> {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn send(&mut self, e: Event) -> bool {
        (self.sink)(e)
    }
}

struct Engine<'a, B: Backend> {
    sh: &'a Shared,
    tok: &'a Tokenizer,
    model: Model<B>,
    state: State<B>,
    pool: BlockPool,
    seed: u64,
    running: Vec<Seq<'a>>,
    waiting: VecDeque<Seq<'a>>,
    batch: Batch,
    host: Vec<f32>,
    /// Token ids picked by the backend (plain-greedy steps).
    ids: Vec<u32>,
    /// The backend's k best (id, logit) per row (top-k steps).
    top: Vec<(u32, f32)>,
    /// Per-step scratch: running indices with a logits row, finished requests.
    rows: Vec<usize>,
    done: Vec<(u64, FinishReason)>,
}

enum Inbound {
    Work,
    Exit,
}

impl<'a, B: Backend> Engine<'a, B> {
    fn run(mut self, backend: &mut B) {
        loop {
            if let Inbound::Exit = self.take_inbox() {
                break;
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                continue;
            }
            if let Err(e) = self.step(backend) {
                // A failed step fails every request in it; the engine goes on.
                for mut s in std::mem::take(&mut self.running) {
                    s.send(Event::Error(format!("internal error: {e}")));
                    self.pool.release_all(&mut s.blocks);
                }
            }
            self.publish();
        }
        // Abort whatever is left.
        for mut s in std::mem::take(&mut self.running)
            .into_iter()
            .chain(std::mem::take(&mut self.waiting))
        {
            let (p, g, c) = (s.prompt_len, s.generated(), s.cached_tokens);
            s.send(Event::Finished {
                reason: FinishReason::Abort,
                prompt_tokens: p,
                completion_tokens: g,
                cached_tokens: c,
            });
            self.pool.release_all(&mut s.blocks);
        }
        self.publish();
    }

    /// Takes new requests and aborts; blocks while there is nothing to do.
    fn take_inbox(&mut self) -> Inbound {
        let sh = self.sh;
        let mut inbox = sh.inbox.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            while let Some(p) = inbox.new.pop_front() {
                let sampler = Sampler::new(p.req.sampling.clone());
                let prompt_len = p.req.prompt.len();
                self.waiting.push_back(Seq {
                    id: p.id,
                    arrived: p.arrived,
                    tokens: p.req.prompt.clone(),
                    req: p.req,
                    sink: p.sink,
                    sampler,
                    prompt_len,
                    n_computed: 0,
                    blocks: Vec::new(),
                    hashed: 0,
                    last_hash: self.seed,
                    cached_tokens: 0,
                    started: false,
                    detok: Detokenizer::new(self.tok, true),
                    text: String::new(),
                    emitted: 0,
                    step: 0,
                });
            }
            for id in std::mem::take(&mut inbox.aborts) {
                self.finish_where(|s| s.id == id, FinishReason::Abort);
            }
            if let Some(d) = inbox.deadline {
                if Instant::now() >= d || (self.running.is_empty() && self.waiting.is_empty()) {
                    inbox.stopped = true;
                    return Inbound::Exit;
                }
                // Draining: nothing new is admitted.
                for mut s in std::mem::take(&mut self.waiting) {
                    let (p, c) = (s.prompt_len, s.cached_tokens);
                    s.send(Event::Finished {
                        reason: FinishReason::Abort,
                        prompt_tokens: p,
                        completion_tokens: 0,
                        cached_tokens: c,
                    });
                    self.pool.release_all(&mut s.blocks);
                }
            }
            if !self.running.is_empty() || !self.waiting.is_empty() {
                return Inbound::Work;
            }
            self.publish_locked();
            inbox = sh
                .cv
                .wait_timeout(inbox, Duration::from_millis(200))
                .map(|r| r.0)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn finish_where(&mut self, pred: impl Fn(&Seq) -> bool, reason: FinishReason) {
        for list in [0, 1] {
            let mut i = 0;
            loop {
                let s = match list {
                    0 if i < self.running.len() => &self.running[i],
                    1 if i < self.waiting.len() => &self.waiting[i],
                    _ => break,
                };
                if pred(s) {
                    let mut s = if list == 0 {
                        self.running.remove(i)
                    } else {
                        self.waiting.remove(i).expect("index checked")
                    };
                    let (p, g, c) = (s.prompt_len, s.generated(), s.cached_tokens);
                    // Blocks and stats first, so that a client that sees Finished sees them.
                    self.pool.release_all(&mut s.blocks);
                    self.publish_locked();
                    s.send(Event::Finished {
                        reason,
                        prompt_tokens: p,
                        completion_tokens: g,
                        cached_tokens: c,
                    });
                } else {
                    i += 1;
                }
            }
        }
    }

    /// Makes sure `s` has blocks for positions up to `upto` (exclusive). False if the pool is dry.
    fn grow(pool: &mut BlockPool, s: &mut Seq, upto: usize) -> bool {
        while s.blocks.len() * BLOCK_SIZE < upto {
            match pool.alloc() {
                Some(b) => s.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Frees the newest running sequence and puts it back at the front of the queue.
    fn preempt_newest(&mut self) -> bool {
        let Some(i) = (0..self.running.len()).max_by_key(|&i| self.running[i].arrived) else {
            return false;
        };
        let mut s = self.running.remove(i);
        self.pool.release_all(&mut s.blocks);
        (s.n_computed, s.hashed, s.last_hash, s.step) = (0, 0, self.seed, 0);
        self.waiting.push_front(s);
        if let Ok(mut st) = self.sh.stats.lock() {
            st.preemptions_total += 1;
        }
        true
    }

    /// Reuses cached full blocks of the sequence's known tokens (never the last token, which
    /// must be computed to get logits).
    fn reuse_prefix(&mut self, s: &mut Seq) {
        while (s.hashed + 1) * BLOCK_SIZE < s.tokens.len() {
            let h = chain_hash(
                s.last_hash,
                &s.tokens[s.hashed * BLOCK_SIZE..(s.hashed + 1) * BLOCK_SIZE],
            );
            match self.pool.lookup(h) {
                Some(b) => {
                    s.blocks.push(b);
                    s.hashed += 1;
                    s.last_hash = h;
                }
                None => break,
            }
        }
        s.n_computed = s.hashed * BLOCK_SIZE;
    }

    fn step(&mut self, backend: &mut B) -> Result<(), String> {
        let max_tokens = self.sh.opts.max_batch_tokens;
        let mut budget = max_tokens;
        // 1. Running sequences: decode tokens and prefill chunks, oldest first.
        self.running.sort_by_key(|s| s.arrived);
        let mut i = 0;
        while i < self.running.len() {
            let want = (self.running[i].tokens.len() - self.running[i].n_computed).min(budget);
            if want == 0 {
                self.running[i].step = 0;
                i += 1;
                continue;
            }
            let upto = self.running[i].n_computed + want;
            if Self::grow(&mut self.pool, &mut self.running[i], upto) {
                self.running[i].step = want;
                budget -= want;
                i += 1;
            } else if self.running.len() > 1 {
                // Sorted by arrival, so the newest is last: it is preempted, which may be this
                // one (then the loop ends) or a later one (then this one retries).
                self.preempt_newest();
            } else {
                return Err("the KV pool cannot hold a single sequence".into());
            }
        }
        // 2. Admit waiting sequences while there is room.
        while budget > 0 && self.running.len() < self.sh.opts.max_seqs {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.reuse_prefix(&mut s);
            let want = (s.tokens.len() - s.n_computed).min(budget);
            let upto = s.n_computed + want;
            if !Self::grow(&mut self.pool, &mut s, upto) {
                self.pool.release_all(&mut s.blocks);
                (s.n_computed, s.hashed, s.last_hash) = (0, 0, self.seed);
                self.waiting.push_front(s);
                break;
            }
            if !s.started {
                s.started = true;
                s.cached_tokens = s.n_computed;
                let (p, c) = (s.prompt_len, s.cached_tokens);
                if let Ok(mut st) = self.sh.stats.lock() {
                    st.prefix_cache_hit_tokens_total += c as u64;
                    st.prompt_tokens_total += p as u64;
                }
                if !s.send(Event::Started {
                    prompt_tokens: p,
                    cached_tokens: c,
                }) {
                    self.pool.release_all(&mut s.blocks);
                    continue;
                }
            }
            s.step = want;
            budget -= want;
            self.running.push(s);
        }
        // 3. The flat batch.
        let b = &mut self.batch;
        b.tokens.clear();
        b.positions.clear();
        b.slots.clear();
        b.seq_of.clear();
        b.logits.clear();
        b.block_size = BLOCK_SIZE;
        b.seqs.resize_with(self.running.len(), SeqSpan::default);
        b.seqs.truncate(self.running.len());
        let rows = &mut self.rows;
        rows.clear();
        for (si, s) in self.running.iter().enumerate() {
            let start = b.tokens.len();
            for p in s.n_computed..s.n_computed + s.step {
                b.tokens.push(s.tokens[p]);
                b.positions.push(p as u32);
                b.slots
                    .push(s.blocks[p / BLOCK_SIZE] * BLOCK_SIZE as u32 + (p % BLOCK_SIZE) as u32);
                b.seq_of.push(si as u32);
            }
            let span = &mut b.seqs[si];
            (span.start, span.len, span.kv_len) = (start, s.step, s.n_computed + s.step);
            span.block_table.clear();
            span.block_table.extend_from_slice(&s.blocks);
            if s.step > 0 && s.n_computed + s.step == s.tokens.len() {
                b.logits.push((start + s.step - 1) as u32);
                rows.push(si);
            }
        }
        if b.tokens.is_empty() {
            return Ok(());
        }
        self.model
            .forward(backend, &mut self.state, &self.batch)
            .map_err(|e| e.to_string())?;
        let nv = self.sh.info.n_vocab;
        // Rows without logprobs that are plain greedy or top-k-only take their tokens from the
        // backend's argmax (k = 1) or k best logits: a GPU sends back k pairs per row instead of
        // the logits. Any other row makes the step read every logit.
        let kmax = self.rows.iter().try_fold(1usize, |m, &si| {
            let s = &self.running[si];
            match (s.req.logprobs, s.sampler.needs()) {
                (None, Needs::Argmax) => Some(m),
                (None, Needs::TopK(k)) => Some(m.max(k)),
                _ => None,
            }
        });
        match kmax {
            Some(1) => backend.argmax(&self.state.logits, self.rows.len(), nv, &mut self.ids),
            Some(k) => backend.top_k(&self.state.logits, self.rows.len(), nv, k, &mut self.top),
            None => backend.read(&self.state.logits, self.rows.len() * nv, &mut self.host),
        }
        .map_err(|e| e.to_string())?;
        if let Ok(mut st) = self.sh.stats.lock() {
            st.steps_total += 1;
        }
        // 4. Advance, register full blocks, sample.
        for s in self.running.iter_mut() {
            s.n_computed += s.step;
            while (s.hashed + 1) * BLOCK_SIZE <= s.n_computed {
                let h = chain_hash(
                    s.last_hash,
                    &s.tokens[s.hashed * BLOCK_SIZE..(s.hashed + 1) * BLOCK_SIZE],
                );
                self.pool.register(s.blocks[s.hashed], h);
                s.hashed += 1;
                s.last_hash = h;
            }
        }
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        for (r, &si) in self.rows.iter().enumerate() {
            let s = &mut self.running[si];
            let (next, lp) = if let Some(k) = kmax {
                let next = if k == 1 {
                    self.ids[r]
                } else {
                    let top = &self.top[r * k..][..k];
                    match s.sampler.needs() {
                        Needs::Argmax => top[0].0,
                        _ => s.sampler.sample_top(top),
                    }
                };
                (next, None)
            } else {
                let row = &self.host[r * nv..][..nv];
                let next = s.sampler.sample(row, &s.tokens);
                let lp = s.req.logprobs.map(|n| {
                    let (logprob, top) = logprobs(row, next, n);
                    TokenLogprob { logprob, top }
                });
                (next, lp)
            };
            if !s.req.ignore_eos && self.tok.is_eog(next) {
                done.push((s.id, FinishReason::Stop));
                continue;
            }
            s.tokens.push(next);
            if let Ok(mut st) = self.sh.stats.lock() {
                st.generated_tokens_total += 1;
            }
            let piece = s.detok.push(next);
            let before = s.text.len();
            s.text.push_str(&piece);
            let (emit_to, reason) = match stop_at(&s.text, &s.req.stop, before) {
                Some(cut) => {
                    s.text.truncate(cut);
                    (cut, Some(FinishReason::Stop))
                }
                None if s.generated() >= s.req.max_tokens => {
                    s.text.push_str(&s.detok.flush());
                    (s.text.len(), Some(FinishReason::Length))
                }
                None => (safe_end(&s.text, &s.req.stop), None),
            };
            let text = if emit_to > s.emitted {
                s.text[s.emitted..emit_to].to_string()
            } else {
                String::new()
            };
            s.emitted = s.emitted.max(emit_to);
            if !s.send(Event::Token {
                id: next,
                text,
                logprob: lp,
            }) {
                done.push((s.id, FinishReason::Abort));
            } else if let Some(r) = reason {
                done.push((s.id, r));
            }
        }
        for &(id, reason) in &done {
            self.finish_where(|s| s.id == id, reason);
        }
        self.done = done;
        Ok(())
    }

    fn publish(&mut self) {
        self.publish_locked();
    }

    fn publish_locked(&self) {
        if let Ok(mut st) = self.sh.stats.lock() {
            st.running = self.running.len();
            st.waiting = self.waiting.len();
            st.kv_blocks_total = self.pool.total();
            st.kv_blocks_used = self.pool.used();
        }
    }
}

/// The end of the text that can be sent without risking a stop string: a tail that is a
/// prefix of some stop string is held back.
fn safe_end(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    for s in stops.iter().filter(|s| !s.is_empty()) {
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && text.is_char_boundary(text.len() - k)
                && s.as_bytes().starts_with(&text.as_bytes()[text.len() - k..])
            {
                end = end.min(text.len() - k);
                break;
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    #[test]
    fn safe_end_holds_back_a_possible_stop_prefix() {
        let stops = vec!["END".to_string()];
        assert_eq!(super::safe_end("hello E", &stops), 6);
        assert_eq!(super::safe_end("hello EN", &stops), 6);
        assert_eq!(super::safe_end("hello", &stops), 5);
        assert_eq!(super::safe_end("hello", &[]), 5);
    }
}
