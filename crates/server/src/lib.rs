//! quiver's OpenAI-compatible HTTP server (axum + tokio) over the serving engine's
//! [`EngineHandle`]: chat and text completions (streamed as server-sent events or whole),
//! models, health, Prometheus metrics, tokenize/detokenize, API keys, graceful shutdown.
//!
//! The CLI calls [`run`] (or, inside a tokio runtime, [`serve`]) with a started engine.

mod anthropic;
mod app;
mod auth;
mod compat;
mod conn;
mod constrain;
mod cors;
mod cpu;
mod dsml_call;
mod embed;
pub mod error;
mod gemma_call;
mod generate;
pub mod metrics;
mod native;
mod output;
pub mod params;
mod prompts;
pub mod reasoning;
mod reqlog;
mod responses;
mod routes;
mod spec;
mod stream;
mod tenant;
mod tools;
mod turn;
mod webui;
mod xml_call;

use app::{router, AppState};
use metrics::Metrics;
use quiver_engine::serve::EngineHandle;
use quiver_tokenizer::chat::ChatTemplate;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The longest timeout or grace the server uses (a year); longer ones are taken as this.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// How the server listens and what it serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port; the log line `listening on http://HOST:PORT` tells which.
    pub port: u16,
    /// Accepted `Authorization: Bearer KEY` keys; empty: no authentication.
    pub api_keys: Vec<String>,
    /// Each API key gets a prefix cache of its own (`--cache-isolation key`): requests with
    /// different keys never share cached blocks, whatever their `cache_salt`.
    pub cache_by_key: bool,
    /// The model id clients name (`model`); empty: the engine's model name.
    pub model_name: String,
    pub max_body_bytes: usize,
    /// On SIGTERM/SIGINT, how long running requests may go on before they are aborted.
    pub shutdown_grace: Duration,
    /// The model's chat template (`ChatTemplate::for_model`); None: ChatML.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Time a client has to send a request's headers (from the accept, or from the request's
    /// first byte on a keep-alive connection), and then its body.
    pub read_timeout: Duration,
    /// Time a keep-alive connection may wait between requests before it is closed.
    pub idle_timeout: Duration,
    /// Most open connections; at the cap a new one replaces the longest-waiting connection
    /// without a request in progress, or is answered 503 when every one is busy.
    pub max_connections: usize,
    /// Sequences the engine runs at once (reported by `/props`).
    pub max_seqs: usize,
    /// How embeddings pool a text's hidden states.
    pub pooling: quiver_engine::embed::Pooling,
    /// Origins a browser page may call from (CORS); `*`: any.
    pub allowed_origins: Vec<String>,
    /// Defaults of generation requests that leave a field out.
    pub defaults: RequestDefaults,
    /// Serve the web chat page at `/` (`--no-webui`: false).
    pub webui: bool,
}

/// Defaults of generation requests that leave a field out: `quiver serve`'s `-n`, `--temp`,
/// `--seed`, `--top-k`, `--top-p`, `--min-p` (llama-server's flags of those names).
#[derive(Clone, Debug, Default)]
pub struct RequestDefaults {
    /// `max_tokens` of a request that gives none (0: the rest of the context); None: each
    /// endpoint's own default.
    pub max_tokens: Option<usize>,
    /// Fields as a request would give them (`temperature`, `top_k`, `top_p`, `min_p`, `seed`).
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl RequestDefaults {
    /// Gives a request's body the default of each field it leaves out (absent or null).
    pub fn fill(&self, m: &mut serde_json::Map<String, serde_json::Value>) {
        for (k, v) in &self.fields {
            if m.get(k).is_none_or(serde_json::Value::is_null) {
                m.insert(k.clone(), v.clone());
            }
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            cache_by_key: false,
            model_name: String::new(),
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(10),
            chat_template: None,
            read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
            max_seqs: 1,
            pooling: quiver_engine::embed::Pooling::Last,
            allowed_origins: vec!["*".into()],
            defaults: RequestDefaults::default(),
            webui: true,
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
    /// The model did not load (the loader's message).
    #[error("{0}")]
    Load(String),
}

/// Where the server's engine comes from: ready, or loaded while the port already answers
/// (503 `Loading model` to every request, as llama-server does, until it is ready).
pub enum Engine {
    Ready(EngineHandle),
    Load(Box<dyn FnOnce() -> Result<EngineHandle, String> + Send>),
}

/// Runs the server on a fresh tokio runtime until SIGTERM/SIGINT, then shuts the engine down.
/// Returns Ok after a graceful shutdown, so that the CLI exits 0.
pub fn run(engine: Engine, cfg: ServerConfig) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(engine, cfg))
}

/// Serves until SIGTERM or SIGINT.
pub async fn serve(engine: Engine, cfg: ServerConfig) -> Result<(), ServerError> {
    serve_until(engine, cfg, shutdown_signal()).await
}

/// SIGTERM or SIGINT (Ctrl-C). The handlers are installed here, before the server says it is
/// listening, so that a signal sent right after that line is never missed.
fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            async fn recv(s: Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                _ = recv(term) => {}
                _ = recv(int) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await
        }
    }
}

/// Connections the kernel queues before the accept loop takes them (capped by the system's
/// `net.core.somaxconn`). A flood of connections (the slow-body test's 1,100 sockets
/// reconnecting) fills tokio's default of 1,024, and a new client's SYN is then dropped: it
/// waits a second for the retry.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` (a name resolves to its addresses, tried in turn, as `bind` does)
/// with [`LISTEN_BACKLOG`].
async fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // (As tokio's bind does on Unix: a restarted server takes its port back at once.)
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "could not resolve to any address",
        )
    }))
}

/// Serves until `stop` resolves: stops accepting, lets running requests finish within
/// `shutdown_grace` (aborting the rest), then joins the engine.
pub async fn serve_until(
    engine: Engine,
    mut cfg: ServerConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    // Deadlines are instants: a duration past any instant would overflow them.
    for d in [
        &mut cfg.read_timeout,
        &mut cfg.idle_timeout,
        &mut cfg.shutdown_grace,
    ] {
        *d = (*d).min(MAX_DURATION);
    }
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = listen(&addr).await.map_err(|source| ServerError::Bind {
        addr: addr.clone(),
        source,
    })?;
    let local = listener.local_addr()?;
    if let Some(w) = cors::exposure_warning(local, &cfg.api_keys, &cfg.allowed_origins) {
        tracing::warn!("{w}");
    }
    let conns = Arc::new(conn::Conns::new(conn::Limits {
        read: cfg.read_timeout,
        idle: cfg.idle_timeout,
        max: cfg.max_connections.max(1),
    }));
    // Connections are taken from now on; until the model is loaded every request is a 503.
    let app = Arc::new(std::sync::OnceLock::new());
    let (tx, rx) = tokio::sync::watch::channel(false);
    let mut task = tokio::spawn(conn::accept_loop(
        listener,
        app::gate(app.clone()),
        conns.clone(),
        rx,
    ));
    let handle = match engine {
        Engine::Ready(h) => h,
        Engine::Load(load) => {
            // (debug: a load that fails must leave one line on stderr, the error.)
            tracing::debug!("loading the model; http://{local} answers 503 until it is ready");
            let loaded = tokio::task::spawn_blocking(load)
                .await
                .unwrap_or_else(|e| Err(format!("the loader stopped: {e}")));
            match loaded {
                Ok(h) => h,
                Err(e) => {
                    let _ = tx.send(true);
                    let _ = tokio::time::timeout(Duration::from_secs(3), &mut task).await;
                    return Err(ServerError::Load(e));
                }
            }
        }
    };
    let model = if cfg.model_name.is_empty() {
        handle.info().name.clone()
    } else {
        cfg.model_name.clone()
    };
    if let Some(n) = conn::open_files_limit() {
        if cfg.max_connections as u64 + 64 > n {
            tracing::warn!(
                "--max-connections {} is close to the open-files limit {n} (ulimit -n): accepting may fail before the cap",
                cfg.max_connections
            );
        }
    }
    let state = Arc::new(AppState {
        handle: handle.clone(),
        model,
        keys: cfg.api_keys.clone(),
        cache_by_key: cfg.cache_by_key,
        template: cfg
            .chat_template
            .clone()
            .unwrap_or_else(|| Arc::new(ChatTemplate::builtin(""))),
        max_body: cfg.max_body_bytes,
        metrics: Metrics::default(),
        shutting_down: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
        next_request: AtomicU64::new(1),
        cpu: cpu::CpuPool::new(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
        ),
        max_token_bytes: cpu::max_token_bytes(handle.tokenizer()),
        grammars: quiver_engine::constraint::Grammars::new(handle.tokenizer()).map(Arc::new),
        max_seqs: cfg.max_seqs,
        pooling: cfg.pooling,
        allowed_origins: cfg.allowed_origins.clone(),
        defaults: cfg.defaults.clone(),
        read_timeout: cfg.read_timeout,
        conns: conns.clone(),
        webui: cfg.webui,
        nonce: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    });
    let _ = app.set(router(state.clone()));
    let (heavy, light) = state.cpu.sizes();
    tracing::debug!(
        heavy,
        light,
        max_token_bytes = state.max_token_bytes,
        "request processing threads"
    );
    tracing::info!(addr = %local, "listening on http://{local}");
    tokio::select! {
        _ = stop => {}
        r = &mut task => {
            // The accept loop ends only when told to, or by a panic.
            handle.shutdown(Duration::ZERO);
            return match r {
                Ok(()) => Ok(()),
                Err(e) => Err(ServerError::Io(std::io::Error::other(e.to_string()))),
            };
        }
    }
    tracing::info!(
        "shutting down (grace {:.1}s)",
        cfg.shutdown_grace.as_secs_f64()
    );
    // New generation requests get 503 `shutting_down` (and /health 503) while the running
    // ones finish: connections are still accepted until the engine has stopped.
    state.shutting_down.store(true, Ordering::SeqCst);
    let h = handle.clone();
    let grace = cfg.shutdown_grace;
    let mut engine = tokio::task::spawn_blocking(move || h.shutdown(grace));
    // A second SIGTERM/SIGINT ends the grace at once (running requests are aborted).
    let again = shutdown_signal();
    tokio::select! {
        _ = &mut engine => {}
        _ = again => {
            tracing::info!("second signal: aborting running requests");
            let h = handle.clone();
            let _ = tokio::task::spawn_blocking(move || h.shutdown(Duration::ZERO)).await;
            let _ = (&mut engine).await;
        }
    }
    let _ = tx.send(true);
    if tokio::time::timeout(Duration::from_secs(3), &mut task)
        .await
        .is_err()
    {
        task.abort();
    }
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_fill_the_fields_a_request_leaves_out() {
        let obj = |v: serde_json::Value| v.as_object().unwrap().clone();
        let d = RequestDefaults {
            max_tokens: None,
            fields: obj(json!({"temperature": 0, "seed": 7, "top_k": 40})),
        };
        let mut m = obj(
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5, "top_k": null}),
        );
        d.fill(&mut m);
        let p = params::parse_chat(&m, 1000).unwrap().params.sampling;
        assert_eq!((p.temperature, p.seed, p.top_k), (1.5, 7, 40));
    }
}
