//! Driving one hand-off over TCP from the engines' relay events: the prefill side turns an
//! export's [`ExportEvent`]s into a [`TcpKvSender`] session, the decode side turns an
//! accepted connection into import commands for its engine.
//!
//! Both sides are plain async functions so the worker process, tests and benchmarks use
//! the same code. Neither side decides what happens after a failure: the caller (the worker,
//! following the router's policy) recomputes or waits for a retry.

use super::tcp::{Incoming, PendingHandoff, TcpKvSender};
use super::{Handshake, TransportError};
use crate::EngineHandle;
use crate::relay::{ExportEvent, plan_blocks};
use baton_core::api::RequestId;
use baton_core::kv_transfer::KvLayout;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// What one finished hand-off moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HandoffReport {
    /// K and V bytes sent, all layers.
    pub bytes: usize,
    /// From the connection to the receiver's final acknowledgement.
    pub elapsed: Duration,
}

/// Prefill side: waits for the export's plan, connects to the decode worker at `addr`
/// (whose engine reserved `request_id`), streams every layer as the engine produces it and
/// ends with the first token. `deadline` bounds every network wait.
///
/// Errors when the export ends early (the prefill request failed or was aborted), when the
/// receiver refuses (layout mismatch, unknown request), or on any transport failure;
/// dropping the connection then tells the receiver.
pub async fn send_export(
    mut events: UnboundedReceiver<ExportEvent>,
    addr: SocketAddr,
    request_id: u64,
    layout: KvLayout,
    deadline: Duration,
) -> Result<HandoffReport, TransportError> {
    let ended = || TransportError::Protocol("the prefill request ended before its KV was complete".into());
    let plan = match events.recv().await {
        Some(ExportEvent::Plan(plan)) => plan,
        Some(_) => return Err(TransportError::Protocol("export events out of order: expected the plan".into())),
        None => return Err(ended()),
    };
    let started = Instant::now();
    let hs = Handshake {
        layout,
        request_id,
        num_tokens: plan.num_blocks() * layout.block_size,
        runs: plan.runs.clone(),
        bytes_per_layer_half: plan.bytes_per_layer / 2,
    };
    let mut sender = TcpKvSender::connect(addr, hs, deadline).await?;
    let mut bytes = 0;
    loop {
        match events.recv().await {
            Some(ExportEvent::Layer(frame)) => {
                bytes += frame.k.len() + frame.v.len();
                sender.send_layer(&frame).await?;
            }
            Some(ExportEvent::Done(trailer)) => {
                sender.finish(&trailer).await?;
                return Ok(HandoffReport { bytes, elapsed: started.elapsed() });
            }
            Some(ExportEvent::Plan(_)) => return Err(TransportError::Protocol("a second plan for one export".into())),
            None => return Err(ended()),
        }
    }
}

/// Decode side: reads the handshake of an accepted connection (refusing a layout mismatch,
/// or whatever `admit` refuses), stores every layer into the reserved blocks through
/// `engine`, then completes the request with the trailer's first token. Returns the
/// request it completed.
pub async fn receive_import(
    pending: PendingHandoff,
    engine: &EngineHandle,
    deadline: Duration,
    admit: impl FnOnce(&Handshake) -> Result<(), String>,
) -> Result<(RequestId, HandoffReport), ImportError> {
    let started = Instant::now();
    let layout = engine.kv_layout();
    let mut incoming = pending.handshake(&layout, deadline, admit).await.map_err(ImportError::before)?;
    let hs = incoming.handshake().clone();
    let id = RequestId(hs.request_id);
    let (_, dst) = plan_blocks(&baton_core::kv_transfer::TransferPlan {
        runs: hs.runs.clone(),
        num_layers: hs.layout.num_layers,
        bytes_per_layer: hs.bytes_per_layer_half * 2,
    });
    let mut bytes = 0;
    loop {
        match incoming.next().await.map_err(|e| ImportError::during(id, e))? {
            Incoming::Layer(frame) => {
                bytes += frame.k.len() + frame.v.len();
                engine.import_layer(id, dst.clone(), frame);
            }
            Incoming::Done(trailer) => {
                engine.import_done(id, trailer);
                incoming.acknowledge().await.map_err(|e| ImportError::during(id, e))?;
                return Ok((id, HandoffReport { bytes, elapsed: started.elapsed() }));
            }
        }
    }
}

/// A failed receive, with the request it concerned when the handshake got that far.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct ImportError {
    /// The request whose KV was arriving (`None`: failed before the handshake named it).
    pub request: Option<RequestId>,
    /// What went wrong.
    #[source]
    pub source: TransportError,
}

impl ImportError {
    fn before(source: TransportError) -> Self {
        Self { request: None, source }
    }

    fn during(id: RequestId, source: TransportError) -> Self {
        Self { request: Some(id), source }
    }
}

/// Resolves `host:port` for the KV listener of a worker.
pub async fn resolve(addr: &str) -> Result<SocketAddr, TransportError> {
    tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| TransportError::Protocol(format!("{addr} resolves to no address")))
}
