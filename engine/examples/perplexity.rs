//! Perplexity of a fixed text with bf16 weights and KV cache, with the FP8 (E4M3) KV cache,
//! with FP8 weights (quantized at load per output channel, dynamic per-token activations: the
//! `--quantization fp8` reference), and with both, on the CPU reference backend emulating the
//! CUDA backend's bf16 storage (so the runs differ only in what is quantized). Default text:
//! `bench/data/eighty-days-ch1-2.txt` (public domain; see `bench/data/README.md`), its first
//! 2,048 tokens; default model: SmolLM2-135M. The text is fed in chunks of 256 tokens
//! through the paged cache, so every chunk after the first attends to (dequantized) cached
//! K/V. Writes `bench/results/perplexity-fp8-<device>-<date>.json`.
//!
//! With `--calculate-kv-scales`, the two FP8 KV runs are repeated with the scales calculated
//! from the first prefill step (the first chunk; `--calculate-kv-scales` as the engine runs it)
//! and the JSON goes to `bench/results/perplexity-fp8-calibrated-<device>-<date>.json`.
//!
//! Usage: `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo run -p baton-engine --example perplexity --
//! [MODEL] [--text FILE] [--tokens N] [--calculate-kv-scales] [--commit SHA] [--out FILE]`

use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::runner::ModelRunner;
use baton_engine::weight_quantization::WeightQuantization;
use baton_formats::{LoadFormat, LoadedModel, load_model};

const CHUNK: usize = 256;
const BLOCK: usize = 16;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// Mean negative log-likelihood (nats per token) of `ids[1..]` given their prefixes.
fn mean_nll(
    model: &LoadedModel,
    ids: &[u32],
    (dtype, weights, calibrate): (KvCacheDtype, WeightQuantization, bool),
) -> Result<f64, Box<dyn std::error::Error>> {
    let store = model.weights.as_ref();
    let mut cfg = model.config.clone();
    weights.apply(&mut cfg);
    let mut r = ModelRunner::load(&cfg, store, CpuBackend::emulating_bf16())?;
    r.set_kv_cache_dtype(dtype, store)?;
    let blocks = ids.len().div_ceil(BLOCK);
    r.alloc_kv_cache(blocks, BLOCK)?;
    if calibrate {
        r.calculate_kv_scales()?;
    }
    let table: Vec<u32> = (0..blocks as u32).collect();
    let vocab = model.config.vocab_size;
    let (mut nll, mut n) = (0.0f64, 0usize);
    for start in (0..ids.len()).step_by(CHUNK) {
        let chunk = &ids[start..(start + CHUNK).min(ids.len())];
        let batch = BatchLayout {
            tokens: chunk.to_vec(),
            positions: (start..start + chunk.len()).collect(),
            seqs: vec![SeqLayout { row_start: 0, n_tokens: chunk.len(), start_pos: start, block_table: table.clone() }],
            logit_rows: (0..chunk.len()).collect(),
            pending: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        let logits = r.forward(&batch)?;
        if calibrate && start == 0 {
            let scales = r.kv_scales();
            let (kmin, kmax) = scales.iter().fold((f32::MAX, 0.0f32), |(a, b), s| (a.min(s.k), b.max(s.k)));
            let (vmin, vmax) = scales.iter().fold((f32::MAX, 0.0f32), |(a, b), s| (a.min(s.v), b.max(s.v)));
            println!(
                "  calibrated scales: k {kmin:.4}..{kmax:.4}, v {vmin:.4}..{vmax:.4} over {} layers",
                scales.len()
            );
        }
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            let Some(&next) = ids.get(start + i + 1) else { break };
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            nll += lse - row[next as usize] as f64;
            n += 1;
        }
    }
    Ok(nll / n.max(1) as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model_path = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let text_path = arg(&args, "--text").unwrap_or_else(|| "bench/data/eighty-days-ch1-2.txt".into());
    let want: usize = arg(&args, "--tokens").map(|t| t.parse()).transpose()?.unwrap_or(2048);
    let commit = arg(&args, "--commit").unwrap_or_else(|| "unknown".into());
    let model = load_model(std::path::Path::new(&model_path), LoadFormat::Auto)?;
    let tok = model.tokenizer.as_ref().ok_or("the model has no tokenizer")?;
    let text = std::fs::read_to_string(&text_path)?;
    let mut ids = tok.encode(&text, false)?;
    if ids.len() < want {
        return Err(format!("{text_path} has {} tokens, fewer than --tokens {want}", ids.len()).into());
    }
    ids.truncate(want);
    let calibrate = args.iter().any(|a| a == "--calculate-kv-scales");
    let mut runs = vec![
        ("bf16", KvCacheDtype::Auto, WeightQuantization::None, false),
        ("fp8_kv", KvCacheDtype::Fp8E4M3, WeightQuantization::None, false),
        ("fp8_weights", KvCacheDtype::Auto, WeightQuantization::Fp8, false),
        ("fp8_weights_and_kv", KvCacheDtype::Fp8E4M3, WeightQuantization::Fp8, false),
    ];
    if calibrate {
        runs.push(("fp8_kv_calibrated", KvCacheDtype::Fp8E4M3, WeightQuantization::None, true));
        runs.push(("fp8_weights_and_kv_calibrated", KvCacheDtype::Fp8E4M3, WeightQuantization::Fp8, true));
    }
    let mut ppl = Vec::new();
    for (name, kv, w, cal) in runs {
        let p = mean_nll(&model, &ids, (kv, w, cal))?.exp();
        println!("{} tokens of {text_path}: perplexity {name:20} {p:.4}", ids.len());
        ppl.push((name, p));
    }
    let base = ppl[0].1;
    let rel = |p: f64| (p / base - 1.0) * 100.0;
    for &(name, p) in &ppl[1..] {
        println!("  {name:20} {:+.3} % vs bf16", rel(p));
    }

    let date = std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let device = "cpu-bf16-emulation";
    let name = if calibrate { "perplexity-fp8-calibrated" } else { "perplexity-fp8" };
    let out = arg(&args, "--out").unwrap_or_else(|| format!("bench/results/{name}-{device}-{date}.json"));
    let mut json = serde_json::json!({
        "name": name,
        "device": device,
        "date": date,
        "commit": commit,
        "command": format!("cargo run -p baton-engine --example perplexity -- {}", args.join(" ")),
        "model": model_path,
        "text": text_path,
        "tokens": ids.len(),
        "chunk_tokens": CHUNK,
        "figures": {
            "perplexity_bf16": ppl[0].1,
            "perplexity_fp8_e4m3_kv": ppl[1].1,
            "perplexity_fp8_weights": ppl[2].1,
            "perplexity_fp8_weights_and_kv": ppl[3].1,
            "relative_change_percent_fp8_kv": rel(ppl[1].1),
            "relative_change_percent_fp8_weights": rel(ppl[2].1),
            "relative_change_percent_fp8_weights_and_kv": rel(ppl[3].1),
            "kv_scales": "from the checkpoint, else 1.0",
            "weight_scales": "per output channel, computed at load; activations per token, dynamic",
        },
        "targets": "FP8 KV within 1 % of bf16; FP8 weights + KV within 2 % (issue 17)",
    });
    if calibrate {
        let figures = &mut json["figures"];
        figures["perplexity_fp8_e4m3_kv_calibrated"] = ppl[4].1.into();
        figures["perplexity_fp8_weights_and_kv_calibrated"] = ppl[5].1.into();
        figures["relative_change_percent_fp8_kv_calibrated"] = rel(ppl[4].1).into();
        figures["relative_change_percent_fp8_weights_and_kv_calibrated"] = rel(ppl[5].1).into();
        figures["kv_scales_calibrated"] =
            "amax(|K|)/200 and amax(|V|)/100 per layer from the first prefill step (the first chunk), then fixed"
                .into();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&json)? + "\n")?;
    println!("wrote {out}");
    Ok(())
}
