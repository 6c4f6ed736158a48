//! Connections: the accept loop, a cap on open connections and per-connection timeouts.
//!
//! Each connection is in one of five phases:
//! - fresh: accepted, its first request's headers not yet complete;
//! - head: bytes of a later request arrived, its headers not yet complete;
//! - idle: between requests (keep-alive), nothing received yet;
//! - body: a request's headers are complete, its body is still arriving;
//! - busy: a whole request is being answered (from its complete body to its response's end).
//!
//! A fresh or head connection has `read` to complete its headers (counted from the accept, or
//! from the request's first byte), an idle one `idle` to start its next request; then it is
//! closed. A request's body must arrive within `read` of its headers (the router's
//! `read_body` middleware, 408). Busy ones have no deadline: generation takes what it takes.
//!
//! At most `max` connections are open. One more, at the cap, takes the place of the connection
//! that has waited longest without a whole request in progress (fresh, head, idle or body), so
//! that idle, half-sent and slow-body connections cannot lock clients out; when every
//! connection is busy it is answered 503 and closed.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tower_service::Service;

/// Connection limits ([`crate::ServerConfig`]).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Time to send a request's headers, and then its body.
    pub read: Duration,
    /// Time a keep-alive connection may wait between requests.
    pub idle: Duration,
    /// Most open connections.
    pub max: usize,
}

const FRESH: u8 = 0;
const HEAD: u8 = 1;
const IDLE: u8 = 2;
const BUSY: u8 = 3;
const BODY: u8 = 4;

/// One open connection, shared by its task, its IO and its requests.
struct Conn {
    phase: AtomicU8,
    /// When the phase began, in ms since [`Conns::epoch`].
    since: AtomicU64,
    in_flight: AtomicUsize,
    evict: AtomicBool,
    /// Wakes the connection's task: its deadline moved, or it is evicted.
    wake: Notify,
    epoch: Instant,
}

impl Conn {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Bytes arrived.
    fn on_bytes(&self) {
        if self
            .phase
            .compare_exchange(IDLE, HEAD, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.since.store(self.now_ms(), Ordering::Release);
            self.wake.notify_one();
        } else {
            // A fresh connection's time runs from its accept.
            let _ = self
                .phase
                .compare_exchange(FRESH, HEAD, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// When the phase's time runs out; None: no deadline (busy, or a limit too far away to
    /// be an instant).
    fn deadline(&self, l: &Limits) -> Option<Instant> {
        let since = self.epoch + Duration::from_millis(self.since.load(Ordering::Acquire));
        match self.phase.load(Ordering::Acquire) {
            FRESH | HEAD => since.checked_add(l.read),
            IDLE => since.checked_add(l.idle),
            _ => None,
        }
    }
}

/// A request in progress on a connection: from its complete headers to its response's end.
/// Its body still arriving, the connection may be displaced ([`Whole`] ends that).
struct Busy(Arc<Conn>);

impl Busy {
    fn new(c: Arc<Conn>) -> Busy {
        if c.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            c.since.store(c.now_ms(), Ordering::Release);
            c.phase.store(BODY, Ordering::Release);
        }
        Busy(c)
    }
}

/// In a request's extensions: tells its connection that the request is whole (its body read,
/// or its answer ready), so that the connection is no longer displaced at the cap.
#[derive(Clone)]
pub(crate) struct Whole(Arc<Conn>);

impl Whole {
    pub(crate) fn mark(&self) {
        let _ = self
            .0
            .phase
            .compare_exchange(BODY, BUSY, Ordering::AcqRel, Ordering::Acquire);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let c = &self.0;
        if c.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            c.since.store(c.now_ms(), Ordering::Release);
            c.phase.store(IDLE, Ordering::Release);
            c.wake.notify_one();
        }
    }
}

/// A response body that keeps its connection busy until it ends.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, telling its connection when bytes arrive.
struct Watched {
    inner: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.on_bytes();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The open connections and what happened to connections (for `/metrics`).
pub struct Conns {
    limits: Limits,
    epoch: Instant,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
    permits: Arc<Semaphore>,
    /// Lingering 503 answers at once (beyond: closed without an answer).
    shedding: Arc<Semaphore>,
    next: AtomicU64,
    pub accepted: AtomicU64,
    pub rejected: AtomicU64,
    pub evicted: AtomicU64,
    pub timed_out: AtomicU64,
}

impl Conns {
    pub fn new(limits: Limits) -> Conns {
        Conns {
            limits,
            epoch: Instant::now(),
            open: Mutex::new(HashMap::new()),
            permits: Arc::new(Semaphore::new(limits.max)),
            shedding: Arc::new(Semaphore::new(64)),
            next: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn open(&self) -> usize {
        self.open.lock().map(|m| m.len()).unwrap_or(0)
    }

    fn register(&self) -> (u64, Arc<Conn>) {
        let c = Arc::new(Conn {
            phase: AtomicU8::new(FRESH),
            since: AtomicU64::new(self.epoch.elapsed().as_millis() as u64),
            in_flight: AtomicUsize::new(0),
            evict: AtomicBool::new(false),
            wake: Notify::new(),
            epoch: self.epoch,
        });
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut m) = self.open.lock() {
            m.insert(id, c.clone());
        }
        self.accepted.fetch_add(1, Ordering::Relaxed);
        (id, c)
    }

    fn remove(&self, id: u64) {
        if let Ok(mut m) = self.open.lock() {
            m.remove(&id);
        }
    }

    /// Asks the connection that has waited longest without a request in progress to close.
    fn evict_one(&self) -> bool {
        let Ok(m) = self.open.lock() else {
            return false;
        };
        let victim = m
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) != BUSY && !c.evict.load(Ordering::Acquire))
            .min_by_key(|c| c.since.load(Ordering::Acquire));
        match victim {
            Some(c) => {
                c.evict.store(true, Ordering::Release);
                c.wake.notify_one();
                true
            }
            None => false,
        }
    }

    /// A slot for a new connection: a free one, else one an idle connection gives up.
    async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(p);
        }
        for _ in 0..3 {
            if !self.evict_one() {
                return None;
            }
            let wait = self.permits.clone().acquire_owned();
            if let Ok(Ok(p)) = tokio::time::timeout(Duration::from_millis(200), wait).await {
                return Some(p);
            }
        }
        None
    }

    /// Answers 503 and closes, without waiting on the client.
    fn shed(&self, stream: TcpStream) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let Ok(permit) = self.shedding.clone().try_acquire_owned() else {
            return;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let _ = stream.try_write(SHED_RESPONSE.as_bytes());
            // Drain what the client sent for a moment before closing, so that closing does not
            // reset the connection under the answer.
            let drain = async {
                let mut buf = [0u8; 4096];
                while stream.readable().await.is_ok() {
                    match stream.try_read(&mut buf) {
                        Ok(0) => break,
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => break,
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
        });
    }
}

const SHED_RESPONSE: &str = concat!(
    "HTTP/1.1 503 Service Unavailable\r\n",
    "content-type: application/json\r\n",
    "retry-after: 1\r\n",
    "connection: close\r\n",
    "content-length: 142\r\n",
    "\r\n",
    r#"{"error":{"message":"the server has too many open connections; retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#
);

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|v| *v).await;
}

/// Accepts connections until `stop` turns true, then waits for the open ones to finish
/// (in-flight requests go on; idle connections close at once).
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    conns: Arc<Conns>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let stream = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::error!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Some(permit) = conns.slot().await else {
            conns.shed(stream);
            continue;
        };
        let (id, conn) = conns.register();
        tokio::spawn(serve_conn(
            stream,
            id,
            conn,
            app.clone(),
            conns.clone(),
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    let _ = conns.permits.acquire_many(conns.limits.max as u32).await;
}

async fn serve_conn(
    stream: TcpStream,
    id: u64,
    conn: Arc<Conn>,
    app: Router,
    conns: Arc<Conns>,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    // Leaves the open set however the task ends (a panic included), so the count never leaks.
    struct Registered(Arc<Conns>, u64);
    impl Drop for Registered {
        fn drop(&mut self) {
            self.0.remove(self.1);
        }
    }
    let _registered = Registered(conns.clone(), id);
    let io = TokioIo::new(Watched {
        inner: stream,
        conn: conn.clone(),
    });
    let c = conn.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let busy = Busy::new(c.clone());
        let whole = Whole(c.clone());
        req.extensions_mut().insert(whole.clone());
        let mut app = app.clone();
        async move {
            let r = app.call(req.map(Body::new)).await;
            whole.mark();
            r.map(|resp| resp.map(|inner| Body::new(Tracked { inner, _busy: busy })))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.header_read_timeout(None);
    let http = builder.serve_connection(io, service);
    tokio::pin!(http);
    let limits = conns.limits;
    let mut draining = false;
    loop {
        let deadline = conn.deadline(&limits);
        let timer = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = http.as_mut() => break,
            _ = conn.wake.notified() => {
                if conn.evict.load(Ordering::Acquire) {
                    if conn.phase.load(Ordering::Acquire) == BUSY {
                        // It took a request meanwhile: keep it.
                        conn.evict.store(false, Ordering::Release);
                    } else {
                        conns.evicted.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            _ = timer => {
                if conn.deadline(&limits).is_some_and(|d| Instant::now() >= d) {
                    conns.timed_out.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
            _ = stopped(&mut stop), if !draining => {
                draining = true;
                http.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The soft limit on open files, where the system tells it (Linux).
pub fn open_files_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shed_response_length_is_right() {
        let (head, body) = SHED_RESPONSE.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn a_connection_whose_body_is_arriving_is_displaced_first_when_oldest() {
        let conns = Conns::new(Limits {
            read: Duration::from_secs(2),
            idle: Duration::from_secs(5),
            max: 2,
        });
        let (_, slow) = conns.register();
        let _b = Busy::new(slow.clone());
        std::thread::sleep(Duration::from_millis(5));
        let (_, idle) = conns.register();
        assert!(conns.evict_one());
        assert!(slow.evict.load(Ordering::Acquire) && !idle.evict.load(Ordering::Acquire));
    }

    #[test]
    fn limits_too_long_for_an_instant_mean_no_deadline() {
        let conns = Conns::new(Limits {
            read: Duration::MAX,
            idle: Duration::MAX,
            max: 2,
        });
        let (_, c) = conns.register();
        let l = conns.limits();
        assert_eq!(c.deadline(&l), None);
        c.on_bytes();
        drop(Busy::new(c.clone()));
        assert_eq!(c.phase.load(Ordering::Acquire), IDLE);
        assert_eq!(c.deadline(&l), None);
    }

    #[test]
    fn phases_and_deadlines() {
        let conns = Conns::new(Limits {
            read: Duration::from_secs(2),
            idle: Duration::from_secs(5),
            max: 2,
        });
        let (_, c) = conns.register();
        let l = conns.limits();
        let d0 = c.deadline(&l).unwrap();
        c.on_bytes();
        assert_eq!(c.phase.load(Ordering::Acquire), HEAD);
        // A fresh connection's time runs from its accept.
        assert_eq!(c.deadline(&l).unwrap(), d0);
        let b = Busy::new(c.clone());
        assert_eq!(c.phase.load(Ordering::Acquire), BODY);
        assert_eq!(c.deadline(&l), None);
        Whole(c.clone()).mark();
        assert_eq!(c.phase.load(Ordering::Acquire), BUSY);
        assert!(!conns.evict_one(), "a busy connection is not evicted");
        drop(b);
        assert_eq!(c.phase.load(Ordering::Acquire), IDLE);
        assert!(c.deadline(&l).unwrap() >= d0 + Duration::from_secs(3));
        assert!(conns.evict_one());
        assert!(c.evict.load(Ordering::Acquire));
    }
}
