//! The prefill → decode relay between two in-process engines over the TCP transport, for
//! the relay tests on CPU and on CUDA.

use baton_core::api::{EngineClient, EngineOutput, EngineRequest, OutputStream, RequestId};
use baton_core::cluster_auth::ReservationToken;
use baton_core::params::SamplingParams;
use baton_engine::EngineHandle;
use baton_engine::kv_connector::{ExportVia, HandoffGate, Link, Links};
use baton_engine::kv_transport::KvCredentials;
use baton_engine::kv_transport::handoff::{LinkSend, Received, receive_import, send_export};
use baton_engine::kv_transport::tcp::TcpKvListener;
use std::sync::Arc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(10);

/// The identity the test's prefill side claims (and reservations are bound to).
pub const PREFILL: &str = "prefill-0";

/// The prefill side's credentials (no cluster secret: the listeners here have none).
pub fn creds() -> KvCredentials {
    KvCredentials { secret: None, identity: PREFILL.into() }
}

/// A decode side's admission: `reservations` (token → request), from [`PREFILL`] only.
pub fn admit_from(
    reservations: Vec<(ReservationToken, RequestId)>,
) -> impl FnOnce(&ReservationToken, &str) -> Result<RequestId, String> {
    move |token, sender| {
        reservations
            .iter()
            .find(|(t, _)| t == token && sender == PREFILL)
            .map(|(_, id)| *id)
            .ok_or_else(|| format!("no reservation {token} from {sender}"))
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

pub async fn collect(mut s: OutputStream) -> Vec<EngineOutput> {
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

pub fn tokens(outs: &[EngineOutput]) -> Vec<u32> {
    outs.iter().flat_map(|o| o.new_token_ids.iter().copied()).collect()
}

/// How a relay moves the data.
#[derive(Clone, Default)]
pub struct Via {
    /// The decode side's links (empty for TCP).
    pub d_links: Arc<Links>,
    /// The prefill side's link and its name, for a link hand-off.
    pub p_link: Option<(String, Arc<Link>)>,
}

impl Via {
    /// A fresh export's connector route and the transfer task's link part.
    pub fn export(&self) -> (ExportVia, Option<LinkSend>) {
        match &self.p_link {
            None => (ExportVia::Host, None),
            Some((name, link)) => {
                let gate = HandoffGate::new();
                let via = ExportVia::Link { link: link.clone(), gate: gate.clone() };
                (via, Some(LinkSend { name: name.clone(), link: link.clone(), gate }))
            }
        }
    }
}

/// One relayed request: D reserves, P computes and streams, D decodes. `break_after` cuts the
/// transfer after that many layers (the prefill worker "dies"); D then recomputes.
pub async fn relay(
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    prompt: &[u32],
    params: SamplingParams,
    break_after: Option<usize>,
) -> (Vec<EngineOutput>, Vec<EngineOutput>) {
    relay_via(p, d, listener, prompt, params, break_after, &Via::default()).await
}

/// [`relay`] over the transport `via` says.
pub async fn relay_via(
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    prompt: &[u32],
    params: SamplingParams,
    break_after: Option<usize>,
    via: &Via,
) -> (Vec<EngineOutput>, Vec<EngineOutput>) {
    let addr = listener.local_addr().expect("addr");
    let (d_stream, table) =
        d.reserve_import(EngineRequest::new(prompt.to_vec(), params.clone())).await.expect("reserve");
    let d_id = d_stream.request_id();
    let token = ReservationToken::random();
    let (export_via, name) = via.export();
    let (p_stream, mut events) =
        p.submit_export(EngineRequest::new(prompt.to_vec(), params), table, export_via).expect("export");
    let layout = p.kv_layout();
    let sender = tokio::spawn(async move {
        match break_after {
            None => send_export(events, addr, token, layout, DEADLINE, name, creds()).await.map(|_| ()),
            Some(n) => {
                // Forward only the start, the plan and n layers, then drop the connection
                // mid-transfer.
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                for _ in 0..n + 2 {
                    if let Some(e) = events.recv().await {
                        let _ = tx.send(e);
                    }
                }
                drop(tx);
                send_export(rx, addr, token, layout, DEADLINE, name, creds()).await.map(|_| ())
            }
        }
    });
    let pending = listener.accept().await.expect("accept");
    let received = receive_import(pending, d, &via.d_links, DEADLINE, admit_from(vec![(token, d_id)])).await;
    match (&received, break_after) {
        (Ok(Received::Import { id, reservation, report }), None) => {
            assert_eq!((*id, *reservation), (d_id, token));
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

/// Several relays at once over one listener (and, with NCCL, one link): every reservation and
/// export is made before any transfer starts, so the prefill engine computes the prompts in
/// one step and their layer sends interleave on the link. Returns each prompt's decode-side
/// outputs (the first token included), in prompt order.
pub async fn relay_many(
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    prompts: &[Vec<u32>],
    params: SamplingParams,
    via: &Via,
) -> Vec<Vec<EngineOutput>> {
    let addr = listener.local_addr().expect("addr");
    let layout = p.kv_layout();
    let mut d_streams = Vec::new();
    let mut p_streams = Vec::new();
    let mut senders = Vec::new();
    for pr in prompts {
        let (d_stream, table) =
            d.reserve_import(EngineRequest::new(pr.clone(), params.clone())).await.expect("reserve");
        let d_id = d_stream.request_id();
        let token = ReservationToken::random();
        let (export_via, name) = via.export();
        let (p_stream, events) =
            p.submit_export(EngineRequest::new(pr.clone(), params.clone()), table, export_via).expect("export");
        senders.push(tokio::spawn(send_export(events, addr, token, layout, DEADLINE, name, creds())));
        d_streams.push((token, d_id, d_stream));
        p_streams.push(p_stream);
    }
    let ids: Vec<_> = d_streams.iter().map(|(token, id, _)| (*token, *id)).collect();
    let mut receivers = Vec::new();
    for _ in prompts {
        let pending = listener.accept().await.expect("accept");
        let (d, links, ids) = (d.clone(), via.d_links.clone(), ids.clone());
        receivers.push(tokio::spawn(async move {
            receive_import(pending, &d, &links, DEADLINE, admit_from(ids)).await.map_err(|e| e.to_string())
        }));
    }
    for r in receivers {
        match r.await.expect("join") {
            Ok(Received::Import { report, .. }) => assert!(report.bytes > 0),
            other => panic!("unexpected receive outcome {other:?}"),
        }
    }
    for s in senders {
        s.await.expect("join").expect("sender");
    }
    for s in p_streams {
        assert_eq!(collect(s).await.len(), 1, "an export's stream ends after its first token");
    }
    let mut outs = Vec::new();
    for (_, _, s) in d_streams {
        outs.push(collect(s).await);
    }
    outs
}

/// Each of `prompts` run alone on `unified`, then relayed from `p` to `d` over `listener`
/// (12 greedy tokens): P's first token and D's tokens must be the unified run's, and D must
/// have computed none of the prompt (its KV all came from P).
pub async fn relays_match_unified(
    unified: &EngineHandle,
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    prompts: &[Vec<u32>],
) {
    for pr in prompts {
        let alone = collect(unified.submit(EngineRequest::new(pr.clone(), super::greedy(12))).expect("submit")).await;
        let (p_out, d_out) = relay(p, d, listener, pr, super::greedy(12), None).await;
        assert_eq!(p_out[0].new_token_ids, alone[0].new_token_ids);
        assert_eq!(tokens(&d_out), tokens(&alone), "prompt of {} tokens", pr.len());
        assert_eq!(d_out[0].num_cached_tokens, pr.len(), "D computed none of the prompt");
    }
}
