//! A step's rows by kind: decode rows (a request's generated tokens, whichever step computes
//! them; `SeqSpan::decode_from`) and prompt rows. With [`Numerics::BatchInvariant`] the kernel
//! table (plan.rs) gives each kind its own families: for the int8 types, decode rows the
//! exact-sum kernels (mmvqc, imv, imm: the same bits for any count) and prompt rows a
//! tensor-core kernel whose per-element order does not depend on how a prompt is chunked (wmm on
//! Hopper, qmm unsplit before it), so that every row's product is the same whatever shares its
//! step, at prompt speed. The scheduler puts a step's
//! decode rows first, so the kinds are two ranges of rows.

use crate::CudaBackend;
use quiver_backend::{Batch, Numerics};

/// Which kernels a product's rows take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Decode,
    Prompt,
}

/// The current step's rows (with graph padding) and how many of them, from the first, are
/// decode rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Kinds {
    pub(crate) rows: usize,
    pub(crate) decode: usize,
}

/// Whether some row of `batch` is known to be a prompt row.
pub(crate) fn has_prompt_rows(batch: &Batch) -> bool {
    batch.seqs.iter().any(|s| {
        s.decode_from != usize::MAX
            && s.len > 0
            && (batch.positions[s.start] as usize) < s.decode_from
    })
}

/// The leading decode rows of `batch`: rows whose position is at or past their sequence's
/// `decode_from`, up to the first that is not.
pub(crate) fn leading_decode_rows(batch: &Batch) -> usize {
    (0..batch.n_tokens())
        .take_while(|&t| {
            let s = &batch.seqs[batch.seq_of[t] as usize];
            batch.positions[t] as usize >= s.decode_from
        })
        .count()
}

impl CudaBackend {
    /// How many of a product's `n` rows, from the first, take the decode kernels: all of them
    /// unless the kinds route the products ([`Numerics::BatchInvariant`]) and the product is
    /// over the step's rows.
    pub(crate) fn decode_rows(&self, n: usize) -> usize {
        let k = self.step.kinds;
        if self.cfg.numerics == Numerics::BatchInvariant && n == k.rows {
            k.decode
        } else {
            n
        }
    }

    /// The one kind of a product's `n` rows; None when it holds both (decode rows first).
    pub(crate) fn kind_of(&self, n: usize) -> Option<Kind> {
        match self.decode_rows(n) {
            0 => Some(Kind::Prompt),
            d if d == n => Some(Kind::Decode),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::tests::spans;

    #[test]
    fn decode_rows_are_the_leading_rows_past_their_prompt() {
        // A decode row, a recompute's generated rows, then a prompt chunk.
        let mut b = spans(&[(1, 30, 20), (3, 12, 12), (4, 0, 9)]);
        assert_eq!(leading_decode_rows(&b), 4);
        assert!(has_prompt_rows(&b));
        b.seqs[2].decode_from = usize::MAX;
        assert_eq!(leading_decode_rows(&b), 4);
        assert!(!has_prompt_rows(&b), "unknown kinds are not prompt rows");
        b.seqs[0].decode_from = 31;
        assert_eq!(leading_decode_rows(&b), 0);
    }
}
