//! [`TpRanks`]: the ranks of a tensor-parallel model as threads of one process, one backend
//! each, driven as one model: each step goes to every rank, rank 0's logits come back.

use crate::{load_shard, ModelError, Result};
use quiver_backend::{Backend, Batch, KvTypes, Shard};
use quiver_gguf::GgufFile;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// One thread per rank, each holding its backend, its part of the model ([`load_shard`]) and
/// its state. A step's error (any rank's) ends every rank: a rank that stops mid-step leaves
/// the group, which fails the others' reductions; later steps are refused.
pub struct TpRanks {
    steps: Vec<Sender<Arc<Batch>>>,
    done: Receiver<(usize, Result<Vec<f32>>)>,
    threads: Vec<JoinHandle<()>>,
    n_vocab: usize,
    failed: bool,
    /// Each rank's weights' bytes as its backend counts them ([`Backend::weights_bytes`]).
    weights: Vec<Option<u64>>,
}

/// What each rank's part of the model is made for: a sequence's context (`n_ctx`: rope
/// factors that depend on it, as `Model::for_context`), the KV cache's types and positions
/// (`n_slots`), and a step's rows and logits rows.
#[derive(Clone, Copy, Debug)]
pub struct TpSizes {
    pub n_ctx: usize,
    pub kv: KvTypes,
    pub n_slots: usize,
    pub max_tokens: usize,
    pub max_logits: usize,
}

impl TpRanks {
    /// Starts a rank on each of `backends` (rank r's backend is rank r of its communicator's
    /// group, in any order), loads its part of `file` for `sizes.n_ctx` and `sizes.kv`, and
    /// makes its state of `sizes`' KV positions, rows and logits rows a step.
    pub fn start<B: Backend + Send + 'static>(
        backends: Vec<B>,
        file: &Arc<GgufFile>,
        sizes: TpSizes,
    ) -> Result<TpRanks> {
        let mut shards: Vec<Shard> = backends.iter().map(|b| b.shard()).collect();
        shards.sort_by_key(|s| s.rank);
        let n = backends.len();
        if n == 0
            || shards
                .iter()
                .enumerate()
                .any(|(rank, &s)| s != Shard { rank, size: n })
        {
            let list: Vec<String> = shards.iter().map(|s| s.to_string()).collect();
            return Err(ModelError::Tp(format!(
                "{n} backends that are not the ranks of one group of {n}: {}",
                list.join(", ")
            )));
        }
        let hp = crate::hparams(file)?;
        let (done_tx, done) = channel();
        let (held_tx, held_rx) = channel();
        let mut ranks = TpRanks {
            steps: Vec::new(),
            done,
            threads: Vec::new(),
            n_vocab: hp.n_vocab,
            failed: false,
            weights: vec![None; n],
        };
        for mut b in backends {
            let (tx, rx) = channel::<Arc<Batch>>();
            let (file, done, held) = (file.clone(), done_tx.clone(), held_tx.clone());
            let rank = b.shard().rank;
            ranks.steps.push(tx);
            ranks.threads.push(std::thread::spawn(move || {
                let loaded = load_shard(&b, &file, b.shard()).and_then(|mut m| {
                    m.for_context(sizes.n_ctx);
                    m.set_kv_types(sizes.kv)?;
                    let s = m.state(&b, sizes.n_slots, sizes.max_tokens, sizes.max_logits)?;
                    Ok((m, s))
                });
                let (m, mut s) = match loaded {
                    Ok(ms) => ms,
                    Err(e) => {
                        _ = done.send((rank, Err(e)));
                        return;
                    }
                };
                _ = held.send((rank, b.weights_bytes()));
                _ = done.send((rank, Ok(Vec::new())));
                for batch in rx {
                    let mut logits = Vec::new();
                    let r = m.forward(&mut b, &mut s, &batch).and_then(|_| {
                        let n = batch.logits.len() * m.hp.n_vocab;
                        if rank == 0 {
                            b.read(&s.logits, n, &mut logits)?;
                        }
                        Ok(logits)
                    });
                    let stop = r.is_err();
                    _ = done.send((rank, r));
                    if stop {
                        return; // dropping the backend leaves the group
                    }
                }
            }));
        }
        ranks.collect()?;
        for (rank, w) in held_rx.try_iter() {
            ranks.weights[rank] = w;
        }
        Ok(ranks)
    }

    /// The ranks.
    pub fn size(&self) -> usize {
        self.steps.len()
    }

    /// One forward step of `batch` on every rank: rank 0's logits,
    /// `[batch.logits.len(), n_vocab]`.
    pub fn forward(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        if self.failed {
            return Err(ModelError::Tp("the ranks stopped after an error".into()));
        }
        let batch = Arc::new(batch.clone());
        for tx in &self.steps {
            _ = tx.send(batch.clone());
        }
        self.collect()
    }

    /// Each rank's weights' bytes, as its backend counts them (None: it does not).
    pub fn weights_bytes(&self) -> &[Option<u64>] {
        &self.weights
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Every rank's answer to the last request: rank 0's value, or the first error (rank
    /// order).
    fn collect(&mut self) -> Result<Vec<f32>> {
        let mut got: Vec<Option<Result<Vec<f32>>>> = (0..self.size()).map(|_| None).collect();
        for _ in 0..self.size() {
            match self.done.recv() {
                Ok((rank, r)) if rank < got.len() => got[rank] = Some(r),
                _ => break,
            }
        }
        let mut first = None;
        for (rank, r) in got.into_iter().enumerate() {
            match r {
                Some(Ok(v)) if rank == 0 => first = first.or(Some(Ok(v))),
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    first = Some(Err(e));
                    break;
                }
                None => {
                    first = Some(Err(ModelError::Tp(format!("rank {rank} did not answer"))));
                    break;
                }
            }
        }
        let r = first.unwrap_or_else(|| Err(ModelError::Tp("no ranks".into())));
        self.failed |= r.is_err();
        r
    }
}

impl Drop for TpRanks {
    fn drop(&mut self) {
        self.steps.clear(); // each rank's loop ends
        for t in self.threads.drain(..) {
            _ = t.join();
        }
    }
}
