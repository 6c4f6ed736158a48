//! The `QUIVER_*` variables quiver and its tests read (docs/ENV.md has a line for each), and
//! the start-up warning for any other.

/// Every `QUIVER_*` variable read anywhere in quiver: locations, kill switches, debug aids.
pub const KNOWN: [&str; 16] = [
    "QUIVER_HOME",
    "QUIVER_THREADS",
    "QUIVER_CPU_SIMD",
    "QUIVER_CPU_PREFETCH",
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
    "QUIVER_DEEP_FIXTURES",
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

    /// The names in `text` after each `needle` (`QUIVER_` and what follows of A–Z, 0–9, _).
    fn names_after(text: &str, needle: &str) -> Vec<String> {
        text.match_indices(needle)
            .map(|(i, _)| {
                let rest = &text[i + needle.len() - "QUIVER_".len()..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                    .unwrap_or(rest.len());
                rest[..end].to_string()
            })
            .collect()
    }

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn every_variable_the_code_reads_is_known_and_documented() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let doc = std::fs::read_to_string(root.join("docs/ENV.md")).unwrap();
        let mut documented = names_after(&doc, "\n| `QUIVER_");
        documented.sort();
        let mut known: Vec<String> = KNOWN.iter().map(|s| s.to_string()).collect();
        known.sort();
        assert_eq!(documented, known, "docs/ENV.md's table against KNOWN");
        let mut files = Vec::new();
        rust_files(&root.join("crates"), &mut files);
        assert!(files.len() > 50, "the crates' sources are found");
        let this = std::path::Path::new(file!()).file_name().unwrap();
        for f in files.iter().filter(|f| f.file_name() != Some(this)) {
            let text = std::fs::read_to_string(f).unwrap();
            for needle in ["var(\"QUIVER_", "var_os(\"QUIVER_"] {
                for name in names_after(&text, needle) {
                    assert!(
                        KNOWN.contains(&name.as_str()),
                        "{} reads {name}, which KNOWN and docs/ENV.md lack",
                        f.display()
                    );
                }
            }
        }
    }
}
