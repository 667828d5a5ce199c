//! The prefill → decode relay between two real CPU engines over the TCP transport, in one
//! process: a prompt computed on P and decoded on D must give exactly the tokens (and
//! logprobs) one engine gives alone; a transfer that breaks mid-way falls back to a local
//! recompute on D with the same result; both engines end with every block free.

mod common;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::EngineConfig;
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_formats::testing::TinySpec;
use common::relay::*;
use common::*;

#[test]
fn relayed_requests_match_one_engine_token_for_token() {
    let spec = TinySpec::llama();
    let m = tiny(&spec);
    let vocab = m.model.config.vocab_size;
    let cfg = EngineConfig { enable_prefix_caching: true, ..EngineConfig::default() };
    let unified = engine(&m.model, cfg.clone());
    let p = engine(&m.model, EngineConfig { record_cache_events: true, ..cfg.clone() });
    let d = engine(&m.model, cfg);
    let params = SamplingParams { logprobs: Some(3), ..greedy(10) };
    let prompts: Vec<Vec<u32>> =
        [1usize, 15, 16, 17, 40, 70].iter().enumerate().map(|(i, &n)| prompt(500 + i as u64, n, vocab)).collect();
    let rt = rt();
    rt.block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        for pr in &prompts {
            let alone = collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
            let (p_out, d_out) = relay(&p, &d, &listener, pr, params.clone(), None).await;
            assert_eq!(p_out.len(), 1, "the prefill side yields exactly the first token");
            assert_eq!(p_out[0].finish_reason, None);
            assert_eq!(tokens(&d_out), tokens(&alone), "prompt of {} tokens", pr.len());
            assert_eq!(p_out[0].new_token_ids, alone[0].new_token_ids);
            // Logprobs of the first token travel with the KV; later ones are D's own.
            let lp = |outs: &[EngineOutput]| outs.iter().flat_map(|o| o.logprobs.clone()).collect::<Vec<_>>();
            assert_eq!(lp(&d_out), lp(&alone));
            assert_eq!(d_out[0].num_cached_tokens, pr.len(), "D computed none of the prompt");
        }
        // A transfer cut after 1 layer: D recomputes the prompt itself, same tokens.
        let pr = &prompts[4];
        let alone = tokens(&collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("s")).await);
        let (_, d_out) = relay(&p, &d, &listener, pr, params.clone(), Some(1)).await;
        assert_eq!(tokens(&d_out), alone, "recompute after a broken transfer");
    });
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    // The prefill side cached the prompts' full blocks and reports them for the router.
    let events = p.take_cache_events();
    assert!(
        events.iter().filter(|e| matches!(e, baton_core::block_manager::CacheEvent::Stored(_))).count() >= 1 + 2 + 4,
        "{events:?}"
    );
    for e in [unified, p, d] {
        e.shutdown();
    }
}

#[test]
fn concurrent_relays_match_one_engine() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let unified = engine(&m.model, EngineConfig::default());
    let (p, d) = (engine(&m.model, EngineConfig::default()), engine(&m.model, EngineConfig::default()));
    let params = SamplingParams { logprobs: Some(1), ..greedy(8) };
    let prompts: Vec<Vec<u32>> =
        [5usize, 16, 33, 70, 1, 48].iter().enumerate().map(|(i, &n)| prompt(900 + i as u64, n, vocab)).collect();
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let outs = relay_many(&p, &d, &listener, &prompts, params.clone(), &Via::default()).await;
        for (pr, d_out) in prompts.iter().zip(&outs) {
            let alone = collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
            assert_eq!(tokens(d_out), tokens(&alone), "prompt of {} tokens", pr.len());
        }
    });
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d] {
        e.shutdown();
    }
}

#[test]
fn a_reservation_that_cannot_fit_is_refused_and_an_abort_mid_transfer_frees_both_sides() {
    let spec = TinySpec::llama();
    let m = tiny(&spec);
    let vocab = m.model.config.vocab_size;
    let d = engine(&m.model, EngineConfig { num_kv_blocks: Some(8), max_model_len: Some(128), ..Default::default() });
    let p = engine(&m.model, EngineConfig::default());
    let rt = rt();
    rt.block_on(async {
        // 8 blocks of 16 hold 128 tokens: two 60-token reservations fit, a third does not.
        let a = d.reserve_import(EngineRequest::new(prompt(1, 60, vocab), greedy(4))).await.expect("first");
        let b = d.reserve_import(EngineRequest::new(prompt(2, 60, vocab), greedy(4))).await.expect("second");
        let c = d.reserve_import(EngineRequest::new(prompt(3, 60, vocab), greedy(4))).await;
        assert!(matches!(c, Err(baton_core::api::SubmitError::QueueFull { .. })), "{:?}", c.map(|_| ()));
        // Dropping a reservation's stream aborts it and frees its blocks, transfer or not.
        drop(a);
        let (b_stream, table) = b;
        let (p_stream, events) =
            p.submit_export(EngineRequest::new(prompt(2, 60, vocab), greedy(4)), table, None).expect("x");
        drop(events);
        drop(p_stream);
        drop(b_stream);
    });
    assert_all_blocks_free(&d);
    assert_all_blocks_free(&p);
    d.shutdown();
    p.shutdown();
}
