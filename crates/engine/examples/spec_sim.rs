//! Prompt lookup's policy replayed on a greedy token sequence: how many steps the n-gram
//! proposer and the request's speculation policy (`SpecState`, `worth`) take to produce it,
//! under a model of what a step of r rows costs (1 + c·(r − 1) units: c ≈ 0.02 on a GPU, where
//! the weights are read once a step, c ≈ 1 on a CPU). Greedy output does not depend on the
//! speculation, so the replay is exact for a given output.
//!
//! cargo run --release -p quiver-engine --example spec_sim -- IDS.json PROMPT_TOKENS C [DRAFT_MAX]
//!   IDS.json: the prompt's and the output's token ids, one JSON array.

use quiver_engine::spec::{ngram_propose, SpecState};
use quiver_engine::spec_cost::StepCost;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 3 {
        eprintln!("usage: spec_sim IDS.json PROMPT_TOKENS C [DRAFT_MAX]");
        std::process::exit(2);
    }
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&a[0]).expect("ids file"))
        .expect("a JSON array of token ids");
    let prompt: usize = a[1].parse().expect("prompt tokens");
    let c: f64 = a[2].parse().expect("row cost");
    let draft_max: usize = a.get(3).map_or(16, |s| s.parse().expect("draft max"));
    let t = |rows: usize| 1e-3 * (1.0 + c * (rows as f64 - 1.0));
    // Learnt as the engine learns it: each step's time by its rows.
    let mut cost = StepCost::default();
    let (mut p, mut steps, mut time, mut proposed, mut accepted) = (prompt, 0, 0.0, 0, 0);
    let mut state = SpecState::default();
    while p < ids.len() {
        let len = state.next_len(draft_max, 1, &cost);
        let prop = ngram_propose(&ids[..p], 4, 2, len);
        let ok = prop
            .iter()
            .zip(&ids[p..])
            .take_while(|(x, y)| x == y)
            .count();
        state.record(prop.len(), ok, draft_max);
        (proposed, accepted) = (proposed + prop.len(), accepted + ok);
        time += t(1 + prop.len());
        cost.record(1 + prop.len(), t(1 + prop.len()));
        steps += 1;
        p += ok + 1;
    }
    let gen = ids.len() - prompt;
    println!(
        "{gen} tokens in {steps} steps ({:.2} a step), proposed {proposed}, accepted {accepted}; {:.2}x plain decode's speed",
        gen as f64 / steps as f64,
        gen as f64 * t(1) / time
    );
}
