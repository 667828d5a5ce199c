//! Whole-model benchmark of the CUDA backend (a benchmark program, not a test): a model
//! config with random weights (`--load-format dummy` through baton_formats, bf16 on the GPU),
//! driven step by step as the engine drives it: [`ModelRunner::forward_with`], then greedy
//! sampling of every logit row with [`ModelRunner::sample`] (on the GPU; only token ids reach
//! the host, which synchronizes; before GPU sampling each step copied all f32 logits to the
//! host instead, see BENCHMARKS.md).
//!
//! Figures, each with its ceiling measured in the same run:
//! - the device-to-device copy bandwidth (bytes read + written, 1 GiB);
//! - single-stream decode tok/s at a 128-token context vs the roofline: weight bytes read per
//!   step (every matrix except the embedding table, of which one row is read) ÷ copy bandwidth;
//! - TTFT of one 2,048-token prompt (one prefill step, median of 3; with the per-op profile of
//!   that step unless `--no-profile`), with the tensor-core
//!   prefill attention and again with the decode kernel over every row (the old path);
//! - decode steps at each `--shapes` `batch:context` (default the torch.compile peer's:
//!   1:128, 64:1024, 256:1024, 1:8192, 32:8192; the KV cache is filled with random values
//!   instead of prefilled), with the weight + KV bytes per step over the copy bandwidth as the
//!   floor, and, with `--peer PEER.json` (written by `scripts/bench/peer_decode.py` in the same
//!   device call), the peer's step time and Baton's speed relative to it;
//! - per shape, a profile of one eager step (queued behind a spin so its kernels run back to
//!   back): each op's time summed over the layers, next to its own floor (its fewest bytes
//!   over the copy bandwidth); `--no-profile` skips it.
//!
//! Usage: `bench_cuda --config configs/models/llama-3.1-8b.json --out OUT.json [--commit C]
//! [--shapes B:CTX,...] [--peer PEER.json] [--cublas] [--graphs on|off|both] [--no-profile] [--no-ttft]
//! [--kv-cache-dtype auto|fp8] [--quantization none|fp8] [--fused-gate on|off|both] [--fused-norm on|off|both]
//! [--fused-rope on|off|both] [--lt-tuner heuristic|splitk[-flushed],...] [--moe-norm off|both|router|down] [--moe-kernel legacy|split|new|fused-router|both|LIST] [--l2-prefetch MIB,...] [--rope-grouped-min-rows ROWS,...] [--carveout auto|none|PERCENT[/PERCENT[p]],...] [--fp8-fast-accum on|off] [--stream-attention on|off] [--kv-k-shift X] [--all-global]`; with `--kv-cache-dtype fp8` the cache holds random E4M3
//! codes (scales 1) and the floors count one byte per cached K or V value; with
//! `--quantization fp8` the projections are quantized at load (per channel) and count one byte
//! per weight; `--fused-gate` runs the gated MLP projection with its activation fused into the
//! skinny GEMM (`on`, the default), unfused (`off`) or each in turn (`both`); `--fused-norm`
//! likewise for the RMSNorm fused into the skinny GEMMs around it (`branch_boundary`), and
//! `--fused-rope` for RoPE and the KV write in the qkv product's epilogue; `--moe-norm` picks
//! which of a MoE layer's two norms the fused norm takes (`CudaBackend::set_moe_norm_fusion`);
//! `--moe-kernel`
//! runs a MoE config's layers on their first kernels (`legacy`), the five-launch decode set
//! (`split`), their current ones (`new`, the default: router + routing + permutation and down +
//! un-permute fused for steps of at most 16 rows), or each of a comma list in turn at every
//! shape, in the decode timings and the profile (`both` = `legacy,new`); the profile splits a
//! MoE layer into its `moe_*` kernels, each with its floor;
//! `--l2-prefetch` runs the decode timings once per listed budget (MiB of each skinny GEMM's
//! weights pulled into L2 before it waits for the previous kernel; `CudaDevice::gemv_l2_prefetch`);
//! `--carveout` runs them once per listed carve-out choice: `auto` (the backend's per-step
//! rule, the default) or pins `OTHERS[/ATTENTION[p]]` (percents of the SM's largest or `none`;
//! one value pins both; `p` plans attention's splits in its share;
//! `CudaDevice::set_carveout_policy`);
//! `--all-global` treats every layer as global (no sliding window; each layer keeps its RoPE
//! and everything else), so that a windowed model (`configs/models/gemma-3-12b.json`) can be
//! compared with itself attending over the whole context. The decode floors count what each
//! layer's attention must read: `min(ctx, window)` tokens on a windowed layer; the table shows
//! that floor and the all-global one (every layer reading `ctx`) side by side.
//! `--cublas` sends every GEMM to cuBLAS (by default small batches use the skinny-GEMM
//! kernel), for comparisons; decode is measured with CUDA graphs and op by op (`--graphs`,
//! default both).

use baton_engine::backend::cuda::{CudaBackend, MoeKernels, MoeNormFusion};
use baton_engine::backend::{Backend, BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::{LoadFormat, load_model};
use baton_kernels::cuda::{CANDIDATES, CarveoutPins, CarveoutPolicy, DEFAULT_SEARCH, LtSearch};
use std::fmt::Write as _;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_cuda: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// One engine-like step: the forward pass, then greedy sampling of every logit row (on the
/// device for the CUDA backend).
fn engine_step(model: &mut ModelRunner<CudaBackend>, lay: &BatchLayout) -> Res<()> {
    model.forward_with(lay, None)?;
    let params = baton_core::params::SamplingParams::greedy();
    let ctx = baton_core::sampling::SamplingContext {
        params: &params,
        prompt_token_ids: &[],
        output_token_ids: &[],
        eos_token_ids: &[],
        seed: 0,
        allowed: None,
    };
    let ctxs = vec![ctx; lay.logit_rows.len()];
    model.sample(&ctxs)?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let config = flag(&args, "--config").ok_or("--config PATH is required")?;
    let out = flag(&args, "--out").unwrap_or_else(|| "bench-cuda.json".into());
    let commit = flag(&args, "--commit").unwrap_or_default();
    let mut table = String::new();
    let mut json = Vec::new();

    let t0 = Instant::now();
    let loaded = load_model(std::path::Path::new(&config), LoadFormat::Dummy)?;
    let mut cfg = loaded.config.clone();
    // `--quantization fp8`: the attention and MLP projections quantized at load per channel
    // (as the engine does), read by the FP8 kernels; the floors count them at one byte.
    let quantization: baton_engine::weight_quantization::WeightQuantization =
        flag(&args, "--quantization").as_deref().unwrap_or("none").parse()?;
    quantization.apply(&mut cfg);
    // `--all-global`: no layer has a window (the layer kinds, and so each layer's RoPE, stay).
    let all_global = args.iter().any(|a| a == "--all-global");
    if all_global {
        cfg.sliding_window = None;
    }
    // The kernels the server would load for this model, no more.
    let opts = baton_kernels::cuda::CudaOptions {
        ordinal: 0,
        cache_dir: Some(std::env::temp_dir().join("baton-bench-kernels")),
        needs: baton_engine::backend::cuda::kernel_needs(&cfg),
    };
    let mut backend = CudaBackend::new(&opts)?;
    let gemv = !args.iter().any(|a| a == "--cublas");
    backend.set_gemv(gemv);
    let device = backend.device().name().to_string();
    let mut model = ModelRunner::load(&cfg, loaded.weights.as_ref(), backend)?;
    let kv_dtype: baton_engine::kv_cache_dtype::KvCacheDtype =
        flag(&args, "--kv-cache-dtype").as_deref().unwrap_or("auto").parse()?;
    model.set_kv_cache_dtype(kv_dtype, loaded.weights.as_ref())?;
    let kv_elem_bytes = if kv_dtype == baton_engine::kv_cache_dtype::KvCacheDtype::Fp8E4M3 { 1 } else { 2 };
    let load_s = t0.elapsed().as_secs_f64();
    println!(
        "{device}: loaded {config} (random weights) in {load_s:.1} s; small-batch GEMV {gemv}; KV cache {kv_dtype:?}; weights {quantization}; all-global {all_global}"
    );

    // Ceiling: device copy bandwidth, 1 GiB, read + written.
    let copy_gbs = {
        let dev = model.backend().device();
        let n = 1usize << 29;
        let src = dev.alloc::<half::bf16>(n)?;
        let mut dst = dev.alloc::<half::bf16>(n)?;
        // Random-ish contents: copy a filled buffer over the source first.
        dev.copy(&src, &mut dst, n)?;
        let mut times = Vec::new();
        for i in 0..13 {
            let a = dev.event()?;
            let b = dev.event()?;
            a.record(dev.stream())?;
            dev.copy(&src, &mut dst, n)?;
            b.record(dev.stream())?;
            b.synchronize()?;
            if i >= 3 {
                times.push(a.elapsed_ms(&b)? as f64);
            }
        }
        2.0 * (n * 2) as f64 / (median(times) * 1e-3) / 1e9
    };
    let h = cfg.hidden_size;
    let qd = cfg.num_attention_heads * cfg.head_dim;
    let kvd = cfg.num_key_value_heads * cfg.head_dim;
    // Weights read per decode step of `b` rows: every attention matrix, every dense MLP, and
    // in each MoE layer the router plus the experts the step touches: exactly `k` at b = 1,
    // and for larger b the expected count under uniform routing, E·(1 − (1 − k/E)^b) (random
    // weights route about uniformly; the figure says so).
    let attn = h * (qd + 2 * kvd) + qd * h;
    let moe_layers = cfg.moe.as_ref().map_or(0, |m| (0..cfg.num_hidden_layers).filter(|&l| m.is_moe_layer(l)).count());
    let dense_layers = cfg.num_hidden_layers - moe_layers;
    let touched = |b: usize| -> f64 {
        cfg.moe.as_ref().map_or(0.0, |m| {
            let (e, k) = (m.num_experts as f64, m.experts_per_token as f64);
            if b == 1 { k } else { e * (1.0 - (1.0 - k / e).powi(b as i32)) }
        })
    };
    // (projection parameters, other parameters read) per step of `b` rows: the projections
    // are what `--quantization fp8` stores at one byte; MoE experts, the router and the LM head
    // stay bf16.
    let params_for = |b: usize| -> (f64, f64) {
        let moe = cfg.moe.as_ref().map_or(0.0, |m| {
            moe_layers as f64 * ((h * m.num_experts) as f64 + touched(b) * (3 * h * m.intermediate_size) as f64)
        });
        let dense = (cfg.num_hidden_layers * attn + dense_layers * 3 * h * cfg.intermediate_size) as f64;
        (dense, moe + (cfg.vocab_size * h) as f64)
    };
    let projection_bytes = if cfg.quantization.is_some() { 1.0 } else { 2.0 };
    let weight_bytes_for = |b: usize| -> f64 {
        let (projections, other) = params_for(b);
        projection_bytes * projections + 2.0 * other
    };
    let weight_bytes = weight_bytes_for(1);
    let active_params = {
        let (projections, other) = params_for(1);
        projections + other
    };
    // KV bytes one sequence's attention reads at context `ctx`, over the layers: a windowed
    // layer reads min(ctx, window) tokens (the tuned kernels never read before the window);
    // and the same with every layer global.
    let windows = layer_windows(&cfg);
    let kv_token_bytes = (2 * kvd * kv_elem_bytes) as f64;
    let kv_seq_bytes = |ctx: usize| -> f64 { kv_token_bytes * layer_tokens(&windows, ctx) };
    let kv_seq_bytes_global = |ctx: usize| -> f64 { kv_token_bytes * (cfg.num_hidden_layers * ctx) as f64 };
    let windowed_layers = windows.iter().filter(|w| w.is_some()).count();
    if windowed_layers > 0 {
        writeln!(table, "{windowed_layers} of {} layers attend within a window", cfg.num_hidden_layers)?;
    }
    writeln!(table, "copy 1 GiB d2d: {copy_gbs:.0} GB/s; weights read per step {:.2} GB", weight_bytes / 1e9)?;
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"gb_s\":{copy_gbs:.1}}}"));

    let bs = 16usize;
    // Decode shapes `batch:context`; the defaults are the table (the torch.compile
    // peer's shapes).
    let shapes: Vec<(usize, usize)> = flag(&args, "--shapes")
        .unwrap_or_else(|| "1:128,64:1024,256:1024,1:8192,32:8192".into())
        .split(',')
        .map(|s| -> Res<(usize, usize)> {
            let (b, c) = s.split_once(':').ok_or("--shapes takes batch:context pairs")?;
            Ok((b.parse()?, c.parse()?))
        })
        .collect::<Res<_>>()?;
    let peer = match flag(&args, "--peer") {
        Some(p) => Some(serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&p)?)?),
        None => None,
    };
    let peer_ms = |b: usize, c: usize| -> Option<f64> {
        peer.as_ref()?["results"].as_array()?.iter().find_map(|r| {
            (r["batch"].as_u64()? == b as u64 && r["context"].as_u64()? == c as u64)
                .then(|| r["ms_per_step"].as_f64())
                .flatten()
        })
    };
    // Every sequence gets room for its context + 64 tokens; the 2,048-token prompt its own
    // blocks after the largest shape's.
    let n = 2048usize;
    let per_seq = |ctx: usize| (ctx + 64).div_ceil(bs);
    let decode_blocks = shapes.iter().map(|&(b, c)| b * per_seq(c)).max().unwrap_or(0);
    let prefill_blocks = n.div_ceil(bs);
    model.alloc_kv_cache(decode_blocks + prefill_blocks, bs)?;
    model.backend_mut().fill_kv_random(7)?;
    // `--kv-k-shift X`: every FP8 layer's keys stored less a shift of X in every channel (the
    // cost of key smoothing's extra load in each key write; the values are random anyway).
    if let Some(x) = flag(&args, "--kv-k-shift") {
        let x: f32 = x.parse()?;
        let stride = cfg.num_key_value_heads * cfg.head_dim;
        for layer in 0..cfg.num_hidden_layers {
            model.set_kv_k_shift(layer, &vec![x; stride])?;
        }
        println!("FP8 key shift {x} in every layer");
    }
    let decode_batch = |b: usize, ctx: usize, pos: usize| BatchLayout {
        tokens: (0..b).map(|i| (i * 7919 % cfg.vocab_size) as u32).collect(),
        positions: vec![pos; b],
        seqs: (0..b)
            .map(|i| SeqLayout {
                row_start: i,
                n_tokens: 1,
                start_pos: pos,
                block_table: ((i * per_seq(ctx)) as u32..((i + 1) * per_seq(ctx)) as u32).collect(),
            })
            .collect(),
        logit_rows: (0..b).collect(),
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    let prefill_table: Vec<u32> = (decode_blocks as u32..(decode_blocks + prefill_blocks) as u32).collect();

    // `--moe-kernel legacy|split|new|fused-router|both` or a comma list of them (`split,new`):
    // the MoE layer on its first kernels, on the five-launch set, on the current one (the
    // default), on that with the router fused too, or each in turn at every shape (`both` =
    // `legacy,new`; MoE configs only).
    let moe_sets: Vec<MoeKernels> = match (cfg.moe.is_some(), flag(&args, "--moe-kernel").as_deref()) {
        (false, _) | (true, None) => vec![MoeKernels::Fused],
        (true, Some("both")) => vec![MoeKernels::First, MoeKernels::Fused],
        (true, Some(list)) => list
            .split(',')
            .map(|name| {
                [MoeKernels::First, MoeKernels::Split, MoeKernels::Fused, MoeKernels::FusedRouter]
                    .into_iter()
                    .find(|k| k.name() == name)
                    .ok_or_else(|| format!("--moe-kernel {name}: expected legacy, split, new, fused-router or both"))
            })
            .collect::<Result<_, _>>()?,
    };
    // TTFT: one 2,048-token prompt as one prefill step.
    let prefill = BatchLayout {
        tokens: (0..n).map(|i| (i * 31 % cfg.vocab_size) as u32).collect(),
        positions: (0..n).collect(),
        seqs: vec![SeqLayout { row_start: 0, n_tokens: n, start_pos: 0, block_table: prefill_table }],
        logit_rows: vec![n - 1],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    // Every MoE kernel set with the prefill attention kernel, the last also with the decode one
    // and (on Hopper) with the mma.sync prefill kernel instead of the warpgroup one.
    let last = moe_sets[moe_sets.len() - 1];
    let mut ttft_runs: Vec<(MoeKernels, bool, bool)> = moe_sets.iter().map(|&m| (m, true, true)).collect();
    if model.backend_mut().prefill_wgmma_capable() {
        ttft_runs.push((last, true, false));
    }
    ttft_runs.push((last, false, true));
    // `--no-ttft`: decode only (a profiler's launch window then starts in the decode steps).
    if args.iter().any(|a| a == "--no-ttft") {
        ttft_runs.clear();
    }
    // `--fp8-fast-accum on|off`: cuBLASLt's FP8 products with fast accumulation or not (the
    // device's default when not given).
    if let Some(v) = flag(&args, "--fp8-fast-accum") {
        model.backend_mut().set_lt_fp8_fast_accum(v == "on")?;
    }
    // `--stream-attention on|off`: the default decode attention may take the streaming kernel
    // (the device's default, on sm_90) or stays on the tensor-core kernel.
    if let Some(v) = flag(&args, "--stream-attention") {
        model.backend_mut().set_stream_attention(v == "on");
    }
    // `--moe-norm off|both|router|down`: which of a MoE layer's two norms the fused norm takes.
    if let Some(v) = flag(&args, "--moe-norm") {
        let fusion = match v.as_str() {
            "off" => None,
            name => match MoeNormFusion::parse(name) {
                Some(f) => Some(f),
                None => {
                    eprintln!("--moe-norm takes off, both, router or down, not {v}");
                    std::process::exit(2);
                }
            },
        };
        model.backend_mut().set_moe_norm_fusion(fusion);
    }
    // The TTFT runs with the fused norm as `--fused-norm` says (`off`: unfused; `on` and `both`:
    // fused, the default).
    model.backend_mut().set_fused_norm(flag(&args, "--fused-norm").as_deref() != Some("off"));
    for (moe, prefill_kernel, wgmma) in ttft_runs {
        model.backend_mut().set_moe_kernels(moe);
        model.backend_mut().set_prefill_kernel(prefill_kernel);
        model.backend_mut().set_prefill_wgmma(wgmma);
        engine_step(&mut model, &prefill)?;
        let mut t = Vec::new();
        for _ in 0..3 {
            let s = Instant::now();
            engine_step(&mut model, &prefill)?;
            t.push(s.elapsed().as_secs_f64());
        }
        let ttft = median(t);
        let prefill_tflops = 2.0 * active_params * n as f64 / ttft / 1e12;
        let wg = wgmma && model.backend_mut().prefill_wgmma_capable();
        let attn = match (prefill_kernel, wg) {
            (false, _) => "decode kernel",
            (true, true) => "prefill kernel (warpgroup MMA)",
            (true, false) => "prefill kernel (mma.sync)",
        };
        let moe_name = moe.name();
        let moe_txt = if cfg.moe.is_some() { format!(", MoE kernels {moe_name}") } else { String::new() };
        writeln!(
            table,
            "TTFT 2048-token prompt, attention on the {attn}{moe_txt}: {:.1} ms ({prefill_tflops:.0} TFLOP/s of GEMM work)",
            ttft * 1e3
        )?;
        json.push(format!(
            "{{\"name\":\"ttft\",\"prompt_tokens\":{n},\"prefill_kernel\":{prefill_kernel},\"prefill_wgmma\":{wg},\"moe_kernels\":\"{moe_name}\",\"ms\":{:.2},\"gemm_tflop_s\":{prefill_tflops:.1}}}",
            ttft * 1e3
        ));
    }
    model.backend_mut().set_prefill_kernel(true);
    model.backend_mut().set_prefill_wgmma(true);
    model.backend_mut().set_moe_kernels(last);
    // Where the prefill step's time goes: the same step op by op (eager, events between ops).
    if !args.iter().any(|a| a == "--no-profile" || a == "--no-ttft") {
        writeln!(table, "  per-op TTFT step (eager, queue filled first): op | us")?;
        for (op, us) in profile_step(&mut model, &prefill, 3)? {
            writeln!(table, "    {op:12}| {us:9.1}")?;
            json.push(format!("{{\"name\":\"ttft_op\",\"prompt_tokens\":{n},\"op\":\"{op}\",\"us\":{us:.1}}}"));
        }
    }

    // Decode, with CUDA graphs (the default) and op by op (`--enforce-eager`), and with and
    // without programmatic dependent launch (`--pdl both`), in this run.
    let graph_modes: Vec<bool> = match flag(&args, "--graphs").as_deref() {
        Some("on") => vec![true],
        Some("off") => vec![false],
        _ => vec![true, false],
    };
    let pdl_modes: Vec<bool> = match flag(&args, "--pdl").as_deref() {
        Some("off") => vec![false],
        Some("both") => vec![true, false],
        _ => vec![true],
    };
    // And with the gated MLP's activation fused into the skinny GEMM or not (`--fused-gate
    // both`; the default runs it fused only).
    let fused_modes: Vec<bool> = match flag(&args, "--fused-gate").as_deref() {
        Some("off") => vec![false],
        Some("both") => vec![true, false],
        _ => vec![true],
    };
    // And with the skinny GEMM pulling this many MiB of its weights into L2 before it waits
    // for the previous kernel (`--l2-prefetch 0,16,32`: a list; the device's default when not
    // given).
    let default_prefetch = model.backend().device().gemv_l2_prefetch();
    let prefetch_modes: Vec<usize> = match flag(&args, "--l2-prefetch") {
        None => vec![default_prefetch],
        Some(list) => list
            .split(',')
            .map(|v| v.parse::<usize>().map(|mib| mib << 20).map_err(|e| format!("--l2-prefetch {v}: {e}")))
            .collect::<Result<_, _>>()?,
    };
    // And with the RMSNorm fused into the skinny GEMMs around it or not (`--fused-norm both`).
    let norm_modes: Vec<bool> = match flag(&args, "--fused-norm").as_deref() {
        Some("off") => vec![false],
        Some("both") => vec![true, false],
        _ => vec![true],
    };
    // And with RoPE's heads grouped into CTAs from these row counts (`--rope-grouped-min-rows
    // 513,129`: a list; the device's default when not given).
    let default_rope_min = model.backend().device().rope_grouped_min_rows();
    let rope_modes: Vec<usize> = match flag(&args, "--rope-grouped-min-rows") {
        None => vec![default_rope_min],
        Some(list) => list
            .split(',')
            .map(|v| v.parse::<usize>().map_err(|e| format!("--rope-grouped-min-rows {v}: {e}")))
            .collect::<Result<_, _>>()?,
    };
    // And with RoPE and the KV write in the qkv product's epilogue or in their own kernel
    // (`--fused-rope both`).
    let rope_fused_modes: Vec<bool> = match flag(&args, "--fused-rope").as_deref() {
        Some("off") => vec![false],
        Some("both") => vec![true, false],
        _ => vec![true],
    };
    // And with the launches' shared-memory carve-outs chosen per step (`auto`, the default) or
    // pinned (`--carveout auto,none,50,50/none,40/50p,...`: see `parse_carveout`).
    let carveout_modes: Vec<Carveout> = match flag(&args, "--carveout") {
        None => vec![Carveout::Auto],
        Some(list) => list.split(',').map(parse_carveout).collect::<Result<_, _>>()?,
    };
    // And with cuBLASLt's tuner as `--lt-tuner LIST` says: each entry `heuristic` (the
    // heuristic's first CANDIDATES) or `splitk` (those and their split-K variants), `-flushed` for the
    // candidates timed behind an L2 flush (e.g. `heuristic,heuristic-flushed`); the device's
    // setting when not given.
    let dev_tuner = LtTuner {
        search: model.backend().device().lt_search()?.unwrap_or(DEFAULT_SEARCH),
        flushed: model.backend().device().lt_flushed_timing(),
    };
    let search_modes: Vec<LtTuner> = match flag(&args, "--lt-tuner") {
        None => vec![dev_tuner],
        Some(list) => list.split(',').map(LtTuner::parse).collect::<Result<_, _>>()?,
    };
    let mut modes: Vec<Mode> = Vec::new();
    for &graphs in &graph_modes {
        for &pdl in &pdl_modes {
            for &fused_gate in &fused_modes {
                for &fused_norm in &norm_modes {
                    for &prefetch in &prefetch_modes {
                        for &rope_min in &rope_modes {
                            let carveouts = &carveout_modes;
                            let searches = &search_modes;
                            let with_moe = moe_sets.iter().flat_map(|&moe| {
                                rope_fused_modes.iter().flat_map(move |&fused_rope| {
                                    carveouts.iter().flat_map(move |&carveout| {
                                        searches.iter().map(move |&lt_search| Mode {
                                            graphs,
                                            pdl,
                                            fused_gate,
                                            fused_norm,
                                            moe,
                                            fused_rope,
                                            prefetch,
                                            rope_min,
                                            carveout,
                                            lt_search,
                                        })
                                    })
                                })
                            });
                            modes.extend(with_moe);
                        }
                    }
                }
            }
        }
    }
    writeln!(
        table,
        "decode step (median of 40): shape | mode | ms | floor ms (weights + KV read at copy) | % of floor | all-global floor ms | peer ms | baton/peer speed"
    )?;
    for &(b, ctx) in &shapes {
        let bytes = weight_bytes_for(b) + kv_seq_bytes(ctx) * b as f64;
        let global_floor_ms = (weight_bytes_for(b) + kv_seq_bytes_global(ctx) * b as f64) / (copy_gbs * 1e9) * 1e3;
        if cfg.moe.is_some() {
            writeln!(table, "  b={b:3}: {:.1} experts touched per MoE layer in the floor", touched(b))?;
        }
        let floor_ms = bytes / (copy_gbs * 1e9) * 1e3;
        for &Mode { graphs, pdl, fused_gate, fused_norm, moe, fused_rope, prefetch, rope_min, carveout, lt_search } in
            &modes
        {
            model.backend_mut().set_graphs(graphs);
            let dev = model.backend().device();
            if dev.lt_search()? != Some(lt_search.search) || dev.lt_flushed_timing() != lt_search.flushed {
                model.backend_mut().set_lt_search(lt_search.search)?;
                model.backend_mut().set_lt_flushed_timing(lt_search.flushed)?;
            }
            model.backend_mut().set_carveout_policy(carveout.policy());
            model.backend_mut().set_pdl(pdl);
            model.backend_mut().set_fused_gate(fused_gate);
            model.backend_mut().set_fused_norm(fused_norm);
            model.backend_mut().set_fused_rope(fused_rope);
            model.backend_mut().set_moe_kernels(moe);
            model.backend_mut().set_gemv_l2_prefetch(prefetch);
            model.backend_mut().set_rope_grouped_min_rows(rope_min);
            let legacy = moe == MoeKernels::First;
            let moe_name = moe.name();
            let carveout_json = format!("\"{}\"", carveout.name());
            let mode = format!(
                "{}{}{}{}{}{}{}{}{}{}",
                if graphs { "graphs" } else { "eager" },
                if pdl { "+pdl" } else { "" },
                if fused_gate { "" } else { "-unfused" },
                if fused_norm { "" } else { "-normunfused" },
                if fused_rope { "" } else { "-ropeunfused" },
                if moe == MoeKernels::Fused || cfg.moe.is_none() { String::new() } else { format!("+{moe_name}-moe") },
                if prefetch_modes.len() > 1 { format!("+pf{}M", prefetch >> 20) } else { String::new() },
                if rope_modes.len() > 1 { format!("+rope{rope_min}") } else { String::new() },
                if carveout_modes.len() > 1 { format!("+co{}", carveout.name()) } else { String::new() },
                if search_modes.len() > 1 { format!("+lt-{}", lt_search.name()) } else { String::new() }
            );
            let mut times = Vec::new();
            for s in 0..48 {
                let lay = decode_batch(b, ctx, ctx + s);
                let st = Instant::now();
                engine_step(&mut model, &lay)?;
                if s >= 8 {
                    times.push(st.elapsed().as_secs_f64());
                }
            }
            let ms = median(times) * 1e3;
            let peer = peer_ms(b, ctx);
            let (peer_txt, ratio_txt) = match peer {
                Some(p) => (format!("{p:.3}"), format!("{:.3}x", p / ms)),
                None => ("-".into(), "-".into()),
            };
            writeln!(
                table,
                "  b={b:3} ctx={ctx:5} | {mode:28} | {ms:7.3} | {floor_ms:7.3} | {:5.1}% | {global_floor_ms:7.3} | {peer_txt} | {ratio_txt}",
                100.0 * floor_ms / ms
            )?;
            json.push(format!(
                "{{\"name\":\"decode_step\",\"graphs\":{graphs},\"pdl\":{pdl},\"fused_gate\":{fused_gate},\"fused_norm\":{fused_norm},\"fused_rope\":{fused_rope},\"gemv_l2_prefetch\":{prefetch},\"rope_grouped_min_rows\":{rope_min},\"carveout_pin\":{carveout_json},\"lt_search\":\"{}\",\"legacy_moe\":{legacy},\"moe_kernels\":\"{moe_name}\",\"all_global\":{all_global},\"batch\":{b},\"context\":{ctx},\"ms_per_step\":{ms:.4},\"tok_s\":{:.1},\"floor_ms\":{floor_ms:.4},\"floor_all_global_ms\":{global_floor_ms:.4},\"frac_of_floor\":{:.4},\"peer_ms_per_step\":{},\"speed_vs_peer\":{}}}",
                lt_search.name(),
                b as f64 * 1e3 / ms,
                floor_ms / ms,
                peer.map_or("null".into(), |p| format!("{p:.4}")),
                peer.map_or("null".into(), |p| format!("{:.4}", p / ms)),
            ));
        }
        model.backend_mut().set_gemv_l2_prefetch(default_prefetch);
        model.backend_mut().set_carveout_policy(carveout_modes[0].policy());
        if !args.iter().any(|a| a == "--no-profile") {
            model.backend_mut().set_pdl(pdl_modes[0]);
            model.backend_mut().set_fused_gate(fused_modes[0]);
            model.backend_mut().set_fused_norm(norm_modes[0]);
            model.backend_mut().set_fused_rope(rope_fused_modes[0]);
            // Batches past the skinny GEMM run cuBLASLt's measured choice: profiled with plain
            // cuBLAS too, for the comparison.
            let gemms: &[&str] = if b > 16 && gemv { &["default", "cublas"] } else { &["default"] };
            let runs = gemms.iter().flat_map(|g| moe_sets.iter().map(move |l| (g, l)));
            for ((&gemm, &moe), &rope_min) in runs.flat_map(|r| rope_modes.iter().map(move |m| (r, m))) {
                model.backend_mut().set_moe_kernels(moe);
                model.backend_mut().set_rope_grouped_min_rows(rope_min);
                let (legacy, moe_name) = (moe == MoeKernels::First, moe.name());
                model.backend_mut().set_gemv(gemm == "default" && gemv);
                let rows = profile_step(&mut model, &decode_batch(b, ctx, ctx), 5)?;
                let shape = OpShape {
                    b,
                    ctx,
                    cfg: &cfg,
                    kv_elem_bytes: kv_elem_bytes as f64,
                    projection_bytes,
                    dense_layers: dense_layers as f64,
                    moe_layers: moe_layers as f64,
                    touched: touched(b),
                    windows: &windows,
                };
                let mut moe_txt = if cfg.moe.is_none() { String::new() } else { format!(" moe={moe_name}") };
                if rope_modes.len() > 1 {
                    moe_txt += &format!(" rope_grouped_min_rows={rope_min}");
                }
                writeln!(
                    table,
                    "  per-op (eager, queue filled first) b={b} ctx={ctx} gemm={gemm}{moe_txt}: op | us/step | floor us | % of floor"
                )?;
                let mut total = 0.0;
                for (label, us) in &rows {
                    total += us;
                    let floor_us = shape.bytes(label) / (copy_gbs * 1e9) * 1e6;
                    writeln!(table, "    {label:11} | {us:8.1} | {floor_us:8.1} | {:5.1}%", 100.0 * floor_us / us)?;
                    json.push(format!(
                        "{{\"name\":\"decode_op\",\"rope_grouped_min_rows\":{rope_min},\"legacy_moe\":{legacy},\"moe_kernels\":\"{moe_name}\",\"batch\":{b},\"context\":{ctx},\"gemm\":{gemm:?},\"op\":{label:?},\"us_per_step\":{us:.2},\"floor_us\":{floor_us:.2}}}"
                    ));
                }
                writeln!(table, "    total       | {total:8.1} | {:8.1} |", floor_ms * 1e3)?;
            }
            model.backend_mut().set_gemv(gemv);
            model.backend_mut().set_moe_kernels(MoeKernels::Fused);
            model.backend_mut().set_rope_grouped_min_rows(default_rope_min);
        }
        let st = model.backend().graph_stats();
        writeln!(
            table,
            "  CUDA graphs so far: {} recorded, {} replayed, {} failed, {} invalidations",
            st.recorded, st.replayed, st.failed, st.invalidated
        )?;
    }

    let doc = format!(
        "{{\"benchmark\":\"bench-cuda\",\"device\":{device:?},\"commit\":{commit:?},\"all_global\":{all_global},\"kv_cache_dtype\":\"{kv_dtype:?}\",\"quantization\":\"{quantization}\",\"command\":{:?},\"model_config\":{config:?},\"gemv\":{gemv},\"load_seconds\":{load_s:.1},\"results\":[\n{}\n]}}\n",
        args.join(" "),
        json.join(",\n")
    );
    std::fs::write(&out, doc)?;
    println!("{table}");
    Ok(())
}

/// One eager decode step profiled `reps` times (the host queues it behind a spin, so its
/// kernels run back to back): each op's microseconds per step, summed over the layers,
/// median over the repetitions, in the order the ops first run.
fn profile_step(model: &mut ModelRunner<CudaBackend>, lay: &BatchLayout, reps: usize) -> Res<Vec<(&'static str, f64)>> {
    model.backend_mut().set_graphs(false);
    engine_step(model, lay)?;
    let params = baton_core::params::SamplingParams::greedy();
    let ctx = baton_core::sampling::SamplingContext {
        params: &params,
        prompt_token_ids: &[],
        output_token_ids: &[],
        eos_token_ids: &[],
        seed: 0,
        allowed: None,
    };
    let ctxs: Vec<(usize, _)> = (0..lay.logit_rows.len()).map(|i| (i, ctx)).collect();
    let mut order: Vec<&'static str> = Vec::new();
    let mut samples: std::collections::HashMap<&'static str, Vec<f64>> = Default::default();
    for _ in 0..reps {
        model.backend_mut().profile_begin(30_000_000)?;
        model.forward_with(lay, None)?;
        model.backend_mut().mark("sample");
        model.sample_launch(&ctxs)?;
        model.backend_mut().mark("end");
        let marks = model.backend_mut().profile_end()?;
        model.sample_collect()?;
        let mut sums: std::collections::HashMap<&'static str, f64> = Default::default();
        for (label, ms) in marks {
            if !order.contains(&label) {
                order.push(label);
            }
            *sums.entry(label).or_default() += ms * 1e3;
        }
        for (label, us) in sums {
            samples.entry(label).or_default().push(us);
        }
    }
    model.backend_mut().set_graphs(true);
    Ok(order.into_iter().map(|l| (l, median(samples.remove(l).unwrap_or_default()))).collect())
}

/// The fewest bytes each op of a decode step of `b` sequences at `ctx` tokens must move,
/// summed over the layers (weights once, activations read and written once, the KV of the
/// context read once).
struct OpShape<'a> {
    b: usize,
    ctx: usize,
    cfg: &'a baton_formats::ModelConfig,
    /// Bytes of one cached K or V value (2 for bf16, 1 for FP8).
    kv_elem_bytes: f64,
    /// Bytes of one weight of the attention and dense MLP projections (1 with
    /// `--quantization fp8`, as the step's floor counts them).
    projection_bytes: f64,
    /// Layers with a dense MLP, and with a mixture of experts.
    dense_layers: f64,
    moe_layers: f64,
    /// Experts a MoE layer reads in this step (as the step's floor counts them).
    touched: f64,
    /// Each layer's window ([`layer_windows`]).
    windows: &'a [Option<usize>],
}

/// Each layer's sliding window (`None`: global), as the model attends: sliding layers of a
/// config with a `sliding_window` (none left with `--all-global`).
fn layer_windows(cfg: &baton_formats::ModelConfig) -> Vec<Option<usize>> {
    cfg.layer_types
        .iter()
        .map(|t| match (t, cfg.sliding_window) {
            (baton_formats::LayerType::Sliding, Some(w)) => Some(w),
            _ => None,
        })
        .collect()
}

/// Tokens read at context `ctx`, summed over the layers: `min(ctx, window)` on a windowed one.
fn layer_tokens(windows: &[Option<usize>], ctx: usize) -> f64 {
    windows.iter().map(|w| w.map_or(ctx, |w| ctx.min(w)) as f64).sum()
}

impl OpShape<'_> {
    fn bytes(&self, op: &str) -> f64 {
        let c = self.cfg;
        let (b, l) = (self.b as f64, c.num_hidden_layers as f64);
        let h = c.hidden_size as f64;
        let qd = (c.num_attention_heads * c.head_dim) as f64;
        let kvd = (c.num_key_value_heads * c.head_dim) as f64;
        let inter = c.intermediate_size as f64;
        let vocab = c.vocab_size as f64;
        let linear = |n: f64, k: f64| self.projection_bytes * n * k + 2.0 * b * (n + k);
        let dl = self.dense_layers;
        // MoE: `a` assignments (rows × k), experts of width `mi`; the products read the
        // touched experts' weights once and their entries' activations (the fused gate_up
        // writes only the activated `a × mi`; `moe_act` appears only when it runs apart).
        let (ml, ne, mi, a) = c.moe.as_ref().map_or((0.0, 0.0, 0.0, 0.0), |m| {
            (self.moe_layers, m.num_experts as f64, m.intermediate_size as f64, b * m.experts_per_token as f64)
        });
        match op {
            "moe_router" => ml * (2.0 * ne * h + b * (2.0 * h + 4.0 * ne)),
            "moe_route" => ml * (b * 4.0 * ne + a * 8.0 + a * 8.0),
            "moe_gate_up" => ml * (self.touched * 2.0 * 2.0 * mi * h + b * 2.0 * h + a * 2.0 * mi),
            "moe_act" => ml * a * 6.0 * mi,
            "moe_down" => ml * (self.touched * 2.0 * h * mi + a * 2.0 * (mi + h)),
            "moe_unpermute" => ml * (a * (2.0 * h + 8.0) + b * 2.0 * h),
            // The fused launches of small steps: the sums of their parts.
            "moe_router_route" => self.bytes("moe_router") + self.bytes("moe_route"),
            "moe_down_unpermute" => self.bytes("moe_down") + self.bytes("moe_unpermute"),
            "embed" => b * h * 6.0,
            // Two norms per layer: the f32 residual read and written, x read, out written.
            "norm" => 2.0 * l * b * h * 12.0,
            "qkv" => l * linear(qd + 2.0 * kvd, h),
            "rope_kv" => l * b * 2.0 * 2.0 * (qd + 2.0 * kvd),
            "attention" => 2.0 * self.kv_elem_bytes * b * layer_tokens(self.windows, self.ctx) * kvd + l * 4.0 * b * qd,
            "o_proj" => l * linear(h, qd),
            "gate_up" => dl * linear(2.0 * inter, h),
            "silu_mul" => dl * b * 6.0 * inter,
            "down" => dl * linear(h, inter),
            "final_norm" => b * h * 12.0,
            "lm_head" => 2.0 * vocab * h + b * (2.0 * h + 4.0 * vocab),
            "sample" => b * vocab * 4.0,
            _ => 0.0,
        }
    }
}

/// One configuration the decode timings run a shape under.
#[derive(Clone, Copy)]
struct Mode {
    graphs: bool,
    pdl: bool,
    fused_gate: bool,
    fused_norm: bool,
    moe: MoeKernels,
    /// RoPE and the KV write in the qkv product's epilogue (`--fused-rope`).
    fused_rope: bool,
    /// Bytes of each skinny GEMM's weights pulled into L2 before it waits.
    prefetch: usize,
    /// Rows from which RoPE groups heads into a CTA.
    rope_min: usize,
    /// The carve-outs the launches ask for (`--carveout`).
    carveout: Carveout,
    /// How cuBLASLt's tuner picks each product's configuration (`--lt-tuner`).
    lt_search: LtTuner,
}

/// How cuBLASLt's tuner picks a product's configuration (`--lt-tuner`).
#[derive(Clone, Copy, PartialEq)]
struct LtTuner {
    search: LtSearch,
    /// Candidates timed behind an L2 flush.
    flushed: bool,
}

impl LtTuner {
    fn parse(v: &str) -> Result<Self, String> {
        let (name, flushed) = match v.strip_suffix("-flushed") {
            Some(n) => (n, true),
            None => (v, false),
        };
        let search = match name {
            "heuristic" => LtSearch::Heuristic(CANDIDATES),
            "splitk" => LtSearch::SplitK(CANDIDATES),
            _ => return Err(format!("--lt-tuner takes heuristic or splitk, each with -flushed or not, not {v}")),
        };
        Ok(Self { search, flushed })
    }

    fn name(self) -> String {
        format!("{}{}", self.search, if self.flushed { "-flushed" } else { "" })
    }
}

/// The launches' carve-outs (`--carveout`): chosen per step, or pinned.
#[derive(Clone, Copy)]
enum Carveout {
    /// The backend's per-step rule (`step_carveout`), the default.
    Auto,
    /// These pins on every step.
    Fixed(CarveoutPins),
}

impl Carveout {
    fn policy(self) -> CarveoutPolicy {
        match self {
            Self::Auto => CarveoutPolicy::PerStep,
            Self::Fixed(pins) => CarveoutPolicy::Fixed(pins),
        }
    }

    /// The `--carveout` entry this was parsed from (`auto`, `none`, `50`, `50/none`, ...).
    fn name(self) -> String {
        let Self::Fixed(pins) = self else { return "auto".into() };
        let p = |v: Option<u32>| v.map_or("none".to_string(), |c| c.to_string());
        let plan = if pins.split_by_pin { "p" } else { "" };
        if pins.others == pins.attention && !pins.split_by_pin {
            p(pins.others)
        } else {
            format!("{}/{}{plan}", p(pins.others), p(pins.attention))
        }
    }
}

/// One `--carveout` entry: `auto` (the per-step rule), or `OTHERS[/ATTENTION[p]]` pinned on
/// every step: percents of the SM's largest shared memory or `none` (the driver's choice, and
/// attention's own), one value pinning both; `p`: attention's splits planned in its share.
fn parse_carveout(entry: &str) -> Result<Carveout, String> {
    if entry == "auto" {
        return Ok(Carveout::Auto);
    }
    let one = |v: &str| match v {
        "none" => Ok(None),
        _ => v.parse::<u32>().map(Some).map_err(|e| format!("--carveout {entry}: {e}")),
    };
    let pins = match entry.split_once('/') {
        Some((o, a)) => {
            let (a, split_by_pin) = a.strip_suffix('p').map_or((a, false), |a| (a, true));
            CarveoutPins { others: one(o)?, attention: one(a)?, split_by_pin }
        }
        None => {
            let p = one(entry)?;
            CarveoutPins { others: p, attention: p, split_by_pin: false }
        }
    };
    Ok(Carveout::Fixed(pins))
}
