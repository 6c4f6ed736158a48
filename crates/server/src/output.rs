//! OpenAI's response shapes: whole responses, logprobs, usage.

use crate::app::St;
use crate::error::ApiError;
use crate::generate::{Gen, Kind};
use axum::response::{IntoResponse, Response};
use axum::Json;
use quiver_engine::serve::{Event, TokenLogprob};
use serde_json::{json, Value};

/// Formats a request's output in OpenAI's shapes.
#[derive(Clone)]
pub(crate) struct Out {
    pub(crate) st: St,
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) logprobs: bool,
    pub(crate) text_offset: usize,
    /// The prompt's ids when it is echoed with logprobs (empty otherwise).
    pub(crate) echo_ids: Vec<u32>,
    /// Chat with tools the model may call: calls in the text become `tool_calls`.
    pub(crate) tools: Option<crate::tools::Tools>,
    /// A thinking model's chat: its tags, and whether the prompt opened the thinking.
    pub(crate) thinking: Option<crate::reasoning::Thinking>,
}

pub(crate) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

impl Out {
    pub(crate) fn piece(&self, id: u32) -> String {
        self.st.handle.tokenizer().decode(&[id], false)
    }

    /// The token's own bytes: a token holding part of a UTF-8 character gives those bytes,
    /// not U+FFFD's.
    fn piece_bytes(&self, id: u32) -> Vec<u8> {
        self.st
            .handle
            .tokenizer()
            .token_piece_bytes(id)
            .into_owned()
    }

    /// Chat logprob entries for one token.
    pub(crate) fn chat_logprob(&self, id: u32, lp: &TokenLogprob) -> Value {
        let top: Vec<Value> = lp
            .top
            .iter()
            .map(|&(t, l)| json!({"token": self.piece(t), "logprob": l, "bytes": self.piece_bytes(t)}))
            .collect();
        json!({"token": self.piece(id), "logprob": lp.logprob, "bytes": self.piece_bytes(id), "top_logprobs": top})
    }

    /// Legacy completion logprobs for a run of tokens; advances the text offset.
    pub(crate) fn completion_logprobs(
        &mut self,
        toks: &[(u32, String, Option<TokenLogprob>)],
    ) -> Value {
        let mut tokens = Vec::new();
        let mut lps = Vec::new();
        let mut tops = Vec::new();
        let mut offs = Vec::new();
        for (id, text, lp) in toks {
            tokens.push(json!(self.piece(*id)));
            offs.push(json!(self.text_offset));
            self.text_offset += text.len();
            match lp {
                Some(lp) => {
                    lps.push(json!(lp.logprob));
                    let mut m = serde_json::Map::new();
                    for &(t, l) in &lp.top {
                        m.insert(self.piece(t), json!(l));
                    }
                    tops.push(Value::Object(m));
                }
                None => {
                    lps.push(Value::Null);
                    tops.push(Value::Null);
                }
            }
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
    }

    /// Legacy completion logprobs of the echoed prompt: its first token has none, each other
    /// its `PromptLogprobs` entry; offsets into the echoed text from 0, which the generated
    /// tokens' offsets then follow.
    pub(crate) fn prompt_logprobs(&mut self, lps: Vec<TokenLogprob>, echo_len: usize) -> Value {
        let ids = std::mem::take(&mut self.echo_ids);
        let tok = self.st.handle.tokenizer();
        let mut lps = lps.into_iter();
        let toks: Vec<(u32, String, Option<TokenLogprob>)> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let lp = if i == 0 { None } else { lps.next() };
                (id, tok.decode(&[id], true), lp)
            })
            .collect();
        self.text_offset = 0;
        let v = self.completion_logprobs(&toks);
        self.text_offset = echo_len;
        v
    }

    pub(crate) fn model(&self) -> &str {
        &self.st.model
    }

    pub(crate) fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model(), "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v.to_string()
    }
}

/// What one generation produced, collected before it is formatted.
struct Collected {
    text: String,
    toks: Vec<(u32, String, Option<TokenLogprob>)>,
    prompt_lps: Option<Vec<TokenLogprob>>,
    reason: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
}

async fn collect(mut gen: Gen, logprobs: bool) -> Result<Collected, ApiError> {
    let mut c = Collected {
        text: String::new(),
        toks: Vec::new(),
        prompt_lps: None,
        reason: "stop",
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_tokens: 0,
    };
    loop {
        match gen.next().await {
            // (Text generations get no embedding.)
            Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
            Some(Event::PromptLogprobs(lps)) => c.prompt_lps = Some(lps),
            Some(Event::Token { id, text, logprob }) => {
                c.text.push_str(&text);
                if logprobs {
                    c.toks.push((id, text, logprob));
                }
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                c.reason = reason.as_str();
                (c.prompt_tokens, c.completion_tokens, c.cached_tokens) =
                    (prompt_tokens, completion_tokens, cached_tokens);
                return Ok(c);
            }
            Some(Event::Error(e)) => {
                return Err(ApiError::internal(format!("generation failed: {e}")))
            }
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

/// The whole response of one or more generations of the same prompt (`n`): choice i is
/// generation i; usage counts the prompt once and every choice's tokens.
pub(crate) async fn whole_response(
    gens: Vec<Gen>,
    out: Out,
    echo: Option<String>,
) -> Result<Response, ApiError> {
    Ok(Json(whole_json(gens, out, echo).await?).into_response())
}

/// [`whole_response`]'s body.
pub(crate) async fn whole_json(
    gens: Vec<Gen>,
    mut out: Out,
    echo: Option<String>,
) -> Result<Value, ApiError> {
    let logprobs = out.logprobs;
    let all = futures_util::future::join_all(gens.into_iter().map(|g| collect(g, logprobs))).await;
    let mut choices = Vec::new();
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    let echo_ids = std::mem::take(&mut out.echo_ids);
    for (i, c) in all.into_iter().enumerate() {
        let c = c?;
        if i == 0 {
            (prompt, cached) = (c.prompt_tokens, c.cached_tokens);
        }
        completion += c.completion_tokens;
        let fr = c.reason;
        let choice = match out.kind {
            Kind::Chat => {
                let lp = if logprobs {
                    json!({"content": c.toks.iter().filter_map(|(id, _, lp)| lp.as_ref().map(|lp| out.chat_logprob(*id, lp))).collect::<Vec<_>>()})
                } else {
                    Value::Null
                };
                let (reasoning, text) = match out.thinking {
                    Some(th) => crate::reasoning::split(&c.text, th),
                    None => (None, c.text.clone()),
                };
                let calls = out.tools.as_ref().and_then(|t| t.extract(&text));
                let legacy = out.tools.as_ref().is_some_and(|t| t.legacy);
                let (mut message, fr) = match calls {
                    Some((content, calls)) if !calls.is_empty() => {
                        let content = if content.is_empty() {
                            Value::Null
                        } else {
                            json!(content)
                        };
                        let mut m = json!({"role": "assistant", "content": content});
                        if legacy {
                            m["function_call"] = crate::tools::function_call_json(&calls[0]);
                        } else {
                            m["tool_calls"] =
                                crate::tools::tool_calls_json(&calls, &format!("{}_{i}", out.id));
                        }
                        let called = if legacy {
                            "function_call"
                        } else {
                            "tool_calls"
                        };
                        (m, if fr == "stop" { called } else { fr })
                    }
                    // A call cut short: the text before it.
                    Some((content, _)) => (json!({"role": "assistant", "content": content}), fr),
                    None => (json!({"role": "assistant", "content": text}), fr),
                };
                if let Some(r) = reasoning {
                    message["reasoning_content"] = json!(r);
                }
                json!({"index": i, "message": message, "logprobs": lp, "finish_reason": fr})
            }
            Kind::Completion => {
                let mut text = echo.clone().unwrap_or_default();
                let lp = if logprobs {
                    let prompt_lp = match (c.prompt_lps, echo_ids.is_empty()) {
                        (Some(lps), false) => {
                            out.echo_ids = echo_ids.clone();
                            Some(out.prompt_logprobs(lps, text.len()))
                        }
                        _ => None,
                    };
                    out.text_offset = text.len();
                    let gen = out.completion_logprobs(&c.toks);
                    match prompt_lp {
                        Some(p) => concat_logprobs(p, gen),
                        None => gen,
                    }
                } else {
                    Value::Null
                };
                text.push_str(&c.text);
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": fr})
            }
        };
        choices.push(choice);
    }
    let object = match out.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let body = json!({
        "id": out.id, "object": object, "created": out.created, "model": out.model(),
        "choices": choices,
        "usage": usage(prompt, completion, cached),
    });
    Ok(body)
}

/// The prompt's legacy logprobs followed by the generated tokens'.
fn concat_logprobs(mut a: Value, b: Value) -> Value {
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[k].as_array_mut(), b[k].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}
