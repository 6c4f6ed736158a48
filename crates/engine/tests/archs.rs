//! Every architecture against llama.cpp on tiny random models (`quiver synth --preset tiny-*`,
//! F32 and Q8_0): the fixtures hold llama.cpp's teacher-forced log-probabilities over a fixed
//! token sequence, the prompt in one step and the rest one token per step
//! (`tools/parity/make_arch_fixtures.sh`). quiver writes the same model again (its sha256 must
//! match the fixture's) and evaluates the same steps:
//! - the log-probability of each of llama.cpp's best 8 tokens within 0.02 (F32 weights) or
//!   0.05 (Q8_0) on the CPU (most Q8_0 models give llama.cpp's bits);
//! - top-1 equal wherever llama.cpp's top-1 leads its second by more than 0.1 nat.
//!
//! On the GPU (ignored without one) F32 is held to 0.05. Q8_0 is held to 0.4 (0.7 for MoE), with
//! top-1 checked where llama.cpp leads by more than that: llama.cpp's CPU rounds the activations
//! of Q8_0 products to 8 bits (as quiver's CPU does, bit for bit), the GPU's kernels do not, and
//! these deliberately sharp models (weights of σ 0.1) turn that rounding into up to 0.25 nat
//! (measured on the H200, 2026-12-01: F32 ≤ 0.023 everywhere, Q8_0 0.13–0.30; the MoE model
//! 0.64 with the router's product on the tensor cores, where f16 rounding can swap two nearly
//! equal experts, 0.26 without). Gemma 4 too, since the tenth session (head dim 512 on the
//! split-K attention, the extra ops of the CUDA backend's src/extras.rs).

mod common;
mod teacher;
use quiver_backend::Backend;
use quiver_backend_cpu::{CpuBackend, CpuConfig, Numerics};
use quiver_engine::{ModelRunner, RunnerOptions};
use quiver_gguf::GgufFile;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use teacher::{log_softmax, teacher_forced};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// A fixtures' folder (`archs`: the tiny models, `deep`: real depth): where the build put
/// them, else relative to the repo root (a test binary carried to another machine and run from
/// a copy of the tree).
fn fixture_dir(set: &str) -> std::path::PathBuf {
    // QUIVER_DEEP_FIXTURES=DIR: the deep set from elsewhere (e.g. files of `--weights flat`,
    // to measure what the deep weights change).
    if let Ok(dir) = std::env::var("QUIVER_DEEP_FIXTURES") {
        if set == "deep" {
            return dir.into();
        }
    }
    let built = std::path::PathBuf::from(FIXTURES).join(set);
    if built.is_dir() {
        built
    } else {
        std::path::PathBuf::from("crates/engine/tests/fixtures").join(set)
    }
}

#[derive(Clone)]
struct Fixture {
    name: String,
    preset: String,
    ty: String,
    seed: u64,
    /// `quiver synth --weights`, where not the preset's.
    weights: Option<String>,
    sha256: String,
    /// Whether llama.cpp's build ran AVX-512 (absent: it did, as the tiny fixtures' build).
    avx512: bool,
    n_prompt: usize,
    tokens: Vec<u32>,
    /// Per position: llama.cpp's best (id, log-probability), best first.
    top: Vec<Vec<(u32, f64)>>,
}

fn fixtures(set: &str, min: usize) -> Vec<Fixture> {
    let dir = fixture_dir(set);
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    names.sort();
    assert!(
        names.len() >= min,
        "{} fixtures in {}",
        names.len(),
        dir.display()
    );
    names
        .iter()
        .map(|p| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            let s = |k: &str| v[k].as_str().unwrap().to_string();
            Fixture {
                name: p.file_stem().unwrap().to_string_lossy().into(),
                preset: s("preset"),
                ty: s("type"),
                seed: v["seed"].as_u64().unwrap(),
                weights: v["weights"].as_str().map(String::from),
                sha256: s("sha256"),
                avx512: v["avx512"].as_bool().unwrap_or(true),
                n_prompt: v["n_prompt"].as_u64().unwrap() as usize,
                tokens: v["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect(),
                top: v["top"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|row| {
                        row.as_array()
                            .unwrap()
                            .iter()
                            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
                            .collect()
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The fixture's model, written again (and checked to be the same bytes), in a folder of the
/// test's own thread: the CPU and GPU tests run at once in one process.
fn model(fx: &Fixture) -> Arc<GgufFile> {
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    let dir = std::env::temp_dir().join(format!("quiver-archs-{}-{thread}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.gguf", fx.name));
    let mut p = quiver_synth::preset(&fx.preset).unwrap().clone();
    if let Some(w) = &fx.weights {
        p.init = quiver_synth::Init::parse(w).unwrap();
    }
    let ft = quiver_synth::file_type(&fx.ty).unwrap();
    quiver_synth::write(&p, ft, fx.seed, &path, 2, |_, _| {}).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let sha = format!("{:x}", Sha256::digest(&bytes));
    assert_eq!(
        sha, fx.sha256,
        "{}: quiver synth no longer writes the fixture's model: remake the fixtures \
         (tools/parity/make_arch_fixtures.sh)",
        fx.name
    );
    let f = Arc::new(GgufFile::open(&path).unwrap());
    // Read through its mapping from here on: no file left behind.
    let _ = std::fs::remove_file(&path);
    f
}

/// Compares one backend with every fixture of `set` whose name passes `pick`; `bound(fixture)`
/// is the log-probability bound, `lead(fixture)` how far llama.cpp's top-1 must
/// lead for top-1 to be checked and how many of those checked may differ.
fn check<B: Backend>(
    set: &str,
    pick: impl Fn(&str) -> bool,
    make: impl Fn() -> B,
    bound: impl Fn(&Fixture) -> f64,
    lead: impl Fn(&Fixture) -> (f64, usize),
    refused: &[&str],
) {
    let mut failures = Vec::new();
    // QUIVER_ONLY=name,name: only those fixtures (op-by-op debugging with QUIVER_DUMP_DIR).
    let only = std::env::var("QUIVER_ONLY").ok();
    let all = fixtures(set, if set == "archs" { 16 } else { 1 });
    let mut ran = 0;
    for fx in all.into_iter().filter(|fx| pick(&fx.name)) {
        ran += 1;
        if let Some(only) = &only {
            if !only.split(',').any(|n| n == fx.name) {
                continue;
            }
        }
        let f = model(&fx);
        // The harness's context (LongRoPE picks its factors by it).
        let opts = RunnerOptions {
            kv: Default::default(),
            n_ctx: 1024,
            n_batch: fx.n_prompt.max(64),
            max_logits: fx.n_prompt.max(64),
        };
        let mut r = match ModelRunner::new(make(), &f, &opts) {
            Ok(r) => r,
            // An architecture the backend does not run yet must be refused at load, by name.
            Err(e) if refused.iter().any(|p| fx.preset == *p) => {
                let e = e.to_string();
                assert!(
                    e.contains("has no"),
                    "{}: refused without saying why: {e}",
                    fx.name
                );
                eprintln!("{}: refused at load, as expected: {e}", fx.name);
                continue;
            }
            Err(e) => {
                failures.push(format!("{}: load: {e}", fx.name));
                continue;
            }
        };
        let nv = r.n_vocab();
        let np = fx.n_prompt;
        let rows = teacher_forced(&mut r, &fx.tokens, np);
        assert_eq!(rows.len(), fx.top.len() * nv, "{}", fx.name);
        let (mut worst, mut top1_checked, mut top1_wrong, mut top1_same) = (0f64, 0, 0, 0);
        for (pos, want) in fx.top.iter().enumerate() {
            let lp = log_softmax(&rows[pos * nv..][..nv]);
            for &(id, ref_lp) in want {
                let d = (lp[id as usize] - ref_lp).abs();
                if d > bound(&fx) {
                    eprintln!(
                        "{} position {pos}: token {id} {:.4} vs llama.cpp {ref_lp:.4}",
                        fx.name, lp[id as usize]
                    );
                }
                worst = worst.max(d);
            }
            let same = quiver_engine::argmax(&rows[pos * nv..][..nv]) == want[0].0;
            top1_same += usize::from(same);
            if want[0].1 - want[1].1 > lead(&fx).0 {
                top1_checked += 1;
                top1_wrong += usize::from(!same);
            }
        }
        let b = bound(&fx);
        eprintln!(
            "{}: max |Δ logprob| {worst:.4} (bound {b}), top-1 {}/{top1_checked} where llama.cpp leads by {}, {top1_same}/{} in all",
            fx.name,
            top1_checked - top1_wrong,
            lead(&fx).0,
            fx.top.len()
        );
        if worst > b || top1_wrong > lead(&fx).1 {
            failures.push(format!(
                "{}: max |Δ logprob| {worst:.4} > {b} or {top1_wrong} top-1 differ",
                fx.name
            ));
        }
        if top1_checked < 3 {
            failures.push(format!("{}: too few clear positions", fx.name));
        }
    }
    assert!(ran > 0, "no fixture of {set} picked");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn cpu_matches_llama_cpp_on_every_architecture() {
    check(
        "archs",
        |_| true,
        || {
            CpuBackend::with_config(CpuConfig {
                threads: 2,
                numerics: Numerics::Fast,
            })
        },
        |fx| common::cpu_bound(&fx.ty),
        |_| (0.1, 0),
        &[],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_llama_cpp_on_every_architecture() {
    use quiver_backend_cuda::{CudaBackend, CudaConfig};
    check(
        "archs",
        |_| true,
        || CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap(),
        |fx| gpu_bound(&fx.preset, &fx.ty),
        |fx| (gpu_bound(&fx.preset, &fx.ty).clamp(0.1, 0.7), gpu_flips(fx)),
        &[],
    );
}

fn gpu_bound(preset: &str, ty: &str) -> f64 {
    match (ty, preset) {
        // DeepSeek-V4: every position within 0.03 but one, 0.50 (an H200, 2026-12-06), top-1
        // 121/121: an expert chosen otherwise where two sqrt-softplus scores (plus bias) lie
        // close (quiver's CPU, bit for bit with llama.cpp, flips position 23 the same way when
        // its router logits are perturbed by 1e-3: the choice is that sensitive on this model).
        ("F32", "tiny-deepseek4") => 0.6,
        // F32 weights' products in f32 since 2026-12-06 (f32mm; an H100): every tiny F32 model
        // within 0.0005–0.0194 (0.041 before for Gemma 4, whose products rounded to f16).
        ("F32", _) => 0.03,
        // Gemma 4 in Q8_0 on the GPU, measured on the H200: 0.72; top-1 39/39. Its F32 files
        // are within 0.02, so the ops are right. The thirteenth session compared
        // the GPU's and the CPU's tensors layer by layer (BENCHMARKS.md): the products differ by
        // the usual f16 rounding (3e-4), and Gemma 4's attention scale of 1 over RMS-normed q
        // and k makes these σ-0.1 models' attention near one-hot, which amplifies it ten-fold
        // per sliding-window layer. Held there so that it cannot grow unnoticed.
        (_, "tiny-gemma4") => 0.8,
        // With experts, since their decode rows run on int8 activations in the exact-sum order
        // (moe.rs; an H100, 2026-12-06): Gemma 4 0.82 (2.04 before), Qwen 3.5 0.70, top-1 7/7
        // (2.50 and 6/7 before: tokens routed to another expert where the router's 2nd and 3rd
        // logits lay within 0.002 to 0.06, carried on by the delta net). With the F32 router in
        // f32 (as llama.cpp's; f16 before) Qwen 3.5 0.59 and Gemma 4 1.40, top-1 40/40: its
        // largest gaps are tail tokens (log-probabilities −6 to −10) where a near tie of the
        // router now falls the other way than with the f16 router; its F32 file went 0.0194.
        (_, "tiny-gemma4moe") => 1.5,
        (_, "tiny-qwen35moe") => 0.9,
        // DeepSeek-V4 in Q8_0: 3.29 on an H100 and an H200 (2026-12-06), top-1 35/37 where
        // llama.cpp leads by 0.7 (`gpu_flips`): with the products' int8 activations summed in
        // the GPU's order its experts are routed otherwise at near ties of the sqrt-softplus
        // scores (as its F32 file's once, above), and a row routed otherwise writes other
        // window and compressed rows, which later rows read.
        (_, "tiny-deepseek4") => 3.5,
        (_, p) if p.ends_with("moe") => 0.7,
        _ => 0.4,
    }
}

/// Top-1 flips allowed on the GPU where llama.cpp's leads by `gpu_bound` (at most 0.7).
fn gpu_flips(fx: &Fixture) -> usize {
    match (fx.ty.as_str(), fx.preset.as_str()) {
        ("Q8_0", "tiny-deepseek4") => 2,
        _ => 0,
    }
}

/// The deep models whose comparison runs by default (a plain decoder, and Gemma 4's extra ops
/// and shared KV over 35 layers: about 25 s on 2 cores; Qwen 3.5's delta net would add 40 s);
/// all of them (3 minutes) are `cpu_matches_llama_cpp_at_every_real_depth`.
const DEEP_DEFAULT: &[&str] = &["deep-llama-", "deep-gemma4-"];

fn cpu_fast() -> CpuBackend {
    CpuBackend::with_config(CpuConfig {
        threads: 2,
        numerics: Numerics::Fast,
    })
}

/// The CPU's bound at real depth: the tiny models' 0.02 (F32) and 0.05 (Q8_0) against
/// llama.cpp's AVX-512 build, whose floats quiver's CPU reproduces. Against an AVX2 build (the
/// fixtures made on a CPU without AVX-512), whose vector e^x (attention, SiLU) rounds otherwise
/// in the last bits, Q8_0's 8-bit activations round some values to the neighbouring step,
/// layer after layer: measured 0.19–0.32 on the dense and Qwen3 MoE models, 0.41–0.68 on
/// Qwen 3.5's, held at 0.5 / 0.8 (tools/parity/README.md, "Deep models").
/// Gemma 4 with experts: F32 0.33 (0.0204 at 6 layers, 0.0106 without its experts: the MoE
/// blocks amplify the rounding over 30 layers, quiver's CPU against its own batch-invariant
/// numerics alike), held at 0.4, Q8_0 at 1.5 (a follow-up: what in its MoE amplifies).
fn deep_bound(fx: &Fixture) -> f64 {
    let g4moe = fx.preset == "deep-gemma4moe";
    match (fx.ty.as_str(), fx.avx512) {
        ("F32", _) if g4moe => 0.4,
        ("F32", _) => 0.02,
        (_, true) => 0.05,
        _ if g4moe => 1.5,
        _ if fx.preset.starts_with("deep-qwen35") => 0.8,
        _ => 0.5,
    }
}

/// Where top-1 is checked (llama.cpp's lead over its second) and how many may differ there: at
/// 0.1 none, as for the tiny models; past a loose bound, past that bound.
fn deep_lead(fx: &Fixture) -> (f64, usize) {
    (deep_bound(fx).max(0.1), 0)
}

/// Each architecture at the depth of its smallest published model (`quiver synth --preset
/// deep-*`, `--weights deep`; fixtures in `tests/fixtures/deep`, 96 prompt tokens and 48 steps)
/// against llama.cpp ([`deep_bound`]). Here the default ones.
#[test]
fn cpu_matches_llama_cpp_at_real_depth() {
    check(
        "deep",
        |n| DEEP_DEFAULT.iter().any(|d| n.starts_with(d)),
        cpu_fast,
        deep_bound,
        deep_lead,
        &[],
    );
}

#[test]
#[ignore = "minutes on 2 cores: cargo test --release -p quiver-engine --test archs -- --ignored cpu_matches_llama_cpp_at_every_real_depth"]
fn cpu_matches_llama_cpp_at_every_real_depth() {
    check("deep", |_| true, cpu_fast, deep_bound, deep_lead, &[]);
}

/// The deep models on the GPU, bounds from the H200 (2026-12-05) with a margin: F32 0.011–0.079
/// (Qwen 3.5 0.079, Qwen3 MoE 0.055: the GPU's own order of sums, amplified over the real
/// depth; with F32 weights' products in f32, an H100 2026-12-06: 0.005–0.052, Qwen 3.5 0.0053),
/// held at 0.1; Gemma 4 with experts 0.42 (0.34), held at 0.6. Q8_0 (the GPU's products take
/// f32 activations, llama.cpp's CPU 8-bit ones): 0.21–0.53, held at the CPU's AVX2 bounds (0.5,
/// Qwen 3.5 MoE 0.8); Qwen 3.5 1.18, 2.30 with its F32 products in f32 (top-1 25/25 where
/// llama.cpp leads by 1.5: its delta net carries a rounding change over the real depth), held at
/// 2.5; Gemma 4 with experts 3.34 (top-1 100/144: a
/// router's near tie flips experts, and over 30 layers that compounds; the CPU's F32 gap of 0.33
/// is the same follow-up), held at 4; top-1 where llama.cpp leads by the bound, at most 1.5.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_llama_cpp_at_every_real_depth() {
    use quiver_backend_cuda::{CudaBackend, CudaConfig};
    let bound = |fx: &Fixture| {
        let g4moe = fx.preset == "deep-gemma4moe";
        match fx.ty.as_str() {
            "F32" if g4moe => 0.6,
            "F32" => 0.1,
            _ if g4moe => 4.0,
            _ if fx.preset == "deep-qwen35" => 2.5,
            _ => deep_bound(&Fixture {
                avx512: false,
                ..fx.clone()
            }),
        }
    };
    check(
        "deep",
        |_| true,
        || CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap(),
        bound,
        // Top-1 where llama.cpp leads by the bound (at most 1.5, so that enough positions are
        // checked); Gemma 4 with experts may swap one of them (14/15 at 1.5 in Q8_0).
        move |fx| {
            let g4moe = fx.preset == "deep-gemma4moe";
            (bound(fx).clamp(0.1, 1.5), usize::from(g4moe))
        },
        &[],
    );
}
