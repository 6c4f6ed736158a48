//! The batched benchmark's sequences get exactly what they get alone (CPU kernels are batch
//! invariant by default), with prompts cut into steps that cross sequence boundaries.

use quiver_backend_cpu::CpuBackend;
use quiver_engine::{bench_prompt, ModelRunner, RunnerOptions};
use quiver_gguf::GgufFile;
use std::sync::Arc;

#[test]
fn batched_sequences_equal_solo_greedy_runs() {
    let p = quiver_hub::alias_path("smollm2-135m");
    assert!(p.is_file(), "{} is missing: run scripts/test", p.display());
    let f = Arc::new(GgufFile::open(&p).unwrap());
    let opts = RunnerOptions {
        kv: Default::default(),
        n_ctx: 64,
        n_batch: 64,
        max_logits: 1,
    };
    let mut r = ModelRunner::new(CpuBackend::new(2), &f, &opts).unwrap();
    let (n_prompt, n_gen) = (20, 6);
    let res =
        quiver_engine::batched_bench(&mut r.backend, &r.model, n_prompt, n_gen, 3, 32).unwrap();
    assert_eq!(res.tokens.len(), 3);
    assert!(res.pp_tps() > 0.0 && res.tg_tps() > 0.0);
    let nv = r.n_vocab();
    for (s, got) in res.tokens.iter().enumerate() {
        let prompt = bench_prompt(s, n_prompt, nv);
        let mut want = vec![r.eval_argmax(&prompt, 0).unwrap()];
        for g in 0..n_gen {
            let t = *want.last().unwrap();
            want.push(r.eval_argmax(&[t], n_prompt + g).unwrap());
        }
        assert_eq!(got, &want, "sequence {s}");
    }
    // Sequence 0 does not depend on how many run beside it.
    let one =
        quiver_engine::batched_bench(&mut r.backend, &r.model, n_prompt, n_gen, 1, 32).unwrap();
    assert_eq!(one.tokens[0], res.tokens[0]);
}
