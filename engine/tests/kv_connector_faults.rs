//! The link state machine under faults, on the CPU: two real engines hand prompts off over
//! a [`Link`] whose communicator is the in-process fake (`kv_connector::fake`), through the
//! real transport (TCP control connection, handshake, notices) and the real connectors. The
//! CPU analogue of each two-GPU fault run:
//! - two concurrent hand-offs on one link, the first one's notices delayed 500 ms: the second
//!   completes only after them (its trailer never overtakes its own receives);
//! - the transfer task dropped right after the export step: both ends fail the link, the
//!   request recomputes, and new links then serve hand-off after hand-off;
//! - a refused reservation: nothing is sent, the link stays usable;
//! - a dead peer: the link fails on both sides within the timeout and is evicted, the
//!   request recomputes, neither engine hangs, and a new link serves again (links counted).
//!
//! Every case checks tokens against one engine alone and that every block is free at the end.

mod common;

use baton_core::api::{EngineClient, EngineRequest, RequestId};
use baton_core::cluster_auth::ReservationToken;
use baton_core::params::SamplingParams;
use baton_engine::kv_connector::fake::{self, FakeControl};
use baton_engine::kv_connector::{Link, Links};
use baton_engine::kv_transport::handoff::{Received, receive_import, send_export};
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::relay::ExportEvent;
use baton_engine::{EngineConfig, EngineHandle, EngineHealth};
use baton_formats::testing::TinySpec;
use common::relay::*;
use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::unbounded_channel;

const DEADLINE: Duration = Duration::from_secs(10);
/// The engines' link timeout: short, so the dead-peer cases end quickly.
const TIMEOUT: Duration = Duration::from_secs(1);

fn cfg() -> EngineConfig {
    EngineConfig { kv_transfer_timeout: TIMEOUT, ..EngineConfig::default() }
}

/// A new fake link named `name`: its receiving end filed in `d_links` (as a link setup does
/// on the decode worker), its sending end returned (as the prefill worker keeps it).
fn fake_link(d_links: &Arc<Links>, name: &str) -> (Arc<Link>, FakeControl) {
    let (tx, rx, ctl) = fake::pair();
    d_links.insert(name.into(), Arc::new(Link::new(name, PREFILL, Box::new(rx))));
    (Arc::new(Link::new(name, "decode-0", Box::new(tx))), ctl)
}

struct Engines {
    unified: EngineHandle,
    p: EngineHandle,
    d: EngineHandle,
    vocab: usize,
}

fn engines() -> Engines {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    Engines { unified: engine(&m.model, cfg()), p: engine(&m.model, cfg()), d: engine(&m.model, cfg()), vocab }
}

impl Engines {
    async fn alone(&self, pr: &[u32], params: &SamplingParams) -> Vec<u32> {
        tokens(&collect(self.unified.submit(EngineRequest::new(pr.to_vec(), params.clone())).expect("submit")).await)
    }

    fn end(self) {
        for e in [&self.unified, &self.p, &self.d] {
            assert_eq!(e.health(), EngineHealth::Healthy);
            assert_all_blocks_free(e);
        }
        for e in [self.unified, self.p, self.d] {
            e.shutdown();
        }
    }
}

/// One hand-off of `pr` over `via`, driven by hand: D reserves, P exports; `tap` sits between
/// P's export events and the transfer task. Returns D's output stream, its request, and the
/// transfer and receive tasks.
async fn start_handoff(
    e: &Engines,
    listener: &TcpKvListener,
    pr: &[u32],
    params: &SamplingParams,
    via: &Via,
    tap: impl FnOnce(tokio::sync::mpsc::UnboundedReceiver<ExportEvent>) -> tokio::sync::mpsc::UnboundedReceiver<ExportEvent>,
) -> Handoff {
    let (d_stream, table) = e.d.reserve_import(EngineRequest::new(pr.to_vec(), params.clone())).await.expect("reserve");
    let d_id = d_stream.request_id();
    let token = ReservationToken::random();
    let (export_via, link) = via.export();
    let (p_stream, events) =
        e.p.submit_export(EngineRequest::new(pr.to_vec(), params.clone()), table, export_via).expect("export");
    let events = tap(events);
    let addr = listener.local_addr().expect("addr");
    let layout = e.p.kv_layout();
    let sender = tokio::spawn(send_export(events, addr, token, layout, DEADLINE, link, creds()));
    let pending = listener.accept().await.expect("accept");
    let (d, links) = (e.d.clone(), via.d_links.clone());
    let receiver = tokio::spawn(async move {
        receive_import(pending, &d, &links, DEADLINE, admit_from(vec![(token, d_id)])).await.map_err(|e| e.to_string())
    });
    Handoff { d_stream, d_id, p_stream, sender, receiver }
}

struct Handoff {
    d_stream: baton_core::api::OutputStream,
    d_id: RequestId,
    p_stream: baton_core::api::OutputStream,
    sender: tokio::task::JoinHandle<
        Result<baton_engine::kv_transport::handoff::HandoffReport, baton_engine::kv_transport::TransportError>,
    >,
    receiver: tokio::task::JoinHandle<Result<Received, String>>,
}

fn pass_through(
    events: tokio::sync::mpsc::UnboundedReceiver<ExportEvent>,
) -> tokio::sync::mpsc::UnboundedReceiver<ExportEvent> {
    events
}

#[test]
fn a_trailer_never_overtakes_its_own_receives_behind_a_delayed_notice() {
    let e = engines();
    let params = greedy(6);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let d_links = Arc::new(Links::default());
        let (link, _ctl) = fake_link(&d_links, "p0");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0".into(), link.clone())) };
        let (a, b) = (prompt(1, 40, e.vocab), prompt(2, 33, e.vocab));
        let (alone_a, alone_b) = (e.alone(&a, &params).await, e.alone(&b, &params).await);
        let t0 = Instant::now();
        let delay = Duration::from_millis(500);
        // A's notices and trailer are held back 500 ms (its plan goes at once, so its
        // handshake is accepted); B's flow freely. Both prompts run in one step, so B's layer
        // groups are numbered after A's and cannot be received before A's notices come.
        let hold_a = move |mut events: tokio::sync::mpsc::UnboundedReceiver<ExportEvent>| {
            let (tx, rx) = unbounded_channel();
            tokio::spawn(async move {
                while let Some(ev) = events.recv().await {
                    if matches!(ev, ExportEvent::Layer(_) | ExportEvent::Done(_)) {
                        tokio::time::sleep_until((t0 + delay).into()).await;
                    }
                    if tx.send(ev).is_err() {
                        break;
                    }
                }
            });
            rx
        };
        let mut ha = start_handoff(&e, &listener, &a, &params, &via, hold_a).await;
        let mut hb = start_handoff(&e, &listener, &b, &params, &via, pass_through).await;
        let first_b = hb.d_stream.next().await.expect("B's first token").expect("B ok");
        let b_at = t0.elapsed();
        assert!(b_at >= delay, "B took its first token after {b_at:?}, before A's notices were sent");
        let mut out_b = vec![first_b];
        out_b.extend(collect(hb.d_stream).await);
        assert_eq!(tokens(&out_b), alone_b, "B's tokens");
        assert_eq!(tokens(&collect(ha.d_stream).await), alone_a, "A's tokens");
        for h in [&mut ha.receiver, &mut hb.receiver] {
            assert!(matches!(h.await.expect("join"), Ok(Received::Import { .. })));
        }
        for h in [ha.sender, hb.sender] {
            h.await.expect("join").expect("sent");
        }
        assert_eq!(collect(ha.p_stream).await.len() + collect(hb.p_stream).await.len(), 2);
        assert!(!link.is_failed());
        assert_eq!(d_links.count(), 1);
    });
    e.end();
}

#[test]
fn a_dropped_transfer_task_fails_the_link_and_new_links_then_serve() {
    let e = engines();
    let params = greedy(5);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let d_links = Arc::new(Links::default());
        for round in 0..3u64 {
            let name = format!("p0-{round}");
            let (link, _ctl) = fake_link(&d_links, &name);
            let via = Via { d_links: d_links.clone(), p_link: Some((name.clone(), link.clone())) };
            let d_link = d_links.get(&name).expect("filed");
            let pr = prompt(10 + round, 45, e.vocab);
            let alone = e.alone(&pr, &params).await;
            // The transfer task is dropped right after the export step: once the first
            // notice went through, the rest (and the trailer) are lost with it.
            let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
            let tap = move |mut events: tokio::sync::mpsc::UnboundedReceiver<ExportEvent>| {
                let (tx, rx) = unbounded_channel();
                tokio::spawn(async move {
                    let mut seen = Some(seen_tx);
                    while let Some(ev) = events.recv().await {
                        let layer = matches!(ev, ExportEvent::Layer(_));
                        let _ = tx.send(ev);
                        if layer && let Some(s) = seen.take() {
                            let _ = s.send(());
                            // Hold the rest back: the task is about to be dropped.
                            std::future::pending::<()>().await;
                        }
                    }
                });
                rx
            };
            let h = start_handoff(&e, &listener, &pr, &params, &via, tap).await;
            seen_rx.await.expect("a notice went out");
            tokio::time::sleep(Duration::from_millis(20)).await;
            h.sender.abort();
            assert!(h.sender.await.expect_err("aborted").is_cancelled());
            assert!(h.receiver.await.expect("join").is_err(), "the receiver sees the hand-off break");
            assert!(link.is_failed(), "the sender failed its end of the link");
            assert!(d_link.is_failed(), "the receiver failed its end of the link");
            assert!(d_links.get(&name).is_none(), "a failed link is not handed out");
            // What the router then asks; the link's failure already started the recompute.
            e.d.import_failed(h.d_id);
            assert_eq!(tokens(&collect(h.d_stream).await), alone, "round {round}: the recompute's tokens");
            let p_out = collect_until_end(h.p_stream).await;
            assert!(p_out.len() <= 1);
        }
        // The next hand-offs to that peer make a new link and run on it, one after the other.
        let (link, _ctl) = fake_link(&d_links, "p0-new");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0-new".into(), link.clone())) };
        for i in 0..8u64 {
            let pr = prompt(100 + i, 5 + 9 * i as usize, e.vocab);
            let alone = e.alone(&pr, &params).await;
            let (_, d_out) = relay_via(&e.p, &e.d, &listener, &pr, params.clone(), None, &via).await;
            assert_eq!(tokens(&d_out), alone, "hand-off {i} on the new link");
        }
        assert!(!link.is_failed());
        assert_eq!(d_links.count(), 1, "only the new link is left");
    });
    e.end();
}

/// Reads an export's output stream to its end, tolerating an error (a failed export).
async fn collect_until_end(mut s: baton_core::api::OutputStream) -> Vec<baton_core::api::EngineOutput> {
    let mut outs = Vec::new();
    while let Some(o) = s.next().await {
        match o {
            Ok(o) => outs.push(o),
            Err(_) => break,
        }
    }
    outs
}

#[test]
fn a_refused_reservation_sends_nothing_and_the_link_stays_in_step() {
    let e = engines();
    let params = greedy(5);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let d_links = Arc::new(Links::default());
        let (link, ctl) = fake_link(&d_links, "p0");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0".into(), link.clone())) };
        // A first hand-off, so the link has history.
        let pr = prompt(20, 30, e.vocab);
        let alone = e.alone(&pr, &params).await;
        assert_eq!(tokens(&relay_via(&e.p, &e.d, &listener, &pr, params.clone(), None, &via).await.1), alone);
        let sent = link.sends_enqueued();
        assert!(sent > 0);
        // The reservation expires while its prefill is queued: D gives it up (and recomputes),
        // so the handshake that comes later is refused.
        let pr = prompt(21, 50, e.vocab);
        let alone = e.alone(&pr, &params).await;
        let expired = |events| events;
        let (d_stream, table) = e.d.reserve_import(EngineRequest::new(pr.clone(), params.clone())).await.expect("r");
        let d_id = d_stream.request_id();
        e.d.import_failed(d_id);
        let (export_via, link_send) = via.export();
        let (p_stream, events) =
            e.p.submit_export(EngineRequest::new(pr.clone(), params.clone()), table, export_via).expect("x");
        let token = ReservationToken::random();
        let addr = listener.local_addr().expect("addr");
        let sender =
            tokio::spawn(send_export(expired(events), addr, token, e.p.kv_layout(), DEADLINE, link_send, creds()));
        let pending = listener.accept().await.expect("accept");
        let refused = receive_import(pending, &e.d, &d_links, DEADLINE, |_: &ReservationToken, _: &str| {
            Err::<RequestId, String>("reservation is not waiting for KV here".into())
        })
        .await;
        assert!(refused.is_err_and(|e| e.request.is_none()), "refused at the handshake");
        assert!(sender.await.expect("join").is_err(), "the sender hears the refusal");
        let p_out = collect_until_end(p_stream).await;
        assert!(p_out.is_empty(), "the export that could not hand off fails: {p_out:?}");
        assert_eq!(link.sends_enqueued(), sent, "nothing of the refused hand-off was sent");
        assert_eq!(ctl.in_flight(), 0);
        assert!(!link.is_failed());
        assert_eq!(tokens(&collect(d_stream).await), alone, "D recomputed the expired reservation");
        // The link is still in step: the next hand-offs on it go through.
        for i in 0..3u64 {
            let pr = prompt(30 + i, 25, e.vocab);
            let alone = e.alone(&pr, &params).await;
            assert_eq!(tokens(&relay_via(&e.p, &e.d, &listener, &pr, params.clone(), None, &via).await.1), alone);
        }
        assert!(!link.is_failed());
        assert_eq!(d_links.count(), 1);
    });
    e.end();
}

#[test]
fn a_dead_peer_fails_and_evicts_the_link_and_the_request_recomputes() {
    let e = engines();
    let params = greedy(5);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let d_links = Arc::new(Links::default());
        let (link, ctl) = fake_link(&d_links, "p0");
        let d_link = d_links.get("p0").expect("filed");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0".into(), link.clone())) };
        let pr = prompt(40, 60, e.vocab);
        let alone = e.alone(&pr, &params).await;
        // The peer dies with the hand-off's data in flight: nothing on the wire ever completes.
        ctl.kill();
        let t0 = Instant::now();
        let h = start_handoff(&e, &listener, &pr, &params, &via, pass_through).await;
        let received = h.receiver.await.expect("join");
        assert!(received.is_err(), "the trailer is refused: its layers never landed");
        assert!(t0.elapsed() < TIMEOUT * 5, "the receiver gave up within the timeout: {:?}", t0.elapsed());
        assert!(h.sender.await.expect("join").is_err());
        assert!(d_link.is_failed(), "D aborted its end");
        assert_eq!(d_links.count(), 0, "the dead peer's link is evicted");
        assert_eq!(tokens(&collect(h.d_stream).await), alone, "D recomputed the prompt");
        assert_eq!(collect_until_end(h.p_stream).await.len(), 1, "P produced the first token");
        // P does not hang: its sends never complete, and its deadline fails its end.
        let until = Instant::now() + TIMEOUT * 5;
        while !link.is_failed() {
            assert!(Instant::now() < until, "P's end of the dead link was never failed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(e.p.health(), EngineHealth::Healthy);
        // The next hand-off to that peer sets up a new link and runs on it.
        let (link, _ctl) = fake_link(&d_links, "p0");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0".into(), link.clone())) };
        let pr = prompt(41, 35, e.vocab);
        let alone = e.alone(&pr, &params).await;
        assert_eq!(tokens(&relay_via(&e.p, &e.d, &listener, &pr, params.clone(), None, &via).await.1), alone);
        assert_eq!(d_links.count(), 1);
    });
    e.end();
}

/// A decode request aborted (client gone) while receives into its blocks are in flight on a
/// link keeps those blocks until nothing more can land in them; only then are they freed, so
/// a new request can never get blocks a transfer is still writing.
#[test]
fn an_aborted_request_keeps_its_blocks_until_its_receives_landed() {
    let e = engines();
    let params = greedy(4);
    rt().block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let d_links = Arc::new(Links::default());
        let (link, ctl) = fake_link(&d_links, "p0");
        let via = Via { d_links: d_links.clone(), p_link: Some(("p0".into(), link.clone())) };
        let pr = prompt(7, 60, e.vocab);
        // Nothing sent on the link reaches the receiver until released.
        ctl.hold(true);
        let h = start_handoff(&e, &listener, &pr, &params, &via, pass_through).await;
        let until = Instant::now() + Duration::from_millis(500);
        while ctl.in_flight() == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(ctl.in_flight() > 0, "the prefill side sent layer groups");
        // Let the decode side take the notices and enqueue its receives.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let held = e.d.stats().num_used_blocks;
        assert!(held > 0, "the reservation holds blocks");
        e.d.abort(h.d_id);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            e.d.stats().num_used_blocks,
            held,
            "an aborted request's blocks stay held while receives into them may still land"
        );
        ctl.hold(false);
        let out = collect_until_end(h.d_stream).await;
        assert_eq!(
            out.last().and_then(|o| o.finish_reason),
            Some(baton_core::api::FinishReason::Abort),
            "the client's stream ends as aborted"
        );
        let _ = h.receiver.await;
        let _ = h.sender.await;
        let _ = collect_until_end(h.p_stream).await;
    });
    // `end` waits for every block of every engine to be free and both to be healthy.
    e.end();
}
