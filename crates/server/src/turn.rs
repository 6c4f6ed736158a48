//! A chat generation read as an assistant turn's parts, for the APIs that translate chat
//! completions into their own shapes (Anthropic's Messages, OpenAI's Responses): the request
//! runs exactly as `/v1/chat/completions` runs it (template, tools grammar, stop strings,
//! reasoning), and its text comes back as reasoning, text and tool calls, with why it ended
//! (an end-of-generation token, a stop string and which one, the token limit, a call).

use crate::app::St;
use crate::error::ApiError;
use crate::generate::{submit, Gen};
use crate::params::GenParams;
use crate::reasoning::{Splitter, Thinking};
use crate::reqlog::ReqLog;
use crate::tools::{Choice, Tools};
use quiver_engine::serve::{Event, FinishReason};
use serde_json::{Map, Value};
use std::sync::Arc;

/// Why a turn ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The model ended its turn (an end-of-generation token, or its grammar's end).
    EndTurn,
    /// One of the request's stop strings: which one.
    Sequence(String),
    /// The token limit.
    Length,
    /// The turn holds tool calls.
    ToolCalls,
    /// Ended from outside (shutdown).
    Abort,
}

/// How a turn ended, with its token counts.
#[derive(Clone, Debug)]
pub(crate) struct End {
    pub(crate) stop: Stop,
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
    pub(crate) cached_tokens: usize,
}

/// A part of a streamed turn, in the order it is generated.
#[derive(Debug)]
pub(crate) enum Part {
    /// The prompt was scheduled: its length, and how much of it the prefix cache held.
    Started {
        prompt_tokens: usize,
        cached: usize,
    },
    Reasoning(String),
    Text(String),
    /// The calls, at the end of the turn: (name, arguments as a JSON string).
    Calls(Vec<(String, String)>),
    End(End),
    Failed(ApiError),
}

/// A whole turn.
#[derive(Debug)]
pub(crate) struct Whole {
    pub(crate) reasoning: Option<String>,
    pub(crate) text: String,
    pub(crate) calls: Vec<(String, String)>,
    pub(crate) end: End,
}

/// One chat generation in flight, read as parts.
pub(crate) struct Turn {
    st: St,
    gen: Gen,
    tools: Option<Tools>,
    thinking: Option<Thinking>,
    think: Option<Splitter>,
    stops: Vec<String>,
    /// With tools: text held back because it may be (the start of) a call.
    held: String,
    in_call: bool,
    /// Every token's text as the engine gave it, and the ids.
    raw: String,
    ids: Vec<u32>,
    done: bool,
}

impl Turn {
    /// Submits the prepared request (one choice).
    pub(crate) async fn start(
        st: &St,
        log: &Arc<ReqLog>,
        p: &GenParams,
        ids: Vec<u32>,
    ) -> Result<Turn, ApiError> {
        let mut gens = submit(st, log, ids, p, "messages", None, 0).await?;
        let gen = gens
            .pop()
            .ok_or_else(|| ApiError::internal("no generation was started"))?;
        let tools = p.tools.clone().filter(|t| t.choice != Choice::None);
        Ok(Turn {
            st: st.clone(),
            gen,
            tools,
            thinking: p.thinking,
            think: p.thinking.map(Splitter::new),
            stops: p.stop.clone(),
            held: String::new(),
            in_call: false,
            raw: String::new(),
            ids: Vec::new(),
            done: false,
        })
    }

    /// The next parts (possibly none); None once the turn has ended.
    pub(crate) async fn next(&mut self) -> Option<Vec<Part>> {
        if self.done {
            return None;
        }
        let mut parts = Vec::new();
        match self.gen.next().await {
            Some(Event::Started {
                prompt_tokens,
                cached_tokens,
            }) => parts.push(Part::Started {
                prompt_tokens,
                cached: cached_tokens,
            }),
            Some(Event::Token { id, text, .. }) => {
                self.ids.push(id);
                self.raw.push_str(&text);
                let text = match self.think.as_mut() {
                    Some(sp) => {
                        let (r, c) = sp.push(&text);
                        if !r.is_empty() {
                            parts.push(Part::Reasoning(r));
                        }
                        c
                    }
                    None => text,
                };
                let text = match &self.tools {
                    Some(t) => {
                        self.held.push_str(&text);
                        let (emit, keep) = crate::stream::split_for_calls(
                            &self.held,
                            t.format.marker(),
                            &mut self.in_call,
                        );
                        let emit = emit.to_string();
                        self.held = keep.to_string();
                        emit
                    }
                    None => text,
                };
                if !text.is_empty() {
                    parts.push(Part::Text(text));
                }
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                self.done = true;
                if let Some(sp) = self.think.as_mut() {
                    let (r, c) = sp.finish();
                    if !r.is_empty() {
                        parts.push(Part::Reasoning(r));
                    }
                    if self.tools.is_some() {
                        self.held.push_str(&c);
                    } else if !c.is_empty() {
                        parts.push(Part::Text(c));
                    }
                }
                let mut calls = Vec::new();
                if let Some(t) = &self.tools {
                    let held = std::mem::take(&mut self.held);
                    match t.extract(&held) {
                        Some((content, c)) => {
                            if !content.is_empty() {
                                parts.push(Part::Text(content));
                            }
                            calls = c;
                        }
                        None if !held.is_empty() => parts.push(Part::Text(held)),
                        None => {}
                    }
                }
                let stop = self.stop(reason, !calls.is_empty());
                if !calls.is_empty() {
                    parts.push(Part::Calls(calls));
                }
                parts.push(Part::End(End {
                    stop,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                }));
            }
            Some(Event::Error(e)) => {
                self.done = true;
                parts.push(Part::Failed(ApiError::internal(format!(
                    "generation failed: {e}"
                ))));
            }
            Some(Event::PromptLogprobs(_)) | Some(Event::Embedding(_)) => {}
            None => {
                self.done = true;
                parts.push(Part::Failed(ApiError::internal(
                    "the engine dropped the request",
                )));
            }
        }
        Some(parts)
    }

    /// Why the turn ended, from the engine's reason, the last token and the text.
    fn stop(&self, reason: FinishReason, calls: bool) -> Stop {
        match reason {
            FinishReason::Length => Stop::Length,
            FinishReason::Abort => Stop::Abort,
            FinishReason::Stop if calls => Stop::ToolCalls,
            FinishReason::Stop => {
                let tok = self.st.handle.tokenizer();
                if self.stops.is_empty() || self.ids.last().is_some_and(|&t| tok.is_eog(t)) {
                    return Stop::EndTurn;
                }
                let full = tok.decode(&self.ids, true);
                match matched_stop(&self.raw, &full, &self.stops) {
                    Some(s) => Stop::Sequence(s),
                    None => Stop::EndTurn,
                }
            }
        }
    }

    /// Runs the turn to its end: the reasoning, the text and the calls, read from the whole
    /// text as `/v1/chat/completions` reads a whole answer.
    pub(crate) async fn whole(mut self) -> Result<Whole, ApiError> {
        // Parts are read only for the end: the text is split from `raw` as a whole.
        self.think = None;
        let tools = self.tools.take();
        let mut end = None;
        while let Some(parts) = self.next().await {
            for p in parts {
                match p {
                    Part::End(e) => end = Some(e),
                    Part::Failed(e) => return Err(e),
                    _ => {}
                }
            }
        }
        let mut end = end.ok_or_else(|| ApiError::internal("the generation did not end"))?;
        let (reasoning, text) = match self.thinking {
            Some(th) => crate::reasoning::split(&self.raw, th),
            None => (None, self.raw.clone()),
        };
        // (Calls may be empty: the only call was cut short, and the text before it stays.)
        let (text, calls) = match tools.as_ref().and_then(|t| t.extract(&text)) {
            Some((content, calls)) => {
                if !calls.is_empty() && end.stop != Stop::Length && end.stop != Stop::Abort {
                    end.stop = Stop::ToolCalls;
                }
                (content, calls)
            }
            None => (text, Vec::new()),
        };
        Ok(Whole {
            reasoning,
            text,
            calls,
            end,
        })
    }
}

/// Which stop string ended a text: the engine's text (`emitted`) ends where the stop string
/// begins, and `full` (every generated token decoded) goes on with it. The earliest one found
/// from there; None when none is (the text ended otherwise).
pub(crate) fn matched_stop(emitted: &str, full: &str, stops: &[String]) -> Option<String> {
    let from = if full.starts_with(emitted) {
        emitted.len()
    } else {
        0
    };
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| full[from..].find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, s)| (*at, std::cmp::Reverse(s.len())))
        .map(|(_, s)| s.clone())
}

/// A call's arguments as a JSON object (Anthropic's `input`): a string that holds an object
/// becomes that object, an empty one `{}`, anything else an object holding it as `arguments`.
pub(crate) fn arguments_object(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        Ok(Value::Null) | Err(_) if args.trim().is_empty() => Value::Object(Map::new()),
        Ok(other) => serde_json::json!({ "arguments": other }),
        Err(_) => serde_json::json!({ "arguments": args }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_stop_string_that_ended_the_text_is_found() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(
            matched_stop("Hello", "Hello\n\nmore", &stops).as_deref(),
            Some("\n\n")
        );
        assert_eq!(
            matched_stop("a b", "a bEND", &stops).as_deref(),
            Some("END")
        );
        // The earliest after the text wins, whatever the list's order.
        assert_eq!(
            matched_stop("x", "x\n\nEND", &stops).as_deref(),
            Some("\n\n")
        );
        // A stop string inside the text already sent is not the one that ended it.
        assert_eq!(matched_stop("END ok", "END ok", &stops), None);
        assert_eq!(matched_stop("x", "x", &[]), None);
        // Overlapping candidates at the same place: the longer.
        let s = vec!["a".to_string(), "ab".to_string()];
        assert_eq!(matched_stop("", "ab", &s).as_deref(), Some("ab"));
    }

    #[test]
    fn arguments_become_an_object() {
        assert_eq!(arguments_object("{\"a\": 1}"), json!({"a": 1}));
        assert_eq!(arguments_object(""), json!({}));
        assert_eq!(arguments_object("[1]"), json!({"arguments": [1]}));
        assert_eq!(arguments_object("{oops"), json!({"arguments": "{oops"}));
    }
}
