//! Compiles every CUDA kernel module with NVRTC for an architecture, in parallel, and writes
//! each image, with no GPU needed: a quick check of the sources on any machine where libnvrtc
//! loads. Also checks that every module defines the kernels the device loads from it
//! (`kernel_modules`), so a renamed or missing instantiation fails here rather than in
//! `CudaDevice::open` on a GPU, and prints each module's compile time (the longest one bounds a
//! cold start on a machine with enough cores).
//!
//! Usage: `cuda_compile [ARCH] [OUT_DIR] [--head-dim N [--experts] [--fp8-weights]]` (default
//! `sm_90a`, `baton_kernels/`, every module). An `sm_*` architecture gives CUBINs, a `compute_*`
//! one PTX. `--head-dim` compiles only what a model of that head_dim (with experts, with FP8
//! weights) loads, as its cold start does (`KernelNeeds::model`). To fill a kernel *cache* (what
//! a server reads), use `baton kernels build --arch ARCH --out DIR`.

use baton_kernels::cuda::{ImageKind, KernelNeeds, compile_needed, missing_kernels};

fn main() {
    let all: Vec<String> = std::env::args().collect();
    let flag = |f: &str| all.iter().any(|a| a == f);
    let head_dim = all.iter().position(|a| a == "--head-dim").map(|i| match all.get(i + 1).map(|v| v.parse()) {
        Some(Ok(hd)) => hd,
        _ => {
            eprintln!("--head-dim needs a number");
            std::process::exit(2);
        }
    });
    let needs = match head_dim {
        Some(hd) => KernelNeeds::model(hd, flag("--experts"), flag("--fp8-weights")),
        None => KernelNeeds::all(),
    };
    let args: Vec<&String> = all.iter().take_while(|a| !a.starts_with("--")).collect();
    let arch = args.get(1).map(|s| s.as_str()).unwrap_or("sm_90a");
    let out = std::path::PathBuf::from(args.get(2).map(|s| s.as_str()).unwrap_or("baton_kernels"));
    let kind = match ImageKind::for_arch(arch) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let t0 = std::time::Instant::now();
    let compiled = match compile_needed(arch, &needs) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let wall = t0.elapsed().as_secs_f64();
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("cannot create {}: {e}", out.display());
        std::process::exit(1);
    }
    let ext = if kind == ImageKind::Cubin { "cubin" } else { "ptx" };
    let mut failed = false;
    for c in &compiled {
        let name = c.module.name();
        let path = out.join(format!("{name}.{ext}"));
        if let Err(e) = std::fs::write(&path, &c.image) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        let missing = missing_kernels(&c.module, &c.image, kind);
        if !missing.is_empty() {
            eprintln!("{arch} {name}: lacks {} kernel(s) the device loads: {missing:?}", missing.len());
            failed = true;
        }
        println!("{name:<16} {:>9} bytes {:>8.0} ms", c.image.len(), c.ms);
    }
    let longest = compiled.iter().map(|c| c.ms).fold(0.0, f64::max);
    let total: f64 = compiled.iter().map(|c| c.ms).sum();
    println!(
        "{arch}: {} modules in {}, {wall:.1} s wall ({:.1} s longest module, {:.1} s summed)",
        compiled.len(),
        out.display(),
        longest / 1e3,
        total / 1e3
    );
    if failed {
        std::process::exit(1);
    }
}
