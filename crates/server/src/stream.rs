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
}

impl StreamState {
    fn on_event(&mut self, ev: Option<Event>) {
        let out = &mut self.out;
        match ev {
            Some(Event::Started { .. }) => {}
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
                let fr = reason.as_str();
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
    };
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
