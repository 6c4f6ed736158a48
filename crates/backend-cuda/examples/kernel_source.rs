//! Prints the full source NVRTC compiles for a kernel module (`cargo run --example
//! kernel_source -p quiver-backend-cuda -- quant_q4_k`), e.g. to read ptxas' register and
//! spill counts with `nvcc -arch=sm_90 -cubin --resource-usage` on a machine with the toolkit.

fn main() {
    let module = std::env::args().nth(1).unwrap_or_else(|| "ops".into());
    match quiver_backend_cuda::registry::module_source(&module) {
        Some(src) => print!("{src}"),
        None => {
            eprintln!("unknown kernel module {module}");
            std::process::exit(1);
        }
    }
}
