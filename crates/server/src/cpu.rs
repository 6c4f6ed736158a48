//! CPU work of requests off the HTTP workers: parsing a body, rendering the chat template,
//! tokenizing and detokenizing run on a small pool of threads of its own, so that the two async
//! workers keep answering (`/health`, small requests, streams) whatever the prompts. Big jobs
//! (bodies of 256 KiB and more) have their own lane of fewer threads, at a lower scheduling
//! priority (nice +10 on Linux), so that small requests never queue behind them and the HTTP
//! threads win the cores from them.

use crate::error::ApiError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::oneshot;

/// Bodies from this size on take the heavy lane.
pub const HEAVY_BYTES: usize = 256 << 10;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one queue.
struct Lane {
    tx: Mutex<mpsc::Sender<Job>>,
    threads: usize,
}

impl Lane {
    fn new(name: &str, threads: usize, nice: i32) -> Lane {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    lower_priority(nice);
                    loop {
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::error!("cannot start a {name} thread: {e}");
            }
        }
        Lane {
            tx: Mutex::new(tx),
            threads,
        }
    }

    fn submit(&self, job: Job) -> bool {
        self.tx
            .lock()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false)
    }
}

/// Makes the calling thread yield the cores to others (Linux: per-thread nice value).
fn lower_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    if nice > 0 {
        // SAFETY: setpriority has no memory effects; on Linux, who = 0 with PRIO_PROCESS is
        // the calling thread.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, 0, nice);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

pub struct CpuPool {
    heavy: Lane,
    light: Lane,
}

impl CpuPool {
    /// `cores` CPU cores: `max(1, cores / 2)` heavy threads at nice +10, `max(2, cores)`
    /// light ones.
    pub fn new(cores: usize) -> CpuPool {
        let cores = cores.max(1);
        CpuPool {
            heavy: Lane::new("quiver-cpu-heavy", (cores / 2).max(1), 10),
            light: Lane::new("quiver-cpu", cores.max(2), 0),
        }
    }

    /// (heavy, light) threads.
    pub fn sizes(&self) -> (usize, usize) {
        (self.heavy.threads, self.light.threads)
    }

    /// Runs `f` on the pool (the heavy lane when `size`, the input's size in bytes, is
    /// [`HEAVY_BYTES`] or more) and waits for it. A job whose request went away before its
    /// turn is skipped; a panic in `f` is a 500, not a dropped connection.
    pub async fn run<T, F>(&self, size: usize, f: F) -> Result<T, ApiError>
    where
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
        T: Send + 'static,
    {
        let lane = if size >= HEAVY_BYTES {
            &self.heavy
        } else {
            &self.light
        };
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            if tx.is_closed() {
                return;
            }
            let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
        });
        if !lane.submit(job) {
            return Err(ApiError::internal("the request processing pool is gone"));
        }
        match rx.await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ApiError::internal("request processing panicked")),
            Err(_) => Err(ApiError::internal("request processing failed")),
        }
    }
}

/// The longest token's decoded length in bytes (at least 4: an unknown token stands for one
/// character). Every token the tokenizer emits covers at most this many bytes of the text, so
/// a text of `b` bytes has at least `b / max_token_bytes` tokens.
pub fn max_token_bytes(tok: &quiver_tokenizer::Tokenizer) -> usize {
    (0..tok.n_vocab() as u32)
        .filter_map(|id| tok.token_bytes(id).map(<[u8]>::len))
        .max()
        .unwrap_or(0)
        .max(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn runs_off_the_runtime_and_maps_panics() {
        let p = CpuPool::new(2);
        assert_eq!(p.sizes(), (1, 2));
        let main = std::thread::current().id();
        let other = p
            .run(10, move || Ok(std::thread::current().id() != main))
            .await
            .unwrap();
        assert!(other);
        let e = p
            .run(HEAVY_BYTES, || -> Result<(), ApiError> { panic!("boom") })
            .await
            .unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        // The lane is free again after a panic.
        assert_eq!(p.run(HEAVY_BYTES, || Ok(3)).await.unwrap(), 3);
    }
}
