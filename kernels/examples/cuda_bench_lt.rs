//! cuBLASLt's algorithm choice for the batched decode products (a benchmark program, not a
//! test): how far the configuration the engine runs is from the best cuBLASLt has, and
//! whether timing candidates from L2 (as `LtGemm` does) picks the one that is fastest from
//! DRAM (as inside a step).
//!
//! Per Llama-3.1-8B projection (qkv 4096 → 6144, o 4096 → 4096, gate_up 4096 → 28672, down
//! 14336 → 4096) and rows of x M ∈ {32, 64, 128, 256} (or `--rows`):
//! - `engine`: `LinearCall` with `LinearKernel::Tuned`, the engine's product for these rows;
//! - every candidate of `LtSearch::SplitK(16)` (the heuristic's first 16, then their split-K
//!   variants) and of `LtSearch::Exhaustive(--limit)`, each timed two ways: back to back over
//!   weights that rotate among copies (≥ 256 MB together, so from DRAM; the figure reported),
//!   as `LtGemm` times by default (the same weights, median of 5 after a warm-up, each from an
//!   idle stream: launch latency included, weights mostly in L2), and as it times with flushed
//!   timing on (each run queued behind a write over 128 MB, so from DRAM on a busy stream);
//! - the pick each timing would make among the heuristic's first 12 (today's tuner), among the
//!   split-K set, and among the exhaustive set, each at its DRAM time.
//!
//! The floor of a product is max(bytes ÷ copy bandwidth, FLOPs ÷ 780 TFLOP/s, the cuBLAS bf16
//! ceiling of DESIGN.md); bytes are the weights, x and out once. What was timed is checked:
//! every reported pick's output against the heuristic's first choice (relative difference; f32
//! accumulation in a different order: ~1e-3 at most).
//!
//! Usage: `cuda_bench_lt OUT.json [COMMIT] [--rows 32,64] [--limit 1500]`; prints a table and
//! writes every figure as JSON.

use baton_kernels::cuda::{
    CudaDevice, CudaError, CudaOptions, CudaSlice, LinearCall, LinearKernel, LtSearch, LtShape, bf16,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::fmt::Write as _;

#[allow(dead_code)] // the decode-attention sets serve the other benches
mod common;
use common::{download_f32, rel_diff, tiled, time_ms, time_ms_back_to_back};

/// The cuBLAS bf16 ceiling measured on the H100 (DESIGN.md), FLOP/s.
const BF16_PEAK: f64 = 780e12;

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench_lt failed: {e}");
        std::process::exit(1);
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// One candidate's two timings (µs).
#[derive(Clone, Copy)]
struct Timed {
    dram: f64,
    l2: f64,
    /// As `LtGemm` times with flushed timing on: each run behind a write over twice the L2.
    flushed: f64,
}

/// The index of the smallest `key` among `idx`.
fn pick(t: &[Timed], idx: impl Iterator<Item = usize>, key: impl Fn(&Timed) -> f64) -> Option<usize> {
    idx.min_by(|&a, &b| key(&t[a]).total_cmp(&key(&t[b])))
}

fn run() -> Result<(), CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let out_path = args.get(1).cloned().unwrap_or_else(|| "cuda_bench_lt.json".into());
    let commit = args.get(2).filter(|a| !a.starts_with("--")).cloned().unwrap_or_default();
    let rows: Vec<usize> = arg(&args, "--rows")
        .unwrap_or_else(|| "32,64,128,256".into())
        .split(',')
        .map(|v| v.parse().map_err(|e| CudaError::BlasLt(format!("--rows {v}: {e}"))))
        .collect::<Result<_, _>>()?;
    let limit: usize = arg(&args, "--limit")
        .map(|v| v.parse().map_err(|e| CudaError::BlasLt(format!("--limit {v}: {e}"))))
        .transpose()?
        .unwrap_or(1500);
    let dev = CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: None, ..Default::default() })?;
    let mut r = StdRng::seed_from_u64(0x17);
    let mut table = String::new();
    let mut json = Vec::new();
    let (_, copy_gbs) = common::copy_bandwidth(&dev, &mut r)?;
    writeln!(table, "device {} ({}); copy 1 GiB d2d: {copy_gbs:.0} GB/s", dev.name(), dev.arch()).ok();
    writeln!(
        table,
        "\nµs from DRAM (back to back, weights rotating); floor = max(bytes/copy, FLOPs/780T)\n shape      M  floor  engine  tuner12(L2)  tuner12(flushed)  best12  splitK(L2)  best splitK  exh(L2)  best exh   n_sk n_exh  best config"
    )
    .ok();
    // Twice an H100's 50 MB L2, written before each flushed timing.
    let mut flush = dev.alloc::<u8>(128 << 20)?;
    let tile: Vec<bf16> = (0..1 << 20).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0) * 0.05)).collect();
    for (name, k, n) in [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)] {
        let copies = (256usize << 20).div_ceil(2 * n * k).clamp(2, 8);
        let ws: Vec<CudaSlice<bf16>> = (0..copies).map(|_| tiled(&dev, &tile, n * k)).collect::<Result<_, _>>()?;
        for &m in &rows {
            let xt: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
            let x = dev.upload(&xt)?;
            let mut out = dev.alloc::<bf16>(m * n)?;
            let bytes = 2 * (n * k + m * k + m * n);
            let flops = 2.0 * (m * n * k) as f64;
            let floor = (bytes as f64 / (copy_gbs * 1e9)).max(flops / BF16_PEAK) * 1e6;
            let engine = 1e3
                * time_ms_back_to_back(&dev, 3, 20, |i| {
                    LinearCall { x: &x, m, k, w: &ws[i % copies], n, out: &mut out, kernel: LinearKernel::Tuned }
                        .launch(&dev)
                })?;
            let shape = LtShape { m, n, k, f32_out: false, fp8: false };
            let mut sets = Vec::new();
            for search in [LtSearch::SplitK(16), LtSearch::Exhaustive(limit)] {
                let probe = dev.lt_probe(shape, search)?;
                let mut t = Vec::with_capacity(probe.infos().len());
                for i in 0..probe.infos().len() {
                    let dram = 1e3
                        * time_ms_back_to_back(&dev, 2, 10, |j| {
                            dev.lt_probe_launch(&probe, i, &x, &ws[j % copies], &mut out)
                        })?;
                    let l2 = 1e3 * time_ms(&dev, 1, 5, |_| dev.lt_probe_launch(&probe, i, &x, &ws[0], &mut out))?;
                    let mut fl = Vec::with_capacity(5);
                    for _ in 0..5 {
                        dev.stream().memset_zeros(&mut flush)?;
                        let (a, b) = (dev.event()?, dev.event()?);
                        a.record(dev.stream())?;
                        dev.lt_probe_launch(&probe, i, &x, &ws[0], &mut out)?;
                        b.record(dev.stream())?;
                        b.synchronize()?;
                        fl.push(1e3 * f64::from(a.elapsed_ms(&b)?));
                    }
                    t.push(Timed { dram, l2, flushed: common::median(fl) });
                }
                sets.push((probe, t));
            }
            // The reference output: the heuristic's first choice.
            dev.lt_probe_launch(&sets[0].0, 0, &x, &ws[0], &mut out)?;
            let reference = download_f32(&dev, &out, m * n)?;
            let (sk, skt) = &sets[0];
            let (ex, ext) = &sets[1];
            let heur12 = sk.infos().iter().take_while(|a| a.heuristic).count().min(12);
            let tuner = pick(skt, 0..heur12, |t| t.l2).unwrap_or(0);
            let tuner_flushed = pick(skt, 0..heur12, |t| t.flushed).unwrap_or(0);
            let best12 = pick(skt, 0..heur12, |t| t.dram).unwrap_or(0);
            let sk_l2 = pick(skt, 0..skt.len(), |t| t.l2).unwrap_or(0);
            let sk_best = pick(skt, 0..skt.len(), |t| t.dram).unwrap_or(0);
            let ex_l2 = pick(ext, 0..ext.len(), |t| t.l2).unwrap_or(0);
            let ex_best = pick(ext, 0..ext.len(), |t| t.dram).unwrap_or(0);
            let mut diffs = Vec::new();
            for (probe, i) in [(sk, sk_best), (ex, ex_best)] {
                dev.lt_probe_launch(probe, i, &x, &ws[0], &mut out)?;
                diffs.push(rel_diff(&download_f32(&dev, &out, m * n)?, &reference));
            }
            let (best_info, best_us) = if ext[ex_best].dram < skt[sk_best].dram {
                (ex.infos()[ex_best], ext[ex_best].dram)
            } else {
                (sk.infos()[sk_best], skt[sk_best].dram)
            };
            // The DRAM time of each pick: tuner (isolated), tuner (flushed), best of the heuristic's,
            // split-K by isolated timing, best split-K, exhaustive by isolated timing, best
            // exhaustive.
            let picks = [
                skt[tuner].dram,
                skt[tuner_flushed].dram,
                skt[best12].dram,
                skt[sk_l2].dram,
                skt[sk_best].dram,
                ext[ex_l2].dram,
                ext[ex_best].dram,
            ];
            writeln!(
                table,
                " {name:8} {m:4} {floor:6.1} {engine:7.1} {:11.1} {:16.1} {:7.1} {:11.1} {:12.1} {:8.1} {:9.1} {:6} {:5}  {best_info} ({:.0} % of floor)",
                picks[0],
                picks[1],
                picks[2],
                picks[3],
                picks[4],
                picks[5],
                picks[6],
                skt.len(),
                ext.len(),
                100.0 * floor / best_us,
            )
            .ok();
            // Each row as it is measured (a timeout keeps what ran).
            print!("{table}");
            table.clear();
            let cfgs = |p: &baton_kernels::cuda::LtProbe, t: &[Timed]| {
                p.infos()
                    .iter()
                    .zip(t)
                    .map(|(a, t)| {
                        format!(
                            "{{\"config\":\"{a}\",\"dram_us\":{:.2},\"l2_us\":{:.2},\"flushed_us\":{:.2}}}",
                            t.dram, t.l2, t.flushed
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            };
            json.push(format!(
                "{{\"shape\":\"{name}\",\"m\":{m},\"n\":{n},\"k\":{k},\"bytes\":{bytes},\"floor_us\":{floor:.2},\"engine_us\":{engine:.2},\"tuner12_l2_pick_us\":{:.2},\"tuner12_flushed_pick_us\":{:.2},\"best12_us\":{:.2},\"splitk_l2_pick_us\":{:.2},\"splitk_best_us\":{:.2},\"exhaustive_l2_pick_us\":{:.2},\"exhaustive_best_us\":{:.2},\"best_config\":\"{best_info}\",\"rel_diff_splitk_best\":{:.2e},\"rel_diff_exhaustive_best\":{:.2e},\"splitk\":[{}],\"exhaustive\":[{}]}}",
                picks[0],
                picks[1],
                picks[2],
                picks[3],
                picks[4],
                picks[5],
                picks[6],
                diffs[0],
                diffs[1],
                cfgs(sk, skt),
                cfgs(ex, ext),
            ));
        }
    }
    print!("{table}");
    common::write_results(
        &dev,
        &out_path,
        "cuda_bench_lt",
        &commit,
        &args,
        &format!("\"copy_gb_s\":{copy_gbs:.1},"),
        &json,
    )
}
