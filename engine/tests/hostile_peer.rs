//! A hostile peer on a decode engine's KV port, after a real reservation: a handshake whose
//! runs total a billion blocks (or overflow), a frame declaring a terabyte, a layer past the
//! last, a first token outside the vocabulary, a sender without the cluster secret or not
//! the one the reservation is bound to, and a thousand idle connections. Each time the
//! hand-off fails on its own, the request recomputes and gives exactly the greedy tokens one
//! engine gives, memory stays bounded (VmRSS), the engine stays healthy, the listener serves
//! a bounded number of connections, and every block is free at the end. Bad data handed to
//! the engine directly (past the transport) is refused the same way.
//!
//! The listener has a cluster secret and the hostile peers (but one) prove it: the checks
//! against the reservation hold even for a peer inside the cluster.
//!
//! The raw-wire cases speak the TCP transport's documented format themselves
//! (`baton_engine::kv_transport::tcp`): the receiver's magic `BKV5` and 32-byte challenge,
//! then the sender's magic and frames `kind: u8, len: u64 LE`, the `HELLO` carrying a
//! 32-byte proof before the handshake JSON.

mod common;

use baton_core::api::{EngineClient, EngineRequest, RequestId};
use baton_core::cluster_auth::{ClusterSecret, KV_NONCE_LEN, KvChallenge, ReservationToken};
use baton_core::kv_transfer::{BlockRun, KvLayout, plan_transfer};
use baton_engine::EngineHandle;
use baton_engine::kv_transport::handoff::{ImportError, Received, send_export};
use baton_engine::kv_transport::intake::{ImportIntake, IntakeLimits};
use baton_engine::kv_transport::tcp::{TcpKvListener, TcpKvSender};
use baton_engine::kv_transport::{Handshake, KvCredentials, LayerFrame, TransportError};
use baton_engine::relay::TransferTrailer;
use baton_engine::{EngineConfig, EngineHealth};
use baton_formats::testing::TinySpec;
use common::relay::{PREFILL, collect, rt, tokens};
use common::*;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

const DEADLINE: Duration = Duration::from_secs(5);
const HELLO: u8 = 1;
const ACCEPT: u8 = 2;
const LAYER: u8 = 4;
/// Most the process may grow over all the hostile cases (the engines are already loaded).
const RSS_BUDGET_KIB: u64 = 192 << 10;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS value")
}

/// The cluster secret of the test's workers.
fn secret() -> ClusterSecret {
    ClusterSecret::from_bytes(b"the hostile-peer test's cluster secret").expect("secret")
}

/// What the test's prefill side proves and claims.
fn creds() -> KvCredentials {
    KvCredentials { secret: Some(secret()), identity: PREFILL.into() }
}

/// The decode worker's reservation table (as the worker keeps it): token → request, each
/// bound to [`PREFILL`].
#[derive(Clone, Default)]
struct Expected(Arc<Mutex<Vec<(ReservationToken, RequestId)>>>);

impl Expected {
    /// Issues a token for `id`.
    fn expect(&self, id: RequestId) -> ReservationToken {
        let token = ReservationToken::random();
        self.0.lock().expect("lock").push((token, id));
        token
    }

    fn admit(&self, token: &ReservationToken, sender: &str) -> Result<RequestId, String> {
        let table = self.0.lock().map_err(|_| "poisoned".to_owned())?;
        match table.iter().find(|(t, _)| t == token) {
            Some((_, id)) if sender == PREFILL => Ok(*id),
            _ => Err(format!("reservation {token} is not waiting for KV from {sender}")),
        }
    }
}

/// A decode engine's KV listener (with the cluster secret) served by an [`ImportIntake`]
/// admitting the tokens of `expected` (the engine's reservations then check the rest); every
/// connection's outcome comes out of the channel.
async fn listen(
    d: &EngineHandle,
    limits: IntakeLimits,
    expected: Expected,
) -> (SocketAddr, Arc<ImportIntake>, UnboundedReceiver<Result<Received, ImportError>>) {
    let listener =
        TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind").with_secret(Some(secret()));
    let addr = listener.local_addr().expect("addr");
    let intake = ImportIntake::new(d.clone(), Default::default(), DEADLINE, limits);
    let (tx, rx) = unbounded_channel();
    let admit = move |token: &ReservationToken, sender: &str| expected.admit(token, sender);
    tokio::spawn(intake.clone().serve(listener, admit, move |r| drop(tx.send(r))));
    (addr, intake, rx)
}

/// Connects and offers `hs` proving the cluster secret, as an honest sender does.
async fn connect(addr: SocketAddr, hs: Handshake) -> Result<TcpKvSender, TransportError> {
    TcpKvSender::connect(addr, hs, DEADLINE, Some(&secret())).await
}

/// The handshake an honest prefill worker makes for a reservation.
fn honest(layout: KvLayout, token: ReservationToken, table: &[u32], prompt_len: usize) -> Handshake {
    let plan = plan_transfer(&layout, table, table, prompt_len, 0).expect("plan");
    Handshake {
        layout,
        sender: PREFILL.into(),
        reservation: Some(token),
        num_tokens: prompt_len,
        runs: plan.runs,
        bytes_per_layer_half: plan.bytes_per_layer / 2,
        nccl: None,
    }
}

/// A peer writing the wire format by hand.
struct RawPeer(TcpStream);

impl RawPeer {
    async fn frame(&mut self, kind: u8, declared_len: u64, payload: &[u8]) {
        let mut head = vec![kind];
        head.extend_from_slice(&declared_len.to_le_bytes());
        // The receiver may already have hung up on a bad frame: that is the point.
        let _ = self.0.write_all(&head).await;
        let _ = self.0.write_all(payload).await;
    }

    /// Connects and offers `hs` (proving the cluster secret); returns the peer and the
    /// answer's kind.
    async fn hello(addr: SocketAddr, hs: &Handshake) -> (RawPeer, u8) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut greeting = [0u8; 4 + KV_NONCE_LEN];
        s.read_exact(&mut greeting).await.expect("the receiver's challenge");
        assert_eq!(&greeting[..4], b"BKV5");
        let challenge = KvChallenge(greeting[4..].try_into().expect("32 bytes"));
        s.write_all(b"BKV5").await.expect("magic");
        let body = serde_json::to_vec(hs).expect("json");
        let proof = secret().kv_proof(&challenge, &body);
        let mut peer = RawPeer(s);
        peer.frame(HELLO, (proof.len() + body.len()) as u64, &[&proof[..], &body].concat()).await;
        let mut head = [0u8; 9];
        peer.0.read_exact(&mut head).await.expect("answer");
        let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
        let mut reason = vec![0u8; len as usize];
        peer.0.read_exact(&mut reason).await.expect("answer body");
        (peer, head[0])
    }

    async fn layer(&mut self, layer: u32, half: usize) {
        let mut payload = layer.to_le_bytes().to_vec();
        payload.extend_from_slice(&(half as u64).to_le_bytes());
        payload.extend_from_slice(&0u64.to_le_bytes());
        // Then the two FP8 scales (0, 0: none) and the K and V bytes.
        payload.resize(28 + 2 * half, 0);
        self.frame(LAYER, payload.len() as u64, &payload).await;
    }
}

/// Waits for the next connection's outcome and returns its error.
async fn failure(results: &mut UnboundedReceiver<Result<Received, ImportError>>) -> ImportError {
    match tokio::time::timeout(DEADLINE * 2, results.recv()).await.expect("an outcome in time").expect("open") {
        Err(e) => e,
        Ok(r) => panic!("the hostile hand-off was accepted: {r:?}"),
    }
}

#[test]
fn hostile_handshakes_and_frames_cost_their_own_request_a_recompute() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let unified = engine(&m.model, EngineConfig::default());
    let d = engine(&m.model, EngineConfig::default());
    let layout = d.kv_layout();
    let params = greedy(6);
    rt().block_on(async {
        let expected = Expected::default();
        let (addr, _intake, mut results) = listen(&d, IntakeLimits::default(), expected.clone()).await;
        // Warm both engines up before measuring memory.
        let warm = prompt(1, 40, vocab);
        collect(unified.submit(EngineRequest::new(warm.clone(), params.clone())).expect("submit")).await;
        collect(d.submit(EngineRequest::new(warm, params.clone())).expect("submit")).await;
        let rss_before = rss_kib();

        for case in 0..11u64 {
            let pr = prompt(100 + case, 40, vocab);
            let alone =
                tokens(&collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("s")).await);
            let (stream, table) =
                d.reserve_import(EngineRequest::new(pr.clone(), params.clone())).await.expect("reserve");
            let id = stream.request_id();
            let token = expected.expect(id);
            let hs = honest(layout, token, &table, pr.len());
            let half = hs.bytes_per_layer_half;
            let bpb = layout.bytes_per_block();
            let mut router_recomputes = true;
            match case {
                0 => {
                    // Runs totalling a billion blocks, with a matching size: only the
                    // reservation can tell, and it is asked before anything is expanded.
                    let hs = Handshake {
                        runs: vec![BlockRun {
                            logical_start: 0,
                            src_start: 0,
                            dst_start: table[0],
                            len: 1_000_000_000,
                        }],
                        bytes_per_layer_half: 1_000_000_000 * bpb,
                        ..hs
                    };
                    match connect(addr, hs).await.map(|_| ()) {
                        Err(TransportError::Refused(m)) => assert!(m.contains("1000000000"), "{m}"),
                        other => panic!("a billion blocks must be refused: {other:?}"),
                    }
                    assert_eq!(failure(&mut results).await.request, None);
                }
                1 => {
                    // Run lengths whose sum overflows.
                    let runs = vec![
                        BlockRun { logical_start: 0, src_start: 0, dst_start: table[0], len: usize::MAX },
                        BlockRun { logical_start: 0, src_start: 0, dst_start: table[0], len: 2 },
                    ];
                    let hs = Handshake { runs, ..hs };
                    let err = connect(addr, hs).await.map(|_| ()).expect_err("overflow");
                    assert!(matches!(err, TransportError::Refused(_)), "{err}");
                    assert_eq!(failure(&mut results).await.request, None);
                }
                2 => {
                    // A layer frame declaring a terabyte, after an honest handshake.
                    let (mut peer, answer) = RawPeer::hello(addr, &hs).await;
                    assert_eq!(answer, ACCEPT);
                    peer.frame(LAYER, 1 << 40, &[0; 64]).await;
                    let e = failure(&mut results).await;
                    assert_eq!(e.request, Some(id));
                    assert!(matches!(&e.source, TransportError::Protocol(m) if m.contains("bytes")), "{e}");
                }
                3 => {
                    // Every layer, then one more.
                    let (mut peer, answer) = RawPeer::hello(addr, &hs).await;
                    assert_eq!(answer, ACCEPT);
                    for layer in 0..=layout.num_layers as u32 {
                        peer.layer(layer, half).await;
                    }
                    let e = failure(&mut results).await;
                    assert_eq!(e.request, Some(id));
                    assert!(matches!(&e.source, TransportError::Protocol(m) if m.contains("after the last")), "{e}");
                }
                4 => {
                    // A layout with an extra layer.
                    let more = KvLayout { num_layers: layout.num_layers + 1, ..layout };
                    let err = connect(addr, Handshake { layout: more, ..hs }).await.map(|_| ());
                    assert!(matches!(&err, Err(TransportError::Refused(m)) if m.contains("num_layers")), "{err:?}");
                    failure(&mut results).await;
                }
                5 => {
                    // Every layer, then a first token past the vocabulary.
                    let mut sender = connect(addr, hs).await.expect("accepted");
                    for layer in 0..layout.num_layers {
                        sender
                            .send_layer(&LayerFrame { layer, k: vec![0; half], v: vec![0; half], seq: 0, coding: None })
                            .await
                            .expect("layer");
                    }
                    let trailer = TransferTrailer { first_token: vocab as u32 + 5, logprobs: None };
                    match sender.finish(&trailer).await {
                        Err(TransportError::Refused(m)) => assert!(m.contains("outside the vocabulary"), "{m}"),
                        other => panic!("a token past the vocabulary must be refused: {other:?}"),
                    }
                    assert_eq!(failure(&mut results).await.request, Some(id));
                }
                6 => {
                    // Past the transport: the engine itself refuses a token outside the
                    // vocabulary and recomputes, without anyone telling it to.
                    d.import_done(id, TransferTrailer { first_token: vocab as u32 + 5, logprobs: None });
                    router_recomputes = false;
                }
                7 => {
                    // Past the transport: a layer outside the layout, then one of the wrong size.
                    let frame = LayerFrame {
                        layer: layout.num_layers,
                        k: vec![0; half],
                        v: vec![0; half],
                        seq: 0,
                        coding: None,
                    };
                    d.import_layer(id, table.clone(), frame);
                    router_recomputes = false;
                }
                8 => {
                    let frame =
                        LayerFrame { layer: 0, k: vec![0; half + 4], v: vec![0; half + 4], seq: 0, coding: None };
                    d.import_layer(id, table.clone(), frame);
                    router_recomputes = false;
                }
                9 => {
                    // The honest handshake for this very reservation, from a peer without the
                    // cluster secret: refused before the handshake is even parsed.
                    let err = TcpKvSender::connect(addr, hs, DEADLINE, None).await.map(|_| ());
                    assert!(matches!(&err, Err(TransportError::Refused(m)) if m.contains("authentication")), "{err:?}");
                    let e = failure(&mut results).await;
                    assert!(matches!(e.source, TransportError::Unauthenticated), "{e}");
                    assert_eq!(e.request, None);
                }
                _ => {
                    // The honest handshake with the secret, from a worker the reservation is
                    // not bound to.
                    let hs = Handshake { sender: "prefill-other".into(), ..hs };
                    let err = connect(addr, hs).await.map(|_| ());
                    assert!(matches!(&err, Err(TransportError::Refused(m)) if m.contains("not waiting")), "{err:?}");
                    assert_eq!(failure(&mut results).await.request, None);
                }
            }
            if router_recomputes {
                // What the router decides after a failed hand-off.
                d.import_failed(id);
            }
            assert_eq!(tokens(&collect(stream).await), alone, "case {case}: the recompute's tokens");
            assert_eq!(d.health(), EngineHealth::Healthy, "case {case}");
            assert!(d.reservation(id).is_none());
        }
        // A hand-off naming a token this worker never issued.
        let hs = honest(layout, ReservationToken::random(), &[0], 1);
        let err = connect(addr, hs).await.map(|_| ());
        assert!(matches!(&err, Err(TransportError::Refused(m)) if m.contains("not waiting")), "{err:?}");
        // A hand-off for a token whose request reserved nothing in the engine.
        let hs = honest(layout, expected.expect(RequestId(999_999)), &[0], 1);
        let err = connect(addr, hs).await.map(|_| ());
        assert!(matches!(&err, Err(TransportError::Refused(m)) if m.contains("not waiting")), "{err:?}");
        let grown = rss_kib().saturating_sub(rss_before);
        assert!(grown < RSS_BUDGET_KIB, "VmRSS grew by {grown} KiB");
    });
    assert_all_blocks_free(&d);
    assert!(d.is_healthy());
    for e in [unified, d] {
        e.shutdown();
    }
}

/// Raises this process's open-file limit to `want` (within the hard limit): the flood below
/// holds both ends of a thousand connections.
fn raise_fd_limit(want: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    let target = lim.maximum.map_or(want, |max| max.min(want));
    if lim.current.is_some_and(|cur| cur < target) {
        setrlimit(Resource::Nofile, rustix::process::Rlimit { current: Some(target), ..lim }).expect("setrlimit");
    }
}

#[test]
fn a_thousand_idle_connections_cost_bounded_work_and_then_nothing() {
    raise_fd_limit(4096);
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let unified = engine(&m.model, EngineConfig::default());
    let p = engine(&m.model, EngineConfig::default());
    let d = engine(&m.model, EngineConfig::default());
    let params = greedy(6);
    let limits = IntakeLimits { max_connections: 32, hello_deadline: Duration::from_millis(200) };
    rt().block_on(async {
        let expected = Expected::default();
        let (addr, intake, mut results) = listen(&d, limits, expected.clone()).await;
        let rss_before = rss_kib();
        // The kernel queues 128 connections; the rest of the thousand wait for room (their
        // connects retry) while the listener drops silent ones at their hello deadline.
        let idle: Vec<std::net::TcpStream> = tokio::task::spawn_blocking(move || {
            (0..1000)
                .map(|_| {
                    let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(30)).expect("connect");
                    s.set_nonblocking(true).expect("nonblocking");
                    s
                })
                .collect()
        })
        .await
        .expect("join");
        // The listener drops silent connections at their hello deadline, a bounded number at
        // a time: some see the end of their stream (after the receiver's magic and challenge,
        // which each was sent first).
        let closed = |idle: &[std::net::TcpStream]| {
            use std::io::Read;
            let ended = |s: &std::net::TcpStream| {
                let mut buf = [0u8; 64];
                loop {
                    match (&mut &*s).read(&mut buf) {
                        Ok(0) => break true,
                        Ok(_) => continue,
                        Err(_) => break false,
                    }
                }
            };
            idle.iter().filter(|s| ended(s)).count()
        };
        let mut waited = Duration::ZERO;
        while closed(&idle) == 0 {
            assert!(waited < Duration::from_secs(10), "no idle connection was dropped");
            assert!(intake.active() <= limits.max_connections, "{} connections served at once", intake.active());
            tokio::time::sleep(Duration::from_millis(50)).await;
            waited += Duration::from_millis(50);
        }
        assert!(intake.active() <= limits.max_connections, "{} connections served at once", intake.active());
        assert_eq!(intake.peak(), limits.max_connections, "the listener served the most it may, no more");
        let grown = rss_kib().saturating_sub(rss_before);
        assert!(grown < RSS_BUDGET_KIB, "VmRSS grew by {grown} KiB");
        drop(idle);

        // The listener still serves an honest hand-off once the idle ones are gone.
        let pr = prompt(7, 40, vocab);
        let alone = tokens(&collect(unified.submit(EngineRequest::new(pr.clone(), params.clone())).expect("s")).await);
        let (d_stream, table) = d.reserve_import(EngineRequest::new(pr.clone(), params.clone())).await.expect("r");
        let d_id = d_stream.request_id();
        let (p_stream, events) = p
            .submit_export(EngineRequest::new(pr, params), table, baton_engine::kv_connector::ExportVia::Host)
            .expect("export");
        let token = expected.expect(d_id);
        let report = send_export(events, addr, token, p.kv_layout(), Duration::from_secs(30), None, creds()).await;
        assert!(report.is_ok(), "{report:?}");
        assert_eq!(collect(p_stream).await.len(), 1);
        assert_eq!(tokens(&collect(d_stream).await), alone);
        // Every idle connection ended in an error of its own, then the honest one in an import.
        loop {
            match tokio::time::timeout(DEADLINE, results.recv()).await.expect("outcomes").expect("open") {
                Ok(Received::Import { id, .. }) => break assert_eq!(id, d_id),
                Ok(other) => panic!("{other:?}"),
                Err(e) => assert_eq!(e.request, None, "{e}"),
            }
        }
        assert!(intake.peak() <= limits.max_connections, "peak {}", intake.peak());
    });
    assert!(d.is_healthy());
    for e in [&unified, &p, &d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d] {
        e.shutdown();
    }
}
