//! Greedy decoding of a Hugging Face model folder on the CUDA (or CPU) backend, dumped as
//! JSON for comparison with transformers (`scripts/golden/hf_compare.py`).
//!
//! All prompts run as one batch through [`ModelRunner::forward`] (their prefills in one mixed
//! step, then one decode row each per step), so the dump also exercises batching. For each
//! prompt it writes the greedy tokens and, at every step, the top logits (id, logit) and the
//! log-sum-exp of the step's logits; the full f32 logits of the first step (the prompt's
//! last position) of every prompt go to `OUT.logits0.f32` (prompts × vocab, little endian).
//!
//! Usage:
//!   greedy_dump write-tiny DIR
//!       writes the tiny test models (`TinySpec` llama / qwen2 / tied, each also with the
//!       well-conditioned init `init_std 0.5` as `<name>_wc`) as HF folders under DIR;
//!   greedy_dump run MODEL_DIR PROMPTS.json OUT.json [--steps N] [--device cuda|cpu] [--top K]
//!       PROMPTS.json is a JSON list of lists of token ids.

use baton_engine::backend::{Backend, BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::testing::{TinySpec, write_hf_folder};
use baton_formats::{LoadFormat, load_model};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = real_main() {
        eprintln!("greedy_dump: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("write-tiny") => {
            let dir = PathBuf::from(args.get(1).ok_or("write-tiny needs DIR")?);
            for (name, spec) in [("llama", TinySpec::llama()), ("qwen2", TinySpec::qwen2()), ("tied", TinySpec::tied())]
            {
                write_hf_folder(&dir.join(name), &spec)?;
                let wc = TinySpec { init_std: 0.5, seed: spec.seed + 1000, ..spec };
                write_hf_folder(&dir.join(format!("{name}_wc")), &wc)?;
            }
            Ok(())
        }
        Some("run") => {
            let model_dir = PathBuf::from(args.get(1).ok_or("run needs MODEL_DIR")?);
            let prompts_path = PathBuf::from(args.get(2).ok_or("run needs PROMPTS.json")?);
            let out = PathBuf::from(args.get(3).ok_or("run needs OUT.json")?);
            let mut steps = 64usize;
            let mut top = 8usize;
            let mut device = "cuda".to_string();
            let mut i = 4;
            while i < args.len() {
                let v = args.get(i + 1).ok_or("flag without a value")?;
                match args[i].as_str() {
                    "--steps" => steps = v.parse()?,
                    "--top" => top = v.parse()?,
                    "--device" => device = v.clone(),
                    f => return Err(format!("unknown flag {f}").into()),
                }
                i += 2;
            }
            let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(&prompts_path)?)?;
            run(&model_dir, &prompts, steps, top, &device, &out)
        }
        _ => Err("usage: greedy_dump write-tiny DIR | greedy_dump run MODEL_DIR PROMPTS.json OUT.json [--steps N] [--device cuda|cpu] [--top K]".into()),
    }
}

fn run(model_dir: &Path, prompts: &[Vec<u32>], steps: usize, top: usize, device: &str, out: &Path) -> Res<()> {
    let loaded = load_model(model_dir, LoadFormat::Auto)?;
    let t0 = std::time::Instant::now();
    let (per_prompt, logits0, dev_name) = match device {
        "cuda" => {
            let cache = std::env::temp_dir().join("baton-greedy-dump-kernels");
            let opts = baton_kernels::cuda::CudaOptions { ordinal: 0, cache_dir: Some(cache), ..Default::default() };
            let backend = baton_engine::backend::cuda::CudaBackend::new(&opts)?;
            let name = backend.device().name().to_string();
            let model = ModelRunner::load(&loaded.config, loaded.weights.as_ref(), backend)?;
            let (a, b) = decode(model, prompts, steps, top)?;
            (a, b, name)
        }
        "cpu" => {
            let model = ModelRunner::load(
                &loaded.config,
                loaded.weights.as_ref(),
                baton_engine::backend::cpu::CpuBackend::new(),
            )?;
            let (a, b) = decode(model, prompts, steps, top)?;
            (a, b, "cpu".to_string())
        }
        d => return Err(format!("unknown device {d}").into()),
    };
    let secs = t0.elapsed().as_secs_f64();
    let mut json = String::new();
    write!(
        json,
        "{{\"model\":{:?},\"device\":{dev_name:?},\"backend\":{device:?},\"steps\":{steps},\"seconds\":{secs:.3},\"prompts\":[",
        model_dir.display().to_string()
    )?;
    for (pi, (p, (toks, recs))) in prompts.iter().zip(&per_prompt).enumerate() {
        if pi > 0 {
            json.push(',');
        }
        write!(json, "{{\"prompt\":{p:?},\"tokens\":{toks:?},\"steps\":[")?;
        for (si, (lse, tops)) in recs.iter().enumerate() {
            if si > 0 {
                json.push(',');
            }
            let t: Vec<String> = tops.iter().map(|(id, l)| format!("[{id},{l}]")).collect();
            write!(json, "{{\"lse\":{lse},\"top\":[{}]}}", t.join(","))?;
        }
        json.push_str("]}");
    }
    json.push_str("]}\n");
    std::fs::write(out, json)?;
    let bytes: Vec<u8> = logits0.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(out.with_extension("logits0.f32"), bytes)?;
    println!("{}: {} prompts × {steps} tokens on {dev_name} in {secs:.2} s", model_dir.display(), prompts.len());
    Ok(())
}

/// Per prompt: greedy tokens, and per step (log-sum-exp, top (id, logit)).
type PerPrompt = Vec<(Vec<u32>, Vec<(f64, Vec<(u32, f32)>)>)>;

fn decode<B: Backend>(
    mut model: ModelRunner<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    top: usize,
) -> Res<(PerPrompt, Vec<f32>)> {
    let bs = 16usize;
    let vocab = model.config().vocab_size;
    let per_seq = prompts.iter().map(|p| (p.len() + steps).div_ceil(bs)).max().unwrap_or(1);
    model.alloc_kv_cache(per_seq * prompts.len(), bs)?;
    let tables: Vec<Vec<u32>> =
        (0..prompts.len()).map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect()).collect();
    let mut out: PerPrompt = prompts.iter().map(|_| (Vec::new(), Vec::new())).collect();
    let mut logits0 = Vec::new();
    // Step 0: every prompt's prefill in one mixed batch.
    let mut batch = BatchLayout::default();
    for (i, p) in prompts.iter().enumerate() {
        let row = batch.tokens.len();
        batch.tokens.extend_from_slice(p);
        batch.positions.extend(0..p.len());
        batch.seqs.push(SeqLayout { row_start: row, n_tokens: p.len(), start_pos: 0, block_table: tables[i].clone() });
        batch.logit_rows.push(row + p.len() - 1);
    }
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for step in 0..steps {
        let logits = model.forward(&batch)?;
        if step == 0 {
            logits0 = logits.clone();
        }
        let mut next = BatchLayout::default();
        for (i, row) in logits.chunks(vocab).enumerate() {
            let (tok, rec) = summarize(row, top);
            out[i].0.push(tok);
            out[i].1.push(rec);
            next.tokens.push(tok);
            next.positions.push(pos[i]);
            next.seqs.push(SeqLayout { row_start: i, n_tokens: 1, start_pos: pos[i], block_table: tables[i].clone() });
            next.logit_rows.push(i);
            pos[i] += 1;
        }
        batch = next;
    }
    Ok((out, logits0))
}

/// The argmax (lowest id on ties) and (log-sum-exp, top-k by logit) of one row.
fn summarize(row: &[f32], k: usize) -> (u32, (f64, Vec<(u32, f32)>)) {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.clamp(1, row.len());
    idx.select_nth_unstable_by(k - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let mut tops: Vec<(u32, f32)> = idx[..k].iter().map(|&i| (i, row[i as usize])).collect();
    tops.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mx = tops[0].1 as f64;
    let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
    (tops[0].0, (lse, tops))
}
