//! Decode attention with a sliding window (a benchmark program, not a test), at the
//! Gemma-3-12B shape (16 query heads, 8 KV heads, head_dim 256, block size 16, bf16 cache,
//! window 1,024): per batch and context, the tuned kernel over the whole context (a global
//! layer), the tuned kernel with the window (`AttentionOptions::window`: a sliding layer),
//! and the window/soft-cap/sinks kernel that sliding layers took before (`AttentionExtCall`).
//!
//! Fewest bytes: every K and V element a row reads once (`min(ctx, window)` tokens with the
//! window), plus q and out; the floor is that over the copy bandwidth measured first. The
//! windowed outputs of both kernels are compared (rel diff, bf16: ~1e-3). Times are medians of
//! CUDA-event-timed repeats after warm-up; K/V sets rotate so that no timing is served from L2
//! (a windowed row at batch 1 reads 8 MB); each figure is also timed as 20 calls queued back to
//! back (`us_back_to_back`: no host launch latency, as inside a captured step).
//!
//! Numbers before measuring (H100, ~2,990 GB/s copy): one row reads 2 × 8 KV heads × 256 × 2 B
//! = 8 KiB a token, so at ctx 8,192 a global row is 67 MB and a windowed one 8.4 MB; at batch
//! 16 the floors are 359 µs and 45 µs (8×). The tuned kernel reached 71-86 % of copy at the
//! Llama shape (hd 128), so expect ~420-500 µs global and, with the window, the same fraction
//! of 45 µs at large batches (less at batch 1, where 1,024 tokens × 8 KV heads make only ~128
//! CTAs). The extended kernel runs one CTA per (row, query head), so each K/V row is read once
//! per query head of its group (twice here) and one token per warp step: expect it several
//! times slower than the tuned windowed kernel.
//!
//! Usage: `cuda_bench_window OUT.json [COMMIT [B:CTX,...]]` (B:CTX: only those decode shapes);
//! prints a table and writes every figure as JSON.

use baton_kernels::cuda::{
    AttentionCall, AttentionExtCall, AttentionOptions, AttnKernel, AttnSplit, CudaDevice, CudaError, CudaOptions,
    CudaSlice, KvCacheRef, StepMeta, bf16,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::fmt::Write as _;

mod common;
use common::{download_f32, rel_diff, time_ms_both};

fn random_bf16(dev: &CudaDevice, r: &mut StdRng, n: usize) -> Result<CudaSlice<bf16>, CudaError> {
    let tile: Vec<bf16> = (0..n.min(1 << 24)).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
    common::tiled(dev, &tile, n)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench_window: {e}");
        std::process::exit(1);
    }
}

/// Which kernel, and whether it attends within the window.
#[derive(Clone, Copy)]
enum Mode {
    TunedGlobal,
    TunedWindow,
    ExtWindow,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Self::TunedGlobal => "tuned global",
            Self::TunedWindow => "tuned window",
            Self::ExtWindow => "ext window",
        }
    }
}

fn run() -> Result<(), CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let out_path = args.get(1).cloned().unwrap_or_else(|| "cuda_bench_window.json".into());
    let commit = args.get(2).cloned().unwrap_or_default();
    let dev = CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: None, ..Default::default() })?;
    let mut r = StdRng::seed_from_u64(0x5eed);
    let mut table = String::new();
    let mut json = Vec::new();
    println!("device {} ({})", dev.name(), dev.arch());

    let (_, copy_gbs) = common::copy_bandwidth(&dev, &mut r)?;
    writeln!(table, "copy 1 GiB d2d: {copy_gbs:.0} GB/s (read+write)").ok();
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"gb_s\":{copy_gbs:.1}}}"));

    let (nh, nkv, hd, bs, window) = (16usize, 8usize, 256usize, 16usize, 1024usize);
    let scale = 1.0 / (hd as f32).sqrt();
    writeln!(
        table,
        "\ndecode attention, Gemma-3-12B shape (16/8 heads, hd 256, bs 16), window {window}, Auto splits\n mode          batch   ctx      us  floor us  %floor  rel diff (window: tuned vs ext)"
    )
    .ok();
    let shapes = match args.get(3) {
        Some(list) => common::decode_shapes(list)?,
        None => vec![(1, 8192), (8, 8192), (16, 8192), (32, 8192), (64, 8192), (1, 32768), (16, 32768)],
    };
    for &(batch, ctx) in &shapes {
        let common::DecodeSets { geo, mut metas, copies } =
            common::decode_sets(&dev, &mut r, (batch, ctx), (bs, nkv, hd), 2)?;
        let kc = random_bf16(&dev, &mut r, geo.layer_len())?;
        let vc = random_bf16(&dev, &mut r, geo.layer_len())?;
        let q = random_bf16(&dev, &mut r, batch * nh * hd)?;
        let mut o = dev.alloc::<bf16>(batch * nh * hd)?;
        let attention = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, mode: Mode| match mode {
            Mode::TunedGlobal | Mode::TunedWindow => {
                let window = matches!(mode, Mode::TunedWindow).then_some(window);
                AttentionCall {
                    q: &q,
                    cache: KvCacheRef::Bf16 { k: &kc, v: &vc },
                    meta,
                    n_heads: nh,
                    geo,
                    scale,
                    out,
                    kernel: AttnKernel::DECODE,
                    split: AttnSplit::Auto,
                    options: AttentionOptions { window, ..Default::default() },
                }
                .launch(&dev)
            }
            Mode::ExtWindow => AttentionExtCall {
                q: &q,
                k_cache: &kc,
                v_cache: &vc,
                meta,
                n_heads: nh,
                geo,
                scale,
                window: Some(window),
                softcap: None,
                sinks: None,
                out,
            }
            .launch(&dev),
        };
        attention(&mut metas[0], &mut o, Mode::ExtWindow)?;
        let reference = download_f32(&dev, &o, batch * nh * hd)?;
        for mode in [Mode::TunedGlobal, Mode::TunedWindow, Mode::ExtWindow] {
            let read = if matches!(mode, Mode::TunedGlobal) { ctx } else { ctx.min(window) };
            let bytes = (2 * batch * read * nkv * hd + 2 * batch * nh * hd) * 2;
            let floor_us = bytes as f64 / (copy_gbs * 1e9) * 1e6;
            let (ms, b2b) = time_ms_both(&dev, 3, 20, |i| attention(&mut metas[i % copies], &mut o, mode))?;
            let (us, us_b2b) = (1e3 * ms, 1e3 * b2b);
            attention(&mut metas[0], &mut o, mode)?;
            let diff = match mode {
                Mode::TunedWindow => rel_diff(&download_f32(&dev, &o, batch * nh * hd)?, &reference),
                _ => f64::NAN,
            };
            let diff_txt = if diff.is_nan() { "-".to_string() } else { format!("{diff:.1e}") };
            writeln!(
                table,
                " {:13} {batch:5} {ctx:5} {us:8.1} {floor_us:8.1} {:6.1}%  {diff_txt} | back to back {us_b2b:8.1} {:6.1}%",
                mode.label(),
                100.0 * floor_us / us,
                100.0 * floor_us / us_b2b
            )
            .ok();
            json.push(format!(
                "{{\"name\":\"decode_attention_window\",\"mode\":{:?},\"batch\":{batch},\"ctx\":{ctx},\"window\":{window},\"n_heads\":{nh},\"n_kv_heads\":{nkv},\"head_dim\":{hd},\"us\":{us:.2},\"min_bytes\":{bytes},\"floor_us\":{floor_us:.2},\"us_back_to_back\":{us_b2b:.2},\"rel_diff_vs_ext\":{}}}",
                mode.label(),
                if diff.is_nan() { "null".to_string() } else { format!("{diff:.2e}") }
            ));
        }
    }

    common::write_results(&dev, &out_path, "cuda-attention-window", &commit, &args, "", &json)?;
    println!("{table}");
    Ok(())
}
