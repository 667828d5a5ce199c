//! The offline 1000/1000 workload through the scheduler alone, with no model: how many steps
//! it takes, how many preemptions and recomputed prompt tokens, and what a step-cost model of
//! the Llama-3.1-8B shape on an H100 says the run costs (a planning tool, not a benchmark:
//! nothing here runs a kernel).
//!
//! The step cost is the bytes and FLOPs a step must move: the weights (16 GB, at the 85 % of
//! copy the decode step reaches: 6.3 ms), every scheduled row's KV (128 KB a token at 2.6 TB/s,
//! decode attention's 87 % of copy at large batches) and 16 GFLOP per prompt token at
//! 600 TFLOP/s. At 436,368 KV tokens (bf16) and 256 sequences it predicts 4,467 steps and
//! 136.0 s (7,354 output tok/s) where `bench_throughput` measured 4,469 steps and 134.5 s
//! (7,436 tok/s, H100, 27da163), so it is a fair map of where that run's time goes.
//!
//! Usage: `cargo run --release -p baton-core --example offline_model -- [KV_TOKENS] [MAX_SEQS]
//! [BATCHED_TOKENS] [PROMPTS] [ISL] [OSL]` (defaults 436368 256 8192 1000 1000 1000).

use baton_core::api::{EngineRequest, RequestId};
use baton_core::params::SamplingParams;
use baton_core::scheduler::{Scheduler, SchedulerConfig};

/// Milliseconds a step spends reading the weights.
const WEIGHTS_MS: f64 = 6.3;
/// KV bytes a token per step, and the rate attention reads them at.
const KV_BYTES_PER_TOKEN: f64 = 131_072.0;
const KV_BYTES_PER_S: f64 = 2.6e12;
/// FLOPs per prompt token, and the rate prefill runs at.
const PREFILL_FLOP_PER_TOKEN: f64 = 16e9;
const PREFILL_FLOP_PER_S: f64 = 600e12;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|v| v.parse().expect("a number")).collect();
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (kv_tokens, max_seqs, budget) = (get(0, 436_368), get(1, 256), get(2, 8192));
    let (prompts, isl, osl) = (get(3, 1000), get(4, 1000), get(5, 1000));
    let cfg = SchedulerConfig {
        block_size: 16,
        num_blocks: kv_tokens / 16,
        max_num_seqs: max_seqs,
        max_num_batched_tokens: budget,
        max_model_len: isl + osl,
        max_waiting: prompts.max(1),
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).expect("a valid scheduler config");
    // Distinct random prompts (a linear congruential stream), so no prefix is shared.
    let mut x = 1u64;
    for i in 0..prompts as u64 {
        let prompt: Vec<u32> = (0..isl)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % 30000 + 10) as u32
            })
            .collect();
        let p = SamplingParams { max_tokens: Some(osl), ignore_eos: true, ..SamplingParams::greedy() };
        s.add_request(RequestId(i), EngineRequest::new(prompt, p), &[]).expect("the request fits");
    }
    let (mut steps, mut rows, mut prompt_tokens) = (0usize, 0usize, 0usize);
    let (mut weights_ms, mut kv_ms, mut prefill_ms) = (0f64, 0f64, 0f64);
    while s.has_unfinished() {
        let out = s.schedule();
        let sampled: Vec<_> = out.seqs.iter().filter(|q| q.sample).map(|q| (q.id, 7u32)).collect();
        let fed: usize = out.seqs.iter().filter(|q| q.token_ids.len() > 1).map(|q| q.token_ids.len()).sum();
        let ctx: usize = out.seqs.iter().map(|q| q.end_pos()).sum();
        weights_ms += WEIGHTS_MS;
        kv_ms += ctx as f64 * KV_BYTES_PER_TOKEN / KV_BYTES_PER_S * 1e3;
        prefill_ms += fed as f64 * PREFILL_FLOP_PER_TOKEN / PREFILL_FLOP_PER_S * 1e3;
        steps += 1;
        rows += out.seqs.len();
        prompt_tokens += fed;
        s.update(&out, &sampled);
    }
    let total_s = (weights_ms + kv_ms + prefill_ms) / 1e3;
    println!(
        "KV {kv_tokens} tokens, {max_seqs} seqs, {budget} batched tokens: {steps} steps, {:.1} rows a step, {} preemptions, {} prompt tokens recomputed",
        rows as f64 / steps.max(1) as f64,
        s.num_preemptions(),
        prompt_tokens.saturating_sub(prompts * isl),
    );
    println!(
        "modelled {total_s:.1} s = weights {:.1} + KV {:.1} + prefill {:.1}: {:.0} output tok/s",
        weights_ms / 1e3,
        kv_ms / 1e3,
        prefill_ms / 1e3,
        (prompts * osl) as f64 / total_s
    );
}
