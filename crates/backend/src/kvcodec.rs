//! The KV cache's element types as bytes: how one head's vector (K or V of one KV head at one
//! position) is stored for each [`KvType`], and the scalar attention over such rows that the
//! backends' fused kernels must agree with.
//!
//! A cache row (one position of one layer) is `n_head_kv` head records side by side, each
//! [`KvType::head_bytes`] long:
//! - `f16`, `bf16`: the values, little-endian;
//! - `q8_0`: ggml's `block_q8_0` per 32 values (f16 scale `amax / 127`, 32 signed bytes);
//! - `tq8`, `tq4`: the TurboQuant codes of the rotated vector ([`crate::turboquant`]), then
//!   the f32 RMS of each block of 256 coordinates.
//!
//! TurboQuant rows hold the *rotated* vector: attention scores a rotated q against them and
//! accumulates values in the rotated domain, un-rotating the output once ([`attend`]).
//!
//! tq4 *keys* are the exception: not rows but one record per (KV block, KV head), 4-bit codes
//! between each channel's minimum and maximum over the block, no rotation ([`crate::kblock`]);
//! a K cache of type tq4 is laid out by blocks ([`KvType::key_row_bytes`] a slot on average).

use crate::kblock::{self, ExactKeys};
use crate::turboquant::{self, Tq};

/// The version of the record layouts and codebooks: part of what identifies a cached block
/// (the prefix cache's hash seed), so that a block is never read under another codec.
/// 2: tq4 keys are per-block min/max records ([`crate::kblock`]); 3: tq8's levels are evenly
/// spaced ([`crate::turboquant::TQ8_STEP`]).
pub const LAYOUT_VERSION: u32 = 3;
use crate::{AttnParams, Batch, KvType, KvTypes};

impl KvType {
    /// Every type, in the order the CLI lists them.
    pub const ALL: [KvType; 5] = [
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Tq8,
        KvType::Tq4,
    ];

    /// The type a name (`f16`, `bf16`, `q8_0`, `tq8`, `tq4`) stands for.
    pub fn parse(s: &str) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Tq8 => "tq8",
            KvType::Tq4 => "tq4",
        }
    }

    /// The TurboQuant codec behind a type, if any.
    pub fn tq(self) -> Option<Tq> {
        match self {
            KvType::Tq8 => Some(Tq::Tq8),
            KvType::Tq4 => Some(Tq::Tq4),
            _ => None,
        }
    }

    /// Whether rows hold the rotated vector.
    pub fn rotated(self) -> bool {
        self.tq().is_some()
    }

    /// Whether one head of `head_dim` values can be stored as this type; else why not.
    pub fn check(self, head_dim: usize) -> std::result::Result<(), String> {
        match self {
            KvType::F16 | KvType::Bf16 => Ok(()),
            KvType::Q8_0 if head_dim.is_multiple_of(32) => Ok(()),
            KvType::Q8_0 => Err(format!(
                "KV type q8_0 needs a head dim that is a multiple of 32, not {head_dim}"
            )),
            _ if head_dim.is_power_of_two() && (8..=turboquant::MAX_DIM).contains(&head_dim) => {
                Ok(())
            }
            _ => Err(format!(
                "KV type {} needs a power-of-two head dim from 8 to {}, not {head_dim}",
                self.name(),
                turboquant::MAX_DIM
            )),
        }
    }

    /// Bytes of one head's record of `head_dim` values.
    pub fn head_bytes(self, head_dim: usize) -> usize {
        match self {
            KvType::F16 | KvType::Bf16 => 2 * head_dim,
            KvType::Q8_0 => head_dim / 32 * 34,
            KvType::Tq8 | KvType::Tq4 => {
                let tq = self.tq().unwrap_or(Tq::Tq8);
                tq.code_bytes(head_dim) + 4 * head_dim.div_ceil(turboquant::BLOCK)
            }
        }
    }

    /// Bytes one position of a layer with `n_head_kv` heads of `head_dim` takes (as V, or as
    /// K of any type but tq4: [`KvType::key_row_bytes`]).
    pub fn row_bytes(self, n_head_kv: usize, head_dim: usize) -> u64 {
        (n_head_kv * self.head_bytes(head_dim)) as u64
    }

    /// Whether keys of this type are per-block records ([`crate::kblock`]): tq4.
    pub fn key_blocks(self) -> bool {
        self == KvType::Tq4
    }

    /// Bytes one position of a K cache of this type takes: [`KvType::row_bytes`], except tq4
    /// keys, a 16th of a block's records (¾ of a byte a value).
    pub fn key_row_bytes(self, n_head_kv: usize, head_dim: usize) -> u64 {
        if self.key_blocks() {
            (n_head_kv * kblock::record_bytes(head_dim) / kblock::SLOTS) as u64
        } else {
            self.row_bytes(n_head_kv, head_dim)
        }
    }
}

impl KvTypes {
    /// The K and V types one name stands for (`--kv-type`): both that type, except `tq4`,
    /// whose keys are stored as tq8. tq4 keys (per-block min/max records since layout 2) meet
    /// the perplexity and top-1 bounds with tq4 values (+0.98% on SmolLM2-135M, +1.68% on
    /// Gemma 3 270M at 2048 tokens) but not passkey retrieval: on Gemma 3 tq4 keys and values
    /// miss 5 of the 14 placements (1,000–3,000 tokens) f16 finds, where K tq8 + V tq4 and tq4
    /// keys with f16 or tq8 values find those tried (docs/TURBOQUANT.md, "Measured"). tq8 keys
    /// with tq4 values cost ~0.39 of f16's bytes (0.33 with tq4 keys); tq4 keys stay available
    /// by naming K's type (`--kv-type-k tq4`).
    pub fn named(t: KvType) -> KvTypes {
        match t {
            KvType::Tq4 => KvTypes {
                k: KvType::Tq8,
                v: KvType::Tq4,
            },
            t => KvTypes { k: t, v: t },
        }
    }
}

/// Stores one head vector `x` as `ty` into `out` (`ty.head_bytes(x.len())` bytes).
pub fn encode_head(ty: KvType, x: &[f32], out: &mut [u8]) {
    let d = x.len();
    let out = &mut out[..ty.head_bytes(d)];
    match ty {
        KvType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        KvType::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        KvType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(34).zip(x.chunks_exact(32)) {
                // ggml's quantize_row_q8_0_ref.
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                for (q, v) in o[2..].iter_mut().zip(b) {
                    *q = (v * id).round() as i8 as u8;
                }
            }
        }
        KvType::Tq8 | KvType::Tq4 => {
            let tq = ty.tq().unwrap_or(Tq::Tq8);
            let nc = tq.code_bytes(d);
            let mut rms = [0f32; turboquant::MAX_DIM / turboquant::BLOCK];
            let rms = &mut rms[..d.div_ceil(turboquant::BLOCK)];
            turboquant::encode_into(x, tq, &mut out[..nc], rms);
            for (o, r) in out[nc..].chunks_exact_mut(4).zip(rms.iter()) {
                o.copy_from_slice(&r.to_le_bytes());
            }
        }
    }
}

/// The values one head record stands for, into `out` (`head_dim` values); for TurboQuant
/// types the rotated vector (level × RMS per coordinate), as attention reads it.
pub fn decode_head(ty: KvType, rec: &[u8], out: &mut [f32]) {
    let d = out.len();
    match ty {
        KvType::F16 => {
            for (o, b) in out.iter_mut().zip(rec.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvType::Bf16 => {
            for (o, b) in out.iter_mut().zip(rec.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(rec.chunks_exact(34)) {
                let s = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (v, q) in o.iter_mut().zip(&b[2..]) {
                    *v = *q as i8 as f32 * s;
                }
            }
        }
        // tq8's level computed from the code (each product rounded as TQ8_LEVELS[c] × RMS is:
        // the same bits), so that the loop vectorizes.
        KvType::Tq8 => {
            let (codes, rms) = rec.split_at(d);
            let blocks = out
                .chunks_mut(turboquant::BLOCK)
                .zip(codes.chunks(turboquant::BLOCK));
            for ((o, c), r) in blocks.zip(rms.chunks_exact(4)) {
                let r = f32::from_le_bytes([r[0], r[1], r[2], r[3]]);
                for (o, &c) in o.iter_mut().zip(c) {
                    *o = (c as f32 - 127.5) * turboquant::TQ8_STEP * r;
                }
            }
        }
        KvType::Tq4 => {
            let levels = Tq::Tq4.levels();
            let (codes, rms) = rec.split_at(Tq::Tq4.code_bytes(d));
            for (i, o) in out.iter_mut().enumerate() {
                let c = (codes[i / 2] >> (4 * (i % 2))) & 15;
                let r = &rms[4 * (i / turboquant::BLOCK)..][..4];
                *o = levels[c as usize] * f32::from_le_bytes([r[0], r[1], r[2], r[3]]);
            }
        }
    }
}

/// One layer's K or V cache as bytes: `ty` records of `head_dim` values, `n_head_kv` per slot;
/// as K of type tq4, `n_head_kv` [`kblock`] records per block of 16 slots, and the exact keys
/// of the blocks written lately (`exact`; `None`: every key from its record).
#[derive(Clone, Copy)]
pub struct KvRows<'a> {
    pub ty: KvType,
    pub bytes: &'a [u8],
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub exact: Option<&'a ExactKeys>,
}

impl<'a> KvRows<'a> {
    /// The record of KV head `h` at `slot` (not for tq4 keys).
    pub fn head(&self, slot: usize, h: usize) -> &'a [u8] {
        let hb = self.ty.head_bytes(self.head_dim);
        &self.bytes[(slot * self.n_head_kv + h) * hb..][..hb]
    }

    /// tq4 keys: the record of KV head `h` of block `b`.
    pub fn block_record(&self, b: usize, h: usize) -> &'a [u8] {
        let rb = kblock::record_bytes(self.head_dim);
        &self.bytes[(b * self.n_head_kv + h) * rb..][..rb]
    }

    /// tq4 keys: KV head `h`'s key at `slot` into `out`, from the exact keys when `exact` and
    /// the block's are held, else from the block's record.
    /// `st` caches the statistics of the block last read from a record (`*st_of`: that block
    /// + 1, 0 for none), so that a block's 16 keys read them once.
    pub fn block_key(
        &self,
        slot: usize,
        h: usize,
        exact: bool,
        st: (&mut [f32], &mut usize),
        out: &mut [f32],
    ) {
        let (b, s) = (slot / kblock::SLOTS, slot % kblock::SLOTS);
        let d = self.head_dim;
        if let Some(keys) = self.exact.filter(|_| exact).and_then(|x| x.block(b)) {
            let row = &keys[(s * self.n_head_kv + h) * d..][..d];
            for (o, x) in out.iter_mut().zip(row) {
                *o = x.to_f32();
            }
            return;
        }
        let rec = self.block_record(b, h);
        let (st, st_of) = st;
        if *st_of != b + 1 {
            kblock::stats(rec, d, st);
            *st_of = b + 1;
        }
        kblock::decode_with(rec, st, d, s, out);
    }
}

/// Buffers one [`attend`] call uses (grown once, reused).
#[derive(Default)]
pub struct AttendScratch {
    q: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    sum: Vec<f32>,
    krow: Vec<f32>,
    /// tq4 keys: the key as the query's own block holds it (exact).
    kown: Vec<f32>,
    /// tq4 keys: the statistics of the block last read from a record, and that block + 1.
    kstat: Vec<f32>,
    kstat_of: usize,
    vrow: Vec<f32>,
}

/// q·k with eight running sums (lane i % 8), added pairwise at the end: one fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            s[l] += x[l] * y[l];
        }
    }
    let mut t = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (x, y) in a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
    {
        t += x * y;
    }
    t
}

/// Attention of heads `h0..h0 + g` (of one KV group) of the consecutive batch tokens `tokens`
/// (all of one sequence) over the sequence's cached K/V of any element types; `q` is the
/// step's whole `[n_tokens, n_head, head_dim]`, and the result is left in the scratch
/// ([`AttendScratch::row`]). Each key's records are decoded once for all the
/// tokens and heads, scores and the online softmax in f32 in key order, values accumulated in
/// f32. A rotated K type meets a rotated q; a rotated V type's accumulator is un-rotated at the
/// end. tq4 keys ([`crate::kblock`]): a token reads the keys of its own block (the block of
/// its position) exactly, as written so far, and every earlier block's from its record. Each
/// token's floats are those it gets alone (batch invariant): the same operations on the same
/// keys in the same order, whatever else shares the call.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    k: KvRows,
    v: KvRows,
    batch: &Batch,
    a: &AttnParams,
    tokens: std::ops::Range<usize>,
    h0: usize,
    g: usize,
    sc: &mut AttendScratch,
) {
    let hd = a.head_dim;
    let nt = tokens.len();
    let kvh = h0 / (a.n_head / a.n_head_kv);
    let s = batch.seq_of[tokens.start] as usize;
    let span = |t: usize| {
        let pos = batch.positions[t] as usize;
        (
            a.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize)),
            pos,
        )
    };
    let scale = if a.scale_q { 1.0 } else { a.scale };
    sc.q.clear();
    for t in tokens.clone() {
        sc.q.extend_from_slice(&q[(t * a.n_head + h0) * hd..][..g * hd]);
    }
    let kb = k.ty.key_blocks();
    if k.ty.rotated() && !kb {
        sc.q.chunks_exact_mut(hd)
            .for_each(turboquant::rotate_in_place);
    }
    sc.acc.clear();
    sc.acc.resize(nt * g * hd, 0.0);
    sc.m.clear();
    sc.m.resize(nt * g, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(nt * g, 0.0);
    sc.krow.resize(hd, 0.0);
    sc.kown.resize(hd, 0.0);
    sc.kstat.resize(2 * hd, 0.0);
    sc.kstat_of = 0;
    sc.vrow.resize(hd, 0.0);
    let bs = kblock::SLOTS;
    let lo = tokens.clone().map(|t| span(t).0).min().unwrap_or(0);
    let hi = tokens.clone().map(|t| span(t).1).max().unwrap_or(0);
    for p in lo..=hi {
        let slot = batch.slot(s, p);
        // tq4 keys: whether a token of the run reads p from its block's record (an earlier
        // block) or exactly (its own block).
        if kb {
            let (mut rec, mut own) = (false, false);
            for t in tokens.clone() {
                let (first, pos) = span(t);
                if (first..=pos).contains(&p) {
                    if pos / bs == p / bs {
                        own = true;
                    } else {
                        rec = true;
                    }
                }
            }
            if rec {
                let st = (&mut sc.kstat[..], &mut sc.kstat_of);
                k.block_key(slot, kvh, false, st, &mut sc.krow);
            }
            if own {
                let st = (&mut sc.kstat[..], &mut sc.kstat_of);
                k.block_key(slot, kvh, true, st, &mut sc.kown);
            }
        } else {
            decode_head(k.ty, k.head(slot, kvh), &mut sc.krow);
        }
        decode_head(v.ty, v.head(slot, kvh), &mut sc.vrow);
        for (i, t) in tokens.clone().enumerate() {
            let (first, pos) = span(t);
            if p < first || p > pos {
                continue;
            }
            let krow = if kb && pos / bs == p / bs {
                &sc.kown
            } else {
                &sc.krow
            };
            for j in i * g..(i + 1) * g {
                let mut x = dot(&sc.q[j * hd..][..hd], krow) * scale;
                if let Some(c) = a.softcap {
                    x = c * (x / c).tanh();
                }
                // One exponential per key: the new maximum's weight is exactly 1.
                let acc = &mut sc.acc[j * hd..][..hd];
                let w = if x > sc.m[j] {
                    let r = (sc.m[j] - x).exp();
                    sc.m[j] = x;
                    sc.sum[j] = sc.sum[j] * r + 1.0;
                    acc.iter_mut().for_each(|a| *a *= r);
                    1.0
                } else {
                    let w = (x - sc.m[j]).exp();
                    sc.sum[j] += w;
                    w
                };
                for (a, b) in acc.iter_mut().zip(&sc.vrow) {
                    *a += w * b;
                }
            }
        }
    }
    for j in 0..nt * g {
        let inv = if sc.sum[j] > 0.0 {
            1.0 / sc.sum[j]
        } else {
            0.0
        };
        let acc = &mut sc.acc[j * hd..][..hd];
        acc.iter_mut().for_each(|x| *x *= inv);
        if v.ty.rotated() {
            turboquant::unrotate_in_place(acc);
        }
    }
}

impl AttendScratch {
    /// After [`attend`]: the output of the `i`-th token's head `h0 + j`.
    pub fn row(&self, i: usize, j: usize, g: usize, hd: usize) -> &[f32] {
        &self.acc[(i * g + j) * hd..][..hd]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }

    #[test]
    fn names_round_trip_and_sizes_follow_the_layouts() {
        for t in KvType::ALL {
            assert_eq!(KvType::parse(t.name()), Some(t));
        }
        assert_eq!(KvType::parse("q4_0"), None);
        assert_eq!(KvType::F16.head_bytes(64), 128);
        assert_eq!(KvType::Q8_0.head_bytes(128), 4 * 34);
        assert_eq!(KvType::Tq8.head_bytes(128), 128 + 4);
        assert_eq!(KvType::Tq4.head_bytes(512), 256 + 8);
        assert!(KvType::Tq8.check(96).is_err());
        assert!(KvType::Q8_0.check(80).is_err());
        assert!(KvType::Tq4.check(256).is_ok());
    }

    #[test]
    fn tq4_names_tq8_keys_and_tq4_values() {
        for t in KvType::ALL {
            let n = KvTypes::named(t);
            assert_eq!(n.v, t);
            assert_eq!(n.k, if t == KvType::Tq4 { KvType::Tq8 } else { t });
        }
        // K and V bytes of one head at one position against f16's: 0.41, 0.39, 0.38, 0.38.
        let n = KvTypes::named(KvType::Tq4);
        for (d, bytes) in [(64, 104), (128, 200), (256, 392), (512, 784)] {
            assert_eq!(n.k.key_row_bytes(1, d) + n.v.row_bytes(1, d), bytes);
        }
        // tq4 keys and values: 0.33, 0.32, 0.32, 0.32 (records; the exact keys add 1/16).
        for (d, bytes) in [(64, 84), (128, 164), (256, 324), (512, 648)] {
            let k = KvType::Tq4.key_row_bytes(1, d);
            assert_eq!(k + KvType::Tq4.row_bytes(1, d), bytes);
        }
        assert_eq!(
            KvType::Tq8.key_row_bytes(2, 64),
            KvType::Tq8.row_bytes(2, 64)
        );
    }

    #[test]
    fn q8_0_rows_are_ggmls_blocks() {
        let mut s = 7u64;
        let x: Vec<f32> = (0..128).map(|_| rnd(&mut s)).collect();
        let mut ours = vec![0u8; KvType::Q8_0.head_bytes(128)];
        encode_head(KvType::Q8_0, &x, &mut ours);
        let mut theirs = Vec::new();
        quiver_quant::quantize(quiver_gguf::GgmlType::Q8_0, &x, &mut theirs).unwrap();
        assert_eq!(ours, theirs);
        let mut back = vec![0f32; 128];
        decode_head(KvType::Q8_0, &ours, &mut back);
        let mut want = vec![0f32; 128];
        quiver_quant::dequantize(quiver_gguf::GgmlType::Q8_0, &theirs, &mut want).unwrap();
        assert_eq!(back, want);
    }

    /// Every tq8 code of both blocks of a 512-value record decodes to its level × the block's
    /// RMS, bit for bit (the decoder computes the level).
    #[test]
    fn every_tq8_code_decodes_to_its_level() {
        let mut rec: Vec<u8> = (0..512).map(|i| (i % 256) as u8).collect();
        let rms = [1.37f32, 0.0123];
        rec.extend(rms.iter().flat_map(|r| r.to_le_bytes()));
        let mut y = vec![0f32; 512];
        decode_head(KvType::Tq8, &rec, &mut y);
        for (i, v) in y.iter().enumerate() {
            let want = turboquant::TQ8_LEVELS[i % 256] * rms[i / 256];
            assert_eq!(v.to_bits(), want.to_bits(), "value {i}");
        }
    }

    #[test]
    fn records_decode_to_what_the_reference_codec_gives() {
        let mut s = 11u64;
        for d in [64, 256, 512] {
            let x: Vec<f32> = (0..d).map(|_| rnd(&mut s)).collect();
            for ty in KvType::ALL {
                let mut rec = vec![0u8; ty.head_bytes(d)];
                encode_head(ty, &x, &mut rec);
                let mut y = vec![0f32; d];
                decode_head(ty, &rec, &mut y);
                let want: Vec<f32> = match ty.tq() {
                    Some(tq) => turboquant::decode_rotated(&turboquant::encode(&x, tq), d, tq),
                    None => x.clone(),
                };
                let tol = match ty {
                    KvType::F16 => 2e-3,
                    KvType::Bf16 => 1.6e-2,
                    KvType::Q8_0 => 2.0 / 127.0,
                    _ => 0.0,
                };
                for (a, b) in y.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "{ty:?} d {d}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
