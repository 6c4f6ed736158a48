//! Speculation in the scheduler on a fake model that reads its KV: proposals change the
//! steps, never the tokens, and rejected proposals leave nothing behind (blocks freed, no
//! unaccepted token in the prefix cache).

use super::*;
use crate::spec::SpecType;
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
        let out = s.schedule().unwrap().clone();
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
