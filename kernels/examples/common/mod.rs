//! Helpers shared by the kernel benchmark programs (`cuda_bench`, `cuda_bench_fp8`,
//! `cuda_bench_window`): timing, and large device buffers filled from a small random tile.

use baton_kernels::cuda::{CudaDevice, CudaError, CudaSlice, bf16};

/// Decode shapes from a `B:CTX[,B:CTX...]` argument (batch, context), as the benchmarks take
/// them to run only those shapes (one, for a profiler); a malformed entry is an error.
pub fn decode_shapes(list: &str) -> Result<Vec<(usize, usize)>, CudaError> {
    let bad = |s: &str, why: String| CudaError::Shape { op: "decode_shapes", message: format!("shape {s}: {why}") };
    list.split(',')
        .map(|s| {
            let (b, c) = s.split_once(':').ok_or_else(|| bad(s, "not B:CTX".into()))?;
            let parse = |v: &str| v.parse::<usize>().map_err(|e| bad(s, e.to_string()));
            Ok((parse(b)?, parse(c)?))
        })
        .collect()
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `f(0..warm)` untimed and waits for the device: the start of every timing below.
fn warm_up(dev: &CudaDevice, warm: usize, f: &mut impl FnMut(usize) -> Result<(), CudaError>) -> Result<(), CudaError> {
    for i in 0..warm {
        f(i)?;
    }
    dev.synchronize()
}

/// Median milliseconds of `reps` CUDA-event-timed calls of `f` after `warm` untimed ones.
pub fn time_ms(
    dev: &CudaDevice,
    warm: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    warm_up(dev, warm, &mut f)?;
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

/// Mean milliseconds per call of `reps` calls of `f` enqueued back to back between two CUDA
/// events, after `warm` untimed ones. The stream never waits for the host here, so the host's
/// launch latency and the idle stream before each call (both inside [`time_ms`]'s figure) are
/// not timed: what a kernel costs inside a captured step, where its launch is queued before
/// the previous kernel ends. `f(i)` should cycle through enough copies of its inputs that no
/// call is served from L2.
pub fn time_ms_back_to_back(
    dev: &CudaDevice,
    warm: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    warm_up(dev, warm, &mut f)?;
    let a = dev.event()?;
    let b = dev.event()?;
    a.record(dev.stream())?;
    for i in 0..reps {
        f(i)?;
    }
    b.record(dev.stream())?;
    b.synchronize()?;
    Ok(f64::from(a.elapsed_ms(&b)?) / reps.max(1) as f64)
}

/// [`time_ms`] and then [`time_ms_back_to_back`] of the same calls: (isolated, back to back).
pub fn time_ms_both(
    dev: &CudaDevice,
    warm: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<(f64, f64), CudaError> {
    Ok((time_ms(dev, warm, reps, &mut f)?, time_ms_back_to_back(dev, warm, reps, &mut f)?))
}

/// The device-to-device copy of a 1 GiB buffer of random bf16: its median milliseconds and
/// bandwidth (GB/s, bytes read plus written), the ceiling a memory-bound kernel's figure is
/// compared with.
pub fn copy_bandwidth(dev: &CudaDevice, r: &mut rand::rngs::StdRng) -> Result<(f64, f64), CudaError> {
    use rand::Rng;
    let n = 1usize << 29;
    let tile: Vec<bf16> = (0..1 << 20).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
    let src = tiled(dev, &tile, n)?;
    let mut dst = dev.alloc::<bf16>(n)?;
    let ms = time_ms(dev, 3, 20, |_| dev.copy(&src, &mut dst, n))?;
    Ok((ms, 2.0 * (n * 2) as f64 / (ms * 1e-3) / 1e9))
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

/// Decode-attention inputs that rotate so that no timing is served from L2: `copies` sets of
/// `batch` rows at context `ctx`, each set over its own blocks of one shuffled pool.
pub struct DecodeSets {
    /// The cache geometry covering every set (`num_blocks` = copies × batch × blocks a row).
    pub geo: baton_kernels::cuda::KvGeometry,
    /// One step's metadata per set.
    pub metas: Vec<baton_kernels::cuda::StepMeta>,
    /// How many sets (enough for about 512 MiB of K and V, 1 to 16).
    pub copies: usize,
}

/// [`DecodeSets`] for `batch` decode rows at context `ctx`, with block size `bs` and `nkv` KV
/// heads of `hd` dims, `elem_bytes` bytes per cached value. The caller allocates the caches
/// for `geo.layer_len()` values.
pub fn decode_sets(
    dev: &CudaDevice,
    r: &mut rand::rngs::StdRng,
    (batch, ctx): (usize, usize),
    (bs, nkv, hd): (usize, usize, usize),
    elem_bytes: usize,
) -> Result<DecodeSets, CudaError> {
    use baton_kernels::cuda::{HostSeq, KvGeometry, StepMeta};
    use rand::Rng;
    let blocks_per = ctx.div_ceil(bs);
    let set_bytes = 2 * batch * blocks_per * bs * nkv * hd * elem_bytes;
    let copies = (512usize << 20).div_ceil(set_bytes).clamp(1, 16);
    let num_blocks = copies * batch * blocks_per;
    let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, r.random_range(0..=i));
    }
    let tables: Vec<Vec<u32>> = pool.chunks(blocks_per).map(<[u32]>::to_vec).collect();
    let mut metas = Vec::with_capacity(copies);
    for set in tables.chunks(batch) {
        let seqs: Vec<HostSeq<'_>> = set
            .iter()
            .enumerate()
            .map(|(i, t)| HostSeq { row_start: i, n_tokens: 1, start_pos: ctx - 1, block_table: t })
            .collect();
        let mut meta = StepMeta::new(dev)?;
        meta.set(dev, &seqs, batch, bs, num_blocks)?;
        metas.push(meta);
    }
    Ok(DecodeSets { geo, metas, copies })
}

/// Writes a benchmark's JSON document to `out_path`: `benchmark`, the device, its arch, the
/// commit, the command line (`args`), the `extra` fields (each `"key":value,`, or empty) and
/// the `results`.
pub fn write_results(
    dev: &CudaDevice,
    out_path: &str,
    benchmark: &str,
    commit: &str,
    args: &[String],
    extra: &str,
    results: &[String],
) -> Result<(), CudaError> {
    let doc = format!(
        "{{\"benchmark\":\"{benchmark}\",\"device\":\"{}\",\"arch\":\"{}\",\"commit\":\"{commit}\",\"command\":\"{}\",{extra}\"results\":[\n{}\n]}}\n",
        dev.name(),
        dev.arch(),
        args.join(" "),
        results.join(",\n")
    );
    std::fs::write(out_path, doc).map_err(|e| CudaError::Cache { path: out_path.into(), message: e.to_string() })
}
