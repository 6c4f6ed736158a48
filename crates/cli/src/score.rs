//! `quiver perplexity`, `quiver logprobs` and `quiver bench`.

use crate::engine::{self, LoadArgs};
use anyhow::{bail, Context, Result};
use quiver_engine::{logprobs, Want};
use quiver_tokenizer::Tokenizer;
use serde_json::json;

/// llama-perplexity's method: the whole text tokenized once (BOS as the model asks, special
/// text not parsed), consecutive `n_ctx`-token chunks, BOS written over the first token of
/// each chunk when the model adds BOS, and only the second half of each chunk scored.
pub fn perplexity(
    load: &LoadArgs,
    file: &std::path::Path,
    n_ctx: usize,
    json_out: bool,
) -> Result<()> {
    let mut text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    let gguf = engine::open(load)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let ids = tok.encode(&text, true, false)?;
    if n_ctx < 4 {
        bail!("context {n_ctx} is too small for perplexity (at least 4)");
    }
    let n_chunk = ids.len() / n_ctx;
    if n_chunk == 0 {
        bail!(
            "the text has {} tokens, fewer than one chunk of {n_ctx}",
            ids.len()
        );
    }
    let first = n_ctx / 2;
    let mut args = load.clone();
    args.ctx_size = Some(n_ctx as u32);
    let mut l = engine::load(&args, gguf, n_ctx - first)?;
    let nv = l.runner.n_vocab();
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut chunks = Vec::new();
    let t0 = std::time::Instant::now();
    for c in 0..n_chunk {
        let mut chunk = ids[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if tok.add_bos() {
            if let Some(b) = tok.bos() {
                chunk[0] = b;
            }
        }
        let logits = l.runner.eval(&chunk, 0, Want::From(first))?;
        let (mut c_nll, mut c_n) = (0f64, 0usize);
        for p in first..n_ctx - 1 {
            let row = &logits[(p - first) * nv..][..nv];
            let (lp, _) = logprobs(row, chunk[p + 1], 0);
            let v = -(lp as f64);
            nll += v;
            nll2 += v * v;
            c_nll += v;
            c_n += 1;
        }
        count += c_n;
        let cum = (nll / count as f64).exp();
        chunks.push(
            json!({"chunk": c + 1, "ppl": (c_nll / c_n as f64).exp(), "cumulative_ppl": cum}),
        );
        if !json_out {
            print!("[{}]{:.4},", c + 1, cum);
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    let err = if count > 1 {
        ppl * (var / (count - 1) as f64).sqrt()
    } else {
        0.0
    };
    let secs = t0.elapsed().as_secs_f64();
    if json_out {
        let j = json!({"ppl": ppl, "ppl_error": err, "tokens": ids.len(), "chunks": n_chunk, "n_ctx": n_ctx,
                        "scored_tokens": count, "seconds": secs, "per_chunk": chunks});
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!();
        println!("PPL = {ppl:.4} +/- {err:.5}");
    }
    eprintln!(
        "quiver: {} tokens, {n_chunk} chunks of {n_ctx}, {count} scored, {secs:.1}s ({:.1} t/s)",
        ids.len(),
        (n_chunk * n_ctx) as f64 / secs
    );
    Ok(())
}

/// Teacher-forced top-N predictions after every position of a token list.
pub fn logprobs_cmd(load: &LoadArgs, ids_json: &str, top: usize) -> Result<()> {
    let ids: Vec<u32> =
        serde_json::from_str(ids_json).context("--ids must be a JSON array of token ids")?;
    if ids.is_empty() {
        bail!("--ids is empty");
    }
    let gguf = engine::open(load)?;
    let n_vocab = Tokenizer::from_gguf(&gguf)?.n_vocab();
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= n_vocab) {
        bail!("token id {bad} is outside the vocabulary of {n_vocab}");
    }
    let mut args = load.clone();
    if args.ctx_size.is_none() {
        args.ctx_size = Some(ids.len().max(16) as u32);
    }
    let batch = args.batch_size as usize;
    let mut l = engine::load(&args, gguf, batch)?;
    let nv = l.runner.n_vocab();
    if ids.len() > l.runner.n_ctx() {
        bail!(
            "{} ids exceed the context of {} tokens",
            ids.len(),
            l.runner.n_ctx()
        );
    }
    let logits = l.runner.eval(&ids, 0, Want::From(0))?;
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    for pos in 0..ids.len() {
        let (_, best) = logprobs(&logits[pos * nv..][..nv], 0, top);
        let top: Vec<_> = best
            .iter()
            .map(|&(id, lp)| json!({"id": id, "logprob": lp}))
            .collect();
        writeln!(out, "{}", json!({"pos": pos, "top": top}))?;
    }
    Ok(())
}

pub(crate) fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (m, var.sqrt())
}

/// Prompt processing and generation speed, like llama-bench: pp = one batch of `n_prompt`
/// tokens from an empty cache; tg = `n_gen` tokens one at a time from an empty cache.
/// What `quiver bench` measures: a prompt of `n_prompt` tokens and `n_gen` generated tokens,
/// each after `depth` tokens already in the cache.
pub struct BenchShape {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub depth: usize,
}

pub fn bench(load: &LoadArgs, shape: BenchShape, reps: usize, json_out: bool) -> Result<()> {
    let BenchShape {
        n_prompt,
        n_gen,
        depth,
    } = shape;
    if n_prompt == 0 && n_gen == 0 {
        bail!("nothing to measure: -p and -n are both 0");
    }
    let gguf = engine::open(load)?;
    let mut args = load.clone();
    let need = depth + n_prompt.max(n_gen).max(1);
    let Ok(need_ctx) = u32::try_from(need) else {
        bail!("-d {depth} with -p {n_prompt} -n {n_gen} needs a context of {need} tokens, past any model's");
    };
    if args.ctx_size.is_none() {
        args.ctx_size = Some(need_ctx);
    }
    args.batch_size = args.batch_size.max(n_prompt as u32);
    let mut l = engine::load(&args, gguf, 1)?;
    let nv = l.runner.n_vocab() as u64;
    // Deterministic pseudo-random token ids, as llama-bench feeds random tokens.
    let mut x = 0x2545F4914F6CDD1Du64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % nv) as u32
    };
    let ctx = args.ctx_size.unwrap_or(0) as usize;
    if ctx < need {
        bail!("-c {ctx} is less than the depth and the test need ({need} tokens)");
    }
    if depth > 0 && l.runner.hparams().has_seq_state() {
        // Each test would start over a state that already holds the previous test's tokens.
        bail!("-d {depth}: a model with per-sequence state (qwen35, deepseek4) is benchmarked from depth 0 only");
    }
    let prompt: Vec<u32> = (0..n_prompt).map(|_| rnd()).collect();
    let context: Vec<u32> = (0..depth).map(|_| rnd()).collect();
    // The depth's tokens fill positions 0..depth once; every test writes after them.
    let step = (args.batch_size as usize).max(1);
    for (i, chunk) in context.chunks(step).enumerate() {
        l.runner.eval(chunk, i * step, Want::Last)?;
    }
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    // Warm-up, as llama-bench does: one run of each test, untimed (first-use costs such as
    // kernel loading, library heuristics and graph capture stay out of the numbers).
    if n_prompt > 0 {
        l.runner.eval(&prompt, depth, Want::Last)?;
    }
    let mut tokv = rnd();
    for p in 0..n_gen.min(8) {
        tokv = l.runner.eval_argmax(&[tokv], depth + p)?;
    }
    for _ in 0..reps {
        if n_prompt > 0 {
            let t = std::time::Instant::now();
            l.runner.eval(&prompt, depth, Want::Last)?;
            pp.push(n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        if n_gen > 0 {
            let t = std::time::Instant::now();
            let mut tokv = rnd();
            for p in 0..n_gen {
                tokv = l.runner.eval_argmax(&[tokv], depth + p)?;
            }
            tg.push(n_gen as f64 / t.elapsed().as_secs_f64());
        }
    }
    let threads = engine::threads(load)?;
    let model = l.runner.hparams().arch.clone();
    let backend = l.runner.backend_name();
    let counters = engine::counters_json(l.runner.as_ref());
    l.report_counters(load);
    let mut rows = Vec::new();
    // llama-bench's names: "pp512 @ d4096".
    let at = if depth > 0 {
        format!(" @ d{depth}")
    } else {
        String::new()
    };
    if !pp.is_empty() {
        let (m, s) = mean_sd(&pp);
        rows.push(json!({"test": format!("pp{n_prompt}{at}"), "tokens_per_second": m, "sd": s, "samples": pp}));
    }
    if !tg.is_empty() {
        let (m, s) = mean_sd(&tg);
        rows.push(
            json!({"test": format!("tg{n_gen}{at}"), "tokens_per_second": m, "sd": s, "samples": tg}),
        );
    }
    if json_out {
        let j = json!({"model": model, "backend": backend, "threads": threads, "repetitions": reps, "results": rows, "counters": counters});
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("| model | backend | threads | test | t/s |");
        println!("|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {model} | {backend} | {threads} | {} | {:.2} ± {:.2} |",
                r["test"].as_str().unwrap_or(""),
                r["tokens_per_second"].as_f64().unwrap_or(0.0),
                r["sd"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// `quiver bench --parallel N,…`: llama-batched-bench's S_PP and S_TG per sequence count.
pub fn batched(
    load: &LoadArgs,
    n_prompt: usize,
    n_gen: usize,
    parallel: &[u32],
    json_out: bool,
) -> Result<()> {
    if n_prompt == 0 || n_gen == 0 {
        bail!("--parallel needs -p and -n above 0");
    }
    if let Some(tp @ 2..) = load.tensor_parallel {
        bail!("--parallel runs on one rank: the batched bench does not run with -tp {tp} yet");
    }
    let gguf = engine::open(load)?;
    let mut args = load.clone();
    // The runner's own sequence is only a warm-up; each count gets its own KV pool.
    args.ctx_size = Some(args.ctx_size.unwrap_or(64).max(16));
    let mut l = engine::load(&args, gguf, 1)?;
    let step = (load.batch_size as usize).max(1);
    let model = l.runner.hparams().arch.clone();
    let mut rows = Vec::new();
    // Warm-up (kernel loading, library heuristics): one small run.
    l.runner.batched_bench(n_prompt.min(64), 2, 1, step)?;
    for &np in parallel {
        let r = l.runner.batched_bench(n_prompt, n_gen, np as usize, step)?;
        rows.push(json!({
            "parallel": r.parallel, "n_prompt": r.n_prompt, "n_gen": r.n_gen,
            "pp_secs": r.pp_secs, "pp_tokens_per_second": r.pp_tps(),
            "tg_secs": r.tg_secs, "tg_tokens_per_second": r.tg_tps(),
        }));
    }
    let backend = l.runner.backend_name();
    l.report_counters(load);
    if json_out {
        let counters = engine::counters_json(l.runner.as_ref());
        let j = json!({"model": model, "backend": backend, "results": rows, "counters": counters});
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("| model | backend | PP | TG | B | T_PP s | S_PP t/s | T_TG s | S_TG t/s |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {model} | {backend} | {} | {} | {} | {:.3} | {:.2} | {:.3} | {:.2} |",
                r["n_prompt"],
                r["n_gen"],
                r["parallel"],
                r["pp_secs"].as_f64().unwrap_or(0.0),
                r["pp_tokens_per_second"].as_f64().unwrap_or(0.0),
                r["tg_secs"].as_f64().unwrap_or(0.0),
                r["tg_tokens_per_second"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
