//! The random weights of `quiver synth`: a pool of N(0, 0.02²) values, rows taken from it at
//! pseudo-random places and quantized; for the large matrices of the slow quantizers
//! (K-quants, IQ types) rows of pre-quantized pool blocks instead.

use crate::{deep, Init, Preset};
use quiver_gguf::GgmlType;
use std::collections::HashMap;

/// Deterministic pseudo-random weights: a pool of N(0, 0.02²) values generated once from
/// the seed; every row starts at a pseudo-random place in it.
pub(crate) struct Weights {
    pool: Vec<f32>,
    state: u64,
}

const POOL: usize = 1 << 20;

impl Weights {
    pub(crate) fn new(seed: u64) -> Self {
        let mut s = seed ^ 0x5DEECE66D;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut pool = Vec::with_capacity(POOL);
        while pool.len() < POOL {
            // Box-Muller
            let (u1, u2) = (next().max(1e-300), next());
            let r = (-2.0 * u1.ln()).sqrt() * 0.02;
            let t = std::f64::consts::TAU * u2;
            pool.push((r * t.cos()) as f32);
            pool.push((r * t.sin()) as f32);
        }
        Weights {
            pool,
            state: seed.wrapping_mul(0x9E3779B97F4A7C15) | 1,
        }
    }

    pub(crate) fn row_start(&mut self) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state % POOL as u64) as usize
    }

    pub(crate) fn fill_row(&self, start: usize, out: &mut [f32]) {
        let mut pos = start;
        let mut done = 0;
        while done < out.len() {
            let n = (out.len() - done).min(POOL - pos);
            out[done..done + n].copy_from_slice(&self.pool[pos..pos + n]);
            done += n;
            pos = 0;
        }
    }
}

pub(crate) fn quantize_rows(
    w: &Weights,
    starts: &[usize],
    cols: usize,
    scale: f32,
    ty: GgmlType,
    threads: usize,
) -> Result<Vec<u8>, String> {
    let threads = threads.max(1).min(starts.len().max(1));
    let per = starts.len().div_ceil(threads);
    let chunks: Vec<Result<Vec<u8>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = starts
            .chunks(per.max(1))
            .map(|chunk| {
                s.spawn(move || {
                    let mut row = vec![0f32; cols];
                    let mut out = Vec::new();
                    for &st in chunk {
                        w.fill_row(st, &mut row);
                        if scale != 1.0 {
                            row.iter_mut().for_each(|v| *v *= scale);
                        }
                        quiver_quant::quantize(ty, &row, &mut out).map_err(|e| e.to_string())?;
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("quantizer thread panicked".into()))
            })
            .collect()
    });
    let mut all = Vec::new();
    for c in chunks {
        all.extend_from_slice(&c?);
    }
    Ok(all)
}

/// The values of a norm or bias vector `name` of `n` values.
pub(crate) fn vector(p: &Preset, name: &str, n: usize, weights: &mut Weights) -> Vec<f32> {
    let bias = name.ends_with(".bias");
    // The deep weights' factor on a norm (`deep::norm_factor`).
    let f = match p.init {
        Init::Flat => 1.0,
        Init::Deep => deep::norm_factor(p, name, n),
    };
    if name.starts_with("rope_factors_") {
        // Frequency divisors growing over the pairs, the long ones faster.
        let step = if name.contains("long") { 0.5 } else { 0.05 };
        (0..n).map(|j| 1.0 + step * j as f32).collect()
    } else if p.random_vectors {
        // Norms 1 + N(0, 0.1²), biases N(0, 0.1²).
        let mut row = vec![0f32; n];
        let start = weights.row_start();
        weights.fill_row(start, &mut row);
        row.iter()
            .map(|&v| if bias { 5.0 * v } else { f * (1.0 + 5.0 * v) })
            .collect()
    } else {
        // Norm weights: ones, biases zeros, as a freshly initialised model has.
        vec![if bias { 0.0 } else { f }; n]
    }
}

/// Matrices of at least this many values take pre-quantized rows (`Prequant`) where their type's
/// quantizer is slow.
pub(crate) const PREQUANT_MIN: usize = 1 << 24;

/// Types whose quantizer searches per block (the K-quants and the IQ types): quantizing an 8B
/// shape's matrices with them takes minutes, the other types' seconds.
pub(crate) fn slow_quantizer(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS)
}

/// The pool quantized once per (type, scale), as rows of whole blocks: a row that starts at
/// pool value `s` (a multiple of 32) is the blocks from there on, wrapping at the pool's end.
/// For 256-value blocks the pool is quantized 8 times, from values 0, 32, … 224 (on
/// `quantize_rows`' threads), so that rows still start at 32,768 places. Speed does not depend on the values; the rows repeat where a
/// matrix has more of them than there are places, which only the large matrices (the token
/// embedding and the output excluded, whose equal rows would tie logits) are allowed.
#[derive(Default)]
pub(crate) struct Prequant {
    pools: HashMap<(GgmlType, u32), Vec<Vec<u8>>>,
}

impl Prequant {
    /// The rows of `starts` (pool places, as `Weights::row_start` gives them) of `cols` values
    /// scaled by `scale`, in `ty`'s blocks.
    pub(crate) fn rows(
        &mut self,
        w: &Weights,
        starts: &[usize],
        cols: usize,
        scale: f32,
        ty: GgmlType,
        threads: usize,
    ) -> Result<Vec<u8>, String> {
        let (be, bb) = (ty.block_size(), ty.type_size());
        if !be.is_multiple_of(32) || !cols.is_multiple_of(be) {
            return Err(format!("{cols} columns are not whole {be}-value blocks"));
        }
        // The pool from values 0, 32, … be − 32: one "row" of POOL values each.
        let shifts = be / 32;
        let key = (ty, scale.to_bits());
        if let std::collections::hash_map::Entry::Vacant(slot) = self.pools.entry(key) {
            let starts: Vec<usize> = (0..shifts).map(|k| 32 * k).collect();
            let all = quantize_rows(w, &starts, POOL, scale, ty, threads)?;
            slot.insert(all.chunks(all.len() / shifts).map(<[u8]>::to_vec).collect());
        }
        let pools = &self.pools[&key];
        let nblk = POOL / be;
        let mut all = Vec::with_capacity(starts.len() * cols / be * bb);
        for &st in starts {
            let a = st / 32 % (shifts * nblk);
            let (pool, mut j) = (&pools[a % shifts], a / shifts);
            let mut left = cols / be;
            while left > 0 {
                let n = left.min(nblk - j);
                all.extend_from_slice(&pool[j * bb..(j + n) * bb]);
                left -= n;
                j = 0;
            }
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prequantized_rows_are_the_rows_quantized_from_their_start() {
        let w = Weights::new(3);
        let mut pq = Prequant::default();
        for (ty, cols) in [
            (GgmlType::Q4_K, 512),
            (GgmlType::IQ4_NL, 96),
            (GgmlType::Q6_K, 1024),
        ] {
            // Starts at multiples of 32 (and one near the pool's end: the row wraps).
            let starts = [0, 32 * 7, 32 * 1001, POOL - 32 * 3];
            let got = pq.rows(&w, &starts, cols, 1.5, ty, 2).unwrap();
            let want = starts
                .iter()
                .flat_map(|&st| {
                    let mut v = vec![0f32; cols];
                    w.fill_row(st, &mut v);
                    v.iter_mut().for_each(|x| *x *= 1.5);
                    let mut out = Vec::new();
                    quiver_quant::quantize(ty, &v, &mut out).unwrap();
                    out
                })
                .collect::<Vec<u8>>();
            assert_eq!(got, want, "{ty}");
        }
    }
}
