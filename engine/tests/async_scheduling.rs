//! Async scheduling (a decode step planned while the one before it is in flight, its rows fed
//! the in-flight picks) must change nothing a client sees: the same tokens, logprobs, finish
//! reasons and stop tokens as planning each step after the previous one's tokens are applied,
//! under stop tokens that end requests mid-flight, penalties that read the newest token,
//! seeded sampling, waiting requests, preemption and aborts; and it must leak no block.

mod common;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest, FinishReason};
use baton_core::params::SamplingParams;
use baton_engine::{EngineConfig, EngineHandle};
use baton_formats::testing::TinySpec;
use common::*;

/// What a client sees of one request.
type Seen = (Vec<u32>, Vec<EngineOutput>, FinishReason);

/// Twelve requests of every kind: greedy, seeded with penalties (which read the token the
/// previous step sampled), logprobs, stop tokens that fire a few tokens in, min_tokens.
fn workload(vocab: usize, stops: &[u32]) -> Vec<EngineRequest> {
    (0..12u64)
        .map(|i| {
            let p = prompt(300 + i, 3 + (i as usize * 7) % 29, vocab);
            let max_tokens = Some(6 + (i as usize * 5) % 17);
            let params = match i % 4 {
                0 => SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy() },
                1 => SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    seed: Some(1000 + i),
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.4,
                    max_tokens,
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
                2 => SamplingParams { logprobs: Some(3), max_tokens, ignore_eos: true, ..SamplingParams::greedy() },
                _ => SamplingParams {
                    stop_token_ids: stops.to_vec(),
                    min_tokens: 1,
                    max_tokens,
                    ignore_eos: true,
                    ..SamplingParams::greedy()
                },
            };
            EngineRequest::new(p, params)
        })
        .collect()
}

/// Same entries and ids; values within 1e-5 (the CPU's sums are not bit-identical across
/// batch shapes, and a planned-ahead step carries a stopped request's row one step longer).
fn assert_logprobs_match(got: &[EngineOutput], want: &[EngineOutput], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: outputs");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.logprobs.len(), w.logprobs.len(), "{what}: logprob entries");
        for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
            assert_eq!(a.token_id, b.token_id, "{what}");
            assert!((a.logprob - b.logprob).abs() <= 1e-5, "{what}: {} vs {}", a.logprob, b.logprob);
            assert_eq!(a.top.iter().map(|t| t.0).collect::<Vec<_>>(), b.top.iter().map(|t| t.0).collect::<Vec<_>>());
            assert!(a.top.iter().zip(&b.top).all(|(x, y)| (x.1 - y.1).abs() <= 1e-5), "{what}: top logprobs");
        }
    }
}

fn run_all(e: &EngineHandle, reqs: &[EngineRequest]) -> Vec<Seen> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).expect("submit")).collect();
    streams.into_iter().map(drain).collect()
}

#[test]
fn async_scheduling_changes_nothing_a_client_sees() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    // Stop tokens that really come up: tokens the greedy requests produce a few steps in.
    let probe = engine(&m.model, EngineConfig { async_scheduling: false, ..EngineConfig::default() });
    let stops: Vec<u32> = (0..3u64)
        .map(|i| run(&probe, &prompt(300 + 4 * i + 3, 3 + ((4 * i + 3) as usize * 7) % 29, vocab), greedy(8))[3])
        .collect();
    probe.shutdown();
    let reqs = workload(vocab, &stops);
    for (label, cfg) in [
        ("every request seated", EngineConfig { max_num_seqs: 16, ..EngineConfig::default() }),
        ("4 seats, the rest waiting", EngineConfig { max_num_seqs: 4, ..EngineConfig::default() }),
        (
            "a pool small enough to preempt",
            EngineConfig {
                num_kv_blocks: Some(8),
                max_model_len: Some(64),
                max_num_seqs: 8,
                ..EngineConfig::default()
            },
        ),
    ] {
        let sync = engine(&m.model, EngineConfig { async_scheduling: false, ..cfg.clone() });
        let want = run_all(&sync, &reqs);
        assert_eq!(sync.step_timing().planned_ahead, 0, "{label}: nothing is planned ahead when it is off");
        assert_all_blocks_free(&sync);
        sync.shutdown();

        let e = engine(&m.model, EngineConfig { async_scheduling: true, ..cfg });
        let got = run_all(&e, &reqs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.0, w.0, "{label}: request {i}'s tokens");
            assert_eq!(g.2, w.2, "{label}: request {i}'s finish reason");
            let stops = |s: &Seen| s.1.iter().map(|o| o.stop_token).collect::<Vec<_>>();
            assert_eq!(stops(g), stops(w), "{label}: request {i}'s stop token");
            assert_logprobs_match(&g.1, &w.1, &format!("{label}: request {i}"));
        }
        assert!(want.iter().any(|w| w.2 == FinishReason::Stop), "{label}: some request ends on a stop token");
        let t = e.step_timing();
        // With every request seated, most decode steps are planned ahead; where requests wait
        // for a seat or for blocks, fewer can be.
        let share = if label == "every request seated" { 2 } else { 8 };
        assert!(
            t.planned_ahead * share > t.steps,
            "{label}: only {} of {} steps planned ahead",
            t.planned_ahead,
            t.steps
        );
        assert_all_blocks_free(&e);
        e.shutdown();
    }
}

#[test]
fn aborts_while_a_step_is_planned_ahead_free_everything() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let e = engine(&m.model, EngineConfig { async_scheduling: true, ..EngineConfig::default() });
    let keep = prompt(900, 20, vocab);
    let alone = run(&e, &keep, greedy(40));
    for round in 0..5u64 {
        let kept = e.submit(EngineRequest::new(keep.clone(), greedy(40))).expect("submit");
        let mut dropped: Vec<_> = (0..4)
            .map(|i| e.submit(EngineRequest::new(prompt(910 + 4 * round + i, 15, vocab), greedy(200))).expect("submit"))
            .collect();
        // Read a few tokens of each, then drop them mid-generation.
        for s in &mut dropped {
            for _ in 0..=round {
                s.blocking_next().expect("a token").expect("no error");
            }
        }
        drop(dropped);
        assert_eq!(drain(kept).0, alone, "round {round}: aborted neighbours changed a request's tokens");
        assert_all_blocks_free(&e);
    }
    assert!(e.step_timing().planned_ahead > 0);
}
