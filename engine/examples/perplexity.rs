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
//! Beside perplexity, every run after the first is compared position by position with the bf16
//! run: the mean KL divergence KL(bf16 ‖ run) in nats per token, and how often the two agree on
//! the most likely next token. Perplexity over 2,048 tokens of a 135M model moves by ±0.5 points
//! between treatments that should be alike (session 30); the KL settles smaller differences.
//!
//! `fp8_weights_w8a16` is the FP8 weights with the activations left in bf16: what the CUDA
//! backend computes for decode batches up to 16 rows (the skinny FP8 kernel), where prefill and
//! larger batches quantize the activations per token (W8A8, the `fp8_weights` run).
//! `--runs NAME,...` runs only those (bf16 always runs first: it is every comparison's base).
//!
//! Usage: `cargo run --release -p baton-engine --example perplexity -- [MODEL] [--text FILE]
//! [--tokens N] [--calculate-kv-scales] [--runs NAME,...] [--commit SHA] [--out FILE]`

use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::kv_k_smoothing;
use baton_engine::runner::ModelRunner;
use baton_engine::weight_quantization::WeightQuantization;
use baton_formats::{ActivationQuant, LoadFormat, LoadedModel, load_model};

const CHUNK: usize = 256;
const BLOCK: usize = 16;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// Mean negative log-likelihood (nats per token) of `ids[1..]` given their prefixes.
/// One treatment: the KV cache's dtype, the weights' quantization, whether the activations of
/// FP8 products are quantized per token (W8A8) or left alone (W8A16), and whether the KV scales
/// are calibrated on the first prefill step.
struct Run {
    name: &'static str,
    kv: KvCacheDtype,
    weights: WeightQuantization,
    per_token_activations: bool,
    calibrate: bool,
    /// Key smoothing: the calibration tokens and the served context the shift is spread
    /// over (`kv_k_smoothing::calibrate`); `None`: keys unshifted.
    smoothing: Option<(Vec<u32>, usize)>,
}

/// What one run measured: the mean negative log-likelihood of the next token, and against the
/// base run (when given) the mean KL(base ‖ run) and the top-1 agreement.
struct RunStats {
    nll: f64,
    kl: Option<f64>,
    top1: Option<f64>,
}

/// What a run does with its log-probabilities per position (`vocab` each).
enum Base<'a> {
    /// Appends them here: this is the base run.
    Record(&'a mut Vec<f32>),
    /// Compares them with the base run's.
    Compare(&'a [f32]),
}

/// The run over `ids`, recording or comparing its log-probabilities as `base` says.
fn mean_nll(
    model: &LoadedModel,
    ids: &[u32],
    run: &Run,
    mut base: Base<'_>,
) -> Result<RunStats, Box<dyn std::error::Error>> {
    let store = model.weights.as_ref();
    let mut cfg = model.config.clone();
    run.weights.apply(&mut cfg);
    if !run.per_token_activations
        && let Some(q) = cfg.quantization.as_mut()
    {
        q.activations = ActivationQuant::None;
    }
    let mut r = ModelRunner::load(&cfg, store, CpuBackend::emulating_bf16())?;
    r.set_kv_cache_dtype(run.kv, store)?;
    let blocks = ids.len().div_ceil(BLOCK);
    r.alloc_kv_cache(blocks, BLOCK)?;
    if let Some((tokens, served)) = &run.smoothing {
        let done = kv_k_smoothing::calibrate(&mut r, tokens, (blocks, BLOCK), *served)?;
        println!("  key smoothing for contexts up to {served}: {done:?}");
    }
    if run.calibrate {
        r.calculate_kv_scales()?;
    }
    let table: Vec<u32> = (0..blocks as u32).collect();
    let vocab = model.config.vocab_size;
    let (mut nll, mut n) = (0.0f64, 0usize);
    let (mut kl, mut agree) = (0.0f64, 0usize);
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
        if run.calibrate && start == 0 {
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
            let lp = row.iter().map(|&x| (x as f64 - lse) as f32);
            match &mut base {
                Base::Record(k) => k.extend(lp),
                Base::Compare(b) => {
                    let b = b.get(n * vocab..(n + 1) * vocab).ok_or("the base run has fewer positions")?;
                    let lp: Vec<f32> = lp.collect();
                    kl += b.iter().zip(&lp).map(|(&p, &q)| (p as f64).exp() * (p as f64 - q as f64)).sum::<f64>();
                    agree += usize::from(argmax(b) == argmax(&lp));
                }
            }
            n += 1;
        }
    }
    let n_f = n.max(1) as f64;
    let compared = matches!(base, Base::Compare(_));
    Ok(RunStats { nll: nll / n_f, kl: compared.then_some(kl / n_f), top1: compared.then_some(agree as f64 / n_f) })
}

/// The index of the largest value (the first of equals).
fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (j, &x)| if x > b.1 { (j, x) } else { b }).0
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
    let run = |name, kv, weights, per_token_activations, calibrate| Run {
        name,
        kv,
        weights,
        per_token_activations,
        calibrate,
        smoothing: None,
    };
    let (auto, fp8kv, none, fp8w) =
        (KvCacheDtype::Auto, KvCacheDtype::Fp8E4M3, WeightQuantization::None, WeightQuantization::Fp8);
    let mut runs = vec![
        run("bf16", auto, none, true, false),
        run("fp8_kv", fp8kv, none, true, false),
        run("fp8_weights", auto, fp8w, true, false),
        run("fp8_weights_and_kv", fp8kv, fp8w, true, false),
        run("fp8_weights_w8a16", auto, fp8w, false, false),
    ];
    if calibrate {
        runs.push(run("fp8_kv_calibrated", fp8kv, none, true, true));
        runs.push(run("fp8_weights_and_kv_calibrated", fp8kv, fp8w, true, true));
    }
    // Key smoothing as the engine runs it (`--kv-k-smoothing auto`): the shift measured on
    // the calibration text, spread over the served context (the model's whole, unless
    // `--served-len N`).
    let served: usize =
        arg(&args, "--served-len").map(|t| t.parse()).transpose()?.unwrap_or(model.config.max_position_embeddings);
    let calibration = tok.encode(kv_k_smoothing::CALIBRATION_TEXT, true)?;
    for (name, weights) in [("fp8_kv_smoothed", none), ("fp8_weights_and_kv_smoothed", fp8w)] {
        runs.push(Run { smoothing: Some((calibration.clone(), served)), ..run(name, fp8kv, weights, true, false) });
    }
    if let Some(list) = arg(&args, "--runs") {
        let wanted: Vec<&str> = list.split(',').collect();
        if let Some(bad) = wanted.iter().find(|w| !runs.iter().any(|r| r.name == **w)) {
            let names: Vec<&str> = runs.iter().map(|r| r.name).collect();
            return Err(format!("--runs: no run named {bad} (runs: {})", names.join(", ")).into());
        }
        runs.retain(|r| r.name == "bf16" || wanted.contains(&r.name));
    }
    let mut stats: Vec<(&str, f64, RunStats)> = Vec::new();
    let mut base_lp = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let st = if i == 0 {
            mean_nll(&model, &ids, run, Base::Record(&mut base_lp))?
        } else {
            mean_nll(&model, &ids, run, Base::Compare(&base_lp))?
        };
        let p = st.nll.exp();
        let cmp = match (st.kl, st.top1) {
            (Some(kl), Some(t)) => format!(", KL vs bf16 {kl:.5} nats/token, top-1 agreement {:.2} %", 100.0 * t),
            _ => String::new(),
        };
        println!("{} tokens of {text_path}: perplexity {:30} {p:.4}{cmp}", ids.len(), run.name);
        stats.push((run.name, p, st));
    }
    let base = stats[0].1;
    let rel = |p: f64| (p / base - 1.0) * 100.0;
    for (name, p, _) in &stats[1..] {
        println!("  {name:30} {:+.3} % vs bf16", rel(*p));
    }
    let figure = |name: &str| stats.iter().find(|s| s.0 == name).map(|s| s.1);

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
            "perplexity_bf16": base,
            "perplexity_fp8_e4m3_kv": figure("fp8_kv"),
            "perplexity_fp8_weights": figure("fp8_weights"),
            "perplexity_fp8_weights_and_kv": figure("fp8_weights_and_kv"),
            "perplexity_fp8_weights_w8a16": figure("fp8_weights_w8a16"),
            "relative_change_percent_fp8_kv": figure("fp8_kv").map(rel),
            "relative_change_percent_fp8_weights": figure("fp8_weights").map(rel),
            "relative_change_percent_fp8_weights_and_kv": figure("fp8_weights_and_kv").map(rel),
            "relative_change_percent_fp8_weights_w8a16": figure("fp8_weights_w8a16").map(rel),
            "kv_scales": "from the checkpoint, else 1.0",
            "weight_scales": "per output channel, computed at load; activations per token, dynamic (w8a16: not quantized)",
        },
        "runs": stats.iter().map(|(name, p, st)| serde_json::json!({
            "run": name,
            "perplexity": p,
            "relative_change_percent": rel(*p),
            "kl_vs_bf16_nats_per_token": st.kl,
            "top1_agreement_with_bf16": st.top1,
        })).collect::<Vec<_>>(),
        "targets": "FP8 KV within 1 % of bf16; FP8 weights + KV within 2 % (issue 17)",
    });
    if calibrate {
        let figures = &mut json["figures"];
        figures["perplexity_fp8_e4m3_kv_calibrated"] = figure("fp8_kv_calibrated").into();
        figures["perplexity_fp8_weights_and_kv_calibrated"] = figure("fp8_weights_and_kv_calibrated").into();
        figures["relative_change_percent_fp8_kv_calibrated"] = figure("fp8_kv_calibrated").map(rel).into();
        figures["relative_change_percent_fp8_weights_and_kv_calibrated"] =
            figure("fp8_weights_and_kv_calibrated").map(rel).into();
        figures["kv_scales_calibrated"] =
            "amax(|K|)/200 and amax(|V|)/100 per layer from the first prefill step (the first chunk), then fixed"
                .into();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&json)? + "\n")?;
    println!("wrote {out}");
    Ok(())
}
