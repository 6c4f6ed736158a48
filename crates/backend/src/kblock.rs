//! tq4 keys: 4-bit codes per KV block (16 slots), KV head and channel, between the block's
//! minimum and maximum of that channel (docs/TURBOQUANT.md, "tq4 keys").
//!
//! One record per (block, KV head) of head dim D ([`record_bytes`], 12·D bytes):
//! - D f16 minimums `min_c` (each the channel's minimum over the block's keys, rounded down
//!   to an f16),
//! - D f16 steps `step_c` (≥ (max_c − min_c) / 15, rounded up to an f16, so that code 15
//!   reaches the maximum: the codes never clip),
//! - 16 × D/2 bytes of codes: slot s's codes at `s·D/2`, two a byte, the even channel in the
//!   low nibble; code = round((k − min) / step) clamped to 0..15, 0 where the step is 0.
//!
//! A key decodes to `min_c + step_c · code_c` per channel (one `mul_add`, f32); a score is
//! q·min + Σ (q ⊙ step)·code. No rotation.
//!
//! A block's statistics need its keys, so the exact keys (f16) of recently written blocks
//! are kept aside ([`ExactKeys`], keyed by physical block): every write stores the key there
//! and encodes its block's record again from the block's written keys. Attention reads the
//! query's own block from there (the keys written so far, exactly) and every earlier block
//! from its record, which is final once the block is full and depends only on its 16 keys: a
//! query's result never depends on the keys after it or on what else shares the step, and a
//! full block is self-contained (the prefix cache shares only full blocks).

use std::collections::HashMap;

/// Slots of the KV block a record covers (the paged pool's block size, which tq4 keys need).
pub const SLOTS: usize = crate::KV_BLOCK_SIZE;

/// A pool keeps the exact keys of one block in this many ([`ExactKeys::keep_for`]).
pub const KEEP_ONE_IN: usize = 16;

/// Bytes of one (block, KV head) record of head dim `d`: minimums, steps, codes.
pub fn record_bytes(d: usize) -> usize {
    2 * d + 2 * d + SLOTS * d / 2
}

/// The largest f16 ≤ x (x finite, clamped to f16's range).
fn f16_down(x: f32) -> half::f16 {
    let x = x.clamp(-65504.0, 65504.0);
    let h = half::f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    step_f16(h, false)
}

/// The smallest f16 ≥ x (x finite, clamped to f16's range).
fn f16_up(x: f32) -> half::f16 {
    let x = x.clamp(-65504.0, 65504.0);
    let h = half::f16::from_f32(x);
    if h.to_f32() >= x {
        return h;
    }
    step_f16(h, true)
}

/// The f16 next to a finite `h`, up or down.
fn step_f16(h: half::f16, up: bool) -> half::f16 {
    let b = h.to_bits();
    let neg = b & 0x8000 != 0;
    let nb = match (neg, up) {
        // +0 down and −0 up cross zero.
        (false, false) if b == 0 => 0x8001,
        (true, true) if b == 0x8000 => 0x0001,
        (false, true) | (true, false) => b + 1,
        (false, false) | (true, true) => b - 1,
    };
    half::f16::from_bits(nb)
}

/// Encodes one (block, KV head) record from `n` (1..=16) written keys, slot s's key at
/// `keys[s * stride..][..d]`; slots from `n` on get code 0. `out`: [`record_bytes`]`(d)`.
pub fn encode_block(keys: &[half::f16], stride: usize, d: usize, n: usize, out: &mut [u8]) {
    let out = &mut out[..record_bytes(d)];
    let (stats, codes) = out.split_at_mut(4 * d);
    codes.fill(0);
    for c in 0..d {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for s in 0..n {
            let x = keys[s * stride + c].to_f32();
            lo = lo.min(x);
            hi = hi.max(x);
        }
        let (m, st) = stats_of(lo, hi);
        stats[2 * c..][..2].copy_from_slice(&m.to_le_bytes());
        stats[2 * d + 2 * c..][..2].copy_from_slice(&st.to_le_bytes());
        let (m, st) = (m.to_f32(), st.to_f32());
        for s in 0..n {
            let q = code(keys[s * stride + c].to_f32(), m, st);
            codes[s * d / 2 + c / 2] |= q << (4 * (c % 2));
        }
    }
}

/// A channel's minimum and step from its smallest and largest value: the minimum rounded down
/// to an f16, the step the smallest f16 with min + 15·step ≥ hi (0 when lo = hi).
fn stats_of(lo: f32, hi: f32) -> (half::f16, half::f16) {
    if lo > hi {
        // No finite keys (NaN): zeros.
        return (half::f16::ZERO, half::f16::ZERO);
    }
    let m = f16_down(lo);
    let mf = m.to_f32();
    let hi = hi.min(65504.0);
    let mut st = f16_up(((hi - mf) / 15.0).max(0.0));
    // At most a step or two: (hi − min) / 15 rounded in f32 may land below.
    while 15.0f32.mul_add(st.to_f32(), mf) < hi && st.to_f32() < 65504.0 {
        st = step_f16(st, true);
    }
    (m, st)
}

/// The code of x between `m` and `m + 15·st`.
#[inline]
fn code(x: f32, m: f32, st: f32) -> u8 {
    if st > 0.0 {
        // NaN → 0 (`as` saturates).
        ((x - m) / st).round().clamp(0.0, 15.0) as u8
    } else {
        0
    }
}

/// Slot `s`'s key from a record, into `out` (`d` values).
pub fn decode(rec: &[u8], d: usize, s: usize, out: &mut [f32]) {
    let mut st = [0f32; 2 * crate::turboquant::MAX_DIM];
    stats(rec, d, &mut st[..2 * d]);
    decode_with(rec, &st[..2 * d], d, s, out);
}

/// A record's minimums then steps as f32 (`2·d` values into `out`): what [`decode_with`]
/// takes, read once for a block's 16 keys.
pub fn stats(rec: &[u8], d: usize, out: &mut [f32]) {
    for (o, b) in out[..2 * d].iter_mut().zip(rec.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Slot `s`'s key from a record whose [`stats`] are `st`, into `out` (`d` values): the same
/// floats as [`decode`].
pub fn decode_with(rec: &[u8], st: &[f32], d: usize, s: usize, out: &mut [f32]) {
    let codes = &rec[4 * d + s * d / 2..][..d / 2];
    let (m, step) = st[..2 * d].split_at(d);
    for (c, o) in out[..d].iter_mut().enumerate() {
        let q = (codes[c / 2] >> (4 * (c % 2))) & 15;
        *o = step[c].mul_add(q as f32, m[c]);
    }
}

/// The exact (f16) keys of recently written blocks of one layer's tq4 key cache, keyed by
/// physical block: each entry holds 16 slots × `n_head_kv · head_dim` values.
///
/// Every write goes through [`ExactKeys::write`], which stores the keys here and encodes the
/// records of the blocks the step touched again from their written keys (a write at slot j
/// makes slots 0..=j the block's keys: positions past a write are never valid, as after a
/// rollback of rejected tokens). Entries not touched by a step may be dropped once more than
/// `keep` are held (the oldest write first); a block written again after its entry was
/// dropped takes its earlier slots from its record (then 4-bit, not exact). The entries a
/// step touched are kept through it, so a prompt's every query reads its own block exactly.
pub struct ExactKeys {
    kv_dim: usize,
    keep: usize,
    map: HashMap<u32, u32>,
    /// Per entry: its block (`u32::MAX`: free) and the write counter of its last write.
    block: Vec<u32>,
    stamp: Vec<u64>,
    keys: Vec<half::f16>,
    free: Vec<u32>,
    now: u64,
    /// The step's touched blocks: (block, entry, written slots).
    touched: Vec<(u32, u32, usize)>,
    row: Vec<f32>,
    /// `evict`'s candidates (kept, so that a step allocates nothing once warm).
    old: Vec<(u64, u32)>,
}

impl ExactKeys {
    /// Entries for a layer of `kv_dim` values a slot; at most `keep` outlive the step that
    /// wrote them.
    pub fn new(kv_dim: usize, keep: usize) -> ExactKeys {
        ExactKeys {
            kv_dim,
            keep,
            map: HashMap::new(),
            block: Vec::new(),
            stamp: Vec::new(),
            keys: Vec::new(),
            free: Vec::new(),
            now: 0,
            touched: Vec::new(),
            row: Vec::new(),
            old: Vec::new(),
        }
    }

    /// How many blocks [`ExactKeys::new`] keeps for a pool of `n_blocks` blocks: one in
    /// [`KEEP_ONE_IN`], at least 4 (a sequence needs its open block; the rest is slack for
    /// rollbacks).
    pub fn keep_for(n_blocks: usize) -> usize {
        (n_blocks / KEEP_ONE_IN).max(4)
    }

    /// Bytes the kept entries add to each slot of a pool of `kv_dim` values a slot: f16 keys
    /// of one block in [`KEEP_ONE_IN`].
    pub fn bytes_per_slot(kv_dim: usize) -> u64 {
        (2 * kv_dim / KEEP_ONE_IN) as u64
    }

    /// Block `b`'s exact keys (16 slots × kv_dim), if held.
    pub fn block(&self, b: usize) -> Option<&[half::f16]> {
        let e = *self.map.get(&(b as u32))? as usize;
        Some(&self.keys[e * SLOTS * self.kv_dim..][..SLOTS * self.kv_dim])
    }

    /// Writes keys `k[t]` (the step's rows, `kv_dim` each) at `slots[t]` and encodes the
    /// touched blocks' records into `records` (per block, `n_head_kv` records of
    /// [`record_bytes`]`(head_dim)`).
    pub fn write(
        &mut self,
        slots: &[u32],
        k: &[f32],
        records: &mut [u8],
        n_head_kv: usize,
        head_dim: usize,
    ) {
        let kd = self.kv_dim;
        debug_assert_eq!(kd, n_head_kv * head_dim);
        let rb = record_bytes(head_dim);
        self.now += 1;
        self.touched.clear();
        let mut row = std::mem::take(&mut self.row);
        row.resize(head_dim, 0.0);
        for (t, &slot) in slots.iter().enumerate() {
            let (b, s) = (slot / SLOTS as u32, slot as usize % SLOTS);
            let e = match self.map.get(&b) {
                Some(&e) => e,
                None => {
                    let e = self.alloc(b);
                    // A block met past its first slot without an entry: its earlier slots from
                    // its record.
                    let blk = &records[b as usize * n_head_kv * rb..][..n_head_kv * rb];
                    let dst = &mut self.keys[e as usize * SLOTS * kd..][..SLOTS * kd];
                    for j in 0..s {
                        for h in 0..n_head_kv {
                            decode(&blk[h * rb..][..rb], head_dim, j, &mut row);
                            for (o, x) in dst[j * kd + h * head_dim..][..head_dim]
                                .iter_mut()
                                .zip(&row)
                            {
                                *o = half::f16::from_f32(*x);
                            }
                        }
                    }
                    e
                }
            };
            self.stamp[e as usize] = self.now;
            let dst = &mut self.keys[(e as usize * SLOTS + s) * kd..][..kd];
            for (o, x) in dst.iter_mut().zip(&k[t * kd..][..kd]) {
                *o = half::f16::from_f32(*x);
            }
            match self.touched.iter_mut().find(|x| x.0 == b) {
                Some(x) => x.2 = s + 1,
                None => self.touched.push((b, e, s + 1)),
            }
        }
        for &(b, e, n) in &self.touched {
            let src = &self.keys[e as usize * SLOTS * kd..][..SLOTS * kd];
            let blk = &mut records[b as usize * n_head_kv * rb..][..n_head_kv * rb];
            for h in 0..n_head_kv {
                encode_block(
                    &src[h * head_dim..],
                    kd,
                    head_dim,
                    n,
                    &mut blk[h * rb..][..rb],
                );
            }
        }
        self.row = row;
        self.evict();
    }

    /// A free entry for block `b`.
    fn alloc(&mut self, b: u32) -> u32 {
        let e = match self.free.pop() {
            Some(e) => e,
            None => {
                self.block.push(u32::MAX);
                self.stamp.push(0);
                self.keys
                    .resize(self.keys.len() + SLOTS * self.kv_dim, half::f16::ZERO);
                (self.block.len() - 1) as u32
            }
        };
        self.block[e as usize] = b;
        self.map.insert(b, e);
        e
    }

    /// Drops the oldest entries the last step did not touch while more than `keep` are held.
    fn evict(&mut self) {
        let held = self.map.len();
        if held <= self.keep {
            return;
        }
        let mut old = std::mem::take(&mut self.old);
        old.clear();
        old.extend(
            (0..self.block.len() as u32)
                .filter(|&e| {
                    self.block[e as usize] != u32::MAX && self.stamp[e as usize] < self.now
                })
                .map(|e| (self.stamp[e as usize], e)),
        );
        old.sort_unstable();
        for &(_, e) in old.iter().take(held - self.keep) {
            self.map.remove(&self.block[e as usize]);
            self.block[e as usize] = u32::MAX;
            self.free.push(e);
        }
        self.old = old;
    }
}

#[cfg(test)]
#[path = "kblock_tests.rs"]
mod tests;
