//! Disjoint writes into one output slice from several pool tasks.

use std::marker::PhantomData;

/// A mutable slice that pool tasks write into concurrently, each task at indices no other
/// task writes (the matmul drivers give every task its own rows or tokens).
pub(crate) struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a `SharedMut` only hands out writes of `T: Send` values to distinct indices (the
// contract of `write`), which is what `&mut [T]` split across threads would allow.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(s: &'a mut [T]) -> SharedMut<'a, T> {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }

    /// Writes `v` at `i` (ignored when out of range).
    ///
    /// # Safety
    /// No other thread writes index `i` while the `SharedMut` is shared, and nothing reads
    /// the slice until the borrow ends.
    #[inline(always)]
    pub unsafe fn write(&self, i: usize, v: T) {
        debug_assert!(i < self.len);
        if i < self.len {
            // SAFETY: in bounds (checked); exclusive per the caller's contract.
            unsafe { self.ptr.add(i).write(v) }
        }
    }

    /// Copies `v` to `i..i + v.len()` (ignored when out of range).
    ///
    /// # Safety
    /// As for [`SharedMut::write`], for every index written.
    #[inline(always)]
    pub unsafe fn write_slice(&self, i: usize, v: &[T])
    where
        T: Copy,
    {
        debug_assert!(i <= self.len && v.len() <= self.len - i);
        if i <= self.len && v.len() <= self.len - i {
            // SAFETY: in bounds (checked); `v` is a different allocation than the shared
            // slice (the caller holds it by shared reference while we hold the unique
            // borrow); exclusive per the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(i), v.len()) }
        }
    }
}
