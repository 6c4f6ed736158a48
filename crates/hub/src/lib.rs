//! Model resolution: paths, aliases of known models fetched into the quiver cache, and
//! `hf:` references.

use std::path::PathBuf;

/// The quiver cache folder: `$QUIVER_HOME`, else `$XDG_CACHE_HOME/quiver`, else
/// `~/.cache/quiver`.
pub fn cache_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("QUIVER_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h);
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("quiver");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("quiver")
}

/// Where the model of a known alias lives once fetched.
pub fn alias_path(alias: &str) -> PathBuf {
    cache_dir().join("models").join(format!("{alias}.gguf"))
}
