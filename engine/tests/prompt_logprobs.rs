//! Prompt logprobs (`SamplingParams::prompt_logprobs`) on the CPU engine against teacher
//! forcing: each entry must equal the log-softmax of a full forward's logits at the position
//! before it, whatever the engine did to get there (chunked prefill, a prefix-cache hit it had
//! to skip, a batch of requests sharing a prompt, prompts longer than one LM-head slice), and
//! their sum must equal what a token-by-token forward gives.

mod common;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest, PromptLogprob, RequestId};
use baton_core::params::SamplingParams;
use baton_engine::EngineConfig;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::runner::{ModelRunner, PROMPT_LOGPROB_SLICE};
use baton_formats::LoadedModel;
use baton_formats::testing::TinySpec;
use common::*;

const BLOCK: usize = 16;

/// A CPU model with a KV pool large enough for one `max_len`-token sequence.
fn cpu_model(model: &LoadedModel, max_len: usize) -> ModelRunner<CpuBackend> {
    let mut m = ModelRunner::load(&model.config, model.weights.as_ref(), CpuBackend::new()).expect("load model");
    m.alloc_kv_cache(max_len.div_ceil(BLOCK) + 1, BLOCK).expect("kv cache");
    m
}

/// Logits of every position of `ids`, from one forward over the whole prompt.
fn all_logits(m: &mut ModelRunner<CpuBackend>, ids: &[u32]) -> Vec<Vec<f32>> {
    let batch = BatchLayout {
        tokens: ids.to_vec(),
        positions: (0..ids.len()).collect(),
        seqs: vec![SeqLayout {
            row_start: 0,
            n_tokens: ids.len(),
            start_pos: 0,
            block_table: (0..ids.len().div_ceil(BLOCK) as u32).collect(),
        }],
        logit_rows: (0..ids.len()).collect(),
        ..BatchLayout::default()
    };
    let logits = m.forward(&batch).expect("forward");
    let vocab = logits.len() / ids.len();
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// Log-softmax of a row in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// Teacher forcing: entry `i` is the logprob of `ids[i]` under the logits of position `i - 1`.
fn reference(model: &LoadedModel, ids: &[u32]) -> Vec<Option<Vec<f64>>> {
    let mut m = cpu_model(model, ids.len());
    let rows = all_logits(&mut m, ids);
    std::iter::once(None).chain(rows[..ids.len() - 1].iter().map(|r| Some(log_softmax(r)))).collect()
}

/// Checks `got` (an engine's prompt logprobs with top `k`) against the teacher-forced rows.
fn assert_matches(label: &str, ids: &[u32], got: &[Option<PromptLogprob>], want: &[Option<Vec<f64>>], k: usize) {
    assert_eq!(got.len(), ids.len(), "{label}: one entry per prompt token");
    assert!(got[0].is_none(), "{label}: the first prompt token has no logprob");
    for i in 1..ids.len() {
        let lp = got[i].as_ref().unwrap_or_else(|| panic!("{label}: entry {i} is missing"));
        let row = want[i].as_ref().expect("reference row");
        assert_eq!(lp.token_id, ids[i], "{label}: entry {i} scores the wrong token");
        let diff = (lp.logprob as f64 - row[ids[i] as usize]).abs();
        assert!(diff < 1e-4, "{label}: entry {i}: {} vs {} (diff {diff})", lp.logprob, row[ids[i] as usize]);
        let above = row.iter().filter(|&&x| x > row[ids[i] as usize] + 1e-6).count();
        let ties = row.iter().filter(|&&x| (x - row[ids[i] as usize]).abs() <= 1e-6).count();
        let rank = lp.rank as usize;
        assert!(rank > above && rank <= above + ties, "{label}: entry {i} rank {rank}, {above} tokens above");
        assert_eq!(lp.top.len(), k, "{label}: entry {i} top list length");
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for (j, &(id, v)) in lp.top.iter().enumerate() {
            assert!((v as f64 - row[id as usize]).abs() < 1e-4, "{label}: entry {i} top {j} value");
            // Near-ties may swap between two summations; the value must be the j-th largest.
            assert!((v as f64 - row[order[j]]).abs() < 1e-4, "{label}: entry {i} top {j} is not the {j}-th best");
        }
    }
}

/// The request's outputs; the prompt logprobs must come with the first one only.
fn prompt_logprobs_of(outs: &[EngineOutput]) -> Vec<Option<PromptLogprob>> {
    assert!(
        outs.iter().skip(1).all(|o| o.prompt_logprobs.is_empty()),
        "prompt logprobs only come with the first output"
    );
    outs[0].prompt_logprobs.clone()
}

fn with_prompt_logprobs(k: usize, max_tokens: usize) -> SamplingParams {
    SamplingParams { prompt_logprobs: Some(k), ..greedy(max_tokens) }
}

#[test]
fn prompt_logprobs_equal_teacher_forcing_in_every_engine_configuration() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        [2usize, 7, 16, 17, 40, 63].iter().enumerate().map(|(i, &len)| prompt(500 + i as u64, len, vocab)).collect();
    let refs: Vec<_> = prompts.iter().map(|p| reference(&m.model, p)).collect();
    for (label, cfg) in [
        ("prefix cache on", EngineConfig::default()),
        (
            "chunked prefill, budget 8",
            EngineConfig { max_num_batched_tokens: 8, max_num_seqs: 8, ..EngineConfig::default() },
        ),
        ("no prefix cache", EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() }),
    ] {
        let e = engine(&m.model, cfg);
        // The plain greedy tokens, to check asking for prompt logprobs changes nothing else.
        let plain: Vec<Vec<u32>> = prompts.iter().map(|p| run(&e, p, greedy(3))).collect();
        for round in 0..2 {
            // All together (one batch), twice: the second round finds every prompt cached and
            // must still compute every position.
            let streams: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| e.submit(EngineRequest::new(p.clone(), with_prompt_logprobs(i % 4, 3))).expect("submit"))
                .collect();
            for (i, s) in streams.into_iter().enumerate() {
                let (tokens, outs, _) = drain(s);
                let label = format!("{label}, round {round}, prompt {i}");
                assert_eq!(tokens, plain[i], "{label}: the generated tokens changed");
                assert_eq!(outs[0].num_cached_tokens, 0, "{label}: a prompt-logprobs request must skip the cache");
                assert_matches(&label, &prompts[i], &prompt_logprobs_of(&outs), &refs[i], i % 4);
            }
        }
        // A plain request afterwards still hits the cache the others filled.
        if label == "prefix cache on" {
            let s = e.submit(EngineRequest::new(prompts[4].clone(), greedy(2))).expect("submit");
            let (_, outs, _) = drain(s);
            assert!(outs[0].num_cached_tokens > 0, "the prompt's blocks should be cached");
            assert!(outs[0].prompt_logprobs.is_empty(), "nothing asked for prompt logprobs");
        }
        assert_all_blocks_free(&e);
        e.shutdown();
    }
}

#[test]
fn prompt_logprobs_of_a_shared_prompt_with_n_children() {
    let m = tiny(&TinySpec::llama());
    let p = prompt(77, 37, m.model.config.vocab_size);
    let want = reference(&m.model, &p);
    let e = engine(&m.model, EngineConfig::default());
    // The frontend's fan-out for n = 3: children share the first one's prefix.
    let mut streams = Vec::new();
    let mut first: Option<RequestId> = None;
    for _ in 0..3 {
        let mut req = EngineRequest::new(p.clone(), with_prompt_logprobs(2, 4));
        req.share_prefix_with = first;
        let s = e.submit(req).expect("submit");
        first = first.or(Some(s.request_id()));
        streams.push(s);
    }
    for (i, s) in streams.into_iter().enumerate() {
        let (_, outs, _) = drain(s);
        assert_matches(&format!("child {i}"), &p, &prompt_logprobs_of(&outs), &want, 2);
    }
    assert_all_blocks_free(&e);
    e.shutdown();
}

#[test]
fn long_prompts_span_several_lm_head_slices_and_sum_like_a_token_by_token_forward() {
    let m = tiny(&TinySpec::llama());
    let len = PROMPT_LOGPROB_SLICE + 45;
    let p = prompt(9, len, m.model.config.vocab_size);
    let want = reference(&m.model, &p);
    let e = engine(&m.model, EngineConfig { max_num_batched_tokens: 512, ..EngineConfig::default() });
    let (_, outs, _) = drain(e.submit(EngineRequest::new(p.clone(), with_prompt_logprobs(1, 1))).expect("submit"));
    let got = prompt_logprobs_of(&outs);
    assert_matches("long prompt", &p, &got, &want, 1);
    e.shutdown();

    // Token by token through the cache: position i's logits from a one-row step.
    let short = &p[..48];
    let mut model = cpu_model(&m.model, short.len());
    let table: Vec<u32> = (0..short.len().div_ceil(BLOCK) as u32).collect();
    let mut sum_stepwise = 0.0f64;
    for i in 0..short.len() - 1 {
        let batch = BatchLayout {
            tokens: vec![short[i]],
            positions: vec![i],
            seqs: vec![SeqLayout { row_start: 0, n_tokens: 1, start_pos: i, block_table: table.clone() }],
            logit_rows: vec![0],
            ..BatchLayout::default()
        };
        let logits = model.forward(&batch).expect("step");
        sum_stepwise += log_softmax(&logits)[short[i + 1] as usize];
    }
    let e = engine(&m.model, EngineConfig { max_num_batched_tokens: 5, max_num_seqs: 4, ..EngineConfig::default() });
    let (_, outs, _) = drain(e.submit(EngineRequest::new(short.to_vec(), with_prompt_logprobs(0, 1))).expect("submit"));
    let sum: f64 = prompt_logprobs_of(&outs).iter().flatten().map(|lp| lp.logprob as f64).sum();
    assert!((sum - sum_stepwise).abs() < 1e-3, "chunked sum {sum} vs token-by-token {sum_stepwise}");
    e.shutdown();
}

#[test]
fn a_bad_prompt_logprobs_count_is_refused() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig::default());
    let err = e.submit(EngineRequest::new(vec![1, 2, 3], with_prompt_logprobs(21, 1))).err().expect("refused");
    assert!(err.to_string().contains("prompt_logprobs"), "{err}");
    e.shutdown();
}
