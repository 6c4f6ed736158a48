//! The scheduling policy on fake requests: no model, no device.

use super::*;

const EOG: u32 = 999;

fn sched(max_batch_tokens: usize, max_seqs: usize, kv_blocks: usize) -> Scheduler {
    Scheduler::new(SchedConfig {
        max_batch_tokens,
        max_seqs,
        max_logits: max_seqs + 8,
        kv_blocks,
        hash_seed: 7,
        eog: vec![EOG],
        spec: Default::default(),
        recurrent: false,
        rollback: 0,
    })
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> SchedRequest {
    SchedRequest {
        id,
        prompt,
        max_tokens,
        ignore_eos: false,
        prompt_logits: false,
        whole_prompt: false,
        cache_salt: None,
        speculate: false,
        spec: Default::default(),
    }
}

/// A fake model: the token after position `pos` of request `id`.
fn fake_token(id: u64, pos: usize) -> u32 {
    (id as u32 * 100 + pos as u32) % 500
}

/// One step: schedule, "sample" the fake token for each sampling row, update. Returns the
/// output and the outcomes.
fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<Outcome>) {
    let out = s.schedule().unwrap().clone();
    let sampled: Vec<(u64, u32)> = out
        .scheduled
        .iter()
        .filter(|x| x.sample)
        .map(|x| (x.id, fake_token(x.id, x.start_pos + x.n_tokens())))
        .collect();
    let outcomes = s.update(&sampled).to_vec();
    (out, outcomes)
}

/// Runs until nothing is left; returns each request's output tokens.
fn drain(s: &mut Scheduler) -> std::collections::BTreeMap<u64, Vec<u32>> {
    let mut got = std::collections::BTreeMap::new();
    for _ in 0..10_000 {
        if !s.has_work() {
            return got;
        }
        let (_, outcomes) = step(s);
        for o in outcomes.iter().filter(|o| o.appended) {
            got.entry(o.id).or_insert_with(Vec::new).push(o.token);
        }
    }
    panic!("the scheduler did not finish its requests");
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + salt) % 400).collect()
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = sched(8, 4, 64);
    s.add(req(1, prompt(20, 0), 2));
    let (out, outcomes) = step(&mut s);
    assert_eq!(out.n_tokens(), 8);
    assert_eq!(out.scheduled.len(), 1);
    assert!(
        !out.scheduled[0].sample,
        "a partial prefill samples nothing"
    );
    assert_eq!(out.started.len(), 1);
    assert!(outcomes.is_empty());
    let (out, _) = step(&mut s);
    assert_eq!((out.scheduled[0].start_pos, out.n_tokens()), (8, 8));
    assert!(out.started.is_empty(), "started once");
    let (out, outcomes) = step(&mut s);
    assert_eq!((out.scheduled[0].start_pos, out.n_tokens()), (16, 4));
    assert!(out.scheduled[0].sample);
    assert_eq!(outcomes.len(), 1);
    assert!(outcomes[0].appended && outcomes[0].finish.is_none());
    // Decode: one token at position 20, with the token just sampled.
    let (out, outcomes) = step(&mut s);
    assert_eq!((out.scheduled[0].start_pos, out.n_tokens()), (20, 1));
    assert_eq!(out.tokens, vec![fake_token(1, 20)]);
    assert_eq!(outcomes[0].finish, Some(FinishReason::Length));
    assert!(!s.has_work());
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn decode_goes_before_new_prefill_and_the_budget_is_shared() {
    let mut s = sched(10, 4, 64);
    s.add(req(1, prompt(6, 0), 5));
    step(&mut s); // prefill of 1
    s.add(req(2, prompt(30, 1), 5));
    let (out, _) = step(&mut s);
    // Request 1 decodes one token, request 2 gets the other 9 of the budget.
    assert_eq!(out.scheduled[0].id, 1);
    assert_eq!(out.scheduled[0].n_tokens(), 1);
    assert_eq!(out.scheduled[1].id, 2);
    assert_eq!(out.scheduled[1].n_tokens(), 9);
    assert_eq!(out.n_tokens(), 10);
    // Block tables cover every position the step writes.
    for x in &out.scheduled {
        let (toks, table) = out.parts(x);
        assert_eq!(toks.len(), x.n_tokens());
        assert!(table.len() * BLOCK_SIZE >= x.start_pos + x.n_tokens());
    }
}

#[test]
fn max_seqs_bounds_the_running_set() {
    let mut s = sched(64, 2, 64);
    for id in 1..=3 {
        s.add(req(id, prompt(4, id as u32), 3));
    }
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!((s.n_running(), s.n_waiting()), (2, 1));
    // The first step sampled one token for each of the two; the third waited.
    let got = drain(&mut s);
    assert_eq!(got.len(), 3);
    assert_eq!((got[&1].len(), got[&2].len(), got[&3].len()), (2, 2, 3));
}

#[test]
fn a_shared_prefix_reuses_cached_blocks() {
    let mut s = sched(256, 4, 64);
    let base = prompt(40, 3);
    s.add(req(1, base.clone(), 1));
    drain(&mut s);
    // Same first 32 tokens (two full blocks), then different.
    let mut p2 = base[..32].to_vec();
    p2.extend([1, 2, 3, 4, 5]);
    s.add(req(2, p2, 1));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 32);
    assert_eq!(out.scheduled[0].start_pos, 32);
    assert_eq!(out.n_tokens(), 5);
    // A prompt made only of cached blocks still computes its last block (for logits).
    drain(&mut s);
    s.add(req(3, base[..32].to_vec(), 1));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 16);
    assert_eq!(out.scheduled[0].start_pos, 16);
    // A different first block shares nothing, even with the same second block.
    drain(&mut s);
    let mut p4 = base[..32].to_vec();
    p4[0] += 1;
    p4.push(9);
    s.add(req(4, p4, 1));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 0);
    drain(&mut s);
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn blocks_of_generated_tokens_serve_only_their_own_request() {
    let mut s = sched(256, 4, 64);
    let base = prompt(20, 5);
    s.add(req(1, base.clone(), 30));
    let got = drain(&mut s).remove(&1).unwrap();
    // A prompt that holds request 1's prompt and answer reuses only the block of prompt
    // tokens (0..16); 16..48 hold generated tokens, which it computes as prompt rows.
    let mut p2 = base.clone();
    p2.extend(&got);
    p2.push(3);
    s.add(req(2, p2.clone(), 1));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 16);
    assert_eq!(out.scheduled[0].decode_from, p2.len());
    drain(&mut s);
    // The same prompt again finds request 2's blocks, all prompt rows (its last block is
    // still computed for logits).
    s.add(req(3, p2.clone(), 1));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 48);
    drain(&mut s);
}

#[test]
fn decode_rows_lead_the_step_and_no_part_crosses_the_prompt_end() {
    let mut s = sched(64, 4, 64);
    s.add(req(1, prompt(10, 1), 8));
    step(&mut s);
    // Request 2's prompt chunk comes after request 1's decode row.
    s.add(req(2, prompt(100, 2), 4));
    let (out, _) = step(&mut s);
    let kinds: Vec<(u64, bool)> = out
        .scheduled
        .iter()
        .map(|x| (x.id, x.start_pos >= x.decode_from))
        .collect();
    assert_eq!(kinds, vec![(1, true), (2, false)]);
    drain(&mut s);
    // Under a pool small enough to preempt (6 blocks; each request needs 3), every step: its
    // decode parts first, and no part across its request's prompt end (a resumed request
    // recomputes its prompt, then its generated tokens as decode rows).
    let mut s = sched(64, 4, 6);
    for id in 1..=3u64 {
        s.add(req(id, prompt(20, id as u32), 24));
    }
    let (mut preempted, mut recomputed) = (0, 0);
    while s.has_work() {
        let (out, _) = step(&mut s);
        preempted += out.preempted.len();
        let kinds: Vec<bool> = out
            .scheduled
            .iter()
            .map(|x| x.start_pos >= x.decode_from)
            .collect();
        assert!(kinds.windows(2).all(|k| k[0] || !k[1]), "{kinds:?}");
        for x in &out.scheduled {
            let end = x.start_pos + x.n_tokens();
            assert!(
                x.start_pos >= x.decode_from || end <= x.decode_from,
                "{x:?}"
            );
            recomputed += usize::from(x.start_pos >= x.decode_from && x.n_tokens() > 1);
        }
    }
    assert!(preempted > 0 && recomputed > 0, "{preempted} {recomputed}");
}

#[test]
fn preemption_under_a_small_pool_loses_nothing() {
    // Alone, each request gets these tokens.
    let solo: Vec<Vec<u32>> = (1..=3u64)
        .map(|id| {
            let mut s = sched(64, 4, 16);
            s.add(req(id, prompt(20, id as u32), 24));
            drain(&mut s).remove(&id).unwrap()
        })
        .collect();
    // Together in a pool of 6 blocks (96 positions; each needs 44, so 3 do not fit).
    let mut s = sched(64, 4, 6);
    for id in 1..=3u64 {
        s.add(req(id, prompt(20, id as u32), 24));
    }
    let mut preempted = 0;
    let mut resumed = 0;
    let mut got = std::collections::BTreeMap::<u64, Vec<u32>>::new();
    while s.has_work() {
        let (out, outcomes) = step(&mut s);
        preempted += out.preempted.len();
        resumed += out.started.iter().filter(|x| x.resumed).count();
        assert!(s.kv_blocks_used() <= 6);
        for o in outcomes.iter().filter(|o| o.appended) {
            got.entry(o.id).or_default().push(o.token);
        }
    }
    assert!(preempted > 0, "the pool was meant to run dry");
    assert_eq!(resumed, preempted, "every preempted request came back");
    for id in 1..=3u64 {
        assert_eq!(got[&id], solo[id as usize - 1], "request {id}");
    }
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn a_request_that_cannot_fit_the_pool_is_an_error() {
    let mut s = sched(64, 4, 2);
    s.add(req(1, prompt(40, 0), 1));
    assert_eq!(
        s.schedule().unwrap_err(),
        SchedError::PoolTooSmall {
            blocks: 2,
            tokens: 40
        }
    );
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn abort_frees_blocks_wherever_the_request_is() {
    let mut s = sched(8, 1, 64);
    s.add(req(1, prompt(20, 0), 5));
    s.add(req(2, prompt(20, 1), 5));
    step(&mut s);
    assert!(s.kv_blocks_used() > 0);
    // 2 is waiting (max_seqs 1), 1 is running mid-prefill.
    let c = s.finish(2).unwrap();
    assert_eq!((c.prompt_tokens, c.completion_tokens), (20, 0));
    let c = s.finish(1).unwrap();
    assert_eq!(c.prompt_tokens, 20);
    assert_eq!(s.finish(1), None, "already ended");
    assert_eq!(s.kv_blocks_used(), 0);
    assert!(!s.has_work());
    assert!(s.schedule().unwrap().is_empty());
}

#[test]
fn end_of_generation_and_length_end_requests() {
    let mut s = sched(64, 4, 64);
    s.add(req(1, prompt(5, 0), 10));
    s.add(SchedRequest {
        ignore_eos: true,
        ..req(2, prompt(5, 1), 2)
    });
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.scheduled.len(), 2);
    let o = s.update(&[(1, EOG), (2, EOG)]).to_vec();
    assert_eq!(
        o[0],
        Outcome {
            id: 1,
            token: EOG,
            index: 0,
            appended: false,
            finish: Some(FinishReason::Stop)
        }
    );
    assert_eq!(
        o[1],
        Outcome {
            id: 2,
            token: EOG,
            index: 1,
            appended: true,
            finish: None
        }
    );
    s.schedule().unwrap();
    let o = s.update(&[(2, 5)]).to_vec();
    assert_eq!(o[0].finish, Some(FinishReason::Length));
    assert!(o[0].appended);
    assert!(!s.has_work());
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn finish_waiting_and_all_for_shutdown() {
    let mut s = sched(8, 1, 64);
    s.add(req(1, prompt(4, 0), 5));
    s.add(req(2, prompt(4, 1), 5));
    step(&mut s);
    let w = s.finish_waiting();
    assert_eq!(w.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2]);
    let a = s.finish_all();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].1.completion_tokens, 1);
    assert_eq!(s.kv_blocks_used(), 0);
}

#[test]
fn prompt_logits_take_every_prompt_row_within_the_row_budget() {
    // max_logits = max_seqs + 8: 8 prompt rows a step.
    let mut s = sched(64, 2, 64);
    let p = prompt(40, 5);
    s.add(req(1, p.clone(), 1));
    drain(&mut s); // its blocks are now in the prefix cache
    s.add(SchedRequest {
        prompt_logits: true,
        whole_prompt: false,
        ..req(2, p.clone(), 1)
    });
    s.add(req(3, prompt(4, 9), 2));
    let out = s.schedule().unwrap().clone();
    let x = &out.scheduled[0];
    assert_eq!(
        out.started[0].cached_tokens, 0,
        "no prefix cache for prompt rows"
    );
    assert_eq!((x.start_pos, x.n_tokens(), x.logits_from), (0, 8, Some(0)));
    assert_eq!(x.logit_rows(), 8);
    // The other request still gets its sampling row.
    assert_eq!(out.scheduled[1].logit_rows(), 1);
    s.update(&[(3, 7)]);
    let mut pos = 8;
    while pos < 40 {
        let out = s.schedule().unwrap().clone();
        let x = out.scheduled.iter().find(|x| x.id == 2).unwrap();
        assert_eq!((x.start_pos, x.logits_from), (pos, Some(0)));
        assert!(x.logit_rows() <= 8);
        pos += x.n_tokens();
        assert_eq!(x.sample, pos == 40);
        let sampled: Vec<(u64, u32)> = out
            .scheduled
            .iter()
            .filter(|x| x.sample)
            .map(|x| (x.id, 1))
            .collect();
        s.update(&sampled);
    }
}

#[test]
fn requests_with_different_cache_salts_share_no_blocks() {
    let salted = |id, p: &Vec<u32>, salt: Option<&str>| SchedRequest {
        cache_salt: salt.map(String::from),
        ..req(id, p.clone(), 4)
    };
    let mut s = sched(256, 4, 64);
    let p = prompt(40, 11);
    s.add(salted(1, &p, Some("tenant-a")));
    drain(&mut s);
    // Another salt, and no salt, find none of tenant-a's cached blocks.
    for (id, salt) in [(2, Some("tenant-b")), (3, None)] {
        s.add(salted(id, &p, salt));
        let (out, _) = step(&mut s);
        assert_eq!(out.started[0].cached_tokens, 0, "{salt:?}");
        drain(&mut s);
    }
    // The same salt does (two full blocks; the last is computed for logits).
    s.add(salted(4, &p, Some("tenant-a")));
    let (out, _) = step(&mut s);
    assert_eq!(out.started[0].cached_tokens, 32);
    drain(&mut s);
    // Running side by side, two salts hold disjoint blocks; the same salt shares them.
    let mut s = sched(256, 8, 64);
    s.add(salted(5, &p, Some("x")));
    s.add(salted(6, &p, Some("y")));
    s.add(salted(7, &p, Some("x")));
    let tables = |s: &mut Scheduler| {
        let (out, _) = step(s);
        out.scheduled
            .iter()
            .map(|x| (x.id, out.parts(x).1.to_vec()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    // Step 1 computes the three prompts (nothing cached yet); each samples its first token,
    // and step 2 decodes them beside the new prompts.
    tables(&mut s);
    s.add(salted(8, &p, Some("x")));
    s.add(salted(9, &p, Some("z")));
    let t = tables(&mut s);
    let shared = |a: &[u32], b: &[u32]| a.iter().filter(|x| b.contains(x)).count();
    assert_eq!(shared(&t[&5], &t[&6]), 0);
    assert_eq!(shared(&t[&9], &t[&5]) + shared(&t[&9], &t[&6]), 0);
    assert_eq!(shared(&t[&8], &t[&6]), 0);
    assert_eq!(
        shared(&t[&8][..2], &t[&5]),
        2,
        "the same salt shares its blocks"
    );
    drain(&mut s);
    assert_eq!(s.kv_blocks_used(), 0);
}
