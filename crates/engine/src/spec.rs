//! Speculative decoding's proposer and policy, pure functions of a request's tokens: prompt
//! lookup (n-gram) proposes the tokens that followed the latest earlier occurrence of the
//! sequence's last n tokens, and [`SpecState`] decides how many to propose each step from the
//! request's own acceptance. The scheduler asks for proposals; the runner scores them in the
//! step's one forward pass as decode rows of the positions they would take; each row's token
//! is picked with the request's sampler as it would be without speculation, and the proposal
//! is accepted while the picked token equals it (`accepted_prefix`).
//!
//! A draft model ([`SpecType::Draft`], `crate::draft`) proposes instead: its argmax token after
//! the sequence, then after that token, … (greedy, as llama.cpp drafts by default), stopping
//! where its top token's probability falls below `p_min`. A greedy draft is a deterministic
//! proposer too (its distribution q is a point mass on the proposed token), so the rule below
//! is the standard one with q's probabilities: accept with min(1, p(t)/q(t)) = p(t), and on
//! rejection draw from max(0, p − q) renormalised = p without t. Nothing else of the draft's
//! distribution enters, and the output's distribution is the target's whatever the draft.
//!
//! With a sampler that draws by inverting the distribution's CDF at one uniform number per
//! token, accepting a proposed token exactly when the draw lands on it is the standard
//! rejection rule for a deterministic proposer: the token is accepted with probability
//! p(t), and on rejection the draw is distributed as p with t removed and renormalised. Each
//! generated token consumes one draw with or without speculation, so a seeded request's
//! tokens are the same either way.

use crate::spec_cost::{worth, Acceptance, StepCost};

/// Which proposer runs (`--spec-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecType {
    #[default]
    None,
    Ngram,
    /// A draft model of the same vocabulary (`-md`).
    Draft,
    /// An EAGLE-3 head (`-md`) reading the target's hidden states (`crate::draft`).
    Eagle3,
    /// The target's own multi-token-prediction block (Qwen 3.5's or DeepSeek-V4's `nextn`
    /// layer) reading its hidden states, run as an EAGLE-3 head is (`crate::eagle`).
    Mtp,
}

impl SpecType {
    pub fn parse(s: &str) -> Option<SpecType> {
        match s {
            "none" => Some(SpecType::None),
            "ngram" => Some(SpecType::Ngram),
            "draft" => Some(SpecType::Draft),
            "eagle3" | "draft-eagle3" => Some(SpecType::Eagle3),
            "mtp" | "draft-mtp" => Some(SpecType::Mtp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SpecType::None => "none",
            SpecType::Ngram => "ngram",
            SpecType::Draft => "draft",
            SpecType::Eagle3 => "eagle3",
            SpecType::Mtp => "mtp",
        }
    }

    /// Proposals come from a second model (`-md`).
    pub fn uses_model(self) -> bool {
        matches!(self, SpecType::Draft | SpecType::Eagle3)
    }

    /// Proposals come from a head reading the target's hidden states (`crate::eagle`).
    pub fn uses_head(self) -> bool {
        matches!(self, SpecType::Eagle3 | SpecType::Mtp)
    }
}

/// Speculation settings of the serving engine.
#[derive(Clone, Debug)]
pub struct SpecConfig {
    pub kind: SpecType,
    /// Most tokens proposed per step (`--draft-max`).
    pub draft_max: usize,
    /// A proposal shorter than this is not made (`--draft-min`).
    pub draft_min: usize,
    /// Longest n-gram matched (then shorter ones down to `ngram_min`).
    pub ngram_max: usize,
    pub ngram_min: usize,
    /// No proposals in a step with more decoding requests than this: a large step is bound by
    /// compute, and extra rows cost more than they save.
    pub max_decoding: usize,
    /// The draft model drafts while its top token's probability is at least this
    /// (`--draft-p-min`; 0: always, and the draft's argmax is all the device sends back).
    pub p_min: f32,
    /// The draft model's file (`-md`), for [`SpecType::Draft`].
    pub draft_model: Option<DraftFile>,
    /// Proposal lengths cut by the measured step times (`--spec-timing`; [`crate::spec_cost`]);
    /// off, by acceptance alone.
    pub timed: bool,
}

/// The draft model's open file.
#[derive(Clone)]
pub struct DraftFile(pub std::sync::Arc<quiver_gguf::GgufFile>);

impl std::fmt::Debug for DraftFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftFile({} tensors)", self.0.tensors.len())
    }
}

/// A request's own speculation settings (llama-server's `speculative.n_max`, `.n_min`,
/// `.p_min`), each in place of the server's when given.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestSpec {
    pub n_max: Option<usize>,
    pub n_min: Option<usize>,
    pub p_min: Option<f32>,
}

impl RequestSpec {
    /// (draft_max, draft_min, p_min) of a request under the server's settings.
    pub fn resolve(&self, cfg: &SpecConfig) -> (usize, usize, f32) {
        (
            self.n_max.unwrap_or(cfg.draft_max),
            self.n_min.unwrap_or(cfg.draft_min),
            self.p_min.unwrap_or(cfg.p_min),
        )
    }

    /// Checks the fields; the error names the field (an OpenAI-shaped 400 for the server).
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("n_max", self.n_max), ("n_min", self.n_min)] {
            if v.is_some_and(|v| v > MAX_DRAFT) {
                return Err(format!("speculative.{name} must be at most {MAX_DRAFT}"));
            }
        }
        if let (Some(max), Some(min)) = (self.n_max, self.n_min) {
            if min > max {
                return Err(format!(
                    "speculative.n_min ({min}) must not be above speculative.n_max ({max})"
                ));
            }
        }
        if self.p_min.is_some_and(|p| !(0.0..=1.0).contains(&p)) {
            return Err("speculative.p_min must be between 0 and 1".into());
        }
        Ok(())
    }
}

/// The most tokens a step may propose per request.
pub const MAX_DRAFT: usize = 256;

/// The adaptive policy's cap on a step's proposal length per request, from the number of
/// requests decoding in it: the full `draft_max` alone; shorter as the step grows (a decode
/// step's weight reads are shared by its rows, and each proposed row adds compute that a
/// larger step has less idle time for: at most `2 · draft_max / n` rows, so the step's
/// proposed rows stay within twice one request's); none above `max_decoding`.
/// `draft_max` is the request's (`speculative.n_max`, else `--draft-max`).
pub fn batch_cap(cfg: &SpecConfig, draft_max: usize, n_decoding: usize) -> usize {
    if cfg.kind == SpecType::None || n_decoding > cfg.max_decoding {
        return 0;
    }
    match n_decoding {
        0 | 1 => draft_max,
        n => (2 * draft_max / n).clamp(1, draft_max),
    }
}

/// One request's drafting this step: up to `len` tokens after `tokens` into `out` (cleared
/// first), stopping where the draft's top token is below `p_min` (`len` 0: an EAGLE-3 head
/// only catches up with the target's new states). The draft's KV holds the
/// first `*done` of `tokens` in `blocks` (the target's block numbers, the proposal's blocks
/// already allocated); `*done` is left at what it holds then.
pub struct DraftJob<'a> {
    /// The request (an EAGLE-3 head keeps the target's states of its tokens by it).
    pub id: u64,
    pub tokens: &'a [u32],
    pub done: &'a mut usize,
    pub blocks: &'a [u32],
    /// Its slot of the target's per-sequence state (a DeepSeek-V4 block's state uses the same).
    pub slot: u32,
    pub len: usize,
    pub p_min: f32,
    pub out: &'a mut Vec<u32>,
}

/// Proposes tokens with a draft model (the serving loop's, `crate::draft`): the scheduler
/// calls it once a step with every request that may propose, which it drafts together (one
/// forward pass per proposed position).
pub trait Drafter {
    fn draft(&mut self, jobs: &mut [DraftJob<'_>]);
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            kind: SpecType::None,
            draft_max: 16,
            draft_min: 0,
            ngram_max: 4,
            ngram_min: 2,
            max_decoding: 4,
            p_min: 0.0,
            draft_model: None,
            timed: true,
        }
    }
}

impl SpecConfig {
    pub fn on(&self) -> bool {
        self.kind != SpecType::None && self.draft_max > 0
    }

    /// Checks the settings; the error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.p_min) {
            return Err(format!(
                "--draft-p-min {} is not between 0 and 1",
                self.p_min
            ));
        }
        match (self.kind.uses_model(), &self.draft_model) {
            (true, None) => {
                return Err(format!(
                    "--spec-type {} needs a draft model (-md/--model-draft)",
                    self.kind.name()
                ))
            }
            (false, Some(_)) if self.kind != SpecType::Mtp => return Err(
                "-md/--model-draft goes with --spec-type draft, eagle3 or mtp (a block's own file)"
                    .into(),
            ),
            _ => {}
        }
        if self.draft_min > self.draft_max {
            return Err(format!(
                "--draft-min {} is above --draft-max {}",
                self.draft_min, self.draft_max
            ));
        }
        Ok(())
    }
}

/// Prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens
/// of `tokens` (n from `n_max` down to `n_min`), at most `len`.
pub fn ngram_propose(tokens: &[u32], n_max: usize, n_min: usize, len: usize) -> &[u32] {
    if len == 0 {
        return &[];
    }
    for n in (n_min.max(1)..=n_max).rev() {
        if tokens.len() <= n {
            continue;
        }
        let tail = &tokens[tokens.len() - n..];
        // Latest match first: an occurrence ending before the tail's start.
        for start in (0..tokens.len() - n).rev() {
            if &tokens[start..start + n] == tail {
                let from = start + n;
                return &tokens[from..(from + len).min(tokens.len())];
            }
        }
    }
    &[]
}

/// How many of `proposed` a step accepted, given the tokens picked from its rows in order
/// (one per row, the picks stopping at the first that differs from its proposal).
pub fn accepted_prefix(proposed: &[u32], picked: &[u32]) -> usize {
    proposed
        .iter()
        .zip(picked)
        .take_while(|(p, t)| p == t)
        .count()
}

/// A request's speculation policy: the proposal length starts at [`START_LEN`] and follows its
/// acceptance (doubling after a step that accepted everything, down to one past the accepted
/// count otherwise), and after steps that accepted nothing it stops proposing for a while (1, 2,
/// 4, … up to 32 steps) unless the step times say a proposal still pays. The engine's step
/// times choose the length of the most tokens per second ([`crate::spec_cost::worth`]) among the
/// longest timed one of `--draft-max` and its halves (or the acceptance's, if longer) and its
/// halves; where none pays, it pauses [`COST_PAUSE`] steps. (`examples/spec_sim.rs` replays the
/// policy on a greedy output: on a GPU-like step cost it took `typos` from 1.78× to 2.00× of
/// plain decode and `code_rename` from 5.00× to 5.85×.)
/// A request's first proposal length (at most `--draft-max`): a proposer that agrees reaches 16
/// after two steps, one that does not costs 4 verified rows, not 16 (a random EAGLE-3 head over
/// SmolLM2 on the CPU: −22% of plain decode's speed starting at 16, −10% at 4).
pub const START_LEN: usize = 4;
/// Steps without a proposal after the step times said that none pays (the acceptance's
/// evidence ages meanwhile, so that the choice is made again on fresher terms).
pub const COST_PAUSE: usize = 4;

#[derive(Clone, Debug, Default)]
pub struct SpecState {
    /// Proposal length for the next step (0: not yet set, start at [`START_LEN`]).
    len: usize,
    /// Steps to wait before proposing again.
    cooldown: usize,
    /// Steps in a row that accepted nothing.
    misses: u32,
    acc: Acceptance,
}

impl SpecState {
    /// The proposal length this step may use (0: none) in a step of `n` decoding requests
    /// whose times `cost` holds, and counts down a pause.
    pub fn next_len(&mut self, draft_max: usize, n: usize, cost: &StepCost) -> usize {
        if self.len == 0 {
            self.len = START_LEN;
        }
        // The step times choose the length (of the longest timed one among `draft_max` and
        // its halves, half of it, …, by the tokens a second at this acceptance); lengths
        // longer than every timed one are the acceptance's to reach.
        let top = (0..usize::BITS)
            .map(|k| draft_max >> k)
            .find(|&l| l == 0 || cost.knows(n, l))
            .unwrap_or(0);
        let len = top.max(self.len.min(draft_max));
        let timed = top > 0;
        if self.cooldown > 0 {
            // The pause after misses is for rows that cost: where the step times show that a
            // proposal pays even at this request's acceptance so far, it proposes at once.
            let l = if timed {
                worth(len, n, &self.acc, cost)
            } else {
                0
            };
            if l == 0 {
                self.cooldown -= 1;
                self.acc.age();
            } else {
                self.cooldown = 0;
            }
            return l;
        }
        let l = worth(len, n, &self.acc, cost);
        if l == 0 && len > 0 {
            self.cooldown = COST_PAUSE - 1;
            self.acc.age();
        }
        l
    }

    /// Takes a step's result: `accepted` of `proposed` tokens.
    pub fn record(&mut self, proposed: usize, accepted: usize, draft_max: usize) {
        if proposed == 0 {
            return;
        }
        tracing::debug!(proposed, accepted, "proposal verified");
        self.acc.record(proposed, accepted);
        if accepted == 0 {
            self.misses += 1;
            self.cooldown = 1 << (self.misses - 1).min(5);
            self.len = (self.len / 2).max(1);
        } else {
            self.misses = 0;
            self.len = if accepted == proposed {
                (self.len * 2).min(draft_max)
            } else {
                accepted + 1
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_lookup_proposes_the_latest_continuation_longest_match_first() {
        // "1 2 3 4 5 ... 1 2 3" → 4 5 (the 3-gram), at most `len`.
        let t = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(ngram_propose(&t, 3, 1, 8), &[4, 5, 9, 1, 2, 3]);
        assert_eq!(ngram_propose(&t, 3, 1, 2), &[4, 5]);
        // The latest occurrence wins: 7 8 after the second "2 3".
        let t = [2, 3, 5, 2, 3, 7, 8, 2, 3];
        assert_eq!(ngram_propose(&t, 2, 2, 2), &[7, 8]);
        // The longest n matches first: the 3-gram "4 2 3" points at 6, the 2-gram at 7.
        let t = [4, 2, 3, 6, 2, 3, 7, 4, 2, 3];
        assert_eq!(ngram_propose(&t, 3, 2, 1), &[6]);
        assert_eq!(ngram_propose(&t, 2, 2, 1), &[7]);
        // No earlier occurrence, or n below the minimum: nothing.
        assert!(ngram_propose(&[1, 2, 3, 4], 3, 1, 4).is_empty());
        assert!(ngram_propose(&[5, 1, 5], 3, 2, 4).is_empty());
        assert_eq!(ngram_propose(&[5, 1, 5], 3, 1, 4), &[1, 5]);
        assert!(ngram_propose(&t, 3, 2, 0).is_empty());
    }

    #[test]
    fn acceptance_is_the_matching_prefix() {
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 3, 9]), 3);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[5]), 0);
    }

    /// The rejection rule as the engine applies it (a proposed token is accepted when the
    /// request's sampler draws it): accepted with probability p(t), and on rejection the token
    /// drawn follows p with t removed and renormalised; then the next row's draw follows p.
    #[test]
    fn accepting_the_draw_that_equals_the_proposal_keeps_the_targets_distribution() {
        use crate::sampler::{Sampler, SamplerParams};
        let logits = [1.0f32, 0.2, 2.0, -0.5, 1.4, 0.0];
        let temp = 0.7;
        let e: Vec<f64> = logits.iter().map(|&l| ((l / temp) as f64).exp()).collect();
        let p: Vec<f64> = e.iter().map(|x| x / e.iter().sum::<f64>()).collect();
        let (t, n) = (4u32, 40_000);
        let (mut accepted, mut rejected, mut next) = (0usize, [0usize; 6], [0usize; 6]);
        for seed in 0..n {
            let mut s = Sampler::new(SamplerParams {
                temperature: temp,
                seed: seed as u64,
                ..SamplerParams::neutral()
            });
            let first = s.sample(&logits, &[]);
            if first == t {
                accepted += 1;
                next[s.sample(&logits, &[t]) as usize] += 1;
            } else {
                rejected[first as usize] += 1;
            }
        }
        let pt = p[t as usize];
        let sd = (pt * (1.0 - pt) / n as f64).sqrt();
        let rate = accepted as f64 / n as f64;
        assert!((rate - pt).abs() < 4.0 * sd, "accepted {rate}, p(t) {pt}");
        // Chi-square, 4 degrees of freedom (5 for `next`): 0.1% critical values.
        let chi2 = |counts: &[usize; 6], q: &dyn Fn(usize) -> f64| {
            let total: usize = counts.iter().sum();
            (0..6)
                .filter(|&i| q(i) > 0.0)
                .map(|i| {
                    let want = q(i) * total as f64;
                    (counts[i] as f64 - want).powi(2) / want
                })
                .sum::<f64>()
        };
        assert_eq!(rejected[t as usize], 0);
        let c = chi2(&rejected, &|i| {
            if i == t as usize {
                0.0
            } else {
                p[i] / (1.0 - pt)
            }
        });
        assert!(c < 18.47, "rejected draws {rejected:?}: chi2 {c}");
        let c = chi2(&next, &|i| p[i]);
        assert!(c < 20.52, "next draws {next:?}: chi2 {c}");
        // A token the sampler's filters drop (top-k 2) is never accepted.
        let mut s = Sampler::new(SamplerParams {
            temperature: temp,
            top_k: 2,
            ..SamplerParams::neutral()
        });
        assert!((0..1000).all(|_| s.sample(&logits, &[]) != 1));
    }

    #[test]
    fn the_batch_cap_shrinks_proposals_as_the_step_grows_and_stops_them_above_the_limit() {
        let cfg = SpecConfig {
            kind: SpecType::Ngram,
            draft_max: 16,
            max_decoding: 8,
            ..Default::default()
        };
        let caps: Vec<usize> = (0..=9).map(|n| batch_cap(&cfg, 16, n)).collect();
        assert_eq!(caps, [16, 16, 16, 10, 8, 6, 5, 4, 4, 0]);
        // Proposed rows per step stay within twice one request's.
        assert!((1..=8).all(|n| n * batch_cap(&cfg, 16, n) <= 2 * 16));
        // A request's own maximum, above or below the server's.
        assert_eq!((batch_cap(&cfg, 32, 2), batch_cap(&cfg, 4, 4)), (32, 2));
        // Off: nothing, whatever the batch or the request.
        assert_eq!(batch_cap(&SpecConfig::default(), 16, 1), 0);
        assert_eq!((batch_cap(&cfg, 1, 2), batch_cap(&cfg, 1, 8)), (1, 1));
        assert_eq!(batch_cap(&cfg, 0, 1), 0);
    }

    #[test]
    fn the_policy_grows_on_acceptance_and_pauses_on_misses() {
        let mut s = SpecState::default();
        // Step times not yet known: the acceptance alone decides.
        let c = StepCost::default();
        assert_eq!(s.next_len(2, 1, &c), 2);
        assert_eq!(s.next_len(16, 1, &c), START_LEN);
        s.record(4, 4, 16);
        assert_eq!(s.next_len(16, 1, &c), 8);
        s.record(8, 8, 16);
        assert_eq!(s.next_len(16, 1, &c), 16);
        s.record(16, 16, 16);
        assert_eq!(s.next_len(16, 1, &c), 16);
        s.record(16, 3, 16);
        assert_eq!(s.next_len(16, 1, &c), 4);
        s.record(4, 4, 16);
        assert_eq!(s.next_len(16, 1, &c), 8);
        s.record(8, 0, 16);
        // One step off, then 4.
        assert_eq!(s.next_len(16, 1, &c), 0);
        assert_eq!(s.next_len(16, 1, &c), 4);
        s.record(4, 0, 16);
        assert_eq!(
            (
                s.next_len(16, 1, &c),
                s.next_len(16, 1, &c),
                s.next_len(16, 1, &c)
            ),
            (0, 0, 2)
        );
        for _ in 0..10 {
            s.record(1, 0, 16);
        }
        // The pause is capped at 32 steps.
        assert_eq!((0..32).filter(|_| s.next_len(16, 1, &c) == 0).count(), 32);
        assert_eq!(s.next_len(16, 1, &c), 1);
    }

    /// Step times of `rows`-row steps: `t(rows)` each, timed enough to be used.
    fn timed(t: impl Fn(usize) -> f64) -> StepCost {
        let mut c = StepCost::default();
        for rows in 1..=40 {
            for _ in 0..crate::spec_cost::SEEN {
                c.record(rows, t(rows));
            }
        }
        c
    }

    #[test]
    fn timed_steps_choose_the_length_up_to_the_draft_max() {
        let gpu = timed(|r| 1e-3 * (1.0 + 0.02 * r as f64));
        let mut s = SpecState::default();
        // Acceptance high, but the last proposal stopped early: its own length would be 4.
        for _ in 0..4 {
            s.record(16, 16, 16);
        }
        s.record(16, 3, 16);
        assert_eq!(s.next_len(16, 1, &gpu), 16);
        assert_eq!(s.next_len(16, 1, &StepCost::default()), 4);
        // Where rows cost (a CPU), the same acceptance takes a short proposal.
        let cpu = timed(|r| 1e-3 * (1.0 + 0.5 * (r as f64 - 1.0)));
        let l = s.next_len(16, 1, &cpu);
        assert!((1..16).contains(&l), "{l}");
    }

    #[test]
    fn misses_pause_proposals_only_where_rows_cost() {
        // A GPU: a step of up to 17 rows costs what one row does (2% a row more).
        let gpu = timed(|r| 1e-3 * (1.0 + 0.02 * r as f64));
        // A CPU: each row costs its share.
        let cpu = timed(|r| 1e-3 * r as f64);
        for (cost, pauses) in [(&gpu, false), (&cpu, true)] {
            let mut s = SpecState::default();
            s.record(4, 2, 16);
            s.record(3, 0, 16);
            let next = s.next_len(16, 1, cost);
            assert_eq!(next == 0, pauses, "{next}");
        }
        // Two misses in a row at an acceptance near zero: the GPU still proposes, and shorter.
        let mut s = SpecState::default();
        for _ in 0..6 {
            s.record(8, 0, 16);
        }
        let l = s.next_len(16, 1, &gpu);
        assert!((1..=4).contains(&l), "{l}");
    }
}
