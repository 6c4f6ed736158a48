//! Files quiver cannot run are refused at load with an error that names what is wrong: the
//! architecture (and the supported ones), the missing tensor (with its layer), the key.

use quiver_backend_cpu::CpuBackend;
use quiver_gguf::GgufFile;
use std::sync::Arc;

fn load(p: &quiver_synth::Preset, tag: &str) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("quiver-load-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.gguf"));
    let ft = quiver_synth::file_type("F32").unwrap();
    quiver_synth::write(p, ft, 1, &path, 1, |_, _| {}).unwrap();
    let f = Arc::new(GgufFile::open(&path).unwrap());
    // Read through its mapping from here on.
    let _ = std::fs::remove_file(&path);
    quiver_models::load(&CpuBackend::new(1), &f)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn preset(name: &str) -> quiver_synth::Preset {
    quiver_synth::preset(name).unwrap().clone()
}

#[test]
fn every_tiny_architecture_loads() {
    for name in [
        "tiny-llama",
        "tiny-mistral3",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3moe",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-deepseek4",
        // With a multi-token-prediction block after the trunk (counted out of it).
        "tiny-deepseek4-mtp",
    ] {
        load(&preset(name), name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn an_unknown_architecture_names_itself_and_the_supported_ones() {
    let p = quiver_synth::Preset {
        arch: "mamba",
        ..preset("tiny-llama")
    };
    let e = load(&p, "mamba").unwrap_err();
    assert!(e.contains("\"mamba\""), "{e}");
    for a in quiver_models::SUPPORTED {
        assert!(e.contains(a), "{e} lacks {a}");
    }
}

#[test]
fn a_missing_tensor_is_named_with_its_layer() {
    // A MoE file read as the dense architecture: its FFN tensors are not there.
    let p = quiver_synth::Preset {
        arch: "qwen3",
        ..preset("tiny-qwen3moe")
    };
    let e = load(&p, "moe-as-dense").unwrap_err();
    assert!(
        e.contains("blk.0.ffn_gate.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn more_experts_used_than_there_are_is_a_load_error() {
    let p = quiver_synth::Preset {
        n_expert_used: 20,
        ..preset("tiny-qwen3moe")
    };
    let e = load(&p, "too-many-used").unwrap_err();
    assert!(
        e.contains("expert_used_count") && e.contains("20") && e.contains("16"),
        "{e}"
    );
}

#[test]
fn expert_tensors_that_do_not_fit_the_keys_are_named() {
    // Experts of 64 rows where the tensors hold 128: the shape check names the tensor.
    let mut p = preset("tiny-qwen3moe");
    p.n_ff_exp = 128;
    let dir = std::env::temp_dir().join(format!("quiver-load-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("expert-shape.gguf");
    quiver_synth::write(
        &p,
        quiver_synth::file_type("F32").unwrap(),
        1,
        &path,
        1,
        |_, _| {},
    )
    .unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let mut hp = quiver_models::hparams(&f).unwrap();
    if let Some(m) = hp.moe.as_mut() {
        m.n_ff = 64;
    }
    let e = quiver_models::load_with(&CpuBackend::new(1), &Arc::new(f), hp)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.0.ffn_gate_exps.weight"), "{e}");
}
