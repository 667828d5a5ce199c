//! Compiles the CUDA kernels with NVRTC for an architecture and writes the PTX, with no GPU
//! needed: a quick check of the sources on any machine where libnvrtc loads. Also checks that
//! the PTX defines every kernel the device loads at open (`kernel_names`), so a renamed or
//! missing instantiation fails here rather than in `CudaDevice::open` on a GPU.
//!
//! Usage: `cuda_compile [ARCH] [OUT.ptx]` (default `compute_90a`, `baton_kernels.ptx`).

use std::collections::HashSet;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arch = args.get(1).map(String::as_str).unwrap_or("compute_90a");
    let out = args.get(2).map(String::as_str).unwrap_or("baton_kernels.ptx");
    let ptx = match baton_kernels::cuda::compile_ptx(arch) {
        Ok(ptx) => ptx,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = std::fs::write(out, &ptx) {
        eprintln!("cannot write {out}: {e}");
        std::process::exit(1);
    }
    // Entry points appear as `.visible .entry NAME(`.
    let entries: HashSet<&str> = ptx
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l).trim())
        .collect();
    let names = baton_kernels::cuda::kernel_names();
    let missing: Vec<&String> = names.iter().filter(|n| !entries.contains(n.as_str())).collect();
    if !missing.is_empty() {
        eprintln!("{arch}: the PTX lacks {} kernel(s) the device loads: {missing:?}", missing.len());
        std::process::exit(1);
    }
    println!(
        "{arch}: {} bytes of PTX in {out}; all {} kernels the device loads are defined ({} entries)",
        ptx.len(),
        names.len(),
        entries.len()
    );
}
