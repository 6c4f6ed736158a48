//! SentencePiece-style tokenization as llama.cpp does it: start from UTF-8 characters and
//! repeatedly merge the adjacent pair whose concatenation is the vocabulary entry with the
//! highest score (leftmost first on ties); what is left and is not a token falls back to
//! byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Candidate {
    /// Greater = popped first: higher score, then smaller left index. Scores compare as
    /// llama.cpp compares them (`-0.0 == 0.0`).
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .partial_cmp(&o.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// Tokenizes `text` (spaces already escaped as ▁) and appends the ids to `out`.
/// `byte_token(b)` gives the fallback token of a byte, if the vocabulary has one.
pub fn tokenize(
    text: &str,
    vocab: &HashMap<String, u32>,
    scores: &[f32],
    byte_token: impl Fn(u8) -> Option<u32>,
    out: &mut Vec<u32>,
) {
    struct Sym {
        start: usize,
        len: usize,
        next: usize,
        prev: usize,
    }
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym {
            start,
            len: c.len_utf8(),
            prev: i.wrapping_sub(1),
            next: i + 1,
        });
    }
    let n = syms.len();
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Candidate>, syms: &[Sym], l: usize, r: usize| {
        if l >= n || r >= n {
            return;
        }
        let (start, end) = (syms[l].start, syms[r].start + syms[r].len);
        if let Some(&id) = vocab.get(&text[start..end]) {
            let score = scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Candidate {
                score,
                left: l,
                right: r,
                size: end - start,
            });
        }
    };
    for i in 1..n {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(c) = heap.pop() {
        let (l, r) = (c.left, c.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != c.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        let rn = syms[r].next;
        syms[l].next = rn;
        if rn < n {
            syms[rn].prev = l;
        }
        let lp = syms[l].prev;
        try_add(&mut heap, &syms, lp, l);
        try_add(&mut heap, &syms, l, rn);
    }
    let mut i = 0;
    while i < n {
        let s = &syms[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.get(piece) {
            Some(&id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(&byte_token)),
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_score_first_and_byte_fallback() {
        let words = ["▁", "a", "b", "ab", "▁a", "<0xC3>", "<0xA9>"];
        let vocab: HashMap<String, u32> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, 0.0, 0.0];
        let byte = |b: u8| vocab.get(&format!("<0x{b:02X}>")).copied();
        let mut out = Vec::new();
        tokenize("▁ab", &vocab, &scores, byte, &mut out);
        // "ab" (-1) beats "▁a" (-2).
        assert_eq!(out, [0, 3]);
        out.clear();
        tokenize("é", &vocab, &scores, byte, &mut out);
        assert_eq!(out, [5, 6]);
    }
}
