//! Tensor parallelism's communicator: the ranks of one model, each holding part of every layer,
//! and the sum all-reduce that joins their partial products ([`Backend::all_reduce`]).
//!
//! The sum has one order whatever the timing: every rank gets `((p_0 + p_1) + p_2) + …`, the
//! ranks' values added in rank order element by element, so every rank holds the same bits
//! and a run is reproducible. [`LocalComm`] joins ranks that are threads of one process (the
//! tests of the sharded model without several GPUs).
//!
//! [`Backend::all_reduce`]: crate::Backend::all_reduce

use crate::{BackendError, Result};
use std::sync::{Arc, Condvar, Mutex, RwLock};

/// Which part of a tensor-parallel model an instance holds: rank `rank` of `size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// The whole model on one rank.
    pub const ONE: Shard = Shard { rank: 0, size: 1 };
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.size)
    }
}

/// A group of ranks that sum their values.
pub trait Comm: Send + Sync {
    /// This rank and the group's size.
    fn shard(&self) -> Shard;
    /// x ← Σ_r x_r over the ranks, added in rank order (`((x_0 + x_1) + x_2) + …`, element by
    /// element): every rank gets the same bits. Every rank calls it with the same length.
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()>;
    /// out ← every rank's x, rank after rank (`out.len()` = size · `x.len()`). Every rank
    /// calls it with the same length.
    fn all_gather(&self, x: &[f32], out: &mut [f32]) -> Result<()>;
    /// This rank leaves the group (it stopped mid-step): every rank's exchange in progress or
    /// later fails instead of waiting for it.
    fn leave(&self);
}

/// [`Backend::all_gather_cols`](crate::Backend::all_gather_cols) over values on the host:
/// x[..rows · width] is this rank's; x becomes every rank's as its columns of rows of
/// size · width, the ranks' values gathered rank after rank into `all` first.
pub fn all_gather_cols(
    comm: &dyn Comm,
    x: &mut [f32],
    rows: usize,
    width: usize,
    all: &mut Vec<f32>,
) -> Result<()> {
    let size = comm.shard().size;
    let (part, row) = (rows * width, size * width);
    if x.len() < rows * row {
        return Err(BackendError::Shape {
            op: "all_gather_cols",
            detail: format!("{} values for {size} ranks of {rows}×{width}", x.len()),
        });
    }
    all.clear();
    all.resize(rows * row, 0.0);
    comm.all_gather(&x[..part], all)?;
    for (r, block) in all.chunks_exact(part.max(1)).enumerate() {
        for (t, src) in block.chunks_exact(width.max(1)).enumerate() {
            x[t * row + r * width..][..width].copy_from_slice(src);
        }
    }
    Ok(())
}

/// Ranks that are threads of one process: [`LocalComm::group`] makes one per rank, each
/// handed to its rank's thread. A rank that drops its communicator (its thread finished or
/// panicked) breaks the group: the others' reductions then fail instead of waiting forever.
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
}

struct Group {
    /// Each rank's values of the reduction in progress.
    slots: Vec<RwLock<Vec<f32>>>,
    gate: Gate,
}

impl LocalComm {
    /// The communicators of `size` ranks (at least 1), rank 0 first.
    pub fn group(size: usize) -> Vec<LocalComm> {
        let size = size.max(1);
        let group = Arc::new(Group {
            slots: (0..size).map(|_| RwLock::new(Vec::new())).collect(),
            gate: Gate::new(size),
        });
        (0..size)
            .map(|rank| LocalComm {
                rank,
                group: group.clone(),
            })
            .collect()
    }
}

impl Comm for LocalComm {
    fn shard(&self) -> Shard {
        Shard {
            rank: self.rank,
            size: self.group.slots.len(),
        }
    }

    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()> {
        if self.group.slots.len() == 1 {
            return Ok(());
        }
        self.put(x)?;
        // Each rank sums all of them, in rank order.
        self.take(x.len(), |r, p| {
            if r == 0 {
                x.copy_from_slice(p);
            } else {
                x.iter_mut().zip(p).for_each(|(a, b)| *a += b);
            }
        })
    }

    fn all_gather(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        let n = x.len();
        if out.len() != n * self.group.slots.len() {
            return Err(comm_error(format!(
                "gathering {n} values of {} ranks into {}",
                self.group.slots.len(),
                out.len()
            )));
        }
        self.put(x)?;
        self.take(n, |r, p| out[r * n..(r + 1) * n].copy_from_slice(p))
    }
    fn leave(&self) {
        self.group.gate.break_all();
    }
}

impl LocalComm {
    /// Puts this rank's `x` where the others see it, and waits for theirs.
    fn put(&self, x: &[f32]) -> Result<()> {
        let g = &self.group;
        {
            let mut mine = g.slots[self.rank]
                .write()
                .unwrap_or_else(|e| e.into_inner());
            mine.clear();
            mine.extend_from_slice(x);
        }
        g.gate.wait()
    }

    /// After [`LocalComm::put`]: every rank's values to `take` in rank order (each must hold
    /// `len`), then waits for every rank to have read them.
    fn take(&self, len: usize, mut take: impl FnMut(usize, &[f32])) -> Result<()> {
        let g = &self.group;
        let mut result = Ok(());
        for (r, slot) in g.slots.iter().enumerate() {
            let p = slot.read().unwrap_or_else(|e| e.into_inner());
            if p.len() != len {
                result = Err(comm_error(format!(
                    "rank {r} exchanged {} values, rank {} {len}",
                    p.len(),
                    self.rank,
                )));
                break;
            }
            take(r, &p);
        }
        // No rank overwrites its values for the next exchange before all have read them.
        g.gate.wait()?;
        result
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        self.group.gate.break_all();
    }
}

fn comm_error(detail: String) -> BackendError {
    BackendError::Shape {
        op: "all_reduce",
        detail,
    }
}

/// A barrier of `n` ranks that a leaving rank breaks (std's `Barrier` would wait forever).
struct Gate {
    n: usize,
    /// (ranks arrived, generation, broken)
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Gate {
    fn new(n: usize) -> Gate {
        Gate {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Waits for every rank; an error once any rank has left the group.
    fn wait(&self) -> Result<()> {
        let broken = || comm_error("a rank left the group (its thread ended or panicked)".into());
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.2 {
            return Err(broken());
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            (s.0, s.1) = (0, generation + 1);
            self.cv.notify_all();
            return Ok(());
        }
        while s.1 == generation && !s.2 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if s.1 == generation {
            Err(broken())
        } else {
            Ok(())
        }
    }

    fn break_all(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.2 = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f(rank's comm)` on `n` threads, results in rank order.
    fn ranks<T: Send>(n: usize, f: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let hs: Vec<_> = LocalComm::group(n)
                .into_iter()
                .map(|c| s.spawn(|| f(c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_gets_the_rank_ordered_sum() {
        // Values whose sum depends on the order of the additions.
        let part = |r: usize| -> Vec<f32> {
            (0..257)
                .map(|i| [1e8f32, 1.0, -1e8, 3.5e-3][(r + i) % 4] * (1.0 + i as f32 / 7.0))
                .collect()
        };
        for n in [1, 2, 3, 4] {
            let want: Vec<f32> = (0..257)
                .map(|i| (1..n).fold(part(0)[i], |a, r| a + part(r)[i]))
                .collect();
            // Three reductions in a row: the group's buffers are reused.
            let got = ranks(n, |c| {
                let mut last = Vec::new();
                for _ in 0..3 {
                    let mut x = part(c.shard().rank);
                    c.all_reduce_sum(&mut x).unwrap();
                    last = x;
                }
                last
            });
            for (r, x) in got.iter().enumerate() {
                let same = x.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rank {r} of {n}");
            }
        }
        // The order matters for these values: the test could tell a reversed sum.
        let reversed: Vec<f32> = (0..257)
            .map(|i| (0..3).rev().fold(part(3)[i], |a, r| a + part(r)[i]))
            .collect();
        let forward: Vec<f32> = (0..257)
            .map(|i| (1..4).fold(part(0)[i], |a, r| a + part(r)[i]))
            .collect();
        assert_ne!(reversed, forward);
    }

    #[test]
    fn every_rank_gets_every_ranks_values_in_rank_order() {
        for n in [1, 3] {
            let got = ranks(n, |c| {
                let r = c.shard().rank as f32;
                let mut out = vec![0.0; 2 * n];
                c.all_gather(&[r, -r - 0.5], &mut out).unwrap();
                assert!(c.all_gather(&[r], &mut out).is_err()); // out of the wrong length
                out
            });
            let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, -(r as f32) - 0.5]).collect();
            assert!(got.iter().all(|g| *g == want), "{got:?}");
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_and_lengths_must_agree() {
        let errs = ranks(3, |c| {
            if c.shard().rank == 2 {
                return None; // drops its communicator without reducing
            }
            Some(c.all_reduce_sum(&mut [1.0; 4]).unwrap_err().to_string())
        });
        assert!(
            errs[0].as_ref().unwrap().contains("left the group"),
            "{errs:?}"
        );
        let errs = ranks(2, |c| {
            let mut x = vec![1.0; 4 + c.shard().rank];
            c.all_reduce_sum(&mut x).map_err(|e| e.to_string())
        });
        assert!(errs
            .iter()
            .all(|e| e.as_ref().unwrap_err().contains("values")));
    }
}
