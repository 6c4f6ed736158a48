//! A draft head beside a [`ModelRunner`]'s one sequence (`quiver run`, `quiver chat` with
//! `--spec-type eagle3 -md HEAD` or `--spec-type mtp`): the serving loop's head
//! ([`crate::eagle`]) with the sequence as request 0. Every forward step of the runner hands
//! the head the target's states of its rows, and
//! [`Session::propose_head`](crate::Session::propose_head) catches the head's KV up with them
//! and drafts. The head's KV has the runner's context, addressed as the
//! runner's (block `k` is positions `16k..`).

use crate::draft::DraftModel;
use crate::runner::ModelRunner;
use crate::spec::DraftJob;
use crate::types::{Result, BLOCK_SIZE};
use quiver_backend::Backend;
use quiver_gguf::GgufFile;
use std::sync::Arc;

pub(crate) struct RunnerEagle<B: Backend> {
    head: DraftModel<B>,
    /// The head's block table: the runner's, every block in order.
    table: Vec<u32>,
    /// Positions whose K/V the head holds.
    done: usize,
}

impl<B: Backend> ModelRunner<B> {
    /// Loads the EAGLE-3 head `head` for this runner's model (`target`, its file) on the same
    /// backend, with the runner's context and KV types; every later step keeps the layers it
    /// reads.
    pub fn attach_eagle3(&mut self, head: &Arc<GgufFile>, target: &Arc<GgufFile>) -> Result<()> {
        let kv = self.model.kv_types;
        let d = DraftModel::load_eagle3(
            &self.backend,
            head,
            target,
            self.n_ctx,
            self.n_batch,
            1,
            kv,
            self.model.hp.n_vocab,
        )?;
        let layers = d.eagle3_layers().expect("an EAGLE-3 head names its layers");
        self.keep_layers(&layers)?;
        self.attach_head(d);
        Ok(())
    }

    /// Loads this runner's model's multi-token-prediction block (`file`: the model's file, or
    /// a sidecar of the block alone) as its draft head, as [`ModelRunner::attach_eagle3`] does
    /// an EAGLE-3 head.
    pub fn attach_mtp(&mut self, file: &Arc<GgufFile>) -> Result<()> {
        let (kv, nv) = (self.model.kv_types, self.model.hp.n_vocab);
        let d = DraftModel::load_mtp(&self.backend, file, self.n_ctx, self.n_batch, 1, kv, nv)?;
        self.attach_head(d);
        Ok(())
    }

    fn attach_head(&mut self, head: DraftModel<B>) {
        self.eagle = Some(Box::new(RunnerEagle {
            head,
            table: (0..(self.n_ctx / BLOCK_SIZE) as u32).collect(),
            done: 0,
        }));
    }

    /// After a step of `rows` tokens at `start_pos..`: the head keeps their states (and holds
    /// no K/V from `start_pos` on: those positions were computed again).
    pub(crate) fn eagle_absorb(&mut self, start_pos: usize, rows: usize) -> Result<()> {
        if let Some(e) = self.eagle.as_mut() {
            e.done = e.done.min(start_pos);
            e.head
                .absorb_one(&mut self.backend, &self.state, start_pos, rows)?;
        }
        Ok(())
    }

    /// See [`Session::propose_head`](crate::Session::propose_head).
    pub(crate) fn eagle_propose(
        &mut self,
        tokens: &[u32],
        len: usize,
        p_min: f32,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let Some(e) = self.eagle.as_mut() else {
            return Ok(());
        };
        // The target's KV holds every token but the last.
        e.done = e.done.min(tokens.len().saturating_sub(1));
        loop {
            let before = e.done;
            let mut job = DraftJob {
                id: 0,
                tokens,
                done: &mut e.done,
                blocks: &e.table,
                slot: 0,
                len,
                p_min,
                out,
            };
            e.head
                .propose(&mut self.backend, std::slice::from_mut(&mut job))?;
            // A long prompt's states go in a step at a time; the last one drafts.
            if !out.is_empty() || e.done == before || e.done + 1 >= tokens.len() {
                return Ok(());
            }
        }
    }
}
