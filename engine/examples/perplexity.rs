//! Perplexity of a fixed text with the bf16 KV cache and with the FP8 (E4M3) KV cache, on
//! the CPU reference backend emulating the CUDA backend's bf16 storage (so the only
//! difference between the two runs is the cache's element type). Default text:
//! `bench/data/eighty-days-ch1-2.txt` (public domain; see `bench/data/README.md`), its first
//! 2,048 tokens; default model: SmolLM2-135M. The text is fed in chunks of 256 tokens
//! through the paged cache, so every chunk after the first attends to (dequantized) cached
//! K/V. Writes `bench/results/perplexity-fp8-kv-<device>-<date>.json`.
//!
//! Usage: `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo run -p baton-engine --example perplexity --
//! [MODEL] [--text FILE] [--tokens N] [--commit SHA] [--out FILE]`

use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::runner::ModelRunner;
use baton_formats::{LoadFormat, LoadedModel, load_model};

const CHUNK: usize = 256;
const BLOCK: usize = 16;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// Mean negative log-likelihood (nats per token) of `ids[1..]` given their prefixes.
fn mean_nll(model: &LoadedModel, ids: &[u32], dtype: KvCacheDtype) -> Result<f64, Box<dyn std::error::Error>> {
    let store = model.weights.as_ref();
    let mut r = ModelRunner::load(&model.config, store, CpuBackend::emulating_bf16())?;
    r.set_kv_cache_dtype(dtype, store)?;
    let blocks = ids.len().div_ceil(BLOCK);
    r.alloc_kv_cache(blocks, BLOCK)?;
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
    let bf16 = mean_nll(&model, &ids, KvCacheDtype::Auto)?;
    let fp8 = mean_nll(&model, &ids, KvCacheDtype::Fp8E4M3)?;
    let (ppl_bf16, ppl_fp8) = (bf16.exp(), fp8.exp());
    let rel = (ppl_fp8 / ppl_bf16 - 1.0) * 100.0;
    println!(
        "{} tokens of {text_path}: perplexity bf16 KV {ppl_bf16:.4}, FP8 KV {ppl_fp8:.4} ({rel:+.3} %)",
        ids.len()
    );

    let date = std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let device = "cpu-bf16-emulation";
    let out = arg(&args, "--out").unwrap_or_else(|| format!("bench/results/perplexity-fp8-kv-{device}-{date}.json"));
    let json = serde_json::json!({
        "name": "perplexity-fp8-kv",
        "device": device,
        "date": date,
        "commit": commit,
        "command": format!("cargo run -p baton-engine --example perplexity -- {}", args.join(" ")),
        "model": model_path,
        "text": text_path,
        "tokens": ids.len(),
        "chunk_tokens": CHUNK,
        "figures": {
            "perplexity_bf16_kv": ppl_bf16,
            "perplexity_fp8_e4m3_kv": ppl_fp8,
            "relative_change_percent": rel,
            "kv_scales": "from the checkpoint, else 1.0",
        },
        "target": "FP8 KV perplexity within 1 % of bf16 KV (issue 17)",
    });
    std::fs::write(&out, serde_json::to_string_pretty(&json)? + "\n")?;
    println!("wrote {out}");
    Ok(())
}
