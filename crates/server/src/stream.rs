//! Streamed responses: server-sent events in OpenAI's chunk format, ending with `[DONE]`.

use crate::error::ApiError;
use crate::generate::{Gen, Kind};
use crate::output::{usage, Out};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use quiver_engine::serve::Event;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;

struct StreamState {
    gen: Gen,
    out: Out,
    include_usage: bool,
    pending: VecDeque<String>,
    done: bool,
    /// An echoed prompt held back until its logprobs arrive.
    echo: Option<String>,
    /// With tools: text held back because it may be (the start of) a tool call.
    held: String,
    /// A tool call has begun: everything from there is held to the end.
    in_call: bool,
    /// A thinking model's chat: routes its thinking to `reasoning_content`.
    think: Option<crate::reasoning::Splitter>,
}

impl StreamState {
    fn on_event(&mut self, ev: Option<Event>) {
        let out = &mut self.out;
        match ev {
            Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
            Some(Event::PromptLogprobs(lps)) => {
                // The echoed prompt waited for its logprobs (see `stream_response`).
                if let Some(echo) = self.echo.take() {
                    let lp = out.prompt_logprobs(lps, echo.len());
                    let c =
                        json!([{"index": 0, "text": echo, "logprobs": lp, "finish_reason": null}]);
                    self.pending.push_back(out.chunk(c, None));
                }
            }
            Some(Event::Token { id, text, logprob }) => {
                let text = match self.think.as_mut() {
                    Some(sp) => {
                        let (r, c) = sp.push(&text);
                        if !r.is_empty() {
                            let ch = json!([{"index": 0, "delta": {"reasoning_content": r}, "logprobs": null, "finish_reason": null}]);
                            self.pending.push_back(out.chunk(ch, None));
                        }
                        c
                    }
                    None => text,
                };
                let text = match &out.tools {
                    Some(t) => {
                        self.held.push_str(&text);
                        let (emit, keep) =
                            split_for_calls(&self.held, t.format.marker(), &mut self.in_call);
                        let emit = emit.to_string();
                        self.held = keep.to_string();
                        emit
                    }
                    None => text,
                };
                if text.is_empty() && !(out.logprobs && logprob.is_some()) {
                    return;
                }
                let choice = match out.kind {
                    Kind::Chat => {
                        let lp = match (&logprob, out.logprobs) {
                            (Some(lp), true) => json!({"content": [out.chat_logprob(id, lp)]}),
                            _ => Value::Null,
                        };
                        json!({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                    }
                    Kind::Completion => {
                        let lp = if out.logprobs {
                            out.completion_logprobs(&[(id, text.clone(), logprob)])
                        } else {
                            Value::Null
                        };
                        json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null})
                    }
                };
                self.pending.push_back(out.chunk(json!([choice]), None));
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let mut fr = reason.as_str();
                if let Some(sp) = self.think.as_mut() {
                    let (r, c) = sp.finish();
                    if !r.is_empty() {
                        let ch = json!([{"index": 0, "delta": {"reasoning_content": r}, "logprobs": null, "finish_reason": null}]);
                        self.pending.push_back(out.chunk(ch, None));
                    }
                    if out.tools.is_some() {
                        self.held.push_str(&c);
                    } else if !c.is_empty() {
                        let ch = json!([{"index": 0, "delta": {"content": c}, "logprobs": null, "finish_reason": null}]);
                        self.pending.push_back(out.chunk(ch, None));
                    }
                }
                if let Some(t) = &out.tools {
                    let held = std::mem::take(&mut self.held);
                    match t.extract(&held) {
                        Some((content, calls)) => {
                            if !content.is_empty() {
                                let c = json!([{"index": 0, "delta": {"content": content}, "logprobs": null, "finish_reason": null}]);
                                self.pending.push_back(out.chunk(c, None));
                            }
                            let mut tc = crate::tools::tool_calls_json(&calls, &out.id);
                            for (i, c) in tc.as_array_mut().into_iter().flatten().enumerate() {
                                c["index"] = json!(i);
                            }
                            let c = json!([{"index": 0, "delta": {"tool_calls": tc}, "logprobs": null, "finish_reason": null}]);
                            self.pending.push_back(out.chunk(c, None));
                            if fr == "stop" {
                                fr = "tool_calls";
                            }
                        }
                        None if !held.is_empty() => {
                            let c = json!([{"index": 0, "delta": {"content": held}, "logprobs": null, "finish_reason": null}]);
                            self.pending.push_back(out.chunk(c, None));
                        }
                        None => {}
                    }
                }
                let choice = match out.kind {
                    Kind::Chat => {
                        json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": fr})
                    }
                    Kind::Completion => {
                        json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fr})
                    }
                };
                self.pending.push_back(out.chunk(json!([choice]), None));
                if self.include_usage {
                    self.pending.push_back(out.chunk(
                        json!([]),
                        Some(usage(prompt_tokens, completion_tokens, cached_tokens)),
                    ));
                }
                self.pending.push_back("[DONE]".into());
                self.done = true;
            }
            Some(Event::Error(e)) => {
                self.pending.push_back(
                    ApiError::internal(format!("generation failed: {e}"))
                        .body()
                        .to_string(),
                );
                self.pending.push_back("[DONE]".into());
                self.done = true;
            }
            None => {
                self.pending.push_back(
                    ApiError::internal("the engine dropped the request")
                        .body()
                        .to_string(),
                );
                self.pending.push_back("[DONE]".into());
                self.done = true;
            }
        }
    }
}

pub(crate) fn stream_response(
    gen: Gen,
    out: Out,
    include_usage: bool,
    echo: Option<String>,
) -> Response {
    let mut st = StreamState {
        gen,
        out,
        include_usage,
        pending: VecDeque::new(),
        done: false,
        echo: None,
        held: String::new(),
        in_call: false,
        think: None,
    };
    st.think = st.out.thinking.map(crate::reasoning::Splitter::new);
    let echo_lp = st.out.logprobs && !st.out.echo_ids.is_empty();
    let first = match st.out.kind {
        Kind::Chat => {
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        }
        Kind::Completion => {
            json!([{"index": 0, "text": echo.clone().unwrap_or_default(), "logprobs": null, "finish_reason": null}])
        }
    };
    st.out.text_offset = echo.as_ref().map(|e| e.len()).unwrap_or(0);
    if echo_lp {
        st.echo = echo;
    } else {
        st.pending.push_back(st.out.chunk(first, None));
    }
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(s) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(s)), st));
            }
            if st.done {
                return None;
            }
            let ev = st.gen.next().await;
            st.on_event(ev);
        }
    });
    Sse::new(stream).into_response()
}

/// With tools: the part of `held` that can be streamed as content now, and the part to hold.
/// Text from the format's marker on is held (it is a call); so is a tail that could be the
/// marker's start. Without a marker (Llama 3's bare JSON), output that starts as a JSON object
/// is held whole.
fn split_for_calls<'a>(
    held: &'a str,
    marker: Option<&str>,
    in_call: &mut bool,
) -> (&'a str, &'a str) {
    if *in_call {
        return ("", held);
    }
    match marker {
        None => {
            let t = held.trim_start();
            if t.starts_with('{') || t.starts_with("<|python_tag|>") || t.is_empty() {
                *in_call = !t.is_empty();
                ("", held)
            } else {
                (held, "")
            }
        }
        Some(m) => {
            if let Some(at) = held.find(m) {
                *in_call = true;
                return held.split_at(at);
            }
            // The longest tail that is a prefix of the marker stays held.
            let keep = crate::reasoning::tag_prefix_tail(held, m);
            held.split_at(held.len() - keep)
        }
    }
}
