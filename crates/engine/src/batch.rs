//! The one flat-batch builder: every caller (the single-sequence runner, the serving loop,
//! the batched benchmark) fills its step's [`Batch`] through [`BatchBuilder`], reusing its
//! arrays from step to step.

use crate::sched::SchedulerOutput;
use crate::types::BLOCK_SIZE;
use quiver_backend::{Batch, SeqSpan};

/// Where a sequence's KV positions live.
#[derive(Clone, Copy, Debug)]
pub enum Blocks<'a> {
    /// Blocks `0..n` in order (a single sequence owning the whole cache).
    Identity(usize),
    /// A block table from the pool.
    Table(&'a [u32]),
}

pub struct BatchBuilder {
    batch: Batch,
    n_seqs: usize,
}

impl Default for BatchBuilder {
    fn default() -> Self {
        BatchBuilder {
            batch: Batch {
                block_size: BLOCK_SIZE,
                ..Default::default()
            },
            n_seqs: 0,
        }
    }
}

impl BatchBuilder {
    /// Starts a new step (keeps the arrays' capacity).
    pub fn begin(&mut self) -> &mut Self {
        let b = &mut self.batch;
        b.tokens.clear();
        b.positions.clear();
        b.slots.clear();
        b.seq_of.clear();
        b.logits.clear();
        self.n_seqs = 0;
        self
    }

    /// Appends a sequence's step: `tokens` at positions `start_pos..`, its KV in `blocks`,
    /// logits wanted for its tokens from index `logits_from` on (None: no logits).
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        blocks: Blocks,
        logits_from: Option<usize>,
    ) -> &mut Self {
        let b = &mut self.batch;
        let si = self.n_seqs;
        self.n_seqs += 1;
        if b.seqs.len() < self.n_seqs {
            b.seqs.push(SeqSpan::default());
        }
        let start = b.tokens.len();
        let n = tokens.len();
        let span = &mut b.seqs[si];
        (span.start, span.len, span.kv_len) = (start, n, start_pos + n);
        span.decode_from = usize::MAX;
        span.state_slot = 0;
        span.kept_slot = SeqSpan::NOT_KEPT;
        match blocks {
            Blocks::Identity(n_blocks) => {
                span.block_table.clear();
                span.block_table.extend(0..n_blocks as u32);
            }
            Blocks::Table(t) => {
                span.block_table.clear();
                span.block_table.extend_from_slice(t);
            }
        }
        let bs = BLOCK_SIZE;
        for (k, &t) in tokens.iter().enumerate() {
            let p = start_pos + k;
            b.tokens.push(t);
            b.positions.push(p as u32);
            // A table too short for the position leaves a slot `Batch::validate` refuses (the
            // step then fails with an error, not a panic).
            let slot = span
                .block_table
                .get(p / bs)
                .map_or(u32::MAX, |&blk| blk * bs as u32 + (p % bs) as u32);
            b.slots.push(slot);
            b.seq_of.push(si as u32);
        }
        if let Some(from) = logits_from {
            b.logits
                .extend((start + from.min(n)) as u32..(start + n) as u32);
        }
        self
    }

    /// The last pushed sequence's prompt length (`SeqSpan::decode_from`: its rows from there on
    /// are decode rows).
    pub fn decode_from(&mut self, prompt_len: usize) -> &mut Self {
        self.batch.seqs[self.n_seqs - 1].decode_from = prompt_len;
        self
    }

    /// The last pushed sequence's slot of the model's recurrent state
    /// (`SeqSpan::state_slot`; 0 by default).
    pub fn state_slot(&mut self, slot: u32) -> &mut Self {
        self.batch.seqs[self.n_seqs - 1].state_slot = slot;
        self
    }

    /// The last pushed sequence keeps what a rollback of its last rows needs, in kept slot
    /// `k` (`SeqSpan::kept_slot`).
    pub fn kept_slot(&mut self, k: u32) -> &mut Self {
        self.batch.seqs[self.n_seqs - 1].kept_slot = k;
        self
    }

    /// The scheduled step; a request whose step carries proposals keeps what a rollback needs,
    /// the i-th such request of the step in kept slot i ([`kept_slots`]).
    pub fn build_scheduled(&mut self, out: &SchedulerOutput) -> &Batch {
        self.begin();
        for (s, k) in out.scheduled.iter().zip(kept_slots(out)) {
            let (tokens, table) = out.parts(s);
            self.push_seq(tokens, s.start_pos, Blocks::Table(table), s.logits_from)
                .decode_from(s.decode_from)
                .state_slot(s.state_slot)
                .kept_slot(k);
        }
        self.batch()
    }

    /// The batch built since `begin`.
    pub fn batch(&mut self) -> &Batch {
        self.batch.seqs.truncate(self.n_seqs);
        &self.batch
    }
}

/// Each scheduled request's kept slot: the requests whose steps carry proposals numbered in
/// schedule order, the others none (`SeqSpan::NOT_KEPT`).
pub(crate) fn kept_slots(out: &SchedulerOutput) -> impl Iterator<Item = u32> + '_ {
    let mut k = 0;
    out.scheduled.iter().map(move |s| match s.draft {
        0 => SeqSpan::NOT_KEPT,
        _ => {
            k += 1;
            k - 1
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_lay_out_slots_through_their_tables() {
        let mut bb = BatchBuilder::default();
        bb.begin()
            .push_seq(&[1, 2, 3], 15, Blocks::Table(&[4, 9]), Some(2))
            .push_seq(&[7], 0, Blocks::Identity(2), None);
        let b = bb.batch();
        assert_eq!(b.tokens, vec![1, 2, 3, 7]);
        assert_eq!(b.positions, vec![15, 16, 17, 0]);
        assert_eq!(b.slots, vec![4 * 16 + 15, 9 * 16, 9 * 16 + 1, 0]);
        assert_eq!(b.seq_of, vec![0, 0, 0, 1]);
        assert_eq!(b.logits, vec![2]);
        assert_eq!(b.seqs[0].kv_len, 18);
        assert_eq!(b.seqs[1].block_table, vec![0, 1]);
        b.validate(10 * 16).unwrap();
        // A smaller step reuses the builder and drops the stale sequence.
        bb.begin()
            .push_seq(&[5, 6], 0, Blocks::Identity(4), Some(0));
        let b = bb.batch();
        assert_eq!(b.seqs.len(), 1);
        assert_eq!(b.logits, vec![0, 1]);
        assert_eq!(b.seqs[0].block_table, vec![0, 1, 2, 3]);
        b.validate(4 * 16).unwrap();
        // A table too short for the step is a validation error, not a panic.
        bb.begin()
            .push_seq(&[1, 2], 15, Blocks::Table(&[3]), Some(1));
        assert!(bb.batch().validate(64 * 16).is_err());
        // A row inside one sequence's span that names another sequence is refused too.
        bb.begin()
            .push_seq(&[1, 2], 0, Blocks::Identity(1), Some(1))
            .push_seq(&[3], 0, Blocks::Identity(1), Some(0));
        let mut b = bb.batch().clone();
        b.validate(16).unwrap();
        b.seq_of[1] = 1;
        let e = b.validate(16).unwrap_err();
        assert!(e.contains("sequence 0"), "{e}");
    }
}
