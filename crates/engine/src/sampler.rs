//! Token sampling: penalties, logit bias, top-k, top-p, min-p, temperature, seeded draws, and
//! log-probabilities of the raw logits.

/// Sampling settings. `temperature <= 0` means greedy.
#[derive(Clone, Debug)]
pub struct SamplerParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalties look at (0: all).
    pub penalty_last_n: usize,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            penalty_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerParams {
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Plain sampling from the softmax at temperature 1, nothing truncated (the OpenAI API's
    /// defaults).
    pub fn neutral() -> Self {
        SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }
    }
}

/// A small, fast, seedable generator (xoshiro256**), so the same seed gives the same text on
/// every platform.
#[derive(Clone, Debug)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E3779B97F4A7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let r = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    pub params: SamplerParams,
    rng: Rng,
    /// Reused candidate list: (token, logit).
    cand: Vec<(u32, f32)>,
    /// Reused probabilities of `cand`.
    probs: Vec<f64>,
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            cand: Vec::new(),
            probs: Vec::new(),
            counts: Default::default(),
        }
    }

    /// Greedy with nothing that changes logits: the argmax of the raw logits, which a device
    /// can compute without sending the logits back.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.repeat_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.logit_bias.is_empty()
    }

    /// Picks the next token from raw logits, given the tokens so far (prompt and output).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        self.cand.clear();
        self.cand
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // Penalties over the recent window.
        if p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let start = if p.penalty_last_n == 0 {
                0
            } else {
                history.len().saturating_sub(p.penalty_last_n)
            };
            self.counts.clear();
            for &t in &history[start..] {
                *self.counts.entry(t).or_default() += 1;
            }
            for (&t, &c) in &self.counts {
                if let Some(x) = self.cand.get_mut(t as usize) {
                    let l = &mut x.1;
                    if p.repeat_penalty != 1.0 {
                        *l = if *l > 0.0 {
                            *l / p.repeat_penalty
                        } else {
                            *l * p.repeat_penalty
                        };
                    }
                    *l -= c as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(x) = self.cand.get_mut(t as usize) {
                x.1 += b;
            }
        }
        if p.temperature <= 0.0 {
            return argmax_pairs(&self.cand);
        }
        self.finish()
    }

    /// What the next token needs from the logits: their argmax, their k largest, or all.
    pub fn needs(&self) -> Needs {
        if self.is_plain_greedy() {
            Needs::Argmax
        } else if let Some(k) = self.top_k_only() {
            Needs::TopK(k)
        } else {
            Needs::Logits
        }
    }

    /// Some(k) when the next token depends only on the k largest raw logits (top-k on, at most
    /// `MAX_DEVICE_TOP_K`, temperature above 0, nothing that changes logits): a device can send
    /// back just those, and `sample_top` picks from them.
    pub fn top_k_only(&self) -> Option<usize> {
        let p = &self.params;
        let plain = p.repeat_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.logit_bias.is_empty();
        (plain && p.temperature > 0.0 && (1..=MAX_DEVICE_TOP_K).contains(&p.top_k))
            .then_some(p.top_k)
    }

    /// What `sample` returns for a `top_k_only` sampler, given at least its k largest logits as
    /// (id, logit) pairs in any order.
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        self.cand.clear();
        self.cand.extend_from_slice(top);
        self.finish()
    }

    /// top-k, top-p, min-p, temperature and the draw, over `self.cand`.
    fn finish(&mut self) -> u32 {
        let p = &self.params;
        // top-k (0 = off)
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_by(by_logit);
        // softmax at temperature 1 for top-p / min-p (llama.cpp applies temperature last)
        softmax_pairs(&self.cand, 1.0, &mut self.probs);
        let probs = &self.probs;
        let mut keep = self.cand.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        self.cand.truncate(keep.max(1));
        softmax_pairs(&self.cand, p.temperature, &mut self.probs);
        let probs = &self.probs;
        let r = self.rng.next_f64();
        let mut acc = 0.0;
        for (i, &q) in probs.iter().enumerate() {
            acc += q;
            if r < acc {
                return self.cand[i].0;
            }
        }
        self.cand[self.cand.len() - 1].0
    }
}

fn softmax_pairs(c: &[(u32, f32)], temp: f32, out: &mut Vec<f64>) {
    let m = c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    out.clear();
    out.extend(c.iter().map(|x| ((x.1 as f64 - m) / temp as f64).exp()));
    let s: f64 = out.iter().sum();
    out.iter_mut().for_each(|x| *x /= s);
}

fn argmax_pairs(c: &[(u32, f32)]) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for &(t, l) in c {
        if l > best.1 {
            best = (t, l);
        }
    }
    best.0
}

/// The index of the largest logit (the first on ties).
pub use quiver_backend::reference::argmax;

/// What a sampler needs from a row of logits (`Sampler::needs`): a device can send back less
/// than the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    Argmax,
    TopK(usize),
    Logits,
}

/// The largest top-k a device selects for the sampler (`Sampler::top_k_only`).
pub const MAX_DEVICE_TOP_K: usize = 64;

/// log-softmax of the raw logits: (logprob of `token`, top-n (id, logprob) best first).
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> (f32, Vec<(u32, f32)>) {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + logits
        .iter()
        .map(|&l| (l as f64 - m).exp())
        .sum::<f64>()
        .ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = top_n.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, cmp);
    }
    idx.truncate(n);
    idx.sort_by(cmp);
    (
        lp(logits[token as usize]),
        idx.into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37 % 100) as f32) / 10.0).collect()
    }

    #[test]
    fn greedy_is_argmax_and_bias_can_change_it() {
        let l = logits();
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&l, &[]), argmax(&l));
        let mut p = SamplerParams::greedy();
        p.logit_bias = vec![(5, 100.0)];
        assert_eq!(Sampler::new(p).sample(&l, &[]), 5);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_1_is_greedy() {
        let l = logits();
        let p = SamplerParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&l, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&l, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 3,
            "temperature 1.5 should vary"
        );
        let c: Vec<u32> = {
            let mut s = Sampler::new(SamplerParams {
                seed: 7,
                ..p.clone()
            });
            (0..50).map(|_| s.sample(&l, &[])).collect()
        };
        assert_ne!(a, c);
        let mut s = Sampler::new(SamplerParams { top_k: 1, ..p });
        for _ in 0..20 {
            assert_eq!(s.sample(&l, &[]), argmax(&l));
        }
    }

    #[test]
    fn sampling_from_the_top_k_equals_sampling_from_all_logits() {
        // Logits with many ties (quantized to a coarse grid) over a vocabulary of 3000.
        let mut x = 0x1234_5678u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..40u64 {
            let logits: Vec<f32> = (0..3000)
                .map(|_| ((next() % 200) as f32 - 100.0) / 8.0)
                .collect();
            let params = SamplerParams {
                temperature: [0.3f32, 0.8, 1.5][case as usize % 3],
                top_k: [1usize, 2, 7, 40, 64][case as usize % 5],
                top_p: [1.0f32, 0.9, 0.5][case as usize % 3],
                min_p: [0.0f32, 0.05][case as usize % 2],
                seed: case,
                ..Default::default()
            };
            let mut full = Sampler::new(params.clone());
            let mut top = Sampler::new(params);
            let k = top.top_k_only().expect("top-k-only sampler");
            let mut cands = Vec::new();
            quiver_backend::reference::top_k(&logits, k, &mut cands);
            // The device may return them in any order, and more than k of them.
            cands.reverse();
            for _ in 0..20 {
                assert_eq!(
                    full.sample(&logits, &[]),
                    top.sample_top(&cands),
                    "case {case}"
                );
            }
        }
        let mut p = SamplerParams {
            top_k: 40,
            ..Default::default()
        };
        assert_eq!(Sampler::new(p.clone()).top_k_only(), Some(40));
        p.repeat_penalty = 1.1;
        assert_eq!(
            Sampler::new(p.clone()).top_k_only(),
            None,
            "penalties need every logit"
        );
        p.repeat_penalty = 1.0;
        p.top_k = 0;
        assert_eq!(Sampler::new(p.clone()).top_k_only(), None);
        p.top_k = MAX_DEVICE_TOP_K + 1;
        assert_eq!(Sampler::new(p).top_k_only(), None);
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut l = vec![0.0f32; 10];
        l[3] = 2.0;
        l[4] = 1.9;
        let mut p = SamplerParams::greedy();
        p.repeat_penalty = 1.5;
        assert_eq!(Sampler::new(p.clone()).sample(&l, &[3]), 4);
        p.repeat_penalty = 1.0;
        p.presence_penalty = 0.5;
        assert_eq!(Sampler::new(p.clone()).sample(&l, &[3]), 4);
        p.presence_penalty = 0.0;
        p.frequency_penalty = 0.05;
        assert_eq!(Sampler::new(p.clone()).sample(&l, &[3]), 3);
        assert_eq!(Sampler::new(p).sample(&l, &[3, 3, 3]), 4);
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let mut l = vec![-10.0f32; 50];
        l[7] = 5.0;
        l[8] = 4.9;
        let p = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert!((0..100).all(|_| s.sample(&l, &[]) == 7));
        let p = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let got: std::collections::HashSet<u32> = (0..200).map(|_| s.sample(&l, &[])).collect();
        assert_eq!(got, [7, 8].into_iter().collect());
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = vec![1.0f32, 2.0, 3.0];
        let (lp, top) = logprobs(&l, 0, 2);
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
