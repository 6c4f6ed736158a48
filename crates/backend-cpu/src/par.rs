//! Splitting an op's rows over the thread pool.

use quiver_cpu_kernels::ThreadPool;

/// A raw pointer the pool's tasks share; each task touches only its own part (see `par_rows`).
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: `par_rows` hands each task a disjoint range and reads nothing back until the pool's
// `run` has returned.
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// A pointer to element `i` (inside the buffer for the caller to use it).
    pub(crate) fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// The range lies inside the buffer, and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        // SAFETY: per the function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Runs `f(r0, r1)` over rows `0..rows` cut into ranges of at least `min_rows` rows, one range per
/// pool task; rows are independent, so each row's result is what a single thread computes.
pub(crate) fn par_rows(
    pool: &ThreadPool,
    rows: usize,
    min_rows: usize,
    f: impl Fn(usize, usize) + Sync,
) {
    let tasks = (rows / min_rows.max(1)).clamp(1, 4 * pool.n_threads());
    if tasks == 1 {
        f(0, rows);
        return;
    }
    let per = rows.div_ceil(tasks);
    pool.run(rows.div_ceil(per), &|i| {
        f(i * per, ((i + 1) * per).min(rows))
    });
}
