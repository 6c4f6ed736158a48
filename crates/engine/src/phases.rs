//! Where the serving loop's time goes: `QUIVER_SERVE_PROFILE=N` logs, every N steps, the mean
//! time per step of each phase (docs/ENV.md). Off (no clock read) when unset.

use std::time::{Duration, Instant};

/// The phases of a step, in order ([`Phases::mark`] closes one).
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    Schedule,
    ForwardAndMasks,
    DeviceMasks,
    Fetch,
    Pick,
    Constraints,
    Emit,
}

/// Each phase's name in the log line, in `Phase` order.
const NAMES: [&str; 7] = [
    "schedule",
    "forward + masks",
    "device masks",
    "fetch",
    "pick",
    "constraints",
    "emit",
];

/// The profile's clock and sums; None when `QUIVER_SERVE_PROFILE` is unset.
pub struct Phases(Option<Profile>);

struct Profile {
    every: u64,
    steps: u64,
    rows: u64,
    total: [Duration; NAMES.len()],
    last: Instant,
}

impl Phases {
    pub fn from_env() -> Phases {
        let every = std::env::var("QUIVER_SERVE_PROFILE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Phases((every > 0).then(|| Profile {
            every,
            steps: 0,
            rows: 0,
            total: Default::default(),
            last: Instant::now(),
        }))
    }

    /// A step begins.
    pub fn start(&mut self) {
        if let Some(p) = &mut self.0 {
            p.last = Instant::now();
        }
    }

    /// Phase `phase` ends now.
    pub fn mark(&mut self, phase: Phase) {
        if let Some(p) = &mut self.0 {
            let now = Instant::now();
            p.total[phase as usize] += now - p.last;
            p.last = now;
        }
    }

    /// A step of `rows` sampling rows ended; every `every` steps, a line on stderr.
    pub fn step_done(&mut self, rows: usize) {
        let Some(p) = &mut self.0 else {
            return;
        };
        p.steps += 1;
        p.rows += rows as u64;
        if p.steps < p.every {
            return;
        }
        let per = |d: Duration| d.as_secs_f64() * 1e6 / p.steps as f64;
        let all: f64 = p.total.iter().map(|&d| per(d)).sum();
        let parts: Vec<String> = NAMES
            .iter()
            .zip(p.total)
            .map(|(n, d)| format!("{n} {:.0}", per(d)))
            .collect();
        eprintln!(
            "serve profile: {} steps, {:.1} rows/step, µs/step {all:.0}: {}",
            p.steps,
            p.rows as f64 / p.steps as f64,
            parts.join(", ")
        );
        p.steps = 0;
        p.rows = 0;
        p.total = Default::default();
    }
}
