//! Tokenizes texts for comparison with llama.cpp. Reads lines of hex-encoded UTF-8 from
//! stdin and prints, per line: the ids for (add_special, parse_special) = (false, false),
//! (false, true), (true, false), (true, true), each followed by `|`, then the hex of
//! `detokenize(ids of (false, true), remove_special = false, unparse_special = true)`, `|`,
//! and the hex of `detokenize(ids of (true, true), true, false)`: the same as a small
//! harness over llama.cpp's `llama_tokenize` / `llama_detokenize` prints, so the two outputs
//! can be compared with `cmp`.
//!
//! `cargo run --release -p quiver-tokenizer --example tokenize_lines -- MODEL.gguf < texts.hex`
//! With `--info` after the model it prints the special-token ids, EOG set and control tokens.

use quiver_tokenizer::Tokenizer;
use std::io::{BufRead, Write};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: tokenize_lines MODEL.gguf < texts.hex")?;
    let f = quiver_gguf::GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf(&f)?;
    if std::env::args().nth(2).as_deref() == Some("--info") {
        // Special-token facts, in the llama.cpp harness's format.
        let id = |x: Option<u32>| x.map_or(-1, |v| v as i64);
        println!(
            "n={} bos={} eos={} eot={} add_bos={} add_eos={}",
            tok.n_vocab(),
            id(tok.bos()),
            id(tok.eos()),
            id(tok.eot()),
            u8::from(tok.add_bos()),
            u8::from(tok.add_eos())
        );
        let eog: String = tok.eog_ids().map(|i| format!(" {i}")).collect();
        println!("eog:{eog}");
        let ctl: String = (0..tok.n_vocab() as u32)
            .filter(|&i| tok.is_control(i))
            .map(|i| format!(" {i}"))
            .collect();
        println!("control_or_unknown:{ctl}");
        return Ok(());
    }
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
