//! Software prefetch of the decode path's weight rows, by CPU vendor.
//!
//! A one-token product reads its matrix once, row after row. On the Intel server cores of the
//! pool's VMs the hardware prefetchers keep too few lines in flight for two threads to stream
//! it at memory speed: Gemma 3's Q8_0 output head (262,144 × 640) took 12.8 ms a token at
//! 13.9 GB/s, and 6.6 ms asking for the lines 8 KiB ahead of the row being read (an Emerald
//! Rapids VM, `bench_matmul`). On AMD's Zen 5 prefetching the rows lost (BENCHMARKS.md), so
//! there the distance is 0: no prefetch.

use std::sync::OnceLock;

/// Bytes ahead of the row being read on Intel cores.
const INTEL_AHEAD: usize = 8192;

/// How many bytes ahead of the current row the decode path asks for weight lines (0: none):
/// [`INTEL_AHEAD`] on Intel, none elsewhere; `QUIVER_CPU_PREFETCH=BYTES` overrides it (a
/// debugging switch: `0` turns it off).
pub(crate) fn distance() -> usize {
    static D: OnceLock<usize> = OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("QUIVER_CPU_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| if intel() { INTEL_AHEAD } else { 0 })
    })
}

#[cfg(target_arch = "x86_64")]
fn intel() -> bool {
    let r = std::arch::x86_64::__cpuid(0);
    [r.ebx, r.edx, r.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e] // "GenuineIntel"
}

#[cfg(not(target_arch = "x86_64"))]
fn intel() -> bool {
    false
}

/// Asks for the cache lines of `w[from + ahead..to + ahead]` (clamped to `w`), `ahead` from
/// [`distance`]: the bytes the rows `ahead` bytes past `from..to` will read.
#[inline(always)]
pub(crate) fn rows(w: &[u8], from: usize, to: usize, ahead: usize) {
    #[cfg(target_arch = "x86_64")]
    if ahead > 0 {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (to + ahead).min(w.len());
        let mut o = (from + ahead) & !63;
        while o < end {
            // SAFETY: o < w.len(): the address is inside `w` (a prefetch never faults anyway).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(o).cast()) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (w, from, to, ahead);
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    #[test]
    fn the_vendor_from_cpuid_is_the_kernels() {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let vendor = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim())
            .unwrap();
        assert_eq!(super::intel(), vendor == "GenuineIntel", "{vendor}");
    }
}
