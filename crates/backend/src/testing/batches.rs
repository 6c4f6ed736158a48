//! The batches every step op is checked over: flat, paged, multi-sequence batches with
//! scattered block tables, from 1 to 151 tokens, decode and prefill mixed.

use super::Rng;
use crate::{Batch, SeqSpan};

/// A batch of the table and the KV pool it runs over.
pub struct TestBatch {
    pub name: &'static str,
    pub batch: Batch,
    /// Positions of the pool (a whole number of the batch's blocks).
    pub n_slots: usize,
}

/// Two sequences in one flat batch: seq 0 decodes 1 token at position 20 (its earlier
/// positions already cached), seq 1 prefills 5 tokens at positions 0..5; blocks of 4 slots,
/// scattered; logits for the first and the last token.
pub fn two_sequence_batch() -> Batch {
    let seqs = vec![
        SeqSpan {
            start: 0,
            len: 1,
            kv_len: 21,
            block_table: vec![7, 2, 9, 0, 5, 11],
            ..Default::default()
        },
        SeqSpan {
            start: 1,
            len: 5,
            kv_len: 5,
            block_table: vec![3, 10],
            ..Default::default()
        },
    ];
    let mut b = Batch {
        tokens: vec![1, 2, 3, 4, 5, 6],
        positions: vec![20, 0, 1, 2, 3, 4],
        seq_of: vec![0, 1, 1, 1, 1, 1],
        seqs,
        logits: vec![0, 5],
        block_size: 4,
        slots: vec![],
    };
    b.slots = (0..6)
        .map(|t| b.slot(b.seq_of[t] as usize, b.positions[t] as usize) as u32)
        .collect();
    b
}

/// A batch of sequences `(first, new)`: each runs `new` tokens at positions
/// `first..first + new`, its positions before `first` already cached. Every sequence's blocks
/// are drawn at random from a pool of `n_slots / block_size` blocks (scattered, none shared);
/// token ids are random below `vocab`; logits for each sequence's last token (all of them,
/// when every sequence decodes one token).
pub fn paged_batch(
    rng: &mut Rng,
    seqs: &[(usize, usize)],
    block_size: usize,
    n_slots: usize,
    vocab: usize,
) -> Batch {
    let mut free: Vec<u32> = (0..(n_slots / block_size) as u32).collect();
    let mut b = Batch {
        block_size,
        ..Batch::default()
    };
    for (s, &(first, new)) in seqs.iter().enumerate() {
        let kv_len = first + new;
        let block_table: Vec<u32> = (0..kv_len.div_ceil(block_size))
            .map(|_| {
                assert!(!free.is_empty(), "the pool is too small for the batch");
                free.swap_remove(rng.below(free.len()))
            })
            .collect();
        b.seqs.push(SeqSpan {
            start: b.tokens.len(),
            len: new,
            kv_len,
            block_table,
            ..Default::default()
        });
        for p in first..kv_len {
            b.tokens.push(rng.below(vocab) as u32);
            b.positions.push(p as u32);
            b.seq_of.push(s as u32);
            b.slots.push(b.slot(s, p) as u32);
        }
        b.logits.push(b.tokens.len() as u32 - 1);
    }
    b
}

/// `n` sequences decoding one token each, sequence s at position `first + s`, over one shared
/// prefix of `first / 16` blocks (a prefix-cache hit's) and blocks of their own from there: a
/// step of many decode rows over long contexts.
pub fn shared_prefix_decodes(
    rng: &mut Rng,
    n: usize,
    first: usize,
    vocab: usize,
) -> (Batch, usize) {
    let block_size = 16;
    let shared = first / block_size;
    let mut next = shared as u32;
    let mut b = Batch {
        block_size,
        ..Batch::default()
    };
    for s in 0..n {
        let p = first + s;
        let mut block_table: Vec<u32> = (0..shared as u32).collect();
        while block_table.len() * block_size <= p {
            block_table.push(next);
            next += 1;
        }
        b.seqs.push(SeqSpan {
            start: s,
            len: 1,
            kv_len: p + 1,
            block_table,
            ..Default::default()
        });
        b.tokens.push(rng.below(vocab) as u32);
        b.positions.push(p as u32);
        b.seq_of.push(s as u32);
        b.slots.push(b.slot(s, p) as u32);
        b.logits.push(s as u32);
    }
    (b, next as usize * block_size)
}

/// The batches of the table (token ids below `vocab`, the first two `vocab - 1` and 0):
/// - 1 token: one sequence decoding at position 37;
/// - 3 tokens: three sequences decoding, one of them its first position;
/// - 6 tokens: [`two_sequence_batch`] (blocks of 4), over a pool of 48 and of 4096 slots;
/// - 9 tokens: a decode, a prefill and a chunk of a longer prompt (blocks of 8);
/// - 64 tokens: two decodes, a 40-token prefill and a 22-token chunk, in a 4096-slot pool;
/// - 151 tokens: a 150-token prefill (three 64-row query tiles) beside a decode at position 70;
/// - 70 tokens: 70 decodes at positions 520–589 over a shared 512-position prefix (more decode
///   rows than one KV-group launch takes, each over more key ranges than its grid is wide).
pub fn batches(rng: &mut Rng, vocab: usize) -> Vec<TestBatch> {
    let mut six = two_sequence_batch();
    for t in six.tokens.iter_mut() {
        *t %= vocab as u32;
    }
    let mut out = vec![
        TestBatch {
            name: "1 token (decode)",
            batch: paged_batch(rng, &[(37, 1)], 16, 128, vocab),
            n_slots: 128,
        },
        TestBatch {
            name: "3 tokens (3 decodes)",
            batch: paged_batch(rng, &[(20, 1), (0, 1), (70, 1)], 16, 256, vocab),
            n_slots: 256,
        },
        TestBatch {
            name: "6 tokens (decode + prefill), 48 slots",
            batch: six.clone(),
            n_slots: 48,
        },
        TestBatch {
            name: "6 tokens (decode + prefill), 4096 slots",
            batch: six,
            n_slots: 4096,
        },
        TestBatch {
            name: "9 tokens (decode + prefill + chunk)",
            batch: paged_batch(rng, &[(20, 1), (0, 5), (30, 3)], 8, 256, vocab),
            n_slots: 256,
        },
        TestBatch {
            name: "64 tokens (2 decodes + prefill + chunk)",
            batch: paged_batch(rng, &[(100, 1), (0, 40), (50, 22), (9, 1)], 16, 4096, vocab),
            n_slots: 4096,
        },
        TestBatch {
            name: "151 tokens (prefill + decode)",
            batch: paged_batch(rng, &[(0, 150), (70, 1)], 16, 512, vocab),
            n_slots: 512,
        },
    ];
    let (batch, n_slots) = shared_prefix_decodes(rng, 70, 520, vocab);
    out.push(TestBatch {
        name: "70 decodes over a shared prefix, 521-590 keys",
        batch,
        n_slots,
    });
    for b in &mut out {
        // The first and the last row of the table are looked up.
        let t = &mut b.batch.tokens;
        t[0] = vocab as u32 - 1;
        if t.len() > 1 {
            t[1] = 0;
        }
        b.batch
            .validate(b.n_slots)
            .unwrap_or_else(|e| panic!("{}: {e}", b.name));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batches_are_valid_and_scattered() {
        let mut rng = Rng(7);
        let bs = batches(&mut rng, 96);
        let counts: Vec<usize> = bs.iter().map(|b| b.batch.n_tokens()).collect();
        assert_eq!(counts, [1, 3, 6, 6, 9, 64, 151, 70]);
        for b in &bs {
            // No two tokens write one slot, and no token writes a block another sequence's
            // table holds (shared blocks are a prefix's, read only).
            let mut slots = b.batch.slots.clone();
            slots.sort_unstable();
            slots.dedup();
            assert_eq!(slots.len(), b.batch.n_tokens(), "{}", b.name);
            let bs = b.batch.block_size as u32;
            for (t, &slot) in b.batch.slots.iter().enumerate() {
                let own = b.batch.seq_of[t] as usize;
                for (s, span) in b.batch.seqs.iter().enumerate() {
                    let holds = span.block_table.contains(&(slot / bs));
                    assert_eq!(
                        holds,
                        s == own,
                        "{}: token {t}'s block in sequence {s}",
                        b.name
                    );
                }
            }
            assert!(
                b.batch.slots.iter().all(|&x| (x as usize) < b.n_slots),
                "{}",
                b.name
            );
            assert!(b.batch.tokens.iter().all(|&t| t < 96));
        }
        // Some block is shared.
        let last = &bs[7].batch.seqs;
        assert_eq!(last[0].block_table[..32], last[69].block_table[..32]);
        // The 151-token prefill is not laid out in order.
        let t = &bs[6].batch.seqs[0].block_table;
        assert!(t.windows(2).any(|w| w[1] != w[0] + 1));
    }
}
