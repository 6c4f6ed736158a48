//! `quiver compare`: the same model on the CPU and on another device, fed the same tokens;
//! reports how far the logits are apart. Random weights give flat distributions, so synthetic
//! models are judged by relative L2 error and max |Δlogit|; real models also by top-1 agreement
//! over llama.cpp's reference generations (teacher-forced).

use crate::engine::{self, LoadArgs};
use anyhow::{bail, Context, Result};
use quiver_engine::{Session, Want};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Prompt tokens (random ids) evaluated in one step.
    #[arg(short = 'n', long, default_value_t = 64)]
    pub tokens: usize,
    /// Then this many single-token decode steps (these run from captured graphs on CUDA).
    #[arg(long, default_value_t = 32)]
    pub decode: usize,
    /// llama.cpp reference generations (JSON lines with prompt_ids and output_ids): report
    /// teacher-forced top-1 agreement of the two devices over every generated position.
    #[arg(long)]
    pub reference: Option<std::path::PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Default)]
struct Diff {
    sq: f64,
    ref_sq: f64,
    max_abs: f64,
    rows: usize,
    top1_same: usize,
}

impl Diff {
    fn add(&mut self, got: &[f32], want: &[f32], n_vocab: usize) {
        for (g, w) in got.chunks_exact(n_vocab).zip(want.chunks_exact(n_vocab)) {
            for (a, b) in g.iter().zip(w) {
                let d = (*a as f64 - *b as f64).abs();
                self.sq += d * d;
                self.ref_sq += (*b as f64) * (*b as f64);
                self.max_abs = self.max_abs.max(if d.is_nan() { f64::INFINITY } else { d });
            }
            self.rows += 1;
            self.top1_same += usize::from(quiver_engine::argmax(g) == quiver_engine::argmax(w));
        }
    }
    fn json(&self) -> serde_json::Value {
        json!({
            "rows": self.rows,
            "rel_l2": (self.sq / self.ref_sq.max(1e-30)).sqrt(),
            "max_abs": self.max_abs,
            "top1_agreement": self.top1_same as f64 / self.rows.max(1) as f64,
        })
    }
}

pub fn compare(a: CompareArgs) -> Result<()> {
    if a.load.device == "cpu" {
        bail!(
            "compare runs the CPU against another device: pass --device cuda (or auto with a GPU)"
        );
    }
    let gguf = engine::open(&a.load)?;
    let n = a.tokens.max(1);
    let mut cpu_args = a.load.clone();
    cpu_args.device = "cpu".into();
    let need = (n + a.decode).max(1);
    let ctx = a.load.ctx_size.map(|c| c as usize).unwrap_or(need.max(512));
    cpu_args.ctx_size = Some(ctx as u32);
    cpu_args.batch_size = cpu_args.batch_size.max(n as u32);
    let mut dev_args = cpu_args.clone();
    dev_args.device = a.load.device.clone();
    let max_logits = ctx;
    let mut dev = engine::load(&dev_args, gguf.clone(), max_logits)?.runner;
    // Both with the flags' numerics: with parity the CUDA backend rounds as the CPU's
    // batch-invariant path, which the CPU then takes, so the two compute the same floats.
    let mut cpu = engine::load(&cpu_args, gguf, max_logits)?.runner;
    let nv = cpu.n_vocab();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % nv as u64) as u32
    };
    let ids: Vec<u32> = (0..n).map(|_| rnd()).collect();
    let mut prompt = Diff::default();
    let want = cpu.eval(&ids, 0, Want::From(0))?.to_vec();
    prompt.add(dev.eval(&ids, 0, Want::From(0))?, &want, nv);
    let mut decode = Diff::default();
    let mut tok = rnd();
    for p in n..n + a.decode {
        let want = cpu.eval(&[tok], p, Want::Last)?.to_vec();
        decode.add(dev.eval(&[tok], p, Want::Last)?, &want, nv);
        tok = rnd();
    }
    let mut out = json!({
        "device": dev.backend_name(),
        "numerics": a.load.numerics.name(),
        "prompt": prompt.json(),
        "decode": decode.json(),
        "counters": engine::counters_json(dev.as_ref()),
    });
    if let Some(path) = &a.reference {
        out["reference"] = reference(cpu.as_mut(), dev.as_mut(), path, ctx)?;
    }
    if a.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// Teacher-forced: each record's prompt plus llama.cpp's output in one step on both devices.
fn reference(
    cpu: &mut (dyn Session + Send),
    dev: &mut (dyn Session + Send),
    path: &std::path::Path,
    ctx: usize,
) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let nv = cpu.n_vocab();
    let (mut positions, mut same, mut dev_llama, mut cpu_llama) = (0usize, 0usize, 0usize, 0usize);
    let mut diff = Diff::default();
    let mut parted = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let r: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}: line {}", path.display(), i + 1))?;
        let get = |k: &str| -> Result<Vec<u32>> {
            r[k].as_array()
                .with_context(|| format!("line {}: no {k}", i + 1))?
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).context("bad id"))
                .collect()
        };
        let (p, o) = (get("prompt_ids")?, get("output_ids")?);
        if o.is_empty() || p.is_empty() {
            continue;
        }
        let mut all = p.clone();
        all.extend_from_slice(&o[..o.len() - 1]);
        all.truncate(ctx);
        let first = p.len() - 1;
        let want = cpu.eval(&all, 0, Want::From(first))?.to_vec();
        let got = dev.eval(&all, 0, Want::From(first))?;
        diff.add(got, &want, nv);
        for (k, (g, w)) in got.chunks_exact(nv).zip(want.chunks_exact(nv)).enumerate() {
            let (ga, wa) = (quiver_engine::argmax(g), quiver_engine::argmax(w));
            positions += 1;
            same += usize::from(ga == wa);
            if ga != wa {
                // How close a call it was: the CPU's logit margin of its choice over the
                // device's, and the device's margin the other way.
                let (wa, ga) = (wa as usize, ga as usize);
                parted.push(json!({"record": i, "step": k,
                    "cpu_margin": w[wa] - w[ga], "device_margin": g[ga] - g[wa]}));
            }
            dev_llama += usize::from(ga == o[k]);
            cpu_llama += usize::from(wa == o[k]);
        }
    }
    let f = |c: usize| c as f64 / positions.max(1) as f64;
    Ok(
        json!({"positions": positions, "top1_device_vs_cpu": f(same), "top1_device_vs_llama_cpp": f(dev_llama), "top1_cpu_vs_llama_cpp": f(cpu_llama), "logits": diff.json(), "parted": parted}),
    )
}
