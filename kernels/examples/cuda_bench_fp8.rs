//! The tuned attention kernels over an FP8 (E4M3) KV cache beside the same kernels over a bf16
//! cache holding the same values, in one run (a benchmark program, not a test).
//!
//! Decode attention at the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, block
//! size 16) for several batches and contexts: every FP8 variant and the bf16 default, split
//! `Auto`. Fewest bytes = every cached K and V element of every sequence read once (1 byte
//! FP8, 2 bytes bf16) plus q and out; the figure is that over the time, as a share of the
//! device-to-device copy bandwidth measured first. Pools are replicated (one block-table set
//! per copy, used in turn) so that no timing is served from L2. Per shape, the default FP8
//! variant and the bf16 default also run at fixed split counts (1 = one launch, no combine).
//! Every decode figure is timed twice: each call from an idle stream (`us`, as before), and 20
//! calls queued back to back (`us_back_to_back`, the mean: no host launch latency, as inside a
//! captured step).
//!
//! Prefill attention (one sequence of S tokens, causal) through the router (`Mixed`), FP8 and
//! bf16: causal FLOPs = 2 · S² · head_dim · heads.
//!
//! Both caches hold the same values: random E4M3 codes (scales 1, no NaN code) and their bf16
//! images (exact), so each FP8 output's relative difference from the bf16 default's output is
//! printed as a check of what was timed (the prefill kernels round only where the bf16 path
//! does; the FP8 decode kernel rounds the softmax weights to f16 where bf16 rounds to bf16).
//!
//! Usage: `cuda_bench_fp8 OUT.json [COMMIT [B:CTX,...]]` (B:CTX: only those decode shapes); prints a
//! table and writes every figure as JSON.

use baton_kernels::cpu::fp8::e4m3_to_f32;
use baton_kernels::cuda::{
    ATTN_FP8_VARIANTS, AttentionCall, AttentionOptions, AttnKernel, AttnSplit, CudaDevice, CudaError, CudaOptions,
    CudaSlice, DecodeShape, HostSeq, KvCacheRef, KvGeometry, StepMeta, attn_default, attn_fp8_default,
    attn_stream_default, bf16,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::fmt::Write as _;

mod common;
use common::{tiled, time_ms, time_ms_both};

/// A K or V layer of `n` values as E4M3 codes and as their exact bf16 images.
struct TwinCache {
    codes: CudaSlice<u8>,
    bf16: CudaSlice<bf16>,
}

fn twin(dev: &CudaDevice, r: &mut StdRng, n: usize) -> Result<TwinCache, CudaError> {
    // Sign and an exponent field below 7: |value| < 1, no NaN code.
    let codes: Vec<u8> = (0..n.min(1 << 24)).map(|_| r.random::<u8>() & 0xb7).collect();
    let images: Vec<bf16> = codes.iter().map(|&c| bf16::from_f32(e4m3_to_f32(c))).collect();
    Ok(TwinCache { codes: tiled(dev, &codes, n)?, bf16: tiled(dev, &images, n)? })
}

fn random_q(dev: &CudaDevice, r: &mut StdRng, n: usize) -> Result<CudaSlice<bf16>, CudaError> {
    let v: Vec<bf16> = (0..n).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
    dev.upload(&v)
}

/// ‖a − b‖ / ‖b‖ over the first `n` values of two bf16 outputs.
fn rel_diff(dev: &CudaDevice, a: &CudaSlice<bf16>, b: &CudaSlice<bf16>, n: usize) -> Result<f64, CudaError> {
    Ok(common::rel_diff(&common::download_f32(dev, a, n)?, &common::download_f32(dev, b, n)?))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench_fp8 failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let out_path = args.get(1).cloned().unwrap_or_else(|| "cuda_bench_fp8.json".into());
    let commit = args.get(2).cloned().unwrap_or_default();
    // Optional `B:CTX[,B:CTX...]`: only those decode shapes (for a profiler run of one launch,
    // or shapes off the default list).
    let only = args.get(3).map(|list| common::decode_shapes(list)).transpose()?;
    let dev = CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: None, ..Default::default() })?;
    let mut r = StdRng::seed_from_u64(0xf8);
    let mut table = String::new();
    let mut json = Vec::new();

    let (_, copy_gbs) = common::copy_bandwidth(&dev, &mut r)?;
    writeln!(table, "device {}; copy 1 GiB d2d: {copy_gbs:.0} GB/s (read+write)", dev.name()).ok();
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"gb_s\":{copy_gbs:.1}}}"));

    let (nh, nkv, hd, bs) = (32usize, 8usize, 128usize, 16usize);
    let scale = 1.0 / (hd as f32).sqrt();
    writeln!(
        table,
        "\ndecode attention (32/8 heads, hd 128, bs 16, split auto); * = default FP8 variant\n cache variant      batch   ctx      us    GB/s  %copy  vs bf16  rel diff"
    )
    .ok();
    let shapes = only
        .unwrap_or_else(|| vec![(1, 8192), (8, 4096), (32, 2048), (32, 8192), (64, 2048), (128, 4096), (256, 1024)]);
    for &(batch, ctx) in &shapes {
        let common::DecodeSets { geo, mut metas, copies } =
            common::decode_sets(&dev, &mut r, (batch, ctx), (bs, nkv, hd), 1)?;
        let (k, v) = (twin(&dev, &mut r, geo.layer_len())?, twin(&dev, &mut r, geo.layer_len())?);
        let q = random_q(&dev, &mut r, batch * nh * hd)?;
        let len = batch * nh * hd;
        let (mut o_ref, mut o) = (dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?);
        let bf16_cache = KvCacheRef::Bf16 { k: &k.bf16, v: &v.bf16 };
        let fp8_cache = KvCacheRef::Fp8 { k: &k.codes, v: &v.codes, k_scale: 1.0, v_scale: 1.0 };
        let attention_split = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, cache, variant, split| {
            let kernel = AttnKernel::Decode { variant };
            AttentionCall {
                q: &q,
                cache,
                meta,
                n_heads: nh,
                geo,
                scale,
                out,
                kernel,
                split,
                options: AttentionOptions::default(),
            }
            .launch(&dev)
        };
        let attention = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, cache, variant| {
            attention_split(meta, out, cache, variant, AttnSplit::Auto)
        };
        let (bf16_ms, bf16_b2b) =
            time_ms_both(&dev, 3, 20, |i| attention(&mut metas[i % copies], &mut o_ref, bf16_cache, None))?;
        attention(&mut metas[0], &mut o_ref, bf16_cache, None)?;
        // The default FP8 variant of this launch (the streaming kernel from 8 rows on sm_90).
        let shape = DecodeShape { rows: batch, n_heads: nh, n_kv_heads: nkv, head_dim: hd, fp8: true };
        let fp8_default = attn_default(&shape, dev.stream_attention());
        // Where the split count matters: the FP8 tensor-core and streaming defaults at fixed
        // splits (what `Auto` would choose is in the rows below).
        for (name, vi) in [("tc", attn_fp8_default(nh / nkv)), ("st", attn_stream_default(nh / nkv, true))] {
            let mut sweep = Vec::new();
            for n in [1usize, 2, 4, 8, 16, 32, 64] {
                let split = AttnSplit::Fixed(n);
                let v = Some(vi);
                let (ms, b2b) = time_ms_both(&dev, 3, 20, |i| {
                    attention_split(&mut metas[i % copies], &mut o, fp8_cache, v, split)
                })?;
                sweep.push(format!("{n}:{:.1}/{:.1}", ms * 1e3, b2b * 1e3));
                json.push(format!(
                    "{{\"name\":\"decode_attention_fp8_split\",\"kernel\":\"{name}\",\"batch\":{batch},\"ctx\":{ctx},\"fixed_splits\":{n},\"us\":{:.2},\"us_back_to_back\":{:.2}}}",
                    ms * 1e3,
                    b2b * 1e3
                ));
            }
            writeln!(
                table,
                " fp8 {name} at fixed splits (splits:us isolated/back to back) b={batch} ctx={ctx}: {}",
                sweep.join(" ")
            )
            .ok();
        }
        // The bf16 default at the same fixed splits (1 = no combine launch).
        let mut sweep = Vec::new();
        for n in [1usize, 2, 4, 8, 16, 32, 64] {
            let split = AttnSplit::Fixed(n);
            let (ms, b2b) = time_ms_both(&dev, 3, 20, |i| {
                attention_split(&mut metas[i % copies], &mut o, bf16_cache, None, split)
            })?;
            sweep.push(format!("{n}:{:.1}/{:.1}", ms * 1e3, b2b * 1e3));
            json.push(format!(
                "{{\"name\":\"decode_attention_bf16_split\",\"batch\":{batch},\"ctx\":{ctx},\"fixed_splits\":{n},\"us\":{:.2},\"us_back_to_back\":{:.2}}}",
                ms * 1e3,
                b2b * 1e3
            ));
        }
        writeln!(
            table,
            " bf16 default at fixed splits (splits:us isolated/back to back) b={batch} ctx={ctx}: {}",
            sweep.join(" ")
        )
        .ok();
        let qo_bytes = 2 * len * 2;
        let kv_values = 2 * batch * ctx * nkv * hd;
        let mut rows =
            vec![("bf16".to_string(), "default".to_string(), bf16_ms, bf16_b2b, kv_values * 2 + qo_bytes, 0.0)];
        for (vi, var) in ATTN_FP8_VARIANTS.iter().enumerate() {
            let (ms, b2b) =
                time_ms_both(&dev, 3, 20, |i| attention(&mut metas[i % copies], &mut o, fp8_cache, Some(vi)))?;
            attention(&mut metas[0], &mut o, fp8_cache, Some(vi))?;
            let mark = if vi == fp8_default { "*" } else { "" };
            rows.push((
                "fp8".into(),
                format!("{}{mark}", var.label()),
                ms,
                b2b,
                kv_values + qo_bytes,
                rel_diff(&dev, &o, &o_ref, len)?,
            ));
        }
        for (cache, variant, ms, b2b, bytes, diff) in rows {
            let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
            let gbs_b2b = bytes as f64 / (b2b * 1e-3) / 1e9;
            writeln!(
                table,
                " {cache:5} {variant:12} {batch:5} {ctx:5} {:7.1} {gbs:7.0} {:5.1}%  {:5.2}x  {diff:.1e} | back to back {:7.1} {:5.1}%",
                ms * 1e3,
                100.0 * gbs / copy_gbs,
                bf16_ms / ms,
                b2b * 1e3,
                100.0 * gbs_b2b / copy_gbs
            )
            .ok();
            json.push(format!(
                "{{\"name\":\"decode_attention\",\"cache\":\"{cache}\",\"variant\":\"{}\",\"default\":{},\"batch\":{batch},\"ctx\":{ctx},\"us\":{:.2},\"min_bytes\":{bytes},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4},\"speed_vs_bf16\":{:.4},\"rel_diff_vs_bf16\":{diff:.2e},\"us_back_to_back\":{:.2},\"frac_of_copy_back_to_back\":{:.4}}}",
                variant.trim_end_matches('*'),
                variant.ends_with('*') || cache == "bf16",
                ms * 1e3,
                gbs / copy_gbs,
                bf16_ms / ms,
                b2b * 1e3,
                gbs_b2b / copy_gbs
            ));
        }
    }

    writeln!(
        table,
        "\nprefill attention through the router (one sequence, causal, 32/8 heads, hd 128, bs 16)\n cache     S        us  TFLOP/s  vs bf16  rel diff"
    )
    .ok();
    for &s in &[512usize, 2048, 8192] {
        let blocks = s.div_ceil(bs);
        let geo = KvGeometry { num_blocks: blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let (k, v) = (twin(&dev, &mut r, geo.layer_len())?, twin(&dev, &mut r, geo.layer_len())?);
        let mut bt: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..bt.len()).rev() {
            bt.swap(i, r.random_range(0..=i));
        }
        let mut meta = StepMeta::new(&dev)?;
        meta.set(&dev, &[HostSeq { row_start: 0, n_tokens: s, start_pos: 0, block_table: &bt }], s, bs, blocks)?;
        let len = s * nh * hd;
        let q = random_q(&dev, &mut r, len)?;
        let (mut o_ref, mut o) = (dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?);
        let mut run = |cache, out: &mut CudaSlice<bf16>| {
            time_ms(&dev, 3, 20, |_| {
                let (kernel, split) = (AttnKernel::Mixed, AttnSplit::Auto);
                AttentionCall {
                    q: &q,
                    cache,
                    meta: &mut meta,
                    n_heads: nh,
                    geo,
                    scale,
                    out: &mut *out,
                    kernel,
                    split,
                    options: AttentionOptions::default(),
                }
                .launch(&dev)
            })
        };
        let bf16_ms = run(KvCacheRef::Bf16 { k: &k.bf16, v: &v.bf16 }, &mut o_ref)?;
        let fp8_ms = run(KvCacheRef::Fp8 { k: &k.codes, v: &v.codes, k_scale: 1.0, v_scale: 1.0 }, &mut o)?;
        let diff = rel_diff(&dev, &o, &o_ref, len)?;
        let flops = 4.0 * (s as f64).powi(2) * (hd * nh) as f64 / 2.0;
        for (cache, ms, d) in [("bf16", bf16_ms, 0.0), ("fp8", fp8_ms, diff)] {
            let tf = flops / (ms * 1e-3) / 1e12;
            writeln!(table, " {cache:5} {s:5} {:9.1} {tf:8.1}  {:5.2}x  {d:.1e}", ms * 1e3, bf16_ms / ms).ok();
            json.push(format!(
                "{{\"name\":\"prefill_attention\",\"cache\":\"{cache}\",\"seq\":{s},\"us\":{:.2},\"tflop_s\":{tf:.2},\"speed_vs_bf16\":{:.4},\"rel_diff_vs_bf16\":{d:.2e}}}",
                ms * 1e3,
                bf16_ms / ms
            ));
        }
    }

    common::write_results(&dev, &out_path, "cuda-fp8-attention", &commit, &args, "", &json)?;
    println!("{table}");
    Ok(())
}
