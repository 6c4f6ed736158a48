//! Finding the CUDA libraries at run time. cudarc loads them by name and panics when one is
//! missing; quiver looks first (also in the usual toolkit and Python-wheel folders), loads each
//! by full path so that cudarc's later lookup by name finds the loaded copy, and turns a miss
//! into a clear error.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Folders searched after the dynamic loader's own path.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(v) = std::env::var("QUIVER_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&v));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(Path::new(&v).join("lib64"));
            dirs.push(Path::new(&v).join("lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.push("/usr/lib/x86_64-linux-gnu".into());
    dirs.push("/usr/local/nvidia/lib64".into());
    // Python wheels (nvidia-cuda-nvrtc, nvidia-cublas, nvidia-nccl): <prefix>/lib/python3.X/site-packages/nvidia/...
    let mut prefixes: Vec<PathBuf> = ["/usr", "/usr/local", "/opt/torch/.venv", "/opt/conda"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Ok(v) = std::env::var("VIRTUAL_ENV") {
        prefixes.insert(0, v.into());
    }
    for p in prefixes {
        for lib in ["lib", "lib64"] {
            let Ok(rd) = std::fs::read_dir(p.join(lib)) else {
                continue;
            };
            for e in rd.flatten() {
                let name = e.file_name();
                if !name.to_string_lossy().starts_with("python3") {
                    continue;
                }
                for sp in ["site-packages", "dist-packages"] {
                    let nv = e.path().join(sp).join("nvidia");
                    for sub in ["cu13/lib", "cuda_nvrtc/lib", "cublas/lib", "nccl/lib"] {
                        dirs.push(nv.join(sub));
                    }
                }
            }
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

/// Loads the first of `names` found (by the loader's path, then in the search folders) and
/// keeps it loaded for the life of the process.
fn preload(names: &[&str]) -> Result<PathBuf, String> {
    for n in names {
        // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
        if let Ok(lib) = unsafe { libloading::Library::new(*n) } {
            std::mem::forget(lib);
            return Ok(PathBuf::from(n));
        }
    }
    for d in search_dirs() {
        for n in names {
            let p = d.join(n);
            if p.is_file() {
                // SAFETY: as above.
                match unsafe { libloading::Library::new(&p) } {
                    Ok(lib) => {
                        std::mem::forget(lib);
                        return Ok(p);
                    }
                    Err(e) => return Err(format!("{}: {e}", p.display())),
                }
            }
        }
    }
    Err(format!(
        "{} not found (set QUIVER_CUDA_LIB_DIR to its folder)",
        names[0]
    ))
}

static DRIVER: OnceLock<Result<PathBuf, String>> = OnceLock::new();
static NVRTC: OnceLock<Result<PathBuf, String>> = OnceLock::new();
static CUBLAS: OnceLock<Result<PathBuf, String>> = OnceLock::new();
static NCCL: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// The CUDA driver library (libcuda), which only a machine with an NVIDIA driver has.
pub fn driver() -> Result<&'static Path, String> {
    DRIVER
        .get_or_init(|| {
            preload(&["libcuda.so.1", "libcuda.so"])
                .map_err(|_| "no NVIDIA driver (libcuda.so.1 not found)".to_string())
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// NVRTC, the run-time CUDA compiler (from the toolkit or the `nvidia-cuda-nvrtc` wheel).
pub fn nvrtc() -> Result<&'static Path, String> {
    NVRTC
        .get_or_init(|| {
            let p = preload(&["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"])
                .map_err(|e| format!("NVRTC is missing: {e}"))?;
            // NVRTC opens its builtins library by name; one found beside it is loaded first.
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                if let Ok(rd) = std::fs::read_dir(dir) {
                    for e in rd.flatten() {
                        let n = e.file_name().to_string_lossy().to_string();
                        if n.starts_with("libnvrtc-builtins.so") {
                            // SAFETY: as in preload.
                            if let Ok(lib) = unsafe { libloading::Library::new(e.path()) } {
                                std::mem::forget(lib);
                                break;
                            }
                        }
                    }
                }
            }
            Ok(p)
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// cuBLAS (with cuBLASLt, which it needs), used for prefill matrix products.
pub fn cublas() -> Result<&'static Path, String> {
    CUBLAS
        .get_or_init(|| {
            preload(&["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"])?;
            preload(&["libcublas.so.13", "libcublas.so.12", "libcublas.so"])
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// NCCL, the collectives of tensor parallelism over several GPUs (the toolkit's or the
/// `nvidia-nccl` wheel's).
pub fn nccl() -> Result<&'static Path, String> {
    NCCL.get_or_init(|| preload(&["libnccl.so.2", "libnccl.so"]))
        .as_deref()
        .map_err(Clone::clone)
}
