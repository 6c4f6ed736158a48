//! Splitting text around special tokens before tokenization (llama.cpp's
//! `tokenizer_st_partition`): special tokens are taken longest first, and each claims every
//! occurrence that lies wholly inside text no longer-or-earlier special token has claimed.

use aho_corasick::{AhoCorasick, MatchKind};
use std::collections::BTreeMap;

/// A piece of the input: raw text (a byte range of it) or a special token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fragment {
    Text(std::ops::Range<usize>),
    Token(u32),
}

/// The special tokens of a vocabulary in matching priority order, and a matcher over them.
pub struct Specials {
    /// (id, allowed only when parsing special tokens) in priority order (longest text first).
    tokens: Vec<(u32, bool)>,
    matcher: Option<AhoCorasick>,
}

impl Specials {
    /// `tokens`: (id, text, is control-or-unknown). The order given is kept among tokens of
    /// equal length.
    pub fn new(mut tokens: Vec<(u32, &str, bool)>) -> Result<Specials, aho_corasick::BuildError> {
        tokens.sort_by_key(|t| std::cmp::Reverse(t.1.len()));
        let matcher = if tokens.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .build(tokens.iter().map(|t| t.1))?,
            )
        };
        Ok(Specials {
            tokens: tokens.iter().map(|t| (t.0, t.2)).collect(),
            matcher,
        })
    }

    /// Token ids in priority order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.tokens.iter().map(|t| t.0)
    }

    /// The stretches of `text` that some control (or unknown) token's text matches, overlapping
    /// matches merged: what must not become a control token when `text` is client input.
    pub fn control_ranges(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        let Some(matcher) = &self.matcher else {
            return Vec::new();
        };
        let mut hits: Vec<std::ops::Range<usize>> = matcher
            .find_overlapping_iter(text)
            .filter(|m| self.tokens[m.pattern().as_usize()].1)
            .map(|m| m.start()..m.end())
            .collect();
        hits.sort_by_key(|r| r.start);
        let mut out: Vec<std::ops::Range<usize>> = Vec::with_capacity(hits.len());
        for r in hits {
            match out.last_mut() {
                Some(last) if r.start < last.end => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        out
    }

    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let Some(matcher) = &self.matcher else {
            return vec![Fragment::Text(0..text.len())];
        };
        // Every occurrence of every enabled special token, grouped by priority.
        let mut hits: Vec<(usize, usize, usize)> = matcher
            .find_overlapping_iter(text)
            .map(|m| (m.pattern().as_usize(), m.start(), m.end()))
            .filter(|&(p, _, _)| parse_special || !self.tokens[p].1)
            .collect();
        if hits.is_empty() {
            return vec![Fragment::Text(0..text.len())];
        }
        hits.sort_unstable();
        // Claimed ranges: start -> (end, pattern).
        let mut claimed: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for (p, s, e) in hits {
            let overlaps = claimed
                .range(..e)
                .next_back()
                .is_some_and(|(_, &(ce, _))| ce > s);
            if !overlaps {
                claimed.insert(s, (e, p));
            }
        }
        let mut out = Vec::with_capacity(claimed.len() * 2 + 1);
        let mut pos = 0;
        for (s, (e, p)) in claimed {
            if s > pos {
                out.push(Fragment::Text(pos..s));
            }
            out.push(Fragment::Token(self.tokens[p].0));
            pos = e;
        }
        if pos < text.len() {
            out.push(Fragment::Text(pos..text.len()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fragment::*;

    #[test]
    fn longest_first_and_control_gating() {
        let sp = Specials::new(vec![
            (1, "<s>", false),
            (2, "</s>", true),
            (3, "<s></s>", true),
            (4, "\n", false),
            (5, "\n\n", false),
        ])
        .unwrap();
        assert_eq!(
            sp.partition("a</s>b <s>c", false),
            [Text(0..7), Token(1), Text(10..11)]
        );
        assert_eq!(
            sp.partition("a</s>b <s>c", true),
            [Text(0..1), Token(2), Text(5..7), Token(1), Text(10..11)]
        );
        assert_eq!(sp.partition("<s></s>", true), [Token(3)]);
        assert_eq!(sp.partition("<s></s>", false), [Token(1), Text(3..7)]);
        assert_eq!(sp.partition("\n\n\n", false), [Token(5), Token(4)]);
        assert_eq!(sp.partition("", true), []);
        assert_eq!(sp.partition("plain", true), [Text(0..5)]);
    }
}
