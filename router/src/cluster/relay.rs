//! Driving one routed request to completion over the worker gRPC streams.
//!
//! - `Local`: one `Generate` stream on one worker.
//! - `Relay`: the decode worker reserves blocks (`Decode` answers `reserved` with a random
//!   token, bound to the prefill worker's instance named in the request), the prefill
//!   worker computes the prompt and streams its KV there (`Prefill`, presenting the token),
//!   its first token goes to the client at once, and the decode worker's tokens follow. A
//!   retry on another prefill worker first rebinds the reservation to it (`Rebind`).
//!
//! Outputs are delivered by output position: a token at a position already delivered (the
//! decode worker repeating the first token it received, or a recompute/retry producing it
//! again with the same seed) is dropped. If the prefill worker fails before the hand-off
//! completes, the [`TransferFailurePolicy`] retries on another prefill worker or asks the
//! decode worker to recompute. A failed decode worker fails the request (its KV is gone);
//! a decode worker that cannot be reached at all is ejected and another one is tried.
//! Every wait has a deadline: nothing here can hang a client.

use super::client::{Inner, OutputTx, TransferFailurePolicy};
use super::registry::{InflightGuard, Picked, Role};
use super::wire::{output_from_wire, sampling_to_wire};
use baton_core::api::{EngineError, EngineOutput, EngineRequest};
use baton_proto::worker as pb;
use baton_proto::worker::worker_client::WorkerClient;
use tonic::Streaming;

/// Where a request runs.
#[derive(Debug, Clone)]
pub(crate) enum Route {
    /// Entirely on one worker.
    Local(Picked),
    /// Prompt on `prefill`, generation on `decode`.
    Relay {
        prefill: Picked,
        decode: Picked,
        /// Prompt tokens `prefill` does not hold in its prefix cache (its queued work).
        uncached_tokens: usize,
    },
}

/// Delivers outputs to the client once per output position.
struct Delivery<'a> {
    tx: &'a OutputTx,
    next: usize,
    /// The prompt's cached tokens as the prefill side reported them (the decode side
    /// reports the whole prompt as received).
    cached: Option<usize>,
}

impl Delivery<'_> {
    /// Sends the part of `out` (first token at `index`) not delivered yet; true when the
    /// request is finished.
    fn deliver(&mut self, index: usize, mut out: EngineOutput) -> bool {
        let skip = self.next.saturating_sub(index).min(out.new_token_ids.len());
        if index > self.next {
            tracing::warn!(index, expected = self.next, "a worker skipped output positions");
        }
        out.new_token_ids.drain(..skip);
        if out.logprobs.len() >= skip && !out.logprobs.is_empty() {
            out.logprobs.drain(..skip);
        }
        let finished = out.finish_reason.is_some();
        if out.new_token_ids.is_empty() && !finished {
            return false;
        }
        if let Some(c) = self.cached {
            out.num_cached_tokens = c;
        } else {
            self.cached = Some(out.num_cached_tokens);
        }
        self.next = self.next.max(index + skip + out.new_token_ids.len());
        let _ = self.tx.send(Ok(out));
        finished
    }
}

fn worker_error(who: &str, p: &Picked, what: impl std::fmt::Display) -> EngineError {
    EngineError::Backend(format!("the {who} worker {} ({}) failed: {what}", p.info.id, p.info.url))
}

fn work_request(req: &EngineRequest, deadline_ms: u32) -> pb::WorkRequest {
    pb::WorkRequest {
        prompt_token_ids: req.prompt_token_ids.clone(),
        params: Some(sampling_to_wire(&req.params)),
        priority: req.priority,
        deadline_ms,
        prefill_instance: String::new(),
    }
}

/// Runs `request` along `route`, sending its outputs to `tx`. An `Err` is the request's
/// final error (the caller sends it).
pub(crate) async fn drive(
    inner: &Inner,
    route: Route,
    request: EngineRequest,
    tx: &OutputTx,
) -> Result<(), EngineError> {
    let mut delivery = Delivery { tx, next: 0, cached: None };
    match route {
        Route::Local(worker) => run_local(inner, &worker, &request, &mut delivery).await,
        Route::Relay { prefill, decode, uncached_tokens } => {
            run_relay(inner, prefill, decode, uncached_tokens, &request, &mut delivery).await
        }
    }
}

async fn run_local(
    inner: &Inner,
    worker: &Picked,
    request: &EngineRequest,
    delivery: &mut Delivery<'_>,
) -> Result<(), EngineError> {
    let _load = worker.track();
    let mut client = WorkerClient::new(inner.channel(&worker.info.url).map_err(EngineError::Backend)?);
    let deadline_ms = inner.settings.kv_deadline.as_millis() as u32;
    let stream = client.generate(work_request(request, deadline_ms)).await.map_err(|s| {
        eject_if_unreachable(inner, worker, &s);
        worker_error("decode", worker, s.message())
    })?;
    let mut stream = stream.into_inner();
    loop {
        match next_event(inner, &mut stream).await {
            Ok(Some(pb::work_event::Event::Tokens(t))) => {
                let (index, out) = output_from_wire(t).map_err(|e| worker_error("decode", worker, e))?;
                if delivery.deliver(index, out) {
                    return Ok(());
                }
            }
            Ok(Some(pb::work_event::Event::Error(e))) => return Err(worker_error("decode", worker, e)),
            Ok(Some(_)) => return Err(worker_error("decode", worker, "unexpected event on a generate stream")),
            Ok(None) => return Err(worker_error("decode", worker, "the stream ended before the request finished")),
            Err(e) => {
                if let Some(s) = e.status() {
                    eject_if_unreachable(inner, worker, s);
                }
                return Err(worker_error("decode", worker, e));
            }
        }
    }
}

/// A failed wait on a worker stream.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error("{0}")]
    Status(tonic::Status),
    #[error("no event for {0:?}")]
    Idle(std::time::Duration),
}

impl StreamError {
    fn status(&self) -> Option<&tonic::Status> {
        match self {
            StreamError::Status(s) => Some(s),
            StreamError::Idle(_) => None,
        }
    }
}

async fn next_event(
    inner: &Inner,
    stream: &mut Streaming<pb::WorkEvent>,
) -> Result<Option<pb::work_event::Event>, StreamError> {
    let idle = inner.settings.idle_timeout;
    match tokio::time::timeout(idle, stream.message()).await {
        Err(_) => Err(StreamError::Idle(idle)),
        Ok(Err(s)) => Err(StreamError::Status(s)),
        Ok(Ok(None)) => Ok(None),
        Ok(Ok(Some(ev))) => Ok(ev.event),
    }
}

/// A worker that refuses connections is gone: eject it now rather than at its missed heartbeats.
fn eject_if_unreachable(inner: &Inner, worker: &Picked, status: &tonic::Status) {
    if status.code() == tonic::Code::Unavailable {
        inner.registry.eject(worker.info.id, &format!("unreachable: {}", status.message()));
    }
}

/// Router-side load a relayed request puts on its prefill worker: one request in flight,
/// and its uncached prompt tokens until the first token comes back.
#[derive(Default)]
struct PrefillLoad {
    inflight: Option<InflightGuard>,
    queued: Option<InflightGuard>,
}

impl PrefillLoad {
    fn start(&mut self, prefill: &Picked, tokens: usize) {
        self.inflight = Some(prefill.track());
        self.queued = Some(prefill.track_prefill(tokens));
    }

    fn first_token(&mut self) {
        self.queued = None;
    }

    fn release(&mut self) {
        self.inflight = None;
        self.queued = None;
    }
}

/// The decode worker's reservation.
struct Reservation {
    stream: Streaming<pb::WorkEvent>,
    /// The decode worker's random token naming it (opaque here).
    token: Vec<u8>,
    block_table: Vec<u32>,
    kv_addr: String,
}

/// Why a decode worker gave no reservation.
enum ReserveError {
    /// It cannot be reached or is at capacity: another decode worker may do.
    TryAnother(EngineError),
    /// Anything else (e.g. the request is invalid there): fail the request.
    Fatal(EngineError),
}

/// Reserves blocks on `decode` for KV that only `prefill` may send.
async fn reserve(
    inner: &Inner,
    decode: &Picked,
    prefill: &Picked,
    request: &EngineRequest,
) -> Result<Reservation, ReserveError> {
    let deadline = inner.settings.kv_deadline;
    let channel = inner.channel(&decode.info.url).map_err(|e| ReserveError::Fatal(EngineError::Backend(e)))?;
    let mut client = WorkerClient::new(channel);
    let work = pb::WorkRequest {
        prefill_instance: prefill.info.instance.clone(),
        ..work_request(request, deadline.as_millis() as u32)
    };
    let call = async {
        let mut stream =
            client.decode(work).await.inspect_err(|s| eject_if_unreachable(inner, decode, s))?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((stream, first))
    };
    let (stream, first) = match tokio::time::timeout(deadline, call).await {
        Err(_) => {
            let e = worker_error("decode", decode, format!("no reservation within {deadline:?}"));
            return Err(ReserveError::TryAnother(e));
        }
        Ok(Err(s)) => {
            let e = worker_error("decode", decode, s.message());
            return Err(match s.code() {
                tonic::Code::Unavailable | tonic::Code::ResourceExhausted => ReserveError::TryAnother(e),
                _ => ReserveError::Fatal(e),
            });
        }
        Ok(Ok(x)) => x,
    };
    match first.and_then(|e| e.event) {
        Some(pb::work_event::Event::Reserved(r)) => {
            Ok(Reservation { stream, token: r.reservation, block_table: r.block_table, kv_addr: r.kv_addr })
        }
        Some(pb::work_event::Event::Error(e)) => Err(ReserveError::Fatal(worker_error("decode", decode, e))),
        _ => Err(ReserveError::Fatal(worker_error(
            "decode",
            decode,
            "the decode stream did not start with a reservation",
        ))),
    }
}

async fn start_prefill(
    inner: &Inner,
    prefill: &Picked,
    request: &EngineRequest,
    res: &Reservation,
) -> Result<Streaming<pb::WorkEvent>, tonic::Status> {
    let channel = inner.channel(&prefill.info.url).map_err(tonic::Status::unavailable)?;
    let deadline_ms = inner.settings.kv_deadline.as_millis() as u32;
    let req = pb::PrefillRequest {
        request: Some(work_request(request, deadline_ms)),
        kv_addr: res.kv_addr.clone(),
        reservation: res.token.clone(),
        decode_block_table: res.block_table.clone(),
        deadline_ms,
    };
    let stream =
        WorkerClient::new(channel).prefill(req).await.inspect_err(|s| eject_if_unreachable(inner, prefill, s))?;
    Ok(stream.into_inner())
}

async fn run_relay(
    inner: &Inner,
    first_prefill: Picked,
    decode: Picked,
    uncached_tokens: usize,
    request: &EngineRequest,
    delivery: &mut Delivery<'_>,
) -> Result<(), EngineError> {
    // A decode worker that cannot be reached (ejected) or is full is replaced by another one.
    let mut decode = decode;
    let mut tried_decode = vec![decode.info.id];
    let mut res = loop {
        match reserve(inner, &decode, &first_prefill, request).await {
            Ok(r) => break r,
            Err(ReserveError::Fatal(e)) => return Err(e),
            Err(ReserveError::TryAnother(e)) => {
                let next = inner
                    .registry
                    .candidates(Role::decodes, None)
                    .into_iter()
                    .find(|(c, _)| !tried_decode.contains(&c.id))
                    .map(|(_, p)| p);
                match next {
                    Some(p) => {
                        tracing::warn!(error = %e, next = p.info.id, "trying another decode worker");
                        tried_decode.push(p.info.id);
                        decode = p;
                    }
                    None => return Err(e),
                }
            }
        }
    };
    let _decode_load = decode.track();
    let mut prefill = first_prefill;
    let mut tried = vec![prefill.info.id];
    let mut retries_left = match inner.settings.on_transfer_failure {
        TransferFailurePolicy::Recompute => 0,
        TransferFailurePolicy::Retry { max_retries } => max_retries,
    };
    let mut p_load = PrefillLoad::default();
    p_load.start(&prefill, uncached_tokens);
    let mut p_stream = match start_prefill(inner, &prefill, request, &res).await {
        Ok(s) => Some(s),
        Err(s) => {
            tracing::warn!(worker = prefill.info.id, error = %s.message(), "prefill call failed");
            None
        }
    };
    let mut transfer_done = false;
    loop {
        // The prefill side is over (done or failed) when its stream is gone.
        if p_stream.is_none() && !transfer_done {
            p_load.release();
            let next = (retries_left > 0)
                .then(|| {
                    inner
                        .registry
                        .candidates(Role::prefills, None)
                        .into_iter()
                        .find(|(c, p)| !tried.contains(&c.id) && c.id != decode.info.id && p.info.role.prefills())
                        .map(|(_, p)| p)
                })
                .flatten();
            match next {
                Some(p) => {
                    retries_left -= 1;
                    tried.push(p.info.id);
                    prefill = p;
                    tracing::warn!(worker = prefill.info.id, "retrying the prefill on another worker");
                    p_load.start(&prefill, request.prompt_token_ids.len());
                    // The reservation admits only the prefill worker it is bound to.
                    p_stream = match rebind(inner, &decode, &res, &prefill).await {
                        Ok(()) => start_prefill(inner, &prefill, request, &res).await.ok(),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot hand the reservation to another prefill worker");
                            None
                        }
                    };
                    continue;
                }
                None => {
                    tracing::warn!(decode = decode.info.id, "prefill failed; the decode worker recomputes the prompt");
                    recompute(inner, &decode, &res.token).await?;
                    transfer_done = true;
                }
            }
        }
        tokio::select! {
            ev = next_if_open(inner, &mut p_stream) => {
                match ev {
                    Ok(Some(pb::work_event::Event::Tokens(t))) => {
                        let (index, out) = output_from_wire(t).map_err(|e| worker_error("prefill", &prefill, e))?;
                        p_load.first_token();
                        if delivery.deliver(index, out) {
                            return Ok(());
                        }
                    }
                    Ok(Some(pb::work_event::Event::Transfer(t))) if t.ok => {
                        transfer_done = true;
                        p_stream = None;
                        p_load.release();
                    }
                    Ok(Some(pb::work_event::Event::Transfer(t))) => {
                        tracing::warn!(worker = prefill.info.id, error = %t.error, "KV transfer failed");
                        p_stream = None;
                    }
                    Ok(Some(pb::work_event::Event::Error(e))) => {
                        tracing::warn!(worker = prefill.info.id, error = %e, "prefill failed");
                        p_stream = None;
                    }
                    Ok(Some(pb::work_event::Event::Reserved(_))) | Ok(None) => {
                        tracing::warn!(worker = prefill.info.id, "prefill stream ended before the transfer finished");
                        p_stream = None;
                    }
                    Err(e) => {
                        tracing::warn!(worker = prefill.info.id, error = %e, "prefill stream failed");
                        p_stream = None;
                    }
                }
            }
            ev = next_event(inner, &mut res.stream) => {
                match ev {
                    Ok(Some(pb::work_event::Event::Tokens(t))) => {
                        let (index, out) = output_from_wire(t).map_err(|e| worker_error("decode", &decode, e))?;
                        if delivery.deliver(index, out) {
                            return Ok(());
                        }
                    }
                    Ok(Some(pb::work_event::Event::Error(e))) => return Err(worker_error("decode", &decode, e)),
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        return Err(worker_error("decode", &decode, "the stream ended before the request finished"));
                    }
                    Err(e) => {
                        if let Some(s) = e.status() {
                            eject_if_unreachable(inner, &decode, s);
                        }
                        return Err(worker_error("decode", &decode, e));
                    }
                }
            }
        }
    }
}

/// The next event of an open stream; never resolves for a closed one.
async fn next_if_open(
    inner: &Inner,
    stream: &mut Option<Streaming<pb::WorkEvent>>,
) -> Result<Option<pb::work_event::Event>, StreamError> {
    match stream {
        Some(s) => next_event(inner, s).await,
        None => std::future::pending().await,
    }
}

/// Binds the reservation to `prefill` (a retry on another prefill worker).
async fn rebind(inner: &Inner, decode: &Picked, res: &Reservation, prefill: &Picked) -> Result<(), EngineError> {
    let channel = inner.channel(&decode.info.url).map_err(EngineError::Backend)?;
    let mut client = WorkerClient::new(channel);
    let call = client
        .rebind(pb::RebindRequest { reservation: res.token.clone(), prefill_instance: prefill.info.instance.clone() });
    match tokio::time::timeout(inner.settings.kv_deadline, call).await {
        Ok(Ok(r)) if r.get_ref().found => Ok(()),
        Ok(Ok(_)) => Err(worker_error("decode", decode, "the reservation is no longer waiting for KV")),
        Ok(Err(s)) => Err(worker_error("decode", decode, format!("cannot rebind: {}", s.message()))),
        Err(_) => Err(worker_error("decode", decode, "no answer to rebind")),
    }
}

async fn recompute(inner: &Inner, decode: &Picked, token: &[u8]) -> Result<(), EngineError> {
    let channel = inner.channel(&decode.info.url).map_err(EngineError::Backend)?;
    let mut client = WorkerClient::new(channel);
    let call = client.recompute(pb::RecomputeRequest { reservation: token.to_vec() });
    match tokio::time::timeout(inner.settings.kv_deadline, call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(worker_error("decode", decode, format!("cannot recompute: {}", s.message()))),
        // The decode worker recomputes on its own at its KV deadline anyway.
        Err(_) => Ok(()),
    }
}
