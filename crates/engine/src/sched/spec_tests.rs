//! Speculation in the scheduler on a fake model that reads its KV: proposals change the
//! steps, never the tokens, and rejected proposals leave nothing behind (blocks freed, no
//! unaccepted token in the prefix cache).

use super::*;
use crate::spec::{DraftJob, Drafter, SpecType};
use std::collections::{BTreeMap, HashMap};

/// The fake KV cache: (block, offset) → the token written there.
type Kv = HashMap<(u32, usize), u32>;

const PERIOD: usize = 7;

/// The fake model's token after position `pos`, from the sequence read back from the KV
/// through the block table: mostly the token `PERIOD` back (so that prompt lookup proposes
/// well), now and then one that depends on every token so far (so that some are rejected).
/// A slot holding another token than the request's (a rejected proposal's KV, a wrong cached
/// block) changes what follows.
fn target(kv: &Kv, blocks: &[u32], pos: usize) -> u32 {
    let seq: Vec<u32> = (0..=pos)
        .map(|q| kv[&(blocks[q / BLOCK_SIZE], q % BLOCK_SIZE)])
        .collect();
    let h = chain_hash(1, &seq);
    if h.is_multiple_of(5) || pos + 1 < PERIOD {
        ((h >> 8) % 300) as u32
    } else {
        seq[pos + 1 - PERIOD]
    }
}

struct Run {
    outputs: BTreeMap<u64, Vec<u32>>,
    steps: usize,
    preemptions: usize,
    counts: SpecCounts,
}

fn run(kind: SpecType, kv_blocks: usize, prompts: &[Vec<u32>], max_tokens: usize) -> Run {
    run_with(kind, kv_blocks, prompts, max_tokens, None, None)
}

/// `step_secs`: each step's time by its rows, told to the scheduler (`note_step`).
fn run_with(
    kind: SpecType,
    kv_blocks: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    mut drafter: Option<&mut dyn Drafter>,
    step_secs: Option<&dyn Fn(usize) -> f64>,
) -> Run {
    let mut s = Scheduler::new(SchedConfig {
        max_batch_tokens: 64,
        max_seqs: 4,
        max_logits: 4 + 32,
        kv_blocks,
        hash_seed: 3,
        eog: vec![999],
        spec: SpecConfig {
            kind,
            draft_max: 8,
            ngram_min: 1,
            ..Default::default()
        },
        recurrent: false,
        rollback: 0,
    });
    for (i, p) in prompts.iter().enumerate() {
        s.add(SchedRequest {
            id: i as u64 + 1,
            prompt: p.clone(),
            max_tokens,
            ignore_eos: false,
            prompt_logits: false,
            whole_prompt: false,
            cache_salt: None,
            speculate: true,
            spec: Default::default(),
        });
    }
    let mut kv = Kv::new();
    let mut r = Run {
        outputs: BTreeMap::new(),
        steps: 0,
        preemptions: 0,
        counts: SpecCounts::default(),
    };
    while s.has_work() {
        r.steps += 1;
        assert!(
            r.steps < 10_000,
            "the scheduler did not finish its requests"
        );
        let out = match drafter.as_mut() {
            Some(d) => s.schedule_with(Some(&mut **d)),
            None => s.schedule(),
        }
        .unwrap()
        .clone();
        r.preemptions += out.preempted.len();
        let mut sampled = Vec::new();
        for x in &out.scheduled {
            let (tokens, blocks) = out.parts(x);
            for (j, &t) in tokens.iter().enumerate() {
                let pos = x.start_pos + j;
                kv.insert((blocks[pos / BLOCK_SIZE], pos % BLOCK_SIZE), t);
            }
            if !x.sample {
                continue;
            }
            // A proposal never reaches past the token limit.
            let generated = r.outputs.get(&x.id).map_or(0, Vec::len);
            assert!(x.draft < max_tokens - generated, "{x:?}");
            assert_eq!(x.logits_from, Some(x.n_tokens() - 1 - x.draft));
            for j in x.n_tokens() - 1 - x.draft..x.n_tokens() {
                let t = target(&kv, blocks, x.start_pos + j);
                sampled.push((x.id, t));
                if tokens.get(j + 1) != Some(&t) {
                    break;
                }
            }
        }
        for o in s.update(&sampled).iter().filter(|o| o.appended) {
            r.outputs.entry(o.id).or_default().push(o.token);
        }
        if let Some(f) = step_secs {
            s.note_step(f(out.n_tokens()));
        }
        // Every running request holds the blocks of its computed tokens and no more, and its
        // registered blocks are full blocks of accepted tokens.
        for e in &s.running {
            assert_eq!(e.blocks.len(), e.n_computed.div_ceil(BLOCK_SIZE));
            assert_eq!(e.hashed, e.n_computed.min(e.tokens.len()) / BLOCK_SIZE);
            assert!(e.proposal.is_empty());
        }
    }
    assert_eq!(s.kv_blocks_used(), 0, "blocks leaked");
    r.counts = s.spec_counts();
    r
}

fn prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|i| (0..20 + 3 * i).map(|k| (k * 11 + i * 5) % 300).collect())
        .collect()
}

#[test]
fn speculation_changes_the_steps_not_the_tokens() {
    let plain = run(SpecType::None, 256, &prompts(), 60);
    let spec = run(SpecType::Ngram, 256, &prompts(), 60);
    assert_eq!(plain.counts, SpecCounts::default());
    assert_eq!(spec.outputs, plain.outputs);
    assert!(spec.outputs.values().all(|o| o.len() == 60));
    let c = spec.counts;
    assert!(c.accepted > 0 && c.accepted < c.proposed, "{c:?}");
    assert!(
        spec.steps < plain.steps,
        "{} vs {}",
        spec.steps,
        plain.steps
    );
}

#[test]
fn proposals_follow_what_their_rows_cost() {
    // One request whose prompt half repeats: a row that costs as much as a step (a CPU's
    // arithmetic) leaves a proposal only where it pays; one that costs nothing (a GPU's
    // weight reads shared) keeps them all. The tokens are the same.
    let p: Vec<u32> = (0..48).map(|k| ((k % 24) * 7 % 50) as u32).collect();
    let plain = run(SpecType::None, 64, std::slice::from_ref(&p), 300);
    let free = run_with(
        SpecType::Ngram,
        64,
        std::slice::from_ref(&p),
        300,
        None,
        Some(&|_| 1.0),
    );
    let dear = run_with(SpecType::Ngram, 64, &[p], 300, None, Some(&|r| r as f64));
    assert_eq!(free.outputs, plain.outputs);
    assert_eq!(dear.outputs, plain.outputs);
    let (f, d) = (free.counts, dear.counts);
    assert!(f.accepted > 0 && free.steps < plain.steps, "{f:?}");
    assert!(d.proposed * 2 < f.proposed, "{d:?} against {f:?}");
    // Where a row costs a step, no proposal pays once the steps are timed: those made while
    // they were not are all the rejected ones.
    assert!(
        d.proposed - d.accepted <= f.proposed - f.accepted,
        "{d:?} against {f:?}"
    );
}

#[test]
fn speculation_under_preemption_keeps_the_tokens() {
    // 12 blocks for 4 requests of up to 83 tokens: they preempt each other, and a resumed
    // request finds its own cached blocks.
    let plain = run(SpecType::None, 256, &prompts(), 60);
    let tight = run(SpecType::Ngram, 12, &prompts(), 60);
    assert!(tight.preemptions > 0);
    assert_eq!(tight.outputs, plain.outputs);
}

#[test]
fn proposals_stop_at_the_token_limit() {
    // A prompt that repeats: long proposals, each within the tokens left (`run` checks).
    let p: Vec<u32> = (0..40).map(|k| (k % PERIOD) as u32).collect();
    let r = run(SpecType::Ngram, 64, &[p], 9);
    assert_eq!(r.outputs[&1].len(), 9);
    assert!(r.counts.accepted > 0, "{:?}", r.counts);
}

/// A fake draft model with its own KV (the same block numbers): it checks that the scheduler's
/// `done` never claims a position its KV does not hold with the request's token (a rejected
/// proposal's, a preempted request's), writes what it computes, and proposes the token
/// `PERIOD` back (the fake target's usual rule), or with `wrong` one it never picks.
#[derive(Default)]
struct FakeDraft {
    kv: Kv,
    wrong: bool,
    calls: usize,
    caught_up: usize,
}

impl Drafter for FakeDraft {
    fn draft(&mut self, jobs: &mut [DraftJob<'_>]) {
        self.calls += 1;
        for j in jobs.iter_mut() {
            let slot = |p: usize| (j.blocks[p / BLOCK_SIZE], p % BLOCK_SIZE);
            for p in 0..*j.done {
                assert_eq!(self.kv.get(&slot(p)), Some(&j.tokens[p]), "draft KV at {p}");
            }
            assert!(
                j.blocks.len() * BLOCK_SIZE >= j.tokens.len() + j.len,
                "no blocks"
            );
            let mut seq = j.tokens.to_vec();
            for (p, &t) in seq.iter().enumerate().skip(*j.done) {
                self.kv.insert(slot(p), t);
                self.caught_up += 1;
            }
            *j.done = seq.len();
            j.out.clear();
            while j.out.len() < j.len {
                let t = if self.wrong {
                    299
                } else {
                    seq[seq.len() - PERIOD]
                };
                j.out.push(t);
                if j.out.len() == j.len {
                    break;
                }
                self.kv.insert(slot(seq.len()), t);
                seq.push(t);
                *j.done += 1;
            }
        }
    }
}

#[test]
fn a_drafter_changes_the_steps_not_the_tokens_and_its_kv_follows_the_accepted_tokens() {
    let plain = run(SpecType::None, 256, &prompts(), 60);
    for wrong in [false, true] {
        for kv_blocks in [256, 12] {
            let mut d = FakeDraft {
                wrong,
                ..Default::default()
            };
            let r = run_with(
                SpecType::Draft,
                kv_blocks,
                &prompts(),
                60,
                Some(&mut d),
                None,
            );
            assert_eq!(
                r.outputs, plain.outputs,
                "wrong {wrong}, {kv_blocks} blocks"
            );
            let c = r.counts;
            assert!(d.calls > 0 && c.proposed > 0, "{c:?}");
            if wrong {
                assert_eq!(c.accepted, 0, "{c:?}");
            } else {
                assert!(c.accepted > c.proposed / 2, "{c:?}");
                assert!(r.steps < plain.steps, "{} vs {}", r.steps, plain.steps);
            }
            if kv_blocks == 12 {
                assert!(r.preemptions > 0);
            }
        }
    }
    // Without a drafter, `SpecType::Draft` proposes nothing.
    let none = run(SpecType::Draft, 256, &prompts(), 60);
    assert_eq!(
        (none.outputs, none.counts),
        (plain.outputs, SpecCounts::default())
    );
}
