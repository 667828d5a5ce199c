//! The Worker gRPC service: runs the router's requests on this worker's engine.
//!
//! - `Generate`: a whole request here.
//! - `Decode`: reserve blocks for a prompt whose KV comes from a prefill worker, answer
//!   `reserved` (a random 128-bit token, block table, KV address), then stream every output
//!   token. Only the prefill worker instance named in the request may fill the reservation;
//!   it waits at most the request's deadline for its KV, then recomputes here.
//! - `Prefill`: compute the prompt, stream its KV to the decode worker while computing,
//!   stream the first token, then the transfer's result.
//! - `Recompute`: stop waiting for a reservation's KV and recompute here.
//! - `Rebind`: let another prefill worker (a retry) fill a waiting reservation.
//! - `Identify`: this worker's instance (the registry's check of a worker URL).
//!
//! The service is wrapped by the cluster-auth check ([`super::run`]), so with a secret none
//! of these runs for an unsigned call.
//!
//! Cancelling any stream drops its engine stream, which aborts the request and frees its
//! blocks (on the decode side also a reservation still waiting for KV).
//!
//! Liveness on the streams: while a request produces no tokens for the request's
//! `progress_ms` (queued, computing a long prompt, waiting for KV) and the engine keeps
//! stepping, its stream carries `progress`; a prefill stream says `prefill_started` when the
//! engine first schedules the prompt; a decode stream says `recomputing` when its backstop
//! deadline passes. So the router can tell a busy worker from a stuck one and count its
//! hand-off deadline from the start of the prefill.
//!
//! Every stream holds one of the worker's `--max-inflight` slots while it is open; past the
//! cap new calls are `RESOURCE_EXHAUSTED`.

use super::KvTransportKind;
use super::WorkerState;
use super::slots::StreamSlot;
use baton_core::api::{EngineClient, EngineError, EngineOutput, EngineRequest, OutputStream, SubmitError};
use baton_core::cluster_auth::ReservationToken;
use baton_engine::kv_connector::{ExportVia, HandoffGate, Link};
use baton_engine::kv_transport::handoff::{LinkSend, resolve, send_export, setup_link};
use baton_engine::relay::ExportEvent;
use baton_proto::wire::GRAMMAR_KIND_METADATA;
use baton_proto::wire::{output_to_wire, sampling_from_wire};
use baton_proto::worker as pb;
use futures::Stream;
use pb::work_event::Event;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tonic::{Request, Response, Status};

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::WorkEvent, Status>> + Send>>;

/// The service over one worker's engine.
pub struct WorkerService {
    state: Arc<WorkerState>,
}

impl WorkerService {
    /// Serves `state`'s engine.
    pub fn new(state: Arc<WorkerState>) -> Self {
        Self { state }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::worker_server::WorkerServer<Self> {
        pb::worker_server::WorkerServer::new(self)
    }
}

fn event(e: Event) -> pb::WorkEvent {
    pb::WorkEvent { event: Some(e) }
}

/// Submission errors as gRPC statuses (the router maps them back for its clients).
fn submit_status(e: SubmitError) -> Status {
    match e {
        SubmitError::InvalidGrammar { kind, message } => grammar_status(&kind, &message),
        SubmitError::InvalidParams(_) | SubmitError::InvalidPrompt(_) | SubmitError::ContextTooLong { .. } => {
            Status::invalid_argument(e.to_string())
        }
        SubmitError::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
        SubmitError::Unavailable(_) => Status::unavailable(e.to_string()),
    }
}

/// A grammar that does not compile, as the router recognises it
/// (`baton_proto::wire::invalid_grammar_of`): INVALID_ARGUMENT with the kind in
/// metadata, so the router answers its client 400 rather than a worker failure.
fn grammar_status(kind: &str, message: &str) -> Status {
    let mut status = Status::invalid_argument(message.to_owned());
    if let Ok(v) = kind.parse() {
        status.metadata_mut().insert(GRAMMAR_KIND_METADATA, v);
    }
    status
}

/// A work request's engine request and timing: its deadline and how often to report
/// progress on a silent stream (`None`: never).
struct Work {
    request: EngineRequest,
    deadline: Duration,
    progress: Option<Duration>,
}

fn engine_request(r: Option<pb::WorkRequest>) -> Result<Work, Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("no request"))?;
    let params = sampling_from_wire(r.params).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let mut request = EngineRequest::new(r.prompt_token_ids, params);
    request.priority = r.priority;
    let deadline = Duration::from_millis(u64::from(r.deadline_ms.max(1)));
    // Not more often than every 10 ms, whatever the caller asks.
    let progress = (r.progress_ms > 0).then(|| Duration::from_millis(u64::from(r.progress_ms.max(10))));
    Ok(Work { request, deadline, progress })
}

/// Takes one of the worker's stream slots (`--max-inflight`).
fn stream_slot(state: &WorkerState) -> Result<StreamSlot, Status> {
    state.streams.try_take().map_err(|e| Status::resource_exhausted(e.to_string()))
}

/// What a worker stream waits for next.
enum Next {
    Output(Option<Result<EngineOutput, EngineError>>),
    Notice(Option<Event>),
    Tick,
}

/// Streams an engine request's outputs as `tokens` events, numbering output positions from
/// zero; an engine error becomes an `error` event that ends the stream. `notices` (e.g.
/// `prefill_started`) are passed through as they come. After `progress` without anything
/// sent, a `progress` event goes out if the engine stepped meanwhile (a stuck engine stays
/// silent, so the router notices). The stream holds `slot` until it ends.
fn token_events(
    mut stream: OutputStream,
    state: Arc<WorkerState>,
    progress: Option<Duration>,
    mut notices: UnboundedReceiver<Event>,
    slot: StreamSlot,
) -> impl Stream<Item = Result<pb::WorkEvent, Status>> + Send {
    async_stream::stream! {
        let _slot = slot;
        let mut index = 0;
        let mut first = true;
        let mut notices_open = true;
        let mut steps = state.engine.step_timing().steps;
        let mut ticker = progress.map(|p| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let next = tokio::select! {
                item = stream.next() => Next::Output(item),
                notice = notices.recv(), if notices_open => Next::Notice(notice),
                _ = tick(&mut ticker) => Next::Tick,
            };
            match next {
                Next::Output(None) => break,
                Next::Output(Some(Ok(out))) => {
                    let finished = out.finish_reason.is_some();
                    if first && !out.new_token_ids.is_empty() {
                        first = false;
                        let computed = out.num_prompt_tokens.saturating_sub(out.num_cached_tokens);
                        state.metrics.add_prompt_tokens_computed(computed);
                    }
                    yield Ok(event(Event::Tokens(output_to_wire(&out, index))));
                    index += out.new_token_ids.len();
                    state.count_tokens(out.new_token_ids.len());
                    if finished {
                        break;
                    }
                }
                Next::Output(Some(Err(EngineError::InvalidGrammar { kind, message }))) => {
                    // Compiled after the submission was accepted: still the request's fault.
                    yield Err(grammar_status(&kind, &message));
                    break;
                }
                Next::Output(Some(Err(e))) => {
                    yield Ok(event(Event::Error(e.to_string())));
                    break;
                }
                Next::Notice(Some(notice)) => yield Ok(event(notice)),
                Next::Notice(None) => {
                    notices_open = false;
                    continue;
                }
                Next::Tick => {
                    let now = state.engine.step_timing().steps;
                    if now == steps {
                        continue;
                    }
                    steps = now;
                    yield Ok(event(Event::Progress(pb::Progress {})));
                    continue;
                }
            }
            // Something was sent: the silence starts again.
            if let Some(t) = ticker.as_mut() {
                t.reset();
            }
        }
    }
}

/// The next tick, or never without a ticker.
async fn tick(ticker: &mut Option<tokio::time::Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A channel for notices on a stream that has none.
fn no_notices() -> UnboundedReceiver<Event> {
    unbounded_channel().1
}

/// The NCCL link to the decode worker at `kv_addr` (made on first contact), with its name.
async fn ensure_link(
    state: &WorkerState,
    kv_addr: &str,
    addr: std::net::SocketAddr,
    deadline: Duration,
) -> Result<(String, Arc<Link>), Status> {
    let name = format!("{}->{kv_addr}", state.instance);
    if let Some(link) = state.links.get(kv_addr) {
        return Ok((name, link));
    }
    // One setup at a time: concurrent first requests to the same decode worker must share one
    // communicator (two would be filed under one name on the decode side, and sends on one
    // would wait forever for receives posted on the other).
    let _setup = state.link_setup.lock().await;
    if let Some(link) = state.links.get(kv_addr) {
        return Ok((name, link));
    }
    let stream = state.engine.transfer_stream().await.map_err(Status::failed_precondition)?;
    let link = setup_link(addr, state.engine.kv_layout(), deadline, name.clone(), stream, state.kv_credentials.clone())
        .await
        .map_err(|e| Status::unavailable(format!("cannot set up an NCCL link to {kv_addr}: {e}")))?;
    let link = Arc::new(link);
    state.links.insert(kv_addr.to_owned(), link.clone());
    tracing::info!(peer = %kv_addr, link = %name, "NCCL link ready");
    Ok((name, link))
}

/// Passes export events through to the transfer, except `Started`, which goes to the
/// router's stream as `prefill_started`.
fn start_tap(
    mut events: UnboundedReceiver<ExportEvent>,
    started: UnboundedSender<Event>,
) -> UnboundedReceiver<ExportEvent> {
    let (tx, rx) = unbounded_channel();
    tokio::spawn(async move {
        while let Some(e) = events.recv().await {
            if matches!(e, ExportEvent::Started) {
                let _ = started.send(Event::PrefillStarted(pb::PrefillStarted {}));
                continue;
            }
            if tx.send(e).is_err() {
                break;
            }
        }
    });
    rx
}

/// Passes export events through and exits the process once `layers` layers went by: a
/// prefill worker dying in the middle of a hand-off.
fn chaos_tap(mut events: UnboundedReceiver<ExportEvent>, layers: usize) -> UnboundedReceiver<ExportEvent> {
    let (tx, rx) = unbounded_channel();
    tokio::spawn(async move {
        let mut sent = 0;
        while let Some(e) = events.recv().await {
            let is_layer = matches!(e, ExportEvent::Layer(_));
            if is_layer && sent == layers {
                // Give the transport a moment to put the earlier layers on the wire.
                tokio::time::sleep(Duration::from_millis(50)).await;
                tracing::error!(layers, "chaos: exiting in the middle of a KV hand-off");
                std::process::exit(super::CHAOS_EXIT_CODE);
            }
            sent += usize::from(is_layer);
            if tx.send(e).is_err() {
                break;
            }
        }
    });
    rx
}

/// Forgets a reservation when its stream goes away, so a late transfer is refused.
struct PendingGuard {
    state: Arc<WorkerState>,
    token: ReservationToken,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.state.forget_reservation(&self.token);
    }
}

fn reservation_token(bytes: &[u8]) -> Result<ReservationToken, Status> {
    ReservationToken::from_slice(bytes).ok_or_else(|| Status::invalid_argument("a reservation token is 16 bytes"))
}

/// Aborts a spawned task when dropped (the prefill stream's transfer).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = EventStream;
    type DecodeStream = EventStream;
    type PrefillStream = EventStream;

    async fn generate(&self, request: Request<pb::WorkRequest>) -> Result<Response<EventStream>, Status> {
        let slot = stream_slot(&self.state)?;
        let work = engine_request(Some(request.into_inner()))?;
        let stream = self.state.engine.submit(work.request).map_err(submit_status)?;
        let events = token_events(stream, self.state.clone(), work.progress, no_notices(), slot);
        Ok(Response::new(Box::pin(events)))
    }

    async fn decode(&self, request: Request<pb::WorkRequest>) -> Result<Response<EventStream>, Status> {
        if !self.state.role.decodes() {
            return Err(Status::failed_precondition("this worker does not decode"));
        }
        let slot = stream_slot(&self.state)?;
        let work = request.into_inner();
        if !baton_core::cluster_auth::valid_identity(&work.prefill_instance) {
            return Err(Status::invalid_argument("Decode needs the prefill_instance allowed to send the KV"));
        }
        let prefill = work.prefill_instance.clone();
        let Work { request: req, deadline, progress } = engine_request(Some(work))?;
        let (stream, table) = self.state.engine.reserve_import(req).await.map_err(submit_status)?;
        let id = stream.request_id();
        let token = ReservationToken::random();
        self.state.expect_reservation(token, id, Instant::now() + deadline, prefill);
        let guard = PendingGuard { state: self.state.clone(), token };
        // The backstop: a reservation whose KV has not arrived by then recomputes here, and
        // says so (the router cancels a prefill still running for it).
        let (notice_tx, notices) = unbounded_channel();
        let state = self.state.clone();
        let backstop = AbortOnDrop(tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(id) = state.forget_reservation(&token) {
                tracing::warn!(request = %id, ?deadline, "no KV within the deadline; recomputing the prompt here");
                state.engine.import_failed(id);
                let _ = notice_tx.send(Event::Recomputing(pb::Recomputing {}));
            }
        }));
        let reserved =
            pb::Reserved { reservation: token.0.to_vec(), block_table: table, kv_addr: self.state.kv_addr.clone() };
        let tokens = token_events(stream, self.state.clone(), progress, notices, slot);
        let out = async_stream::stream! {
            let _guard = guard;
            let _backstop = backstop;
            yield Ok(event(Event::Reserved(reserved)));
            for await item in tokens {
                yield item;
            }
        };
        Ok(Response::new(Box::pin(out)))
    }

    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<EventStream>, Status> {
        if !self.state.role.prefills() {
            return Err(Status::failed_precondition("this worker does not prefill"));
        }
        let slot = stream_slot(&self.state)?;
        let p = request.into_inner();
        let token = reservation_token(&p.reservation)?;
        let Work { request: req, progress, .. } = engine_request(p.request)?;
        let addr = resolve(&p.kv_addr).await.map_err(|e| Status::invalid_argument(e.to_string()))?;
        let deadline = Duration::from_millis(u64::from(p.deadline_ms.max(1)));
        let layout = self.state.engine.kv_layout();
        let link = match self.state.kv_transport {
            KvTransportKind::Tcp => None,
            KvTransportKind::Nccl => Some(ensure_link(&self.state, &p.kv_addr, addr, deadline).await?),
        };
        // Over a link, the engine sends nothing until the receiver accepted the handshake.
        let link = link.map(|(name, link)| LinkSend { name, link, gate: HandoffGate::new() });
        let via = match &link {
            Some(l) => ExportVia::Link { link: l.link.clone(), gate: l.gate.clone() },
            None => ExportVia::Host,
        };
        let (stream, events) =
            self.state.engine.submit_export(req, p.decode_block_table, via).map_err(submit_status)?;
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let state = self.state.clone();
        let creds = self.state.kv_credentials.clone();
        let (started_tx, notices) = unbounded_channel();
        let events = start_tap(events, started_tx);
        let events = match self.state.chaos.exit_after_kv_layers {
            Some(n) => chaos_tap(events, n),
            None => events,
        };
        let transfer = AbortOnDrop(tokio::spawn(async move {
            let result = send_export(events, addr, token, layout, deadline, link, creds).await;
            // A link a hand-off failed is pruned from `links` (`send_export` fails it when it
            // may be out of step); the next hand-off to that peer makes a new one.
            if let Ok(report) = &result {
                state.metrics.observe_kv_transfer(report.bytes, report.elapsed);
            }
            let _ = done_tx.send(result);
        }));
        let tokens = token_events(stream, self.state.clone(), progress, notices, slot);
        let out = async_stream::stream! {
            let _transfer = transfer;
            for await item in tokens {
                yield item;
            }
            let result = match done_rx.await {
                Ok(Ok(r)) => pb::TransferResult { ok: true, error: String::new(), bytes: r.bytes as u64, seconds: r.elapsed.as_secs_f64() },
                Ok(Err(e)) => pb::TransferResult { ok: false, error: e.to_string(), bytes: 0, seconds: 0.0 },
                Err(_) => pb::TransferResult { ok: false, error: "the transfer task ended".into(), bytes: 0, seconds: 0.0 },
            };
            yield Ok(event(Event::Transfer(result)));
        };
        Ok(Response::new(Box::pin(out)))
    }

    async fn recompute(
        &self,
        request: Request<pb::RecomputeRequest>,
    ) -> Result<Response<pb::RecomputeResponse>, Status> {
        let token = reservation_token(&request.into_inner().reservation)?;
        if let Some(id) = self.state.forget_reservation(&token) {
            tracing::warn!(request = %id, "the router reports the prefill failed; recomputing the prompt here");
            self.state.engine.import_failed(id);
        }
        Ok(Response::new(pb::RecomputeResponse {}))
    }

    async fn rebind(&self, request: Request<pb::RebindRequest>) -> Result<Response<pb::RebindResponse>, Status> {
        let r = request.into_inner();
        let token = reservation_token(&r.reservation)?;
        if !baton_core::cluster_auth::valid_identity(&r.prefill_instance) {
            return Err(Status::invalid_argument("Rebind needs a prefill_instance"));
        }
        let found = self.state.rebind_reservation(&token, r.prefill_instance);
        Ok(Response::new(pb::RebindResponse { found }))
    }

    async fn identify(&self, _: Request<pb::IdentifyRequest>) -> Result<Response<pb::IdentifyResponse>, Status> {
        Ok(Response::new(pb::IdentifyResponse { instance: self.state.instance.clone() }))
    }
}
