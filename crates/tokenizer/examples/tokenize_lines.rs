//! Tokenizes texts for comparison with llama.cpp. Reads lines of hex-encoded UTF-8 from
//! stdin and prints, per line: the ids for (add_special, parse_special) = (false, false),
//! (false, true), (true, false), (true, true), each followed by `|`, then the hex of
//! `detokenize(ids of (false, true), remove_special = false, unparse_special = true)`, `|`,
//! and the hex of `detokenize(ids of (true, true), true, false)`: the same as a small
//! harness over llama.cpp's `llama_tokenize` / `llama_detokenize` prints, so the two outputs
//! can be compared with `cmp`.
//!
//! `cargo run --release -p quiver-tokenizer --example tokenize_lines -- MODEL.gguf < texts.hex`

use quiver_tokenizer::Tokenizer;
use std::io::{BufRead, Write};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0)).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: tokenize_lines MODEL.gguf < texts.hex")?;
    let f = quiver_gguf::GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf(&f)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for line in std::io::stdin().lock().lines() {
        let text = String::from_utf8_lossy(&unhex(line?.trim())).into_owned();
        let mut keep = Vec::new();
        for (a, p) in [(false, false), (false, true), (true, false), (true, true)] {
            let ids = tok.encode(&text, a, p)?;
            let s: Vec<String> = ids.iter().map(u32::to_string).collect();
            write!(out, "{}|", s.join(","))?;
            keep.push(ids);
        }
        let d1 = tok.detokenize(&keep[1], false, true);
        let d2 = tok.detokenize(&keep[3], true, false);
        writeln!(out, "{}|{}", hex(d1.as_bytes()), hex(d2.as_bytes()))?;
    }
    Ok(())
}
