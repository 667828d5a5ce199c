//! The device sampler (`sample_rows` in kernels/cuda/sampling.cu, driven through the CUDA
//! backend's row conversion) against the CPU sampler `baton_core::sampling::sample`, on fresh
//! random rows (the seed is printed): Llama 3's vocabulary and odd sizes, rows with exact
//! ties, NaN and ±inf, all `-inf`, flat rows; random parameters covering greedy, temperature
//! with and without top_k / top_p / min_p, penalties over histories, logit_bias, min_tokens,
//! 0–20 logprobs and many seeds, and grammar masks (sparse, dense, empty, shorter than
//! the row). Tokens must be identical; logprobs within 1e-4.
//!
//! Named `gpu_*`: excluded from CI by name, and it FAILS when no GPU is present.

use baton_core::params::SamplingParams;
use baton_core::sampling::{Sampled, SamplingContext, plan_row, sample};
use baton_core::structured::TokenMask;
use baton_engine::backend::cuda::{device_ops, device_row, sampled};
use baton_kernels::cuda::{CudaDevice, CudaOptions, SampleBuffers};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn device() -> CudaDevice {
    let cache = std::env::temp_dir().join("baton-gpu-test-kernels");
    CudaDevice::open(&CudaOptions { ordinal: 0, cache_dir: Some(cache), ..Default::default() })
        .expect("a CUDA device is required for gpu_* tests")
}

/// One row of a given character.
fn random_row(r: &mut StdRng, vocab: usize, kind: u32) -> Vec<f32> {
    match kind {
        // Coarse values: many exact ties, at the top too.
        0 => (0..vocab).map(|_| (r.random_range(-8.0f32..8.0) * 2.0).round() / 2.0).collect(),
        // Specials sprinkled into a normal row.
        1 => (0..vocab)
            .map(|_| match r.random_range(0..50) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                _ => r.random_range(-10.0f32..10.0),
            })
            .collect(),
        2 => vec![f32::NEG_INFINITY; vocab],
        3 => vec![1.25; vocab],
        // A peaked row like a real model's: a few large logits over a flat tail.
        4 => {
            (0..vocab)
                .map(|_| {
                    if r.random_range(0..1000) == 0 {
                        r.random_range(5.0f32..15.0)
                    } else {
                        r.random_range(-4.0f32..2.0)
                    }
                })
                .collect()
        }
        _ => (0..vocab).map(|_| r.random_range(-12.0f32..12.0)).collect(),
    }
}

fn random_ids(r: &mut StdRng, max_n: usize, vocab: usize) -> Vec<u32> {
    let n = r.random_range(0..=max_n);
    (0..n).map(|_| r.random_range(0..vocab as u32 + 2)).collect()
}

/// A request's sampling state: parameters and histories.
struct Case {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    seed: u64,
}

fn random_case(r: &mut StdRng, vocab: usize) -> Case {
    let greedy = r.random_range(0..5) == 0;
    let mut p = if greedy { SamplingParams::greedy() } else { SamplingParams::default() };
    if !greedy {
        p.temperature = r.random_range(0.05f32..2.5);
        if r.random_bool(0.4) {
            p.top_k = if r.random_bool(0.8) { r.random_range(1..60) } else { r.random_range(1..vocab + 5) };
        }
        if r.random_bool(0.4) {
            p.top_p = r.random_range(0.05f32..1.0);
        }
        if r.random_bool(0.3) {
            p.min_p = r.random_range(0.0f32..0.3);
        }
    }
    if r.random_bool(0.4) {
        p.repetition_penalty = r.random_range(0.5f32..2.0);
    }
    if r.random_bool(0.4) {
        p.frequency_penalty = r.random_range(-2.0f32..2.0);
        p.presence_penalty = r.random_range(-2.0f32..2.0);
    }
    if r.random_bool(0.3) {
        p.logit_bias = random_ids(r, 6, vocab).into_iter().map(|id| (id, r.random_range(-100.0f32..100.0))).collect();
    }
    if r.random_bool(0.3) {
        p.min_tokens = r.random_range(0..8);
        p.stop_token_ids = random_ids(r, 3, vocab);
        p.ignore_eos = r.random_bool(0.3);
    }
    if r.random_bool(0.6) {
        p.logprobs = Some(r.random_range(0..=20));
    }
    Case { params: p, prompt: random_ids(r, 300, vocab), output: random_ids(r, 40, vocab), seed: r.random() }
}

/// A grammar mask for a third of the rows: a few allowed ids, about half the ids, none at
/// all, or a dense mask shorter than the row (a tokenizer smaller than the LM head).
fn random_mask(r: &mut StdRng, vocab: usize) -> Option<TokenMask> {
    match r.random_range(0..12) {
        0 | 1 => Some(TokenMask::allowing(vocab, (0..r.random_range(1..6)).map(|_| r.random_range(0..vocab as u32)))),
        2 => Some(TokenMask::from_words((0..vocab.div_ceil(32)).map(|_| r.random()).collect(), vocab)),
        3 => Some(TokenMask::allowing(vocab, [])),
        4 => {
            let len = r.random_range(1..=vocab);
            Some(TokenMask::from_words((0..len.div_ceil(32)).map(|_| r.random()).collect(), len))
        }
        _ => None,
    }
}

fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() <= 1e-4 || (a - b).abs() <= 1e-6 * a.abs().max(b.abs())
}

/// Whether the device's answer matches the CPU's: identical tokens and top ids, logprobs close.
fn matches(gpu: &Sampled, cpu: &Sampled) -> bool {
    if gpu.token_id != cpu.token_id {
        return false;
    }
    match (&gpu.logprobs, &cpu.logprobs) {
        (None, None) => true,
        (Some(g), Some(c)) => {
            g.token_id == c.token_id
                && close(g.logprob, c.logprob)
                && g.top.len() == c.top.len()
                && g.top.iter().zip(&c.top).all(|(a, b)| a.0 == b.0 && close(a.1, b.1))
        }
        _ => false,
    }
}

#[test]
fn gpu_sampling_matches_cpu() {
    let dev = device();
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(1) as u64;
    println!("gpu_sampling_matches_cpu: seed {seed}");
    let mut r = StdRng::seed_from_u64(seed);
    let mut bufs = SampleBuffers::new(&dev).expect("buffers");
    let eos = [2u32, 5];
    let (mut checked, mut failures) = (0usize, Vec::new());
    for (vocab, n_rows) in [(128_256usize, 96usize), (32_001, 128), (1_000, 200), (7, 64)] {
        for round in 0..2 {
            let raws: Vec<Vec<f32>> = (0..n_rows).map(|i| random_row(&mut r, vocab, (i % 7) as u32)).collect();
            let cases: Vec<Case> = (0..n_rows).map(|_| random_case(&mut r, vocab)).collect();
            let masks: Vec<Option<TokenMask>> = (0..n_rows).map(|_| random_mask(&mut r, vocab)).collect();
            let ctxs: Vec<SamplingContext<'_>> = cases
                .iter()
                .zip(&masks)
                .map(|(c, mask)| SamplingContext {
                    params: &c.params,
                    prompt_token_ids: &c.prompt,
                    output_token_ids: &c.output,
                    eos_token_ids: &eos,
                    seed: c.seed,
                    allowed: mask.as_ref(),
                })
                .collect();
            let flat: Vec<f32> = raws.iter().flatten().copied().collect();
            let mut logits = dev.upload(&flat).expect("upload");
            // Sample the rows in reverse order so CTA i reads logit row n - 1 - i.
            let plans: Vec<_> = ctxs.iter().map(|c| plan_row(c, vocab)).collect();
            let ops: Vec<_> = plans.iter().map(|p| device_ops(&p.ops)).collect();
            let order: Vec<usize> = (0..n_rows).rev().collect();
            let rows: Vec<_> = order.iter().map(|&i| device_row(i, &plans[i], &ops[i])).collect();
            let picks = dev.sample_rows(&mut logits, n_rows, vocab, &rows, &mut bufs).expect("sample_rows");
            assert_eq!(picks.len(), n_rows);
            for (pick, &i) in picks.into_iter().zip(&order) {
                let gpu = sampled(pick, &plans[i]);
                let cpu = sample(&mut raws[i].clone(), &ctxs[i]);
                checked += 1;
                if !matches(&gpu, &cpu) {
                    failures.push(format!(
                        "vocab {vocab} round {round} row {i} (kind {}, mask allows {:?}): params {:?}\n  gpu {gpu:?}\n  cpu {cpu:?}",
                        i % 7,
                        masks[i].as_ref().map(TokenMask::count_allowed),
                        cases[i].params
                    ));
                }
            }
        }
    }
    for f in failures.iter().take(20) {
        println!("{f}");
    }
    println!("{checked} rows checked, {} mismatches", failures.len());
    assert!(failures.is_empty(), "{} of {checked} rows differ from the CPU sampler", failures.len());
}
