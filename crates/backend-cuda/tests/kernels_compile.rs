//! Every kernel module compiles with NVRTC to sm_90 machine code. Needs NVRTC (CI installs
//! the nvidia-cuda-nvrtc wheel into .venv), not a GPU; without NVRTC they fail.

use quiver_backend_cuda::registry;

/// NVRTC from the environment, or from the project's `.venv` (where `scripts/test` installs the
/// wheel). Without it the tests fail.
fn ensure_nvrtc() {
    if std::env::var_os("QUIVER_CUDA_LIB_DIR").is_none() {
        let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
        if let Some(dir) = std::fs::read_dir(&venv)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("site-packages/nvidia/cu13/lib"))
            .find(|d| d.is_dir())
        {
            // SAFETY: set before any thread of this test binary loads a library.
            unsafe { std::env::set_var("QUIVER_CUDA_LIB_DIR", dir) };
        }
    }
    if let Err(e) = quiver_backend_cuda::libs::nvrtc() {
        panic!("{e}: run scripts/test (it installs the nvidia-cuda-nvrtc wheel into .venv)")
    }
}

/// One module: its cubin holds every kernel of its list under the lowered name.
fn check_module(m: &str) -> Result<(), String> {
    let c = registry::compile(m, 90)?;
    // An ELF image with machine code, not PTX text.
    if &c.cubin[..4] != b"\x7fELF" {
        return Err(format!("{m}: not a cubin"));
    }
    let names = registry::kernel_names(m);
    let lowered: Vec<_> = c.lowered.iter().map(|(n, _)| n).collect();
    if lowered != names.iter().collect::<Vec<_>>() {
        return Err(format!("{m}: kernels {lowered:?}, the list {names:?}"));
    }
    for (name, lowered) in &c.lowered {
        if !c
            .cubin
            .windows(lowered.len())
            .any(|w| w == lowered.as_bytes())
        {
            return Err(format!(
                "{m}: kernel {name} ({lowered}) missing from the cubin"
            ));
        }
    }
    Ok(())
}

/// Every module, compiled on as many threads as there are cores (NVRTC compiles one module on
/// one thread; this test is most of CI's time on two cores).
#[test]
fn every_module_compiles_for_sm90() {
    ensure_nvrtc();
    // QUIVER_ONLY=S: only the modules whose name contains S (while working on them).
    let only = std::env::var("QUIVER_ONLY").unwrap_or_default();
    let modules: Vec<String> = registry::module_names()
        .into_iter()
        .filter(|m| m.contains(&only))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.min(modules.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(m) = modules.get(i) else { break };
                if let Err(e) = check_module(m) {
                    failures.lock().unwrap().push(e);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_broken_kernel_reports_the_module_and_the_log() {
    ensure_nvrtc();
    let e = registry::compile("no_such_module", 90).unwrap_err();
    assert!(e.contains("unknown kernel module no_such_module"), "{e}");
    let e = registry::compile_source(
        "broken",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        90,
    )
    .unwrap_err();
    assert!(e.contains("broken") && e.contains("undefined_name"), "{e}");
}

#[test]
fn cache_keys_differ_by_module_and_architecture() {
    ensure_nvrtc();
    let a = registry::cache_file("ops", 90).unwrap();
    let b = registry::cache_file("ops", 89).unwrap();
    let c = registry::cache_file("exact", 90).unwrap();
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_eq!(a, registry::cache_file("ops", 90).unwrap());
}

/// ptxas's report names every kernel of a module with its registers (the "ops" module here;
/// `QUIVER_ONLY=S cargo test --release -p quiver-backend-cuda --test kernels_compile
/// resources -- --nocapture` prints it for the modules whose name contains S instead: a look
/// at a kernel's registers, spills and shared memory without a GPU).
#[test]
fn resources() {
    ensure_nvrtc();
    let only = std::env::var("QUIVER_ONLY").unwrap_or_else(|_| "ops".into());
    for m in registry::module_names()
        .into_iter()
        .filter(|m| m.contains(&only))
    {
        let log = registry::resource_report(&m, 90).unwrap();
        for name in registry::kernel_names(&m) {
            let at = log
                .find(&format!("'{name}'"))
                .unwrap_or_else(|| panic!("{m}: no report for {name}"));
            assert!(
                log[at..].contains("registers"),
                "{m}: no register count for {name}"
            );
        }
        println!("== {m}\n{log}");
    }
}
