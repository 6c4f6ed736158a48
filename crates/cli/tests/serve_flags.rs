//! `quiver serve`'s flags as a careless operator gives them: a key file without a key, and
//! durations or sizes past what the server can use, are one-line errors at start (never a
//! server that starts without authentication, or one that panics per connection).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn model(alias: &str) -> String {
    let p = quiver_hub::alias_path(alias);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        p.display()
    );
    p.display().to_string()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-serve-flags-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// Runs `quiver ARGS` for at most `limit`: (exit code, stderr), or None when it was still
/// running then (a server that started; it is killed).
fn run_for(args: &[&str], limit: Duration) -> Option<(i32, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("quiver runs");
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some((status.code().unwrap_or(-1), err));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_one_line_error(got: Option<(i32, String)>, code: i32, says: &[&str], what: &str) {
    let Some((rc, err)) = got else {
        panic!("{what}: the server started instead of refusing the flag");
    };
    assert_eq!(rc, code, "{what}: exit code, stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{what}: {err:?}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    for s in says {
        assert!(err.contains(s), "{what}: {err:?} does not say {s:?}");
    }
}

#[test]
fn a_key_file_without_a_key_is_an_error_at_start() {
    let m = model("smollm2-135m");
    for (name, text) in [
        (
            "comments.keys",
            "# keys for the team\n\n   \n# rotated monthly\n",
        ),
        ("empty.keys", ""),
    ] {
        let f = tmp(name);
        std::fs::write(&f, text).unwrap();
        let f = f.to_str().unwrap();
        let got = run_for(
            &["serve", "-m", &m, "--port", "0", "--api-key-file", f],
            Duration::from_secs(20),
        );
        assert_one_line_error(got, 1, &[f, "no key"], name);
    }
}

#[test]
fn durations_and_sizes_past_their_bounds_are_one_line_errors() {
    let m = model("smollm2-135m");
    let max = u64::MAX.to_string();
    for (flag, value) in [
        ("--timeout-read-secs", max.as_str()),
        ("--timeout-read-secs", "86401"),
        ("--timeout-idle-secs", max.as_str()),
        ("--shutdown-grace", max.as_str()),
        ("--timeout", max.as_str()),
        ("--max-connections", "4294967295"),
        ("--max-waiting", "4294967295"),
        ("--max-seqs", "4294967295"),
    ] {
        let got = run_for(
            &["serve", "-m", &m, "--port", "0", flag, value],
            Duration::from_secs(15),
        );
        assert_one_line_error(got, 2, &[flag], &format!("{flag} {value}"));
    }
    // At the bounds: accepted (the server starts; it is killed).
    for (flag, value) in [("--timeout-read-secs", "86400"), ("--shutdown-grace", "0")] {
        let got = run_for(
            &["serve", "-m", &m, "--port", "0", flag, value],
            Duration::from_secs(3),
        );
        assert!(got.is_none(), "{flag} {value}: {got:?}");
    }
}

#[test]
fn cache_isolation_by_key_without_keys_is_a_flag_error() {
    let m = model("smollm2-135m");
    let got = run_for(
        &["serve", "-m", &m, "--port", "0", "--cache-isolation", "key"],
        Duration::from_secs(15),
    );
    assert_one_line_error(got, 2, &["--cache-isolation key", "--api-key"], "no keys");
    let got = run_for(
        &[
            "serve",
            "-m",
            &m,
            "--port",
            "0",
            "--cache-isolation",
            "tenant",
        ],
        Duration::from_secs(15),
    );
    assert_one_line_error(got, 2, &["--cache-isolation"], "an unknown mode");
    let got = run_for(
        &[
            "serve",
            "-m",
            &m,
            "--port",
            "0",
            "--cache-isolation",
            "key",
            "--api-key",
            "k",
        ],
        Duration::from_secs(3),
    );
    assert!(got.is_none(), "with a key the server starts: {got:?}");
}
