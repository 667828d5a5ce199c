//! End-to-end behaviour of the engine on tiny random models: batch
//! invariance (alone vs. among others, chunked prefill on/off, prefix-cache
//! hit or not), aborts freeing blocks, n>1 prefix sharing, and clear errors
//! for bad requests.

mod common;

use baton_core::api::{EngineClient, EngineRequest, FinishReason, SubmitError};
use baton_core::params::SamplingParams;
use baton_engine::EngineConfig;
use baton_formats::testing::TinySpec;
use common::*;

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    // Lengths around block boundaries (block size 16) and a long one.
    [1usize, 5, 15, 16, 17, 31, 33, 47, 64, 70, 3, 9, 22, 40, 55, 90, 101]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(100 + i as u64, len, vocab))
        .collect()
}

#[test]
fn greedy_output_is_batch_invariant() {
    let spec = TinySpec::llama();
    let m = tiny(&spec);
    let vocab = m.model.config.vocab_size;
    let ps = prompts(vocab);
    let n_out = 12;

    // Alone, one at a time, with a fresh engine and no chunking pressure.
    let alone_engine = engine(&m.model, EngineConfig { enable_prefix_caching: false, ..EngineConfig::default() });
    let alone: Vec<Vec<u32>> = ps.iter().map(|p| run(&alone_engine, p, greedy(n_out))).collect();
    assert_all_blocks_free(&alone_engine);
    alone_engine.shutdown();
    assert!(alone.iter().all(|o| o.len() == n_out));
    // The outputs must depend on the prompt (a broken model often emits one token forever).
    let distinct: std::collections::HashSet<&Vec<u32>> = alone.iter().collect();
    assert!(distinct.len() > ps.len() / 2, "outputs barely depend on the prompt: {alone:?}");

    for (label, cfg) in [
        (
            "batched, chunked prefill (budget 24)",
            EngineConfig { max_num_batched_tokens: 24, max_num_seqs: 16, ..EngineConfig::default() },
        ),
        (
            "batched, no chunked prefill",
            EngineConfig { enable_chunked_prefill: false, max_num_batched_tokens: 256, ..EngineConfig::default() },
        ),
        (
            "batched, tiny KV pool (preemption)",
            EngineConfig { num_kv_blocks: Some(24), max_model_len: Some(128), ..EngineConfig::default() },
        ),
    ] {
        let e = engine(&m.model, cfg);
        let streams: Vec<_> =
            ps.iter().map(|p| e.submit(EngineRequest::new(p.clone(), greedy(n_out))).expect("submit")).collect();
        let together: Vec<Vec<u32>> = streams.into_iter().map(|s| drain(s).0).collect();
        assert_eq!(together, alone, "{label}: greedy output differs from running alone");
        if label.contains("preemption") {
            assert!(e.stats().num_preemptions > 0, "{label}: the small pool should have forced a preemption");
        }
        // Second round: every prompt now hits the prefix cache.
        let again: Vec<Vec<u32>> = ps.iter().map(|p| run(&e, p, greedy(n_out))).collect();
        assert_eq!(again, alone, "{label}: prefix-cache hits changed the output");
        assert_all_blocks_free(&e);
        e.shutdown();
    }
}

#[test]
fn prefix_cache_hits_are_counted() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig::default());
    let p = prompt(7, 50, m.model.config.vocab_size);
    let first = run(&e, &p, greedy(4));
    let before = e.stats();
    let second = run(&e, &p, greedy(4));
    let after = e.stats();
    assert_eq!(first, second);
    // 50 tokens = 3 full blocks; all three hit (the last prompt token is always recomputed).
    assert_eq!(after.prefix_cache_hits - before.prefix_cache_hits, 48);
    assert_all_blocks_free(&e);
}

#[test]
fn n_greater_than_one_shares_prompt_blocks() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig::default());
    let p = prompt(9, 40, m.model.config.vocab_size);
    let params = SamplingParams {
        n: 3,
        seed: Some(5),
        temperature: 0.8,
        max_tokens: Some(6),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let kids = params.fan_out();
    let leader = e.submit(EngineRequest::new(p.clone(), kids[0].clone())).expect("leader");
    let leader_id = leader.request_id();
    let followers: Vec<_> = kids[1..]
        .iter()
        .map(|k| {
            let mut r = EngineRequest::new(p.clone(), k.clone());
            r.share_prefix_with = Some(leader_id);
            e.submit(r).expect("follower")
        })
        .collect();
    let before = e.stats().prefix_cache_hits;
    let mut outs = vec![drain(leader)];
    outs.extend(followers.into_iter().map(drain));
    for (toks, last, fin) in &outs {
        assert_eq!(toks.len(), 6);
        assert_eq!(*fin, FinishReason::Length);
        assert_eq!(last.last().map(|o| o.num_prompt_tokens), Some(40));
    }
    // Each follower found the leader's two full prompt blocks in the cache.
    assert_eq!(e.stats().prefix_cache_hits - before, 2 * 32);
    let followers_cached: Vec<usize> = outs[1..].iter().map(|(_, o, _)| o[0].num_cached_tokens).collect();
    assert_eq!(followers_cached, vec![32, 32]);
    assert_all_blocks_free(&e);
}

#[test]
fn dropping_the_stream_aborts_and_frees_blocks() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig::default());
    let p = prompt(3, 60, m.model.config.vocab_size);
    let mut s = e
        .submit(EngineRequest::new(p, greedy(100_000.min(m.model.config.max_position_embeddings - 61))))
        .expect("submit");
    // Wait for the first token, so the request holds blocks, then walk away.
    let first = s.blocking_next().expect("an output").expect("no error");
    assert_eq!(first.new_token_ids.len(), 1);
    assert!(e.stats().num_used_blocks > 0);
    drop(s);
    assert_all_blocks_free(&e);
    // The engine keeps serving.
    assert_eq!(run(&e, &[1, 2, 3], greedy(3)).len(), 3);
}

#[test]
fn bad_requests_get_clear_errors() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig { max_model_len: Some(64), ..EngineConfig::default() });
    let vocab = m.model.config.vocab_size as u32;
    let err = |r: EngineRequest| e.submit(r).err().expect("must be refused");
    assert!(matches!(err(EngineRequest::new(vec![], greedy(1))), SubmitError::InvalidPrompt(_)));
    assert!(matches!(err(EngineRequest::new(vec![vocab], greedy(1))), SubmitError::InvalidPrompt(_)));
    match err(EngineRequest::new(vec![1; 60], greedy(10))) {
        SubmitError::ContextTooLong { prompt_tokens: 60, max_tokens: 10, max_model_len: 64 } => {}
        other => panic!("unexpected {other:?}"),
    }
    let msg = SubmitError::ContextTooLong { prompt_tokens: 60, max_tokens: 10, max_model_len: 64 }.to_string();
    assert!(msg.contains("60") && msg.contains("10") && msg.contains("64"), "{msg}");
    match err(EngineRequest::new(vec![1], SamplingParams { temperature: -1.0, ..greedy(1) })) {
        SubmitError::InvalidParams(p) => assert_eq!(p.param, "temperature"),
        other => panic!("unexpected {other:?}"),
    }
    match err(EngineRequest::new(vec![1], SamplingParams { n: 2, ..greedy(1) })) {
        SubmitError::InvalidParams(p) => assert_eq!(p.param, "n"),
        other => panic!("unexpected {other:?}"),
    }
    // Still serving after the refusals.
    assert_eq!(run(&e, &[4, 5], greedy(2)).len(), 2);
    assert_all_blocks_free(&e);
}

#[test]
fn seeded_sampling_is_reproducible_and_independent_of_the_batch() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let e = engine(&m.model, EngineConfig::default());
    let p = prompt(21, 12, vocab);
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        seed: Some(1234),
        max_tokens: Some(10),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let a = run(&e, &p, params.clone());
    // Same request among noisy neighbours.
    let noise: Vec<_> =
        (0..6).map(|i| e.submit(EngineRequest::new(prompt(50 + i, 20, vocab), greedy(8))).expect("noise")).collect();
    let b = run(&e, &p, params.clone());
    noise.into_iter().for_each(|s| drop(drain(s)));
    assert_eq!(a, b);
    let c = run(&e, &p, SamplingParams { seed: Some(99), ..params });
    assert_ne!(a, c, "a different seed should give a different sample");
    assert_all_blocks_free(&e);
}

#[test]
fn stop_tokens_and_min_tokens() {
    let m = tiny(&TinySpec::llama());
    let e = engine(&m.model, EngineConfig::default());
    let p = prompt(33, 10, m.model.config.vocab_size);
    let free = run(&e, &p, greedy(8));
    // Stop at the 3rd generated token by naming it as a stop token id.
    let stop_tok = free[2];
    let first_idx = free.iter().position(|&t| t == stop_tok).expect("present");
    let s = e
        .submit(EngineRequest::new(p.clone(), SamplingParams { stop_token_ids: vec![stop_tok], ..greedy(8) }))
        .expect("submit");
    let (toks, outs, fin) = drain(s);
    assert_eq!(fin, FinishReason::Stop);
    assert_eq!(toks, free[..=first_idx].to_vec());
    assert_eq!(outs.last().and_then(|o| o.stop_token), Some(stop_tok));
    assert_all_blocks_free(&e);
}

#[test]
fn shutdown_with_requests_in_flight_ends_every_stream_promptly() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    // A small pool, so some requests wait for blocks while others run.
    let e =
        engine(&m.model, EngineConfig { num_kv_blocks: Some(16), max_model_len: Some(128), ..EngineConfig::default() });
    let streams: Vec<_> =
        (0..6).map(|i| e.submit(EngineRequest::new(prompt(500 + i, 60, vocab), greedy(60))).expect("submit")).collect();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let handle = e.clone();
    std::thread::spawn(move || {
        handle.shutdown();
        let _ = done_tx.send(());
    });
    done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("shutdown must not hang");
    for mut s in streams {
        // Each stream ends: finished normally before the shutdown, or told why it stopped.
        let mut last = None;
        while let Some(item) = s.blocking_next() {
            last = Some(item);
        }
        match last {
            Some(Ok(o)) => assert!(o.finish_reason.is_some()),
            Some(Err(err)) => assert_eq!(err, baton_core::api::EngineError::Shutdown),
            None => panic!("a stream ended with no output and no error"),
        }
    }
    assert!(matches!(e.submit(EngineRequest::new(vec![1], greedy(1))), Err(SubmitError::Unavailable(_))));
}
