//! The two real models parse, and every truncation or corruption of them is an error, never a
//! panic. The models are fetched into the quiver cache by `scripts/test`.

use quiver_gguf::GgufFile;

fn model(alias: &str) -> (GgufFile, Vec<u8>) {
    let path = quiver_hub::alias_path(alias);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        path.display()
    );
    let f = GgufFile::open(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (f, bytes)
}

fn check(alias: &str, n_tensors: usize, arch: &str) {
    let (f, bytes) = model(alias);
    assert_eq!(f.tensors.len(), n_tensors);
    assert_eq!(f.arch().unwrap(), arch);
    let hp = f.hparams().unwrap();
    assert!(hp.req_u32("block_count").unwrap() > 0);
    assert!(hp.req_u32("embedding_length").unwrap() > 0);
    let last_end = f
        .tensors
        .iter()
        .map(|t| f.data_offset + t.offset + t.n_bytes)
        .max()
        .unwrap();
    assert!(last_end <= bytes.len() as u64);

    // 20 truncation points: header, metadata, tensor infos, data.
    let mut points: Vec<u64> = vec![0, 4, 8, 23];
    let spread = |a: u64, b: u64, n: u64| (1..=n).map(move |i| a + (b - a) * i / (n + 1));
    points.extend(spread(24, f.infos_offset, 6));
    points.extend(spread(f.infos_offset, f.data_offset, 5));
    points.extend(spread(f.data_offset, last_end, 5));
    assert_eq!(points.len(), 20);
    for p in points {
        let e = GgufFile::validate(&bytes[..p as usize])
            .expect_err(&format!("{alias} truncated at {p} parsed"));
        let msg = e.to_string();
        assert!(!msg.contains('\n'), "{msg}");
    }

    // Flipped bytes in header, metadata and tensor infos: errors or valid files, never a panic.
    let mut copy = bytes[..f.data_offset as usize].to_vec();
    copy.extend(std::iter::repeat_n(0, (last_end - f.data_offset) as usize));
    let mut x: u64 = 0x243F6A8885A308D3;
    let mut errors = 0;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let pos = (x % f.data_offset) as usize;
        let old = copy[pos];
        copy[pos] ^= 1 << (x >> 60 & 7) | 0x80;
        if GgufFile::validate(&copy).is_err() {
            errors += 1;
        }
        copy[pos] = old;
    }
    assert!(errors > 0, "no flipped byte was detected");
    assert!(GgufFile::validate(&copy).is_ok());
}

#[test]
fn smollm2_parses_and_rejects_every_truncation() {
    check("smollm2-135m", 272, "llama");
}

#[test]
fn gemma3_parses_and_rejects_every_truncation() {
    check("gemma3-270m", 236, "gemma3");
}
