//! The serving engine's public face: [`start`] loads the model on the engine thread and runs
//! the serving loop there; the [`EngineHandle`] submits a request (its events come back
//! through a sink), aborts it, reads stats and shuts down. The request, event and stats types
//! are the engine's shared types ([`crate::types`]), re-exported here: what the HTTP server
//! sees (it never sees a tensor).

pub use crate::types::{
    Event, FinishReason, ModelInfo, Request, RunningRequest, ServeOptions, Sink, Stats,
    SubmitError, TokenLogprob,
};

use crate::draft::{check_rollback, check_vocab, DraftModel};
use crate::kv::chain_hash;
use crate::runner::{ModelRunner, RunnerOptions};
use crate::sched::{SchedConfig, Scheduler};
use crate::serving::shared::Shared;
use crate::serving::Engine;
use crate::spec::SpecType;
use crate::types::{EngineError, BLOCK_SIZE};
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use quiver_tokenizer::Tokenizer;
use std::sync::Arc;

/// Logits rows a step gives to prompt log-probabilities, beyond one per running request.
const PROMPT_LOGIT_ROWS: usize = 64;

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
    B: Backend + Send + 'static,
    F: FnOnce() -> B + Send + 'static,
{
    start_ranks(move || vec![make()], file, tokenizer, opts, name)
}

/// [`start`] with the model split over tensor-parallel ranks, one of the backends `make` makes
/// each (the ranks of one group: `ModelRunner::with_ranks`); the scheduler, the KV blocks'
/// bookkeeping and the picks stay single, on rank 0's thread.
pub fn start_ranks<B, F>(
    make: F,
    file: Arc<GgufFile>,
    tokenizer: Tokenizer,
    opts: ServeOptions,
    name: String,
) -> Result<EngineHandle, EngineError>
where
    B: Backend + Send + 'static,
    F: FnOnce() -> Vec<B> + Send + 'static,
{
    let info = ModelInfo {
        name,
        n_ctx: opts.n_ctx,
        n_vocab: tokenizer.n_vocab(),
    };
    let shared = Arc::new(Shared::new(info, tokenizer, opts.clone()));
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
            let mut runner = match ModelRunner::with_ranks(make(), &file, &runner_opts)
                .and_then(|mut r| r.set_seq_state(opts.max_seqs, Some(opts.n_ctx)).map(|_| r))
            {
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
            let draft = match load_draft(&mut runner, &file, &opts) {
                Ok(d) => d,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let recurrent = runner.model.hp.has_seq_state();
            // A recurrent state keeps --draft-max states to roll proposals back to.
            let planes = match opts.spec.kind {
                SpecType::None => 0,
                _ => opts.spec.draft_max,
            };
            // (At most `max_decoding` requests propose in one step.)
            let seqs = opts.spec.max_decoding.min(opts.max_seqs);
            let rollback = match runner.keep_states(planes, seqs) {
                Ok(n) => n,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
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
                spec: opts.spec.clone(),
                recurrent,
                rollback,
            });
            Engine::new(&sh, runner, sched, draft).run();
        })
        .map_err(|e| EngineError::Thread(e.to_string()))?;
    shared.set_thread(t);
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(EngineHandle { inner: shared }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(EngineError::Thread(
            "the engine thread stopped while loading".into(),
        )),
    }
}

/// The draft model of `opts.spec` (None without one): checked against the target's vocabulary,
/// loaded on its backend with a KV pool of the target's block count (the same block numbers).
/// An EAGLE-3 head makes the target keep the hidden states it reads; `--spec-type mtp` loads
/// the target's own multi-token-prediction block.
fn load_draft<B: Backend>(
    runner: &mut ModelRunner<B>,
    target: &Arc<GgufFile>,
    opts: &ServeOptions,
) -> Result<Option<DraftModel<B>>, EngineError> {
    opts.spec.validate().map_err(EngineError::Draft)?;
    if opts.spec.kind == SpecType::Mtp || opts.spec.draft_model.is_some() {
        // (It would run whole on rank 0's backend, whose products reduce over the ranks.)
        runner.whole_only("a draft model or head (-md, --spec-type mtp)")?;
    }
    let n_slots = opts.kv_blocks * BLOCK_SIZE;
    if opts.spec.kind == SpecType::Mtp {
        // The target's own block (or a sidecar's); its K/V in the target's blocks as a draft
        // model's.
        let file = opts.spec.draft_model.as_ref().map_or(target, |d| &d.0);
        let (n_batch, rows, nv) = (opts.max_batch_tokens, opts.max_seqs, runner.n_vocab());
        let d = DraftModel::load_mtp(&runner.backend, file, n_slots, n_batch, rows, opts.kv, nv)
            .map_err(|e| EngineError::Draft(format!("--spec-type mtp: {e}")))?;
        return Ok(Some(d));
    }
    // Loaded with --draft-max 0 too: a request's `speculative.n_max` may ask for proposals.
    let Some(file) = opts.spec.draft_model.as_ref() else {
        return Ok(None);
    };
    check_vocab(target, &file.0).map_err(EngineError::Draft)?;
    check_rollback(&file.0).map_err(EngineError::Draft)?;
    let eagle = file.0.arch().ok() == Some("eagle3");
    if eagle != (opts.spec.kind == SpecType::Eagle3) {
        return Err(EngineError::Draft(match eagle {
            true => "the draft model is an EAGLE-3 head: use --spec-type eagle3".into(),
            false => "--spec-type eagle3 needs an EAGLE-3 head (-md), not a draft model".into(),
        }));
    }
    let (n_batch, rows, nv) = (opts.max_batch_tokens, opts.max_seqs, runner.n_vocab());
    let d = match eagle {
        true => DraftModel::load_eagle3(
            &runner.backend,
            &file.0,
            target,
            n_slots,
            n_batch,
            rows,
            opts.kv,
            nv,
        ),
        false => DraftModel::load(
            &runner.backend,
            &file.0,
            n_slots,
            n_batch,
            rows,
            opts.kv,
            nv,
        ),
    }
    .map_err(|e| EngineError::Draft(e.to_string()))?;
    if let Some(layers) = d.eagle3_layers() {
        runner.keep_layers(&layers)?;
    }
    Ok(Some(d))
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Shared>,
}

impl EngineHandle {
    /// Queues a request; its events go to `sink`. Returns the request id.
    pub fn submit(&self, req: Request, sink: Sink) -> Result<u64, SubmitError> {
        self.inner.submit(req, sink)
    }

    /// Aborts a request (a no-op when it already ended). Its sink gets `Finished { Abort }`.
    pub fn abort(&self, id: u64) {
        self.inner.abort(id)
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.inner.info
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }

    /// Stops accepting requests, lets running ones finish until `deadline`, aborts the rest,
    /// and joins the engine thread. A second call can shorten the deadline (never lengthen it);
    /// it returns at once while the first call joins.
    pub fn shutdown(&self, deadline: std::time::Duration) {
        self.inner.shutdown(deadline)
    }
}
