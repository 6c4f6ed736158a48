//! Software prefetch of the decode path's weight rows, by CPU vendor.
//!
//! A one-token product reads its matrix once, row after row. On the Intel server cores of the
//! pool's VMs the hardware prefetchers keep too few lines in flight for two threads to stream
//! it at memory speed: Gemma 3's Q8_0 output head (262,144 × 640) took 12.8 ms a token at
//! 13.9 GB/s, and 6.6 ms asking for the lines 8 KiB ahead of the row being read (an Emerald
//! Rapids VM, `bench_matmul`). On AMD's Zen 3 server cores (EPYC Milan) 2 KiB ahead took
//! SmolLM2's decode +15% and Gemma 3's +10% (4 KiB was mixed); on Zen 5 prefetching the rows
//! lost (BENCHMARKS.md), so there, and on the AMD cores not measured, the distance is 0.

use std::sync::OnceLock;

/// Bytes ahead of the row being read on Intel cores.
const INTEL_AHEAD: usize = 8192;
/// Bytes ahead on AMD's EPYC Milan (Zen 3: family 25, models 0–15).
const MILAN_AHEAD: usize = 2048;

/// How many bytes ahead of the current row the decode path asks for weight lines (0: none):
/// [`INTEL_AHEAD`] on Intel, [`MILAN_AHEAD`] on EPYC Milan, none elsewhere;
/// `QUIVER_CPU_PREFETCH=BYTES` overrides it (a debugging switch: `0` turns it off).
pub(crate) fn distance() -> usize {
    static D: OnceLock<usize> = OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("QUIVER_CPU_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| match cpu() {
                Cpu::Intel => INTEL_AHEAD,
                Cpu::Milan => MILAN_AHEAD,
                Cpu::Other => 0,
            })
    })
}

/// The cores whose distance was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cpu {
    Intel,
    Milan,
    Other,
}

#[cfg(target_arch = "x86_64")]
fn cpu() -> Cpu {
    use std::arch::x86_64::__cpuid;
    let v = __cpuid(0);
    let vendor = [v.ebx, v.edx, v.ecx];
    if vendor == [0x756e_6547, 0x4965_6e69, 0x6c65_746e] {
        return Cpu::Intel; // "GenuineIntel"
    }
    if vendor != [0x6874_7541, 0x6974_6e65, 0x444d_4163] {
        return Cpu::Other; // not "AuthenticAMD"
    }
    let (family, model) = family_model(__cpuid(1).eax);
    if family == 25 && model < 16 {
        Cpu::Milan
    } else {
        Cpu::Other
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu() -> Cpu {
    Cpu::Other
}

/// The family and model of CPUID leaf 1's eax, as /proc/cpuinfo gives them (the extended
/// fields count where the base family is 15, and the extended model also where it is 6).
fn family_model(eax: u32) -> (u32, u32) {
    let (base, ext) = ((eax >> 8) & 0xf, (eax >> 20) & 0xff);
    let family = if base == 0xf { base + ext } else { base };
    let model = ((eax >> 4) & 0xf)
        | if base == 0xf || base == 6 {
            ((eax >> 16) & 0xf) << 4
        } else {
            0
        };
    (family, model)
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
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().parse::<u32>().unwrap())
                .unwrap()
        };
        let (family, model) = (field("cpu family"), field("model"));
        let want = match vendor {
            "GenuineIntel" => super::Cpu::Intel,
            "AuthenticAMD" if family == 25 && model < 16 => super::Cpu::Milan,
            _ => super::Cpu::Other,
        };
        assert_eq!(super::cpu(), want, "{vendor} family {family} model {model}");
    }

    #[test]
    fn family_and_model_take_the_extended_fields() {
        // EPYC Milan (family 25 model 1), Genoa (25 / 17), Zen 5 (26 / 2), a Sapphire Rapids
        // Xeon (6 / 143): CPUID leaf 1's eax of each.
        assert_eq!(super::family_model(0x00a0_0f11), (25, 1));
        assert_eq!(super::family_model(0x00a1_0f11), (25, 17));
        assert_eq!(super::family_model(0x00b0_0f20), (26, 2));
        assert_eq!(super::family_model(0x0008_06f8), (6, 143));
    }
}
