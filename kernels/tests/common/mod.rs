//! Helpers shared by the GPU kernel tests: the device, seeded random inputs rounded to bf16,
//! uploads, NaN-poisoned outputs, downloads and the relative-error check of DESIGN.md §5.

#![allow(dead_code)] // each test file uses its own subset

use baton_kernels::cuda::{CudaDevice, CudaOptions, CudaSlice, bf16};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The bf16 check: ‖out − ref‖ / ‖ref‖ below this.
pub const TOL: f64 = 1e-2;

pub fn device() -> CudaDevice {
    // A cache shared by the tests of this run (the module has many attention instantiations);
    // gpu_kernel_cache_round_trip checks the cache itself from an empty directory.
    let cache = std::env::temp_dir().join("baton-gpu-test-kernels");
    CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: Some(cache), ..Default::default() })
        .expect("a CUDA device is required for gpu_* tests")
}

/// A generator seeded from the clock (fresh inputs every run), its seed printed.
pub fn rng(test: &str) -> StdRng {
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(1) as u64;
    println!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-a, a], already rounded to bf16.
pub fn rand_vec(r: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(r.random_range(-a..a)).to_f32()).collect()
}

pub fn up(dev: &CudaDevice, v: &[f32]) -> CudaSlice<bf16> {
    dev.upload(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).expect("upload")
}

pub fn poisoned(dev: &CudaDevice, n: usize) -> CudaSlice<bf16> {
    dev.upload(&vec![bf16::NAN; n]).expect("upload poison")
}

pub fn down(dev: &CudaDevice, s: &CudaSlice<bf16>, n: usize) -> Vec<f32> {
    dev.download(s, n).expect("download").iter().map(|v| v.to_f32()).collect()
}

/// ‖out − want‖ / ‖want‖; panics on a non-finite output (unwritten poison or overflow).
pub fn rel_err(out: &[f32], want: &[f32]) -> f64 {
    assert_eq!(out.len(), want.len());
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        panic!("output {i} is {} (unwritten or overflow)", out[i]);
    }
    let err: f64 = out.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    assert!(norm > 0.0, "reference is all zeros");
    err / norm
}

/// The bf16 check ([`TOL`]).
pub fn check(what: &str, out: &[f32], want: &[f32]) {
    let e = rel_err(out, want);
    println!("{what}: rel err {e:.2e}");
    assert!(e < TOL, "{what}: rel err {e:.3e} >= {TOL}");
}

/// Block tables for sequences `(start_pos, n_tokens)` over `bs`-token blocks, dealt out from a
/// shuffled pool with `spare` blocks left over (so tables are non-contiguous and a wrong slot
/// reads someone else's data). Returns the pool size, the tables and the total rows.
pub fn shuffled_tables(
    r: &mut StdRng,
    specs: &[(usize, usize)],
    bs: usize,
    spare: usize,
) -> (usize, Vec<Vec<u32>>, usize) {
    let num_blocks = specs.iter().map(|s| (s.0 + s.1).div_ceil(bs)).sum::<usize>() + spare;
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, r.random_range(0..=i));
    }
    let tables = specs.iter().map(|&(start, n)| pool.drain(..(start + n).div_ceil(bs)).collect()).collect();
    (num_blocks, tables, specs.iter().map(|s| s.1).sum())
}
