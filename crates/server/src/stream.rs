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
use std::sync::{Arc, Mutex};

struct StreamState {
    gen: Gen,
    /// The choice this stream is (`n` > 1: one state per choice, merged).
    index: usize,
    /// One of several choices: no usage chunk or `[DONE]` of its own; its counts go to
    /// `totals` for the merged stream's end.
    multi: Option<Arc<Mutex<Totals>>>,
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
        let idx = self.index;
        match ev {
            Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
            Some(Event::PromptLogprobs(lps)) => {
                // The echoed prompt waited for its logprobs (see `stream_response`).
                if let Some(echo) = self.echo.take() {
                    let lp = out.prompt_logprobs(lps, echo.len());
                    let c = json!([{"index": idx, "text": echo, "logprobs": lp, "finish_reason": null}]);
                    self.pending.push_back(out.chunk(c, None));
                }
            }
            Some(Event::Token { id, text, logprob }) => {
                let text = match self.think.as_mut() {
                    Some(sp) => {
                        let (r, c) = sp.push(&text);
                        if !r.is_empty() {
                            let ch = json!([{"index": idx, "delta": {"reasoning_content": r}, "logprobs": null, "finish_reason": null}]);
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
                        json!({"index": idx, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                    }
                    Kind::Completion => {
                        let lp = if out.logprobs {
                            out.completion_logprobs(&[(id, text.clone(), logprob)])
                        } else {
                            Value::Null
                        };
                        json!({"index": idx, "text": text, "logprobs": lp, "finish_reason": null})
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
                        let ch = json!([{"index": idx, "delta": {"reasoning_content": r}, "logprobs": null, "finish_reason": null}]);
                        self.pending.push_back(out.chunk(ch, None));
                    }
                    if out.tools.is_some() {
                        self.held.push_str(&c);
                    } else if !c.is_empty() {
                        let ch = json!([{"index": idx, "delta": {"content": c}, "logprobs": null, "finish_reason": null}]);
                        self.pending.push_back(out.chunk(ch, None));
                    }
                }
                if let Some(t) = &out.tools {
                    let held = std::mem::take(&mut self.held);
                    match t.extract(&held) {
                        Some((content, calls)) => {
                            if !content.is_empty() {
                                let c = json!([{"index": idx, "delta": {"content": content}, "logprobs": null, "finish_reason": null}]);
                                self.pending.push_back(out.chunk(c, None));
                            }
                            // (None: the only call was cut short, and is left out.)
                            if let Some(first) = calls.first() {
                                let delta = if t.legacy {
                                    json!({"function_call": crate::tools::function_call_json(first)})
                                } else {
                                    let mut tc = crate::tools::tool_calls_json(&calls, &out.id);
                                    for (i, c) in
                                        tc.as_array_mut().into_iter().flatten().enumerate()
                                    {
                                        c["index"] = json!(i);
                                    }
                                    json!({"tool_calls": tc})
                                };
                                let c = json!([{"index": idx, "delta": delta, "logprobs": null, "finish_reason": null}]);
                                self.pending.push_back(out.chunk(c, None));
                                if fr == "stop" {
                                    fr = if t.legacy {
                                        "function_call"
                                    } else {
                                        "tool_calls"
                                    };
                                }
                            }
                        }
                        None if !held.is_empty() => {
                            let c = json!([{"index": idx, "delta": {"content": held}, "logprobs": null, "finish_reason": null}]);
                            self.pending.push_back(out.chunk(c, None));
                        }
                        None => {}
                    }
                }
                let choice = match out.kind {
                    Kind::Chat => {
                        json!({"index": idx, "delta": {}, "logprobs": null, "finish_reason": fr})
                    }
                    Kind::Completion => {
                        json!({"index": idx, "text": "", "logprobs": null, "finish_reason": fr})
                    }
                };
                self.pending.push_back(out.chunk(json!([choice]), None));
                match &self.multi {
                    Some(t) => {
                        let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
                        // The prompt counts once; every choice's tokens count.
                        t.prompt = prompt_tokens;
                        t.cached = cached_tokens;
                        t.completion += completion_tokens;
                    }
                    None => {
                        if self.include_usage {
                            self.pending.push_back(out.chunk(
                                json!([]),
                                Some(usage(prompt_tokens, completion_tokens, cached_tokens)),
                            ));
                        }
                        self.pending.push_back("[DONE]".into());
                    }
                }
                self.done = true;
            }
            Some(Event::Error(e)) => {
                self.pending.push_back(
                    ApiError::internal(format!("generation failed: {e}"))
                        .body()
                        .to_string(),
                );
                if self.multi.is_none() {
                    self.pending.push_back("[DONE]".into());
                }
                self.done = true;
            }
            None => {
                self.pending.push_back(
                    ApiError::internal("the engine dropped the request")
                        .body()
                        .to_string(),
                );
                if self.multi.is_none() {
                    self.pending.push_back("[DONE]".into());
                }
                self.done = true;
            }
        }
    }
}

/// The choices' counts for the usage chunk of a merged stream.
#[derive(Default)]
struct Totals {
    prompt: usize,
    completion: usize,
    cached: usize,
}

/// The stream of one choice (`index`), `multi` when it is one of several.
fn choice_stream(
    gen: Gen,
    out: Out,
    index: usize,
    include_usage: bool,
    echo: Option<String>,
    multi: Option<Arc<Mutex<Totals>>>,
) -> impl futures_util::Stream<Item = String> + Send {
    let idx = index;
    let mut st = StreamState {
        gen,
        index,
        multi,
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
            json!([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        }
        Kind::Completion => {
            json!([{"index": idx, "text": echo.clone().unwrap_or_default(), "logprobs": null, "finish_reason": null}])
        }
    };
    st.out.text_offset = echo.as_ref().map(|e| e.len()).unwrap_or(0);
    if echo_lp {
        st.echo = echo;
    } else {
        st.pending.push_back(st.out.chunk(first, None));
    }
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(s) = st.pending.pop_front() {
                return Some((s, st));
            }
            if st.done {
                return None;
            }
            let ev = st.gen.next().await;
            st.on_event(ev);
        }
    })
}

/// The response streamed: one choice's chunks, or with `n` > 1 every choice's as they come
/// (each with its `index`), then one usage chunk when asked for and `[DONE]`.
pub(crate) fn stream_response(
    mut gens: Vec<Gen>,
    out: Out,
    include_usage: bool,
    echo: Option<String>,
) -> Response {
    use futures_util::StreamExt;
    let data = |s: String| Ok::<_, Infallible>(SseEvent::default().data(s));
    if gens.len() == 1 {
        let gen = gens.pop().expect("one generation");
        let s = choice_stream(gen, out, 0, include_usage, echo, None);
        return Sse::new(s.map(data)).into_response();
    }
    stream_groups(vec![(gens, out, echo)], include_usage)
}

/// Several prompts' choices streamed as one response (`/v1/completions` with a list of
/// prompts; one prompt's `n` choices are one group): the choices of group g follow those of
/// the groups before it in `index`, every choice's chunks go out as they come, then one usage
/// chunk when asked for (each prompt counted once) and `[DONE]`.
pub(crate) fn stream_groups(
    groups: Vec<(Vec<Gen>, Out, Option<String>)>,
    include_usage: bool,
) -> Response {
    use futures_util::StreamExt;
    let data = |s: String| Ok::<_, Infallible>(SseEvent::default().data(s));
    let end_out = groups.first().map(|g| g.1.clone());
    let mut totals = Vec::with_capacity(groups.len());
    let mut streams = Vec::new();
    for (gens, out, echo) in groups {
        let t = Arc::new(Mutex::new(Totals::default()));
        for g in gens {
            let i = streams.len();
            let s = choice_stream(
                g,
                out.clone(),
                i,
                include_usage,
                echo.clone(),
                Some(t.clone()),
            );
            streams.push(Box::pin(s));
        }
        totals.push(t);
    }
    let tail = futures_util::stream::once(async move {
        let mut v = Vec::new();
        if let (true, Some(end_out)) = (include_usage, end_out) {
            let (mut prompt, mut completion, mut cached) = (0, 0, 0);
            for t in &totals {
                let t = t.lock().unwrap_or_else(|e| e.into_inner());
                (prompt, completion, cached) = (
                    prompt + t.prompt,
                    completion + t.completion,
                    cached + t.cached,
                );
            }
            v.push(end_out.chunk(json!([]), Some(usage(prompt, completion, cached))));
        }
        v.push("[DONE]".to_string());
        futures_util::stream::iter(v)
    })
    .flatten();
    let all = futures_util::stream::select_all(streams).chain(tail);
    Sse::new(all.map(data)).into_response()
}

/// With tools: the part of `held` that can be streamed as content now, and the part to hold.
/// Text from the format's marker on is held (it is a call); so is a tail that could be the
/// marker's start, and the whitespace before it (the templates' separator before a call block,
/// as llama.cpp's DeepSeek V4 cases have it, goes with the calls, not the content). Without a marker (Llama 3's bare JSON), output that starts as a JSON object
/// is held whole.
pub(crate) fn split_for_calls<'a>(
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
                return held.split_at(held[..at].trim_end().len());
            }
            // The longest tail that is a prefix of the marker stays held, with the
            // whitespace before it.
            let keep = crate::reasoning::tag_prefix_tail(held, m);
            held.split_at(held[..held.len() - keep].trim_end().len())
        }
    }
}
