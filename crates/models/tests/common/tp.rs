//! What the tensor-parallel tests share (models' `tp.rs` on the CPU, engine's `gpu_tp.rs` on
//! CUDA): tiny models of heads and FFN width that 2 and 4 ranks divide, a fixed run of steps
//! and each step's logits, compared bit for bit.

#![allow(dead_code)] // each includer uses its part

use quiver_backend::{Backend, Batch, SeqSpan, KV_BLOCK_SIZE};
use quiver_gguf::GgufFile;
use quiver_models::Model;
use std::sync::Arc;

/// The tiny preset `name` with the heads and FFN width of tiny-llama's tests (8, 4, 1024).
pub fn preset_of(name: &str) -> quiver_synth::Preset {
    quiver_synth::Preset {
        n_head: 8,
        n_head_kv: 4,
        n_ff: 1024,
        ..quiver_synth::preset(name).unwrap().clone()
    }
}

/// `p`'s file of type `ty` (random weights, seed 7), opened (the file itself removed).
pub fn synth(p: &quiver_synth::Preset, ty: &str, tag: &str) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-tp-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}-{ty}.gguf"));
    let ft = quiver_synth::file_type(ty).unwrap();
    quiver_synth::write(p, ft, 7, &path, 1, |_, _| {}).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    // Read through its mapping from here on.
    let _ = std::fs::remove_file(&path);
    f
}

/// A batch of the listed sequences' spans: (sequence, tokens, first position), every row's
/// logits wanted. Sequence s has blocks 2s and 2s + 1.
pub fn batch(spans: &[(u32, &[u32], usize)]) -> Batch {
    let mut b = Batch {
        block_size: KV_BLOCK_SIZE,
        ..Default::default()
    };
    for &(seq, tokens, at) in spans {
        let si = b.seqs.len();
        let table = vec![2 * seq, 2 * seq + 1];
        for (j, &t) in tokens.iter().enumerate() {
            let pos = at + j;
            b.tokens.push(t);
            b.positions.push(pos as u32);
            b.slots.push(
                table[pos / KV_BLOCK_SIZE] * KV_BLOCK_SIZE as u32 + (pos % KV_BLOCK_SIZE) as u32,
            );
            b.seq_of.push(si as u32);
        }
        b.seqs.push(SeqSpan {
            start: b.tokens.len() - tokens.len(),
            len: tokens.len(),
            kv_len: at + tokens.len(),
            block_table: table,
            ..Default::default()
        });
    }
    b.logits = (0..b.tokens.len() as u32).collect();
    b
}

/// A prompt of two sequences in one step (7 and 5 tokens), decode steps of both (listed in
/// either order), and one of sequence 0 alone.
pub fn steps() -> Vec<Batch> {
    vec![
        batch(&[
            (0, &[1, 17, 300, 42, 9, 505, 3], 0),
            (1, &[5, 250, 77, 8, 100], 0),
        ]),
        batch(&[(0, &[12], 7), (1, &[13], 5)]),
        batch(&[(1, &[400], 6), (0, &[401], 8)]),
        batch(&[(0, &[2], 9)]),
        batch(&[(0, &[33], 10), (1, &[34], 7)]),
    ]
}

/// Every step's logits.
pub fn run<B: Backend>(b: &mut B, m: &Model<B>) -> Vec<Vec<f32>> {
    let mut s = m.state(b, 4 * KV_BLOCK_SIZE, 16, 16).unwrap();
    let n_vocab = m.hp.n_vocab;
    steps()
        .iter()
        .map(|batch| {
            m.forward(b, &mut s, batch).unwrap();
            let mut v = Vec::new();
            b.read(&s.logits, batch.logits.len() * n_vocab, &mut v)
                .unwrap();
            v
        })
        .collect()
}

pub fn bits_differ(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter()
                .zip(y)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count()
        })
        .sum()
}
