//! The paged KV block pool with reference counts and a prefix cache. Pure bookkeeping on
//! block numbers: no device memory is touched here.
//!
//! A full block is identified by a hash chain over its tokens (and every token before it, and
//! a per-model seed), so two prompts that share a prefix share its blocks. A block whose last
//! user frees it keeps its hash and goes to the back of the free list: it can be found again
//! until it is handed out for something else (least recently freed first).

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

pub struct BlockPool {
    refs: Vec<u32>,
    hash_of: Vec<Option<u64>>,
    by_hash: HashMap<u64, u32>,
    /// Blocks with no user, oldest-freed first. Cached ones among them may still be reused.
    free: VecDeque<u32>,
}

/// The hash of a block given the hash of the block before it (or the seed).
pub fn chain_hash(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockPool {
    pub fn new(n: usize) -> Self {
        BlockPool {
            refs: vec![0; n],
            hash_of: vec![None; n],
            by_hash: HashMap::new(),
            free: (0..n as u32).collect(),
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks in use by some sequence.
    pub fn used(&self) -> usize {
        self.total() - self.free.len()
    }

    /// A fresh block (evicting the oldest cached one if need be), or None when all are in use.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop_front()?;
        if let Some(h) = self.hash_of[b as usize].take() {
            if self.by_hash.get(&h) == Some(&b) {
                self.by_hash.remove(&h);
            }
        }
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// The cached block with this hash, now referenced once more.
    pub fn lookup(&mut self, hash: u64) -> Option<u32> {
        let b = *self.by_hash.get(&hash)?;
        if self.refs[b as usize] == 0 {
            let pos = self.free.iter().position(|&x| x == b)?;
            self.free.remove(pos);
        }
        self.refs[b as usize] += 1;
        Some(b)
    }

    /// Records that block `b` now holds the full block with this hash.
    pub fn register(&mut self, b: u32, hash: u64) {
        if self.hash_of[b as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.hash_of[b as usize] = Some(hash);
            self.by_hash.insert(hash, b);
        }
    }

    pub fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released twice");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push_back(b);
        }
    }

    pub fn release_all(&mut self, blocks: &mut Vec<u32>) {
        for b in blocks.drain(..) {
            self.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_release_and_prefix_reuse() {
        let mut p = BlockPool::new(3);
        let a = p.alloc().unwrap();
        let h = chain_hash(7, &[1, 2, 3]);
        p.register(a, h);
        assert_eq!(p.used(), 1);
        // A second user of the same prefix shares the block.
        assert_eq!(p.lookup(h), Some(a));
        p.release(a);
        p.release(a);
        assert_eq!(p.used(), 0);
        // Freed but still cached: found again, and taken off the free list.
        assert_eq!(p.lookup(h), Some(a));
        assert_eq!(p.used(), 1);
        p.release(a);
        // Allocation hands out the other blocks first (oldest freed first), then evicts.
        let b = p.alloc().unwrap();
        let c = p.alloc().unwrap();
        assert!(b != a && c != a);
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.lookup(h), None, "evicted block is no longer cached");
        assert_eq!(p.alloc(), None);
        let mut all = vec![a, b, c];
        p.release_all(&mut all);
        assert_eq!(p.used(), 0);
    }

    #[test]
    fn chain_hash_depends_on_the_whole_prefix() {
        let h1 = chain_hash(0, &[1, 2]);
        assert_ne!(
            chain_hash(h1, &[3, 4]),
            chain_hash(chain_hash(0, &[9, 2]), &[3, 4])
        );
        assert_eq!(
            chain_hash(h1, &[3, 4]),
            chain_hash(chain_hash(0, &[1, 2]), &[3, 4])
        );
    }
}
