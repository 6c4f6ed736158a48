//! quiver's OpenAI-compatible HTTP server (axum + tokio) over the serving engine's
//! [`EngineHandle`]: chat and text completions (streamed as server-sent events or whole),
//! models, health, Prometheus metrics, tokenize/detokenize, API keys, graceful shutdown.
//!
//! The CLI calls [`run`] (or, inside a tokio runtime, [`serve`]) with a started engine.

pub mod error;
pub mod metrics;
pub mod params;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::ApiError;
use metrics::Metrics;
use params::{GenParams, Prompt};
use quiver_engine::serve::{EngineHandle, Event, Request, TokenLogprob};
use quiver_tokenizer::chat::ChatTemplate;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How the server listens and what it serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port; the line `quiver: listening on http://HOST:PORT` tells which.
    pub port: u16,
    /// Accepted `Authorization: Bearer KEY` keys; empty: no authentication.
    pub api_keys: Vec<String>,
    /// The model id clients name (`model`); empty: the engine's model name.
    pub model_name: String,
    pub max_body_bytes: usize,
    /// On SIGTERM/SIGINT, how long running requests may go on before they are aborted.
    pub shutdown_grace: Duration,
    /// The model's chat template (`ChatTemplate::for_model`); None: ChatML.
    pub chat_template: Option<Arc<ChatTemplate>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            model_name: String::new(),
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(10),
            chat_template: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

struct AppState {
    handle: EngineHandle,
    model: String,
    keys: Vec<String>,
    template: Arc<ChatTemplate>,
    max_body: usize,
    metrics: Metrics,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    nonce: u64,
}

type St = Arc<AppState>;

/// Runs the server on a fresh tokio runtime until SIGTERM/SIGINT, then shuts the engine down.
/// Returns Ok after a graceful shutdown, so that the CLI exits 0.
pub fn run(handle: EngineHandle, cfg: ServerConfig) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(handle, cfg))
}

/// Serves until SIGTERM or SIGINT.
pub async fn serve(handle: EngineHandle, cfg: ServerConfig) -> Result<(), ServerError> {
    serve_until(handle, cfg, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Serves until `stop` resolves: stops accepting, lets running requests finish within
/// `shutdown_grace` (aborting the rest), then joins the engine.
pub async fn serve_until(
    handle: EngineHandle,
    cfg: ServerConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr()?;
    let model = if cfg.model_name.is_empty() {
        handle.info().name.clone()
    } else {
        cfg.model_name.clone()
    };
    let state = Arc::new(AppState {
        handle: handle.clone(),
        model,
        keys: cfg.api_keys.clone(),
        template: cfg
            .chat_template
            .clone()
            .unwrap_or_else(|| Arc::new(ChatTemplate::builtin(""))),
        max_body: cfg.max_body_bytes,
        metrics: Metrics::default(),
        shutting_down: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
        nonce: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    });
    let app = router(state.clone());
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = rx.wait_for(|v| *v).await;
    });
    eprintln!("quiver: listening on http://{local}");
    let mut task = tokio::spawn(async move { server.await });
    tokio::select! {
        _ = stop => {}
        r = &mut task => {
            // The server ended by itself: an accept error.
            handle.shutdown(Duration::ZERO);
            return match r {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(ServerError::Io(e)),
                Err(e) => Err(ServerError::Io(std::io::Error::other(e.to_string()))),
            };
        }
    }
    eprintln!(
        "quiver: shutting down (grace {:.1}s)",
        cfg.shutdown_grace.as_secs_f64()
    );
    state.shutting_down.store(true, Ordering::SeqCst);
    let _ = tx.send(true);
    let h = handle.clone();
    let grace = cfg.shutdown_grace;
    let engine = tokio::task::spawn_blocking(move || h.shutdown(grace));
    if tokio::time::timeout(grace + Duration::from_secs(3), &mut task)
        .await
        .is_err()
    {
        task.abort();
    }
    let _ = engine.await;
    eprintln!("quiver: stopped");
    Ok(())
}

fn router(state: St) -> Router {
    let limit = state.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|req: HttpRequest| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

async fn count(State(st): State<St>, req: HttpRequest, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "other".to_string());
    let r = next.run(req).await;
    st.metrics.request(&route, r.status().as_u16());
    r
}

/// Keys guard everything but `/health` and `/metrics`.
async fn auth(State(st): State<St>, req: HttpRequest, next: Next) -> Response {
    let path = req.uri().path();
    if st.keys.is_empty() || path == "/health" || path == "/metrics" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(k)
            if st
                .keys
                .iter()
                .any(|key| ct_eq(key.as_bytes(), k.as_bytes())) =>
        {
            next.run(req).await
        }
        _ => ApiError::unauthorized().into_response(),
    }
}

/// Compares without an early exit on the first differing byte.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn body_bytes(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    match body {
        Ok(b) => Ok(b),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            Err(ApiError::too_large(st.max_body))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "cannot read the request body: {e}"
        ))),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn check_model(st: &AppState, p: &GenParams) -> Result<(), ApiError> {
    match &p.model {
        Some(m) if !m.is_empty() && *m != st.model && *m != st.handle.info().name => {
            Err(ApiError::model_not_found(m, &st.model))
        }
        _ => Ok(()),
    }
}

fn render_chat(
    st: &AppState,
    req: &params::ChatRequest,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let text = st
        .template
        .render(&req.messages, add_generation_prompt, req.tools.as_ref())
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the chat template cannot render these messages: {e}"),
            )
        })?;
    st.handle
        .tokenizer()
        .encode_chat(&text)
        .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize the prompt: {e}")))
}

async fn chat_completions(State(st): State<St>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let req = params::parse_chat(&m, st.handle.info().n_vocab)?;
        check_model(&st, &req.params)?;
        let ids = render_chat(&st, &req, true)?;
        generate(st.clone(), ids, req.params, Kind::Chat, None, 0).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(st): State<St>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let req = params::parse_completion(&m, st.handle.info().n_vocab)?;
        check_model(&st, &req.params)?;
        let tok = st.handle.tokenizer();
        let (ids, text) = match req.prompt {
            Prompt::Text(t) => (
                tok.encode(&t, true, true).map_err(|e| {
                    ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}"))
                })?,
                t,
            ),
            Prompt::Tokens(ids) => {
                let t = tok.decode(&ids, false);
                (ids, t)
            }
        };
        let echo = req.echo.then_some(text);
        generate(st.clone(), ids, req.params, Kind::Completion, echo, 16).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
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

/// One running generation: its events, with latency metrics taken on the way.
struct Gen {
    st: St,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortGuard,
    t0: Instant,
    last: Option<Instant>,
}

impl Gen {
    async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        match &ev {
            Some(Event::Token { .. }) => {
                let now = Instant::now();
                match self.last {
                    None => self.st.metrics.ttft((now - self.t0).as_secs_f64()),
                    Some(l) => self.st.metrics.itl((now - l).as_secs_f64()),
                }
                self.last = Some(now);
            }
            Some(Event::Finished { reason, .. }) => {
                self.guard.done = true;
                self.st.metrics.finished(reason.as_str());
                self.st.metrics.e2e(self.t0.elapsed().as_secs_f64());
            }
            Some(Event::Error(_)) => {
                self.guard.done = true;
                self.st.metrics.finished("error");
            }
            Some(Event::Started { .. }) => {}
            None => self.guard.done = true,
        }
        ev
    }
}

async fn generate(
    st: St,
    prompt: Vec<u32>,
    p: GenParams,
    kind: Kind,
    echo: Option<String>,
    default_max: usize,
) -> Result<Response, ApiError> {
    if st.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    let ctx = st.handle.info().n_ctx;
    let param = kind.prompt_param();
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
    let max_tokens = match p.max_tokens {
        Some(m) => m,
        None if default_max > 0 => default_max.min(room),
        None => room,
    };
    let req = Request {
        prompt,
        sampling: p.sampling.clone(),
        max_tokens,
        stop: p.stop.clone(),
        logprobs: p.logprobs,
        ignore_eos: p.ignore_eos,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let t0 = Instant::now();
    let id = st
        .handle
        .submit(req, Box::new(move |ev| tx.send(ev).is_ok()))
        .map_err(|e| ApiError::from_submit(&e, param))?;
    let gen = Gen {
        st: st.clone(),
        rx,
        guard: AbortGuard {
            handle: st.handle.clone(),
            id,
            done: false,
        },
        t0,
        last: None,
    };
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let rid = match kind {
        Kind::Chat => format!("chatcmpl-{:x}{:06x}", st.nonce, n),
        Kind::Completion => format!("cmpl-{:x}{:06x}", st.nonce, n),
    };
    let out = Out {
        st: st.clone(),
        kind,
        id: rid,
        created: unix_now(),
        logprobs: p.logprobs.is_some(),
        text_offset: 0,
    };
    if p.stream {
        Ok(stream_response(gen, out, p.include_usage, echo))
    } else {
        whole_response(gen, out, echo).await
    }
}

/// Formats a request's output in OpenAI's shapes.
struct Out {
    st: St,
    kind: Kind,
    id: String,
    created: u64,
    logprobs: bool,
    text_offset: usize,
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

impl Out {
    fn piece(&self, id: u32) -> String {
        self.st.handle.tokenizer().decode(&[id], false)
    }

    /// Chat logprob entries for one token.
    fn chat_logprob(&self, id: u32, lp: &TokenLogprob) -> Value {
        let tok = self.piece(id);
        let top: Vec<Value> = lp
            .top
            .iter()
            .map(|&(t, l)| {
                let s = self.piece(t);
                json!({"token": s, "logprob": l, "bytes": s.as_bytes()})
            })
            .collect();
        json!({"token": tok, "logprob": lp.logprob, "bytes": tok.as_bytes(), "top_logprobs": top})
    }

    /// Legacy completion logprobs for a run of tokens; advances the text offset.
    fn completion_logprobs(&mut self, toks: &[(u32, String, Option<TokenLogprob>)]) -> Value {
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

    fn model(&self) -> &str {
        &self.st.model
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
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

async fn whole_response(
    mut gen: Gen,
    mut out: Out,
    echo: Option<String>,
) -> Result<Response, ApiError> {
    let mut text = echo.clone().unwrap_or_default();
    out.text_offset = text.len();
    let mut toks: Vec<(u32, String, Option<TokenLogprob>)> = Vec::new();
    loop {
        match gen.next().await {
            Some(Event::Started { .. }) => {}
            Some(Event::Token {
                id,
                text: t,
                logprob,
            }) => {
                text.push_str(&t);
                if out.logprobs {
                    toks.push((id, t, logprob));
                }
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let u = usage(prompt_tokens, completion_tokens, cached_tokens);
                let fr = reason.as_str();
                let body = match out.kind {
                    Kind::Chat => {
                        let lp = if out.logprobs {
                            json!({"content": toks.iter().filter_map(|(id, _, lp)| lp.as_ref().map(|lp| out.chat_logprob(*id, lp))).collect::<Vec<_>>()})
                        } else {
                            Value::Null
                        };
                        json!({
                            "id": out.id, "object": "chat.completion", "created": out.created, "model": out.model(),
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": fr}],
                            "usage": u,
                        })
                    }
                    Kind::Completion => {
                        let lp = if out.logprobs {
                            out.completion_logprobs(&toks)
                        } else {
                            Value::Null
                        };
                        json!({
                            "id": out.id, "object": "text_completion", "created": out.created, "model": out.model(),
                            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": fr}],
                            "usage": u,
                        })
                    }
                };
                return Ok(Json(body).into_response());
            }
            Some(Event::Error(e)) => {
                return Err(ApiError::internal(format!("generation failed: {e}")))
            }
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

struct StreamState {
    gen: Gen,
    out: Out,
    include_usage: bool,
    pending: VecDeque<String>,
    done: bool,
}

impl StreamState {
    fn on_event(&mut self, ev: Option<Event>) {
        let out = &mut self.out;
        match ev {
            Some(Event::Started { .. }) => {}
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

fn stream_response(gen: Gen, out: Out, include_usage: bool, echo: Option<String>) -> Response {
    let mut st = StreamState {
        gen,
        out,
        include_usage,
        pending: VecDeque::new(),
        done: false,
    };
    let first = match st.out.kind {
        Kind::Chat => {
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        }
        Kind::Completion => {
            json!([{"index": 0, "text": echo.clone().unwrap_or_default(), "logprobs": null, "finish_reason": null}])
        }
    };
    st.out.text_offset = echo.map(|e| e.len()).unwrap_or(0);
    st.pending.push_back(st.out.chunk(first, None));
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

async fn list_models(State(st): State<St>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model, "object": "model", "created": st.nonce, "owned_by": "quiver", "max_model_len": st.handle.info().n_ctx})
}

async fn get_model(State(st): State<St>, Path(model): Path<String>) -> Response {
    if model == st.model {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::model_not_found(&model, &st.model).into_response()
    }
}

async fn health(State(st): State<St>) -> Response {
    if st.shutting_down.load(Ordering::SeqCst) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics_text(State(st): State<St>) -> Response {
    let s = st.handle.stats();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(&s),
    )
        .into_response()
}

/// `{"prompt"|"content": TEXT, "add_special": bool}` or `{"messages": [...]}` →
/// `{"tokens", "count", "max_model_len"}`.
async fn tokenize(State(st): State<St>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let tok = st.handle.tokenizer();
        let ids = if m.get("messages").is_some_and(|v| !v.is_null()) {
            let req = params::parse_chat(&m, st.handle.info().n_vocab)?;
            let agp = match m.get("add_generation_prompt") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "add_generation_prompt",
                        "`add_generation_prompt` must be a boolean",
                    ))
                }
            };
            render_chat(&st, &req, agp)?
        } else {
            let (key, text) = match (m.get("prompt"), m.get("content")) {
                (Some(Value::String(s)), _) => ("prompt", s),
                (None, Some(Value::String(s))) => ("content", s),
                _ => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "give `prompt` (or `content`) as a string, or `messages`",
                    ))
                }
            };
            let add = match m.get("add_special") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "add_special",
                        "`add_special` must be a boolean",
                    ))
                }
            };
            tok.encode(text, add, true)
                .map_err(|e| ApiError::invalid(key, format!("cannot tokenize: {e}")))?
        };
        Ok(Json(
            json!({"count": ids.len(), "max_model_len": st.handle.info().n_ctx, "tokens": ids}),
        )
        .into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `{"tokens": [ids]}` → `{"prompt": TEXT, "content": TEXT}`.
async fn detokenize(State(st): State<St>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let b = body_bytes(&st, body)?;
        let m = params::parse_body(&b)?;
        let n_vocab = st.handle.info().n_vocab;
        let ids = match m.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&t| (t as usize) < n_vocab)
                        .map(|t| t as u32)
                })
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("`tokens` must hold token ids below {n_vocab}"),
                    )
                })?,
            _ => {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` must be an array of token ids",
                ))
            }
        };
        let text = st.handle.tokenizer().decode(&ids, false);
        Ok(Json(json!({"prompt": text, "content": text})).into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_engine::serve::SubmitError;

    #[test]
    fn submit_errors_map_to_statuses() {
        let e = ApiError::from_submit(
            &SubmitError::TooLong {
                prompt: 3000,
                max_tokens: 100,
                ctx: 2048,
            },
            "messages",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("3000") && e.message.contains("2048"),
            "{}",
            e.message
        );
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = ApiError::from_submit(&SubmitError::QueueFull(64), "prompt");
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        let r = e.into_response();
        assert_eq!(r.headers().get(header::RETRY_AFTER).unwrap(), "1");
        assert_eq!(
            ApiError::from_submit(&SubmitError::ShuttingDown, "prompt").status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ApiError::from_submit(&SubmitError::EmptyPrompt, "prompt").status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ApiError::from_submit(&SubmitError::BadToken { id: 9, n_vocab: 5 }, "prompt")
                .param
                .as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn error_bodies_are_openai_shaped() {
        let b = ApiError::invalid("temperature", "bad").body();
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "bad");
        assert!(b["error"].get("code").is_some());
        assert_eq!(ApiError::unauthorized().status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            ApiError::too_large(10).status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            ApiError::model_not_found("x", "y").status,
            StatusCode::NOT_FOUND
        );
        let e = ApiError::context_exceeded("prompt", 5000, None, 2048);
        assert!(e.message.contains("5000") && e.message.contains("2048"));
    }

    #[test]
    fn constant_time_compare() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }
}
