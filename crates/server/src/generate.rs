//! `/v1/chat/completions` and `/v1/completions`: parse, tokenize, submit to the engine, then
//! answer whole or as a stream.

use crate::app::{check_prompt_bytes, on_cpu, unix_now, AppState, St};
use crate::error::ApiError;
use crate::output::{whole_response, Out};
use crate::params::{self, GenParams, Prompt};
use crate::reqlog::ReqLog;
use crate::stream::stream_response;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use quiver_engine::serve::{EngineHandle, Event, Request};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub(crate) fn render_chat(
    st: &AppState,
    req: &params::ChatRequest,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    render_chat_with(st, req, add_generation_prompt, None)
}

/// The messages the template renders and the text that continues them: a last assistant
/// message without tool calls is continued (when the turn is to be opened), not closed.
pub(crate) fn prefill_split(
    messages: &[quiver_tokenizer::chat::Message],
    add_generation_prompt: bool,
) -> (&[quiver_tokenizer::chat::Message], Option<&str>) {
    match messages.split_last() {
        Some((last, before))
            if add_generation_prompt && last.role == "assistant" && last.tool_calls.is_none() =>
        {
            (before, Some(last.content.as_str()))
        }
        _ => (messages, None),
    }
}

/// [`render_chat`] with the template's extra variables (`chat_template_kwargs`). A last
/// assistant message (without tool calls) is continued, as llama-server does: the template
/// renders the messages before it and opens the assistant's turn, and its text follows, for
/// the answer to go on from.
pub(crate) fn render_chat_with(
    st: &AppState,
    req: &params::ChatRequest,
    add_generation_prompt: bool,
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<Vec<u32>, ApiError> {
    let (messages, prefill) = prefill_split(&req.messages, add_generation_prompt);
    let failed = |e: quiver_tokenizer::TokenizerError| match e {
        quiver_tokenizer::TokenizerError::Template(_) => ApiError::invalid(
            "messages",
            format!("the chat template cannot render these messages: {e}"),
        ),
        e => ApiError::invalid("messages", format!("cannot tokenize the prompt: {e}")),
    };
    // The prompt is bounded before it is tokenized. The messages' and tools' text, when it
    // fits, bounds it; when it does not, the rendered prompt decides, since a template may
    // leave some of it out (tools, say).
    let text_bytes: usize = req
        .messages
        .iter()
        .map(|m| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len))
        .sum::<usize>()
        + req.tools.as_ref().map_or(0, |t| t.to_string().len());
    if check_prompt_bytes(st, text_bytes, "messages").is_err() {
        let text = st
            .template
            .render_with(messages, add_generation_prompt, req.tools.as_ref(), kwargs)
            .map_err(failed)?;
        check_prompt_bytes(st, text.len(), "messages")?;
    }
    // Special tokens come only from the template: the messages' text is tokenized as text.
    st.template
        .tokenize_with(
            st.handle.tokenizer(),
            messages,
            add_generation_prompt,
            req.tools.as_ref(),
            kwargs,
            prefill,
        )
        .map_err(failed)
}

/// A chat-completions body parsed, its tools and reasoning read, its prompt rendered with
/// the chat template and tokenized: the parameters and the prompt's ids. Anthropic's Messages
/// and OpenAI's Responses translate their bodies into this one and run it the same way.
pub(crate) fn prepare_chat(
    s: &AppState,
    mut m: serde_json::Map<String, serde_json::Value>,
) -> Result<(GenParams, Vec<u32>), ApiError> {
    s.defaults.fill(&mut m);
    let reasoning = crate::compat::reasoning_parsed(&m)?;
    let legacy = crate::compat::legacy_functions(&mut m)?;
    let kwargs = crate::compat::template_kwargs(&m)?;
    let mut req = params::parse_chat(&m, s.handle.info().n_vocab)?;
    let format = crate::tools::Format::of_template(s.template.source());
    if let Some(mut t) = crate::tools::Tools::parse(&m, format)? {
        t.legacy = legacy;
        if let Some(spec) = t.constraint() {
            if let Some((_, field)) = &req.params.constraint {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` forces a tool call; `{field}` constrains the output too: give one"),
                ));
            }
            req.params.constraint = Some((spec, "tool_choice"));
        }
        req.params.tools = Some(t);
    }
    let ids = render_chat_with(s, &req, true, kwargs.as_ref())?;
    let thinking = crate::reasoning::template_thinks(s.template.source()).map(|tags| {
        let tail = &ids[ids.len().saturating_sub(8)..];
        let text = s.handle.tokenizer().decode(tail, false);
        crate::reasoning::Thinking {
            tags,
            prompt_opened: crate::reasoning::prompt_opens(&text, tags),
            calls: req
                .params
                .tools
                .as_ref()
                .filter(|t| t.choice != crate::tools::Choice::None)
                .and_then(|t| t.format.marker()),
        }
    });
    req.params.thinking = thinking.filter(|_| reasoning);
    if let (None, Some(t)) = (&req.params.constraint, &req.params.tools) {
        // `auto`: the calls the model may write (after its thinking) follow the tools' schemas.
        let spec = t.auto_constraint(thinking);
        req.params.constraint = spec.map(|spec| (spec, "tools"));
    }
    Ok((req.params, ids))
}

pub(crate) async fn chat_completions(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let (params, ids) = on_cpu(&st, body, prepare_chat).await?;
        generate(st.clone(), log, ids, params, Kind::Chat, None, 0).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn completions(
    State(st): State<St>,
    Extension(log): Extension<Arc<ReqLog>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let (params, mut prompts) = on_cpu(&st, body, move |s, mut m| {
            s.defaults.fill(&mut m);
            let mut params = None;
            let mut prompts = Vec::new();
            // A list of prompts: each its own body, answered together (crate::prompts).
            for m in crate::prompts::split(&m)? {
                let req = params::parse_completion(&m, s.handle.info().n_vocab)?;
                let tok = s.handle.tokenizer();
                // A raw prompt is the client's own template: special-token text in it becomes
                // those tokens unless the client says `"parse_special": false`.
                let parse_special = params::opt_bool(&m, "parse_special", true)?;
                let (ids, text) = match req.prompt {
                    Prompt::Text(t) => {
                        check_prompt_bytes(s, t.len(), "prompt")?;
                        let ids = tok.encode(&t, true, parse_special).map_err(|e| {
                            ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}"))
                        })?;
                        (ids, Some(t))
                    }
                    Prompt::Tokens(ids) => {
                        // Decoded only to echo it, and not when generate() refuses it anyway.
                        let fits = ids.len() < s.handle.info().n_ctx;
                        let t = (req.echo && fits).then(|| tok.decode(&ids, false));
                        (ids, t)
                    }
                };
                let echo = if req.echo { text } else { None };
                prompts.push((ids, echo));
                params.get_or_insert(req.params);
            }
            let params =
                params.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
            Ok((params, prompts))
        })
        .await?;
        if prompts.len() > 1 {
            return crate::prompts::generate_many(st.clone(), log, prompts, params).await;
        }
        let (ids, echo) = prompts
            .pop()
            .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
        generate(st.clone(), log, ids, params, Kind::Completion, echo, 16).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        }
    }
}

/// Aborts the engine request when the HTTP side goes away first (client disconnected).
struct AbortGuard {
    handle: EngineHandle,
    id: u64,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.handle.abort(self.id);
        }
    }
}

/// A generation whose client left before it finished ends as an abort in the metrics too
/// (its engine request is aborted by the guard).
impl Drop for Gen {
    fn drop(&mut self) {
        if !self.guard.done {
            self.st.metrics.finished("abort");
        }
    }
}

/// One running generation: its events, with latency metrics taken on the way.
pub(crate) struct Gen {
    st: St,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    t0: Instant,
    last: Option<Instant>,
    /// The request's log line, written when the last holder (this, for streams) lets go.
    log: Arc<ReqLog>,
}

impl Gen {
    pub(crate) async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        match &ev {
            Some(Event::Token { .. }) => {
                let now = Instant::now();
                match self.last {
                    None => self.st.metrics.ttft((now - self.t0).as_secs_f64()),
                    Some(l) => self.st.metrics.itl((now - l).as_secs_f64()),
                }
                self.last = Some(now);
                self.log.token();
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                self.guard.done = true;
                self.st.metrics.finished(reason.as_str());
                self.st.metrics.e2e(self.t0.elapsed().as_secs_f64());
                self.log.finished(
                    reason.as_str(),
                    *prompt_tokens,
                    *completion_tokens,
                    *cached_tokens,
                );
            }
            Some(Event::Error(e)) => {
                self.guard.done = true;
                self.st.metrics.finished("error");
                self.log.failed(&format!("generation failed: {e}"));
            }
            Some(Event::Started { .. })
            | Some(Event::PromptLogprobs(_))
            | Some(Event::Embedding(_)) => {}
            None => {
                self.guard.done = true;
                self.log.failed("the engine dropped the request");
            }
        }
        ev
    }
}

pub(crate) async fn generate(
    st: St,
    log: Arc<ReqLog>,
    prompt: Vec<u32>,
    p: GenParams,
    kind: Kind,
    echo: Option<String>,
    default_max: usize,
) -> Result<Response, ApiError> {
    let echo_ids = match (&echo, p.logprobs) {
        (Some(_), Some(_)) => prompt.clone(),
        _ => Vec::new(),
    };
    let prompt_logprobs = echo.as_ref().and(p.logprobs);
    let gens = submit(
        &st,
        &log,
        prompt,
        &p,
        kind.prompt_param(),
        prompt_logprobs,
        default_max,
    )
    .await?;
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let rid = match kind {
        Kind::Chat => format!("chatcmpl-{:x}{:06x}", st.nonce, n),
        Kind::Completion => format!("cmpl-{:x}{:06x}", st.nonce, n),
    };
    log.submitted(&rid);
    let out = Out {
        st: st.clone(),
        kind,
        id: rid,
        created: unix_now(),
        logprobs: p.logprobs.is_some(),
        text_offset: 0,
        echo_ids,
        tools: p
            .tools
            .clone()
            .filter(|t| t.choice != crate::tools::Choice::None),
        thinking: p.thinking,
    };
    if p.stream {
        Ok(stream_response(gens, out, p.include_usage, echo))
    } else {
        whole_response(gens, out, echo).await
    }
}

/// Checks a generation request against the context, compiles its constraint and submits its
/// `n` choices; their event streams. `param` names the prompt's field in errors.
pub(crate) async fn submit(
    st: &St,
    log: &Arc<ReqLog>,
    prompt: Vec<u32>,
    p: &GenParams,
    param: &'static str,
    prompt_logprobs: Option<usize>,
    default_max: usize,
) -> Result<Vec<Gen>, ApiError> {
    if st.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    let ctx = st.handle.info().n_ctx;
    log.prompt(prompt.len());
    if prompt.is_empty() {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::context_exceeded(
            param,
            prompt.len(),
            p.max_tokens,
            ctx,
        ));
    }
    let room = ctx - prompt.len();
    let default_max = st.defaults.max_tokens.unwrap_or(default_max);
    let max_tokens = match p.max_tokens {
        Some(m) => m,
        None if default_max > 0 => default_max.min(room),
        None => room,
    };
    let constraint = match &p.constraint {
        None => None,
        Some((spec, field)) => {
            let Some(g) = &st.grammars else {
                return Err(ApiError::invalid(
                    field,
                    "this model has no vocabulary to constrain",
                ));
            };
            // Compiling a schema can take a while: on the CPU pool (heavy lane), not the
            // runtime.
            let (g, spec, field) = (g.clone(), spec.clone(), *field);
            let compiled = st
                .cpu
                .run(usize::MAX, move || {
                    g.constraint(&spec).map_err(|e| {
                        ApiError::invalid(field, format!("invalid schema or grammar: {e}"))
                    })
                })
                .await;
            match compiled {
                Ok(c) => Some(c),
                // `tool_choice: auto` asked for no grammar: tools whose schemas llguidance
                // cannot compile leave the answer free, as without one.
                Err(_) if field == "tools" => None,
                Err(e) => return Err(e),
            }
        }
    };
    let n_choices = p.n.max(1);
    let req = Request {
        prompt,
        sampling: p.sampling.clone(),
        max_tokens,
        stop: p.stop.clone(),
        logprobs: p.logprobs,
        // Echo with logprobs: the prompt's too (OpenAI's legacy completions).
        prompt_logprobs,
        ignore_eos: p.ignore_eos,
        constraint,
        embed: None,
        cache_salt: crate::tenant::engine_salt(log.cache_key(), p.cache_salt.as_deref()),
        speculative: p.speculative,
    };
    let mut gens = Vec::with_capacity(n_choices);
    for i in 0..n_choices {
        // Choice i samples with seed + i (the same prompt, its blocks shared through the
        // prefix cache).
        let mut r = req.clone();
        r.sampling.seed = r.sampling.seed.wrapping_add(i as u64);
        let (tx, rx) = mpsc::unbounded_channel();
        let t0 = Instant::now();
        let id = st
            .handle
            .submit(r, Box::new(move |ev| tx.send(ev).is_ok()))
            .map_err(|e| ApiError::from_submit(&e, param))?;
        gens.push(Gen {
            st: st.clone(),
            rx,
            guard: AbortGuard {
                handle: st.handle.clone(),
                id,
                done: false,
            },
            t0,
            last: None,
            log: log.clone(),
        });
    }
    Ok(gens)
}
