//! GGUF files with hostile sizes: every integer of a real file's header (counts, string and
//! array lengths, value types, hyperparameters, tensor dimensions, types and offsets) set to
//! values that overflow or exhaust memory, one field at a time and several at random
//! (deterministic seeds). `quiver info`, `quiver bench` (which loads and runs the model) and
//! `quiver serve` (up to its listen) run on each under a memory cap: each exits 0 or with a
//! one-line error, never an abort (134), a panic (101) or a signal; `info` exits with an error
//! exactly when the file's header or its hyperparameters cannot be read for loading. The real
//! models' tokenizers get the same treatment under `quiver tokenize`.

use std::process::{Command, Stdio};
use std::time::Instant;

/// The memory cap (`ulimit -v`, KiB): far above what a tiny model needs, far below the
/// allocations a hostile count asks for.
const CAP_KIB: u64 = 4 << 20;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// One integer of the file: where, how wide, and what it is.
#[derive(Clone, Debug)]
struct Field {
    off: usize,
    width: usize,
    what: String,
}

/// Reads a GGUF image's layout: every integer of the header, metadata and tensor infos.
struct Walk<'a> {
    b: &'a [u8],
    pos: usize,
    fields: Vec<Field>,
}

impl Walk<'_> {
    fn int(&mut self, width: usize, what: String) -> u64 {
        let mut v = [0u8; 8];
        v[..width].copy_from_slice(&self.b[self.pos..self.pos + width]);
        self.fields.push(Field {
            off: self.pos,
            width,
            what,
        });
        self.pos += width;
        u64::from_le_bytes(v)
    }

    fn string(&mut self, what: &str) -> String {
        let n = self.int(8, format!("{what} length")) as usize;
        let s = String::from_utf8_lossy(&self.b[self.pos..self.pos + n]).into_owned();
        self.pos += n;
        s
    }

    fn value(&mut self, ty: u64, key: &str, depth: usize) {
        let width = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                self.string(&format!("{key} string"));
                return;
            }
            9 => {
                let et = self.int(4, format!("{key} array type"));
                let n = self.int(8, format!("{key} array length"));
                for i in 0..n {
                    // The first elements of an array of counts (per-layer keys) are fields too.
                    if depth == 0 && i < 4 && !matches!(et, 8 | 9) {
                        self.value(et, &format!("{key}[{i}]"), depth + 1);
                    } else {
                        let pos = self.fields.len();
                        self.value(et, key, depth + 1);
                        self.fields.truncate(pos);
                    }
                }
                return;
            }
            _ => panic!("type {ty} in the base file"),
        };
        // Floats and bools are read past, not mutated.
        if matches!(ty, 6 | 7 | 12) {
            self.pos += width;
        } else {
            self.int(width, key.to_string());
        }
    }

    fn file(b: &[u8]) -> Vec<Field> {
        let mut w = Walk {
            b,
            pos: 4,
            fields: Vec::new(),
        };
        w.int(4, "version".into());
        let n_tensors = w.int(8, "tensor count".into());
        let n_kv = w.int(8, "metadata count".into());
        for _ in 0..n_kv {
            let key = w.string("key");
            let ty = w.int(4, format!("{key} type"));
            w.value(ty, &key, 0);
        }
        for _ in 0..n_tensors {
            let name = w.string("tensor name");
            let n_dims = w.int(4, format!("{name} n_dims"));
            for d in 0..n_dims {
                w.int(8, format!("{name} ne[{d}]"));
            }
            w.int(4, format!("{name} type"));
            w.int(8, format!("{name} offset"));
        }
        w.fields
    }
}

/// Values that overflow, exhaust memory or sit at an edge, for a field holding `orig`.
fn hostile(width: usize, orig: u64) -> Vec<u64> {
    let mut v = vec![
        0,
        1,
        2,
        3,
        255,
        1 << 15,
        (1 << 16) - 1,
        (1 << 24) + 1,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        (1 << 40) + 7,
        (1 << 63) - 1,
        1 << 63,
        u64::MAX,
        orig.wrapping_add(1),
        orig.wrapping_sub(1),
        orig.wrapping_mul(2),
        orig.wrapping_mul(1 << 20),
    ];
    let mask = if width == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * width)) - 1
    };
    for x in &mut v {
        *x &= mask;
    }
    v.sort_unstable();
    v.dedup();
    v.retain(|&x| x != orig);
    v
}

fn set(b: &mut [u8], f: &Field, v: u64) {
    b[f.off..f.off + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
}

fn get(b: &[u8], f: &Field) -> u64 {
    let mut v = [0u8; 8];
    v[..f.width].copy_from_slice(&b[f.off..f.off + f.width]);
    u64::from_le_bytes(v)
}

/// splitmix64: the cases' deterministic randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Runs `quiver ARGS` under the memory cap; a description of what went wrong, if anything.
/// `fails`: whether it must exit with an error (None: either way).
fn check(args: &[&str], case: &str, fails: Option<&Result<(), String>>) -> Option<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {CAP_KIB}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_quiver"))
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .output()
        .expect("sh runs");
    let err = String::from_utf8_lossy(&out.stderr);
    let bad = match out.status.code() {
        Some(0) => fails.is_some_and(|f| f.is_err()),
        Some(1) => {
            err.trim_end().lines().count() != 1
                || !err.starts_with("error: ")
                || fails.is_some_and(|f| f.is_ok())
        }
        _ => true,
    };
    let crashed = err.contains("panicked") || err.contains("memory allocation");
    (bad || crashed).then(|| {
        format!(
            "{case}: `quiver {}` exited {:?}: {} (the file {})",
            args[0],
            out.status,
            err.chars().take(600).collect::<String>(),
            match fails {
                None => "may load or not".to_string(),
                Some(Ok(())) => "reads for loading".to_string(),
                Some(Err(e)) => format!("cannot load: {e}"),
            }
        )
    })
}

/// One hostile file: fields of a base image set to values.
struct Case {
    base: usize,
    name: String,
    set: Vec<(Field, u64)>,
}

/// Whether the file's header and hyperparameters read as loading reads them, or why not.
fn readable(path: &std::path::Path) -> Result<(), String> {
    let f = quiver_gguf::GgufFile::open(path).map_err(|e| e.to_string())?;
    match f.arch() {
        Ok(a) if quiver_models::SUPPORTED.contains(&a) => quiver_models::hparams(&f)
            .map(drop)
            .map_err(|e| e.to_string()),
        _ => Ok(()),
    }
}

/// Every command on one mutated image; what went wrong.
fn run_case(base: &[u8], c: &Case, path: &std::path::Path, busy_port: u16) -> Vec<String> {
    let mut bytes = base.to_vec();
    for (f, v) in &c.set {
        set(&mut bytes, f, *v);
    }
    std::fs::write(path, &bytes).unwrap();
    let f = path.to_str().unwrap();
    let port = busy_port.to_string();
    let commands = [
        vec!["bench", "-m", f, "-p", "4", "-n", "1", "-r", "1", "-t", "1"],
        // Up to its listen, on a port that is taken: the pool sizing before the load.
        vec!["serve", "-m", f, "--port", &port, "-t", "1"],
    ];
    let mut failed: Vec<String> = commands
        .iter()
        .filter_map(|args| check(args, &c.name, None))
        .collect();
    failed.extend(check(&["info", f], &c.name, Some(&readable(path))));
    failed
}

fn base(preset: &str) -> Vec<u8> {
    let p = tmp(&format!("{preset}.gguf"));
    let out = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["synth", "--preset", preset, "--type", "q8_0", "-o"])
        .arg(&p)
        .output()
        .expect("quiver synth runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&p).unwrap()
}

#[test]
fn hostile_sizes_are_clean_errors_under_a_memory_cap() {
    let t0 = Instant::now();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = listener.local_addr().unwrap().port();
    let mut bases = Vec::new();
    let mut cases = Vec::new();
    for (preset, seed) in [
        ("tiny-llama", 1u64),
        ("tiny-gemma3", 2),
        ("tiny-gemma4", 3),
        ("tiny-qwen3moe", 4),
    ] {
        let b = base(preset);
        let fields = Walk::file(&b);
        let arch = preset.trim_start_matches("tiny-");
        // Every hyperparameter and the header's counts, one at a time, each hostile value.
        for f in fields.iter().filter(|f| {
            (f.what.starts_with(&format!("{arch}."))
                || f.what.ends_with("count")
                || f.what == "version")
                && !f.what.ends_with(" type")
                && !f.what.ends_with(" length")
        }) {
            for v in hostile(f.width, get(&b, f)) {
                cases.push(Case {
                    base: bases.len(),
                    name: format!("{preset} {} = {v}", f.what),
                    set: vec![(f.clone(), v)],
                });
            }
        }
        // Random fields anywhere (lengths, types, tensor dimensions and offsets), 1 to 3 at
        // once.
        let mut rng = Rng(seed);
        for _ in 0..40 {
            let mut set = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let f = &fields[rng.below(fields.len())];
                let vals = hostile(f.width, get(&b, f));
                set.push((f.clone(), vals[rng.below(vals.len())]));
            }
            let name = set
                .iter()
                .map(|(f, v)| format!("{} = {v}", f.what))
                .collect::<Vec<_>>()
                .join(", ");
            cases.push(Case {
                base: bases.len(),
                name: format!("{preset} {name}"),
                set,
            });
        }
        bases.push(b);
    }
    // The cases on every core.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for w in 0..workers {
            let (cases, bases, next, failures) = (&cases, &bases, &next, &failures);
            s.spawn(move || {
                let path = tmp(&format!("case-{w}.gguf"));
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(c) = cases.get(i) else { break };
                    let got = run_case(&bases[c.base], c, &path, busy);
                    failures.lock().unwrap().extend(got);
                }
            });
        }
    });
    drop(listener);
    let failures = failures.into_inner().unwrap();
    eprintln!(
        "{} hostile files on {workers} threads in {:.1}s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} commands failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A GGUF holding only the tokenizer of a real model (its `tokenizer.*` keys and
/// `general.architecture`, no tensors).
fn tokenizer_base(alias: &str) -> Vec<u8> {
    let p = quiver_hub::alias_path(alias);
    assert!(p.is_file(), "{} is missing: run scripts/test", p.display());
    let f = quiver_gguf::GgufFile::open(&p).unwrap();
    let mut w = quiver_gguf::GgufWriter::new();
    for (k, v) in &f.metadata {
        if k.starts_with("tokenizer.") || k == "general.architecture" {
            w.set(k.clone(), v.clone());
        }
    }
    w.to_bytes(&[]).unwrap()
}

/// The real models' tokenizers with hostile counts, lengths, types and ids (the synth files
/// have none): `quiver tokenize` exits 0 or with one line under the memory cap.
#[test]
fn hostile_tokenizer_fields_are_clean_errors_under_a_memory_cap() {
    let t0 = Instant::now();
    let mut cases = Vec::new();
    let mut bases = Vec::new();
    for (alias, seed) in [("smollm2-135m", 5u64), ("gemma3-270m", 6)] {
        let b = tokenizer_base(alias);
        let fields = Walk::file(&b);
        let mut rng = Rng(seed);
        // Every field, with five of its hostile values (0, the largest, and three at random).
        for f in &fields {
            let vals = hostile(f.width, get(&b, f));
            let mut pick = vec![vals[0], vals[vals.len() - 1]];
            pick.extend((0..3).map(|_| vals[rng.below(vals.len())]));
            pick.sort_unstable();
            pick.dedup();
            cases.extend(
                pick.into_iter()
                    .map(|v| (bases.len(), vec![(f.clone(), v)])),
            );
        }
        for _ in 0..40 {
            let set = (0..1 + rng.below(3))
                .map(|_| {
                    let f = &fields[rng.below(fields.len())];
                    let vals = hostile(f.width, get(&b, f));
                    (f.clone(), vals[rng.below(vals.len())])
                })
                .collect();
            cases.push((bases.len(), set));
        }
        bases.push((alias, b));
    }
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for w in 0..workers {
            let (cases, bases, next, failures) = (&cases, &bases, &next, &failures);
            s.spawn(move || {
                let path = tmp(&format!("tok-{w}.gguf"));
                let f = path.to_str().unwrap();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((base, set)) = cases.get(i) else {
                        break;
                    };
                    let (alias, b) = &bases[*base];
                    let mut bytes = b.clone();
                    for (fld, v) in set {
                        crate::set(&mut bytes, fld, *v);
                    }
                    std::fs::write(&path, &bytes).unwrap();
                    let name = set
                        .iter()
                        .map(|(f, v)| format!("{} = {v}", f.what))
                        .collect::<Vec<_>>()
                        .join(", ");
                    let args = [
                        "tokenize",
                        "-m",
                        f,
                        "Hello <|im_start|> wörld <start_of_turn>",
                    ];
                    if let Some(e) = check(&args, &format!("{alias} {name}"), None) {
                        failures.lock().unwrap().push(e);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    eprintln!(
        "{} hostile tokenizers in {:.1}s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} commands failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
