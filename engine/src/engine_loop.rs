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
//! - Bytes from a peer never reach the backend unchecked: a received layer must be a layer
//!   of the layout, sized for its blocks, aimed at the request's own reservation; a trailer's
//!   token must be in the vocabulary. Anything else fails that hand-off and the request
//!   recomputes its prompt here; the engine's health is not affected.

use crate::backend::{BackendError, BatchLayout, PromptLogprobRow};
use crate::batch::layout_for;
use crate::kv_transport::LayerFrame;
use crate::kv_transport::nccl::{NcclLink, PendingRecv};
use crate::liveness::{EngineHealth, Liveness};
use crate::relay::{ExportEvent, ExportSpec, Reservation, TransferTrailer, plan_blocks};
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
    /// A request whose prompt KV goes to another worker's `dst_block_table`.
    SubmitExport {
        id: RequestId,
        request: Box<EngineRequest>,
        tx: OutputTx,
        grammar: Option<CompiledGrammar>,
        dst_block_table: Vec<u32>,
        export: ExportTx,
        link: Option<Arc<NcclLink>>,
    },
    /// Reserve blocks for a prompt whose KV and first token come from another worker.
    Reserve {
        id: RequestId,
        request: Box<EngineRequest>,
        tx: OutputTx,
        grammar: Option<CompiledGrammar>,
        reply: tokio::sync::oneshot::Sender<Result<Vec<u32>, SubmitError>>,
    },
    /// One received layer for the reserved `blocks` of `id`.
    ImportLayer {
        id: RequestId,
        blocks: Vec<u32>,
        frame: LayerFrame,
    },
    /// Layer `layer` of `id` was sent over `link`: enqueue receiving it into `blocks`.
    ImportLayerNccl {
        id: RequestId,
        layer: usize,
        /// The send group's number on the link.
        seq: u64,
        runs: Vec<(usize, usize)>,
        link: Arc<NcclLink>,
    },
    /// A new transfer stream on the engine's device, for a new NCCL link.
    TransferStream {
        reply: tokio::sync::oneshot::Sender<Result<Arc<cudarc::driver::CudaStream>, String>>,
    },
    /// Every layer of `id` arrived; the trailer carries the first token.
    ImportDone {
        id: RequestId,
        trailer: TransferTrailer,
    },
    /// The transfer for `id` failed: recompute the prompt here.
    ImportFailed(RequestId),
    Abort(RequestId),
    Shutdown,
}

/// Runs a forward step; implemented by the model over any backend.
pub(crate) trait StepModel: Send {
    /// See [`crate::runner::ModelRunner::forward_exporting`].
    fn forward(
        &mut self,
        batch: &crate::backend::BatchLayout,
        exports: &[ExportSpec],
        sink: &mut dyn FnMut(usize, LayerFrame),
    ) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::take_prompt_logprobs`].
    fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprob>;
    /// See [`crate::runner::ModelRunner::sample_launch`].
    fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::sample_collect`].
    fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError>;
    /// See [`crate::runner::ModelRunner::write_kv_blocks`].
    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::nccl_recv_layer`].
    fn nccl_recv_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::nccl_discard_layer`].
    fn nccl_discard_layer(
        &mut self,
        layer: usize,
        runs: &[(usize, usize)],
        link: &NcclLink,
    ) -> Result<(), BackendError>;
    /// See [`crate::runner::ModelRunner::new_transfer_stream`].
    fn new_transfer_stream(&mut self) -> Result<Arc<cudarc::driver::CudaStream>, BackendError>;
    /// See [`crate::runner::ModelRunner::nccl_fence`].
    fn nccl_fence(&mut self, link: &NcclLink) -> Result<(), BackendError>;
}

impl<B: crate::backend::Backend> StepModel for crate::runner::ModelRunner<B> {
    fn forward(
        &mut self,
        batch: &crate::backend::BatchLayout,
        exports: &[ExportSpec],
        sink: &mut dyn FnMut(usize, LayerFrame),
    ) -> Result<(), BackendError> {
        crate::runner::ModelRunner::forward_exporting(self, batch, exports, sink)
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

    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        crate::runner::ModelRunner::write_kv_blocks(self, layer, blocks, k, v)
    }

    fn nccl_recv_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), BackendError> {
        crate::runner::ModelRunner::nccl_recv_layer(self, layer, runs, link)
    }

    fn nccl_discard_layer(
        &mut self,
        layer: usize,
        runs: &[(usize, usize)],
        link: &NcclLink,
    ) -> Result<(), BackendError> {
        crate::runner::ModelRunner::nccl_discard_layer(self, layer, runs, link)
    }

    fn new_transfer_stream(&mut self) -> Result<Arc<cudarc::driver::CudaStream>, BackendError> {
        crate::runner::ModelRunner::new_transfer_stream(self)
    }

    fn nccl_fence(&mut self, link: &NcclLink) -> Result<(), BackendError> {
        crate::runner::ModelRunner::nccl_fence(self, link)
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
    link: Option<Arc<NcclLink>>,
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
    /// NCCL links that are receiving KV for a reservation (fenced before it first runs).
    nccl_imports: HashMap<RequestId, Arc<NcclLink>>,
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
            nccl_imports: HashMap::new(),
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
                // Idle: block until there is something to do (waiting is not a stall).
                self.shared.liveness.idle();
                let next = self.rx.recv();
                self.shared.liveness.beat();
                match next {
                    Ok(c) => self.handle(c),
                    Err(_) => break,
                }
            }
            while !self.stopping
                && let Ok(c) = self.rx.try_recv()
            {
                self.handle(c);
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
            Command::SubmitExport { id, request, tx, grammar, dst_block_table, export, link } => {
                let export = Export { dst_block_table, tx: export, link, started: false };
                self.admit(id, *request, tx, Some(export), grammar);
            }
            Command::ImportLayerNccl { id, layer, seq, runs, link } => {
                self.import_layer_nccl(id, layer, seq, runs, &link)
            }
            Command::TransferStream { reply } => {
                let _ = reply.send(self.model.new_transfer_stream().map_err(|e| e.to_string()));
            }
            Command::Reserve { id, request, tx, grammar, reply } => {
                self.shared.pending.fetch_sub(1, Ordering::SeqCst);
                let seed = request.params.seed.unwrap_or_else(baton_core::api::fresh_seed);
                let (num_prompt_tokens, logprobs) = (request.prompt_token_ids.len(), request.params.logprobs);
                let result = self.scheduler.reserve_for_transfer(id, *request, &self.eos_token_ids);
                if let Ok(table) = &result {
                    // The first token comes with the KV (`import_done` feeds it).
                    let grammar = grammar.map(|g| g.matcher());
                    self.live.insert(id, Live { tx, seed, export: None, grammar, prompt_logprobs: None });
                    let res = Reservation { block_table: table.clone(), num_prompt_tokens, logprobs };
                    if let Ok(mut r) = self.shared.reservations.lock() {
                        r.insert(id, Arc::new(res));
                    }
                }
                if reply.send(result).is_err() {
                    // The caller gave up before the answer: release the reservation.
                    self.forget_reservation(id);
                    self.scheduler.abort(id);
                    self.live.remove(&id);
                }
            }
            Command::ImportLayer { id, blocks, frame } => self.import_layer(id, &blocks, &frame),
            Command::ImportDone { id, trailer } => self.import_done(id, trailer),
            Command::ImportFailed(id) => {
                self.nccl_imports.remove(&id);
                self.forget_reservation(id);
                if self.scheduler.fail_kv_transfer(id) {
                    tracing::warn!(request = %id, "KV transfer failed; recomputing the prompt here");
                }
            }
            Command::Abort(id) => {
                self.nccl_imports.remove(&id);
                self.forget_reservation(id);
                self.scheduler.abort(id);
                if let Some(l) = self.live.remove(&id) {
                    let _ = l.tx.send(Ok(abort_output()));
                }
            }
            Command::Shutdown => self.stopping = true,
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

    /// `id` no longer waits for KV: the transport stops admitting hand-offs for it.
    fn forget_reservation(&self, id: RequestId) {
        if let Ok(mut r) = self.shared.reservations.lock() {
            r.remove(&id);
        }
    }

    /// A hand-off for `id` failed here (bad data, a refused write): it recomputes its prompt.
    fn fail_import(&mut self, id: RequestId, reason: &str) {
        self.nccl_imports.remove(&id);
        self.forget_reservation(id);
        if self.scheduler.fail_kv_transfer(id) {
            tracing::warn!(request = %id, reason, "bad KV hand-off; recomputing the prompt here");
        }
    }

    /// A backend error while storing a peer's KV for `id`: fatal ones stop the engine,
    /// others fail only this hand-off.
    fn import_backend_failed(&mut self, id: RequestId, e: &BackendError) {
        if e.is_fatal() {
            self.go_fatal(e);
        } else {
            self.fail_import(id, &e.to_string());
        }
    }

    /// Checks that `id` still waits for KV and that `blocks` are its own; the reason otherwise.
    fn import_target_ok(&self, id: RequestId, blocks: &[u32]) -> Result<bool, String> {
        let waiting =
            self.scheduler.request(id).is_some_and(|r| r.status() == baton_core::request::RequestStatus::WaitingForKv);
        if !waiting {
            return Ok(false);
        }
        let table = self.scheduler.block_manager().block_table(id).unwrap_or(&[]);
        // Called per layer with every block of a prompt: a set keeps it linear.
        let own: std::collections::HashSet<u32> = table.iter().copied().collect();
        if blocks.iter().all(|b| own.contains(b)) {
            Ok(true)
        } else {
            Err(format!("the transfer targets blocks {blocks:?} outside the reservation {table:?}"))
        }
    }

    /// Files the notice that send group `seq` (layer `layer` of `id`) was enqueued on `link`,
    /// then enqueues every receive now due on that link, in send order: into the request's
    /// reserved blocks, or into scratch when the request no longer waits for KV (the send
    /// must still be matched, or the link would pair every later send with the wrong receive).
    fn import_layer_nccl(
        &mut self,
        id: RequestId,
        layer: usize,
        seq: u64,
        runs: Vec<(usize, usize)>,
        link: &Arc<NcclLink>,
    ) {
        let due = match link.order_recv(seq, PendingRecv { request: id, layer, runs }) {
            Ok(due) => due,
            Err(e) => return self.fail_import(id, &format!("bad NCCL layer notice: {e}")),
        };
        for r in due {
            let blocks: Option<Vec<u32>> = r
                .runs
                .iter()
                .map(|&(s, n)| Some(u32::try_from(s).ok()?..u32::try_from(s.checked_add(n)?).ok()?))
                .collect::<Option<Vec<_>>>()
                .map(|ranges| ranges.into_iter().flatten().collect());
            let target = match blocks {
                Some(_) if r.layer >= self.kv_layout.num_layers => {
                    Err(format!("layer {} is not in the layout", r.layer))
                }
                Some(blocks) => self.import_target_ok(r.request, &blocks),
                None => Err("runs beyond the largest block id".to_owned()),
            };
            let result = match target {
                Ok(true) => {
                    self.nccl_imports.insert(r.request, link.clone());
                    self.model.nccl_recv_layer(r.layer, &r.runs, link)
                }
                Ok(false) => self.model.nccl_discard_layer(r.layer, &r.runs, link),
                Err(e) => {
                    self.fail_import(r.request, &format!("cannot receive a KV layer over NCCL: {e}"));
                    continue;
                }
            };
            if let Err(e) = result {
                self.import_backend_failed(r.request, &e);
            }
        }
    }

    /// Writes one received layer into `id`'s reserved blocks. Frames for requests that are no
    /// longer waiting for KV (aborted, failed over to recompute) are dropped: their blocks may
    /// already belong to someone else. A layer outside the layout, a size that is not the
    /// blocks' or blocks outside the request's own table fail the hand-off before the backend
    /// sees them.
    fn import_layer(&mut self, id: RequestId, blocks: &[u32], frame: &LayerFrame) {
        let want = blocks.len().checked_mul(self.kv_layout.bytes_per_block());
        let checked = if frame.layer >= self.kv_layout.num_layers {
            Err(format!("layer {} is not in the layout ({} layers)", frame.layer, self.kv_layout.num_layers))
        } else if want != Some(frame.k.len()) || want != Some(frame.v.len()) {
            Err(format!("{}+{} bytes for {} blocks", frame.k.len(), frame.v.len(), blocks.len()))
        } else {
            self.import_target_ok(id, blocks)
        };
        match checked {
            Ok(false) => {}
            Ok(true) => {
                if let Err(e) = self.model.write_kv_blocks(frame.layer, blocks, &frame.k, &frame.v) {
                    self.import_backend_failed(id, &e);
                }
            }
            Err(e) => self.fail_import(id, &format!("cannot store a received KV layer: {e}")),
        }
    }

    /// The whole prompt KV of `id` arrived with its first token: it joins the batch (or ends).
    /// A trailer that does not fit the request (a token outside the vocabulary, logprobs it
    /// did not ask for) fails the hand-off instead.
    fn import_done(&mut self, id: RequestId, trailer: TransferTrailer) {
        if let Some(link) = self.nccl_imports.remove(&id)
            && let Err(e) = self.model.nccl_fence(&link)
        {
            return self.import_backend_failed(id, &e);
        }
        let Some(want_logprobs) = self.scheduler.request(id).map(|r| r.params().logprobs) else { return };
        if let Err(reason) = trailer.check(self.vocab_size, want_logprobs) {
            return self.fail_import(id, &reason);
        }
        self.forget_reservation(id);
        let Some(u) = self.scheduler.complete_kv_transfer_with_token(id, trailer.first_token) else {
            return;
        };
        self.publish_stats();
        let Some(live) = self.live.get_mut(&id) else { return };
        let finish_reason = match structured::advance(live.grammar.as_mut(), u.new_token, u.finish_reason) {
            Ok(reason) => reason,
            Err(e) => {
                self.scheduler.abort(id);
                if let Some(l) = self.live.remove(&id) {
                    let _ = l.tx.send(Err(e));
                }
                return;
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
    }

    /// Plans the hand-off of every export request whose prompt completes in this step and
    /// returns, in step order, what the model does with each export's blocks after every
    /// layer and the channel its layers go to (parallel vectors: the model indexes exports).
    fn plan_exports(
        &mut self,
        out: &baton_core::scheduler::SchedulerOutput,
    ) -> (Vec<ExportSpec>, Vec<ExportTx>, Vec<RequestId>) {
        let (mut specs, mut txs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        let mut failed = Vec::new();
        for seq in out.seqs.iter().filter(|s| s.sample) {
            let Some(Export { dst_block_table, tx, link, .. }) = self.live.get(&seq.id).and_then(|l| l.export.as_ref())
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
                        specs.push(ExportSpec { blocks: src, runs, link: link.clone() });
                        txs.push(tx.clone());
                        ids.push(seq.id);
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
        (specs, txs, ids)
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
        let (export_specs, export_txs, export_ids) = self.plan_exports(&out);
        let mut sink = |j: usize, frame: LayerFrame| {
            if let Some(tx) = export_txs.get(j) {
                let _ = tx.send(ExportEvent::Layer(frame));
            }
        };
        let model = &mut self.model;
        self.timing.steps += 1;
        let result = self.pool.install(|| model.forward(&batch, &export_specs, &mut sink));
        if let Err(e) = result {
            self.fail_step(&out, &e);
            return;
        }
        if !prompt_rows.is_empty() {
            self.store_prompt_logprobs(&prompt_rows);
        }
        // Blocks sent over NCCL are freed after this step: later steps must not overwrite them
        // before the sends are done (the GPU waits, the host does not). An export whose sends
        // cannot be fenced fails (its receiver recomputes), so no one trusts what it sent.
        for (spec, id) in export_specs.iter().zip(&export_ids) {
            let Some(link) = spec.link.as_ref() else { continue };
            if let Err(e) = self.model.nccl_fence(link) {
                if e.is_fatal() {
                    return self.go_fatal(&e);
                }
                tracing::warn!(request = %id, error = %e, "cannot fence an NCCL export; failing the export");
                self.scheduler.abort(*id);
                if let Some(l) = self.live.remove(id) {
                    let _ = l.tx.send(Err(EngineError::Backend(e.to_string())));
                }
            }
        }
        self.launch_sample(out, self.async_scheduling && export_specs.is_empty());
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
        match self.pool.install(|| model.forward(&batch, &[], &mut |_, _| {})) {
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
