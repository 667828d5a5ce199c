//! Offline throughput (a benchmark program, not a test), as vLLM's `benchmark_throughput`
//! measures it: every prompt is submitted at once to one engine (random token ids, random
//! weights via `--load-format dummy`, `ignore_eos` so every request makes exactly `--osl`
//! tokens), and the figure is output tokens ÷ wall time from the first submission to the
//! last token. The engine's own scheduler decides batching, chunked prefill and preemption,
//! so this covers the whole engine path: scheduling, the forward step, the logits' trip to
//! the sampler and sampling.
//!
//! Usage: `bench_throughput --config configs/models/llama-3.1-8b.json --out OUT.json
//! [--device cuda:0] [--prompts 1000] [--isl 128] [--osl 128] [--max-num-seqs 256]
//! [--max-num-batched-tokens 8192] [--commit C] [--time-limit-s 300]
//! [--async-scheduling on|off|both] [--kv-cache-dtype auto|bf16|fp8] [--quantization none|fp8]`
//! (`fp8`: the projections quantized at load per output channel, as `baton serve` does). When the time limit passes first, the figures cover the
//! requests that finished and the JSON says `timed_out`. `both` runs the workload with async
//! scheduling off, then on, on one loaded model, and writes a JSON array of the two runs.
//! Each run also records where the engine thread's time went (`StepTiming`): host time and
//! time waiting for sampled tokens, per step, and how many steps were planned ahead.

use baton_core::api::{EngineClient, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::{DeviceSpec, EngineConfig, StepTiming, start_engine};
use baton_formats::testing::random_token_ids;
use baton_formats::{LoadFormat, load_model};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_throughput: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Res<T>
where
    T::Err: std::error::Error + 'static,
{
    match flag(args, name) {
        Some(v) => Ok(v.parse()?),
        None => Ok(default),
    }
}

/// One workload's figures.
struct Figures {
    async_scheduling: bool,
    /// Tokens the engine's KV cache holds (its blocks × block size), as sized from free memory.
    kv_tokens: usize,
    finished: usize,
    output_tokens: usize,
    elapsed: f64,
    timed_out: bool,
    timing: StepTiming,
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let config = flag(&args, "--config").ok_or("--config PATH is required")?;
    let out = flag(&args, "--out").unwrap_or_else(|| "bench-throughput.json".into());
    let commit = flag(&args, "--commit").unwrap_or_default();
    let device: DeviceSpec = flag(&args, "--device").unwrap_or_else(|| "cuda:0".into()).parse()?;
    let prompts: usize = num(&args, "--prompts", 1000)?;
    let isl: usize = num(&args, "--isl", 128)?;
    let osl: usize = num(&args, "--osl", 128)?;
    let time_limit = Duration::from_secs_f64(num(&args, "--time-limit-s", 300.0)?);
    let modes: Vec<bool> = match flag(&args, "--async-scheduling").as_deref().unwrap_or("on") {
        "on" => vec![true],
        "off" => vec![false],
        "both" => vec![false, true],
        other => return Err(format!("--async-scheduling takes on, off or both, not {other}").into()),
    };
    let base_cfg = EngineConfig {
        max_num_seqs: num(&args, "--max-num-seqs", 256)?,
        max_num_batched_tokens: num(&args, "--max-num-batched-tokens", 8192)?,
        max_model_len: Some(isl + osl + 16),
        // Random prompts share no prefix; caching would only add bookkeeping.
        enable_prefix_caching: false,
        max_waiting: prompts + 1,
        kernel_cache_dir: Some(std::env::temp_dir().join("baton-bench-kernels")),
        kv_cache_dtype: flag(&args, "--kv-cache-dtype").as_deref().unwrap_or("auto").parse()?,
        quantization: flag(&args, "--quantization").as_deref().unwrap_or("none").parse()?,
        ..EngineConfig::default()
    };

    let t_load = Instant::now();
    let loaded = load_model(std::path::Path::new(&config), LoadFormat::Dummy)?;
    let load_s = t_load.elapsed().as_secs_f64();
    println!(
        "loaded {config} in {load_s:.1} s; {prompts} prompts, ISL {isl}, OSL {osl}; KV cache {:?}; weights {}",
        base_cfg.kv_cache_dtype, base_cfg.quantization
    );
    let mut runs = Vec::new();
    for async_scheduling in modes {
        let cfg = EngineConfig { async_scheduling, ..base_cfg.clone() };
        let block_size = cfg.block_size;
        let engine = start_engine(&loaded, device, cfg)?;
        let kv_tokens = engine.stats().num_total_blocks * block_size;
        let mut f = workload(&engine, loaded.config.vocab_size, prompts, isl, osl, time_limit, async_scheduling)?;
        f.kv_tokens = kv_tokens;
        engine.shutdown();
        let t = &f.timing;
        println!(
            "async scheduling {}: KV cache {} tokens; finished {}/{prompts} in {:.1} s: {:.0} output tok/s{}; {} steps ({} planned ahead), host {:.3} ms and wait {:.3} ms per step",
            if async_scheduling { "on" } else { "off" },
            f.kv_tokens,
            f.finished,
            f.elapsed,
            f.output_tokens as f64 / f.elapsed,
            if f.timed_out { " (time limit hit: figures over the requests that finished)" } else { "" },
            t.steps,
            t.planned_ahead,
            t.host_ms_per_step(),
            t.wait_ms_per_step(),
        );
        runs.push(f);
    }
    let json: Vec<String> = runs
        .iter()
        .map(|f| {
            let t = &f.timing;
            format!(
                concat!(
                    "{{\"benchmark\":\"offline_throughput\",\"config\":{:?},\"device\":\"{}\",\"commit\":{:?},\"kv_cache_dtype\":\"{:?}\",\"weights\":\"{}\",\"kv_tokens\":{},",
                    "\"prompts\":{},\"finished\":{},\"isl\":{},\"osl\":{},\"max_num_seqs\":{},\"max_num_batched_tokens\":{},",
                    "\"async_scheduling\":{},\"elapsed_s\":{:.3},\"output_tok_s\":{:.1},\"total_tok_s\":{:.1},\"req_s\":{:.3},",
                    "\"timed_out\":{},\"steps\":{},\"planned_ahead\":{},\"host_ms_per_step\":{:.4},\"wait_ms_per_step\":{:.4}}}"
                ),
                config,
                device,
                commit,
                base_cfg.kv_cache_dtype,
                base_cfg.quantization,
                f.kv_tokens,
                prompts,
                f.finished,
                isl,
                osl,
                base_cfg.max_num_seqs,
                base_cfg.max_num_batched_tokens,
                f.async_scheduling,
                f.elapsed,
                f.output_tokens as f64 / f.elapsed,
                (f.finished * isl + f.output_tokens) as f64 / f.elapsed,
                f.finished as f64 / f.elapsed,
                f.timed_out,
                t.steps,
                t.planned_ahead,
                t.host_ms_per_step(),
                t.wait_ms_per_step(),
            )
        })
        .collect();
    let body = if json.len() == 1 { json[0].clone() } else { format!("[{}]", json.join(",\n")) };
    std::fs::write(&out, body + "\n")?;
    Ok(())
}

/// Submits every prompt at once and waits for the last token (or the time limit).
fn workload(
    engine: &baton_engine::EngineHandle,
    vocab: usize,
    prompts: usize,
    isl: usize,
    osl: usize,
    time_limit: Duration,
    async_scheduling: bool,
) -> Res<Figures> {
    let timing0 = engine.step_timing();
    let params = SamplingParams { max_tokens: Some(osl), ignore_eos: true, ..SamplingParams::greedy() };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let (finished, output_tokens, elapsed, timed_out) = rt.block_on(async {
        let start = Instant::now();
        let mut tasks = Vec::with_capacity(prompts);
        for i in 0..prompts {
            let req = EngineRequest::new(random_token_ids(i as u64 + 1, isl, vocab), params.clone());
            let mut stream = engine.submit(req)?;
            tasks.push(tokio::spawn(async move {
                let mut n = 0usize;
                while let Some(o) = stream.next().await {
                    let o = o.map_err(|e| e.to_string())?;
                    n += o.new_token_ids.len();
                    if o.finish_reason.is_some() {
                        return Ok::<_, String>((n, Instant::now()));
                    }
                }
                Err("the stream ended without a finish reason".to_string())
            }));
        }
        let deadline = tokio::time::Instant::now() + time_limit;
        let (mut finished, mut tokens, mut last) = (0usize, 0usize, start);
        let mut timed_out = false;
        for t in tasks {
            match tokio::time::timeout_at(deadline, t).await {
                Ok(joined) => {
                    let (n, at) = joined.map_err(|e| e.to_string())??;
                    finished += 1;
                    tokens += n;
                    last = last.max(at);
                }
                Err(_) => {
                    timed_out = true;
                    break;
                }
            }
        }
        Ok::<_, Box<dyn std::error::Error>>((finished, tokens, (last - start).as_secs_f64(), timed_out))
    })?;
    Ok(Figures {
        async_scheduling,
        kv_tokens: 0,
        finished,
        output_tokens,
        elapsed,
        timed_out,
        timing: engine.step_timing().since(&timing0),
    })
}
