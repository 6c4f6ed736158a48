//! EAGLE-3 heads against llama.cpp (`tools/parity/make_eagle3_fixtures.sh`): the fixtures hold
//! llama.cpp's log-probabilities of a head's decoder rows over a fixed token sequence — the
//! target run over the sequence with the head's three layers kept, the encoder's g of each
//! token, the pairs (token P + 1, g of P) at P = 0 .. N - 2 in one step — then of three drafted
//! positions, each fed the last row's top token with the last row's pre-norm state as g.
//! quiver writes the same two models again (their sha256 must match) and runs the same steps
//! through the head's model API: each of llama.cpp's best 8 tokens within 0.02 (F32) or 0.05
//! (Q8_0), top-1 equal where llama.cpp's leads by more than 0.1 nat. The head's own output
//! matrix over a draft vocabulary (`d2t`), and the target's with g normed before `fc` and as
//! the residual, are both covered.

use quiver_backend::{Backend, Batch};
use quiver_backend_cpu::{CpuBackend, CpuConfig, Numerics};
use quiver_gguf::GgufFile;
use sha2::{Digest, Sha256};
use std::sync::Arc;

mod common;

use common::HeadFixture as Fixture;

fn fixtures() -> Vec<Fixture> {
    common::head_fixtures("eagle3", 4)
}

/// The preset written again, checked against the fixture's bytes.
fn write(preset: &str, ty: &str, seed: u64, sha: &str, tag: &str) -> Arc<GgufFile> {
    let dir = std::env::temp_dir().join(format!("quiver-eagle3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}-{preset}-{ty}.gguf"));
    let p = quiver_synth::preset(preset).unwrap();
    let ft = quiver_synth::file_type(ty).unwrap();
    quiver_synth::write(p, ft, seed, &path, 2, |_, _| {}).unwrap();
    let got = format!("{:x}", Sha256::digest(std::fs::read(&path).unwrap()));
    assert_eq!(
        got, sha,
        "{preset} {ty}: quiver synth no longer writes the fixture's model: remake the fixtures \
         (tools/parity/make_eagle3_fixtures.sh)"
    );
    let f = Arc::new(GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    f
}

use common::log_softmax;

/// The head's rows as llama.cpp's harness runs them: log-probabilities by target id.
fn head_rows<B: Backend>(mut b: B, fx: &Fixture, tag: &str) -> Vec<Vec<(u32, f64)>> {
    let target_sha = fx.target_sha256.as_deref().expect("the target's sha256");
    let tf = write("tiny-llama", &fx.ty, fx.seed, target_sha, tag);
    let hf = write(&fx.preset, &fx.ty, fx.seed + 1, &fx.sha256, tag);
    let target = quiver_models::load(&b, &tf).unwrap();
    let head = quiver_models::load_eagle3(&b, &hf, &tf).unwrap();
    let layers = head.hp.eagle3.as_ref().unwrap().target_layers;
    let (n, bs) = (fx.tokens.len(), quiver_backend::KV_BLOCK_SIZE);
    let table: Vec<u32> = (0..(1024 / bs) as u32).collect();
    let mut ts = target.state(&b, 1024, 64, 64).unwrap();
    ts.capture_layers(&b, &layers, target.hp.n_embd).unwrap();
    let batch = Batch::single(&fx.tokens, 0, &table, bs, vec![(n - 1) as u32]);
    target.forward(&mut b, &mut ts, &batch).unwrap();
    let mut hs = head.state(&b, 1024, 64, 64).unwrap();
    head.head_encode(&b, &mut hs, ts.features().unwrap(), n)
        .unwrap();
    let d = head.hp.n_embd;
    let mut g = Vec::new();
    head.head_g(&b, &hs, n, &mut g).unwrap();
    head.head_input(&b, &mut hs, &g[..(n - 1) * d]).unwrap();
    let all = (0..(n - 1) as u32).collect();
    let batch = Batch::single(&fx.tokens[1..], 0, &table, bs, all);
    head.forward(&mut b, &mut hs, &batch).unwrap();
    let nv = head.hp.n_vocab;
    let (mut rows, mut logits, mut h) = (Vec::new(), Vec::new(), Vec::new());
    let mut take =
        |b: &B, hs: &quiver_models::State<B>, k: usize, rows: &mut Vec<Vec<(u32, f64)>>| {
            b.read(&hs.logits, k * nv, &mut logits).unwrap();
            for r in logits.chunks_exact(nv) {
                let lp = log_softmax(r);
                rows.push(
                    lp.iter()
                        .enumerate()
                        .map(|(i, &l)| (head.head_target_id(i as u32), l))
                        .collect(),
                );
            }
        };
    take(&b, &hs, n - 1, &mut rows);
    head.head_next_g(&b, &hs, n - 1, &mut h).unwrap();
    let mut last = h[(n - 2) * d..].to_vec();
    for k in 0..fx.draft {
        // llama.cpp's drafted token: its best at the row before.
        let t = fx.top[n - 2 + k][0].0;
        head.head_input(&b, &mut hs, &last).unwrap();
        let batch = Batch::single(&[t], n - 1 + k, &table, bs, vec![0]);
        head.forward(&mut b, &mut hs, &batch).unwrap();
        take(&b, &hs, 1, &mut rows);
        head.head_next_g(&b, &hs, 1, &mut h).unwrap();
        last = h[..d].to_vec();
    }
    rows
}

/// `bound(type)`: the largest |Δ log-probability|; top-1 is checked where llama.cpp's leads its
/// second by more than `lead(type)`.
fn check<B: Backend>(
    make: impl Fn() -> B,
    bound: impl Fn(&str) -> f64,
    lead: impl Fn(&str) -> f64,
    tag: &str,
) {
    let mut failures = Vec::new();
    for fx in fixtures() {
        let rows = head_rows(make(), &fx, tag);
        assert_eq!(rows.len(), fx.top.len(), "{}: rows", fx.name);
        let mut worst = 0f64;
        for (p, (got, want)) in rows.iter().zip(&fx.top).enumerate() {
            let lp = |id: u32| {
                got.iter()
                    .find(|x| x.0 == id)
                    .map_or(f64::NEG_INFINITY, |x| x.1)
            };
            for &(id, l) in want {
                worst = worst.max((lp(id) - l).abs());
            }
            let best = got.iter().fold(
                (0, f64::NEG_INFINITY),
                |m, &x| if x.1 > m.1 { x } else { m },
            );
            if want[0].1 - want[1].1 > lead(&fx.ty) && best.0 != want[0].0 {
                failures.push(format!(
                    "{} row {p}: top-1 {} against llama.cpp's {}",
                    fx.name, best.0, want[0].0
                ));
            }
        }
        eprintln!("{}: max |Δ log-probability| {worst:.5}", fx.name);
        if worst > bound(&fx.ty) {
            failures.push(format!(
                "{}: log-probabilities differ by {worst:.5}",
                fx.name
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn cpu_head_matches_llama_cpp() {
    let cpu = || {
        CpuBackend::with_config(CpuConfig {
            threads: 2,
            numerics: Numerics::Fast,
        })
    };
    check(
        cpu,
        |ty| if ty == "F32" { 0.02 } else { 0.05 },
        |_| 0.1,
        "cpu",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_head_matches_llama_cpp() {
    use quiver_backend_cuda::{CudaBackend, CudaConfig};
    let gpu = || CudaBackend::new(0, CudaConfig::from_env(Numerics::BatchInvariant)).unwrap();
    // The GPU's products do not round the activations to 8 bits as llama.cpp's CPU does (as the
    // architectures' GPU bounds, archs.rs), and the head reads the target's three layers, so
    // the target's difference arrives in it thrice. Measured on the H200 (2026-12-05): F32
    // 0.0195 / 0.0636 (the head with norms), Q8_0 0.135 / 0.803 with four top-1 swaps where
    // llama.cpp led by more than 0.1; held at 0.1 and 1.0, top-1 where it leads by more.
    let bound = |ty: &str| if ty == "F32" { 0.1 } else { 1.0 };
    check(gpu, bound, bound, "gpu");
}
