//! [`TpSession`]: one sequence over a tensor-parallel model's ranks ([`TpRanks`]), the
//! [`Session`] `run`, `chat` and `bench` drive: each step goes to every rank, rank 0's logits
//! come back to the host, and tokens are picked there (proposals verified there too). The
//! batched bench and draft heads are refused (one line each).

use crate::batched::BatchedResult;
use crate::runner::{check_single, single_steps, verify_picks, RunnerOptions, Session, Want};
use crate::sampler::Sampler;
use crate::types::{EngineError, Result, BLOCK_SIZE};
use quiver_backend::Batch;
use quiver_gguf::GgufFile;
use quiver_models::{Hparams, ModelError, TpRanks, TpSizes};
use std::sync::Arc;

pub struct TpSession {
    ranks: TpRanks,
    hp: Hparams,
    n_ctx: usize,
    n_batch: usize,
    max_logits: usize,
    /// The sequence's positions in order: the identity block table of the ranks' states.
    table: Vec<u32>,
    logits: Vec<f32>,
}

impl TpSession {
    /// Starts a rank on each of `backends` (the ranks of one group, `TpRanks::start`) for
    /// `opts`' context and KV types, with states of its context (whole blocks), steps and logits
    /// rows, as `ModelRunner::new` makes them.
    pub fn start<B: quiver_backend::Backend + Send + 'static>(
        backends: Vec<B>,
        file: &Arc<GgufFile>,
        opts: &RunnerOptions,
    ) -> Result<TpSession> {
        let (n_ctx, n_batch, max_logits) = opts.sizes();
        let sizes = TpSizes {
            n_ctx: opts.n_ctx,
            kv: opts.kv,
            n_slots: n_ctx,
            max_tokens: n_batch,
            max_logits,
        };
        let ranks = TpRanks::start(backends, file, sizes)?;
        Ok(TpSession {
            ranks,
            hp: quiver_models::hparams(file)?,
            n_ctx,
            n_batch,
            max_logits,
            table: (0..(n_ctx / BLOCK_SIZE) as u32).collect(),
            logits: Vec::new(),
        })
    }

    /// The ranks.
    pub fn size(&self) -> usize {
        self.ranks.size()
    }

    /// Each rank's weights' bytes, as its backend counts them.
    pub fn weights_bytes(&self) -> &[Option<u64>] {
        self.ranks.weights_bytes()
    }

    fn refused(what: &str) -> EngineError {
        EngineError::Model(ModelError::Tp(format!(
            "{what} does not run with --tensor-parallel yet"
        )))
    }
}

impl Session for TpSession {
    fn eval(&mut self, tokens: &[u32], start_pos: usize, want: Want) -> Result<&[f32]> {
        check_single(tokens, start_pos, self.n_ctx, self.hp.n_vocab)?;
        let first_wanted = want.first(tokens.len());
        self.logits.clear();
        let steps = single_steps(tokens.len(), first_wanted, self.n_batch, self.max_logits);
        for (done, end, from) in steps {
            let rows: Vec<u32> = (from.saturating_sub(done)..end - done)
                .map(|r| r as u32)
                .collect();
            let batch = Batch::single(
                &tokens[done..end],
                start_pos + done,
                &self.table,
                BLOCK_SIZE,
                rows,
            );
            let logits = self.ranks.forward(&batch)?;
            self.logits.extend_from_slice(&logits);
        }
        Ok(&self.logits)
    }
    fn eval_argmax(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        let logits = self.eval(tokens, start_pos, Want::Last)?;
        Ok(crate::sampler::argmax(logits))
    }
    fn eval_pick(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        self.eval(tokens, start_pos, Want::Last)?;
        Ok(sampler.sample(&self.logits, history))
    }
    /// As `ModelRunner::eval_verify`: every row's logits on the host, each row's token picked
    /// in order while it equals the next proposed one (no state to roll back: attention only).
    fn eval_verify(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        sampler: &mut Sampler,
        history: &[u32],
        picks: &mut Vec<u32>,
    ) -> Result<()> {
        if tokens.len() > self.max_verify() {
            return Err(ModelError::BatchTooLarge {
                got: tokens.len(),
                max: self.max_verify(),
            }
            .into());
        }
        let nv = self.hp.n_vocab;
        self.eval(tokens, start_pos, Want::From(0))?;
        let logits = &self.logits;
        verify_picks(tokens, history, picks, |j, h| {
            sampler.sample(&logits[j * nv..(j + 1) * nv], h)
        });
        Ok(())
    }
    fn max_verify(&self) -> usize {
        self.max_logits.min(self.n_batch)
    }
    fn keep_states(&mut self, _: usize) -> Result<usize> {
        // (The sharded models hold no recurrent state: nothing to keep.)
        Ok(0)
    }
    fn rewind(&mut self, _: usize) -> Result<()> {
        // Attention only: positions past `pos` are written again before they are read.
        Ok(())
    }
    fn attach_eagle3(&mut self, _: &Arc<GgufFile>, _: &Arc<GgufFile>) -> Result<()> {
        Err(Self::refused("an EAGLE-3 head"))
    }
    fn attach_mtp(&mut self, _: &Arc<GgufFile>) -> Result<()> {
        Err(Self::refused("a multi-token-prediction block"))
    }
    fn propose_head(&mut self, _: &[u32], _: usize, _: f32, _: &mut Vec<u32>) -> Result<()> {
        Ok(())
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn hparams(&self) -> &Hparams {
        &self.hp
    }
    fn backend_name(&self) -> &'static str {
        "cpu"
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    fn batched_bench(&mut self, _: usize, _: usize, _: usize, _: usize) -> Result<BatchedResult> {
        Err(Self::refused("the batched bench (--parallel)"))
    }
}
