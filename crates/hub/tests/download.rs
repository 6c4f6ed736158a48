//! `hf:ORG/REPO[:QUANT]` and URLs against a local HTTP server that speaks the Hugging Face
//! Hub's protocol (`/api/models/ORG/REPO` lists the files, `/ORG/REPO/resolve/main/FILE` serves
//! one, with Range requests). The first download of the file is cut off halfway; the next one
//! resumes from the partial file. One test function: it sets process-wide variables.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// The server's log: each request's path and Range header.
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

fn serve(listener: TcpListener, data: Vec<u8>, seen: Seen) {
    let mut cut_first = true;
    for stream in listener.incoming() {
        let Ok(mut s) = stream else { continue };
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        if r.read_line(&mut line).is_err() {
            continue;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut range = None;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("range") {
                    range = Some(v.trim().to_string());
                }
            }
        }
        seen.lock().unwrap().push((path.clone(), range.clone()));
        if path == "/api/models/org/repo" {
            let body = r#"{"id":"org/repo","siblings":[{"rfilename":"README.md"},{"rfilename":"m-Q4_K_M.gguf"},{"rfilename":"m-Q8_0.gguf"}]}"#;
            reply(&mut s, "200 OK", "", body.as_bytes());
        } else if path.ends_with("/m-Q4_K_M.gguf") || path.ends_with("/m-Q8_0.gguf") {
            let from: usize = range
                .as_deref()
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.trim_end_matches('-').parse().ok())
                .unwrap_or(0);
            if from > 0 {
                let extra = format!(
                    "Content-Range: bytes {from}-{}/{}\r\n",
                    data.len() - 1,
                    data.len()
                );
                reply(&mut s, "206 Partial Content", &extra, &data[from..]);
            } else if cut_first && path.ends_with("/m-Q4_K_M.gguf") {
                // Headers for the whole file, then half of it, then the connection drops.
                cut_first = false;
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    data.len()
                );
                let _ = s.write_all(head.as_bytes());
                let _ = s.write_all(&data[..data.len() / 2]);
                let _ = s.flush();
            } else {
                reply(&mut s, "200 OK", "", &data);
            }
        } else {
            reply(&mut s, "404 Not Found", "", b"not found");
        }
    }
}

fn reply(s: &mut TcpStream, status: &str, extra: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

#[test]
fn hub_files_and_urls_download_and_resume() {
    let data: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    {
        let (data, seen) = (data.clone(), seen.clone());
        std::thread::spawn(move || serve(listener, data, seen));
    }
    let home = std::env::temp_dir().join(format!("quiver-download-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::env::set_var("QUIVER_HOME", &home);
    std::env::set_var("HF_ENDPOINT", format!("http://{addr}"));
    std::env::remove_var("HF_TOKEN");

    // The default quantization, cut off halfway: an error that says so, a partial file.
    let mut log = Vec::new();
    let e = quiver_hub::resolve(Some("hf:org/repo"), &mut log)
        .unwrap_err()
        .to_string();
    assert!(e.contains("org/repo") && e.contains("resumes"), "{e}");
    let dest = home.join("hf/org/repo/m-Q4_K_M.gguf");
    assert!(!dest.exists());
    let partial = home.join("hf/org/repo/m-Q4_K_M.gguf.partial");
    assert_eq!(
        std::fs::metadata(&partial).unwrap().len(),
        data.len() as u64 / 2
    );

    // The next try resumes with a Range request and completes the file.
    let mut log = Vec::new();
    let p = quiver_hub::resolve(Some("hf:org/repo"), &mut log).unwrap();
    assert_eq!(p, dest);
    assert!(
        std::fs::read(&p).unwrap() == data,
        "the resumed file differs"
    );
    assert!(!partial.exists());
    assert!(String::from_utf8_lossy(&log).contains("resuming at 1.4 MiB"));
    let half = format!("bytes={}-", data.len() / 2);
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|(_, r)| r.as_deref() == Some(half.as_str())),
        "{:?}",
        seen.lock().unwrap()
    );
    // Cached: the third time asks the hub for the list only; without the hub, the cache.
    let before = seen.lock().unwrap().len();
    let again = |endpoint: String| {
        std::env::set_var("HF_ENDPOINT", endpoint);
        quiver_hub::resolve(Some("hf:org/repo"), &mut Vec::new()).unwrap()
    };
    assert_eq!(again(format!("http://{addr}")), dest);
    let after: Vec<_> = seen.lock().unwrap()[before..].to_vec();
    assert!(
        after.iter().all(|(p, _)| p.starts_with("/api/")),
        "{after:?}"
    );
    assert_eq!(again("http://127.0.0.1:9".into()), dest);
    std::env::set_var("HF_ENDPOINT", format!("http://{addr}"));

    // A named quantization, a named file, a plain URL.
    let q8 = quiver_hub::resolve(Some("hf:org/repo:q8_0"), &mut Vec::new()).unwrap();
    assert!(q8.ends_with("hf/org/repo/m-Q8_0.gguf") && std::fs::read(&q8).unwrap() == data);
    let url = format!("http://{addr}/org/repo/resolve/main/m-Q8_0.gguf");
    let u = quiver_hub::resolve(Some(&url), &mut Vec::new()).unwrap();
    assert!(u.starts_with(home.join("url")) && std::fs::read(&u).unwrap() == data);

    // What the repository lacks, and a URL that is not there: one-line errors.
    let e = quiver_hub::resolve(Some("hf:org/repo:F16"), &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no GGUF file of F16") && e.contains("m-Q8_0.gguf"),
        "{e}"
    );
    let e = quiver_hub::resolve(
        Some(&format!("http://{addr}/nothing.gguf")),
        &mut Vec::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("404") && !e.contains('\n'), "{e}");
    let _ = std::fs::remove_dir_all(&home);
}
