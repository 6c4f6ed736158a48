//! llama-batched-bench's measurement on quiver's forward: `parallel` sequences of `n_prompt`
//! random prompt tokens each, prefilled together in steps of at most `step_tokens` tokens, then
//! `n_gen` decode steps of one token per sequence, greedy (argmax on the device), timed apart as
//! llama-batched-bench's S_PP and S_TG. The KV of the
//! sequences lives in one paged pool, each sequence in its own blocks.

use crate::batch::{BatchBuilder, Blocks};
use crate::picker::{Fetch, Picker};
use crate::sampler::{Sampler, SamplerParams};
use crate::types::{Result, BLOCK_SIZE};
use quiver_backend::Backend;
use quiver_models::{Model, ModelError};

#[derive(Clone, Debug)]
pub struct BatchedResult {
    pub parallel: usize,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub pp_secs: f64,
    pub tg_secs: f64,
    /// The ids each sequence produced: one from the prefill, then one per decode step.
    pub tokens: Vec<Vec<u32>>,
}

impl BatchedResult {
    /// Prompt tokens per second, summed over the sequences.
    pub fn pp_tps(&self) -> f64 {
        (self.parallel * self.n_prompt) as f64 / self.pp_secs.max(1e-12)
    }
    /// Generated tokens per second, summed over the sequences.
    pub fn tg_tps(&self) -> f64 {
        (self.parallel * self.n_gen) as f64 / self.tg_secs.max(1e-12)
    }
}

/// The prompt of sequence `s` (the same whatever `parallel` is, so runs are comparable).
pub fn bench_prompt(s: usize, n: usize, n_vocab: usize) -> Vec<u32> {
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ ((s as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n_vocab as u64) as u32
        })
        .collect()
}

pub fn batched_bench<B: Backend>(
    b: &mut B,
    model: &Model<B>,
    n_prompt: usize,
    n_gen: usize,
    parallel: usize,
    step_tokens: usize,
) -> Result<BatchedResult> {
    let (n_prompt, parallel) = (n_prompt.max(1), parallel.max(1));
    let nv = model.hp.n_vocab;
    let per_seq = (n_prompt + n_gen).div_ceil(BLOCK_SIZE);
    let n_slots = parallel * per_seq * BLOCK_SIZE;
    // Room for a padded decode batch (a backend may round it up to a graph bucket).
    let rows = parallel.next_power_of_two();
    let step_tokens = step_tokens.max(rows);
    let mut state = model.state_with_seqs(b, n_slots, step_tokens, rows, parallel)?;
    let tables: Vec<Vec<u32>> = (0..parallel)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..parallel)
        .map(|s| bench_prompt(s, n_prompt, nv))
        .collect();
    let mut next = vec![0u32; parallel];
    let mut greedy = Sampler::new(SamplerParams::greedy());
    let mut bb = BatchBuilder::default();
    let mut picker = Picker::default();

    // Prefill: the prompts back to back, cut into steps.
    let t0 = std::time::Instant::now();
    let total = parallel * n_prompt;
    let mut done = 0;
    while done < total {
        let end = (done + step_tokens).min(total);
        bb.begin();
        let mut last_of = Vec::new();
        let mut i = done;
        while i < end {
            let (s, p) = (i / n_prompt, i % n_prompt);
            let len = (n_prompt - p).min(end - i);
            let ends = p + len == n_prompt;
            bb.push_seq(
                &prompts[s][p..p + len],
                p,
                Blocks::Table(&tables[s]),
                ends.then_some(len - 1),
            )
            .decode_from(n_prompt)
            .state_slot(s as u32);
            if ends {
                last_of.push(s);
            }
            i += len;
        }
        model.forward(b, &mut state, bb.batch())?;
        if !last_of.is_empty() {
            picker
                .fetch(b, &state.logits, last_of.len(), nv, Fetch::Argmax)
                .map_err(ModelError::from)?;
            for (k, &s) in last_of.iter().enumerate() {
                next[s] = picker.pick(k, &mut greedy, &[], None, None).token;
            }
        }
        done = end;
    }
    let pp_secs = t0.elapsed().as_secs_f64();

    // Generation: one token per sequence per step.
    let mut tokens: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let t1 = std::time::Instant::now();
    for g in 0..n_gen {
        let pos = n_prompt + g;
        bb.begin();
        for s in 0..parallel {
            bb.push_seq(&next[s..s + 1], pos, Blocks::Table(&tables[s]), Some(0))
                .decode_from(n_prompt)
                .state_slot(s as u32);
        }
        model.forward(b, &mut state, bb.batch())?;
        picker
            .fetch(b, &state.logits, parallel, nv, Fetch::Argmax)
            .map_err(ModelError::from)?;
        for (s, t) in tokens.iter_mut().enumerate() {
            next[s] = picker.pick(s, &mut greedy, &[], None, None).token;
            t.push(next[s]);
        }
    }
    let tg_secs = t1.elapsed().as_secs_f64();
    Ok(BatchedResult {
        parallel,
        n_prompt,
        n_gen,
        pp_secs,
        tg_secs,
        tokens,
    })
}
