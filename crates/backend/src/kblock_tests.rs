use super::*;

fn rnd(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
}

/// 16 keys of `d` as f16, channel c offset by 3·c (a common part, as keys have) and one large
/// value (an attention sink's).
fn keys(d: usize, seed: &mut u64) -> Vec<half::f16> {
    let mut k: Vec<half::f16> = (0..SLOTS * d)
        .map(|i| half::f16::from_f32(rnd(seed) + 3.0 * (i % d) as f32 / d as f32))
        .collect();
    k[5 * d + 1] = half::f16::from_f32(-40.0);
    k
}

fn stats(rec: &[u8], d: usize, c: usize) -> (f32, f32) {
    let m = half::f16::from_le_bytes([rec[2 * c], rec[2 * c + 1]]).to_f32();
    let s = half::f16::from_le_bytes([rec[2 * d + 2 * c], rec[2 * d + 2 * c + 1]]).to_f32();
    (m, s)
}

#[test]
fn records_are_twelve_bytes_a_channel() {
    assert_eq!(record_bytes(64), 128 + 128 + 512);
    assert_eq!(record_bytes(256), 3072);
    // A slot's share: ¾ of a byte a value (48 B at D = 64, 192 B at 256).
    assert_eq!(record_bytes(64) / SLOTS, 48);
    assert_eq!(record_bytes(256) / SLOTS, 192);
    assert_eq!(crate::KvType::Tq4.key_row_bytes(3, 64), 3 * 48);
    assert_eq!(crate::KvType::Tq4.row_bytes(3, 64), 3 * 36);
}

#[test]
fn round_trip_stays_within_half_a_step_and_never_clips() {
    let mut seed = 5u64;
    for d in [8, 64, 256] {
        let k = keys(d, &mut seed);
        for n in [1, 7, 16] {
            let mut rec = vec![0xAAu8; record_bytes(d)];
            encode_block(&k, d, d, n, &mut rec);
            let mut y = vec![0f32; d];
            for s in 0..n {
                decode(&rec, d, s, &mut y);
                for c in 0..d {
                    let x = k[s * d + c].to_f32();
                    let (_, st) = stats(&rec, d, c);
                    // Half a step, and a little for f32 arithmetic.
                    assert!(
                        (y[c] - x).abs() <= 0.5 * st + 1e-6 * x.abs().max(1.0),
                        "d {d} n {n} slot {s} channel {c}: {} vs {x} (step {st})",
                        y[c]
                    );
                }
            }
            // Slots past n: code 0.
            if n < SLOTS {
                assert!(rec[4 * d + n * d / 2..].iter().all(|&b| b == 0));
            }
            for c in 0..d {
                let col: Vec<f32> = (0..n).map(|s| k[s * d + c].to_f32()).collect();
                let lo = col.iter().fold(f32::INFINITY, |a, &b| a.min(b));
                let hi = col.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let (m, st) = stats(&rec, d, c);
                // The keys are f16 already: the minimum is exact, code 15 reaches the maximum
                // within one f16 step of the step.
                assert_eq!(m, lo, "channel {c}");
                assert!(st.mul_add(15.0, m) >= hi, "channel {c}: clips");
                // The smallest such f16 step: one f16 step (1/1024) above (hi − lo) / 15 at most.
                assert!(st - (hi - lo) / 15.0 <= st / 1024.0 + 1e-7, "channel {c}");
                if n == 1 {
                    assert_eq!(st, 0.0);
                }
            }
        }
    }
}

#[test]
fn extremes_decode_to_themselves_up_to_f16_rounding() {
    // Values that are no f16: the minimum rounds down, code 15 still reaches the maximum.
    let d = 8;
    let col = [0.1f32, -0.3333, 7.77, 1e-3, -1e-5, 3.25, 2.5, 0.0];
    let k: Vec<half::f16> = (0..SLOTS * d)
        .map(|i| half::f16::from_f32(col[(i / d) % 8] * (1 + i % d) as f32))
        .collect();
    let mut rec = vec![0u8; record_bytes(d)];
    encode_block(&k, d, d, SLOTS, &mut rec);
    let mut y = vec![0f32; d];
    for c in 0..d {
        let f = (1 + c) as f32;
        let (lo, hi) = (
            half::f16::from_f32(-0.3333 * f).to_f32(),
            half::f16::from_f32(7.77 * f).to_f32(),
        );
        decode(&rec, d, 1, &mut y);
        assert_eq!(y[c], lo, "channel {c}: the minimum is code 0");
        decode(&rec, d, 2, &mut y);
        let (_, st) = stats(&rec, d, c);
        assert!(
            y[c] >= hi && y[c] - hi <= 15.0 * st / 1024.0 + 1e-6,
            "{} vs {hi}",
            y[c]
        );
    }
    // f32 helpers: rounding is outward, and crosses zero.
    assert_eq!(f16_down(0.1).to_f32(), 0.099975586);
    assert_eq!(f16_up(0.1).to_f32(), 0.10003662);
    assert!(f16_down(-0.0).to_f32() <= 0.0);
    assert!(f16_down(1e-9).to_f32() <= 1e-9);
    assert!(f16_up(-1e-9).to_f32() >= -1e-9);
    assert_eq!(f16_down(1e9).to_f32(), 65504.0);
}

#[test]
fn zero_and_constant_blocks_decode_exactly() {
    let d = 64;
    let mut rec = vec![0xFFu8; record_bytes(d)];
    let z = vec![half::f16::ZERO; SLOTS * d];
    encode_block(&z, d, d, SLOTS, &mut rec);
    assert!(rec.iter().all(|&b| b == 0));
    let c = vec![half::f16::from_f32(-2.5); SLOTS * d];
    encode_block(&c, d, d, SLOTS, &mut rec);
    let mut y = vec![1f32; d];
    decode(&rec, d, 9, &mut y);
    assert!(y.iter().all(|&v| v == -2.5));
    // NaN keys: zeros, no panic.
    let nan = vec![half::f16::NAN; SLOTS * d];
    encode_block(&nan, d, d, SLOTS, &mut rec);
    decode(&rec, d, 0, &mut y);
    assert!(y.iter().all(|&v| v == 0.0));
}

/// Writes `k` (`n` keys of kv_dim) at positions 0..n of blocks `table`, in steps of `step`.
fn write_in_steps(x: &mut ExactKeys, recs: &mut [u8], table: &[u32], k: &[f32], step: usize) {
    let (nkv, hd) = (2, 8);
    let kd = nkv * hd;
    let n = k.len() / kd;
    let slots: Vec<u32> = (0..n)
        .map(|p| table[p / SLOTS] * SLOTS as u32 + (p % SLOTS) as u32)
        .collect();
    for p0 in (0..n).step_by(step) {
        let p1 = (p0 + step).min(n);
        x.write(&slots[p0..p1], &k[p0 * kd..p1 * kd], recs, nkv, hd);
    }
}

#[test]
fn a_block_written_by_steps_or_at_once_gives_the_same_record() {
    let (nkv, hd) = (2, 8);
    let kd = nkv * hd;
    let mut seed = 9u64;
    let n = 45;
    let k: Vec<f32> = (0..n * kd).map(|_| rnd(&mut seed) * 3.0).collect();
    let table = [3u32, 0, 2];
    let rb = record_bytes(hd) * nkv;
    let mut whole = vec![0u8; 4 * rb];
    let mut x = ExactKeys::new(kd, 4);
    write_in_steps(&mut x, &mut whole, &table, &k, n);
    for step in [1, 5, 16] {
        let mut recs = vec![0u8; 4 * rb];
        let mut y = ExactKeys::new(kd, 4);
        write_in_steps(&mut y, &mut recs, &table, &k, step);
        assert_eq!(recs, whole, "steps of {step}");
        // The open block's keys are held exactly (f16).
        let b = y.block(2).unwrap();
        for s in 0..n - 32 {
            for (i, v) in b[s * kd..][..kd].iter().enumerate() {
                assert_eq!(*v, half::f16::from_f32(k[(32 + s) * kd + i]));
            }
        }
    }
    // A rollback: positions 40..44 written with other keys, then rewritten from 38 on with
    // the first keys: the block as if the other keys never were.
    let mut recs = vec![0u8; 4 * rb];
    let mut y = ExactKeys::new(kd, 4);
    write_in_steps(&mut y, &mut recs, &table, &k[..40 * kd], 40);
    let other: Vec<f32> = (0..5 * kd).map(|_| 100.0 + rnd(&mut seed)).collect();
    let sl: Vec<u32> = (40..45)
        .map(|p| 2 * SLOTS as u32 + (p % SLOTS) as u32)
        .collect();
    y.write(&sl, &other, &mut recs, nkv, hd);
    let sl: Vec<u32> = (38..45)
        .map(|p| 2 * SLOTS as u32 + (p % SLOTS) as u32)
        .collect();
    y.write(&sl, &k[38 * kd..], &mut recs, nkv, hd);
    assert_eq!(recs, whole);
}

#[test]
fn dropped_entries_come_back_from_their_records() {
    let (nkv, hd) = (2, 8);
    let kd = nkv * hd;
    let mut seed = 3u64;
    let rb = record_bytes(hd) * nkv;
    let mut recs = vec![0u8; 8 * rb];
    let mut x = ExactKeys::new(kd, 1);
    // Block 0 half written, then six other blocks: block 0's entry is dropped.
    let k: Vec<f32> = (0..8 * kd).map(|_| rnd(&mut seed)).collect();
    let sl: Vec<u32> = (0..8).collect();
    x.write(&sl, &k, &mut recs, nkv, hd);
    for b in 1..7u32 {
        let sl: Vec<u32> = (0..16).map(|s| b * 16 + s).collect();
        let kk: Vec<f32> = (0..16 * kd).map(|_| rnd(&mut seed)).collect();
        x.write(&sl, &kk, &mut recs, nkv, hd);
        assert!(x.map.len() <= 2);
    }
    assert!(x.block(0).is_none());
    // Slot 8 of block 0: slots 0..8 from the record (within half a step of the keys).
    let k8: Vec<f32> = (0..kd).map(|_| rnd(&mut seed)).collect();
    x.write(&[8], &k8, &mut recs, nkv, hd);
    let b = x.block(0).unwrap();
    for s in 0..8 {
        for i in 0..kd {
            let (want, got) = (k[s * kd + i], b[s * kd + i].to_f32());
            assert!(
                (want - got).abs() <= 4.0 / 15.0 / 2.0 + 2e-3,
                "{got} vs {want}"
            );
        }
    }
    assert_eq!(b[8 * kd], half::f16::from_f32(k8[0]));
}
