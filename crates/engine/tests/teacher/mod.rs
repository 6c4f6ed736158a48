//! Teacher-forced scoring shared by the architecture comparisons with llama.cpp (archs.rs,
//! llama_archs.rs): every row's logits over a fixture's tokens, and their log-softmax.

use quiver_backend::Backend;
use quiver_engine::{ModelRunner, Want};

/// The logits of every position of `tokens`: the first `n_prompt` as one prompt, then one
/// token a step, each step's last row.
pub fn teacher_forced<B: Backend>(
    r: &mut ModelRunner<B>,
    tokens: &[u32],
    n_prompt: usize,
) -> Vec<f32> {
    let mut rows = r
        .eval(&tokens[..n_prompt], 0, Want::From(0))
        .unwrap()
        .to_vec();
    for (k, &t) in tokens[n_prompt..].iter().enumerate() {
        rows.extend_from_slice(r.eval(&[t], n_prompt + k, Want::Last).unwrap());
    }
    rows
}

pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}
