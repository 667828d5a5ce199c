//! `baton kernels build`: fills a kernel cache directory with every CUDA module compiled for an
//! architecture, on a machine with NVRTC and no GPU (an image build, a CI job), so the servers
//! that are given the directory start without compiling (see `baton_kernels::cuda::build_cache`).

use crate::cli::KernelsBuildArgs;
use crate::settings::serve::default_kernel_cache_dir;
use anyhow::Context;

/// Compiles what the cache lacks and prints one line per module and a summary.
pub fn build(args: &KernelsBuildArgs) -> anyhow::Result<()> {
    let dir = args
        .out
        .clone()
        .or_else(default_kernel_cache_dir)
        .context("no --out given and no default kernel cache (set HOME or XDG_CACHE_HOME)")?;
    let t0 = std::time::Instant::now();
    let reports = baton_kernels::cuda::build_cache(&args.arch, &dir)
        .with_context(|| format!("cannot build the {} kernels into {}", args.arch, dir.display()))?;
    for r in &reports {
        let how = if r.from_cache { "already cached" } else { "compiled" };
        println!("{:<16} {:>9} bytes  {how} ({:.0} ms)", r.name, r.bytes, r.ms);
    }
    let compiled = reports.iter().filter(|r| !r.from_cache).count();
    println!(
        "{}: {} modules in {} ({compiled} compiled, {} already there) in {:.1} s",
        args.arch,
        reports.len(),
        dir.display(),
        reports.len() - compiled,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
