//! The serving engine's public handle: submit a request and receive its events through a
//! sink, abort it, read stats. A background thread runs the scheduling loop; the request,
//! event and stats types are the engine's shared types ([`crate::types`]), re-exported here:
//! what the HTTP server sees (it never sees a tensor).

pub use crate::types::{
    Event, FinishReason, ModelInfo, Request, RunningRequest, ServeOptions, Sink, Stats,
    SubmitError, TokenLogprob,
};
use std::sync::Arc;

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) inner: Arc<crate::serving::Shared>,
}

impl EngineHandle {
    /// Queues a request; its events go to `sink`. Returns the request id.
    pub fn submit(&self, req: Request, sink: Sink) -> Result<u64, SubmitError> {
        self.inner.submit(req, sink)
    }

    /// Aborts a request (a no-op when it already ended). Its sink gets `Finished { Abort }`.
    pub fn abort(&self, id: u64) {
        self.inner.abort(id)
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.inner.info
    }

    pub fn tokenizer(&self) -> &quiver_tokenizer::Tokenizer {
        &self.inner.tokenizer
    }

    /// Stops accepting requests, lets running ones finish until `deadline`, aborts the rest,
    /// and joins the engine thread. A second call can shorten the deadline (never lengthen it);
    /// it returns at once while the first call joins.
    pub fn shutdown(&self, deadline: std::time::Duration) {
        self.inner.shutdown(deadline)
    }
}
