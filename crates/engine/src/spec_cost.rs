//! What speculation costs: a step's time by its rows ([`StepCost`], measured as the engine
//! runs) and a request's acceptance rate ([`Acceptance`]), from which [`worth`] picks the
//! proposal length that gives the most tokens per second, or none.
//!
//! A step of n decoding requests takes T(n) without proposals and T(n + L) with L proposed
//! rows; a proposal whose tokens are each accepted with probability α (while the ones before
//! were) yields E(L) = 1 + α + … + α^L tokens for its request instead of 1. Proposing pays
//! when (n − 1 + E(L)) / T(n + L) > n / T(n). On a GPU a step of a few rows costs about what
//! one row does (the weights are read once), so any acceptance pays; on a CPU each row costs
//! its share of the arithmetic, and a proposal of 16 at 50% acceptance is slower than none.

/// Steps of at most this many rows are timed each by its count; larger ones by powers of two.
const EXACT: usize = 64;
const BUCKETS: usize = EXACT + 11;
/// Steps of a bucket counted but not timed: the first run of a step's shape is eager (it
/// teaches the backend its forms) and the second captures its CUDA graph, each a few times a
/// step's time (an H100, SmolLM2: 4–6 ms where the shape then takes 1.0–1.4).
const WARM: u32 = 2;
/// A bucket's time is used once this many steps have been timed in it.
pub(crate) const SEEN: u32 = WARM + 2;
/// Step times by rows, after a bucket's `WARM` steps: a time takes a faster step at once and
/// follows a slower one a tenth of the way, so that a step delayed by something else (a page
/// fault, another process) moves it little, and a length that once looked too costly is not
/// kept from proposing (and so from being timed again) by a slow step. The serving engine keeps
/// them over its requests (`Scheduler::note_step`).
#[derive(Clone, Debug)]
pub struct StepCost {
    secs: [f64; BUCKETS],
    count: [u32; BUCKETS],
}

impl Default for StepCost {
    fn default() -> Self {
        StepCost {
            secs: [0.0; BUCKETS],
            count: [0; BUCKETS],
        }
    }
}

fn bucket(rows: usize) -> usize {
    if rows <= EXACT {
        rows
    } else {
        let above =
            rows.next_power_of_two().trailing_zeros() as usize - EXACT.trailing_zeros() as usize;
        (EXACT + above).min(BUCKETS - 1)
    }
}

impl StepCost {
    /// A step of `rows` rows took `secs`.
    pub fn record(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let b = bucket(rows);
        let (t, c) = (&mut self.secs[b], &mut self.count[b]);
        *t = match *c {
            c if c < WARM => 0.0,
            c if c == WARM || secs < *t => secs,
            _ => *t + 0.1 * (secs - *t),
        };
        *c = c.saturating_add(1);
    }

    /// Whether steps of `n` rows (at least 1) and of `extra` rows more are both timed.
    pub fn knows(&self, n: usize, extra: usize) -> bool {
        let n = n.max(1);
        self.secs(n).is_some() && self.secs(n + extra).is_some()
    }

    /// The time of a step of `rows` rows, once its bucket has been timed enough.
    pub fn secs(&self, rows: usize) -> Option<f64> {
        let b = bucket(rows);
        (rows > 0 && self.count[b] >= SEEN).then_some(self.secs[b])
    }
}

/// A request's acceptance: proposed tokens reached (the ones up to and including the first
/// rejected) and accepted, each an exponential average over its steps (weight 0.8 a step), so
/// that a request moving from quoted text to new text is followed within a few steps.
#[derive(Clone, Copy, Debug, Default)]
pub struct Acceptance {
    hits: f64,
    tries: f64,
}

const DECAY: f64 = 0.8;

impl Acceptance {
    /// A step that proposed `proposed` tokens and accepted the first `accepted`.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let tried = accepted + usize::from(accepted < proposed);
        self.hits = DECAY * self.hits + accepted as f64;
        self.tries = DECAY * self.tries + tried as f64;
    }

    /// A step without a proposal: the evidence ages toward the prior.
    pub fn age(&mut self) {
        self.hits *= DECAY;
        self.tries *= DECAY;
    }

    /// The chance that a proposed token is accepted, given the ones before it were (one
    /// half before any evidence).
    pub fn rate(&self) -> f64 {
        (self.hits + 0.5) / (self.tries + 1.0)
    }

    /// The tokens a step of `len` proposed tokens yields, expected: 1 + α + … + α^len.
    pub fn expected(&self, len: usize) -> f64 {
        let a = self.rate();
        (0..=len).map(|i| a.powi(i as i32)).sum()
    }
}

/// The proposal length to use this step in place of `len` (the acceptance policy's), for a
/// request among `n` decoding ones: `len` while a step of `len` more rows is not yet timed,
/// none while a step without them is not (each step is timed, so the next choice knows more);
/// else of `len`, `len / 2`, … 1 and none, the one of the most tokens per second, where a
/// shorter one not yet timed is tried before none.
pub fn worth(len: usize, n: usize, acc: &Acceptance, cost: &StepCost) -> usize {
    let n = n.max(1);
    let (t0, t_len) = match (cost.secs(n), cost.secs(n + len)) {
        (Some(t0), Some(t)) => (t0, t),
        (None, Some(_)) => return 0,
        _ => return len,
    };
    let rate = |l: usize, t: f64| (n as f64 - 1.0 + acc.expected(l)) / t;
    let (mut best, mut best_rate) = (0, n as f64 / t0);
    let mut untimed = None;
    let mut l = len;
    let mut t = Some(t_len);
    while l > 0 {
        match t {
            Some(t) if rate(l, t) > best_rate => (best, best_rate) = (l, rate(l, t)),
            None if untimed.is_none() => untimed = Some(l),
            _ => {}
        }
        l /= 2;
        t = cost.secs(n + l);
    }
    match (best, untimed) {
        (0, Some(l)) => l,
        _ => best,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(f: impl Fn(usize) -> f64, rows: impl IntoIterator<Item = usize>) -> StepCost {
        let mut c = StepCost::default();
        for r in rows {
            for _ in 0..SEEN {
                c.record(r, f(r));
            }
        }
        c
    }

    #[test]
    fn step_times_are_known_after_a_few_steps_and_follow_faster_ones() {
        let mut c = StepCost::default();
        // The first two steps of a shape (eager, then its graph captured) are not taken.
        c.record(5, 100.0);
        c.record(5, 50.0);
        c.record(5, 1.0);
        assert_eq!(c.secs(5), None);
        c.record(5, 1.0);
        assert_eq!(c.secs(5), Some(1.0));
        // A slow step moves the time a tenth of the way, a fast one all of it.
        c.record(5, 2.0);
        assert!((c.secs(5).unwrap() - 1.1).abs() < 1e-12);
        c.record(5, 0.1);
        assert_eq!(c.secs(5), Some(0.1));
        // Buckets: exact to 64 rows, then powers of two; nothing of zero rows.
        assert_eq!(
            (bucket(64), bucket(65), bucket(128), bucket(129)),
            (64, 65, 65, 66)
        );
        assert_eq!(bucket(1 << 20), BUCKETS - 1);
        c.record(0, 1.0);
        assert_eq!(c.secs(0), None);
        assert_eq!(c.secs(6), None);
    }

    #[test]
    fn acceptance_counts_tokens_up_to_the_first_rejection() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        assert!((a.expected(2) - 1.75).abs() < 1e-12);
        for _ in 0..40 {
            // 3 of 4 accepted: 3 hits of 4 tries, 15 of 20 in the average (the prior's half
            // of one beside them).
            a.record(4, 3);
        }
        assert!((a.rate() - 15.5 / 21.0).abs() < 1e-3, "{}", a.rate());
        for _ in 0..40 {
            a.record(8, 8);
        }
        assert!(a.rate() > 0.97);
        a.record(0, 0);
        let r = a.rate();
        a.age();
        assert!(a.rate() < r);
    }

    #[test]
    fn proposals_are_kept_where_rows_are_cheap_and_cut_where_they_cost() {
        let mut a = Acceptance::default();
        for _ in 0..40 {
            a.record(4, 1);
        }
        // α ≈ 0.5. Not timed yet: the policy's length, so that the step gets timed; then
        // none, until a step without a proposal is timed too.
        assert_eq!(worth(16, 1, &a, &StepCost::default()), 16);
        assert_eq!(worth(16, 1, &a, &timed(|_| 1.0, [17])), 0);
        // A GPU: a step of up to 17 rows costs 5% more than one row: all 16.
        let gpu = timed(|r| 1.0 + 0.05 * (r > 1) as u8 as f64, [1, 2, 3, 5, 9, 17]);
        assert_eq!(worth(16, 1, &a, &gpu), 16);
        // A CPU: each row costs a third of a step. E(1) = 1.5 tokens in 1.33 (1.125 a unit
        // of time), E(2) = 1.75 in 1.67 (1.05), E(16) ≈ 2 in 6: 1 is best.
        let cpu = timed(|r| 1.0 + (r - 1) as f64 / 3.0, [1, 2, 3, 5, 9, 17]);
        assert_eq!(worth(16, 1, &a, &cpu), 1);
        // A step row as costly as a token: nothing pays.
        let dear = timed(|r| r as f64, [1, 2, 3, 5, 9, 17]);
        assert_eq!(worth(16, 1, &a, &dear), 0);
        // Untimed shorter lengths are tried before none: 16 and 8 are timed and lose.
        let part = timed(|r| r as f64, [1, 9, 17]);
        assert_eq!(worth(16, 1, &a, &part), 4);
        // Four requests decoding: a step of 4 + L rows against one of 4.
        let four = timed(|r| 1.0 + r as f64 / 8.0, [4, 5, 6, 8, 12, 20]);
        // (3 + E(L)) / T(4 + L): L = 1: 4.5 / 1.625 = 2.77, none: 4 / 1.5 = 2.67, L = 2:
        // 4.75 / 1.75 = 2.71.
        assert_eq!(worth(16, 4, &a, &four), 1);
    }
}
