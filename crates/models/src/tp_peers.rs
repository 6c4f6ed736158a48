//! [`TpPeers`]: the ranks of a tensor-parallel model other than rank 0, as threads of one
//! process (one backend each), following rank 0's steps. Rank 0 stays with its caller (the
//! engine's runner, which reads its logits and picks the tokens); [`TpPeers::forward`] runs a
//! step on every rank at once, as the reductions between them need.

use crate::{load_shard, Model, ModelError, Result, State};
use quiver_backend::{Backend, Batch, KvTypes, Shard};
use quiver_gguf::GgufFile;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// One thread per rank from 1 on, each holding its backend, its part of the model
/// ([`load_shard`]) and its state. A step's error (any rank's) ends every rank: a rank that
/// stops mid-step leaves the group, which fails the others' reductions; later steps are
/// refused.
pub struct TpPeers {
    steps: Vec<Sender<Arc<Batch>>>,
    done: Receiver<(usize, Result<()>)>,
    threads: Vec<JoinHandle<()>>,
    failed: bool,
    /// Each rank's weights' bytes as its backend counts them ([`Backend::weights_bytes`]),
    /// rank 1 first.
    weights: Vec<Option<u64>>,
}

/// What each rank's part of the model is made for: a sequence's context (`n_ctx`: rope
/// factors that depend on it, as `Model::for_context`), the KV cache's types and positions
/// (`n_slots`), and a step's rows and logits rows. Rank 0's state is made of the same.
#[derive(Clone, Copy, Debug)]
pub struct TpSizes {
    pub n_ctx: usize,
    pub kv: KvTypes,
    pub n_slots: usize,
    pub max_tokens: usize,
    pub max_logits: usize,
}

impl TpSizes {
    /// A rank's part of `file` on `b` (a backend of no group: the whole model, [`crate::load`]),
    /// made for these sizes, and its state.
    pub fn load<B: Backend>(&self, b: &B, file: &Arc<GgufFile>) -> Result<(Model<B>, State<B>)> {
        let mut m = match b.shard().size {
            1 => crate::load(b, file)?,
            _ => load_shard(b, file, b.shard())?,
        };
        m.for_context(self.n_ctx);
        m.set_kv_types(self.kv)?;
        let s = m.state(b, self.n_slots, self.max_tokens, self.max_logits)?;
        Ok((m, s))
    }
}

impl TpPeers {
    /// Checks that `backends` are the ranks of one group (in any order) and starts a thread
    /// for each rank from 1 on, which loads its part of `file` for `sizes` (`TpSizes::load`).
    /// Returns rank 0's backend, for the caller to load rank 0 on, and the started ranks.
    pub fn start<B: Backend + Send + 'static>(
        backends: Vec<B>,
        file: &Arc<GgufFile>,
        sizes: TpSizes,
    ) -> Result<(B, TpPeers)> {
        let n = backends.len();
        let mut by_rank: Vec<Option<B>> = (0..n).map(|_| None).collect();
        let mut list = Vec::new();
        for b in backends {
            let s = b.shard();
            list.push(s.to_string());
            match by_rank.get_mut(s.rank) {
                Some(slot @ None)
                    if s == (Shard {
                        rank: s.rank,
                        size: n,
                    }) =>
                {
                    *slot = Some(b)
                }
                _ => by_rank.clear(),
            }
        }
        if n == 0 || by_rank.len() != n {
            list.sort();
            return Err(ModelError::Tp(format!(
                "{n} backends that are not the ranks of one group of {n}: {}",
                list.join(", ")
            )));
        }
        let mut by_rank = by_rank.into_iter().map(|b| b.expect("every rank once"));
        let rank0 = by_rank.next().expect("one rank at least");
        let (done_tx, done) = channel();
        let (held_tx, held_rx) = channel();
        let mut peers = TpPeers {
            steps: Vec::new(),
            done,
            threads: Vec::new(),
            failed: false,
            weights: vec![None; n - 1],
        };
        for mut b in by_rank {
            let (tx, rx) = channel::<Arc<Batch>>();
            let (file, done, held) = (file.clone(), done_tx.clone(), held_tx.clone());
            let rank = b.shard().rank;
            peers.steps.push(tx);
            peers.threads.push(std::thread::spawn(move || {
                let (m, mut s) = match sizes.load(&b, &file) {
                    Ok(ms) => ms,
                    Err(e) => {
                        _ = done.send((rank, Err(e)));
                        return;
                    }
                };
                _ = held.send((rank, b.weights_bytes()));
                _ = done.send((rank, Ok(())));
                for batch in rx {
                    let r = m.forward(&mut b, &mut s, &batch);
                    let stop = r.is_err();
                    _ = done.send((rank, r));
                    if stop {
                        return; // dropping the backend leaves the group
                    }
                }
            }));
        }
        drop(done_tx);
        peers.collect()?;
        for (rank, w) in held_rx.try_iter() {
            peers.weights[rank - 1] = w;
        }
        Ok((rank0, peers))
    }

    /// The group's ranks (rank 0 with these).
    pub fn size(&self) -> usize {
        self.steps.len() + 1
    }

    /// One forward step of `batch` on every rank: rank 0's (`m` and `s` on `b`, on this
    /// thread) while the others run theirs. Rank 0's logits are the whole model's. A rank 0
    /// that fails leaves the group, so that the others stop too.
    pub fn forward<B: Backend>(
        &mut self,
        b: &mut B,
        m: &Model<B>,
        s: &mut State<B>,
        batch: &Batch,
    ) -> Result<()> {
        if self.failed {
            return Err(ModelError::Tp("the ranks stopped after an error".into()));
        }
        let shared = Arc::new(batch.clone());
        for tx in &self.steps {
            _ = tx.send(shared.clone());
        }
        let mine = m.forward(b, s, batch);
        if mine.is_err() {
            b.leave_group();
        }
        let theirs = self.collect();
        self.failed |= mine.is_err();
        mine.and(theirs)
    }

    /// Ranks 1.. weights' bytes, as their backends count them (None: one does not).
    pub fn weights_bytes(&self) -> &[Option<u64>] {
        &self.weights
    }

    /// Every rank's answer to the last request: Ok, or the first error in rank order.
    fn collect(&mut self) -> Result<()> {
        let mut got: Vec<Option<Result<()>>> = (0..self.steps.len()).map(|_| None).collect();
        for _ in 0..got.len() {
            match self.done.recv() {
                Ok((rank, r)) if (1..=got.len()).contains(&rank) => got[rank - 1] = Some(r),
                _ => break,
            }
        }
        let mut r = Ok(());
        for (i, g) in got.into_iter().enumerate() {
            match g {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    r = Err(e);
                    break;
                }
                None => {
                    let rank = i + 1;
                    r = Err(ModelError::Tp(format!("rank {rank} did not answer")));
                    break;
                }
            }
        }
        self.failed |= r.is_err();
        r
    }
}

impl Drop for TpPeers {
    fn drop(&mut self) {
        self.steps.clear(); // each rank's loop ends
        for t in self.threads.drain(..) {
            _ = t.join();
        }
    }
}
