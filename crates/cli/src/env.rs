//! The `QUIVER_*` variables quiver and its tests read (docs/ENV.md has a line for each), and
//! the start-up warning for any other.

/// Every `QUIVER_*` variable read anywhere in quiver: locations, kill switches, debug aids.
pub const KNOWN: [&str; 14] = [
    "QUIVER_HOME",
    "QUIVER_THREADS",
    "QUIVER_CPU_SIMD",
    "QUIVER_CPU_MMAP",
    "QUIVER_CUDA_LIB_DIR",
    "QUIVER_CUDA_GRAPHS",
    "QUIVER_CUDA_PDL",
    "QUIVER_CUDA_SYNC",
    "QUIVER_CUDA_LINEINFO",
    "QUIVER_DUMP_DIR",
    "QUIVER_SERVE_PROFILE",
    "QUIVER_TEST_SEED",
    "QUIVER_LLAMA_SRC",
    "QUIVER_ONLY",
];

/// The `QUIVER_*` names among `names` that quiver does not read, sorted.
pub fn unknown(names: impl Iterator<Item = String>) -> Vec<String> {
    let mut v: Vec<String> = names
        .filter(|n| n.starts_with("QUIVER_") && !KNOWN.contains(&n.as_str()))
        .collect();
    v.sort();
    v
}

/// Warns (through the log) of each `QUIVER_*` variable of the environment quiver does not read.
pub fn warn_unknown() {
    let names = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok());
    for name in unknown(names) {
        tracing::warn!(
            "unknown variable {name} is ignored (docs/ENV.md lists the variables quiver reads)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_other_quiver_variables_are_unknown() {
        let names = [
            "QUIVER_CUDA_EXACT",
            "QUIVER_HOME",
            "PATH",
            "QUIVER_ONLY",
            "QUIVER_X",
        ];
        assert_eq!(
            unknown(names.iter().map(|s| s.to_string())),
            ["QUIVER_CUDA_EXACT", "QUIVER_X"]
        );
    }
}
