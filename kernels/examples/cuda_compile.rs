//! Compiles the CUDA kernels with NVRTC for an architecture and writes the PTX, with no GPU
//! needed: a quick check of the sources on any machine where libnvrtc loads.
//!
//! Usage: `cuda_compile [ARCH] [OUT.ptx]` (default `compute_90a`, `baton_kernels.ptx`).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arch = args.get(1).map(String::as_str).unwrap_or("compute_90a");
    let out = args.get(2).map(String::as_str).unwrap_or("baton_kernels.ptx");
    match baton_kernels::cuda::compile_ptx(arch) {
        Ok(ptx) => {
            if let Err(e) = std::fs::write(out, &ptx) {
                eprintln!("cannot write {out}: {e}");
                std::process::exit(1);
            }
            println!("{arch}: {} bytes of PTX in {out}", ptx.len());
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
