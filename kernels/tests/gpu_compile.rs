//! The kernel cache filled without a GPU (`build_cache`, what `baton kernels build` runs).
//! Needs NVRTC only (no device), but like every test that needs a CUDA library it is named
//! `gpu_*`: CI has none.

use baton_kernels::cuda::{build_cache, modules};

#[test]
fn gpu_build_cache_compiles_every_module_once_and_repairs_a_bad_entry() {
    let dir = std::env::temp_dir().join(format!("baton-build-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = build_cache("sm_90a", &dir).expect("build");
    assert_eq!(first.len(), modules().len());
    assert!(first.iter().all(|r| !r.from_cache && r.bytes > 0), "{first:?}");
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
        .collect();
    assert_eq!(files.len(), modules().len(), "one CUBIN per module, no temporary files left");
    let longest = first.iter().map(|r| r.ms).fold(0.0, f64::max);
    println!("sm_90a: {} modules, longest {longest:.0} ms", first.len());

    // Everything is cached now; a truncated entry is compiled again and rewritten.
    let victim = files.iter().find(|p| p.to_string_lossy().contains("gemv_m8_v0-")).expect("gemv_m8_v0 entry");
    let good = std::fs::read(victim).expect("read");
    std::fs::write(victim, &good[..good.len() / 2]).expect("truncate");
    let second = build_cache("sm_90a", &dir).expect("rebuild");
    for r in &second {
        assert_eq!(r.from_cache, r.name != "gemv_m8_v0", "{r:?}");
    }
    assert_eq!(std::fs::read(victim).expect("read").len(), good.len(), "the entry was repaired");

    // Another architecture is another set of entries; PTX for compute_* targets.
    let ptx = build_cache("compute_90a", &dir).expect("ptx");
    assert!(ptx.iter().all(|r| !r.from_cache));
    assert!(build_cache("hopper", &dir).is_err(), "an unknown architecture is refused");
    let _ = std::fs::remove_dir_all(&dir);
}
