//! First measurements of the CUDA kernels (a benchmark program, not a test):
//!
//! 1. the device-to-device copy bandwidth (the ceiling), counting bytes read plus written;
//! 2. paged decode attention at the Llama-3.1-8B shape (32 query heads, 8 KV heads,
//!    head_dim 128, block size 16, bf16 cache) for several batches and context lengths;
//!    fewest bytes = every K and V element of every sequence read once, plus q and out;
//!    FLOPs = 4 · batch · heads · ctx · head_dim; each shape under the carve-out a decode step
//!    of that shape pins (`step_carveout`: the engine's rule on a Llama-family model), so a
//!    figure here is the kernel as it runs inside the step (split counts planned in the pinned
//!    share), with `carveout_pin` in its JSON;
//! 3. the bf16 GEMM (cuBLAS, our `linear`) at the model's decode shapes, with the weight
//!    bytes as the fewest bytes (`M · K + N · K + M · N` elements) and `2 · M · N · K` FLOPs,
//!    and for M ≤ 16 every variant of the skinny GEMM (`gemv`) on the same inputs, with its
//!    speed-up over cuBLAS and its output's relative difference from cuBLAS's; plus one 8192³
//!    product as the matrix-unit ceiling;
//! 4. prefill attention at the Llama-3.1-8B shape (one sequence of S tokens, no cached
//!    prefix, causal, 32/8 heads, head_dim 128, block size 16): the tensor-core prefill
//!    kernel (`AttnKernel::Mixed`) and the decode kernel over every row (`AttnKernel::Decode`,
//!    the old path), with causal FLOPs = 4 · S · S · head_dim · n_heads / 2 (the FA2/FA3/torch
//!    convention: the diagonal's extra S · hd · n_heads · 2 terms are ignored).
//!
//! Times are medians of CUDA-event-timed repeats after warm-up; decode attention is also timed
//! as 20 calls queued back to back (`us_back_to_back`, the mean: no host launch latency, as in
//! a captured step). Inputs are random (never
//! zeros); weights rotate among copies so that no shape is served from L2.
//!
//! Usage: `cuda_bench OUT.json [COMMIT] [attention [B:CTX,...]]`; prints a table and writes every
//! figure as JSON. With `attention`, only sections 1 and 2, at the listed decode shapes if given.

use baton_kernels::cuda::{
    ATTN_VARIANTS, AttentionCall, AttentionOptions, AttnKernel, AttnKind, AttnSplit, CudaDevice, CudaError,
    CudaOptions, CudaSlice, DecodeShape, GEMV_KERNEL_MAX_M, GEMV_VARIANTS, HostSeq, KvCacheRef, KvGeometry, LinearCall,
    LinearKernel, PREFILL_DEFAULT_VARIANT, PREFILL_VARIANTS, PREFILL_WGMMA, SplitTarget, StepMeta, attn_default,
    attn_tc_default, bf16, gemv_default, plan_splits, prefill_variant_warps, step_carveout,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::fmt::Write as _;

mod common;
use common::{download_f32, rel_diff, time_ms, time_ms_both};

/// A device buffer of `n` random bf16 values in [-1, 1], built from a 16 Mi-element random
/// tile copied repeatedly (generating gigabytes on the host would dominate the run).
fn random_bf16(dev: &CudaDevice, r: &mut StdRng, n: usize) -> Result<CudaSlice<bf16>, CudaError> {
    let tile: Vec<bf16> = (0..n.min(1 << 24)).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
    common::tiled(dev, &tile, n)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let out_path = args.get(1).cloned().unwrap_or_else(|| "cuda_bench.json".into());
    let commit = args.get(2).cloned().unwrap_or_default();
    let dev = CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: None, ..Default::default() })?;
    let mut r = StdRng::seed_from_u64(0x5eed);
    let mut table = String::new();
    let mut json = Vec::new();
    println!("device {} ({})", dev.name(), dev.arch());

    // 1. Copy bandwidth: 1 GiB source, bytes read + written.
    let (ms, copy_gbs) = common::copy_bandwidth(&dev, &mut r)?;
    writeln!(table, "copy 1 GiB d2d: {ms:.3} ms, {copy_gbs:.0} GB/s (read+write)").ok();
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"ms\":{ms:.4},\"gb_s\":{copy_gbs:.1}}}"));

    // 2. Paged decode attention, Llama-3.1-8B shape. Small pools are replicated (disjoint
    // blocks, one block table set per copy, used in turn) so that no timing is served from L2.
    let (nh, nkv, hd, bs) = (32usize, 8usize, 128usize, 16usize);
    writeln!(
        table,
        "\ndecode attention (32/8 heads, hd 128, bs 16); variant = w(warps)_u(tokens per thread)_g(heads/CTA)_p(prefetch), tc_ = tensor cores with s(stages); split auto|1, * = default\n variant        split batch   ctx     us    GB/s  %copy  TFLOP/s  rel diff | back to back: us %copy"
    )
    .ok();
    // `cuda_bench OUT COMMIT attention B:CTX,...`: only these decode shapes (one, for a profiler).
    let all_shapes = [
        (1usize, 128usize),
        (1, 1024),
        (1, 2048),
        (1, 8192),
        (1, 32768),
        (8, 4096),
        (32, 2048),
        (32, 4096),
        (64, 1024),
        (64, 2048),
        (64, 8192),
        (128, 1024),
        (128, 4096),
        (256, 1024),
    ];
    let shapes = match args.get(4) {
        Some(list) => common::decode_shapes(list)?,
        None => all_shapes.to_vec(),
    };
    for &(batch, ctx) in &shapes {
        let common::DecodeSets { geo, mut metas, copies } =
            common::decode_sets(&dev, &mut r, (batch, ctx), (bs, nkv, hd), 2)?;
        let kc = random_bf16(&dev, &mut r, geo.layer_len())?;
        let vc = random_bf16(&dev, &mut r, geo.layer_len())?;
        let q = random_bf16(&dev, &mut r, batch * nh * hd)?;
        let mut o = dev.alloc::<bf16>(batch * nh * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let bytes = (2 * batch * ctx * nkv * hd + 2 * batch * nh * hd) * 2;
        let flops = 4.0 * (batch * nh * ctx * hd) as f64;
        // What was timed is checked too: each variant's output on the first block-table set
        // against the register kernel's unsplit output (bf16 outputs: expect ~1e-3).
        // Pinned as the step pins it, before the reference, so every launch below runs in it.
        let shape = DecodeShape { rows: batch, n_heads: nh, n_kv_heads: nkv, head_dim: hd, fp8: false };
        let pin = step_carveout(&shape, dev.stream_attention(), true);
        dev.set_step_carveout(pin);
        let pin_json = pin.map_or("null".to_string(), |p| p.to_string());
        writeln!(table, " batch {batch} ctx {ctx}: carve-out pin {}", pin.map_or("none".into(), |p| format!("{p} %")))
            .ok();
        let attention = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, variant, split| {
            let kernel = AttnKernel::Decode { variant: Some(variant) };
            AttentionCall {
                q: &q,
                cache: KvCacheRef::Bf16 { k: &kc, v: &vc },
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
        attention(&mut metas[0], &mut o, 0, AttnSplit::Fixed(1))?;
        let reference = download_f32(&dev, &o, batch * nh * hd)?;
        for (vi, v) in ATTN_VARIANTS.iter().enumerate() {
            // The default variant also at fixed split counts, to see where Auto's choice sits.
            let mut splits_to_time = vec![AttnSplit::Auto, AttnSplit::Fixed(1)];
            // Likewise the first streaming variant.
            let first_stream = ATTN_VARIANTS.iter().position(|v| v.kind == AttnKind::Stream);
            let default = attn_default(&shape, dev.stream_attention());
            if vi == default || vi == attn_tc_default(nh / nkv) || Some(vi) == first_stream {
                splits_to_time.extend([2, 4, 16, 32, 64, 128].map(AttnSplit::Fixed));
            }
            for split in splits_to_time {
                let (ms, b2b) = time_ms_both(&dev, 3, 20, |i| attention(&mut metas[i % copies], &mut o, vi, split))?;
                attention(&mut metas[0], &mut o, vi, split)?;
                let diff = rel_diff(&download_f32(&dev, &o, batch * nh * hd)?, &reference);
                let x = v.ctas_per_row(nh, nkv, hd);
                let target = SplitTarget::for_variant(v, nkv, hd, false, dev.attention_split_smem());
                let (splits, _) = plan_splits(split, x * batch, ctx, dev.sm_count(), target);
                let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
                let gbs_b2b = bytes as f64 / (b2b * 1e-3) / 1e9;
                let tf = flops / (ms * 1e-3) / 1e12;
                let mark = if vi == default && split == AttnSplit::Auto { '*' } else { ' ' };
                let tag = format!("{}{mark}", v.label());
                writeln!(
                    table,
                    " {tag:13} {splits:5} {batch:5} {ctx:5} {:7.1} {gbs:7.0} {:5.1}% {tf:7.2}  {diff:.1e} | {:7.1} {:5.1}%",
                    ms * 1e3,
                    100.0 * gbs / copy_gbs,
                    b2b * 1e3,
                    100.0 * gbs_b2b / copy_gbs
                )
                .ok();
                json.push(format!(
                    "{{\"name\":\"decode_attention\",\"variant\":\"{}\",\"splits\":{splits},\"default\":{},\"batch\":{batch},\"ctx\":{ctx},\"n_heads\":{nh},\"n_kv_heads\":{nkv},\"head_dim\":{hd},\"block_size\":{bs},\"carveout_pin\":{pin_json},\"us\":{:.2},\"min_bytes\":{bytes},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4},\"tflop_s\":{tf:.3},\"rel_diff_vs_reg_unsplit\":{diff:.2e},\"us_back_to_back\":{:.2},\"frac_of_copy_back_to_back\":{:.4}}}",
                    v.label(),
                    mark == '*',
                    ms * 1e3,
                    gbs / copy_gbs,
                    b2b * 1e3,
                    gbs_b2b / copy_gbs
                ));
            }
        }
    }

    // The later sections measure each launch under its own carve-out, as before.
    dev.set_step_carveout(None);

    if args.get(3).is_some_and(|a| a == "attention") {
        let (cms, cached) = dev.module_load();
        let extra = format!("\"module_load_ms\":{cms:.1},\"module_from_cache\":{cached},");
        common::write_results(&dev, &out_path, "cuda-kernels-attention", &commit, &args, &extra, &json)?;
        println!("{table}");
        return Ok(());
    }

    // 3. GEMM at the decode shapes (N, K) of Llama-3.1-8B: cuBLAS for every M, and for
    // M ≤ GEMV_KERNEL_MAX_M every variant of the skinny GEMM next to it (bf16 out; the LM head
    // also with f32 out, as the engine runs it), with its relative difference from cuBLAS's
    // output as a sanity check of what was timed.
    writeln!(
        table,
        "\nGEMM bf16 out = x·Wᵀ: cuBLAS, and gemv variant (warps, k-steps) with * = default\n shape          M kernel        us  TFLOP/s  weight GB/s  %copy  vs cuBLAS  rel diff"
    )
    .ok();
    let shapes = [
        ("qkv", 6144usize, 4096usize),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ];
    for &(name, nn, k) in &shapes {
        // Enough weight copies to exceed ~256 MB so successive calls miss L2.
        let copies = (256usize << 20).div_ceil(nn * k * 2).clamp(1, 8);
        let ws: Vec<CudaSlice<bf16>> =
            (0..copies).map(|_| random_bf16(&dev, &mut r, nn * k)).collect::<Result<_, _>>()?;
        for &m in &[1usize, 2, 4, 8, 16, 32, 128, 256] {
            let x = random_bf16(&dev, &mut r, m * k)?;
            let mut o = dev.alloc::<bf16>(m * nn)?;
            let flops = 2.0 * (m * nn * k) as f64;
            let bytes = ((m * k + nn * k + m * nn) * 2) as f64;
            let linear = |w: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>, kernel| {
                LinearCall { x: &x, m, k, w, n: nn, out, kernel }.launch(&dev)
            };
            let ms = time_ms(&dev, 3, 20, |i| linear(&ws[i % copies], &mut o, LinearKernel::Cublas))?;
            let mut row = |kernel: &str, ms: f64, cublas_ms: f64, diff: Option<f64>| {
                let tf = flops / (ms * 1e-3) / 1e12;
                let gbs = bytes / (ms * 1e-3) / 1e9;
                let d = diff.map(|d| format!("{d:.1e}")).unwrap_or_default();
                writeln!(
                    table,
                    " {name:8} {m:7} {kernel:10} {:7.1} {tf:8.1} {gbs:12.0} {:5.1}% {:9.2}x {d:>9}",
                    ms * 1e3,
                    100.0 * gbs / copy_gbs,
                    cublas_ms / ms
                )
                .ok();
                (tf, gbs)
            };
            let (tf, gbs) = row("cublas", ms, ms, None);
            json.push(format!(
                "{{\"name\":\"gemm\",\"shape\":\"{name}\",\"m\":{m},\"n\":{nn},\"k\":{k},\"us\":{:.2},\"tflop_s\":{tf:.2},\"min_bytes\":{bytes},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4}}}",
                ms * 1e3,
                gbs / copy_gbs
            ));
            if m > GEMV_KERNEL_MAX_M {
                continue;
            }
            let reference = download_f32(&dev, &o, m * nn)?;
            let default = gemv_default(nn, dev.sm_count());
            for (vi, v) in GEMV_VARIANTS.iter().enumerate() {
                let kernel = LinearKernel::Gemv { variant: Some(vi) };
                let gms = time_ms(&dev, 3, 20, |i| linear(&ws[i % copies], &mut o, kernel))?;
                let diff = rel_diff(&download_f32(&dev, &o, m * nn)?, &reference);
                let mark = if vi == default { "*" } else { "" };
                let (tf, gbs) = row(&format!("gemv({},{}){mark}", v.warps, v.unroll), gms, ms, Some(diff));
                json.push(format!(
                    "{{\"name\":\"gemv\",\"shape\":\"{name}\",\"m\":{m},\"n\":{nn},\"k\":{k},\"out\":\"bf16\",\"variant\":\"w{}_u{}\",\"default\":{},\"us\":{:.2},\"tflop_s\":{tf:.2},\"min_bytes\":{bytes},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4},\"cublas_us\":{:.2},\"speedup_vs_cublas\":{:.3},\"rel_diff_vs_cublas\":{diff:.2e}}}",
                    v.warps,
                    v.unroll,
                    vi == default,
                    gms * 1e3,
                    gbs / copy_gbs,
                    ms * 1e3,
                    ms / gms
                ));
            }
            if name == "lm_head" {
                // The engine's LM head: f32 logits, cuBLAS vs the default gemv variant.
                let mut o32 = dev.alloc::<f32>(m * nn)?;
                let cms = time_ms(&dev, 3, 20, |i| {
                    LinearCall { x: &x, m, k, w: &ws[i % copies], n: nn, out: &mut o32, kernel: LinearKernel::Cublas }
                        .launch(&dev)
                })?;
                row("cublas f32", cms, cms, None);
                let reference = dev.download(&o32, m * nn)?;
                let gms = time_ms(&dev, 3, 20, |i| {
                    LinearCall { x: &x, m, k, w: &ws[i % copies], n: nn, out: &mut o32, kernel: LinearKernel::GEMV }
                        .launch(&dev)
                })?;
                let diff = rel_diff(&dev.download(&o32, m * nn)?, &reference);
                let (tf, gbs) = row("gemv f32*", gms, cms, Some(diff));
                let v = GEMV_VARIANTS[default];
                json.push(format!(
                    "{{\"name\":\"gemv\",\"shape\":\"{name}\",\"m\":{m},\"n\":{nn},\"k\":{k},\"out\":\"f32\",\"variant\":\"w{}_u{}\",\"default\":true,\"us\":{:.2},\"tflop_s\":{tf:.2},\"min_bytes\":{bytes},\"gb_s\":{gbs:.1},\"frac_of_copy\":{:.4},\"cublas_us\":{:.2},\"speedup_vs_cublas\":{:.3},\"rel_diff_vs_cublas\":{diff:.2e}}}",
                    v.warps,
                    v.unroll,
                    gms * 1e3,
                    gbs / copy_gbs,
                    cms * 1e3,
                    cms / gms
                ));
            }
        }
    }
    prefill_section(&dev, &mut r, &mut table, &mut json)?;

    let big = 8192usize;
    let a = random_bf16(&dev, &mut r, big * big)?;
    let b = random_bf16(&dev, &mut r, big * big)?;
    let mut c = dev.alloc::<bf16>(big * big)?;
    let ms = time_ms(&dev, 3, 10, |_| {
        LinearCall { x: &a, m: big, k: big, w: &b, n: big, out: &mut c, kernel: LinearKernel::Cublas }.launch(&dev)
    })?;
    let tf = 2.0 * (big as f64).powi(3) / (ms * 1e-3) / 1e12;
    writeln!(table, " 8192^3 ceiling: {ms:.3} ms, {tf:.0} TFLOP/s").ok();
    json.push(format!("{{\"name\":\"gemm_8192_cubed\",\"ms\":{ms:.4},\"tflop_s\":{tf:.1}}}"));

    let (cms, cached) = dev.module_load();
    let extra = format!("\"module_load_ms\":{cms:.1},\"module_from_cache\":{cached},");
    common::write_results(&dev, &out_path, "cuda-kernels", &commit, &args, &extra, &json)?;
    println!("{table}");
    Ok(())
}

/// Section 4: prefill attention, new kernel vs the decode kernel over every row.
///
/// Two numbers at S = 4096 (32/8 heads, hd 128): FLOPs = 4 · 4096² · 128 · 32 / 2 = 137.4 G;
/// fewest bytes = q + out (2 · 4096 · 32 · 128 · 2 B = 67.1 MB) + K + V (2 · 4096 · 8 · 128 · 2 B
/// = 16.8 MB) = 83.9 MB. At the measured 780 TFLOP/s (cuBLAS 8192³, H200) the arithmetic
/// takes 176 µs; the bytes at ~4 TB/s take 21 µs: the FLOPs are the floor (compute-bound by
/// ~8×). No input rotation: the call is compute-bound, and from S = 4096 its working set
/// (84 MB) exceeds L2 anyway; K/V re-reads across query tiles are meant to hit L2.
fn prefill_section(
    dev: &CudaDevice,
    r: &mut StdRng,
    table: &mut String,
    json: &mut Vec<String>,
) -> Result<(), CudaError> {
    let (nh, nkv, hd, bs) = (32usize, 8usize, 128usize, 16usize);
    writeln!(
        table,
        "\nprefill attention (one sequence, no prefix, causal, 32/8 heads, hd 128, bs 16); FLOPs = 2·S²·hd·heads; * = router default\n     S kernel                us  TFLOP/s  rel diff vs decode kernel"
    )
    .ok();
    for &s in &[512usize, 2048, 4096, 8192] {
        let blocks = s.div_ceil(bs);
        let num_blocks = blocks + 3;
        let geo = KvGeometry { num_blocks, block_size: bs, n_kv_heads: nkv, head_dim: hd };
        let kc = random_bf16(dev, r, geo.layer_len())?;
        let vc = random_bf16(dev, r, geo.layer_len())?;
        let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, r.random_range(0..=i));
        }
        let bt = pool[..blocks].to_vec();
        let mut meta = StepMeta::new(dev)?;
        meta.set(dev, &[HostSeq { row_start: 0, n_tokens: s, start_pos: 0, block_table: &bt }], s, bs, num_blocks)?;
        let q = random_bf16(dev, r, s * nh * hd)?;
        let mut o_new = dev.alloc::<bf16>(s * nh * hd)?;
        let mut o_var = dev.alloc::<bf16>(s * nh * hd)?;
        let mut o_old = dev.alloc::<bf16>(s * nh * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let flops = 4.0 * (s as f64) * (s as f64) * (hd * nh) as f64 / 2.0;
        let bytes = (2 * s * nh * hd + 2 * s * nkv * hd) * 2;
        let attention = |meta: &mut StepMeta, out: &mut CudaSlice<bf16>, kernel| {
            let split = AttnSplit::Auto;
            AttentionCall {
                q: &q,
                cache: KvCacheRef::Bf16 { k: &kc, v: &vc },
                meta,
                n_heads: nh,
                geo,
                scale,
                out,
                kernel,
                split,
                options: AttentionOptions::default(),
            }
            .launch(dev)
        };
        let ms_new = time_ms(dev, 3, 20, |_| attention(&mut meta, &mut o_new, AttnKernel::Mixed))?;
        let ms_old = time_ms(dev, 2, 10, |_| attention(&mut meta, &mut o_old, AttnKernel::DECODE))?;
        let n = s * nh * hd;
        let old = download_f32(dev, &o_old, n)?;
        let diff = rel_diff(&download_f32(dev, &o_new, n)?, &old);
        // The router's choice: the warpgroup kernel on Hopper, else the default mma.sync variant.
        let routed = if dev.prefill_wgmma() { PREFILL_WGMMA } else { PREFILL_DEFAULT_VARIANT };
        let name = |vi: usize| match prefill_variant_warps(vi) {
            _ if vi == PREFILL_WGMMA => "prefill_wgmma".to_string(),
            Some(w) => format!("prefill_mma_w{w}"),
            None => format!("prefill_variant_{vi}"),
        };
        let mut rows = vec![(format!("{}*", name(routed)), ms_new, diff)];
        // The other variants, launched directly (the warpgroup one only where it runs).
        let others =
            (0..PREFILL_VARIANTS).filter(|&vi| vi != routed && (vi != PREFILL_WGMMA || dev.prefill_wgmma_capable()));
        for vi in others {
            let kernel = AttnKernel::Prefill { variant: vi };
            let ms = time_ms(dev, 3, 20, |_| attention(&mut meta, &mut o_var, kernel))?;
            rows.push((name(vi), ms, rel_diff(&download_f32(dev, &o_var, n)?, &old)));
        }
        rows.push(("decode_kernel".to_string(), ms_old, 0.0));
        for (name, ms, diff) in rows {
            let tf = flops / (ms * 1e-3) / 1e12;
            writeln!(table, " {s:5} {name:16} {:9.1} {tf:8.1}  {diff:.2e}", ms * 1e3).ok();
            json.push(format!(
                "{{\"name\":\"prefill_attention\",\"kernel\":\"{}\",\"default\":{},\"seq\":{s},\"n_heads\":{nh},\"n_kv_heads\":{nkv},\"head_dim\":{hd},\"block_size\":{bs},\"causal\":true,\"us\":{:.2},\"flops\":{flops:.0},\"min_bytes\":{bytes},\"tflop_s\":{tf:.2},\"rel_diff_vs_decode_kernel\":{diff:.3e}}}",
                name.trim_end_matches('*'),
                name.ends_with('*'),
                ms * 1e3
            ));
        }
    }
    Ok(())
}
