//! The sampler's random path: the exact support of top_k/top_p/min_p, the
//! empirical distribution against the softmax, seeding, and batch equivalence.

use baton_core::params::SamplingParams;
use baton_core::sampling::{Sampled, SamplingContext, draw_inverse_cdf, sample, sample_batch, truncated_weights};
use std::collections::BTreeSet;

/// xorshift64*: test data independent of the sampler's own generator.
struct TestRng(u64);

impl TestRng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Roughly normal logits with standard deviation `scale`.
    fn logits(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| ((0..4).map(|_| self.unit()).sum::<f32>() - 2.0) * scale * 1.73).collect()
    }
}

fn ctx<'a>(params: &'a SamplingParams, output: &'a [u32], seed: u64) -> SamplingContext<'a> {
    SamplingContext { params, prompt_token_ids: &[], output_token_ids: output, eos_token_ids: &[], seed, allowed: None }
}

/// softmax(row / t) in f64.
fn reference_probs(row: &[f32], t: f32) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row.iter().map(|&x| ((x as f64 - max) / t as f64).exp()).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// Token ids by probability descending, ties by lower id.
fn rank_order(probs: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order
}

/// The set top_k, then top_p (over the renormalised top-k mass), then min_p should
/// keep, computed from the definitions with a full sort in f64.
fn reference_support(row: &[f32], params: &SamplingParams) -> BTreeSet<usize> {
    let probs = reference_probs(row, params.temperature);
    let order = rank_order(&probs);
    let k = if params.top_k == 0 { row.len() } else { params.top_k.min(row.len()) };
    let top_k = &order[..k];
    let mass: f64 = top_k.iter().map(|&i| probs[i]).sum();
    let mut kept = Vec::new();
    let mut before = 0.0;
    for &i in top_k {
        if !kept.is_empty() && before >= params.top_p as f64 * mass {
            break;
        }
        kept.push(i);
        before += probs[i];
    }
    let p_max = probs[order[0]];
    kept.into_iter().filter(|&i| probs[i] >= params.min_p as f64 * p_max).collect()
}

fn support_of(weights: &[f32]) -> BTreeSet<usize> {
    weights.iter().enumerate().filter(|&(_, &w)| w > 0.0).map(|(i, _)| i).collect()
}

#[test]
fn truncation_keeps_exactly_the_defined_support() {
    let mut rng = TestRng::new(21);
    let cases = [
        SamplingParams { top_k: 40, ..Default::default() },
        SamplingParams { top_k: 1500, temperature: 0.6, ..Default::default() },
        SamplingParams { top_p: 0.9, temperature: 0.8, ..Default::default() },
        // A flat row at high temperature: the nucleus holds thousands of tokens, so the
        // mass quickselect partitions several times before sorting.
        SamplingParams { top_p: 0.95, temperature: 3.0, ..Default::default() },
        SamplingParams { min_p: 0.1, temperature: 1.2, ..Default::default() },
        SamplingParams { top_k: 300, top_p: 0.7, min_p: 0.02, temperature: 0.9, ..Default::default() },
        SamplingParams { top_k: 50_000, top_p: 0.5, ..Default::default() },
    ];
    let mut large_nucleus = false;
    for params in &cases {
        for _ in 0..5 {
            let row = rng.logits(8000, 2.0);
            let expected = reference_support(&row, params);
            let mut weights = row.clone();
            let argmax = truncated_weights(&mut weights, params).expect("finite row");
            assert_eq!(weights[argmax], 1.0);
            let got = support_of(&weights);
            assert!(got.len() < row.len(), "{params:?} kept everything");
            large_nucleus |= got.len() > 1024;
            assert_eq!(got, expected, "{params:?}");
        }
    }
    assert!(large_nucleus, "no case exercised a nucleus of more than 1024 tokens");
    // A nucleus smaller than the top token's own mass keeps that token alone.
    for _ in 0..10 {
        let row = rng.logits(8000, 2.0);
        let top_prob = reference_probs(&row, 1.0).into_iter().fold(0.0, f64::max);
        let params = SamplingParams { top_p: (top_prob * 0.5) as f32, ..Default::default() };
        let mut weights = row.clone();
        let argmax = truncated_weights(&mut weights, &params).expect("finite row");
        assert_eq!(support_of(&weights), BTreeSet::from([argmax]));
    }
}

#[test]
fn sampled_tokens_stay_inside_the_support_and_cover_it() {
    let mut rng = TestRng::new(22);
    let cases = [
        SamplingParams { top_k: 6, temperature: 1.0, ..Default::default() },
        SamplingParams { top_p: 0.6, temperature: 1.0, ..Default::default() },
        SamplingParams { min_p: 0.3, temperature: 1.0, ..Default::default() },
    ];
    for params in &cases {
        let row = rng.logits(5000, 4.0);
        let expected = reference_support(&row, params);
        assert!(expected.len() > 1 && expected.len() < 200, "{params:?}: support of {}", expected.len());
        let mut seen = BTreeSet::new();
        let mut output = Vec::new();
        for _ in 0..4000usize {
            let token = sample(&mut row.clone(), &ctx(params, &output, 5)).token_id;
            assert!(expected.contains(&(token as usize)), "{params:?}: token {token} outside the support");
            seen.insert(token as usize);
            output.push(token);
        }
        // Every kept token expected at least 20 times out of 4000 must have shown up.
        let probs = reference_probs(&row, params.temperature);
        let mass: f64 = expected.iter().map(|&i| probs[i]).sum();
        for &i in &expected {
            assert!(probs[i] / mass < 0.005 || seen.contains(&i), "{params:?}: token {i} never sampled");
        }
    }
}

/// Chi-square statistic of `counts` against `probs` over `n` draws.
fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> f64 {
    counts.iter().zip(probs).map(|(&c, &p)| (c as f64 - p * n as f64).powi(2) / (p * n as f64)).sum()
}

#[test]
fn empirical_distribution_matches_the_softmax() {
    let mut rng = TestRng::new(23);
    let row: Vec<f32> = (0..20).map(|_| rng.unit() * 3.0 - 1.5).collect();
    let n = 100_000u64;
    // Full softmax at temperature 0.8; 19 degrees of freedom, 43.82 is the 0.001 critical value.
    let params = SamplingParams { temperature: 0.8, ..Default::default() };
    let mut counts = vec![0u64; 20];
    let mut output = Vec::new();
    for _ in 0..n {
        let token = sample(&mut row.clone(), &ctx(&params, &output, 31)).token_id;
        counts[token as usize] += 1;
        output.push(token);
    }
    let probs = reference_probs(&row, 0.8);
    let chi2 = chi_square(&counts, &probs, n);
    assert!(chi2 < 43.82, "chi2 {chi2}, counts {counts:?}");

    // top_k = 8 renormalises over the eight best; 7 degrees of freedom, critical 24.32.
    let params = SamplingParams { temperature: 1.3, top_k: 8, ..Default::default() };
    let probs = reference_probs(&row, 1.3);
    let top: Vec<usize> = rank_order(&probs)[..8].to_vec();
    let mass: f64 = top.iter().map(|&i| probs[i]).sum();
    let mut counts = [0u64; 20];
    let mut output = Vec::new();
    for _ in 0..n {
        let token = sample(&mut row.clone(), &ctx(&params, &output, 32)).token_id;
        counts[token as usize] += 1;
        output.push(token);
    }
    assert_eq!(counts.iter().enumerate().filter(|&(i, &c)| c > 0 && !top.contains(&i)).count(), 0);
    let top_counts: Vec<u64> = top.iter().map(|&i| counts[i]).collect();
    let top_probs: Vec<f64> = top.iter().map(|&i| probs[i] / mass).collect();
    let chi2 = chi_square(&top_counts, &top_probs, n);
    assert!(chi2 < 24.32, "chi2 {chi2}, counts {top_counts:?}");
}

/// Generates `len` tokens, feeding each back as output history.
fn generate(rows: &[Vec<f32>], params: &SamplingParams, seed: u64) -> Vec<u32> {
    let mut output = Vec::new();
    for row in rows {
        let token = sample(&mut row.clone(), &ctx(params, &output, seed)).token_id;
        output.push(token);
    }
    output
}

#[test]
fn same_seed_repeats_and_different_seeds_diverge() {
    let mut rng = TestRng::new(24);
    let rows: Vec<Vec<f32>> = (0..64).map(|_| rng.logits(1000, 1.0)).collect();
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, ..Default::default() };
    let a = generate(&rows, &params, 1234);
    assert_eq!(a, generate(&rows, &params, 1234));
    let b = generate(&rows, &params, 1235);
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert!(differing > 32, "only {differing} of 64 positions differ");
    // A sequence resumed from its history (e.g. after preemption) continues identically.
    let resumed = sample(&mut rows[40].clone(), &ctx(&params, &a[..40], 1234)).token_id;
    assert_eq!(resumed, a[40]);
}

#[test]
fn batch_equals_per_row_sampling() {
    let mut rng = TestRng::new(25);
    let vocab = 3000;
    let params = [
        SamplingParams::greedy(),
        SamplingParams { temperature: 0.7, top_k: 20, logprobs: Some(3), ..Default::default() },
        SamplingParams { temperature: 1.1, top_p: 0.8, repetition_penalty: 1.2, ..Default::default() },
        SamplingParams {
            min_p: 0.05,
            frequency_penalty: 0.5,
            presence_penalty: 0.3,
            logprobs: Some(0),
            ..Default::default()
        },
        SamplingParams { logit_bias: vec![(7, 5.0)], min_tokens: 2, ..Default::default() },
    ];
    let histories: Vec<Vec<u32>> =
        (0..params.len()).map(|i| (0..i * 3).map(|_| rng.below(vocab) as u32).collect()).collect();
    let prompt: Vec<u32> = (0..50).map(|_| rng.below(vocab) as u32).collect();
    let eos = [2u32];
    let ctxs: Vec<SamplingContext> = params
        .iter()
        .zip(&histories)
        .enumerate()
        .map(|(i, (p, h))| SamplingContext {
            params: p,
            prompt_token_ids: &prompt,
            output_token_ids: h,
            eos_token_ids: &eos,
            seed: 1000 + i as u64,
            allowed: None,
        })
        .collect();
    for _ in 0..10 {
        let logits = rng.logits(vocab * ctxs.len(), 2.0);
        let batch = sample_batch(&mut logits.clone(), vocab, &ctxs);
        let single: Vec<Sampled> =
            logits.chunks(vocab).zip(&ctxs).map(|(row, ctx)| sample(&mut row.to_vec(), ctx)).collect();
        assert_eq!(batch, single);
        assert!(batch[1].logprobs.as_ref().is_some_and(|l| l.top.len() == 3));
        assert!(batch[3].logprobs.as_ref().is_some_and(|l| l.top.is_empty()));
        // Reordering the batch does not change any row's token.
        let reversed: Vec<SamplingContext> = ctxs.iter().rev().copied().collect();
        let mut flipped: Vec<f32> = logits.chunks(vocab).rev().flatten().copied().collect();
        let mut again = sample_batch(&mut flipped, vocab, &reversed);
        again.reverse();
        assert_eq!(again, batch);
    }
    // A short matrix never panics: missing rows come back as token 0.
    let out = sample_batch(&mut rng.logits(vocab + 5, 1.0), vocab, &ctxs[..2]);
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].token_id, 0);
}

#[test]
fn large_batches_split_across_threads_sample_like_single_rows() {
    let mut rng = TestRng::new(26);
    let vocab = 128_256;
    let params = [
        SamplingParams { temperature: 0.8, top_p: 0.9, ..Default::default() },
        SamplingParams { temperature: 1.0, top_k: 40, logprobs: Some(2), ..Default::default() },
        SamplingParams::greedy(),
    ];
    let histories: Vec<Vec<u32>> = (0..24).map(|i| (0..i).map(|_| rng.below(vocab) as u32).collect()).collect();
    let ctxs: Vec<SamplingContext> = histories
        .iter()
        .enumerate()
        .map(|(i, h)| SamplingContext {
            params: &params[i % params.len()],
            prompt_token_ids: &[],
            output_token_ids: h,
            eos_token_ids: &[],
            seed: 77 + i as u64,
            allowed: None,
        })
        .collect();
    let logits = rng.logits(vocab * ctxs.len(), 3.0);
    let batch = sample_batch(&mut logits.clone(), vocab, &ctxs);
    let single: Vec<Sampled> =
        logits.chunks(vocab).zip(&ctxs).map(|(row, ctx)| sample(&mut row.to_vec(), ctx)).collect();
    assert_eq!(batch, single);
}

#[test]
fn inverse_cdf_walks_in_ascending_id_order() {
    let weights = [0.0, 1.0, 0.0, 3.0, 0.0];
    assert_eq!(draw_inverse_cdf(&weights, 0.0), Some(1));
    assert_eq!(draw_inverse_cdf(&weights, 0.2499), Some(1));
    assert_eq!(draw_inverse_cdf(&weights, 0.25), Some(3));
    assert_eq!(draw_inverse_cdf(&weights, 0.999_999), Some(3));
    assert_eq!(draw_inverse_cdf(&[0.0, 0.0], 0.5), None);
    assert_eq!(draw_inverse_cdf(&[], 0.5), None);
}
