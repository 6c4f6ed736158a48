//! The graph executor: a decode step of a padded batch size is captured once as a CUDA graph
//! and replayed. A key's first step runs eagerly (it compiles, sizes scratch, uploads tables),
//! its second is captured (and run from the graph), later ones replay. A moved buffer bumps
//! the generation in the key or clears every graph: never a replay over stale addresses.

use cudarc::driver::{result as dr, sys as ds};
use std::collections::HashMap;

/// Largest token count a captured decode step covers; buckets are powers of two up to it.
pub const MAX_GRAPH_TOKENS: usize = 64;

/// Counters of the graph executor (also in `--verbose` output and bench JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captures: u64,
    /// Captures that could not be kept (the step then ran eagerly; the key stays eager).
    pub failed_captures: u64,
    pub replays: u64,
    pub eager: u64,
}

/// The row count a step runs from a graph with, if it can: decode-shaped steps (every token
/// wants logits) pad to the next power of two up to `MAX_GRAPH_TOKENS`, within the state's
/// buffers.
pub(crate) fn graph_bucket(
    n: usize,
    n_logits: usize,
    max_tokens: usize,
    max_logits: usize,
) -> Option<usize> {
    let b = n.next_power_of_two();
    (n > 0 && n_logits == n && b <= MAX_GRAPH_TOKENS && b <= max_tokens && b <= max_logits)
        .then_some(b)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_steps_pad_to_graph_buckets_within_the_buffers() {
        assert_eq!(graph_bucket(1, 1, 512, 1), Some(1));
        assert_eq!(graph_bucket(3, 3, 512, 8), Some(4));
        assert_eq!(
            graph_bucket(3, 3, 512, 3),
            None,
            "the padded logits would not fit"
        );
        assert_eq!(
            graph_bucket(5, 5, 6, 8),
            None,
            "the padded tokens would not fit"
        );
        assert_eq!(graph_bucket(64, 64, 512, 64), Some(64));
        assert_eq!(graph_bucket(65, 65, 512, 128), None);
        assert_eq!(graph_bucket(12, 1, 512, 16), None, "a prefill chunk");
        assert_eq!(graph_bucket(0, 0, 512, 16), None);
    }
}
