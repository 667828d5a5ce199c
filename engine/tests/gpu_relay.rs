//! The relay on CUDA: two CUDA engines (prefill and decode, same device) exchanging a prompt's
//! bf16 KV over the TCP transport must produce exactly the greedy tokens and logprobs of one
//! CUDA engine alone, and a CUDA-to-CPU-layout mismatch is refused. This exercises the CUDA
//! backend's `read_kv_blocks`/`write_kv_blocks` (device↔host copies of scattered blocks).
//!
//! `gpu2_*` tests need two GPUs: P on `cuda:0`, D on `cuda:1`, the KV moving over an NCCL
//! link (no host staging).
//!
//! Named `gpu_*`/`gpu2_*`: excluded from CI by name, and they FAIL when no GPU is present.

mod common;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest};
use baton_core::params::SamplingParams;
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, start_engine};
use baton_formats::testing::TinySpec;
use common::relay::*;
use common::{assert_all_blocks_free, prompt, tiny};

fn start(model: &baton_formats::LoadedModel, device: DeviceSpec) -> EngineHandle {
    let cfg = EngineConfig { num_kv_blocks: Some(128), max_model_len: Some(512), ..EngineConfig::default() };
    start_engine(model, device, cfg).unwrap_or_else(|e| panic!("start on {device}: {e}"))
}

#[test]
fn gpu_relayed_requests_match_one_cuda_engine() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let (unified, p, d) = (
        start(&m.model, DeviceSpec::Cuda(0)),
        start(&m.model, DeviceSpec::Cuda(0)),
        start(&m.model, DeviceSpec::Cuda(0)),
    );
    assert_eq!(p.kv_layout().dtype, baton_core::kv_transfer::KvDtype::BF16);
    let params =
        SamplingParams { max_tokens: Some(16), ignore_eos: true, logprobs: Some(2), ..SamplingParams::greedy() };
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        // Scatter the blocks: keep a few reservations on D so the relayed ones are not 0, 1, 2...
        let mut keep = Vec::new();
        for i in 0..3 {
            keep.push(
                d.reserve_import(EngineRequest::new(prompt(900 + i, 20, vocab), params.clone())).await.expect("r"),
            );
        }
        for (i, len) in [1usize, 16, 17, 63, 130].into_iter().enumerate() {
            let pr = prompt(700 + i as u64, len, vocab);
            let alone: Vec<EngineOutput> =
                collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
            let (p_out, d_out) = relay(&p, &d, &listener, &pr, params.clone(), None).await;
            assert_eq!(p_out[0].new_token_ids, alone[0].new_token_ids, "first token, prompt of {len}");
            assert_eq!(tokens(&d_out), tokens(&alone), "prompt of {len}");
            let lp =
                |o: &[EngineOutput]| o.iter().flat_map(|x| x.logprobs.iter().map(|l| l.logprob)).collect::<Vec<_>>();
            assert_eq!(lp(&d_out), lp(&alone), "logprobs, prompt of {len}");
        }
        drop(keep);
    });
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d] {
        e.shutdown();
    }
}

#[test]
fn gpu_a_cuda_to_cpu_hand_off_is_refused_for_its_dtype() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let (p, d) = (start(&m.model, DeviceSpec::Cuda(0)), start(&m.model, DeviceSpec::Cpu));
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let params = SamplingParams { max_tokens: Some(4), ..SamplingParams::greedy() };
        let pr = prompt(5, 20, vocab);
        let (d_stream, table) = d.reserve_import(EngineRequest::new(pr.clone(), params.clone())).await.expect("r");
        let (_p_stream, events) = p
            .submit_export(EngineRequest::new(pr, params), table, baton_engine::kv_connector::ExportVia::Host)
            .expect("export");
        let layout = p.kv_layout();
        let d_id = d_stream.request_id();
        let token = baton_core::cluster_auth::ReservationToken::random();
        let sender = tokio::spawn(async move {
            baton_engine::kv_transport::handoff::send_export(
                events,
                addr,
                token,
                layout,
                std::time::Duration::from_secs(5),
                None,
                creds(),
            )
            .await
        });
        let pending = listener.accept().await.expect("accept");
        let err = baton_engine::kv_transport::handoff::receive_import(
            pending,
            &d,
            &Default::default(),
            std::time::Duration::from_secs(5),
            admit_from(vec![(token, d_id)]),
        )
        .await
        .expect_err("refused");
        assert!(err.to_string().contains("dtype"), "{err}");
        let sent = sender.await.expect("join");
        assert!(
            sent.err().is_some_and(|e| e.to_string().contains("dtype BF16 vs F32") || e.to_string().contains("dtype"))
        );
        d.import_failed(d_stream.request_id());
        drop(d_stream);
    });
    assert_all_blocks_free(&p);
    assert_all_blocks_free(&d);
    p.shutdown();
    d.shutdown();
}

#[test]
fn gpu2_nccl_relay_matches_one_cuda_engine() {
    use baton_engine::kv_connector::Links;
    use baton_engine::kv_transport::handoff::setup_link;
    use std::sync::Arc;
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let unified = start(&m.model, DeviceSpec::Cuda(0));
    let p = start(&m.model, DeviceSpec::Cuda(0));
    let d = start(&m.model, DeviceSpec::Cuda(1));
    let params =
        SamplingParams { max_tokens: Some(16), ignore_eos: true, logprobs: Some(2), ..SamplingParams::greedy() };
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let d_links = Arc::new(Links::default());
        // Link setup: P offers, D accepts (and joins in the background), P joins.
        let stream = p.transfer_stream().await.expect("transfer stream on cuda:0");
        let offer = tokio::spawn(setup_link(
            addr,
            p.kv_layout(),
            std::time::Duration::from_secs(30),
            "p0".into(),
            stream,
            creds(),
        ));
        let pending = listener.accept().await.expect("accept");
        let got = baton_engine::kv_transport::handoff::receive_import(
            pending,
            &d,
            &d_links,
            std::time::Duration::from_secs(30),
            admit_from(vec![]),
        )
        .await
        .expect("link setup");
        assert_eq!(got, baton_engine::kv_transport::handoff::Received::Link { name: "p0".into() });
        let link = Arc::new(offer.await.expect("join").expect("P joined the link"));
        let via = Via { d_links, p_link: Some(("p0".into(), link)) };
        // Several hand-offs at once on the one link: P computes them in one step, so their
        // layer sends interleave, and D must post the receives in P's send order.
        let many: Vec<Vec<u32>> = [3usize, 40, 17, 130, 64, 1, 250, 90]
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(700 + i as u64, n, vocab))
            .collect();
        let outs = relay_many(&p, &d, &listener, &many, params.clone(), &via).await;
        for (pr, d_out) in many.iter().zip(&outs) {
            let alone = collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
            assert_eq!(tokens(d_out), tokens(&alone), "concurrent NCCL relay, prompt of {}", pr.len());
        }
        for (i, len) in [1usize, 16, 17, 63, 130, 400].into_iter().enumerate() {
            let pr = prompt(800 + i as u64, len, vocab);
            let alone: Vec<EngineOutput> =
                collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("submit")).await;
            let (p_out, d_out) = relay_via(&p, &d, &listener, &pr, params.clone(), None, &via).await;
            assert_eq!(p_out[0].new_token_ids, alone[0].new_token_ids, "first token, prompt of {len}");
            assert_eq!(tokens(&d_out), tokens(&alone), "NCCL relay, prompt of {len}");
            let lp =
                |o: &[EngineOutput]| o.iter().flat_map(|x| x.logprobs.iter().map(|l| l.logprob)).collect::<Vec<_>>();
            assert_eq!(lp(&d_out), lp(&alone), "logprobs, prompt of {len}");
        }
    });
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d] {
        e.shutdown();
    }
}
