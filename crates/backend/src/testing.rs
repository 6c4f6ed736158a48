//! Helpers the backends' op-parity tests share: random inputs, relative error, and the
//! two-sequence paged batch every op is checked over.

use crate::{Batch, KvSpec, KvType, SeqSpan, KV_BLOCK_SIZE};

/// An f16 cache of one layer: `n_slots` positions of `kv_dim` values.
pub fn kv_spec(n_slots: usize, kv_dim: usize) -> KvSpec {
    KvSpec {
        k: KvType::F16,
        v: KvType::F16,
        block_size: KV_BLOCK_SIZE,
        n_slots,
        layer_dims: vec![kv_dim],
    }
}

/// xorshift64 floats in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
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
        },
        SeqSpan {
            start: 1,
            len: 5,
            kv_len: 5,
            block_table: vec![3, 10],
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
