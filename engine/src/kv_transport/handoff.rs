//! Driving one hand-off from the engines' relay events: the prefill side turns an export's
//! [`ExportEvent`]s into a [`TcpKvSender`] session, the decode side turns an accepted
//! connection into import commands for its engine. With an NCCL link the TCP session only
//! carries control frames and the data moves GPU to GPU (see [`super::nccl`]); links are
//! made by [`setup_link`] on first contact.
//!
//! Both sides are plain async functions so the worker process, tests and benchmarks use
//! the same code. Neither side decides what happens after a failure: the caller (the worker,
//! following the router's policy) recomputes or waits for a retry.

use super::nccl::{NcclLink, NcclLinks, new_id};
use super::tcp::{Incoming, PendingHandoff, TcpKvSender};
use super::{Handshake, KvCredentials, NcclHandshake, TransportError};
use crate::EngineHandle;
use crate::relay::{ExportEvent, plan_blocks};
use baton_core::api::RequestId;
use baton_core::cluster_auth::ReservationToken;
use baton_core::kv_transfer::KvLayout;
use std::net::SocketAddr;
use std::sync::Arc;
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
/// (which issued `reservation`), proves `creds`, streams every layer as the engine produces
/// it and ends with the first token. `deadline` bounds every network wait. With `nccl_link`
/// (the link's name; the export was submitted with that link) layer frames are empty notices.
///
/// Errors when the export ends early (the prefill request failed or was aborted), when the
/// receiver refuses (layout mismatch, unknown request), or on any transport failure;
/// dropping the connection then tells the receiver.
pub async fn send_export(
    mut events: UnboundedReceiver<ExportEvent>,
    addr: SocketAddr,
    reservation: ReservationToken,
    layout: KvLayout,
    deadline: Duration,
    nccl_link: Option<String>,
    creds: KvCredentials,
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
        sender: creds.identity.clone(),
        reservation: Some(reservation),
        num_tokens: plan.num_blocks() * layout.block_size,
        runs: plan.runs.clone(),
        bytes_per_layer_half: plan.bytes_per_layer / 2,
        nccl: nccl_link.map(|link| NcclHandshake::Use { link }),
    };
    let nccl = hs.nccl.is_some();
    let mut sender = TcpKvSender::connect(addr, hs, deadline, creds.secret.as_ref()).await?;
    let mut bytes = 0;
    loop {
        match events.recv().await {
            Some(ExportEvent::Layer(frame)) => {
                bytes += if nccl { plan.bytes_per_layer } else { frame.k.len() + frame.v.len() };
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

/// What an accepted connection was.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// A request's KV, now stored (or, over NCCL, being received) in its reserved blocks.
    Import {
        /// The request.
        id: RequestId,
        /// The reservation it filled.
        reservation: ReservationToken,
        /// What moved.
        report: HandoffReport,
    },
    /// A new NCCL link from a prefill worker (it becomes usable once both sides joined).
    Link {
        /// Its name.
        name: String,
    },
}

/// Decode side: reads the handshake of an accepted connection (refusing a sender without
/// the listener's secret, a layout mismatch, a reservation `admit` does not resolve for
/// this sender, or an unknown NCCL link), stores every layer into the reserved blocks
/// through `engine` (or enqueues the NCCL receives), then completes the request with the
/// trailer's first token. `admit` maps (reservation, sender identity) to the engine request
/// waiting for that KV, or says why not. A link setup joins the new communicator in the
/// background and files it in `links`.
pub async fn receive_import(
    pending: PendingHandoff,
    engine: &EngineHandle,
    links: &Arc<NcclLinks>,
    deadline: Duration,
    admit: impl FnOnce(&ReservationToken, &str) -> Result<RequestId, String>,
) -> Result<Received, ImportError> {
    let started = Instant::now();
    let layout = engine.kv_layout();
    let mut admitted: Option<(RequestId, ReservationToken)> = None;
    let resolve_reservation = |hs: &Handshake| -> Result<(), String> {
        let token = hs.reservation.ok_or_else(|| "the handshake names no reservation".to_owned())?;
        let id = admit(&token, &hs.sender)?;
        admitted = Some((id, token));
        Ok(())
    };
    let admit = async |hs: &Handshake| -> Result<(), String> {
        match &hs.nccl {
            Some(NcclHandshake::Setup { link, id }) => {
                let stream = engine.transfer_stream().await?;
                let (link, id, links) = (link.clone(), id.clone(), links.clone());
                // Joining blocks until the prefill side joins, which it does once we accept.
                tokio::task::spawn_blocking(move || match NcclLink::join(stream, &id, 1) {
                    Ok(l) => links.insert(link, Arc::new(l)),
                    Err(e) => tracing::error!(link, error = %e, "cannot join the NCCL link"),
                });
                Ok(())
            }
            Some(NcclHandshake::Use { link }) => {
                // The link may still be finishing its setup: wait for it within the deadline.
                if links.wait_for(link, deadline).await.is_none() {
                    return Err(format!("no NCCL link {link:?} on this worker"));
                }
                resolve_reservation(hs)
            }
            None => resolve_reservation(hs),
        }
    };
    let mut incoming = pending.handshake(&layout, deadline, admit).await.map_err(ImportError::before)?;
    let hs = incoming.handshake().clone();
    let link = match &hs.nccl {
        Some(NcclHandshake::Setup { link, .. }) => return Ok(Received::Link { name: link.clone() }),
        Some(NcclHandshake::Use { link }) => links.get(link),
        None => None,
    };
    let Some((id, reservation)) = admitted else {
        return Err(ImportError::before(TransportError::Protocol("a hand-off admitted without a reservation".into())));
    };
    let (_, dst) = plan_blocks(&baton_core::kv_transfer::TransferPlan {
        runs: hs.runs.clone(),
        num_layers: hs.layout.num_layers,
        bytes_per_layer: hs.bytes_per_layer_half * 2,
    });
    let dst_runs: Vec<(usize, usize)> = hs.runs.iter().map(|r| (r.dst_start as usize, r.len)).collect();
    let mut bytes = 0;
    loop {
        match incoming.next().await.map_err(|e| ImportError::during(id, e))? {
            Incoming::Layer(frame) => match &link {
                Some(link) => {
                    bytes += hs.bytes_per_layer_half * 2;
                    engine.import_layer_nccl(id, frame.layer, frame.seq, dst_runs.clone(), link.clone());
                }
                None => {
                    bytes += frame.k.len() + frame.v.len();
                    engine.import_layer(id, dst.clone(), frame);
                }
            },
            Incoming::Done(trailer) => {
                engine.import_done(id, trailer);
                incoming.acknowledge().await.map_err(|e| ImportError::during(id, e))?;
                return Ok(Received::Import {
                    id,
                    reservation,
                    report: HandoffReport { bytes, elapsed: started.elapsed() },
                });
            }
        }
    }
}

/// Prefill side, first contact with a decode worker: draws an NCCL unique id, offers the
/// link `name` to the decode worker at `addr` (proving `creds`) and joins it as rank 0 on
/// `stream` (a transfer stream of the prefill engine's device). Returns once both sides
/// joined.
pub async fn setup_link(
    addr: SocketAddr,
    layout: KvLayout,
    deadline: Duration,
    name: String,
    stream: Arc<cudarc::driver::CudaStream>,
    creds: KvCredentials,
) -> Result<NcclLink, TransportError> {
    let id = new_id().map_err(|e| TransportError::Protocol(e.to_string()))?;
    let hs = Handshake {
        layout,
        sender: creds.identity.clone(),
        reservation: None,
        num_tokens: 0,
        runs: Vec::new(),
        bytes_per_layer_half: 0,
        nccl: Some(NcclHandshake::Setup { link: name, id: id.clone() }),
    };
    // The receiver accepts before joining; both joins then meet.
    let sender = TcpKvSender::connect(addr, hs, deadline, creds.secret.as_ref()).await?;
    drop(sender);
    let join = tokio::task::spawn_blocking(move || NcclLink::join(stream, &id, 0));
    match tokio::time::timeout(deadline, join).await {
        Ok(Ok(Ok(link))) => Ok(link),
        Ok(Ok(Err(e))) => Err(TransportError::Protocol(e.to_string())),
        Ok(Err(e)) => Err(TransportError::Protocol(format!("the NCCL join panicked: {e}"))),
        Err(_) => Err(TransportError::Timeout(deadline, "the NCCL link setup")),
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
