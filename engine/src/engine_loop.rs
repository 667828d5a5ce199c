//! The engine thread: owns the scheduler, the model (and through it the
//! backend and KV cache) and the per-request output channels.
//!
//! Each iteration drains commands (blocking only when idle), asks the
//! scheduler for a step, runs it, samples, and hands the sampled tokens back
//! to the scheduler, which decides what finished.
//!
//! With async scheduling, a step's sampling is launched and left in flight: the next
//! iteration first plans and launches the step after it
//! ([`Scheduler::continue_decode`]: its rows take the in-flight picks on the device), and
//! only then waits for the in-flight tokens and applies them, so the host's work for one
//! step runs while the device computes the next. A step that cannot be planned that way
//! is scheduled once the tokens are applied, as without async scheduling.
//!
//! Invariants: every request known to the scheduler has a live entry here and vice versa;
//! at most one step is in flight, and it is applied before the step planned after it; a
//! request whose receiver is gone is aborted (freeing its blocks) on the next send; every
//! request waiting for KV from another worker has its [`Reservation`] published in
//! `Shared::reservations` (for the transport's checks), and only those do.
//!
//! Errors and liveness:
//! - A **recoverable** backend error (out of memory, a refused argument: anything but
//!   [`BackendError::DeviceLost`]) fails the requests of the step it happened in with
//!   [`EngineError::Backend`]; the engine stays healthy and runs the next step.
//! - A **fatal** one ([`BackendError::is_fatal`]: the device's context is lost) fails every
//!   request, records [`EngineHealth::Fatal`] and stops the loop. The engine library does not
//!   exit: the binary watches the health and exits so its supervisor restarts it.
//! - A **panic** unwinds out of `run` and is caught at the thread's boundary
//!   (`start_engine`), which records [`EngineHealth::Panicked`] and only then fails the
//!   requests still here ([`EngineLoop::fail_after_panic`]), so a client that sees its
//!   request fail also sees the engine unhealthy.
//! - The loop beats [`Liveness`] every iteration and marks itself idle before blocking for
//!   a command, so a step that runs past the stall timeout reads as
//!   [`EngineHealth::Stalled`] until it returns.
//! - KV hand-offs go through one [`KvConnector`] (the transport's events arrive as one
//!   command, [`Command::Kv`]); the loop only applies its [`KvOutcome`]s. Bytes from a peer
//!   never reach the backend unchecked: the connector checks a received layer against the
//!   layout and the request's own reservation, and the loop checks a trailer's token against
//!   the vocabulary. Anything else fails that hand-off and the request recomputes its prompt
//!   here; the engine's health is not affected.

use crate::backend::{BackendError, BatchLayout, PromptLogprobRow};
use crate::batch::layout_for;
use crate::kv_connector::{ExportVia, KvAccess, KvConnector, KvEvent, KvOutcome, StepExport};
use crate::liveness::{EngineHealth, Liveness};
use crate::relay::{ExportEvent, Reservation, TransferTrailer, plan_blocks};
use crate::step_timing::StepTiming;
use crate::structured;
use baton_core::api::{
    EngineError, EngineOutput, EngineRequest, EngineStats, FinishReason, PromptLogprob, RequestId, SubmitError,
    TokenLogprob,
};
use baton_core::block_manager::CacheEvent;
use baton_core::kv_transfer::{KvLayout, plan_transfer};
use baton_core::sampling::{Sampled, SamplingContext};
use baton_core::scheduler::{Scheduler, SchedulerOutput};
use baton_core::structured::TokenMask;
use baton_grammar::{CompiledGrammar, SequenceGrammar};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Output channel of one request.
pub(crate) type OutputTx = UnboundedSender<Result<EngineOutput, EngineError>>;

/// Receives a prefill engine's [`ExportEvent`]s for one request.
pub(crate) type ExportTx = UnboundedSender<ExportEvent>;

/// A message from the handle to the engine thread.
pub(crate) enum Command {
    /// A new request; `grammar` is its compiled grammar when it is constrained.
    Submit {
        id: RequestId,
        request: Box<EngineRequest>,
        tx: OutputTx,
        grammar: Option<CompiledGrammar>,
    },
    /// Everything about KV hand-offs (see [`KvCommand`]).
    Kv(KvCommand),
    Abort(RequestId),
    Shutdown,
}

/// A KV hand-off command: the scheduler's part (an export, a reservation) or an event the
/// connector handles.
pub(crate) enum KvCommand {
    /// A request whose prompt KV goes to another worker's `dst_block_table`, `via` a transport.
    Export {
        id: RequestId,
        request: Box<EngineRequest>,
        tx: OutputTx,
        grammar: Option<CompiledGrammar>,
        dst_block_table: Vec<u32>,
        export: ExportTx,
        via: ExportVia,
    },
    /// Reserve blocks for a prompt whose KV and first token come from another worker.
    Reserve {
        id: RequestId,
        request: Box<EngineRequest>,
        tx: OutputTx,
        grammar: Option<CompiledGrammar>,
        reply: tokio::sync::oneshot::Sender<Result<Vec<u32>, SubmitError>>,
    },
    /// The transfer for `id` failed: recompute the prompt here.
    Failed(RequestId),
    /// For the connector.
    Event(KvEvent),
}

/// Runs a forward step; implemented by the model over any backend.
pub(crate) trait StepModel: Send {
    /// See [`crate::runner::ModelRunner::forward_with`]; `after_layer` (when given) runs as
    /// soon as each layer's KV is written.
    fn forward(
        &mut self,
        batch: &crate::backend::BatchLayout,
        after_layer: Option<&mut crate::runner::AfterLayer<'_>>,
    ) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::take_prompt_logprobs`].
    fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprob>;
    /// See [`crate::runner::ModelRunner::sample_launch`].
    fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::sample_collect`].
    fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError>;
    /// The KV cache, for the connector.
    fn kv_access(&mut self) -> &mut dyn KvAccess;
}

impl<B: crate::backend::Backend> StepModel for crate::runner::ModelRunner<B> {
    fn forward(
        &mut self,
        batch: &crate::backend::BatchLayout,
        after_layer: Option<&mut crate::runner::AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        crate::runner::ModelRunner::forward_with(self, batch, after_layer)
    }

    fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprob> {
        crate::runner::ModelRunner::take_prompt_logprobs(self)
    }

    fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError> {
        crate::runner::ModelRunner::sample_launch(self, rows)
    }

    fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError> {
        crate::runner::ModelRunner::sample_collect(self)
    }

    fn kv_access(&mut self) -> &mut dyn KvAccess {
        // The runner, not its backend: it adopts a sender's FP8 scales while calibration waits.
        self
    }
}

/// State shared between the engine thread and its handles.
pub(crate) struct Shared {
    pub stats: Mutex<EngineStats>,
    /// The engine thread's progress and end.
    pub liveness: Liveness,
    /// What each request waiting for KV from another worker reserved (see the invariants).
    pub reservations: Mutex<HashMap<RequestId, Arc<Reservation>>>,
    /// Submitted but not yet seen by the engine thread (counts against `max_waiting`).
    pub pending: AtomicUsize,
    /// Prefix-cache events not yet taken by the worker's reporter (when recording is on).
    pub cache_events: Mutex<Vec<CacheEvent>>,
    /// Where the engine thread's time went.
    pub timing: Mutex<StepTiming>,
}

/// How long the idle engine sleeps between looks at hand-offs in flight.
const KV_POLL: Duration = Duration::from_millis(2);

/// Most cache events kept for a reporter that stopped draining them; older ones are dropped
/// (the router's prefix index is a hint, never a correctness input).
const MAX_PENDING_CACHE_EVENTS: usize = 1 << 20;

struct Live {
    tx: OutputTx,
    seed: u64,
    /// Set for export requests: where the prompt's KV goes.
    export: Option<Export>,
    /// Set for constrained requests: the grammar state, fed every output token so far.
    grammar: Option<SequenceGrammar>,
    /// For a request with `prompt_logprobs`: entry `i` the logprob of prompt token `i`,
    /// filled chunk by chunk as its prompt is computed and sent whole with its first output
    /// (then `None`). A recompute after preemption overwrites entries with equal values.
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
}

struct Export {
    dst_block_table: Vec<u32>,
    tx: ExportTx,
    via: ExportVia,
    /// `ExportEvent::Started` was sent.
    started: bool,
}

/// A step whose forward and sampling are enqueued and whose tokens are not applied yet.
struct InFlight {
    out: SchedulerOutput,
    /// The requests sampled, in the order of the sampling's entries.
    sampled: Vec<RequestId>,
    /// Whether the step after it may be planned before its tokens are known (a decode step
    /// with no KV export).
    continuable: bool,
}

pub(crate) struct EngineLoop {
    pub scheduler: Scheduler,
    pub model: Box<dyn StepModel>,
    pub rx: Receiver<Command>,
    pub shared: Arc<Shared>,
    pub eos_token_ids: Vec<u32>,
    pub pool: rayon::ThreadPool,
    pub kv_layout: KvLayout,
    /// Token ids must be below this (a peer's first token is checked against it).
    pub vocab_size: usize,
    live: HashMap<RequestId, Live>,
    /// Aborted requests that were waiting for KV: their blocks stay held until the connector
    /// says nothing more can land in them (a receive on a link may still be writing), then
    /// they are freed. Without this a new request could get those blocks while a transfer
    /// still writes into them.
    draining: std::collections::HashSet<RequestId>,
    /// Where KV hand-offs go.
    connector: Box<dyn KvConnector>,
    /// Set by a `Shutdown` command; the loop exits at the next check.
    stopping: bool,
    /// See [`crate::EngineConfig::async_scheduling`].
    pub async_scheduling: bool,
    in_flight: Option<InFlight>,
    /// Counters published to `shared.timing` with the stats.
    timing: StepTiming,
}

impl EngineLoop {
    pub fn new(
        scheduler: Scheduler,
        model: Box<dyn StepModel>,
        rx: Receiver<Command>,
        shared: Arc<Shared>,
        eos_token_ids: Vec<u32>,
        pool: rayon::ThreadPool,
        kv_layout: KvLayout,
        vocab_size: usize,
        connector: Box<dyn KvConnector>,
    ) -> Self {
        Self {
            scheduler,
            model,
            rx,
            shared,
            eos_token_ids,
            pool,
            kv_layout,
            vocab_size,
            live: HashMap::new(),
            draining: Default::default(),
            connector,
            stopping: false,
            async_scheduling: false,
            in_flight: None,
            timing: StepTiming::default(),
        }
    }

    /// Runs until shutdown or until every handle is gone; in-flight requests then get
    /// `EngineError::Shutdown` and free their blocks.
    pub fn run(&mut self) {
        while !self.stopping {
            self.shared.liveness.beat();
            if !self.scheduler.has_unfinished() && self.in_flight.is_none() {
                // Idle: block until there is something to do (waiting is not a stall), but
                // only briefly while hand-offs are in flight: the connector polls them.
                self.shared.liveness.idle();
                let next = if self.connector.busy() {
                    match self.rx.recv_timeout(KV_POLL) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                        other => Some(other.map_err(|_| ())),
                    }
                } else {
                    Some(self.rx.recv().map_err(|_| ()))
                };
                self.shared.liveness.beat();
                match next {
                    Some(Ok(c)) => self.handle(c),
                    Some(Err(())) => break,
                    None => {}
                }
            }
            while !self.stopping
                && let Ok(c) = self.rx.try_recv()
            {
                self.handle(c);
            }
            if !self.stopping {
                self.poll_kv();
            }
            if !self.stopping && (self.scheduler.has_unfinished() || self.in_flight.is_some()) {
                let t0 = Instant::now();
                let wait0 = self.timing.wait;
                self.step();
                let waited = self.timing.wait.saturating_sub(wait0);
                self.timing.host += t0.elapsed().saturating_sub(waited);
            }
            self.publish_stats();
        }
        self.fail_all(EngineError::Shutdown);
    }

    /// Applies one command. `Shutdown` only sets `stopping`; `run` winds down, wherever
    /// the command was received.
    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, request, tx, grammar } => self.admit(id, *request, tx, None, grammar),
            Command::Kv(kv) => self.handle_kv(kv),
            Command::Abort(id) => {
                if let Some(l) = self.live.remove(&id) {
                    let _ = l.tx.send(Ok(abort_output()));
                }
                let awaiting_kv = self
                    .scheduler
                    .request(id)
                    .is_some_and(|r| r.status() == baton_core::request::RequestStatus::WaitingForKv);
                if awaiting_kv {
                    // Its blocks are freed when the connector's `Recompute` says nothing more
                    // can land in them (see `draining`).
                    self.draining.insert(id);
                    self.give_up_import(id);
                } else {
                    self.forget_reservation(id);
                    self.scheduler.abort(id);
                }
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    /// Applies one KV command: the scheduler's part here, the rest through the connector.
    fn handle_kv(&mut self, cmd: KvCommand) {
        match cmd {
            KvCommand::Export { id, request, tx, grammar, dst_block_table, export, via } => {
                let export = Export { dst_block_table, tx: export, via, started: false };
                self.admit(id, *request, tx, Some(export), grammar);
            }
            KvCommand::Reserve { id, request, tx, grammar, reply } => {
                self.shared.pending.fetch_sub(1, Ordering::SeqCst);
                let seed = request.params.seed.unwrap_or_else(baton_core::api::fresh_seed);
                let (num_prompt_tokens, logprobs) = (request.prompt_token_ids.len(), request.params.logprobs);
                let result = self.scheduler.reserve_for_transfer(id, *request, &self.eos_token_ids);
                if let Ok(table) = &result {
                    // The first token comes with the KV (the connector's `Complete` feeds it).
                    let grammar = grammar.map(|g| g.matcher());
                    self.live.insert(id, Live { tx, seed, export: None, grammar, prompt_logprobs: None });
                    let res = Arc::new(Reservation { block_table: table.clone(), num_prompt_tokens, logprobs });
                    if let Ok(mut r) = self.shared.reservations.lock() {
                        r.insert(id, res.clone());
                    }
                    self.connector.reserve(id, res);
                }
                if reply.send(result).is_err() {
                    // The caller gave up before the answer: release the reservation.
                    self.forget_reservation(id);
                    self.scheduler.abort(id);
                    self.live.remove(&id);
                }
            }
            // It recomputes once the connector says nothing more can land in its blocks.
            KvCommand::Failed(id) => self.give_up_import(id),
            KvCommand::Event(event) => {
                let mut out = Vec::new();
                self.connector.on_event(event, self.model.kv_access(), &mut out);
                self.apply_kv(out);
            }
        }
    }

    /// Lets the connector look at hand-offs in flight (completions, deadlines).
    fn poll_kv(&mut self) {
        let mut out = Vec::new();
        self.connector.poll(self.model.kv_access(), Instant::now(), &mut out);
        self.apply_kv(out);
    }

    /// Applies what the connector decided.
    fn apply_kv(&mut self, outcomes: Vec<KvOutcome>) {
        for o in outcomes {
            match o {
                KvOutcome::Complete { id, trailer, reply } => {
                    let result = self.complete_import(id, trailer);
                    if let Some(reply) = reply {
                        let _ = reply.send(result);
                    }
                }
                KvOutcome::Recompute { id, .. } if self.draining.remove(&id) => {
                    // An aborted request's hand-off has settled: now its blocks can go.
                    self.forget_reservation(id);
                    self.scheduler.abort(id);
                }
                KvOutcome::Recompute { id, reason } => self.fail_import(id, &reason),
                KvOutcome::ExportFailed { id, reason } => {
                    tracing::warn!(request = %id, reason, "a KV export failed; failing its request");
                    self.scheduler.abort(id);
                    if let Some(l) = self.live.remove(&id) {
                        let _ = l.tx.send(Err(EngineError::Backend(format!("the KV hand-off failed: {reason}"))));
                    }
                }
                KvOutcome::Fatal(e) => {
                    if !self.stopping {
                        self.go_fatal(&e);
                    }
                }
            }
        }
    }

    /// Queues a new request (plain or export). A constrained one's matcher starts from the
    /// compiled grammar and is fed the output the request already has.
    fn admit(
        &mut self,
        id: RequestId,
        request: EngineRequest,
        tx: OutputTx,
        export: Option<Export>,
        grammar: Option<CompiledGrammar>,
    ) {
        self.shared.pending.fetch_sub(1, Ordering::SeqCst);
        let seed = request.params.seed.unwrap_or_else(baton_core::api::fresh_seed);
        let prompt_logprobs = request.params.prompt_logprobs.map(|_| vec![None; request.prompt_token_ids.len()]);
        match self.scheduler.add_request(id, request, &self.eos_token_ids) {
            Ok(()) => {
                let output = self.scheduler.request(id).map(|r| r.output_token_ids()).unwrap_or(&[]);
                match grammar.map(|g| structured::start(&g, output)).transpose() {
                    Ok(grammar) => {
                        self.live.insert(id, Live { tx, seed, export, grammar, prompt_logprobs });
                    }
                    Err(e) => {
                        self.scheduler.abort(id);
                        let _ = tx.send(Err(e));
                    }
                }
            }
            Err(e) => {
                let _ = tx.send(Err(submit_to_engine_error(e)));
            }
        }
    }

    /// `id` no longer waits for KV: the transport stops admitting hand-offs for it and the
    /// connector drops (or receives into scratch) what still comes for it.
    fn forget_reservation(&mut self, id: RequestId) {
        self.unpublish_reservation(id);
        self.connector.forget(id);
    }

    /// `id` stops waiting for its KV: no more hand-offs are admitted for it, and the connector
    /// answers `Recompute` once nothing more can land in its blocks.
    fn give_up_import(&mut self, id: RequestId) {
        self.unpublish_reservation(id);
        let mut out = Vec::new();
        self.connector.cancel(id, &mut out);
        self.apply_kv(out);
    }

    /// The transport stops admitting hand-offs for `id`.
    fn unpublish_reservation(&self, id: RequestId) {
        if let Ok(mut r) = self.shared.reservations.lock() {
            r.remove(&id);
        }
    }

    /// A hand-off for `id` failed (bad data, a refused write, a failed link, given up): it
    /// recomputes its prompt here.
    fn fail_import(&mut self, id: RequestId, reason: &str) {
        self.forget_reservation(id);
        if self.scheduler.fail_kv_transfer(id) {
            tracing::warn!(request = %id, reason, "KV hand-off failed; recomputing the prompt here");
        }
    }

    /// The whole prompt KV of `id` arrived (the connector says so) with its first token: it
    /// joins the batch (or ends). A trailer that does not fit the request (a token outside the
    /// vocabulary, logprobs it did not ask for) fails the hand-off instead; the reason then.
    fn complete_import(&mut self, id: RequestId, trailer: TransferTrailer) -> Result<(), String> {
        let Some(want_logprobs) = self.scheduler.request(id).map(|r| r.params().logprobs) else {
            return Err(format!("request {id} is gone"));
        };
        if let Err(reason) = trailer.check(self.vocab_size, want_logprobs) {
            self.fail_import(id, &reason);
            return Err(reason);
        }
        self.forget_reservation(id);
        let Some(u) = self.scheduler.complete_kv_transfer_with_token(id, trailer.first_token) else {
            return Err(format!("request {id} no longer waits for its KV"));
        };
        self.publish_stats();
        let Some(live) = self.live.get_mut(&id) else { return Ok(()) };
        let finish_reason = match structured::advance(live.grammar.as_mut(), u.new_token, u.finish_reason) {
            Ok(reason) => reason,
            Err(e) => {
                self.scheduler.abort(id);
                if let Some(l) = self.live.remove(&id) {
                    let _ = l.tx.send(Err(e));
                }
                return Ok(());
            }
        };
        if finish_reason.is_some() && u.finish_reason.is_none() {
            // The grammar is complete: stop as on EOS (the scheduler frees it the same way).
            self.scheduler.abort(id);
        }
        let output = EngineOutput {
            new_token_ids: vec![u.new_token],
            logprobs: trailer.logprobs.into_iter().collect(),
            finish_reason,
            stop_token: u.stop_token,
            num_prompt_tokens: u.num_prompt_tokens,
            num_cached_tokens: u.num_cached_tokens,
            prompt_logprobs: Vec::new(),
        };
        let gone = live.tx.send(Ok(output)).is_err();
        if finish_reason.is_some() {
            self.live.remove(&id);
        } else if gone {
            self.scheduler.abort(id);
            self.live.remove(&id);
        }
        Ok(())
    }

    /// Plans the hand-off of every export request whose prompt completes in this step (the
    /// plan goes to its channel) and returns, in step order, what the connector needs to send
    /// each one's blocks after every layer.
    fn plan_exports(&mut self, out: &baton_core::scheduler::SchedulerOutput) -> Vec<StepExport> {
        let mut exports = Vec::new();
        let mut failed = Vec::new();
        for seq in out.seqs.iter().filter(|s| s.sample) {
            let Some(Export { dst_block_table, tx, via, .. }) = self.live.get(&seq.id).and_then(|l| l.export.as_ref())
            else {
                continue;
            };
            let Some(req) = self.scheduler.request(seq.id) else { continue };
            if req.num_output_tokens() > 0 {
                continue;
            }
            match plan_transfer(&self.kv_layout, &seq.block_table, dst_block_table, req.num_prompt_tokens(), 0) {
                Ok(plan) => {
                    let (src, _) = plan_blocks(&plan);
                    let runs = plan.runs.iter().map(|r| (r.src_start as usize, r.len)).collect();
                    if tx.send(ExportEvent::Plan(plan)).is_ok() {
                        exports.push(StepExport { id: seq.id, blocks: src, runs, tx: tx.clone(), via: via.clone() });
                    }
                }
                Err(e) => failed.push((seq.id, e.to_string())),
            }
        }
        for (id, reason) in failed {
            self.scheduler.abort(id);
            if let Some(l) = self.live.remove(&id) {
                let _ = l.tx.send(Err(EngineError::Unschedulable(format!("cannot plan the KV hand-off: {reason}"))));
            }
        }
        exports
    }

    /// Tells each export request scheduled for the first time that its prompt is being
    /// computed (the router counts its hand-off deadline from then, not from the enqueue).
    fn report_export_starts(&mut self, out: &SchedulerOutput) {
        for seq in &out.seqs {
            if let Some(export) = self.live.get_mut(&seq.id).and_then(|l| l.export.as_mut())
                && !export.started
            {
                export.started = true;
                let _ = export.tx.send(ExportEvent::Started);
            }
        }
    }

    /// One iteration's work: with a step in flight, plan and launch the step after it if it
    /// can be planned now, then apply the in-flight tokens; otherwise schedule a step, run
    /// it, launch its sampling, and (without async scheduling) apply its tokens at once.
    fn step(&mut self) {
        if let Some(prev) = self.in_flight.take() {
            let next = if prev.continuable { self.launch_continuation(&prev) } else { None };
            if self.stopping {
                // The continuation hit a fatal error: every request has already failed.
                return;
            }
            let applied = self.finish(prev);
            if let Some(next) = next
                && applied
            {
                self.timing.planned_ahead += 1;
                self.launch_sample(next, true);
            }
            return;
        }
        let out = self.scheduler.schedule();
        if out.seqs.is_empty() {
            // Nothing runnable right now (e.g. a follower waiting for its prefix leader,
            // or no free blocks): wait briefly for a command instead of spinning.
            if let Ok(c) = self.rx.recv_timeout(Duration::from_millis(2)) {
                self.handle(c);
            }
            return;
        }
        self.report_export_starts(&out);
        let mut batch = layout_for(&out);
        let prompt_rows = self.plan_prompt_logprobs(&out, &mut batch);
        let exports = self.plan_exports(&out);
        let exporting = !exports.is_empty();
        self.connector.begin_step(exports);
        let (model, connector) = (&mut self.model, &mut self.connector);
        self.timing.steps += 1;
        let result = self.pool.install(|| {
            let mut after_layer = |layer: usize, kv: &mut dyn KvAccess| connector.after_layer(layer, kv);
            model.forward(&batch, exporting.then_some(&mut after_layer))
        });
        // The connector's step ends whatever the forward did (a failed step sent nothing).
        let mut kv_out = Vec::new();
        self.connector.fence(self.model.kv_access(), &mut kv_out);
        if let Err(e) = result {
            self.fail_step(&out, &e);
            return;
        }
        self.apply_kv(kv_out);
        if self.stopping {
            return;
        }
        if !prompt_rows.is_empty() {
            self.store_prompt_logprobs(&prompt_rows);
        }
        self.launch_sample(out, self.async_scheduling && !exporting);
        if !self.async_scheduling
            && let Some(f) = self.in_flight.take()
        {
            self.finish(f);
        }
    }

    /// Adds to `batch` the rows whose logits score a prompt token, for every request of the
    /// step that still owes its prompt logprobs: chunk position `p` (below the prompt's last,
    /// whose logits pick the first output token) scores prompt token `p + 1`. Returns, per
    /// row in order, the request and the prompt index it fills.
    fn plan_prompt_logprobs(&self, out: &SchedulerOutput, batch: &mut BatchLayout) -> Vec<(RequestId, usize)> {
        let mut filled = Vec::new();
        for (seq, layout) in out.seqs.iter().zip(&batch.seqs) {
            if self.live.get(&seq.id).is_none_or(|l| l.prompt_logprobs.is_none()) {
                continue;
            }
            let Some(req) = self.scheduler.request(seq.id) else { continue };
            let (Some(top_k), prompt) = (req.params().prompt_logprobs, req.prompt_token_ids()) else { continue };
            let last = prompt.len().saturating_sub(1).min(seq.end_pos());
            for p in seq.start_pos..last {
                batch.prompt_logprobs.push(PromptLogprobRow {
                    row: layout.row_start + (p - seq.start_pos),
                    target: prompt[p + 1],
                    top_k,
                });
                filled.push((seq.id, p + 1));
            }
        }
        filled
    }

    /// Files the step's prompt logprobs (rows planned by `plan_prompt_logprobs`) with their
    /// requests.
    fn store_prompt_logprobs(&mut self, rows: &[(RequestId, usize)]) {
        let answers = self.model.take_prompt_logprobs();
        for (&(id, index), lp) in rows.iter().zip(answers) {
            if let Some(slot) =
                self.live.get_mut(&id).and_then(|l| l.prompt_logprobs.as_mut()).and_then(|v| v.get_mut(index))
            {
                *slot = Some(lp);
            }
        }
    }

    /// Plans the decode step after `prev` (still in flight) and enqueues its forward, its
    /// rows fed with `prev`'s picks where they are; `None` when it cannot be planned now or
    /// failed (then its requests are failed).
    fn launch_continuation(&mut self, prev: &InFlight) -> Option<SchedulerOutput> {
        let next = self.scheduler.continue_decode(&prev.out)?;
        let entry: HashMap<RequestId, usize> = prev.sampled.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let mut batch = layout_for(&next);
        // One row per sequence: row r is next.seqs[r].
        let pending: Option<Vec<(usize, usize)>> =
            next.seqs.iter().enumerate().map(|(r, s)| entry.get(&s.id).map(|&i| (r, i))).collect();
        // A sequence whose pick is not in flight cannot be fed; its blocks stay allocated for
        // the normal step that will run it.
        batch.pending = pending?;
        let model = &mut self.model;
        self.timing.steps += 1;
        match self.pool.install(|| model.forward(&batch, None)) {
            Ok(()) => Some(next),
            Err(e) => {
                self.fail_step(&next, &e);
                None
            }
        }
    }

    /// Launches the sampling of `out`'s sampling rows whose requests are still live (a
    /// planned-ahead row of a request that stopped meanwhile is skipped) and leaves the step
    /// in flight.
    ///
    /// Constrained rows get their grammar's mask here, computed from every token applied so
    /// far: `launch_sample` always runs after `finish` applied the step before (also for a
    /// planned-ahead step, whose forward is already running on the device while the masks
    /// are computed: that is the CPU/GPU overlap). A row whose mask fails fails its request.
    fn launch_sample(&mut self, out: SchedulerOutput, continuable: bool) {
        let mut sampled = Vec::new();
        let masks = self.grammar_masks(&out);
        let result = {
            let mut rows = Vec::new();
            let sampling_seqs = out.seqs.iter().filter(|s| s.sample && !s.token_ids.is_empty());
            for (logit_row, seq) in sampling_seqs.enumerate() {
                let (Some(req), Some(live)) = (self.scheduler.request(seq.id), self.live.get(&seq.id)) else {
                    continue;
                };
                rows.push((
                    logit_row,
                    SamplingContext {
                        params: req.params(),
                        prompt_token_ids: req.prompt_token_ids(),
                        output_token_ids: req.output_token_ids(),
                        eos_token_ids: &self.eos_token_ids,
                        seed: live.seed,
                        allowed: masks.get(&seq.id),
                    },
                ));
                sampled.push(seq.id);
            }
            let model = &mut self.model;
            self.pool.install(|| model.sample_launch(&rows))
        };
        match result {
            Ok(()) => self.in_flight = Some(InFlight { out, sampled, continuable }),
            Err(e) => self.fail_step(&out, &e),
        }
    }

    /// Waits for the in-flight step's tokens and applies them: the scheduler's update, the
    /// outputs, the end of finished and exported requests. False when the device failed
    /// (the step's requests are failed).
    fn finish(&mut self, step: InFlight) -> bool {
        let t0 = Instant::now();
        let picks = self.model.sample_collect();
        self.timing.wait += t0.elapsed();
        let picks = match picks {
            Ok(p) => p,
            Err(e) => {
                self.fail_step(&step.out, &e);
                return false;
            }
        };
        let pairs: Vec<(RequestId, u32)> = step.sampled.iter().zip(&picks).map(|(id, s)| (*id, s.token_id)).collect();
        let mut logprobs: HashMap<RequestId, TokenLogprob> =
            step.sampled.iter().zip(picks).filter_map(|(id, s)| s.logprobs.map(|l| (*id, l))).collect();
        let updates = self.scheduler.update(&step.out, &pairs);
        let exported: Vec<RequestId> =
            updates.iter().filter(|u| self.live.get(&u.id).is_some_and(|l| l.export.is_some())).map(|u| u.id).collect();
        for id in &exported {
            // The prompt is handed off: its blocks go back to the pool (full ones stay cached).
            self.scheduler.abort(*id);
        }
        // Publish before sending, so a client that sees a token also sees the load it implies.
        self.publish_stats();
        for u in updates {
            let Some(live) = self.live.get_mut(&u.id) else { continue };
            let finish_reason = match structured::advance(live.grammar.as_mut(), u.new_token, u.finish_reason) {
                Ok(reason) => reason,
                Err(e) => {
                    self.scheduler.abort(u.id);
                    if let Some(l) = self.live.remove(&u.id) {
                        let _ = l.tx.send(Err(e));
                    }
                    continue;
                }
            };
            if finish_reason.is_some() && u.finish_reason.is_none() {
                // The grammar is complete: stop as on EOS (the scheduler frees it the same
                // way; a planned-ahead row of it is skipped at its sampling).
                self.scheduler.abort(u.id);
            }
            let prompt_logprobs = live.prompt_logprobs.take().unwrap_or_default();
            let token_logprobs: Option<TokenLogprob> = logprobs.remove(&u.id);
            if let Some(export) = &live.export {
                let trailer = TransferTrailer { first_token: u.new_token, logprobs: token_logprobs.clone() };
                let _ = export.tx.send(ExportEvent::Done(trailer));
            }
            let output = EngineOutput {
                new_token_ids: vec![u.new_token],
                logprobs: token_logprobs.into_iter().collect(),
                finish_reason,
                stop_token: u.stop_token,
                num_prompt_tokens: u.num_prompt_tokens,
                num_cached_tokens: u.num_cached_tokens,
                prompt_logprobs,
            };
            let gone = live.tx.send(Ok(output)).is_err();
            if finish_reason.is_some() || live.export.is_some() {
                // An export request's stream ends after its first token (the decode worker
                // carries on); closing the channel tells the reader.
                self.live.remove(&u.id);
            } else if gone {
                // The client went away: free its blocks now rather than at the next token.
                self.scheduler.abort(u.id);
                self.live.remove(&u.id);
            }
        }
        true
    }

    /// The masks of `out`'s constrained sampling rows (in parallel on the engine's pool when
    /// there are several); a request whose matcher fails is failed and gets no row.
    fn grammar_masks(&mut self, out: &SchedulerOutput) -> HashMap<RequestId, TokenMask> {
        // Every step comes here: with no constrained request live, allocate nothing.
        if !self.live.values().any(|l| l.grammar.is_some()) {
            return HashMap::new();
        }
        let rows: std::collections::HashSet<RequestId> =
            out.seqs.iter().filter(|s| s.sample && !s.token_ids.is_empty()).map(|s| s.id).collect();
        let grammars: Vec<(RequestId, &mut SequenceGrammar)> = self
            .live
            .iter_mut()
            .filter(|(id, _)| rows.contains(id))
            .filter_map(|(id, l)| l.grammar.as_mut().map(|g| (*id, g)))
            .collect();
        if grammars.is_empty() {
            return HashMap::new();
        }
        let t0 = Instant::now();
        let results = structured::masks(&self.pool, grammars);
        self.timing.grammar_masks += results.len() as u64;
        self.timing.grammar_time += t0.elapsed();
        let mut masks = HashMap::with_capacity(results.len());
        for (id, result) in results {
            match result {
                Ok(mask) => {
                    masks.insert(id, mask);
                }
                Err(e) => {
                    self.scheduler.abort(id);
                    if let Some(l) = self.live.remove(&id) {
                        let _ = l.tx.send(Err(e));
                    }
                }
            }
        }
        masks
    }

    /// A backend failure during a step: every request of the step fails. A fatal error also
    /// stops the engine; after any other the engine runs the next step as usual.
    fn fail_step(&mut self, out: &baton_core::scheduler::SchedulerOutput, e: &BackendError) {
        if e.is_fatal() {
            return self.go_fatal(e);
        }
        tracing::error!(error = %e, requests = out.seqs.len(), "backend step failed; failing its requests");
        for id in out.seqs.iter().map(|s| s.id) {
            self.scheduler.abort(id);
            if let Some(l) = self.live.remove(&id) {
                let _ = l.tx.send(Err(EngineError::Backend(e.to_string())));
            }
        }
    }

    fn publish_stats(&mut self) {
        let s = self.scheduler.stats();
        if let Ok(mut g) = self.shared.stats.lock() {
            *g = s;
        }
        if let Ok(mut t) = self.shared.timing.lock() {
            *t = self.timing;
        }
        let events = self.scheduler.take_cache_events();
        if !events.is_empty()
            && let Ok(mut q) = self.shared.cache_events.lock()
        {
            q.extend(events);
            if q.len() > MAX_PENDING_CACHE_EVENTS {
                let excess = q.len() - MAX_PENDING_CACHE_EVENTS;
                q.drain(..excess);
            }
        }
    }

    /// A fatal backend error: records it, fails every request, and stops the loop.
    fn go_fatal(&mut self, e: &BackendError) {
        tracing::error!(error = %e, "fatal backend error; the engine stops");
        self.shared.liveness.end(EngineHealth::Fatal(e.to_string()));
        self.in_flight = None;
        self.fail_all(EngineError::Backend(e.to_string()));
        self.stopping = true;
    }

    /// After a panic escaped [`EngineLoop::run`]: every request still here gets `err`. Touches
    /// nothing but the output channels, whose state a panic cannot have broken.
    pub fn fail_after_panic(&mut self, err: EngineError) {
        for (_, l) in self.live.drain() {
            let _ = l.tx.send(Err(err.clone()));
        }
    }

    fn fail_all(&mut self, err: EngineError) {
        if let Ok(mut r) = self.shared.reservations.lock() {
            r.clear();
        }
        for (id, l) in self.live.drain() {
            self.scheduler.abort(id);
            self.connector.forget(id);
            let _ = l.tx.send(Err(err.clone()));
        }
        self.publish_stats();
    }
}

fn abort_output() -> EngineOutput {
    EngineOutput {
        new_token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish_reason: Some(FinishReason::Abort),
        stop_token: None,
        num_prompt_tokens: 0,
        num_cached_tokens: 0,
        prompt_logprobs: Vec::new(),
    }
}

fn submit_to_engine_error(e: SubmitError) -> EngineError {
    EngineError::Unschedulable(e.to_string())
}
