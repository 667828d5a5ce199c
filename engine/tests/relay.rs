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
        let (p_stream, events) = p
            .submit_export(
                EngineRequest::new(prompt(2, 60, vocab), greedy(4)),
                table,
                baton_engine::kv_connector::ExportVia::Host,
            )
            .expect("x");
        drop(events);
        drop(p_stream);
        drop(b_stream);
    });
    assert_all_blocks_free(&d);
    assert_all_blocks_free(&p);
    d.shutdown();
    p.shutdown();
}

/// A sender whose plan aims at blocks the receiving request does not own (another request's
/// reservation) is refused at the handshake, before any layer: nothing is written there, the
/// request falls back to computing its prompt itself (the router's choice after a failed
/// hand-off) and still gives the tokens one engine gives, and every block ends free.
#[test]
fn a_transfer_aimed_at_blocks_outside_the_reservation_is_refused_and_recomputed() {
    use baton_engine::kv_connector::Links;
    use baton_engine::kv_transport::TransportError;
    use baton_engine::kv_transport::handoff::receive_import;
    use baton_engine::kv_transport::tcp::TcpKvSender;
    use baton_engine::kv_transport::{Handshake, LayerFrame};
    use baton_engine::relay::TransferTrailer;
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let unified = engine(&m.model, EngineConfig::default());
    let d = engine(&m.model, EngineConfig::default());
    let params = greedy(6);
    let (pa, pb) = (prompt(41, 40, vocab), prompt(42, 40, vocab));
    rt().block_on(async {
        let alone = collect(unified.submit(EngineRequest::new(pa.clone(), params.clone())).expect("submit")).await;
        let (a_stream, a_table) = d.reserve_import(EngineRequest::new(pa.clone(), params.clone())).await.expect("a");
        let (b_stream, b_table) = d.reserve_import(EngineRequest::new(pb, params.clone())).await.expect("b");
        assert!(a_table.iter().all(|blk| !b_table.contains(blk)));
        let a_id = a_stream.request_id();
        let layout = d.kv_layout();
        // Request a's hand-off, planned onto b's blocks.
        let plan = baton_core::kv_transfer::plan_transfer(&layout, &a_table, &b_table, pa.len(), 0).expect("plan");
        let token = baton_core::cluster_auth::ReservationToken::random();
        let hs = Handshake {
            layout,
            sender: common::relay::PREFILL.into(),
            reservation: Some(token),
            num_tokens: pa.len(),
            runs: plan.runs.clone(),
            bytes_per_layer_half: plan.bytes_per_layer / 2,
            nccl: None,
        };
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let first_token = alone[0].new_token_ids[0];
        let sender = tokio::spawn(async move {
            let mut s = TcpKvSender::connect(addr, hs, std::time::Duration::from_secs(10), None).await?;
            let half = plan.bytes_per_layer / 2;
            for layer in 0..layout.num_layers {
                s.send_layer(&LayerFrame { layer, k: vec![0x7f; half], v: vec![0x7f; half], seq: 0, coding: None })
                    .await?;
            }
            s.finish(&TransferTrailer { first_token, logprobs: None }).await
        });
        let pending = listener.accept().await.expect("accept");
        let links = std::sync::Arc::new(Links::default());
        let admit = common::relay::admit_from(vec![(token, a_id)]);
        let got = receive_import(pending, &d, &links, std::time::Duration::from_secs(10), admit).await;
        let err = got.map(|_| ()).expect_err("refused");
        assert!(
            matches!(&err.source, TransportError::Refused(m) if m.contains("where the reservation holds")),
            "{err}"
        );
        let sent = sender.await.expect("join");
        assert!(matches!(&sent, Err(TransportError::Refused(_))), "{sent:?}");
        d.import_failed(a_id);
        assert_eq!(tokens(&collect(a_stream).await), tokens(&alone), "a recomputed its prompt");
        drop(b_stream);
    });
    assert_all_blocks_free(&d);
    for e in [unified, d] {
        e.shutdown();
    }
}

/// An export says when the engine first schedules its prompt (the router counts the hand-off
/// deadline from there, not from the enqueue): one `Started` before the plan, however many
/// chunks the prompt takes, then the plan, one frame per layer, and the first token.
#[test]
fn an_export_reports_its_start_once_before_the_plan() {
    use baton_engine::relay::ExportEvent;
    let spec = TinySpec::llama();
    let m = tiny(&spec);
    let vocab = m.model.config.vocab_size;
    let layers = m.model.config.num_hidden_layers;
    let d = engine(&m.model, EngineConfig::default());
    // 16 tokens per step: the 60-token prompt takes four steps.
    let p = engine(&m.model, EngineConfig { max_num_batched_tokens: 16, max_num_seqs: 16, ..EngineConfig::default() });
    let rt = rt();
    rt.block_on(async {
        let pr = prompt(9, 60, vocab);
        let (d_stream, table) = d.reserve_import(EngineRequest::new(pr.clone(), greedy(4))).await.expect("reserve");
        let (p_stream, mut events) = p
            .submit_export(EngineRequest::new(pr, greedy(4)), table, baton_engine::kv_connector::ExportVia::Host)
            .expect("export");
        let mut kinds = Vec::new();
        while let Some(e) = events.recv().await {
            kinds.push(match e {
                ExportEvent::Started => "started",
                ExportEvent::Plan(_) => "plan",
                ExportEvent::Layer(_) => "layer",
                ExportEvent::Done(_) => "done",
            });
        }
        let mut want = vec!["started", "plan"];
        want.extend(std::iter::repeat_n("layer", layers));
        want.push("done");
        assert_eq!(kinds, want);
        drop(p_stream);
        drop(d_stream);
    });
    assert_all_blocks_free(&d);
    assert_all_blocks_free(&p);
    d.shutdown();
    p.shutdown();
}
