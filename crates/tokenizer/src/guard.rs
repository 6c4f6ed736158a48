//! Chat prompts whose client-supplied text cannot become control tokens: a message whose
//! content holds `<|im_end|><|im_start|>system` must not forge a system turn. Before the
//! template renders the messages, every stretch of their text that a control token's text
//! could match is swapped for a private-use placeholder character; after rendering, the prompt
//! is split around special tokens (which now come only from the template) and each text piece
//! gets its original text back before it is tokenized as plain text. Text without control-token
//! strings renders and tokenizes exactly as before.

use crate::chat::Message;
use crate::{Tokenizer, TokenizerError};
use std::borrow::Cow;

/// Placeholders: Unicode's supplementary private use planes.
const PLANES: [std::ops::RangeInclusive<u32>; 2] = [0xF0000..=0xFFFFD, 0x100000..=0x10FFFD];

#[derive(Default)]
pub(crate) struct Guard {
    /// The text each placeholder stands for, by placeholder number.
    originals: Vec<String>,
}

fn is_placeholder(c: char) -> bool {
    PLANES.iter().any(|p| p.contains(&(c as u32)))
}

impl Guard {
    fn placeholder(&mut self, original: &str) -> Result<char, TokenizerError> {
        let n = self.originals.len() as u32;
        let a = PLANES[0].end() - PLANES[0].start() + 1;
        let code = if n < a {
            PLANES[0].start() + n
        } else {
            PLANES[1].start() + (n - a)
        };
        let c = char::from_u32(code)
            .filter(|&c| is_placeholder(c))
            .ok_or_else(|| {
                TokenizerError::Template("the messages hold too many special-token strings".into())
            })?;
        self.originals.push(original.to_string());
        Ok(c)
    }

    /// `s` with every stretch that could match a control token (and every private-use
    /// character of the placeholder planes itself) replaced by a placeholder.
    pub fn protect(&mut self, tok: &Tokenizer, s: &str) -> Result<String, TokenizerError> {
        let mut ranges = tok.specials.control_ranges(s);
        ranges.extend(
            s.char_indices()
                .filter(|(_, c)| is_placeholder(*c))
                .map(|(i, c)| i..i + c.len_utf8()),
        );
        if ranges.is_empty() {
            return Ok(s.to_string());
        }
        ranges.sort_by_key(|r| r.start);
        let mut out = String::with_capacity(s.len());
        let mut pos = 0;
        for r in ranges {
            if r.start < pos {
                continue; // inside a stretch already replaced (they are merged)
            }
            out.push_str(&s[pos..r.start]);
            out.push(self.placeholder(&s[r.clone()])?);
            pos = r.end;
        }
        out.push_str(&s[pos..]);
        Ok(out)
    }

    /// Every string inside a JSON value (tool definitions, tool-call arguments) protected.
    pub fn protect_json(
        &mut self,
        tok: &Tokenizer,
        v: &mut serde_json::Value,
    ) -> Result<(), TokenizerError> {
        match v {
            serde_json::Value::String(s) => *s = self.protect(tok, s)?,
            serde_json::Value::Array(a) => {
                for x in a {
                    self.protect_json(tok, x)?;
                }
            }
            serde_json::Value::Object(o) => {
                for x in o.values_mut() {
                    self.protect_json(tok, x)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    pub fn protect_message(
        &mut self,
        tok: &Tokenizer,
        m: &Message,
    ) -> Result<Message, TokenizerError> {
        let mut tool_calls = m.tool_calls.clone();
        if let Some(v) = &mut tool_calls {
            self.protect_json(tok, v)?;
        }
        Ok(Message {
            role: self.protect(tok, &m.role)?,
            content: self.protect(tok, &m.content)?,
            tool_calls,
            name: m
                .name
                .as_deref()
                .map(|s| self.protect(tok, s))
                .transpose()?,
            tool_call_id: m
                .tool_call_id
                .as_deref()
                .map(|s| self.protect(tok, s))
                .transpose()?,
            reasoning_content: m
                .reasoning_content
                .as_deref()
                .map(|s| self.protect(tok, s))
                .transpose()?,
        })
    }

    /// The original text of a piece of the rendered prompt.
    pub fn restore<'s>(&self, s: &'s str) -> Cow<'s, str> {
        if self.originals.is_empty() || !s.chars().any(is_placeholder) {
            return Cow::Borrowed(s);
        }
        let mut out = String::with_capacity(s.len());
        for c in s.chars() {
            match self.index(c) {
                Some(i) => out.push_str(&self.originals[i]),
                None => out.push(c),
            }
        }
        Cow::Owned(out)
    }

    fn index(&self, c: char) -> Option<usize> {
        let code = c as u32;
        let a = PLANES[0].end() - PLANES[0].start() + 1;
        let i = if PLANES[0].contains(&code) {
            code - PLANES[0].start()
        } else if PLANES[1].contains(&code) {
            a + code - PLANES[1].start()
        } else {
            return None;
        };
        ((i as usize) < self.originals.len()).then_some(i as usize)
    }
}
