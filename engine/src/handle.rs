//! [`EngineHandle`]: the async world's side of the engine thread.
//!
//! Submissions are validated here (cheap checks that need no engine state),
//! counted against `max_waiting`, and sent over the command channel; the
//! engine thread never blocks on a handle. Dropping a request's
//! [`OutputStream`] aborts it through [`AbortSink`].
//!
//! A constrained request (`params.structured`) first goes to the grammar pool
//! (`grammar_pool`): `submit` returns its stream at once, the grammar compiles on a pool
//! thread, and only then is the request sent to the engine thread with its compiled
//! grammar. A grammar that does not compile ends the stream with
//! [`EngineError::InvalidGrammar`] as its first and only item (a 400 at the edges); the
//! request counts against `max_waiting` while it compiles.

use crate::engine_loop::{Command, KvCommand, OutputTx, Shared};
use crate::grammar_pool::GrammarPool;
use crate::kv_connector::{ExportVia, KvEvent, Link};
use crate::kv_transport::LayerFrame;
use crate::liveness::EngineHealth;
use crate::relay::{ExportEvent, Reservation, TransferTrailer};
use baton_core::api::{
    AbortSink, EngineClient, EngineError, EngineInfo, EngineRequest, EngineStats, OutputStream, RequestId, SubmitError,
};
use baton_core::block_manager::CacheEvent;
use baton_core::kv_transfer::KvLayout;
use baton_core::params::ParamError;
use baton_grammar::CompiledGrammar;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};

struct Inner {
    tx: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    info: EngineInfo,
    kv_layout: KvLayout,
    max_waiting: usize,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Disconnected when the engine thread's body has returned (its sender is dropped then).
    exited: Mutex<Receiver<()>>,
    grammars: GrammarPool,
}

impl Inner {
    fn send(&self, cmd: Command) -> bool {
        match self.tx.lock() {
            Ok(tx) => tx.send(cmd).is_ok(),
            Err(_) => false,
        }
    }
}

/// How long the last handle's drop waits for the engine thread to stop (see `Drop for Inner`).
const DROP_JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for Inner {
    /// The last handle and the last stream are gone: stop the engine thread and wait for it (at
    /// most [`DROP_JOIN_TIMEOUT`]), so that it never meets the process's exit half-way through
    /// its teardown. Left running, a CUDA engine thread met the driver's teardown at exit and
    /// crashed test binaries after their tests had passed (sessions 16 and 17). A thread still
    /// running after the timeout (a hung device) is left behind with a warning rather than
    /// hanging whoever dropped the handle; nothing joins from the engine thread itself.
    fn drop(&mut self) {
        if let Ok(tx) = self.tx.get_mut() {
            let _ = tx.send(Command::Shutdown);
        }
        let Some(thread) = self.thread.get_mut().ok().and_then(Option::take) else { return };
        if thread.thread().id() == std::thread::current().id() {
            return;
        }
        let exited = self.exited.get_mut().map(|rx| rx.recv_timeout(DROP_JOIN_TIMEOUT));
        if let Ok(Err(RecvTimeoutError::Disconnected)) = exited {
            let _ = thread.join();
        } else {
            tracing::warn!(
                timeout_s = DROP_JOIN_TIMEOUT.as_secs(),
                "the engine thread did not stop after its last handle was dropped"
            );
        }
    }
}

impl AbortSink for Inner {
    fn abort(&self, id: RequestId) {
        self.send(Command::Abort(id));
    }
}

/// A cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl EngineHandle {
    pub(crate) fn new(
        tx: Sender<Command>,
        shared: Arc<Shared>,
        info: EngineInfo,
        kv_layout: KvLayout,
        max_waiting: usize,
        thread: std::thread::JoinHandle<()>,
        exited: Receiver<()>,
        grammars: GrammarPool,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                tx: Mutex::new(tx),
                shared,
                info,
                kv_layout,
                max_waiting,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
                exited: Mutex::new(exited),
                grammars,
            }),
        }
    }

    /// Where the engine thread's time went so far (see [`crate::StepTiming`]).
    pub fn step_timing(&self) -> crate::StepTiming {
        self.inner.shared.timing.lock().map(|t| *t).unwrap_or_default()
    }

    /// The geometry and dtype of this engine's KV cache (what a hand-off must match).
    pub fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout
    }

    /// Whether the engine thread is alive and making progress, and if not why (see
    /// [`EngineHealth`]); [`EngineClient::is_healthy`] is `health().is_healthy()`.
    pub fn health(&self) -> EngineHealth {
        self.inner.shared.liveness.health()
    }

    /// What `id` reserved, while it waits for its KV from another worker (`None` once the KV
    /// arrived, the request recomputes or ended): what a hand-off for it is checked against.
    pub fn reservation(&self, id: RequestId) -> Option<Arc<Reservation>> {
        self.inner.shared.reservations.lock().ok()?.get(&id).cloned()
    }

    /// Prefix-cache events since the last call (empty unless `record_cache_events` is on).
    pub fn take_cache_events(&self) -> Vec<CacheEvent> {
        self.inner.shared.cache_events.lock().map(|mut q| std::mem::take(&mut *q)).unwrap_or_default()
    }

    /// Prefill side of a hand-off: runs `request`'s prompt here and streams its KV, layer by
    /// layer during the step that completes the prompt, into the receiver's blocks
    /// `dst_block_table` (the returned channel yields the plan, the layers and the first
    /// token; see [`ExportEvent`]). The output stream yields the first token and then ends;
    /// the request then no longer holds blocks here.
    /// `via` says how the data leaves: staged to the host (the layer events carry it), or over
    /// a link once its gate opens (the layer events are then notices).
    pub fn submit_export(
        &self,
        request: EngineRequest,
        dst_block_table: Vec<u32>,
        via: ExportVia,
    ) -> Result<(OutputStream, tokio::sync::mpsc::UnboundedReceiver<ExportEvent>), SubmitError> {
        self.check(&request)?;
        let (export_tx, export_rx) = tokio::sync::mpsc::unbounded_channel();
        let spec = request.params.structured.clone();
        let make = move |id, tx, grammar| {
            Command::Kv(KvCommand::Export {
                id,
                request: Box::new(request),
                tx,
                grammar,
                dst_block_table,
                export: export_tx,
                via,
            })
        };
        let stream = match spec {
            None => self.enqueue(|id, tx| make(id, tx, None))?,
            Some(spec) => self.enqueue_after_compile(spec, move |id, tx, g| make(id, tx, Some(g)))?,
        };
        Ok((stream, export_rx))
    }

    /// Decode side of a hand-off: reserves blocks for `request`'s whole prompt, whose KV and
    /// first token will come from a prefill worker, and returns the block table to fill.
    /// Then feed [`EngineHandle::import_layer`] for every layer and
    /// [`EngineHandle::import_done`]; or [`EngineHandle::import_failed`] to recompute here.
    /// The stream yields every output token from the first one on.
    pub async fn reserve_import(&self, request: EngineRequest) -> Result<(OutputStream, Vec<u32>), SubmitError> {
        self.check(&request)?;
        // The decode side compiles before reserving: a bad grammar is refused before any
        // block is held (the prefill side refuses it too).
        let grammar = match &request.params.structured {
            Some(spec) => Some(self.inner.grammars.compiled(spec.clone()).await?),
            None => None,
        };
        let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
        let stream = self.enqueue(|id, tx| {
            Command::Kv(KvCommand::Reserve { id, request: Box::new(request), tx, grammar, reply: reply_tx })
        })?;
        match reply_rx.await {
            Ok(Ok(table)) => Ok((stream, table)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SubmitError::Unavailable("the engine thread stopped".into())),
        }
    }

    /// Stores one received layer of request `id` into its reserved `blocks` (in plan order).
    pub fn import_layer(&self, id: RequestId, blocks: Vec<u32>, frame: LayerFrame) {
        self.kv(KvEvent::Layer { id, blocks, frame });
    }

    /// Layer `layer` of request `id` was sent over `link` as send group `seq`: receive it into
    /// the receiver-side runs `(first block, count)` of the plan, in the link's send order.
    pub fn import_link_layer(&self, id: RequestId, layer: usize, seq: u64, runs: Vec<(usize, usize)>, link: Arc<Link>) {
        self.kv(KvEvent::LinkLayer { id, layer, seq, runs, link });
    }

    /// A new stream on the engine's device for an NCCL link (an error on the CPU backend).
    pub async fn transfer_stream(&self) -> Result<Arc<cudarc::driver::CudaStream>, String> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        if !self.kv(KvEvent::TransferStream { reply }) {
            return Err("the engine thread has stopped".into());
        }
        rx.await.map_err(|_| "the engine thread stopped".to_string())?
    }

    /// Every layer of `id` was sent: it joins the running batch with the trailer's first token
    /// once all of its own layers are in.
    pub fn import_done(&self, id: RequestId, trailer: TransferTrailer) {
        self.kv(KvEvent::Done { id, trailer, reply: None });
    }

    /// [`EngineHandle::import_done`], answering once the request took its first token (or why
    /// it did not: a bad trailer, layers that never arrived, a failed link).
    pub async fn import_done_confirmed(&self, id: RequestId, trailer: TransferTrailer) -> Result<(), String> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        if !self.kv(KvEvent::Done { id, trailer, reply: Some(reply) }) {
            return Err("the engine thread has stopped".into());
        }
        rx.await.map_err(|_| "the engine thread stopped".to_string())?
    }

    /// The transfer for `id` failed or timed out: recompute its prompt here (once nothing more
    /// can land in its blocks).
    pub fn import_failed(&self, id: RequestId) {
        self.inner.send(Command::Kv(KvCommand::Failed(id)));
    }

    fn kv(&self, event: KvEvent) -> bool {
        self.inner.send(Command::Kv(KvCommand::Event(event)))
    }

    /// Request checks that need no engine state.
    fn check(&self, request: &EngineRequest) -> Result<(), SubmitError> {
        let info = &self.inner.info;
        let health = self.health();
        if !health.is_healthy() {
            return Err(SubmitError::Unavailable(health.to_string()));
        }
        if request.params.n != 1 {
            return Err(ParamError::new(
                "n",
                format!("engine requests carry one sequence; got n = {} (the frontend fans out)", request.params.n),
            )
            .into());
        }
        request.check(info)?;
        let waiting = self.stats().num_waiting + self.inner.shared.pending.load(Ordering::SeqCst);
        if waiting >= self.inner.max_waiting {
            return Err(SubmitError::QueueFull { waiting });
        }
        Ok(())
    }

    /// Assigns an id, sends the command `make` builds, and returns the request's stream.
    fn enqueue(
        &self,
        make: impl FnOnce(RequestId, crate::engine_loop::OutputTx) -> Command,
    ) -> Result<OutputStream, SubmitError> {
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::SeqCst));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.inner.shared.pending.fetch_add(1, Ordering::SeqCst);
        if !self.inner.send(make(id, tx)) {
            self.inner.shared.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Unavailable("the engine thread has stopped".into()));
        }
        let sink: Arc<dyn AbortSink> = self.inner.clone();
        Ok(OutputStream::new(id, rx, sink))
    }

    /// Like [`EngineHandle::enqueue`] for a constrained request: returns its stream now and
    /// sends the command once `spec` compiled on the grammar pool; a compile error ends the
    /// stream instead. A request whose stream is dropped meanwhile is never sent.
    fn enqueue_after_compile(
        &self,
        spec: baton_core::structured::GrammarSpec,
        make: impl FnOnce(RequestId, OutputTx, CompiledGrammar) -> Command + Send + 'static,
    ) -> Result<OutputStream, SubmitError> {
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::SeqCst));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.inner.shared.pending.fetch_add(1, Ordering::SeqCst);
        let inner = self.inner.clone();
        let queued = self.inner.grammars.compile(spec, move |result| {
            let sent = match result {
                Ok(grammar) if !tx.is_closed() => inner.send(make(id, tx, grammar)),
                Ok(_) => false,
                Err(e) => {
                    let _ = tx.send(Err(match e {
                        SubmitError::InvalidGrammar { kind, message } => EngineError::InvalidGrammar { kind, message },
                        other => EngineError::Unschedulable(other.to_string()),
                    }));
                    false
                }
            };
            // Sent commands are un-counted by the engine thread when it takes them.
            if !sent {
                inner.shared.pending.fetch_sub(1, Ordering::SeqCst);
            }
        });
        if let Err(e) = queued {
            self.inner.shared.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
        let sink: Arc<dyn AbortSink> = self.inner.clone();
        Ok(OutputStream::new(id, rx, sink))
    }

    /// Stops the engine thread (in-flight requests get `EngineError::Shutdown`) and waits for it.
    pub fn shutdown(&self) {
        self.inner.send(Command::Shutdown);
        let thread = self.inner.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl EngineClient for EngineHandle {
    fn submit(&self, request: EngineRequest) -> Result<OutputStream, SubmitError> {
        self.check(&request)?;
        match request.params.structured.clone() {
            None => self.enqueue(|id, tx| Command::Submit { id, request: Box::new(request), tx, grammar: None }),
            Some(spec) => self.enqueue_after_compile(spec, move |id, tx, grammar| Command::Submit {
                id,
                request: Box::new(request),
                tx,
                grammar: Some(grammar),
            }),
        }
    }

    fn abort(&self, id: RequestId) {
        self.inner.send(Command::Abort(id));
    }

    fn info(&self) -> EngineInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn is_healthy(&self) -> bool {
        self.health().is_healthy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceSpec, EngineConfig, start_engine};
    use baton_core::params::SamplingParams;
    use baton_formats::{LoadFormat, load_model};

    /// Dropping the last handle (and the last stream) stops the engine thread and waits for it:
    /// when `drop` returns, the thread has let go of everything it held (its clone of the shared
    /// state included), so a process may exit right after.
    #[test]
    fn dropping_the_last_handle_joins_the_engine_thread() {
        let (dir, _) = baton_formats::testing::load_golden("llama").expect("golden fixture");
        let model = load_model(&dir, LoadFormat::Auto).expect("load");
        let cfg = EngineConfig { num_threads: Some(1), ..EngineConfig::default() };
        for with_stream in [false, true] {
            let handle = start_engine(&model, DeviceSpec::Cpu, cfg.clone()).expect("start");
            let shared = handle.inner.shared.clone();
            let params = SamplingParams { max_tokens: Some(4), ..SamplingParams::greedy() };
            // A stream outlives the handle: the engine runs until the stream goes too.
            let stream = with_stream.then(|| handle.submit(EngineRequest::new(vec![1, 2, 3], params)).expect("submit"));
            drop(handle);
            if let Some(s) = stream {
                assert!(Arc::strong_count(&shared) > 1, "the engine stopped while a stream was alive");
                drop(s);
            }
            assert_eq!(
                Arc::strong_count(&shared),
                1,
                "with a stream {with_stream}: the engine thread still holds its state"
            );
        }
    }
}
