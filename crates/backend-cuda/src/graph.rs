//! The graph executor: a decode step of a padded batch size is captured once as a CUDA graph
//! and replayed. A key's first step runs eagerly (it compiles, sizes scratch, uploads tables),
//! its second is captured (and run from the graph), later ones replay. A moved buffer bumps
//! the generation in the key or clears every graph: never a replay over stale addresses.

use crate::GraphStats;
use cudarc::driver::{result as dr, sys as ds};
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub state: u64,
    pub rows: usize,
    pub generation: u64,
}

pub enum Begin {
    Replayed,
    Capturing,
    Eager,
}

struct Exec(ds::CUgraphExec);
impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: instantiated by us, destroyed once.
        let _ = unsafe { dr::graph::exec_destroy(self.0) };
    }
}

#[derive(Default)]
struct Slot {
    seen: bool,
    /// A capture of this key failed: it runs eagerly.
    failed: bool,
    exec: Option<Exec>,
}

pub struct Graphs {
    enabled: bool,
    map: HashMap<Key, Slot>,
    capturing: Option<Key>,
    pub stats: GraphStats,
}
// SAFETY: graph handles are used with the backend's context current, one thread at a time.
unsafe impl Send for Graphs {}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Graphs {
            enabled,
            map: HashMap::new(),
            capturing: None,
            stats: GraphStats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn capturing(&self) -> bool {
        self.capturing.is_some()
    }

    /// Drops graphs captured before buffers moved.
    pub fn retain_generation(&mut self, generation: u64) {
        self.map.retain(|k, _| k.generation == generation);
    }

    pub fn begin(&mut self, key: Key, stream: ds::CUstream) -> Result<Begin, dr::DriverError> {
        let slot = self.map.entry(key).or_default();
        if let Some(e) = &slot.exec {
            // SAFETY: a live executable graph on our stream.
            unsafe { dr::graph::launch(e.0, stream) }?;
            self.stats.replays += 1;
            return Ok(Begin::Replayed);
        }
        if !slot.seen || slot.failed {
            slot.seen = true;
            self.stats.eager += 1;
            return Ok(Begin::Eager);
        }
        // SAFETY: our stream, not capturing.
        unsafe {
            dr::stream::begin_capture(
                stream,
                ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }?;
        self.capturing = Some(key);
        Ok(Begin::Capturing)
    }

    /// Ends a capture begun by `begin` (true, nothing to do, otherwise) and runs the new graph
    /// once, which computes this step. When the capture or its instantiation fails (or `ok` is
    /// false), the key is marked to run eagerly from now on and false says that the recorded
    /// ops did not run: the caller runs them again, eagerly.
    pub fn end(&mut self, ok: bool, stream: ds::CUstream) -> bool {
        let Some(key) = self.capturing.take() else {
            return true;
        };
        // SAFETY: our stream is capturing.
        let g = unsafe { dr::stream::end_capture(stream) };
        let exec = match g {
            Ok(g) if ok && !g.is_null() => {
                // SAFETY: g is a complete graph; destroyed after instantiation.
                let e = unsafe {
                    let e = dr::graph::instantiate(g, ds::CUgraphInstantiate_flags(0));
                    let _ = dr::graph::destroy(g);
                    e
                };
                // SAFETY: a live executable graph on our stream.
                e.ok()
                    .map(Exec)
                    .filter(|x| unsafe { dr::graph::launch(x.0, stream) }.is_ok())
            }
            Ok(g) => {
                if !g.is_null() {
                    // SAFETY: captured above.
                    let _ = unsafe { dr::graph::destroy(g) };
                }
                None
            }
            Err(_) => None,
        };
        let slot = self.map.entry(key).or_default();
        match exec {
            Some(x) => {
                self.stats.captures += 1;
                slot.exec = Some(x);
                true
            }
            None => {
                slot.failed = true;
                self.stats.failed_captures += 1;
                false
            }
        }
    }
}
