//! x86-64 levels (placeholder: portable until the SIMD kernels land).

use crate::driver::Entry;

pub(crate) fn entry_avx2() -> Entry {
    crate::portable::entry()
}

pub(crate) fn entry_avx512() -> Entry {
    crate::portable::entry()
}
