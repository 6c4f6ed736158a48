//! The backends' error, and the sizes it reports.

use crate::ExtraOp;
use quiver_gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: weight type {ty} is not supported by the {backend} backend")]
    Unsupported {
        op: &'static str,
        ty: GgmlType,
        backend: &'static str,
    },
    #[error("the {backend} backend has no KV cache of K {k} and V {v}")]
    UnsupportedKv {
        k: &'static str,
        v: &'static str,
        backend: &'static str,
    },
    #[error("{0}")]
    Device(String),
    #[error("the {backend} backend has no {op} op, which {arch} models need")]
    MissingOp {
        op: ExtraOp,
        backend: &'static str,
        arch: String,
    },
    #[error("{what} need {} but the {device} backend has {} available{hint}", human_bytes(*need), human_bytes(*available))]
    OutOfMemory {
        what: String,
        need: u64,
        available: u64,
        device: &'static str,
        /// What to change, e.g. ": lower --ctx-size".
        hint: &'static str,
    },
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// `1.5 GiB`-style sizes for messages.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Host memory a new allocation can take without swapping (Linux `MemAvailable`), where the
/// system says.
pub fn host_memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}
