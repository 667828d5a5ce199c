//! Whole-model benchmark of the CUDA backend (a benchmark program, not a test): a model
//! config with random weights (`--load-format dummy` through baton_formats, bf16 on the GPU),
//! driven step by step as the engine drives it: [`LlamaModel::forward_exporting`], then greedy
//! sampling of every logit row with [`LlamaModel::sample`] (on the GPU; only token ids reach
//! the host, which synchronizes; before GPU sampling each step copied all f32 logits to the
//! host instead, see BENCHMARKS.md).
//!
//! Figures, each with its ceiling measured in the same run:
//! - the device-to-device copy bandwidth (bytes read + written, 1 GiB);
//! - single-stream decode tok/s at a 128-token context vs the roofline: weight bytes read per
//!   step (every matrix except the embedding table, of which one row is read) ÷ copy bandwidth;
//! - TTFT of one 2,048-token prompt (one prefill step, median of 3), with the tensor-core
//!   prefill attention and again with the decode kernel over every row (the old path);
//! - batched decode throughput at batch 64 / 128 / 256 with 1,024 tokens of context per
//!   sequence (the KV cache is filled with random values instead of prefilled), with the
//!   weight + KV bytes per step over the copy bandwidth as the floor.
//!
//! Usage: `bench_cuda --config configs/models/llama-3.1-8b.json --out OUT.json [--commit C]
//! [--batches 64,128,256] [--ctx 1024] [--cublas] [--graphs on|off|both]`; `--cublas` sends every
//! GEMM to cuBLAS (by default small batches use the skinny-GEMM kernel), for comparisons;
//! decode is measured with CUDA graphs and op by op (`--graphs`, default both).

use baton_engine::backend::cuda::CudaBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::model::LlamaModel;
use baton_formats::{LoadFormat, load_model};
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
fn engine_step(model: &mut LlamaModel<CudaBackend>, lay: &BatchLayout) -> Res<()> {
    model.forward_exporting(lay, &[], &mut |_, _| {})?;
    let params = baton_core::params::SamplingParams::greedy();
    let ctx = baton_core::sampling::SamplingContext {
        params: &params,
        prompt_token_ids: &[],
        output_token_ids: &[],
        eos_token_ids: &[],
        seed: 0,
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
    let batches: Vec<usize> = flag(&args, "--batches")
        .unwrap_or_else(|| "64,128,256".into())
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let ctx: usize = flag(&args, "--ctx").unwrap_or_else(|| "1024".into()).parse()?;
    let mut table = String::new();
    let mut json = Vec::new();

    let t0 = Instant::now();
    let loaded = load_model(std::path::Path::new(&config), LoadFormat::Dummy)?;
    let cfg = loaded.config.clone();
    let opts = baton_kernels::cuda::CudaOptions {
        ordinal: 0,
        cache_dir: Some(std::env::temp_dir().join("baton-bench-kernels")),
    };
    let mut backend = CudaBackend::new(&opts)?;
    let gemv = !args.iter().any(|a| a == "--cublas");
    backend.set_gemv(gemv);
    let device = backend.device().name().to_string();
    let mut model = LlamaModel::load(&cfg, loaded.weights.as_ref(), backend)?;
    let load_s = t0.elapsed().as_secs_f64();
    println!("{device}: loaded {config} (random bf16 weights) in {load_s:.1} s; small-batch GEMV {gemv}");

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
    let per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * cfg.intermediate_size;
    let weight_bytes = 2.0 * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h) as f64;
    let kv_per_token = (2 * cfg.num_hidden_layers * kvd * 2) as f64;
    writeln!(table, "copy 1 GiB d2d: {copy_gbs:.0} GB/s; weights read per step {:.2} GB", weight_bytes / 1e9)?;
    json.push(format!("{{\"name\":\"copy_d2d_1GiB\",\"gb_s\":{copy_gbs:.1}}}"));

    let bs = 16usize;
    let max_batch = batches.iter().copied().max().unwrap_or(1).max(1);
    // Each decode sequence gets room for ctx + 32 tokens; the 2,048-token prompt its own blocks after them.
    let n = 2048usize;
    let per_seq = (ctx + 32).div_ceil(bs);
    let prefill_blocks = n.div_ceil(bs);
    model.alloc_kv_cache(per_seq * max_batch + prefill_blocks, bs)?;
    model.backend_mut().fill_kv_random(7)?;
    let table_of = |i: usize| -> Vec<u32> { ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect() };
    let prefill_table: Vec<u32> =
        ((per_seq * max_batch) as u32..(per_seq * max_batch + prefill_blocks) as u32).collect();
    let decode_batch = |b: usize, pos: usize| BatchLayout {
        tokens: (0..b).map(|i| (i * 7919 % cfg.vocab_size) as u32).collect(),
        positions: vec![pos; b],
        seqs: (0..b)
            .map(|i| SeqLayout { row_start: i, n_tokens: 1, start_pos: pos, block_table: table_of(i) })
            .collect(),
        logit_rows: (0..b).collect(),
        pending: Vec::new(),
    };

    // TTFT: one 2,048-token prompt as one prefill step.
    let prefill = BatchLayout {
        tokens: (0..n).map(|i| (i * 31 % cfg.vocab_size) as u32).collect(),
        positions: (0..n).collect(),
        seqs: vec![SeqLayout { row_start: 0, n_tokens: n, start_pos: 0, block_table: prefill_table }],
        logit_rows: vec![n - 1],
        pending: Vec::new(),
    };
    for prefill_kernel in [true, false] {
        model.backend_mut().set_prefill_kernel(prefill_kernel);
        engine_step(&mut model, &prefill)?;
        let mut t = Vec::new();
        for _ in 0..3 {
            let s = Instant::now();
            engine_step(&mut model, &prefill)?;
            t.push(s.elapsed().as_secs_f64());
        }
        let ttft = median(t);
        let prefill_tflops = 2.0 * (weight_bytes / 2.0) * n as f64 / ttft / 1e12;
        let attn = if prefill_kernel { "prefill kernel" } else { "decode kernel" };
        writeln!(
            table,
            "TTFT 2048-token prompt, attention on the {attn}: {:.1} ms ({prefill_tflops:.0} TFLOP/s of GEMM work)",
            ttft * 1e3
        )?;
        json.push(format!(
            "{{\"name\":\"ttft\",\"prompt_tokens\":{n},\"prefill_kernel\":{prefill_kernel},\"ms\":{:.2},\"gemm_tflop_s\":{prefill_tflops:.1}}}",
            ttft * 1e3
        ));
    }
    model.backend_mut().set_prefill_kernel(true);

    // Decode, with CUDA graphs (the default) and op by op (`--enforce-eager`), in this run.
    let modes: Vec<bool> = match flag(&args, "--graphs").as_deref() {
        Some("on") => vec![true],
        Some("off") => vec![false],
        _ => vec![true, false],
    };
    for graphs in modes {
        model.backend_mut().set_graphs(graphs);
        let mode = if graphs { "graphs" } else { "eager" };
        // Single stream: 64 decode steps after a 128-token context.
        let steps = 64usize;
        let mut times = Vec::new();
        for s in 0..steps + 8 {
            let b = decode_batch(1, 128 + s);
            let st = Instant::now();
            engine_step(&mut model, &b)?;
            if s >= 8 {
                times.push(st.elapsed().as_secs_f64());
            }
        }
        let step = median(times);
        let roof = copy_gbs * 1e9 / weight_bytes;
        writeln!(
            table,
            "[{mode}] single-stream decode: {:.1} tok/s ({:.2} ms/step); roofline {roof:.1} tok/s; {:.1}% of roofline",
            1.0 / step,
            step * 1e3,
            100.0 / step / roof
        )?;
        json.push(format!(
            "{{\"name\":\"decode_single_stream\",\"graphs\":{graphs},\"context\":128,\"tok_s\":{:.2},\"ms_per_step\":{:.3},\"roofline_tok_s\":{roof:.2},\"frac_of_roofline\":{:.4}}}",
            1.0 / step,
            step * 1e3,
            1.0 / step / roof
        ));

        // Batched decode at `ctx` tokens of context.
        for &b in &batches {
            let mut times = Vec::new();
            for s in 0..24 {
                let lay = decode_batch(b, ctx + s);
                let st = Instant::now();
                engine_step(&mut model, &lay)?;
                if s >= 4 {
                    times.push(st.elapsed().as_secs_f64());
                }
            }
            let step = median(times);
            let bytes = weight_bytes + kv_per_token * (b * ctx) as f64;
            let floor = bytes / (copy_gbs * 1e9);
            writeln!(
                table,
                "[{mode}] batched decode b={b:3} ctx={ctx}: {:.0} tok/s ({:.2} ms/step); floor {:.2} ms (weights + KV at copy bandwidth): {:.1}%",
                b as f64 / step,
                step * 1e3,
                floor * 1e3,
                100.0 * floor / step
            )?;
            json.push(format!(
                "{{\"name\":\"decode_batched\",\"graphs\":{graphs},\"batch\":{b},\"context\":{ctx},\"tok_s\":{:.1},\"ms_per_step\":{:.3},\"floor_ms\":{:.3},\"frac_of_floor\":{:.4}}}",
                b as f64 / step,
                step * 1e3,
                floor * 1e3,
                floor / step
            ));
        }
        let st = model.backend().graph_stats();
        writeln!(
            table,
            "[{mode}] CUDA graphs: {} recorded, {} replayed, {} failed, {} invalidations",
            st.recorded, st.replayed, st.failed, st.invalidated
        )?;
    }

    let doc = format!(
        "{{\"benchmark\":\"bench-cuda\",\"device\":{device:?},\"commit\":{commit:?},\"command\":{:?},\"model_config\":{config:?},\"gemv\":{gemv},\"load_seconds\":{load_s:.1},\"results\":[\n{}\n]}}\n",
        args.join(" "),
        json.join(",\n")
    );
    std::fs::write(&out, doc)?;
    println!("{table}");
    Ok(())
}
