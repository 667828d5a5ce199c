//! The linear layer over FP8 (E4M3) weights beside the same product over bf16 weights, at the
//! Llama-3.1-8B projection shapes, in one run (a benchmark program, not a test).
//!
//! Per shape (qkv 4096 → 6144, o 4096 → 4096, gate_up 4096 → 28672, down 14336 → 4096) and rows
//! of x M ∈ {1, 4, 16, 64, 256}:
//! - `bf16`: the bf16 product the engine runs for bf16 weights (the skinny GEMM's default
//!   variant up to 16 rows, cuBLASLt's tuned algorithm beyond);
//! - `fp8 wW_uU`: every variant of the skinny FP8 kernel (`Fp8GemvCall`, per-channel scales;
//!   `*` = the default, marked where the engine runs it: below `W8A8_MIN_M` rows), up to 64 rows
//!   (at 256 only the default runs, for the record), and the default with 128 × 128 block
//!   scales (`blk`, the engine's choice up to 64 rows for such weights);
//! - `dequant+gemm` (M ≥ 16): the engine's path past 64 rows for weights-only FP8 and 128 × 128
//!   blocks, the matrix dequantized into a bf16 scratch and the bf16 product;
//! - `w8a8` (M ≥ 16): its path from `W8A8_MIN_M` rows for `--quantization fp8` (per-token activation
//!   quantization, then cuBLASLt's FP8 GEMM with outer-vector scales; its "rel diff" includes
//!   the activations' quantization error, ~1e-2, since the reference keeps x in bf16).
//!
//! Fewest bytes: the weights once (n·k codes + scales for FP8, 2·n·k for bf16), x and out
//! (bf16) once; the figure is that over the time, also as a share of the device-to-device
//! copy bandwidth measured first (the floor of a memory-bound kernel). Weights rotate among
//! copies (≥ 256 MB together) so that no timing is served from L2. Times are medians of
//! CUDA-event-timed launches after warm-up. What was timed is checked: each FP8 output's
//! relative difference from dequant + cuBLAS on the same codes (bf16 rounding only: ~1e-3).
//!
//! Usage: `cuda_bench_fp8_linear OUT.json [COMMIT]`; prints a table and writes every figure as
//! JSON (`bench/results/cuda-fp8-linear-COMMIT-DEVICE-DATE.json`).

use baton_kernels::cuda::{
    CudaDevice, CudaError, CudaOptions, CudaSlice, Fp8DequantCall, Fp8GemvCall, Fp8W8A8Call, Fp8Weights,
    GEMV_FP8_MAX_M, GEMV_FP8_VARIANTS, GEMV_KERNEL_MAX_M, LinearCall, LinearKernel, W8A8_MIN_M, bf16, gemv_fp8_default,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::fmt::Write as _;

#[allow(dead_code)] // the decode-attention sets serve the other benches
mod common;
use common::{download_f32, rel_diff, tiled, time_ms};

/// Random non-NaN E4M3 codes for `n` weights (a 16 MiB tile repeated) and `scales` random
/// scales: one FP8 matrix on the device, `(row_block, col_block)` blocks.
fn random_fp8(
    dev: &CudaDevice,
    r: &mut StdRng,
    (rows, cols): (usize, usize),
    (row_block, col_block): (usize, usize),
) -> Result<Fp8Weights, CudaError> {
    let n = rows * cols;
    let tile: Vec<u8> = (0..n.min(1 << 24))
        .map(|_| {
            loop {
                let c: u8 = r.random();
                if c & 0x7f != 0x7f {
                    break c;
                }
            }
        })
        .collect();
    let scales: Vec<f32> =
        (0..rows.div_ceil(row_block) * cols.div_ceil(col_block)).map(|_| r.random_range(0.5f32..2.0) * 1e-3).collect();
    // Per channel or 128 × 128 here: neither needs an expanded per-row copy.
    let (codes, scales) = (tiled(dev, &tile, n)?, dev.upload(&scales)?);
    Ok(Fp8Weights { codes, scales, rows, cols, row_block, col_block, expanded_row_scales: None })
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench_fp8_linear failed: {e}");
        std::process::exit(1);
    }
}

/// One printed and recorded figure.
struct Row<'a> {
    shape: &'a str,
    m: usize,
    n: usize,
    k: usize,
    kernel: String,
    default: bool,
    us: f64,
    bytes: usize,
    diff: Option<f64>,
}

fn run() -> Result<(), CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let out_path = args.get(1).cloned().unwrap_or_else(|| "cuda_bench_fp8_linear.json".into());
    let commit = args.get(2).cloned().unwrap_or_default();
    let dev = CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: None, ..Default::default() })?;
    let mut r = StdRng::seed_from_u64(0xf8f8);
    let mut table = String::new();
    let mut json = Vec::new();

    let (_, copy_gbs) = common::copy_bandwidth(&dev, &mut r)?;
    writeln!(table, "device {} ({}); copy 1 GiB d2d: {copy_gbs:.0} GB/s (read+write)", dev.name(), dev.arch()).ok();
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"gb_s\":{copy_gbs:.1}}}"));
    writeln!(
        table,
        "\nout = x·Wᵀ, bf16 x and out; fp8 = per-channel scales unless blk (128×128); * = default variant\n shape        M kernel             us     GB/s  %copy  fp8 vs bf16  rel diff"
    )
    .ok();
    // W8A8 products cuBLASLt refused (shape, M, why): listed after the table.
    let mut refused: Vec<(&str, usize, String)> = Vec::new();
    let mut record = |row: Row<'_>, bf16_us: f64| {
        let gbs = row.bytes as f64 / (row.us * 1e-6) / 1e9;
        let d = row.diff.map(|d| format!("{d:.1e}")).unwrap_or_default();
        let tag = format!("{}{}", row.kernel, if row.default { "*" } else { "" });
        writeln!(
            table,
            " {:8} {:5} {tag:15} {:8.1} {gbs:8.0} {:5.1}% {:11.2}x {d:>9}",
            row.shape,
            row.m,
            row.us,
            100.0 * gbs / copy_gbs,
            bf16_us / row.us
        )
        .ok();
        let diff = row.diff.map(|d| format!("{d:.3e}")).unwrap_or_else(|| "null".into());
        json.push(format!(
            "{{\"name\":\"linear\",\"shape\":\"{}\",\"m\":{},\"n\":{},\"k\":{},\"kernel\":\"{}\",\"default\":{},\"us\":{:.2},\"min_bytes\":{},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4},\"speedup_vs_bf16\":{:.3},\"rel_diff_vs_dequant_cublas\":{diff}}}",
            row.shape,
            row.m,
            row.n,
            row.k,
            row.kernel,
            row.default,
            row.us,
            row.bytes,
            gbs / copy_gbs,
            bf16_us / row.us
        ));
    };

    for &(shape, n, k) in
        &[("qkv", 6144usize, 4096usize), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    {
        let copies = (256usize << 20).div_ceil(n * k).clamp(2, 16);
        let chan: Vec<Fp8Weights> =
            (0..copies).map(|_| random_fp8(&dev, &mut r, (n, k), (1, k))).collect::<Result<_, _>>()?;
        let blk: Vec<Fp8Weights> =
            (0..copies).map(|_| random_fp8(&dev, &mut r, (n, k), (128, 128))).collect::<Result<_, _>>()?;
        let bf16_copies = (256usize << 20).div_ceil(2 * n * k).clamp(2, 8);
        let wtile: Vec<bf16> = (0..1 << 24).map(|_| bf16::from_f32(r.random_range(-0.1f32..0.1))).collect();
        let wb: Vec<CudaSlice<bf16>> =
            (0..bf16_copies).map(|_| tiled(&dev, &wtile, n * k)).collect::<Result<_, _>>()?;
        let mut scratch = dev.alloc::<bf16>(n * k)?;
        for &m in &[1usize, 4, 16, 64, 256] {
            let xtile: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
            let x = dev.upload(&xtile)?;
            let mut out = dev.alloc::<bf16>(m * n)?;
            let mut reference = dev.alloc::<bf16>(m * n)?;
            let io = 2 * (m * k + m * n);
            let bf16_kernel = if m <= GEMV_KERNEL_MAX_M { LinearKernel::GEMV } else { LinearKernel::Tuned };
            let bf16_us = 1e3
                * time_ms(&dev, 3, 20, |i| {
                    LinearCall { x: &x, m, k, w: &wb[i % bf16_copies], n, out: &mut out, kernel: bf16_kernel }
                        .launch(&dev)
                })?;
            let base = Row { shape, m, n, k, kernel: String::new(), default: false, us: 0.0, bytes: 0, diff: None };
            record(Row { kernel: "bf16".into(), us: bf16_us, bytes: 2 * n * k + io, ..base }, bf16_us);
            let fp8_bytes = n * k + 4 * n + io;
            // The engine's path past GEMV_FP8_MAX_M rows, and the reference for the checks.
            let dequant_gemm = |w: &Fp8Weights, scratch: &mut CudaSlice<bf16>, out: &mut CudaSlice<bf16>| {
                Fp8DequantCall { w, out: scratch }.launch(&dev)?;
                LinearCall { x: &x, m, k, w: scratch, n, out, kernel: LinearKernel::Cublas }.launch(&dev)
            };
            dequant_gemm(&chan[0], &mut scratch, &mut reference)?;
            let want = download_f32(&dev, &reference, m * n)?;
            if m >= GEMV_KERNEL_MAX_M {
                let us = 1e3
                    * time_ms(&dev, 3, 20, |i| {
                        Fp8DequantCall { w: &chan[i % copies], out: &mut scratch }.launch(&dev)?;
                        LinearCall { x: &x, m, k, w: &scratch, n, out: &mut out, kernel: bf16_kernel }.launch(&dev)
                    })?;
                record(Row { kernel: "dequant+gemm".into(), us, bytes: fp8_bytes, ..base }, bf16_us);
                let (mut xq, mut xs) = (dev.alloc::<u8>(m * k)?, dev.alloc::<f32>(m)?);
                let mut w8a8 = |w: &Fp8Weights, out: &mut CudaSlice<bf16>| {
                    Fp8W8A8Call { x: &x, m, w, xq: &mut xq, xs: &mut xs, out }.launch(&dev)
                };
                match w8a8(&chan[0], &mut out) {
                    Ok(()) => {
                        let diff = Some(rel_diff(&download_f32(&dev, &out, m * n)?, &want));
                        let us = 1e3 * time_ms(&dev, 3, 20, |i| w8a8(&chan[i % copies], &mut out))?;
                        let row =
                            Row { kernel: "w8a8".into(), default: m >= W8A8_MIN_M, us, bytes: fp8_bytes, diff, ..base };
                        record(row, bf16_us);
                    }
                    Err(e) => refused.push((shape, m, e.to_string())),
                }
            }
            let default = gemv_fp8_default(n, m, dev.sm_count());
            for (vi, v) in GEMV_FP8_VARIANTS.iter().enumerate() {
                if m > GEMV_FP8_MAX_M && vi != default {
                    continue;
                }
                let us = 1e3
                    * time_ms(&dev, 3, 20, |i| {
                        Fp8GemvCall { x: &x, m, w: &chan[i % copies], out: &mut out, variant: Some(vi) }.launch(&dev)
                    })?;
                Fp8GemvCall { x: &x, m, w: &chan[0], out: &mut out, variant: Some(vi) }.launch(&dev)?;
                let diff = Some(rel_diff(&download_f32(&dev, &out, m * n)?, &want));
                let kernel = format!("fp8 w{}_u{}", v.warps, v.unroll);
                let row = Row { kernel, default: vi == default && m < W8A8_MIN_M, us, bytes: fp8_bytes, diff, ..base };
                record(row, bf16_us);
            }
            // 128 × 128 block scales, default variant.
            let us = 1e3
                * time_ms(&dev, 3, 20, |i| {
                    Fp8GemvCall { x: &x, m, w: &blk[i % copies], out: &mut out, variant: None }.launch(&dev)
                })?;
            dequant_gemm(&blk[0], &mut scratch, &mut reference)?;
            Fp8GemvCall { x: &x, m, w: &blk[0], out: &mut out, variant: None }.launch(&dev)?;
            let diff = Some(rel_diff(&download_f32(&dev, &out, m * n)?, &download_f32(&dev, &reference, m * n)?));
            let blk_bytes = n * k + 4 * n.div_ceil(128) * k.div_ceil(128) + io;
            let row =
                Row { kernel: "fp8 blk".into(), default: m <= GEMV_FP8_MAX_M, us, bytes: blk_bytes, diff, ..base };
            record(row, bf16_us);
        }
    }

    for (shape, m, why) in &refused {
        writeln!(table, " {shape:8} {m:5} w8a8 refused by cuBLASLt: {why}").ok();
        let why = why.replace('"', "'");
        json.push(format!(
            "{{\"name\":\"linear\",\"shape\":\"{shape}\",\"m\":{m},\"kernel\":\"w8a8\",\"refused\":\"{why}\"}}"
        ));
    }
    common::write_results(&dev, &out_path, "cuda-fp8-linear", &commit, &args, "", &json)?;
    println!("{table}");
    Ok(())
}
