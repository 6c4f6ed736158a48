//! Hyperparameters are read per architecture, as llama.cpp's loader reads them: keys an
//! architecture does not read leave its model alone (llama.cpp's own test models write every
//! key, used or not), and keys llama.cpp accepts in two forms are accepted in both.

use quiver_gguf::{Array, GgufFile, GgufWriter, Value};
use std::path::PathBuf;

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-hparams-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A test's file, removed when dropped (a failing test's too); a file opened from it stays
/// readable through its mapping.
struct Tmp(PathBuf);

impl std::ops::Deref for Tmp {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<std::path::Path> for Tmp {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A tiny preset's file, under a name of the test's own (tests run in parallel).
fn synth(name: &str, test: &str) -> Tmp {
    let path = Tmp(dir().join(format!("{name}-{test}.gguf")));
    let p = quiver_synth::preset(name).unwrap();
    let ft = quiver_synth::file_type("F32").unwrap();
    quiver_synth::write(p, ft, 1, &path, 1, |_, _| {}).unwrap();
    path
}

/// The file at `src` with `edit` applied to its metadata, written as `tag`.
fn rewrite(src: &PathBuf, tag: &str, edit: impl FnOnce(&mut GgufWriter, &str)) -> GgufFile {
    let f = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    w.metadata = f.metadata.clone();
    for t in &f.tensors {
        w.add_tensor(t.name.clone(), t.ty, &t.shape);
    }
    edit(&mut w, f.arch().unwrap());
    let path = Tmp(dir().join(format!("{tag}.gguf")));
    w.write_file(&path, |i, _, buf| {
        buf.extend_from_slice(f.tensor_data(&f.tensors[i]));
        Ok(())
    })
    .unwrap();
    GgufFile::open(&path).unwrap()
}

fn hparams(f: &GgufFile) -> String {
    format!("{:?}", quiver_models::hparams(f).unwrap())
}

/// Keys llama.cpp's model saver writes for every architecture, with the values its test
/// models carry, that the architectures below do not read.
fn unused_keys(w: &mut GgufWriter, arch: &str, n_layer: usize) {
    let k = |s: &str| format!("{arch}.{s}");
    w.set(k("attn_logit_softcapping"), Value::F32(50.0));
    w.set(k("final_logit_softcapping"), Value::F32(30.0));
    w.set(k("router_logit_softcapping"), Value::F32(30.0));
    w.set(k("logit_scale"), Value::F32(1.0));
    w.set(k("expert_weights_scale"), Value::F32(2.5));
    w.set(k("expert_weights_norm"), Value::Bool(false));
    w.set(k("expert_gating_func"), Value::U32(2));
    w.set(k("attention.sliding_window"), Value::U32(8));
    w.set(
        k("attention.sliding_window_pattern"),
        Value::Array(Array::U32((0..n_layer as u32).map(|i| i % 2).collect())),
    );
    w.set(k("attention.temperature_scale"), Value::F32(0.5));
    w.set(k("attention.clamp_kqv"), Value::F32(1.0));
    w.set(k("attention.max_alibi_bias"), Value::F32(8.0));
    w.set(k("rope.scaling.yarn_beta_fast"), Value::F32(3.0));
    w.set(k("rope.scaling.yarn_log_multiplier"), Value::F32(0.7));
    w.set(k("use_parallel_residual"), Value::Bool(true));
    // llama.cpp's "no scaling": linear by a factor of 0.
    w.set(k("rope.scaling.type"), Value::String("linear".into()));
    w.set(k("rope.scaling.factor"), Value::F32(0.0));
}

#[test]
fn keys_an_architecture_does_not_read_leave_its_model_alone() {
    for name in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3moe",
        "tiny-phi3",
    ] {
        let path = synth(name, "unused");
        let plain = GgufFile::open(&path).unwrap();
        let before = hparams(&plain);
        let n_layer = quiver_models::hparams(&plain).unwrap().n_layer;
        let f = rewrite(&path, &format!("{name}-unused"), |w, a| {
            unused_keys(w, a, n_layer)
        });
        assert_eq!(hparams(&f), before, "{name}");
    }
}

#[test]
fn gemma3_reads_no_attention_softcap_and_a_zero_final_cap_is_none() {
    let path = synth("tiny-gemma3", "caps");
    let plain = GgufFile::open(&path).unwrap();
    let hp = quiver_models::hparams(&plain).unwrap();
    assert_eq!(hp.attn_softcap, None);
    let f = rewrite(&path, "gemma3-caps", |w, a| {
        w.set(format!("{a}.attn_logit_softcapping"), Value::F32(50.0));
        w.set(format!("{a}.final_logit_softcapping"), Value::F32(0.0));
    });
    let hp2 = quiver_models::hparams(&f).unwrap();
    assert_eq!(hp2.attn_softcap, None);
    assert_eq!(hp2.final_softcap, None);
    assert_eq!(hparams(&f), format!("{hp:?}"));
    let f = rewrite(&path, "gemma3-final", |w, a| {
        w.set(format!("{a}.final_logit_softcapping"), Value::F32(30.0));
    });
    assert_eq!(
        quiver_models::hparams(&f).unwrap().final_softcap,
        Some(30.0)
    );
}

#[test]
fn the_sliding_window_pattern_is_a_period_or_one_flag_per_layer() {
    let path = synth("tiny-gemma2", "swa");
    let n = quiver_models::hparams(&GgufFile::open(&path).unwrap())
        .unwrap()
        .n_layer;
    let key = "gemma2.attention.sliding_window_pattern";
    // The period 3: layers 0, 1 local, 2 global, …
    let by_period = rewrite(&path, "g2-period", |w, _| {
        w.set(key, Value::U32(3));
    });
    let want: Vec<bool> = (0..n).map(|i| i % 3 != 2).collect();
    assert_eq!(quiver_models::hparams(&by_period).unwrap().swa_layers, want);
    // The same layers as flags, in each element type llama.cpp accepts.
    let forms: [(&str, Array); 3] = [
        ("bool", Array::Bool(want.clone())),
        ("u32", Array::U32(want.iter().map(|&b| b as u32).collect())),
        (
            "i32",
            Array::I32(want.iter().map(|&b| b as i32 * 7).collect()),
        ),
    ];
    for (tag, arr) in forms {
        let f = rewrite(&path, &format!("g2-{tag}"), |w, _| {
            w.set(key, Value::Array(arr));
        });
        assert_eq!(
            quiver_models::hparams(&f).unwrap().swa_layers,
            want,
            "{tag}"
        );
    }
    // A list of the wrong length or of floats is a one-line error naming the key.
    for (tag, arr) in [
        ("short", Array::U32(vec![1; n - 1])),
        ("float", Array::F32(vec![1.0; n])),
    ] {
        let f = rewrite(&path, &format!("g2-{tag}"), |w, _| {
            w.set(key, Value::Array(arr));
        });
        let e = quiver_models::hparams(&f).unwrap_err().to_string();
        assert!(e.contains(key) && !e.contains('\n'), "{tag}: {e}");
    }
}

#[test]
fn head_counts_are_a_number_or_one_per_layer() {
    let path = synth("tiny-llama", "heads");
    let hp = quiver_models::hparams(&GgufFile::open(&path).unwrap()).unwrap();
    let n = hp.n_layer;
    let f = rewrite(&path, "llama-heads", |w, a| {
        w.set(
            format!("{a}.attention.head_count"),
            Value::Array(Array::U32(vec![hp.n_head as u32; n])),
        );
        w.set(
            format!("{a}.attention.head_count_kv"),
            Value::Array(Array::I32(vec![hp.n_head_kv as i32; n])),
        );
        w.set(
            format!("{a}.feed_forward_length"),
            Value::Array(Array::U32(vec![hp.n_ff as u32; n])),
        );
    });
    assert_eq!(hparams(&f), format!("{hp:?}"));
}

#[test]
fn llama_and_mistral3_experts_are_as_wide_as_the_dense_ffn() {
    // A Mixtral-style file: the dense architecture's keys plus expert_count / used; llama.cpp
    // sizes each expert by feed_forward_length and ignores expert_feed_forward_length.
    for name in ["tiny-llama", "tiny-mistral3"] {
        let path = synth(name, "moe");
        let f = rewrite(&path, &format!("{name}-moe"), |w, a| {
            w.set(format!("{a}.expert_count"), Value::U32(4));
            w.set(format!("{a}.expert_used_count"), Value::U32(2));
            w.set(format!("{a}.expert_feed_forward_length"), Value::U32(7));
            w.set(format!("{a}.expert_weights_scale"), Value::F32(2.5));
        });
        let hp = quiver_models::hparams(&f).unwrap();
        let m = hp.moe.expect("experts");
        assert_eq!((m.n_expert, m.n_used, m.n_ff), (4, 2, hp.n_ff), "{name}");
        assert_eq!(m.gating, quiver_backend::Gating::Softmax);
        assert!(m.norm && m.scale == 0.0, "{name}: {m:?}");
    }
}

#[test]
fn expert_counts_are_a_number_or_one_per_layer() {
    let path = synth("tiny-qwen3moe", "per-layer");
    let hp = quiver_models::hparams(&GgufFile::open(&path).unwrap()).unwrap();
    let (n, m) = (hp.n_layer, hp.moe.unwrap());
    let key = "qwen3moe.expert_used_count";
    let f = rewrite(&path, "moe-used-array", |w, _| {
        w.set(key, Value::Array(Array::U32(vec![m.n_used as u32; n])));
        w.set(
            "qwen3moe.expert_feed_forward_length",
            Value::Array(Array::I32(vec![m.n_ff as i32; n])),
        );
    });
    assert_eq!(hparams(&f), format!("{hp:?}"));
    // Counts that differ between layers are refused by name, in one line.
    let f = rewrite(&path, "moe-used-mixed", |w, _| {
        let v = (0..n as u32).map(|i| 1 + i % 2).collect();
        w.set(key, Value::Array(Array::U32(v)));
    });
    let e = quiver_models::hparams(&f).unwrap_err().to_string();
    assert!(
        e.contains(key) && e.contains("differs") && !e.contains('\n'),
        "{e}"
    );
}

/// llama.cpp's deepseek4 test model's file (its stored head; the tensor data zeros), under a
/// name of the test's own.
fn deepseek4(test: &str) -> Tmp {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let fx = root.join("tests/reference/llama-archs/deepseek4-moe-s1");
    // The file's size, from the fixture's `"size":N`.
    let json = std::fs::read_to_string(fx.with_extension("json")).unwrap();
    let size: usize = json
        .split("\"size\":")
        .nth(1)
        .unwrap()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let mut bytes = std::fs::read(fx.with_extension("head")).unwrap();
    bytes.resize(size, 0);
    let path = Tmp(dir().join(format!("deepseek4-moe-s1-{test}.gguf")));
    std::fs::write(&path, &bytes).unwrap();
    path
}

#[test]
fn deepseek4_reads_its_keys_and_refuses_what_it_cannot_run_in_one_line() {
    let src = deepseek4("keys");
    let hp = quiver_models::hparams(&GgufFile::open(&src).unwrap()).unwrap();
    let ds = hp.dsv4.as_ref().unwrap();
    assert_eq!(ds.ratios, vec![0, 0, 4, 128]);
    assert_eq!((ds.hc.hc, ds.hc.iters, ds.q_lora, ds.n_swa), (4, 2, 64, 32));
    assert_eq!(
        (ds.o_groups, ds.o_lora, ds.ix_heads, ds.ix_dim),
        (8, 32, 64, 128)
    );
    assert_eq!(
        (ds.n_rot, ds.rope_comp.base, ds.n_ff_shared),
        (32, 160000.0, 1024)
    );
    assert_eq!(ds.clamp_shexp, vec![10.0; 4]);
    let m = hp.moe.unwrap();
    assert_eq!(
        (m.n_expert, m.n_used, m.n_ff, m.norm, m.scale),
        (2, 2, 1024, true, 1.0)
    );
    // Every layer keeps per-sequence state: no paged KV.
    assert!(hp.layers.iter().all(|l| l.recurrent));
    assert!(hp.kv_spec(16, Default::default()).layers.is_empty());
    let cases: [(&str, Value, &str); 6] = [
        ("expert_group_count", Value::U32(2), "group-limited"),
        ("expert_gating_func", Value::U32(2), "sqrt-softplus"),
        (
            "attention.compress_ratios",
            Value::Array(Array::U32(vec![0, 0, 4, 64])),
            "0, 4 and 128",
        ),
        (
            "attention.compress_ratios",
            Value::Array(Array::U32(vec![0, 4])),
            "2 entries for 4 blocks",
        ),
        ("hyper_connection.count", Value::U32(2), "4 only"),
        (
            "attention.output_group_count",
            Value::U32(3),
            "does not divide",
        ),
    ];
    for (i, (key, value, says)) in cases.into_iter().enumerate() {
        let f = rewrite(&src, &format!("deepseek4-bad-{i}"), |w, arch| {
            w.set(format!("{arch}.{key}"), value);
        });
        let e = quiver_models::hparams(&f).unwrap_err().to_string();
        assert!(
            e.contains(key) && e.contains(says) && !e.contains('\n'),
            "{e}"
        );
    }
}

/// `quiver synth`'s DeepSeek-V4 presets read as written: every compression ratio, both
/// routings, per-block clamps, YaRN on the compressed blocks only; the file with a
/// multi-token-prediction block loads for plain use, the block counted out of the trunk and
/// loaded beside it.
#[test]
fn synth_deepseek4_presets_read_as_written_with_and_without_their_block() {
    for (name, nextn) in [("tiny-deepseek4", 0), ("tiny-deepseek4-mtp", 1)] {
        let path = synth(name, "dsv4");
        let f = std::sync::Arc::new(GgufFile::open(&path).unwrap());
        let hp = quiver_models::hparams(&f).unwrap();
        let ds = hp.dsv4.as_ref().unwrap();
        assert_eq!((hp.n_layer, ds.nextn), (4, nextn), "{name}");
        assert_eq!(ds.ratios, [0, 4, 128, 4, 0][..4 + nextn], "{name}");
        assert_eq!((ds.hash_layers, ds.hc.hc, ds.hc.iters), (2, 4, 20));
        assert_eq!((ds.ix_heads, ds.ix_dim, ds.ix_top_k), (16, 64, 4));
        assert_eq!(
            (hp.head_dim, ds.n_rot, ds.n_swa, ds.q_lora),
            (128, 32, 8, 64)
        );
        assert_eq!(ds.clamp_exp[..4], [2.0, 2.5, 3.0, 2.0]);
        assert_eq!(ds.clamp_shexp[..4], [3.0, 2.0, 2.5, 3.0]);
        assert!(ds.rope_comp.yarn.is_some() && ds.rope_raw.yarn.is_none());
        let m = hp.moe.unwrap();
        assert_eq!((m.n_expert, m.n_used, m.n_ff, m.scale), (8, 2, 128, 1.5));
        let model = quiver_models::load(&quiver_backend_cpu::CpuBackend::new(1), &f).unwrap();
        let w = model.dsv4.as_ref().unwrap();
        assert_eq!(w.layers.len(), 4, "{name}");
        assert_eq!(quiver_models::mtp::blocks(&f), nextn, "{name}");
        assert!(w
            .layers
            .iter()
            .take(2)
            .all(|l| l.hash.is_some() && l.bias.is_none()));
        assert!(w
            .layers
            .iter()
            .skip(2)
            .all(|l| l.hash.is_none() && l.bias.is_some()));
        let ratios: Vec<_> = w
            .layers
            .iter()
            .map(|l| (l.comp.is_some(), l.ix.is_some()))
            .collect();
        assert_eq!(
            ratios,
            [(false, false), (true, true), (true, false), (true, true)]
        );
    }
}

/// A backend without DeepSeek-V4's ops (as the parity mode): only its name and what it supports
/// answer; the load must stop, in one line naming the op, before touching anything else.
struct NoDsv4;

impl quiver_backend::Backend for NoDsv4 {
    type Buf = ();
    type Weight = ();
    type Kv = ();
    type StepCtx = ();
    fn name(&self) -> &'static str {
        "nodsv4"
    }
    fn supports(&self, op: quiver_backend::ExtraOp) -> bool {
        op != quiver_backend::ExtraOp::Dsv4
    }
    fn weight(
        &self,
        _: &str,
        _: quiver_gguf::GgmlType,
        _: &[u64],
        _: quiver_backend::WeightBytes,
    ) -> quiver_backend::Result<()> {
        unreachable!("a weight loaded before the ops were checked")
    }
    fn buf(&self, _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn kv(&self, _: &quiver_backend::KvSpec, _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn begin_step<'b>(
        &mut self,
        _: &'b quiver_backend::Batch,
        _: u64,
        _: usize,
        _: usize,
    ) -> quiver_backend::Result<quiver_backend::Step<'b, ()>> {
        unreachable!()
    }
    fn embed(
        &self,
        _: &quiver_backend::Step<()>,
        _: &(),
        _: f32,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn rms_norm(&self, _: &(), _: &(), _: f32, _: usize, _: &mut ()) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn rms_norm_inplace(&self, _: &mut (), _: &(), _: f32, _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn add_rms_norm(
        &self,
        _: &mut (),
        _: &(),
        _: &(),
        _: f32,
        _: usize,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn add(&self, _: &mut (), _: &(), _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn add_bias(&self, _: &mut (), _: &(), _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn moe(
        &self,
        _: &(),
        _: usize,
        _: quiver_backend::MoeWeights<'_, ()>,
        _: &quiver_backend::MoeParams,
        _: quiver_backend::MoeScratch<'_, ()>,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn matmul(&self, _: &(), _: &(), _: usize, _: &mut ()) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn weight_rows(&self, _: &()) -> usize {
        unreachable!()
    }
    fn matmul_logits(
        &self,
        _: &quiver_backend::Step<()>,
        _: &(),
        _: &(),
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn rope_kv_write(
        &self,
        _: &quiver_backend::Step<()>,
        _: &mut (),
        _: &mut (),
        _: &(),
        _: &quiver_backend::RopeParams,
        _: &quiver_backend::AttnParams,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn attention(
        &self,
        _: &quiver_backend::Step<()>,
        _: &(),
        _: &(),
        _: &quiver_backend::AttnParams,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn glu(
        &self,
        _: quiver_backend::Activation,
        _: &(),
        _: &(),
        _: usize,
        _: &mut (),
    ) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn softcap(&self, _: &mut (), _: f32, _: usize) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn read(&self, _: &(), _: usize, _: &mut Vec<f32>) -> quiver_backend::Result<()> {
        unreachable!()
    }
    fn mask_rows(&self, _: &mut (), _: usize, _: &[(usize, &[u32])]) -> quiver_backend::Result<()> {
        unreachable!()
    }
}

#[test]
fn a_backend_without_the_deepseek4_ops_refuses_it_at_load_in_one_line() {
    let f = std::sync::Arc::new(GgufFile::open(deepseek4("refuse")).unwrap());
    let e = match quiver_models::load(&NoDsv4, &f) {
        Ok(_) => panic!("loaded without the deepseek4 ops"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("nodsv4 backend has no deepseek4")
            && e.contains("deepseek4 models")
            && !e.contains('\n'),
        "{e}"
    );
}

/// `feed_forward_length` is optional, as llama.cpp reads it: DeepSeek-V4 and Qwen3 MoE, which
/// run no dense FFN, read the same without it (DeepSeek-V4's logits the same bits); a model
/// with a dense FFN is refused in one line naming the key.
#[test]
fn feed_forward_length_is_needed_only_by_a_dense_ffn() {
    use quiver_backend::{Backend, Batch};
    for (name, dense) in [
        ("tiny-deepseek4", false),
        ("tiny-qwen3moe", false),
        ("tiny-llama", true),
    ] {
        let path = synth(name, "no-ff");
        let with = GgufFile::open(&path).unwrap();
        let without = rewrite(&path, &format!("{name}-no-ff"), |w, a| {
            assert!(w
                .metadata
                .shift_remove(&format!("{a}.feed_forward_length"))
                .is_some());
        });
        if dense {
            let e = quiver_models::hparams(&without).unwrap_err().to_string();
            assert!(
                e.contains("feed_forward_length") && e.contains("missing") && !e.contains('\n'),
                "{name}: {e}"
            );
            continue;
        }
        let (a, b) = (
            quiver_models::hparams(&with).unwrap(),
            quiver_models::hparams(&without).unwrap(),
        );
        assert_eq!(
            (a.moe, a.shared_expert_ff),
            (b.moe, b.shared_expert_ff),
            "{name}"
        );
        if name != "tiny-deepseek4" {
            continue;
        }
        let mut be = quiver_backend_cpu::CpuBackend::new(1);
        let tokens = [3u32, 141, 59, 26, 5, 35];
        let logits = |f: GgufFile, be: &mut quiver_backend_cpu::CpuBackend| {
            let m = quiver_models::load(be, &std::sync::Arc::new(f)).unwrap();
            let mut s = m.state(be, 64, 8, 8).unwrap();
            let table: Vec<u32> = (0..4).collect();
            let all = (0..tokens.len() as u32).collect();
            let batch = Batch::single(&tokens, 0, &table, quiver_backend::KV_BLOCK_SIZE, all);
            m.forward(be, &mut s, &batch).unwrap();
            let mut out = Vec::new();
            be.read(&s.logits, tokens.len() * m.hp.n_vocab, &mut out)
                .unwrap();
            out
        };
        let want = logits(with, &mut be);
        assert!(logits(without, &mut be) == want, "{name}: logits differ");
    }
}
