//! The flat batch.

/// One sequence's part of a batch: its tokens are `batch.tokens[start..start + len]`, and
/// after this step its KV holds `kv_len` positions, position p in slot
/// `block_table[p / block_size] * block_size + p % block_size`.
#[derive(Clone, Debug)]
pub struct SeqSpan {
    pub start: usize,
    pub len: usize,
    pub kv_len: usize,
    pub block_table: Vec<u32>,
    /// Positions from this one on are generated tokens (the prompt's length), whichever step
    /// computes them: a backend may compute those rows as decode rows and the others as prompt
    /// rows, each the same way whatever the step holds. `usize::MAX` (the default):
    /// not known; the backend then goes by the step's shape.
    pub decode_from: usize,
    /// The slot of the model's recurrent state (models with one: Qwen 3.5) the sequence
    /// reads and updates; a span starting at position 0 starts from a zero state.
    pub state_slot: u32,
    /// Where the span keeps what a rollback of its last rows needs (`crate::Snapshots`,
    /// `crate::dsv4::Kept`): its index among the step's speculating sequences;
    /// [`SeqSpan::NOT_KEPT`]: nothing kept.
    pub kept_slot: u32,
}

impl SeqSpan {
    /// [`SeqSpan::kept_slot`] of a span that keeps nothing.
    pub const NOT_KEPT: u32 = u32::MAX;
}

impl Default for SeqSpan {
    fn default() -> Self {
        SeqSpan {
            start: 0,
            len: 0,
            kv_len: 0,
            block_table: Vec::new(),
            decode_from: usize::MAX,
            state_slot: 0,
            kept_slot: SeqSpan::NOT_KEPT,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// [n_tokens]
    pub tokens: Vec<u32>,
    /// [n_tokens] position of each token in its sequence
    pub positions: Vec<u32>,
    /// [n_tokens] KV slot each token writes
    pub slots: Vec<u32>,
    /// [n_tokens] index into `seqs`
    pub seq_of: Vec<u32>,
    pub seqs: Vec<SeqSpan>,
    /// Indices of the tokens whose logits are wanted, in output order.
    pub logits: Vec<u32>,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl Batch {
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The slot that holds position `pos` of sequence `s`.
    pub fn slot(&self, s: usize, pos: usize) -> usize {
        let seq = &self.seqs[s];
        seq.block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// A batch of one sequence: `tokens` at positions `start_pos..`, KV laid out in blocks
    /// `block_table`, logits for the listed token indices.
    pub fn single(
        tokens: &[u32],
        start_pos: usize,
        block_table: &[u32],
        block_size: usize,
        logits: Vec<u32>,
    ) -> Batch {
        let n = tokens.len();
        let mut b = Batch {
            tokens: tokens.to_vec(),
            positions: (start_pos..start_pos + n).map(|p| p as u32).collect(),
            slots: Vec::with_capacity(n),
            seq_of: vec![0; n],
            seqs: vec![SeqSpan {
                start: 0,
                len: n,
                kv_len: start_pos + n,
                block_table: block_table.to_vec(),
                ..Default::default()
            }],
            logits,
            block_size,
        };
        b.slots = (start_pos..start_pos + n)
            .map(|p| b.slot(0, p) as u32)
            .collect();
        b
    }

    /// Refills this batch in place (no allocation once it has grown) as one sequence:
    /// `tokens` at positions `start_pos..`, KV blocks `0..n_blocks` in order, logits for the
    /// tokens from index `logits_from` on.
    pub fn fill_single(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        n_blocks: usize,
        block_size: usize,
        logits_from: usize,
    ) {
        let n = tokens.len();
        self.block_size = block_size;
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.positions.clear();
        self.positions
            .extend((start_pos..start_pos + n).map(|p| p as u32));
        self.slots.clear();
        self.slots.extend_from_slice(&self.positions);
        self.seq_of.clear();
        self.seq_of.resize(n, 0);
        self.seqs.truncate(1);
        if self.seqs.is_empty() {
            self.seqs.push(SeqSpan::default());
        }
        let s = &mut self.seqs[0];
        (s.start, s.len, s.kv_len) = (0, n, start_pos + n);
        if s.block_table.len() != n_blocks
            || s.block_table
                .last()
                .is_some_and(|&b| b as usize != n_blocks - 1)
        {
            s.block_table.clear();
            s.block_table.extend(0..n_blocks as u32);
        }
        self.logits.clear();
        self.logits.extend(logits_from.min(n) as u32..n as u32);
    }

    /// Checks internal consistency; backends call this before running a step.
    pub fn validate(&self, n_slots: usize) -> Result<(), String> {
        let n = self.tokens.len();
        if self.positions.len() != n || self.slots.len() != n || self.seq_of.len() != n {
            return Err("batch arrays differ in length".into());
        }
        if self.block_size == 0 {
            return Err("block size 0".into());
        }
        for (si, s) in self.seqs.iter().enumerate() {
            if s.start + s.len > n {
                return Err(format!("sequence {si} spans past the batch"));
            }
            // The kernels that go over a step's sequences take a sequence's rows as its span.
            if self.seq_of[s.start..s.start + s.len]
                .iter()
                .any(|&o| o as usize != si)
            {
                return Err(format!("sequence {si}: a row of its span is another's"));
            }
            if s.block_table.len() * self.block_size < s.kv_len {
                return Err(format!(
                    "sequence {si}: block table too short for {} positions",
                    s.kv_len
                ));
            }
            for &b in &s.block_table {
                if (b as usize + 1).saturating_mul(self.block_size) > n_slots {
                    return Err(format!("sequence {si}: block {b} beyond the KV pool"));
                }
            }
        }
        for t in 0..n {
            let s = self.seq_of[t] as usize;
            if s >= self.seqs.len() || (self.positions[t] as usize) >= self.seqs[s].kv_len {
                return Err(format!("token {t}: bad sequence or position"));
            }
        }
        if self.logits.iter().any(|&i| i as usize >= n) {
            return Err("logits index beyond the batch".into());
        }
        Ok(())
    }
}
