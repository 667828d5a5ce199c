//! The prefill → decode relay between two real CPU engines over the TCP transport, in one
//! process: a prompt computed on P and decoded on D must give exactly the tokens (and
//! logprobs) one engine gives alone; a transfer that breaks mid-way falls back to a local
//! recompute on D with the same result; both engines end with every block free.

mod common;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest, OutputStream};
use baton_core::params::SamplingParams;
use baton_engine::kv_transport::handoff::{receive_import, send_export};
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{EngineConfig, EngineHandle};
use baton_formats::testing::TinySpec;
use common::*;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(10);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

async fn collect(mut s: OutputStream) -> Vec<EngineOutput> {
    let mut outs = Vec::new();
    while let Some(o) = s.next().await {
        let o = o.expect("engine error");
        let done = o.finish_reason.is_some();
        outs.push(o);
        if done {
            break;
        }
    }
    outs
}

fn tokens(outs: &[EngineOutput]) -> Vec<u32> {
    outs.iter().flat_map(|o| o.new_token_ids.iter().copied()).collect()
}

/// One relayed request: D reserves, P computes and streams, D decodes. `break_after` cuts the
/// transfer after that many layers (the prefill worker "dies"); D then recomputes.
async fn relay(
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    prompt: &[u32],
    params: SamplingParams,
    break_after: Option<usize>,
) -> (Vec<EngineOutput>, Vec<EngineOutput>) {
    let addr = listener.local_addr().expect("addr");
    let (d_stream, table) =
        d.reserve_import(EngineRequest::new(prompt.to_vec(), params.clone())).await.expect("reserve");
    let d_id = d_stream.request_id();
    let (p_stream, mut events) = p.submit_export(EngineRequest::new(prompt.to_vec(), params), table).expect("export");
    let layout = p.kv_layout();
    let sender = tokio::spawn(async move {
        match break_after {
            None => send_export(events, addr, d_id.0, layout, DEADLINE).await.map(|_| ()),
            Some(n) => {
                // Forward only the plan and n layers, then drop the connection mid-transfer.
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                for _ in 0..=n {
                    if let Some(e) = events.recv().await {
                        let _ = tx.send(e);
                    }
                }
                drop(tx);
                send_export(rx, addr, d_id.0, layout, DEADLINE).await.map(|_| ())
            }
        }
    });
    let pending = listener.accept().await.expect("accept");
    let received = receive_import(pending, d, DEADLINE, |hs| {
        if hs.request_id == d_id.0 { Ok(()) } else { Err("unexpected request".into()) }
    })
    .await;
    match (&received, break_after) {
        (Ok((id, report)), None) => {
            assert_eq!(*id, d_id);
            assert!(report.bytes > 0);
        }
        (Err(e), Some(_)) => {
            assert_eq!(e.request, Some(d_id), "{e}");
            d.import_failed(d_id);
        }
        (other, _) => panic!("unexpected receive outcome {:?}", other.as_ref().map(|_| ()).map_err(|e| e.to_string())),
    }
    let sent = sender.await.expect("join");
    assert_eq!(sent.is_ok(), break_after.is_none(), "sender: {sent:?}");
    (collect(p_stream).await, collect(d_stream).await)
}

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
            p.submit_export(EngineRequest::new(prompt(2, 60, vocab), greedy(4)), table).expect("x");
        drop(events);
        drop(p_stream);
        drop(b_stream);
    });
    assert_all_blocks_free(&d);
    assert_all_blocks_free(&p);
    d.shutdown();
    p.shutdown();
}
