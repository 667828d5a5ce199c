//! Driving one hand-off from the engines' relay events: the prefill side turns an export's
//! [`ExportEvent`]s into a [`TcpKvSender`] session, the decode side turns an accepted
//! connection into events for its engine's KV connector. Over a link (NCCL between GPUs)
//! the TCP session only carries control frames and the data moves device to device; links
//! are made by [`setup_link`] on first contact.
//!
//! A link hand-off keeps its link in step or breaks it: the prefill side opens the
//! export's [`HandoffGate`] only when the receiver accepted the handshake (the engine sends
//! nothing before), and closes it on any failure before; once accepted, a hand-off that ends
//! without its final acknowledgement, on either side and for whatever reason (an error, a
//! dropped transfer task, a dead peer), fails the link, because notices the receiver needs
//! may be lost. The receiver acknowledges the trailer only once the request's own layers
//! have all landed.
//!
//! The decode side trusts nothing it reads: the handshake is checked against the engine's
//! [`crate::relay::Reservation`] for the request before anything is allocated
//! ([`super::admission`]), layers are written only into that reservation's blocks, and the
//! trailer is checked ([`crate::relay::TransferTrailer::check`]) before its token reaches the engine. A
//! bad peer fails its own hand-off and nothing else.
//!
//! Both sides are plain async functions so the worker process, tests and benchmarks use
//! the same code. Neither side decides what happens after a failure: the caller (the worker,
//! following the router's policy) recomputes or waits for a retry.

use super::admission::check_handshake;
use super::nccl::{CudaComm, new_id};
use super::tcp::{Incoming, PendingHandoff, TcpKvSender};
use super::{Handshake, KvCredentials, NcclHandshake, TransportError};
use crate::EngineHandle;
use crate::kv_connector::{HandoffGate, Link, Links};
use crate::relay::{ExportEvent, Reservation};
use baton_core::api::{EngineClient, RequestId};
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

/// The link side of a link hand-off, as the prefill side sends it.
#[derive(Debug, Clone)]
pub struct LinkSend {
    /// The link's name (the receiver's key for it).
    pub name: String,
    /// The link (the export was submitted over it).
    pub link: Arc<Link>,
    /// The export's gate (the one it was submitted with).
    pub gate: HandoffGate,
}

/// Closes a link hand-off's gate if it never opened, and fails the link if the hand-off
/// ends after its handshake without the final acknowledgement (also when the transfer task
/// is dropped: the notices the receiver waits for are lost with it).
struct LinkGuard {
    send: Option<LinkSend>,
    finished: bool,
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let Some(s) = &self.send else { return };
        s.gate.close();
        if !self.finished && s.gate.state() == crate::kv_connector::GateState::Accepted {
            s.link.fail("a hand-off on the link ended after its handshake without its acknowledgement");
        }
    }
}

/// Prefill side: waits for the export's plan, connects to the decode worker at `addr`
/// (which issued `reservation`), proves `creds`, streams every layer as the engine produces
/// it and ends with the first token. `deadline` bounds every network wait. With `link` (the
/// export was submitted over it) layer frames are empty notices, and the gate opens when the
/// receiver accepts (see the module docs).
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
    link: Option<LinkSend>,
    creds: KvCredentials,
) -> Result<HandoffReport, TransportError> {
    let mut guard = LinkGuard { send: link, finished: false };
    let ended = || TransportError::Protocol("the prefill request ended before its KV was complete".into());
    let plan = loop {
        match events.recv().await {
            // The prompt is being computed; the plan follows when it completes.
            Some(ExportEvent::Started) => continue,
            Some(ExportEvent::Plan(plan)) => break plan,
            Some(_) => return Err(TransportError::Protocol("export events out of order: expected the plan".into())),
            None => return Err(ended()),
        }
    };
    let started = Instant::now();
    let hs = Handshake {
        layout,
        sender: creds.identity.clone(),
        reservation: Some(reservation),
        num_tokens: plan.num_tokens,
        runs: plan.runs.clone(),
        bytes_per_layer_half: plan.bytes_per_layer / 2,
        nccl: guard.send.as_ref().map(|l| NcclHandshake::Use { link: l.name.clone() }),
    };
    let nccl = hs.nccl.is_some();
    let mut sender = TcpKvSender::connect(addr, hs, deadline, creds.secret.as_ref()).await?;
    if let Some(l) = &guard.send
        && !l.gate.accept()
    {
        return Err(TransportError::Protocol(
            "the prefill engine gave up on the hand-off before it was accepted".into(),
        ));
    }
    let mut bytes = 0;
    loop {
        match events.recv().await {
            Some(ExportEvent::Layer(frame)) => {
                bytes += if nccl { plan.bytes_per_layer } else { frame.k.len() + frame.v.len() };
                sender.send_layer(&frame).await?;
            }
            Some(ExportEvent::Done(trailer)) => {
                sender.finish(&trailer).await?;
                guard.finished = true;
                return Ok(HandoffReport { bytes, elapsed: started.elapsed() });
            }
            Some(ExportEvent::Plan(_)) => return Err(TransportError::Protocol("a second plan for one export".into())),
            Some(ExportEvent::Started) => return Err(TransportError::Protocol("a start after the plan".into())),
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

/// Decode side: reads the handshake of an accepted connection and refuses, in this order,
/// a sender without the listener's secret, a layout mismatch or sizes that do not add up
/// (see [`PendingHandoff::handshake`]), a reservation `admit` does not resolve for this
/// sender, one `engine` no longer holds, a handshake that does not fit that reservation
/// ([`check_handshake`]), or an unknown NCCL link. It then stores every layer into the
/// reservation's own blocks through `engine` (or enqueues the NCCL receives) and completes
/// the request with the trailer's first token (a bad trailer is refused). `admit` maps
/// (reservation token, sender identity) to the engine request waiting for that KV, or says
/// why not. A link setup joins the new communicator in the background and files it in
/// `links`.
///
/// A failure after the handshake named the request leaves it waiting for its KV: the caller
/// decides between a retry and a recompute ([`EngineHandle::import_failed`]). Over a link,
/// such a failure also fails the link (see the module docs), and the trailer is acknowledged
/// only once the request's own layers have all landed.
pub async fn receive_import(
    pending: PendingHandoff,
    engine: &EngineHandle,
    links: &Arc<Links>,
    deadline: Duration,
    admit: impl FnOnce(&ReservationToken, &str) -> Result<RequestId, String>,
) -> Result<Received, ImportError> {
    let started = Instant::now();
    let layout = engine.kv_layout();
    let mut admitted: Option<(RequestId, ReservationToken, Arc<Reservation>)> = None;
    let slot = &mut admitted;
    // The token names the reservation (and the sender must be the one it is bound to); the
    // engine's record of it is what the handshake's sizes and runs are checked against, and
    // the blocks the layers are written into.
    let reserved = move |hs: &Handshake| -> Result<(), String> {
        let token = hs.reservation.ok_or_else(|| "the handshake names no reservation".to_owned())?;
        let id = admit(&token, &hs.sender)?;
        let res = engine.reservation(id).ok_or_else(|| format!("reservation {token} is not waiting for KV here"))?;
        check_handshake(hs, &layout, &res).map_err(|e| e.to_string())?;
        *slot = Some((id, token, res));
        Ok(())
    };
    let admit = async move |hs: &Handshake| -> Result<(), String> {
        match &hs.nccl {
            Some(NcclHandshake::Setup { link, id }) => {
                let stream = engine.transfer_stream().await?;
                let (name, id, links, peer) = (link.clone(), id.clone(), links.clone(), hs.sender.clone());
                // Joining blocks until the prefill side joins, which it does once we accept.
                tokio::task::spawn_blocking(move || match CudaComm::join(stream, &id, 1) {
                    Ok(comm) => links.insert(name.clone(), Arc::new(Link::new(name, peer, Box::new(comm)))),
                    Err(e) => tracing::error!(link = name, error = %e, "cannot join the NCCL link"),
                });
                Ok(())
            }
            Some(NcclHandshake::Use { link }) => {
                // The link may still be finishing its setup: wait for it within the deadline.
                if links.wait_for(link, deadline).await.is_none() {
                    return Err(format!("no NCCL link {link:?} on this worker"));
                }
                reserved(hs)
            }
            None => reserved(hs),
        }
    };
    let mut incoming = pending.handshake(&layout, deadline, admit).await.map_err(ImportError::before)?;
    let hs = incoming.handshake().clone();
    let link = match &hs.nccl {
        Some(NcclHandshake::Setup { link, .. }) => return Ok(Received::Link { name: link.clone() }),
        Some(NcclHandshake::Use { link }) => links.get(link),
        None => None,
    };
    let Some((id, reservation, res)) = admitted else {
        return Err(ImportError::before(TransportError::Protocol(
            "a hand-off admitted without its reservation".into(),
        )));
    };
    // The runs were checked to map the reservation's blocks in order: they are its table.
    let dst = res.block_table.clone();
    let dst_runs: Vec<(usize, usize)> = hs.runs.iter().map(|r| (r.dst_start as usize, r.len)).collect();
    let vocab_size = engine.info().vocab_size;
    let mut bytes = 0;
    let result = async {
        loop {
            match incoming.next().await? {
                Incoming::Layer(frame) => match &link {
                    Some(link) => {
                        bytes += hs.bytes_per_layer_half * 2;
                        engine.import_link_layer(id, frame.layer, frame.seq, dst_runs.clone(), link.clone());
                    }
                    None => {
                        bytes += frame.k.len() + frame.v.len();
                        engine.import_layer(id, dst.clone(), frame);
                    }
                },
                Incoming::Done(trailer) => {
                    if let Err(reason) = trailer.check(vocab_size, res.logprobs) {
                        let _ = incoming.refuse(&reason).await;
                        return Err(TransportError::Protocol(reason));
                    }
                    // Over a link, the layers may still be landing: the request takes its first
                    // token (and the sender hears so) only once they all have.
                    if let Err(reason) = engine.import_done_confirmed(id, trailer).await {
                        let _ = incoming.refuse(&reason).await;
                        return Err(TransportError::Refused(reason));
                    }
                    incoming.acknowledge().await?;
                    return Ok(HandoffReport { bytes, elapsed: started.elapsed() });
                }
            }
        }
    }
    .await;
    match result {
        Ok(report) => Ok(Received::Import { id, reservation, report }),
        Err(e) => {
            if let Some(link) = &link {
                link.fail(&format!("a hand-off on the link failed after its handshake: {e}"));
            }
            Err(ImportError::during(id, e))
        }
    }
}

/// Prefill side, first contact with a decode worker: draws an NCCL unique id, offers the
/// link `name` to the decode worker at `addr` (proving `creds`) and joins it as rank 0 on
/// `stream` (a transfer stream of the prefill engine's device). Returns once both sides
/// joined; the link's peer is `addr`.
pub async fn setup_link(
    addr: SocketAddr,
    layout: KvLayout,
    deadline: Duration,
    name: String,
    stream: Arc<cudarc::driver::CudaStream>,
    creds: KvCredentials,
) -> Result<Link, TransportError> {
    let id = new_id().map_err(|e| TransportError::Protocol(e.to_string()))?;
    let hs = Handshake {
        layout,
        sender: creds.identity.clone(),
        reservation: None,
        num_tokens: 0,
        runs: Vec::new(),
        bytes_per_layer_half: 0,
        nccl: Some(NcclHandshake::Setup { link: name.clone(), id: id.clone() }),
    };
    let name_for_link = name;
    // The receiver accepts before joining; both joins then meet.
    let sender = TcpKvSender::connect(addr, hs, deadline, creds.secret.as_ref()).await?;
    drop(sender);
    let join = tokio::task::spawn_blocking(move || CudaComm::join(stream, &id, 0));
    match tokio::time::timeout(deadline, join).await {
        Ok(Ok(Ok(comm))) => Ok(Link::new(name_for_link, addr.to_string(), Box::new(comm))),
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
