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
//! decode worker to recompute. A failed decode worker fails the request (its KV is gone).
//! A worker that refuses a request before starting it (at capacity, unreachable, or not
//! answering) is replaced by another; when every candidate refused, the request fails with
//! [`EngineError::Overloaded`] (some were full) or [`EngineError::Unavailable`], which the
//! edges answer with 429 / 503.
//!
//! Every wait has a deadline, so nothing here can hang a client:
//! - a call's answer (`Generate`, `Decode`'s reservation, `Prefill`, `Rebind`, `Recompute`):
//!   [`ClusterSettings::rpc_timeout`];
//! - the prefill's queue: [`ClusterSettings::prefill_queue_timeout`] from the `Prefill` call
//!   to the worker's `prefill_started`;
//! - the hand-off: [`ClusterSettings::kv_deadline`] without progress, counted from
//!   `prefill_started` (not from the enqueue) and renewed by each progress report of the
//!   prefill worker, so a long prompt that keeps computing is never cut;
//! - the whole request: [`ClusterSettings::idle_timeout`] without any event from its
//!   workers. Workers report `progress` while their engine steps, so silence means a stuck
//!   or stopped worker, never a long queue or a long prompt.
//!
//! When the relay gives up on a prefill (a deadline, a failure, or the decode worker
//! reporting it recomputes), the prefill stream is dropped: the prefill worker sees the
//! cancellation and its engine aborts the request, so a prompt is never computed twice at
//! once because of a deadline.
//!
//! [`ClusterSettings::rpc_timeout`]: super::ClusterSettings::rpc_timeout
//! [`ClusterSettings::prefill_queue_timeout`]: super::ClusterSettings::prefill_queue_timeout
//! [`ClusterSettings::kv_deadline`]: super::ClusterSettings::kv_deadline
//! [`ClusterSettings::idle_timeout`]: super::ClusterSettings::idle_timeout

use super::client::{Inner, OutputTx, TransferFailurePolicy};
use super::registry::{InflightGuard, Picked};
use baton_core::api::{EngineError, EngineOutput, EngineRequest};
use baton_proto::Role;
use baton_proto::wire::{invalid_grammar_of, output_from_wire, sampling_to_wire};
use baton_proto::worker as pb;
use baton_proto::worker::worker_client::WorkerClient;
use pb::work_event::Event;
use std::time::Duration;
use tokio::time::Instant;
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

/// A worker call's failure as the request's: a grammar the worker could not compile is the
/// client's fault ([`invalid_grammar_of`]); anything else is [`worker_error`].
fn call_error(who: &str, p: &Picked, e: CallError) -> EngineError {
    if let CallError::Status(s) = &e
        && let Some(invalid) = invalid_grammar_of(s)
    {
        return invalid;
    }
    worker_error(who, p, e)
}

fn worker_error(who: &str, p: &Picked, what: impl std::fmt::Display) -> EngineError {
    EngineError::Backend(format!("the {who} worker {} ({}) failed: {what}", p.info.id, p.info.url))
}

/// How often a worker reports progress on a silent stream: a few reports per deadline, so
/// one late report never trips it.
fn progress_interval(inner: &Inner) -> Duration {
    let s = &inner.settings;
    (s.idle_timeout.min(s.kv_deadline) / 4).clamp(Duration::from_millis(20), Duration::from_secs(5))
}

fn work_request(inner: &Inner, req: &EngineRequest, deadline: Duration) -> pb::WorkRequest {
    pb::WorkRequest {
        prompt_token_ids: req.prompt_token_ids.clone(),
        params: Some(sampling_to_wire(&req.params)),
        priority: req.priority,
        deadline_ms: millis(deadline),
        prefill_instance: String::new(),
        progress_ms: millis(progress_interval(inner)),
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
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
        Route::Local(worker) => run_local(inner, worker, &request, &mut delivery).await,
        Route::Relay { prefill, decode, uncached_tokens } => {
            run_relay(inner, prefill, decode, uncached_tokens, &request, &mut delivery).await
        }
    }
}

/// A call that got no usable answer.
#[derive(Debug)]
enum CallError {
    /// The worker answered with this status.
    Status(tonic::Status),
    /// No answer within the deadline (a stopped, partitioned or overloaded worker).
    Timeout(Duration),
    /// The answer was not what the protocol promises.
    Protocol(String),
}

impl CallError {
    /// Whether another worker may take the request: this one is full, gone or silent.
    fn try_another(&self) -> bool {
        match self {
            CallError::Status(s) => matches!(s.code(), tonic::Code::Unavailable | tonic::Code::ResourceExhausted),
            CallError::Timeout(_) => true,
            CallError::Protocol(_) => false,
        }
    }

    fn is_full(&self) -> bool {
        matches!(self, CallError::Status(s) if s.code() == tonic::Code::ResourceExhausted)
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Status(s) => write!(f, "{}", s.message()),
            CallError::Timeout(d) => write!(f, "no answer within {d:?}"),
            CallError::Protocol(m) => f.write_str(m),
        }
    }
}

/// A call's answer within [`super::ClusterSettings::rpc_timeout`]; a worker that refuses
/// connections is ejected at once rather than at its missed heartbeats.
async fn answer<T>(
    inner: &Inner,
    worker: &Picked,
    call: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, CallError> {
    let limit = inner.settings.rpc_timeout;
    match tokio::time::timeout(limit, call).await {
        Err(_) => Err(CallError::Timeout(limit)),
        Ok(Err(s)) => {
            eject_if_unreachable(inner, worker, &s);
            Err(CallError::Status(s))
        }
        Ok(Ok(v)) => Ok(v),
    }
}

/// A worker that refuses connections is gone: eject it now rather than at its missed heartbeats.
fn eject_if_unreachable(inner: &Inner, worker: &Picked, status: &tonic::Status) {
    if status.code() == tonic::Code::Unavailable {
        inner.registry.eject(worker.info.id, &format!("unreachable: {}", status.message()));
    }
}

/// Decode (or unified) workers that refused a request before starting it.
struct Refusals {
    tried: Vec<u64>,
    any_full: bool,
    last: String,
}

impl Refusals {
    fn new(first: &Picked) -> Self {
        Self { tried: vec![first.info.id], any_full: false, last: String::new() }
    }

    /// Notes `worker`'s refusal and picks the next decode worker not tried yet.
    fn next(&mut self, inner: &Inner, worker: &Picked, e: &CallError) -> Option<Picked> {
        self.any_full |= e.is_full();
        self.last = format!("worker {} ({}): {e}", worker.info.id, worker.info.url);
        let next = inner
            .registry
            .candidates(Role::decodes, None)
            .into_iter()
            .find(|(c, _)| !self.tried.contains(&c.id))
            .map(|(_, p)| p)?;
        tracing::warn!(refused = %self.last, next = next.info.id, "trying another decode worker");
        self.tried.push(next.info.id);
        Some(next)
    }

    /// The request's error once no worker is left: the edges answer 429 when some worker
    /// was full, else 503.
    fn exhausted(self) -> EngineError {
        let n = self.tried.len();
        if self.any_full {
            EngineError::Overloaded(format!("all {n} decode worker(s) tried are at capacity (last: {})", self.last))
        } else {
            EngineError::Unavailable(format!(
                "none of the {n} decode worker(s) tried could start it (last: {})",
                self.last
            ))
        }
    }
}

async fn open_generate(
    inner: &Inner,
    worker: &Picked,
    request: &EngineRequest,
) -> Result<Streaming<pb::WorkEvent>, CallError> {
    let channel = inner.channel(&worker.info.url).map_err(CallError::Protocol)?;
    let req = work_request(inner, request, inner.settings.kv_deadline);
    let call = async move { WorkerClient::new(channel).generate(req).await };
    Ok(answer(inner, worker, call).await?.into_inner())
}

async fn run_local(
    inner: &Inner,
    first: Picked,
    request: &EngineRequest,
    delivery: &mut Delivery<'_>,
) -> Result<(), EngineError> {
    let mut worker = first;
    let mut refusals = Refusals::new(&worker);
    let (mut stream, _load) = loop {
        let load = worker.track();
        match open_generate(inner, &worker, request).await {
            Ok(s) => break (s, load),
            Err(e) if e.try_another() => match refusals.next(inner, &worker, &e) {
                Some(next) => worker = next,
                None => return Err(refusals.exhausted()),
            },
            Err(e) => return Err(call_error("decode", &worker, e)),
        }
    };
    let idle = inner.settings.idle_timeout;
    loop {
        let event = match tokio::time::timeout(idle, stream.message()).await {
            Err(_) => return Err(worker_error("decode", &worker, format!("no event for {idle:?}"))),
            Ok(Err(s)) => {
                eject_if_unreachable(inner, &worker, &s);
                return Err(call_error("decode", &worker, CallError::Status(s)));
            }
            Ok(Ok(m)) => m.map(|m| m.event),
        };
        match event {
            Some(Some(Event::Tokens(t))) => {
                let (index, out) = output_from_wire(t).map_err(|e| worker_error("decode", &worker, e))?;
                if delivery.deliver(index, out) {
                    return Ok(());
                }
            }
            Some(Some(Event::Progress(_))) => {}
            Some(Some(Event::Error(e))) => return Err(worker_error("decode", &worker, e)),
            Some(_) => return Err(worker_error("decode", &worker, "unexpected event on a generate stream")),
            None => return Err(worker_error("decode", &worker, "the stream ended before the request finished")),
        }
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

/// The reservation's own deadline on the decode worker: a backstop for a router that stopped
/// deciding, later than every deadline the router enforces itself (queue, then hand-off), so
/// in normal operation the router's `Recompute` or the KV comes first.
fn reservation_backstop(inner: &Inner) -> Duration {
    let s = &inner.settings;
    s.rpc_timeout + s.prefill_queue_timeout + 2 * s.kv_deadline
}

/// Reserves blocks on `decode` for KV that only `prefill` may send.
async fn reserve(
    inner: &Inner,
    decode: &Picked,
    prefill: &Picked,
    request: &EngineRequest,
) -> Result<Reservation, CallError> {
    let channel = inner.channel(&decode.info.url).map_err(CallError::Protocol)?;
    let req = pb::WorkRequest {
        prefill_instance: prefill.info.instance.clone(),
        ..work_request(inner, request, reservation_backstop(inner))
    };
    let call = async move {
        let mut stream = WorkerClient::new(channel).decode(req).await?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((stream, first))
    };
    let (stream, first) = answer(inner, decode, call).await?;
    match first.and_then(|e| e.event) {
        Some(Event::Reserved(r)) => {
            Ok(Reservation { stream, token: r.reservation, block_table: r.block_table, kv_addr: r.kv_addr })
        }
        Some(Event::Error(e)) => Err(CallError::Protocol(e)),
        _ => Err(CallError::Protocol("the decode stream did not start with a reservation".into())),
    }
}

/// A running prefill and the moment the relay gives up on it.
struct Prefill {
    worker: Picked,
    stream: Streaming<pb::WorkEvent>,
    /// Its engine started computing the prompt (it left the queue).
    started: bool,
    /// Queued: the end of the queue allowance; started: the hand-off deadline, renewed by
    /// each sign of progress.
    give_up_at: Instant,
}

impl Prefill {
    fn progressed(&mut self, inner: &Inner) {
        if self.started {
            self.give_up_at = Instant::now() + inner.settings.kv_deadline;
        }
    }

    fn start(&mut self, inner: &Inner) {
        self.started = true;
        self.progressed(inner);
    }
}

async fn open_prefill(
    inner: &Inner,
    prefill: &Picked,
    request: &EngineRequest,
    res: &Reservation,
) -> Result<Prefill, CallError> {
    let channel = inner.channel(&prefill.info.url).map_err(CallError::Protocol)?;
    let deadline = inner.settings.kv_deadline;
    let req = pb::PrefillRequest {
        request: Some(work_request(inner, request, deadline)),
        kv_addr: res.kv_addr.clone(),
        reservation: res.token.clone(),
        decode_block_table: res.block_table.clone(),
        deadline_ms: millis(deadline),
    };
    let call = async move { WorkerClient::new(channel).prefill(req).await };
    let stream = answer(inner, prefill, call).await?.into_inner();
    Ok(Prefill {
        worker: prefill.clone(),
        stream,
        started: false,
        give_up_at: Instant::now() + inner.settings.prefill_queue_timeout,
    })
}

/// What became of the prefill side after one of its events.
enum PrefillOutcome {
    /// Still running.
    Running,
    /// The KV is on the decode worker.
    Transferred,
    /// It failed; the reason.
    Failed(String),
}

/// Applies one prefill-stream event.
fn on_prefill_event(
    inner: &Inner,
    p: &mut Prefill,
    event: Result<Option<pb::WorkEvent>, tonic::Status>,
    load: &mut PrefillLoad,
    delivery: &mut Delivery<'_>,
) -> Result<(PrefillOutcome, bool), EngineError> {
    let event = match event {
        Ok(Some(m)) => m.event,
        Ok(None) => return Ok((PrefillOutcome::Failed("its stream ended before the transfer finished".into()), false)),
        Err(s) => {
            eject_if_unreachable(inner, &p.worker, &s);
            return Ok((PrefillOutcome::Failed(format!("its stream failed: {}", s.message())), false));
        }
    };
    let outcome = match event {
        Some(Event::PrefillStarted(_)) => {
            p.start(inner);
            PrefillOutcome::Running
        }
        Some(Event::Progress(_)) => {
            p.progressed(inner);
            PrefillOutcome::Running
        }
        Some(Event::Tokens(t)) => {
            let (index, out) = output_from_wire(t).map_err(|e| worker_error("prefill", &p.worker, e))?;
            load.first_token();
            // Its engine is done with the prompt; the transfer's end is what is left.
            p.start(inner);
            if delivery.deliver(index, out) {
                return Ok((PrefillOutcome::Running, true));
            }
            PrefillOutcome::Running
        }
        Some(Event::Transfer(t)) if t.ok => PrefillOutcome::Transferred,
        Some(Event::Transfer(t)) => PrefillOutcome::Failed(format!("the KV transfer failed: {}", t.error)),
        Some(Event::Error(e)) => PrefillOutcome::Failed(e),
        Some(Event::Reserved(_)) | Some(Event::Recomputing(_)) | None => {
            PrefillOutcome::Failed("an unexpected event on a prefill stream".into())
        }
    };
    Ok((outcome, false))
}

async fn run_relay(
    inner: &Inner,
    first_prefill: Picked,
    decode: Picked,
    uncached_tokens: usize,
    request: &EngineRequest,
    delivery: &mut Delivery<'_>,
) -> Result<(), EngineError> {
    // A decode worker that cannot be reached, does not answer or is full is replaced by
    // another one.
    let mut decode = decode;
    let mut refusals = Refusals::new(&decode);
    let mut res = loop {
        match reserve(inner, &decode, &first_prefill, request).await {
            Ok(r) => break r,
            Err(e) if e.try_another() => match refusals.next(inner, &decode, &e) {
                Some(next) => decode = next,
                None => return Err(refusals.exhausted()),
            },
            Err(e) => return Err(call_error("decode", &decode, e)),
        }
    };
    let _decode_load = decode.track();
    let mut tried = vec![first_prefill.info.id];
    let mut retries_left = match inner.settings.on_transfer_failure {
        TransferFailurePolicy::Recompute => 0,
        TransferFailurePolicy::Retry { max_retries } => max_retries,
    };
    let mut load = PrefillLoad::default();
    load.start(&first_prefill, uncached_tokens);
    let mut prefill = match open_prefill(inner, &first_prefill, request, &res).await {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(worker = first_prefill.info.id, error = %e, "prefill call failed");
            None
        }
    };
    let mut transfer_done = false;
    let idle = inner.settings.idle_timeout;
    let mut idle_at = Instant::now() + idle;
    loop {
        // The prefill side is over (done or failed) when its stream is gone.
        if prefill.is_none() && !transfer_done {
            load.release();
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
                    tracing::warn!(worker = p.info.id, "retrying the prefill on another worker");
                    load.start(&p, request.prompt_token_ids.len());
                    // The reservation admits only the prefill worker it is bound to.
                    prefill = match rebind(inner, &decode, &res, &p).await {
                        Ok(()) => match open_prefill(inner, &p, request, &res).await {
                            Ok(opened) => Some(opened),
                            Err(e) => {
                                tracing::warn!(worker = p.info.id, error = %e, "prefill call failed");
                                None
                            }
                        },
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
        let give_up_at = prefill.as_ref().map(|p| p.give_up_at);
        tokio::select! {
            ev = next_prefill_event(&mut prefill) => {
                idle_at = Instant::now() + idle;
                let Some(p) = prefill.as_mut() else { continue };
                let (outcome, finished) = on_prefill_event(inner, p, ev, &mut load, delivery)?;
                if finished {
                    return Ok(());
                }
                match outcome {
                    PrefillOutcome::Running => {}
                    PrefillOutcome::Transferred => {
                        transfer_done = true;
                        prefill = None;
                        load.release();
                    }
                    PrefillOutcome::Failed(why) => {
                        tracing::warn!(worker = p.worker.info.id, error = %why, "prefill failed");
                        prefill = None;
                    }
                }
            }
            _ = sleep_until_some(give_up_at) => {
                if let Some(p) = prefill.take() {
                    let why = if p.started {
                        format!("no progress for {:?}", inner.settings.kv_deadline)
                    } else {
                        format!("still queued after {:?}", inner.settings.prefill_queue_timeout)
                    };
                    // Dropping the stream cancels the call: the prefill worker aborts it.
                    tracing::warn!(worker = p.worker.info.id, reason = %why, "giving up on the prefill");
                }
            }
            ev = res.stream.message() => {
                idle_at = Instant::now() + idle;
                match ev {
                    Ok(Some(m)) => match m.event {
                        Some(Event::Tokens(t)) => {
                            let (index, out) = output_from_wire(t).map_err(|e| worker_error("decode", &decode, e))?;
                            if delivery.deliver(index, out) {
                                return Ok(());
                            }
                        }
                        Some(Event::Recomputing(_)) => {
                            // The decode worker stopped waiting for the KV: a prefill still
                            // running for it would be wasted work.
                            if let Some(p) = prefill.take() {
                                tracing::warn!(worker = p.worker.info.id, decode = decode.info.id, "the decode worker recomputes; cancelling the prefill");
                            }
                            load.release();
                            transfer_done = true;
                        }
                        Some(Event::Error(e)) => return Err(worker_error("decode", &decode, e)),
                        Some(_) | None => {}
                    },
                    Ok(None) => {
                        return Err(worker_error("decode", &decode, "the stream ended before the request finished"));
                    }
                    Err(s) => {
                        eject_if_unreachable(inner, &decode, &s);
                        return Err(worker_error("decode", &decode, s.message()));
                    }
                }
            }
            _ = tokio::time::sleep_until(idle_at) => {
                let who = if transfer_done { "decode" } else { "prefill and decode" };
                return Err(worker_error(who, &decode, format!("no event from the request's workers for {idle:?}")));
            }
        }
    }
}

/// The next event of a running prefill; never resolves when there is none.
async fn next_prefill_event(prefill: &mut Option<Prefill>) -> Result<Option<pb::WorkEvent>, tonic::Status> {
    match prefill {
        Some(p) => p.stream.message().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Binds the reservation to `prefill` (a retry on another prefill worker).
async fn rebind(inner: &Inner, decode: &Picked, res: &Reservation, prefill: &Picked) -> Result<(), EngineError> {
    let channel = inner.channel(&decode.info.url).map_err(EngineError::Backend)?;
    let request = pb::RebindRequest { reservation: res.token.clone(), prefill_instance: prefill.info.instance.clone() };
    let call = async move { WorkerClient::new(channel).rebind(request).await };
    match answer(inner, decode, call).await {
        Ok(r) if r.get_ref().found => Ok(()),
        Ok(_) => Err(worker_error("decode", decode, "the reservation is no longer waiting for KV")),
        Err(e) => Err(worker_error("decode", decode, format!("cannot rebind: {e}"))),
    }
}

async fn recompute(inner: &Inner, decode: &Picked, token: &[u8]) -> Result<(), EngineError> {
    let channel = inner.channel(&decode.info.url).map_err(EngineError::Backend)?;
    let request = pb::RecomputeRequest { reservation: token.to_vec() };
    let call = async move { WorkerClient::new(channel).recompute(request).await };
    match answer(inner, decode, call).await {
        Ok(_) => Ok(()),
        // The decode worker recomputes on its own at its backstop deadline; the idle timeout
        // bounds the wait if it is gone.
        Err(CallError::Timeout(_)) => Ok(()),
        Err(e) => Err(worker_error("decode", decode, format!("cannot recompute: {e}"))),
    }
}
