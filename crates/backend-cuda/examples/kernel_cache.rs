//! Compiles kernel modules for sm_90 into the kernel cache of `QUIVER_HOME` without a GPU
//! (`cargo run --release --example kernel_cache -p quiver-backend-cuda -- ops quant_q4_k`), so
//! that a GPU machine with the same NVRTC version loads them instead of compiling
//! (tools/gpu/stage.sh --kernels). Needs NVRTC (`QUIVER_CUDA_LIB_DIR`, as scripts/test sets it).

fn main() {
    let modules: Vec<String> = std::env::args().skip(1).collect();
    if modules.is_empty() {
        eprintln!("kernel_cache: name the modules (registry::module_names)");
        std::process::exit(2);
    }
    for m in &modules {
        match quiver_backend_cuda::registry::precompile(m, 90) {
            Ok(p) => println!("{}", p.display()),
            Err(e) => {
                eprintln!("kernel_cache: {m}: {e}");
                std::process::exit(1);
            }
        }
    }
}
