//! The one token picker: reads back what a step's logits rows need ([`Fetch`]: the device's
//! argmax, its k best, or whole rows), then picks each row's token on the host with the row's
//! own sampler, under a constraint's mask when there is one. The runner's single-sequence
//! steps, the serving loop and the batched benchmark all pick through it.

use crate::sampler::{logprobs, Needs, Sampler};
use crate::types::TokenLogprob;
use quiver_backend::{Backend, BackendError};

/// How much of a step's logits the host reads back: the argmax of each row, its k best, or
/// every logit. A GPU sends back one id or k pairs per row instead of the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fetch {
    Argmax,
    TopK(usize),
    Logits,
}

impl Fetch {
    /// What one row needs: its sampler's needs, unless it wants log-probabilities, which need
    /// the whole row. (A constrained row is masked where the logits are, except one with
    /// log-probabilities: the host masks a copy of its whole row.)
    pub fn of(needs: Needs, logprobs: bool) -> Fetch {
        match needs {
            _ if logprobs => Fetch::Logits,
            Needs::Argmax => Fetch::Argmax,
            Needs::TopK(k) => Fetch::TopK(k),
            Needs::Logits => Fetch::Logits,
        }
    }

    /// What a step needs for two kinds of rows together.
    pub fn merge(self, other: Fetch) -> Fetch {
        use Fetch::*;
        match (self, other) {
            (Logits, _) | (_, Logits) => Logits,
            (TopK(a), TopK(b)) => TopK(a.max(b)),
            (TopK(k), Argmax) | (Argmax, TopK(k)) => TopK(k),
            (Argmax, Argmax) => Argmax,
        }
    }
}

/// A constraint on a row's logits (structured output): called on the row before sampling.
pub type Mask<'a> = &'a mut dyn FnMut(&mut [f32]);

/// One row's token and, when asked, its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct Picked {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// The one token picker: reads back what a step's rows need ([`Picker::fetch`]), then picks
/// each row's token with its own sampler ([`Picker::pick`]). The draw stays on the host, so a
/// seed gives the same text whatever the device.
#[derive(Default)]
pub struct Picker {
    fetched: Option<Fetch>,
    n_vocab: usize,
    ids: Vec<u32>,
    top: Vec<(u32, f32)>,
    /// Every logit of the rows, when the fetch read them all.
    pub(crate) host: Vec<f32>,
}

impl Picker {
    pub fn fetch<B: Backend>(
        &mut self,
        backend: &B,
        logits: &B::Buf,
        rows: usize,
        n_vocab: usize,
        how: Fetch,
    ) -> std::result::Result<(), BackendError> {
        self.fetched = None;
        self.n_vocab = n_vocab;
        match how {
            Fetch::Argmax => backend.argmax(logits, rows, n_vocab, &mut self.ids)?,
            Fetch::TopK(k) => backend.top_k(logits, rows, n_vocab, k, &mut self.top)?,
            Fetch::Logits => backend.read(logits, rows * n_vocab, &mut self.host)?,
        }
        self.fetched = Some(how);
        Ok(())
    }

    /// Row `r`'s logits, when the fetch read them all.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        (self.fetched == Some(Fetch::Logits))
            .then(|| &self.host[r * self.n_vocab..][..self.n_vocab])
    }

    /// Row `r`'s token. `history` is the sequence's tokens so far (penalties), `logprobs` the
    /// number of top log-probabilities wanted, `mask` a constraint on the logits. The fetch
    /// must have been made for what this row needs (`Fetch::of`, merged over the rows).
    pub fn pick(
        &mut self,
        r: usize,
        sampler: &mut Sampler,
        history: &[u32],
        logprobs_n: Option<usize>,
        mask: Option<Mask>,
    ) -> Picked {
        let fetched = self.fetched.expect("Picker::pick before fetch");
        debug_assert!(
            fetched.merge(Fetch::of(sampler.needs(), logprobs_n.is_some())) == fetched
                && (mask.is_none() || fetched == Fetch::Logits),
            "the fetch does not cover this row (a host mask needs the whole row)"
        );
        let token = match fetched {
            Fetch::Argmax => self.ids[r],
            Fetch::TopK(k) => {
                let top = &self.top[r * k..][..k];
                match sampler.needs() {
                    Needs::Argmax => top[0].0,
                    _ => sampler.sample_top(top),
                }
            }
            Fetch::Logits => {
                let nv = self.n_vocab;
                let row = &mut self.host[r * nv..][..nv];
                // Log-probabilities are the model's (before any constraint).
                let lp = |row: &[f32], token| {
                    logprobs_n.map(|n| {
                        let (logprob, top) = logprobs(row, token, n);
                        TokenLogprob { logprob, top }
                    })
                };
                return match mask {
                    None => {
                        let token = sampler.sample(row, history);
                        Picked {
                            token,
                            logprob: lp(row, token),
                        }
                    }
                    Some(mask) => {
                        let raw = logprobs_n.is_some().then(|| row.to_vec());
                        mask(row);
                        let token = sampler.sample(row, history);
                        Picked {
                            token,
                            logprob: raw.and_then(|raw| lp(&raw, token)),
                        }
                    }
                };
            }
        };
        Picked {
            token,
            logprob: None,
        }
    }
}
