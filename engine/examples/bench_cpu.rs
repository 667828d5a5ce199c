//! CPU engine benchmark: single-stream prefill and decode tokens/s, and
//! throughput with concurrent streams, on a real model file (default: the
//! SmolLM2-135M Q4_1 GGUF, dequantized at load). Writes
//! `bench/results/engine-cpu-<device>-<date>.json` with the figures next to
//! the llama.cpp anchors measured on the same kind of machine.
//!
//! Usage: `cargo run --release -p baton-engine --example bench_cpu -- [MODEL] [--threads N] [--commit SHA] [--out FILE]`

use baton_core::api::{EngineClient, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::{DeviceSpec, EngineConfig, start_engine};
use baton_formats::{LoadFormat, load_model};
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn params(max: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(max), ignore_eos: true, ..SamplingParams::greedy() }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model_path = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let threads: usize = arg(&args, "--threads").map(|t| t.parse()).transpose()?.unwrap_or(2);
    let commit = arg(&args, "--commit").unwrap_or_else(|| "unknown".into());
    let t0 = Instant::now();
    let model = load_model(std::path::Path::new(&model_path), LoadFormat::Auto)?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size as u32;
    let engine = start_engine(
        &model,
        DeviceSpec::Cpu,
        EngineConfig { num_threads: Some(threads), max_model_len: Some(2048), ..EngineConfig::default() },
    )?;
    let prompt = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 7919)) % vocab).collect()
    };

    // Warm-up (page in weights, size workspaces).
    let mut s = engine.submit(EngineRequest::new(prompt(0, 64), params(4)))?;
    while let Some(o) = s.blocking_next() {
        if o?.finish_reason.is_some() {
            break;
        }
    }

    // Prefill: 512-token prompt, one output token; time to the first token.
    let mut pp = Vec::new();
    for r in 0..3 {
        let t = Instant::now();
        let mut s = engine.submit(EngineRequest::new(prompt(100 + r, 512), params(1)))?;
        while let Some(o) = s.blocking_next() {
            if o?.finish_reason.is_some() {
                break;
            }
        }
        pp.push(512.0 / t.elapsed().as_secs_f64());
    }
    pp.sort_by(f64::total_cmp);
    let prefill_tok_s = pp[1];

    // Decode: 128 tokens after a short prompt; rate over tokens 2..128.
    let mut tg = Vec::new();
    for r in 0..3 {
        let mut s = engine.submit(EngineRequest::new(prompt(200 + r, 8), params(128)))?;
        let mut first = None;
        let mut n = 0usize;
        while let Some(o) = s.blocking_next() {
            let o = o?;
            n += o.new_token_ids.len();
            if first.is_none() {
                first = Some(Instant::now());
            }
            if o.finish_reason.is_some() {
                break;
            }
        }
        let dt = first.map(|f| f.elapsed().as_secs_f64()).unwrap_or(f64::NAN);
        tg.push((n - 1) as f64 / dt);
    }
    tg.sort_by(f64::total_cmp);
    let decode_tok_s = tg[1];

    // Throughput: 8 concurrent streams of 128 tokens each.
    let streams = 8;
    let t = Instant::now();
    let subs: Vec<_> = (0..streams)
        .map(|i| engine.submit(EngineRequest::new(prompt(300 + i, 32), params(128))))
        .collect::<Result<_, _>>()?;
    let handles: Vec<_> = subs
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                let mut n = 0usize;
                while let Some(Ok(o)) = s.blocking_next() {
                    n += o.new_token_ids.len();
                    if o.finish_reason.is_some() {
                        break;
                    }
                }
                n
            })
        })
        .collect();
    let total: usize = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    let throughput = total as f64 / t.elapsed().as_secs_f64();
    engine.shutdown();

    let date = std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let device = format!("cpu{cores}c");
    let out = arg(&args, "--out").unwrap_or_else(|| format!("bench/results/engine-cpu-{device}-{date}.json"));
    let json = serde_json::json!({
        "name": "engine-cpu",
        "device": device,
        "date": date,
        "commit": commit,
        "command": format!("cargo run --release -p baton-engine --example bench_cpu -- {}", args.join(" ")),
        "model": model_path,
        "threads": threads,
        "weights_dtype": "f32 (dequantized at load)",
        "load_seconds": load_s,
        "figures": {
            "prefill_tok_s_pp512": prefill_tok_s,
            "decode_tok_s_tg128": decode_tok_s,
            "throughput_tok_s_8_streams_128_tokens": throughput,
        },
        "anchors_llama_cpp_2_threads": {
            "q4_1": {"pp512": 181.0, "tg128": 113.0},
            "f16": {"pp512": 367.0, "tg128": 72.0},
            "target_decode_tok_s": 36.0,
        },
    });
    if let Some(dir) = std::path::Path::new(&out).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    println!(
        "prefill {prefill_tok_s:.1} tok/s | decode {decode_tok_s:.1} tok/s | 8 streams {throughput:.1} tok/s | wrote {out}"
    );
    Ok(())
}
