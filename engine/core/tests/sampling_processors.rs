//! The sampler's deterministic parts: greedy decoding, each logit processor
//! against a hand-computed expectation, raw logprobs, and hostile inputs.

use baton_core::params::SamplingParams;
use baton_core::sampling::{LogSoftmax, SamplingContext, process_logits, sample};

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

fn ctx<'a>(params: &'a SamplingParams, prompt: &'a [u32], output: &'a [u32], eos: &'a [u32]) -> SamplingContext<'a> {
    SamplingContext {
        params,
        prompt_token_ids: prompt,
        output_token_ids: output,
        eos_token_ids: eos,
        seed: 99,
        allowed: None,
    }
}

/// First index of the maximum, by a plain scan.
fn first_argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for i in 1..row.len() {
        if row[i] > row[best] {
            best = i;
        }
    }
    best
}

#[test]
fn greedy_picks_the_argmax_of_random_rows() {
    let mut rng = TestRng::new(1);
    for round in 0..50 {
        let row = rng.logits(1000 + round * 37, 3.0);
        let expected = first_argmax(&row) as u32;
        for params in [SamplingParams::greedy(), SamplingParams { top_k: 1, temperature: 0.8, ..Default::default() }] {
            let got = sample(&mut row.clone(), &ctx(&params, &[], &[], &[]));
            assert_eq!(got.token_id, expected, "round {round}");
            assert_eq!(got.logprobs, None);
        }
    }
}

#[test]
fn greedy_ties_go_to_the_lowest_id() {
    let mut rng = TestRng::new(2);
    let params = SamplingParams::greedy();
    for _ in 0..50 {
        let mut row = rng.logits(500, 2.0);
        let top = row.iter().copied().fold(f32::MIN, f32::max) + 1.0;
        let (a, b) = (rng.below(500), rng.below(500));
        row[a] = top;
        row[b] = top;
        let got = sample(&mut row, &ctx(&params, &[], &[], &[]));
        assert_eq!(got.token_id as usize, a.min(b));
    }
}

#[test]
fn logit_bias_adds_per_entry_and_ignores_unknown_ids() {
    let mut rng = TestRng::new(3);
    let row = rng.logits(300, 2.0);
    let (a, b) = (rng.below(150), 150 + rng.below(150));
    let params = SamplingParams {
        logit_bias: vec![(a as u32, 1.5), (b as u32, -2.0), (a as u32, 0.25), (300, 9.0)],
        ..Default::default()
    };
    let mut got = row.clone();
    process_logits(&mut got, &ctx(&params, &[], &[], &[]));
    let mut expected = row;
    expected[a] += 1.75;
    expected[b] -= 2.0;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert!((g - e).abs() < 1e-6, "token {i}: {g} vs {e}");
    }
}

#[test]
fn a_bias_of_plus_100_forces_the_token() {
    let mut rng = TestRng::new(4);
    let row = rng.logits(2000, 3.0);
    let forced = rng.below(2000) as u32;
    let params = SamplingParams { temperature: 1.5, logit_bias: vec![(forced, 100.0)], ..Default::default() };
    let mut output = Vec::new();
    for _ in 0..200 {
        let got = sample(&mut row.clone(), &ctx(&params, &[], &output, &[]));
        assert_eq!(got.token_id, forced);
        output.push(got.token_id);
    }
}

#[test]
fn min_tokens_blocks_eos_and_stop_ids_until_reached() {
    let mut rng = TestRng::new(5);
    let mut row = rng.logits(400, 1.0);
    let (eos, stop) = (17u32, 250u32);
    row[eos as usize] = 40.0;
    row[stop as usize] = 39.0;
    let eos_ids = [eos];
    let params = SamplingParams { min_tokens: 4, stop_token_ids: vec![stop], temperature: 1.0, ..Default::default() };
    let mut output: Vec<u32> = Vec::new();
    while output.len() < 4 {
        let mut processed = row.clone();
        process_logits(&mut processed, &ctx(&params, &[], &output, &eos_ids));
        assert_eq!(processed[eos as usize], f32::NEG_INFINITY);
        assert_eq!(processed[stop as usize], f32::NEG_INFINITY);
        let got = sample(&mut row.clone(), &ctx(&params, &[], &output, &eos_ids)).token_id;
        assert!(got != eos && got != stop, "blocked token {got} sampled at {}", output.len());
        output.push(got);
    }
    // Reached: EOS is no longer held back and dominates the row.
    let got = sample(&mut row.clone(), &ctx(&params, &[], &output, &eos_ids)).token_id;
    assert_eq!(got, eos);
    // With ignore_eos, EOS does not end the sequence and is not held back; stop ids still are.
    let params = SamplingParams { ignore_eos: true, ..params };
    let mut processed = row.clone();
    process_logits(&mut processed, &ctx(&params, &[], &[], &eos_ids));
    assert_eq!(processed[eos as usize], 40.0);
    assert_eq!(processed[stop as usize], f32::NEG_INFINITY);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_once() {
    let mut rng = TestRng::new(6);
    for _ in 0..20 {
        let row = rng.logits(200, 2.0);
        let prompt: Vec<u32> = (0..30).map(|_| rng.below(200) as u32).collect();
        let output: Vec<u32> = (0..10).map(|_| rng.below(200) as u32).chain([500]).collect();
        let params = SamplingParams { repetition_penalty: 1.3, ..Default::default() };
        let mut got = row.clone();
        process_logits(&mut got, &ctx(&params, &prompt, &output, &[]));
        for (i, (&g, &x)) in got.iter().zip(&row).enumerate() {
            let seen = prompt.contains(&(i as u32)) || output.contains(&(i as u32));
            let expected = match (seen, x > 0.0) {
                (false, _) => x,
                (true, true) => x / 1.3,
                (true, false) => x * 1.3,
            };
            assert!((g - expected).abs() < 1e-6, "token {i}: {g} vs {expected}");
        }
    }
}

#[test]
fn frequency_and_presence_penalties_count_only_the_output() {
    let mut rng = TestRng::new(7);
    let row = rng.logits(50, 2.0);
    let prompt = [9u32, 1, 1];
    let output = [5u32, 5, 9, 5, 2, 77];
    let params = SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.25, ..Default::default() };
    let mut got = row.clone();
    process_logits(&mut got, &ctx(&params, &prompt, &output, &[]));
    let mut expected = row;
    expected[5] -= 3.0 * 0.5 + 0.25;
    expected[9] -= 0.5 + 0.25;
    expected[2] -= 0.5 + 0.25;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert!((g - e).abs() < 1e-6, "token {i}: {g} vs {e}");
    }
}

#[test]
fn processors_run_bias_then_repetition_then_frequency() {
    let mut row = TestRng::new(8).logits(10, 1.0);
    row[3] = -0.5;
    let params = SamplingParams {
        logit_bias: vec![(3, 1.0)],
        repetition_penalty: 2.0,
        frequency_penalty: 0.1,
        ..Default::default()
    };
    process_logits(&mut row, &ctx(&params, &[], &[3], &[]));
    // (-0.5 + 1.0) / 2.0 - 0.1; penalising before biasing would give -1.0 + 1.0 - 0.1.
    assert!((row[3] - 0.15).abs() < 1e-6, "{}", row[3]);
}

/// log-softmax of `row` in f64, computed directly.
fn reference_log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_sum = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - max - log_sum).collect()
}

#[test]
fn logprobs_come_from_the_raw_logits() {
    let mut rng = TestRng::new(9);
    for round in 0..20 {
        let row = rng.logits(3000, 2.5);
        let reference = reference_log_softmax(&row);
        let k = 1 + round % 20;
        let biased = rng.below(3000) as u32;
        let params = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.2,
            logit_bias: vec![(biased, 100.0)],
            logprobs: Some(k),
            ..Default::default()
        };
        let output = [biased, 3];
        let got = sample(&mut row.clone(), &ctx(&params, &[1, 2], &output, &[])).logprobs.expect("logprobs requested");
        // The bias forces the token, but its logprob is the raw model's, not ~0.
        assert_eq!(got.token_id, biased);
        assert!(
            (got.logprob as f64 - reference[biased as usize]).abs() < 1e-4,
            "{} vs {}",
            got.logprob,
            reference[biased as usize]
        );
        assert_eq!(got.top.len(), k);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for (j, &(id, lp)) in got.top.iter().enumerate() {
            assert_eq!(id as usize, order[j], "rank {j}");
            assert!((lp as f64 - reference[id as usize]).abs() < 1e-4);
        }
        let softmax = LogSoftmax::of(&row);
        let total: f64 = row.iter().map(|&x| (softmax.logprob(x) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "sum of probabilities {total}");
    }
}

#[test]
fn logprob_top_list_breaks_ties_by_lower_id() {
    let mut row = TestRng::new(10).logits(100, 1.0);
    for id in [70, 12, 40] {
        row[id] = 9.0;
    }
    let params = SamplingParams { logprobs: Some(2), ..SamplingParams::greedy() };
    let got = sample(&mut row, &ctx(&params, &[], &[], &[])).logprobs.expect("logprobs requested");
    assert_eq!(got.token_id, 12);
    assert_eq!(got.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(), vec![12, 40]);
    assert_eq!(got.top[0].1, got.top[1].1);
    assert_eq!(got.logprob, got.top[0].1);
}

#[test]
fn nan_and_infinite_logits_never_panic() {
    let mut rng = TestRng::new(11);
    let random = SamplingParams {
        temperature: 0.9,
        top_k: 5000,
        top_p: 0.8,
        min_p: 0.05,
        logprobs: Some(5),
        ..Default::default()
    };
    let odd = SamplingParams {
        temperature: f32::NAN,
        top_p: 0.0,
        min_p: 2.0,
        repetition_penalty: 0.0,
        logprobs: Some(50),
        ..Default::default()
    };
    let param_sets =
        [SamplingParams::greedy(), random, odd, SamplingParams { top_p: -1.0, min_p: 2.0, ..Default::default() }];
    for params in &param_sets {
        for _ in 0..20 {
            let mut row = rng.logits(64, 3.0);
            for _ in 0..10 {
                let at = rng.below(64);
                row[at] = [f32::NAN, f32::NEG_INFINITY, -f32::MAX][rng.below(3)];
            }
            let output = [1u32, 2, 3, 1000];
            let got = sample(&mut row, &ctx(params, &[0, 70_000], &output, &[5, 900]));
            assert!(got.token_id < 64);
            if let Some(lp) = got.logprobs {
                assert!(!lp.logprob.is_nan() && lp.top.iter().all(|&(id, p)| id < 64 && !p.is_nan()));
            }
        }
        let ctx = ctx(params, &[], &[], &[]);
        // +inf dominates (clamped to f32::MAX).
        let mut row = vec![0.5, f32::INFINITY, 2.0, f32::NEG_INFINITY];
        assert_eq!(sample(&mut row, &ctx).token_id, 1);
        // Nothing usable: the raw argmax of an all -inf/NaN row is token 0.
        assert_eq!(sample(&mut [f32::NAN; 7], &ctx).token_id, 0);
        assert_eq!(sample(&mut [f32::NEG_INFINITY; 7], &ctx).token_id, 0);
        assert_eq!(sample(&mut [3.5], &ctx).token_id, 0);
        assert_eq!(sample(&mut [], &ctx).token_id, 0);
    }
}

#[test]
fn a_fully_blocked_row_falls_back_to_the_raw_argmax() {
    let mut rng = TestRng::new(12);
    let mut row = vec![f32::NEG_INFINITY; 300];
    let eos = rng.below(300);
    row[eos] = 1.0;
    let eos_ids = [eos as u32];
    for params in [
        SamplingParams { min_tokens: 3, ..Default::default() },
        SamplingParams { min_tokens: 3, ..SamplingParams::greedy() },
    ] {
        let got = sample(&mut row.clone(), &ctx(&params, &[], &[], &eos_ids));
        assert_eq!(got.token_id as usize, eos);
    }
}

#[test]
fn a_grammar_mask_confines_every_draw_and_keeps_raw_logprobs() {
    use baton_core::structured::TokenMask;
    let mut rng = TestRng::new(77);
    for round in 0..60u64 {
        let vocab = 50 + rng.below(400);
        let allowed_ids: Vec<u32> = (0..1 + rng.below(6)).map(|_| rng.below(vocab) as u32).collect();
        let mask = TokenMask::allowing(vocab, allowed_ids.iter().copied());
        let raw = rng.logits(vocab, 4.0);
        let greedy = round % 2 == 0;
        let params = SamplingParams {
            temperature: if greedy { 0.0 } else { 1.3 },
            logprobs: Some(3),
            seed: Some(round),
            ..Default::default()
        };
        let mut c = ctx(&params, &[], &[], &[]);
        c.seed = round;
        c.allowed = Some(&mask);
        let picked = sample(&mut raw.clone(), &c);
        assert!(allowed_ids.contains(&picked.token_id), "round {round}: {} not in {allowed_ids:?}", picked.token_id);
        if greedy {
            let best = *allowed_ids
                .iter()
                .max_by(|a, b| raw[**a as usize].total_cmp(&raw[**b as usize]).then(b.cmp(a)))
                .unwrap();
            assert_eq!(picked.token_id, best, "round {round}");
        }
        // Logprobs stay those of the raw row (vLLM's raw_logprobs), mask or not.
        let lp = picked.logprobs.expect("asked for logprobs");
        let want = LogSoftmax::of(&raw).logprob(raw[picked.token_id as usize]);
        assert!((lp.logprob - want).abs() < 1e-5, "round {round}");
        // process_logits leaves -inf exactly outside the mask.
        let mut processed = raw.clone();
        process_logits(&mut processed, &c);
        for (id, x) in processed.iter().enumerate() {
            assert_eq!(*x == f32::NEG_INFINITY, !mask.allows(id as u32), "round {round} id {id}");
        }
    }
}

#[test]
fn a_grammar_mask_beats_min_tokens_and_an_empty_mask_falls_back_to_the_raw_argmax() {
    use baton_core::structured::TokenMask;
    // min_tokens bans EOS (id 2) but the grammar allows only EOS: the grammar wins.
    let params = SamplingParams { temperature: 0.0, min_tokens: 5, ..Default::default() };
    let only_eos = TokenMask::allowing(8, [2]);
    let mut c = ctx(&params, &[], &[], &[2]);
    c.allowed = Some(&only_eos);
    let row = vec![0.0, 9.0, -3.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    assert_eq!(sample(&mut row.clone(), &c).token_id, 2);
    // A mask that allows nothing in the row: the plain raw argmax (the engine fails the grammar).
    let none = TokenMask::allowing(8, []);
    c.allowed = Some(&none);
    assert_eq!(sample(&mut row.clone(), &c).token_id, 1);
}
