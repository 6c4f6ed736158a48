//! A few threads kept for the serving loop's constraint work (masks while the forward pass
//! runs, the tokens drawn taken after it): handing them a chunk costs a channel message where
//! starting a thread costs ~20 µs, more than a mask over a small vocabulary.

use std::sync::mpsc;
use std::thread::JoinHandle;

type Task = Box<dyn FnOnce() + Send>;

pub struct Workers {
    tx: Vec<mpsc::Sender<Task>>,
    threads: Vec<JoinHandle<()>>,
}

/// Results on their way back from [`Workers::map`].
pub struct Pending<R> {
    rx: mpsc::Receiver<(usize, Vec<R>)>,
    chunks: usize,
}

/// Fewest items a chunk is given (a chunk is a message and a wake-up).
const MIN_CHUNK: usize = 4;

impl Workers {
    /// `n` threads (at least one). None: the system refused a thread.
    pub fn new(n: usize) -> Option<Workers> {
        let mut w = Workers {
            tx: Vec::new(),
            threads: Vec::new(),
        };
        for i in 0..n.max(1) {
            let (tx, rx) = mpsc::channel::<Task>();
            let t = std::thread::Builder::new()
                .name(format!("quiver-constraints-{i}"))
                .spawn(move || {
                    for task in rx {
                        // A panic ends its chunk (whose results never come), not the thread.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
                    }
                })
                .ok()?;
            w.tx.push(tx);
            w.threads.push(t);
        }
        Some(w)
    }

    /// `f` over `items` in chunks across the threads; [`Pending::wait`] gives the results in
    /// order.
    pub fn map<T, R>(&self, items: Vec<T>, f: fn(T) -> R) -> Pending<R>
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        let per = MIN_CHUNK.max(items.len().div_ceil(self.tx.len()));
        let (rtx, rx) = mpsc::channel();
        let mut items = items.into_iter();
        let mut chunks = 0;
        loop {
            let chunk: Vec<T> = items.by_ref().take(per).collect();
            if chunk.is_empty() {
                break;
            }
            let rtx = rtx.clone();
            let k = chunks;
            let task: Task = Box::new(move || {
                let _ = rtx.send((k, chunk.into_iter().map(f).collect()));
            });
            // (A thread cannot have gone: a panic ends its task, not the thread.)
            let _ = self.tx[k % self.tx.len()].send(task);
            chunks += 1;
        }
        Pending { rx, chunks }
    }
}

impl<R> Pending<R> {
    /// Every chunk's results, in order; None: a chunk's thread failed.
    pub fn wait(self) -> Option<Vec<R>> {
        let mut got: Vec<Option<Vec<R>>> = (0..self.chunks).map(|_| None).collect();
        for _ in 0..self.chunks {
            let (k, v) = self.rx.recv().ok()?;
            got[k] = Some(v);
        }
        Some(got.into_iter().flatten().flatten().collect())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.tx.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_order_and_a_panic_is_reported() {
        let w = Workers::new(3).unwrap();
        for n in [0, 1, 5, 37] {
            let got = w.map((0..n).collect(), |x: u64| x * x).wait().unwrap();
            assert_eq!(got, (0..n).map(|x| x * x).collect::<Vec<_>>());
        }
        let bad = w.map(vec![1u32, 2, 0, 4], |x| 10 / x).wait();
        assert!(bad.is_none());
        // Every thread still works.
        let again = w.map((0..12).collect(), |x: u32| x + 1).wait();
        assert_eq!(again, Some((1..13).collect()));
    }
}
