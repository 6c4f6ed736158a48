//! Where the serving loop's time goes: `QUIVER_SERVE_PROFILE=N` logs, every N steps, the mean
//! time per step of each phase (docs/ENV.md). Off (no clock read) when unset.

use std::time::{Duration, Instant};

/// The phases of a step, in order ([`Phases::mark`] closes one).
pub const NAMES: [&str; 7] = [
    "schedule",
    "forward + masks",
    "device masks",
    "fetch",
    "pick",
    "constraints",
    "emit",
];

pub struct Phases {
    every: u64,
    steps: u64,
    rows: u64,
    total: [Duration; NAMES.len()],
    last: Instant,
}

impl Phases {
    pub fn from_env() -> Option<Phases> {
        let every = std::env::var("QUIVER_SERVE_PROFILE").ok()?.parse().ok()?;
        (every > 0).then(|| Phases {
            every,
            steps: 0,
            rows: 0,
            total: Default::default(),
            last: Instant::now(),
        })
    }

    /// A step begins.
    pub fn start(&mut self) {
        self.last = Instant::now();
    }

    /// Phase `i` ends now.
    pub fn mark(&mut self, i: usize) {
        let now = Instant::now();
        self.total[i] += now - self.last;
        self.last = now;
    }

    /// A step of `rows` sampling rows ended; every `every` steps, a line on stderr.
    pub fn step_done(&mut self, rows: usize) {
        self.steps += 1;
        self.rows += rows as u64;
        if self.steps < self.every {
            return;
        }
        let per = |d: Duration| d.as_secs_f64() * 1e6 / self.steps as f64;
        let all: f64 = self.total.iter().map(|&d| per(d)).sum();
        let parts: Vec<String> = NAMES
            .iter()
            .zip(self.total)
            .map(|(n, d)| format!("{n} {:.0}", per(d)))
            .collect();
        eprintln!(
            "serve profile: {} steps, {:.1} rows/step, µs/step {all:.0}: {}",
            self.steps,
            self.rows as f64 / self.steps as f64,
            parts.join(", ")
        );
        self.steps = 0;
        self.rows = 0;
        self.total = Default::default();
    }
}
