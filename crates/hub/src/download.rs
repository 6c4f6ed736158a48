//! Downloads over HTTP into the cache: GGUF files of Hugging Face Hub repositories
//! (`hf:ORG/REPO/FILE.gguf`, or `hf:ORG/REPO[:QUANT]` to pick the repository's file of that
//! quantization, as llama.cpp's `-hf` does) and plain URLs (`--model-url`). A download goes to
//! a `.partial` file beside its destination and resumes from it with a Range request after an
//! interruption; the destination appears only once the whole file is there. The hub's address
//! is `$HF_ENDPOINT` (default `https://huggingface.co`), its token `$HF_TOKEN`, as the hub's
//! own tools read them.

use crate::{cache_dir, hex, io_err, HubError, Progress};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The quantization `hf:ORG/REPO` picks when none is named (llama.cpp's default too).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .unwrap_or_else(|| "https://huggingface.co".into())
        .trim_end_matches('/')
        .to_string()
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .build()
}

fn get(url: &str) -> ureq::Request {
    let req = agent().get(url).set("User-Agent", "quiver");
    match std::env::var("HF_TOKEN") {
        Ok(t) if !t.trim().is_empty() && url.starts_with(&endpoint()) => {
            req.set("Authorization", &format!("Bearer {}", t.trim()))
        }
        _ => req,
    }
}

/// An `hf:` reference: the repository and either a file or a quantization.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HfRef {
    pub(crate) repo: String,
    pub(crate) file: Option<String>,
    pub(crate) quant: Option<String>,
}

/// `ORG/REPO/FILE.gguf`, `ORG/REPO:QUANT` or `ORG/REPO`.
pub(crate) fn parse_hf(rest: &str) -> Option<HfRef> {
    let (path, quant) = match rest.split_once(':') {
        Some((p, q)) if !q.is_empty() && !q.contains('/') => (p, Some(q.to_string())),
        Some(_) => return None,
        None => (rest, None),
    };
    let mut it = path.splitn(3, '/');
    let (org, repo) = (it.next()?, it.next()?);
    if org.is_empty() || repo.is_empty() {
        return None;
    }
    let file = match it.next() {
        Some(f) if f.ends_with(".gguf") && quant.is_none() => Some(f.to_string()),
        Some(_) => return None,
        None => None,
    };
    Some(HfRef {
        repo: format!("{org}/{repo}"),
        file,
        quant,
    })
}

/// The GGUF file of `files` (a repository's) for `quant` (case-insensitive, as a name
/// component: `Q4_K_M` matches `model-Q4_K_M.gguf`, not `model-Q4_K_M_L.gguf`), or for
/// [`DEFAULT_QUANT`], else the only model file. Projector files (`mmproj`) are no models.
pub(crate) fn pick_file(files: &[String], quant: Option<&str>) -> Result<String, String> {
    let models: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".gguf") && !f.to_ascii_lowercase().contains("mmproj"))
        .collect();
    let matches = |q: &str| -> Vec<&String> {
        let q = q.to_ascii_lowercase();
        models
            .iter()
            .copied()
            .filter(|f| {
                let stem = f.to_ascii_lowercase();
                let stem = stem.trim_end_matches(".gguf");
                stem.split(['-', '.', '/']).any(|part| part == q)
            })
            .collect()
    };
    let names = || {
        models
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let found = match quant {
        Some(q) => matches(q),
        None => match matches(DEFAULT_QUANT) {
            m if !m.is_empty() => m,
            _ if models.len() == 1 => models.clone(),
            _ => Vec::new(),
        },
    };
    match found.as_slice() {
        [one] if one.contains("-of-0") => Err(format!(
            "{one} is one part of a split GGUF, which quiver does not load (files: {})",
            names()
        )),
        [one] => Ok((*one).clone()),
        [] => Err(format!(
            "no GGUF file of {} (files: {})",
            quant.unwrap_or(DEFAULT_QUANT),
            if models.is_empty() {
                "none".into()
            } else {
                names()
            }
        )),
        many => Err(format!(
            "several files match: {}; name one as hf:ORG/REPO/FILE.gguf",
            many.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn hf_err(reference: &str, detail: impl std::fmt::Display) -> HubError {
    HubError::Hf {
        reference: reference.into(),
        detail: detail.to_string(),
    }
}

/// The files of a hub repository (its model info's `siblings`).
fn repo_files(spec: &str, repo: &str) -> Result<Vec<String>, HubError> {
    let url = format!("{}/api/models/{repo}", endpoint());
    let body = get(&url)
        .call()
        .map_err(|e| hf_err(spec, one_line(&e.to_string())))?
        .into_string()
        .map_err(|e| hf_err(spec, e))?;
    let v: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| hf_err(spec, format!("{url}: not the hub's model info ({e})")))?;
    Ok(v["siblings"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(|f| f["rfilename"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// The complete files under `dir` (relative paths).
fn cached_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(dir) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// Resolves and fetches an `hf:` reference (`rest`: what follows `hf:`) into
/// `$QUIVER_HOME/hf/ORG/REPO/FILE`.
pub(crate) fn fetch_hf(spec: &str, rest: &str, log: &mut dyn Write) -> Result<PathBuf, HubError> {
    let r = parse_hf(rest).ok_or_else(|| HubError::BadHfRef(spec.into()))?;
    let dir = cache_dir().join("hf").join(&r.repo);
    let file = match &r.file {
        Some(f) => f.clone(),
        // The hub's list; without the hub, what an earlier fetch left in the cache.
        None => match repo_files(spec, &r.repo) {
            Ok(files) => pick_file(&files, r.quant.as_deref()).map_err(|e| hf_err(spec, e))?,
            Err(e) => pick_file(&cached_files(&dir), r.quant.as_deref()).map_err(|_| e)?,
        },
    };
    let dest = dir.join(&file);
    if dest.is_file() {
        return Ok(dest);
    }
    let url = format!("{}/{}/resolve/main/{file}", endpoint(), r.repo);
    let _ = writeln!(log, "fetch {}: {file}", r.repo);
    download(&url, &dest, log).map_err(|e| match e {
        Failure::Io(e) => e,
        Failure::Http(d) => hf_err(spec, d),
    })?;
    Ok(dest)
}

/// Fetches `url` into `$QUIVER_HOME/url/HASH-NAME` (HASH: of the URL).
pub(crate) fn fetch_url(url: &str, log: &mut dyn Write) -> Result<PathBuf, HubError> {
    let name = url
        .rsplit('/')
        .next()
        .and_then(|n| n.split(['?', '#']).next())
        .filter(|n| !n.is_empty())
        .unwrap_or("model.gguf");
    let hash = hex(&Sha256::digest(url.as_bytes())[..8]);
    let dest = cache_dir().join("url").join(format!("{hash}-{name}"));
    if dest.is_file() {
        return Ok(dest);
    }
    let _ = writeln!(log, "fetch {url}");
    download(url, &dest, log).map_err(|e| match e {
        Failure::Io(e) => e,
        Failure::Http(detail) => HubError::Url {
            url: url.into(),
            detail,
        },
    })?;
    Ok(dest)
}

enum Failure {
    Io(HubError),
    Http(String),
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `url` into `dest` through `dest.partial`, resuming what an earlier try left there.
fn download(url: &str, dest: &Path, log: &mut dyn Write) -> Result<(), Failure> {
    let dir = dest.parent().expect("cache paths have a parent");
    std::fs::create_dir_all(dir).map_err(|e| Failure::Io(io_err(dir, e)))?;
    let mut partial = dest.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let have = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
    let mut req = get(url);
    if have > 0 {
        req = req.set("Range", &format!("bytes={have}-"));
    }
    let resp = match req.call() {
        Ok(r) => r,
        // Everything is there already (the server has no byte past the end).
        Err(ureq::Error::Status(416, _)) if have > 0 => {
            return std::fs::rename(&partial, dest).map_err(|e| Failure::Io(io_err(dest, e)));
        }
        Err(e) => return Err(Failure::Http(one_line(&e.to_string()))),
    };
    let resumed = resp.status() == 206;
    let from = if resumed { have } else { 0 };
    let len: Option<u64> = resp.header("Content-Length").and_then(|v| v.parse().ok());
    let total = len.map(|l| l + from);
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(resumed)
        .write(true)
        .truncate(!resumed)
        .open(&partial)
        .map_err(|e| Failure::Io(io_err(&partial, e)))?;
    if resumed {
        let _ = writeln!(log, "resuming at {:.1} MiB", have as f64 / 1048576.0);
    }
    let mut bar = Progress::bytes(total.unwrap_or(0));
    let mut body = resp.into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = from;
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                bar.finish(log);
                return Err(Failure::Http(format!(
                    "interrupted at {done} bytes ({e}); the next try resumes there"
                )));
            }
        };
        out.write_all(&buf[..n])
            .map_err(|e| Failure::Io(io_err(&partial, e)))?;
        done += n as u64;
        if total.is_some() {
            bar.update(done, log);
        }
    }
    bar.finish(log);
    drop(out);
    if let Some(t) = total.filter(|&t| t != done) {
        return Err(Failure::Http(format!(
            "the server sent {done} of {t} bytes; the next try resumes there"
        )));
    }
    std::fs::rename(&partial, dest).map_err(|e| Failure::Io(io_err(dest, e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_references_parse() {
        let r = |f: Option<&str>, q: Option<&str>| HfRef {
            repo: "org/repo".into(),
            file: f.map(Into::into),
            quant: q.map(Into::into),
        };
        assert_eq!(parse_hf("org/repo"), Some(r(None, None)));
        assert_eq!(parse_hf("org/repo:Q8_0"), Some(r(None, Some("Q8_0"))));
        assert_eq!(
            parse_hf("org/repo/sub/m.gguf"),
            Some(r(Some("sub/m.gguf"), None))
        );
        for bad in [
            "org",
            "/repo",
            "org/",
            "org/repo/m.bin",
            "org/repo:",
            "org/repo/m.gguf:Q4_0",
        ] {
            assert_eq!(parse_hf(bad), None, "{bad}");
        }
    }

    #[test]
    fn files_are_picked_by_quantization() {
        let files: Vec<String> = [
            "README.md",
            "m-Q4_K_M.gguf",
            "m-Q4_K_M_L.gguf",
            "m-q8_0.gguf",
            "mmproj-m-f16.gguf",
            "big/m-Q6_K-00001-of-00002.gguf",
            "big/m-Q6_K-00002-of-00002.gguf",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(pick_file(&files, None).unwrap(), "m-Q4_K_M.gguf");
        assert_eq!(pick_file(&files, Some("Q8_0")).unwrap(), "m-q8_0.gguf");
        assert!(pick_file(&files, Some("F16"))
            .unwrap_err()
            .contains("no GGUF file of F16"));
        assert!(pick_file(&files, Some("Q6_K"))
            .unwrap_err()
            .contains("several files"));
        let one = vec!["x.gguf".to_string(), "mmproj.gguf".to_string()];
        assert_eq!(pick_file(&one, None).unwrap(), "x.gguf");
        let split = vec!["a-Q4_K_M-00001-of-00003.gguf".to_string()];
        assert!(pick_file(&split, None).unwrap_err().contains("split GGUF"));
    }
}
