//! A persistent thread pool with a low-overhead parallel-for.
//!
//! Workers are spawned once. [`ThreadPool::run`] publishes a job (a borrowed closure and a
//! task count) by bumping an epoch counter; workers that are spinning see it within a few
//! hundred nanoseconds, workers that have been idle longer than the spin window are parked
//! and get unparked. Tasks are handed out through one atomic counter (dynamic scheduling),
//! the calling thread takes tasks too, and `run` returns when every task has finished.
//! Nothing is allocated or spawned per call.
//!
//! A second `run` from another thread while one is in flight (or a nested `run` from inside
//! a task) does not wait: it runs its tasks serially on its own thread.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks, by default.
const DEFAULT_SPIN: Duration = Duration::from_micros(1000);

/// The job a `run` call publishes: lives on the caller's stack for the duration of `run`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n_tasks: usize,
}

struct Shared {
    /// Bumped once per published job (and once at shutdown).
    epoch: AtomicU64,
    /// The epoch of the job workers may still join, or 0 once `run` has closed it.
    open: AtomicU64,
    /// The current job; valid while `open` names its epoch.
    job: AtomicPtr<Job<'static>>,
    /// Next task index to hand out.
    next: Padded<AtomicUsize>,
    /// Tasks finished (or abandoned by a panic) in the current job.
    finished: Padded<AtomicUsize>,
    /// Workers currently inside a job (between joining and leaving).
    entered: AtomicUsize,
    /// Per worker: true while it is (about to be) parked.
    sleeping: Vec<AtomicBool>,
    shutdown: AtomicBool,
    /// Set when a task panicked on a worker.
    panicked: AtomicBool,
    spin: Duration,
}

/// A value alone on its cache line (the task counters are hit by every thread per task).
#[repr(align(64))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Persistent worker threads and a parallel-for over task indices.
pub struct ThreadPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    threads: Vec<Thread>,
    /// Serialises `run` calls; a call that cannot take it runs serially.
    lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in total, the caller included (so `n_threads - 1`
    /// workers are spawned). `0` means the number of available cores.
    pub fn new(n_threads: usize) -> std::io::Result<ThreadPool> {
        ThreadPool::with_spin(n_threads, DEFAULT_SPIN)
    }

    /// As [`ThreadPool::new`] with the idle spin window given.
    pub fn with_spin(n_threads: usize, spin: Duration) -> std::io::Result<ThreadPool> {
        let n = if n_threads == 0 {
            default_threads()
        } else {
            n_threads
        };
        let n_workers = n - 1;
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            open: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            next: Padded(AtomicUsize::new(0)),
            finished: Padded(AtomicUsize::new(0)),
            entered: AtomicUsize::new(0),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            spin,
        });
        let mut pool = ThreadPool {
            shared: shared.clone(),
            handles: Vec::new(),
            threads: Vec::new(),
            lock: Mutex::new(()),
        };
        for i in 0..n_workers {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("quiver-cpu-{}", i + 1))
                .spawn(move || worker(&s, i))?;
            pool.threads.push(h.thread().clone());
            pool.handles.push(h);
        }
        Ok(pool)
    }

    /// Threads that take tasks (workers plus the caller).
    pub fn n_threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the pool, and returns when all
    /// have finished. Tasks are taken in increasing order from a shared counter. If a task
    /// panics, the panic is re-raised here after every thread has left the job.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.handles.is_empty() {
            (0..n_tasks).for_each(f);
            return;
        }
        let _guard = match self.lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // Busy (another thread's job, or a nested call): do the work here.
                (0..n_tasks).for_each(f);
                return;
            }
        };
        let s = &*self.shared;
        let job = Job { f, n_tasks };
        // Erase the lifetime: workers only dereference the pointer after joining the job
        // (`entered` incremented, then `open` seen naming this epoch), and this function
        // closes the job and waits for `entered` to reach zero before it returns or unwinds,
        // so `job` outlives every use.
        let job_ptr = (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut();
        s.job.store(job_ptr, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let epoch = s.epoch.load(Ordering::Relaxed) + 1;
        s.open.store(epoch, Ordering::SeqCst);
        // Publishes the stores above to workers that acquire the epoch.
        s.epoch.store(epoch, Ordering::SeqCst);
        for (flag, t) in s.sleeping.iter().zip(&self.threads) {
            if flag.swap(false, Ordering::SeqCst) {
                t.unpark();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, &job)));
        // Wait for the tasks, not for the workers: a worker that has not been scheduled yet
        // must not delay the caller (the machine may be shared).
        spin_until(|| s.finished.load(Ordering::Acquire) >= n_tasks);
        // Close the job, then wait for workers that joined it to leave.
        s.open.store(0, Ordering::SeqCst);
        spin_until(|| s.entered.load(Ordering::SeqCst) == 0);
        s.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("ThreadPool::run: a task panicked on a worker thread");
        }
    }
}

/// Spins (yielding now and then) until `cond` holds.
fn spin_until(cond: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !cond() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for t in &self.threads {
            t.unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// The number of cores available to this process (at least 1).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Takes and runs tasks until none are left. A task counts as finished even when it
/// panics, so that `run` never waits forever.
fn take_tasks(s: &Shared, job: &Job<'_>) {
    struct Finish<'a>(&'a AtomicUsize);
    impl Drop for Finish<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Release);
        }
    }
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n_tasks {
            break;
        }
        let _finish = Finish(&s.finished.0);
        (job.f)(i);
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin for the spin window, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) || start.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            // Announce the sleep, then re-check: `run` bumps the epoch before it reads the
            // flag (both SeqCst), so either we see the new epoch or it sees the flag.
            s.sleeping[index].store(true, Ordering::SeqCst);
            if s.epoch.load(Ordering::SeqCst) == seen {
                std::thread::park();
            }
            s.sleeping[index].store(false, Ordering::SeqCst);
        }
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // Join the job only if `run` has not closed it yet (see `run` for the protocol).
        s.entered.fetch_add(1, Ordering::SeqCst);
        if s.open.load(Ordering::SeqCst) == seen {
            let ptr = s.job.load(Ordering::Relaxed);
            if !ptr.is_null() {
                // SAFETY: `run` stored a pointer to a `Job` on its stack before opening epoch
                // `seen`, and it does not return before `entered` drops back to zero, which
                // happens only after our decrement below.
                let job = unsafe { &*ptr };
                if catch_unwind(AssertUnwindSafe(|| take_tasks(s, job))).is_err() {
                    s.panicked.store(true, Ordering::Relaxed);
                }
            }
        }
        s.entered.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        for n_threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n_threads).unwrap();
            for n_tasks in [0, 1, 2, 3, 7, 64, 1000] {
                let hits: Vec<AtomicU32> = (0..n_tasks).map(|_| AtomicU32::new(0)).collect();
                for _ in 0..20 {
                    pool.run(n_tasks, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 20),
                    "{n_threads} threads, {n_tasks} tasks"
                );
            }
        }
    }

    #[test]
    fn zero_means_all_cores() {
        let pool = ThreadPool::new(0).unwrap();
        assert_eq!(pool.n_threads(), default_threads());
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::with_spin(3, Duration::from_micros(10)).unwrap();
        let sum = AtomicUsize::new(0);
        for round in 0..5 {
            std::thread::sleep(Duration::from_millis(5));
            pool.run(100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 4950 * (round + 1));
        }
    }

    #[test]
    fn nested_and_concurrent_runs_complete() {
        let pool = Arc::new(ThreadPool::new(2).unwrap());
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let p = pool.clone();
                std::thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..200 {
                        p.run(5, &|_| {
                            c.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    c.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 1000);
        }
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 5 {
                    panic!("task 5");
                }
            })
        }));
        assert!(r.is_err());
        let c = AtomicUsize::new(0);
        pool.run(8, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 8);
    }
}
