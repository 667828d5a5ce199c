//! Helpers shared by the kernel benchmark programs (`cuda_bench`, `cuda_bench_fp8`,
//! `cuda_bench_window`): timing, and large device buffers filled from a small random tile.

use baton_kernels::cuda::{CudaDevice, CudaError, CudaSlice, bf16};

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `reps` CUDA-event-timed calls of `f` after `warm` untimed ones.
pub fn time_ms(
    dev: &CudaDevice,
    warm: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    for i in 0..warm {
        f(i)?;
    }
    dev.synchronize()?;
    let mut out = Vec::with_capacity(reps);
    for i in 0..reps {
        let a = dev.event()?;
        let b = dev.event()?;
        a.record(dev.stream())?;
        f(i)?;
        b.record(dev.stream())?;
        b.synchronize()?;
        out.push(f64::from(a.elapsed_ms(&b)?));
    }
    Ok(median(out))
}

/// `n` values on the device: `tile` (up to its first `n` values) copied repeatedly, so that
/// gigabytes of random inputs cost one small upload.
pub fn tiled<T: cudarc::driver::DeviceRepr + Clone>(
    dev: &CudaDevice,
    tile: &[T],
    n: usize,
) -> Result<CudaSlice<T>, CudaError> {
    let tile = dev.upload(&tile[..tile.len().min(n)])?;
    let mut out = dev.alloc::<T>(n)?;
    let mut off = 0;
    while off < n {
        let len = tile.len().min(n - off);
        let mut dst = out.slice_mut(off..off + len);
        dev.stream().memcpy_dtod(&tile.slice(..len), &mut dst)?;
        off += len;
    }
    Ok(out)
}

/// The first `n` values of a bf16 buffer, widened (synchronizes).
pub fn download_f32(dev: &CudaDevice, s: &CudaSlice<bf16>, n: usize) -> Result<Vec<f32>, CudaError> {
    Ok(dev.download(s, n)?.iter().map(|v| v.to_f32()).collect())
}

/// ‖a − b‖ / ‖b‖ (NaN when either holds a non-finite value).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let err: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
    err / norm
}
