//! Byte-level BPE: merge ranks and the lowest-rank-first merge of one pre-tokenized word.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

const NONE: u32 = u32::MAX;

/// Merge table: every string that takes part in a merge is interned, and each pair of
/// interned strings maps to its rank and the interned id of their concatenation.
pub struct Merges {
    strings: HashMap<String, u32>,
    pairs: HashMap<(u32, u32), (u32, u32)>,
}

impl Merges {
    /// Builds the table from `tokenizer.ggml.merges` entries (`"left right"`). As in
    /// llama.cpp the split is at the first space after the first byte, and the first
    /// occurrence of a pair keeps its rank.
    pub fn new(merges: &[String]) -> Merges {
        let mut m = Merges {
            strings: HashMap::with_capacity(merges.len() * 2),
            pairs: HashMap::with_capacity(merges.len()),
        };
        for (rank, line) in merges.iter().enumerate() {
            let space = line.as_bytes().iter().skip(1).position(|&b| b == b' ');
            let (left, right) = match space {
                Some(p) => (&line[..p + 1], &line[p + 2..]),
                None => ("", ""),
            };
            let l = m.intern(left);
            let r = m.intern(right);
            let joined = m.intern(&format!("{left}{right}"));
            m.pairs.entry((l, r)).or_insert((rank as u32, joined));
        }
        m
    }

    fn intern(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.strings.get(s) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.insert(s.to_string(), id);
        id
    }

    fn lookup(&self, s: &str) -> u32 {
        self.strings.get(s).copied().unwrap_or(NONE)
    }

    fn rank(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        if l == NONE || r == NONE {
            return None;
        }
        self.pairs.get(&(l, r)).copied()
    }

    /// Splits `word` (already byte-level encoded) into the parts BPE merges it into, as byte
    /// ranges of `word`.
    pub fn apply(&self, word: &str, parts: &mut Vec<std::ops::Range<usize>>) {
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
            id: u32,
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            let len = c.len_utf8();
            syms.push(Sym {
                start,
                len,
                prev: i.wrapping_sub(1),
                next: i + 1,
                id: self.lookup(&word[start..start + len]),
            });
        }
        let n = syms.len();
        // Candidate merges: lowest rank first, then leftmost. The lengths recorded with a
        // candidate tell whether both sides are still what they were when it was queued.
        // (rank, left index, left length, right length, id of the joined string)
        type Candidate = Reverse<(u32, usize, usize, usize, u32)>;
        let mut heap: BinaryHeap<Candidate> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize, r: usize| {
            if l >= n || r >= n {
                return;
            }
            if let Some((rank, joined)) = self.rank(syms[l].id, syms[r].id) {
                heap.push(Reverse((rank, l, syms[l].len, syms[r].len, joined)));
            }
        };
        for i in 1..n {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(Reverse((_, l, llen, rlen, joined))) = heap.pop() {
            let r = syms[l].next;
            if r >= n || syms[l].len != llen || syms[r].len != rlen || llen == 0 || rlen == 0 {
                continue;
            }
            syms[l].len += rlen;
            syms[l].id = joined;
            syms[r].len = 0;
            let rn = syms[r].next;
            syms[l].next = rn;
            if rn < n {
                syms[rn].prev = l;
            }
            let lp = syms[l].prev;
            push(&mut heap, &syms, lp, l);
            push(&mut heap, &syms, l, rn);
        }
        let mut i = 0;
        while i < n {
            parts.push(syms[i].start..syms[i].start + syms[i].len);
            i = syms[i].next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(m: &Merges, w: &str) -> Vec<String> {
        let mut parts = Vec::new();
        m.apply(w, &mut parts);
        parts.into_iter().map(|r| w[r].to_string()).collect()
    }

    #[test]
    fn merges_by_rank() {
        let m = Merges::new(&["a b".into(), "b c".into(), "ab c".into(), "Ġ t".into()]);
        assert_eq!(split(&m, "abc"), ["abc"]);
        assert_eq!(split(&m, "bca"), ["bc", "a"]);
        assert_eq!(split(&m, "Ġtx"), ["Ġt", "x"]);
        assert_eq!(split(&m, ""), Vec::<String>::new());
        // Equal candidates: the leftmost merges first.
        let m = Merges::new(&["a a".into()]);
        assert_eq!(split(&m, "aaa"), ["aa", "a"]);
    }
}
