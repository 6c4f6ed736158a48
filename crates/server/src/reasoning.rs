//! Reasoning models' thinking (`<think> … </think>`, as Qwen 3, QwQ and DeepSeek-R1 templates
//! write it; Gemma 4's `<|channel>thought … <channel|>`) goes to `reasoning_content`, as
//! llama-server's default (`deepseek`) format and vLLM's reasoning parsers return it; the
//! answer after it is `content`.

/// The tags around a model's thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    pub open: &'static str,
    pub close: &'static str,
}

pub const THINK: Tags = Tags {
    open: "<think>",
    close: "</think>",
};
pub const GEMMA4: Tags = Tags {
    open: "<|channel>thought",
    close: "<channel|>",
};

/// A thinking chat: its tags, and whether the prompt already opened the thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thinking {
    pub tags: Tags,
    pub prompt_opened: bool,
    /// The tag that opens the request's tool calls, where it has tools: a thinking that never
    /// closes ends where a call begins, as llama.cpp reads DeepSeek V4's answers (a call
    /// forced right after the prompt's `<think>` is written with no `</think>`).
    pub calls: Option<&'static str>,
}

/// The thinking tags of a chat template, where it is a thinking model's (its source spells
/// them).
pub fn template_thinks(source: Option<&str>) -> Option<Tags> {
    let s = source?;
    [THINK, GEMMA4]
        .into_iter()
        .find(|t| s.contains(t.open.trim_end_matches("thought")) && s.contains(t.close))
}

/// Whether a prompt (its last characters) leaves the answer inside the thinking: it ends with
/// the open tag (DeepSeek V3.2 and V4 thinking: `<｜Assistant｜><think>`; not thinking, V3.2
/// closes it again, `<think></think>`, and V4 writes a bare `</think>`).
pub fn prompt_opens(prompt_tail: &str, tags: Tags) -> bool {
    prompt_tail.trim_end().ends_with(tags.open)
}

/// (reasoning, content) of a whole answer: the text inside a leading `<think>` … `</think>`,
/// or, where the prompt already opened the thinking (`prompt_opened`: it ends with `<think>`),
/// everything before `</think>`. An answer that opened it and never closed it is all reasoning,
/// up to a tool call's tag (`th.calls`) where one follows: the call on is content.
pub fn split(text: &str, th: Thinking) -> (Option<String>, String) {
    let Tags { open, close } = th.tags;
    let t = text.trim_start();
    let opened = t.starts_with(open);
    if !opened && !th.prompt_opened {
        return (None, text.to_string());
    }
    let body = if opened { &t[open.len()..] } else { t };
    match body.find(close) {
        Some(end) => (
            Some(body[..end].trim().to_string()),
            body[end + close.len()..].trim_start().to_string(),
        ),
        None => match th.calls.and_then(|m| body.find(m)) {
            Some(at) => (Some(body[..at].trim().to_string()), body[at..].to_string()),
            None => (Some(body.trim().to_string()), String::new()),
        },
    }
}

/// Streaming: routes each piece of text to reasoning or content as the tags pass, holding back
/// a tail that may be the start of a tag.
pub struct Splitter {
    held: String,
    /// Some(true) inside the thinking, Some(false) after it; None before the first text.
    thinking: Option<bool>,
    prompt_opened: bool,
    tags: Tags,
    /// The tools' call tag: held back inside the thinking until it closes (reasoning) or the
    /// answer ends (content: the thinking never closed, a call ended it).
    calls: Option<&'static str>,
    /// Whitespace right after `</think>` is not content (as `split` trims it).
    trim_next: bool,
}

impl Splitter {
    /// `prompt_opened`: the prompt ends with `<think>` (the answer starts inside it).
    pub fn new(th: Thinking) -> Splitter {
        Splitter {
            held: String::new(),
            thinking: None,
            prompt_opened: th.prompt_opened,
            tags: th.tags,
            calls: th.calls,
            trim_next: false,
        }
    }

    /// (reasoning, content) that can be sent now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let Tags { open, close } = self.tags;
        let (mut r, mut c) = (String::new(), String::new());
        loop {
            match self.thinking {
                None => {
                    let t = self.held.trim_start();
                    if t.is_empty() || (!self.prompt_opened && open.starts_with(t)) {
                        return (r, c);
                    }
                    if let Some(rest) = t.strip_prefix(open) {
                        self.held = rest.to_string();
                        self.thinking = Some(true);
                    } else {
                        self.thinking = Some(self.prompt_opened);
                    }
                }
                Some(true) => match self.held.find(close) {
                    Some(end) => {
                        r.push_str(&self.held[..end]);
                        self.held = self.held[end + close.len()..].to_string();
                        self.thinking = Some(false);
                        self.trim_next = true;
                    }
                    None => {
                        let call = self.calls.map(|m| (m, self.held.find(m)));
                        let keep = match call {
                            // From a call's tag on, held: it may yet be thinking.
                            Some((_, Some(at))) => self.held.len() - at,
                            Some((m, None)) => tag_prefix_tail(&self.held, close)
                                .max(tag_prefix_tail(&self.held, m)),
                            None => tag_prefix_tail(&self.held, close),
                        };
                        let cut = self.held.len() - keep;
                        r.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return (r, c);
                    }
                },
                Some(false) => {
                    if self.trim_next {
                        let t = self.held.trim_start();
                        if t.is_empty() {
                            self.held.clear();
                            return (r, c);
                        }
                        self.held = t.to_string();
                        self.trim_next = false;
                    }
                    c.push_str(&self.held);
                    self.held.clear();
                    return (r, c);
                }
            }
        }
    }

    /// What is left at the end: (reasoning, content).
    pub fn finish(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        match self.thinking {
            // The thinking never closed: a call held back is the answer.
            Some(true) if !self.calls.is_some_and(|m| rest.starts_with(m)) => (rest, String::new()),
            _ => (String::new(), rest),
        }
    }
}

/// The length of the longest tail of `s` that is a proper start of `tag` (text to hold back
/// while streaming, in case the tag is arriving).
pub(crate) fn tag_prefix_tail(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn th(prompt_opened: bool) -> Thinking {
        Thinking {
            tags: THINK,
            prompt_opened,
            calls: None,
        }
    }

    #[test]
    fn whole_answers_split() {
        assert_eq!(
            split("<think>\nhmm, two\n</think>\n\nIt is 2.", th(false)),
            (Some("hmm, two".into()), "It is 2.".into())
        );
        assert_eq!(
            split("hmm</think>It is 2.", th(true)),
            (Some("hmm".into()), "It is 2.".into())
        );
        assert_eq!(
            split("hmm</think>It is 2.", th(false)),
            (None, "hmm</think>It is 2.".into())
        );
        assert_eq!(
            split("<think>still going", th(false)),
            (Some("still going".into()), String::new())
        );
        assert_eq!(
            split("Just an answer.", th(false)),
            (None, "Just an answer.".into())
        );
    }

    #[test]
    fn streamed_pieces_route_across_split_tags() {
        let mut s = Splitter::new(th(false));
        let mut r = String::new();
        let mut c = String::new();
        for piece in [
            "<th", "ink>", "let me ", "see</th", "ink>", "\n", "Yes", ".",
        ] {
            let (a, b) = s.push(piece);
            r.push_str(&a);
            c.push_str(&b);
        }
        let (a, b) = s.finish();
        r.push_str(&a);
        c.push_str(&b);
        assert_eq!((r.as_str(), c.as_str()), ("let me see", "Yes."));
        // No thinking: everything is content, even text that looks like a tag's start.
        let mut s = Splitter::new(th(false));
        let (a, b) = s.push("<b>bold</b>");
        assert_eq!((a.as_str(), b.as_str()), ("", "<b>bold</b>"));
        // The prompt opened it.
        let mut s = Splitter::new(th(true));
        let (a, b) = s.push("plan</think>done");
        assert_eq!((a.as_str(), b.as_str()), ("plan", "done"));
    }

    #[test]
    fn gemma4_thought_channel_as_test_chat_cpp_has_it() {
        let g = Thinking {
            tags: GEMMA4,
            prompt_opened: false,
            calls: None,
        };
        assert_eq!(
            split(
                "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?",
                g
            ),
            (
                Some("I'm\nthinking".into()),
                "Hello, world!\nWhat's up?".into()
            )
        );
        assert_eq!(
            split("<|channel>thought<channel|>Hello, world!\nWhat's up?", g),
            (Some(String::new()), "Hello, world!\nWhat's up?".into())
        );
        let mut s = Splitter::new(g);
        let mut out = (String::new(), String::new());
        for piece in ["<|chan", "nel>tho", "ught\nhm", "m<chan", "nel|>Hi"] {
            let (a, b) = s.push(piece);
            out.0.push_str(&a);
            out.1.push_str(&b);
        }
        assert_eq!((out.0.trim(), out.1.as_str()), ("hmm", "Hi"));
        assert_eq!(
            template_thinks(Some("{{'<|channel>thought'}}...<channel|>")),
            Some(GEMMA4)
        );
        assert_eq!(template_thinks(Some("<think></think>")), Some(THINK));
        assert_eq!(template_thinks(Some("plain")), None);
    }

    /// llama.cpp's test-chat.cpp cases for DeepSeek-V3.2.jinja, DeepSeek-V4.jinja and
    /// V4-Flash-0731 (reasoning format `deepseek`): the prompts' ends, then the answers split.
    #[test]
    fn deepseek_v3_2_and_v4_as_test_chat_cpp_has_them() {
        // Thinking: `<think>` ends the prompt; not thinking, V3.2's `<think></think>` and V4's
        // bare `</think>` do not open it.
        assert!(prompt_opens("<｜Assistant｜><think>", THINK));
        assert!(!prompt_opens("<｜Assistant｜><think></think>", THINK));
        assert!(!prompt_opens("<｜Assistant｜></think>", THINK));
        let block = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let ds = |prompt_opened| Thinking {
            tags: THINK,
            prompt_opened,
            calls: Some("<｜DSML｜tool_calls>"),
        };
        let hello = "Hello, world!\nWhat's up?".to_string();
        assert_eq!(split(&hello, ds(false)), (None, hello.clone()));
        assert_eq!(
            split("I'm\nthinking</think>Hello, world!\nWhat's up?", ds(true)),
            (Some("I'm\nthinking".into()), hello.clone())
        );
        assert_eq!(
            split(
                &format!("Let me check the time</think>\n\n{block}"),
                ds(true)
            ),
            (Some("Let me check the time".into()), block.to_string())
        );
        assert_eq!(
            split(
                &format!("Thinking about it</think>Let me call the function.\n\n{block}"),
                ds(true)
            ),
            (
                Some("Thinking about it".into()),
                format!("Let me call the function.\n\n{block}")
            )
        );
        assert_eq!(
            split(&format!("</think>\n\n{block}"), ds(true)),
            (Some(String::new()), block.to_string())
        );
        // V4-Flash, not thinking: the separator goes with the block (the call parse trims it).
        assert_eq!(
            split(&format!("\n\n{block}"), ds(false)),
            (None, format!("\n\n{block}"))
        );
        // A thinking that never closes ends where a call begins (a call forced right after
        // the prompt's `<think>`); without tools it is all thinking.
        let unclosed = format!("Let me check the time\n\n{block}");
        assert_eq!(
            split(&unclosed, ds(true)),
            (Some("Let me check the time".into()), block.to_string())
        );
        assert_eq!(
            split(block, ds(true)),
            (Some(String::new()), block.to_string())
        );
        assert_eq!(
            split(&unclosed, th(true)),
            (Some(unclosed.trim().to_string()), String::new())
        );
        // A call's tag inside a thinking that closes is thinking.
        let mention = format!("I could write {block} here.</think>No call.");
        assert_eq!(
            split(&mention, ds(true)),
            (
                Some(format!("I could write {block} here.")),
                "No call.".into()
            )
        );
        // Streamed, in pieces that cut the tags: the same answers.
        for text in [
            unclosed.as_str(),
            mention.as_str(),
            "I'm\nthinking</think>Hello",
        ] {
            let mut s = Splitter::new(ds(true));
            let (mut r, mut c) = (String::new(), String::new());
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(3) {
                let (a, b) = s.push(&piece.iter().collect::<String>());
                r.push_str(&a);
                c.push_str(&b);
            }
            let (a, b) = s.finish();
            r.push_str(&a);
            c.push_str(&b);
            let (want_r, want_c) = split(text, ds(true));
            assert_eq!(
                (r.trim(), c.as_str()),
                (want_r.unwrap().as_str(), want_c.as_str()),
                "{text}"
            );
        }
    }
}
