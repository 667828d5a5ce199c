//! The engine thread: owns the scheduler, the model (and through it the
//! backend and KV cache) and the per-request output channels.
//!
//! Each iteration drains commands (blocking only when idle), asks the
//! scheduler for a step, runs it, samples, and hands the sampled tokens back
//! to the scheduler, which decides what finished. Invariants: every request
//! known to the scheduler has a live entry here and vice versa; a request whose
//! receiver is gone is aborted (freeing its blocks) on the next send; a backend
//! error fails the step's requests and marks the engine unhealthy.

use crate::backend::BackendError;
use crate::batch::layout_for;
use baton_core::api::{EngineError, EngineOutput, EngineRequest, EngineStats, FinishReason, RequestId, SubmitError};
use baton_core::sampling::{SamplingContext, sample_batch};
use baton_core::scheduler::Scheduler;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// Output channel of one request.
pub(crate) type OutputTx = UnboundedSender<Result<EngineOutput, EngineError>>;

/// A message from the handle to the engine thread.
pub(crate) enum Command {
    Submit { id: RequestId, request: Box<EngineRequest>, tx: OutputTx },
    Abort(RequestId),
    Shutdown,
}

/// Runs a forward step; implemented by the model over any backend.
pub(crate) trait StepModel: Send {
    fn forward(&mut self, batch: &crate::backend::BatchLayout) -> Result<Vec<f32>, BackendError>;
}

impl<B: crate::backend::Backend> StepModel for crate::model::LlamaModel<B> {
    fn forward(&mut self, batch: &crate::backend::BatchLayout) -> Result<Vec<f32>, BackendError> {
        crate::model::LlamaModel::forward(self, batch)
    }
}

/// State shared between the engine thread and its handles.
pub(crate) struct Shared {
    pub stats: Mutex<EngineStats>,
    pub healthy: AtomicBool,
    /// Submitted but not yet seen by the engine thread (counts against `max_waiting`).
    pub pending: AtomicUsize,
}

struct Live {
    tx: OutputTx,
    seed: u64,
}

pub(crate) struct EngineLoop {
    pub scheduler: Scheduler,
    pub model: Box<dyn StepModel>,
    pub rx: Receiver<Command>,
    pub shared: Arc<Shared>,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub pool: rayon::ThreadPool,
    live: HashMap<RequestId, Live>,
    /// Set by a `Shutdown` command; the loop exits at the next check.
    stopping: bool,
}

impl EngineLoop {
    pub fn new(
        scheduler: Scheduler,
        model: Box<dyn StepModel>,
        rx: Receiver<Command>,
        shared: Arc<Shared>,
        eos_token_ids: Vec<u32>,
        vocab_size: usize,
        pool: rayon::ThreadPool,
    ) -> Self {
        Self { scheduler, model, rx, shared, eos_token_ids, vocab_size, pool, live: HashMap::new(), stopping: false }
    }

    /// Runs until shutdown or until every handle is gone; in-flight requests then get
    /// `EngineError::Shutdown` and free their blocks.
    pub fn run(mut self) {
        while !self.stopping {
            if !self.scheduler.has_unfinished() {
                // Idle: block until there is something to do.
                match self.rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => break,
                }
            }
            while !self.stopping
                && let Ok(c) = self.rx.try_recv()
            {
                self.handle(c);
            }
            if !self.stopping && self.scheduler.has_unfinished() {
                self.step();
            }
            self.publish_stats();
        }
        self.fail_all(EngineError::Shutdown);
    }

    /// Applies one command. `Shutdown` only sets `stopping`; `run` winds down, wherever
    /// the command was received.
    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, request, tx } => {
                self.shared.pending.fetch_sub(1, Ordering::SeqCst);
                let seed = request.params.seed.unwrap_or_else(entropy_seed);
                match self.scheduler.add_request(id, *request, &self.eos_token_ids) {
                    Ok(()) => {
                        self.live.insert(id, Live { tx, seed });
                    }
                    Err(e) => {
                        let _ = tx.send(Err(submit_to_engine_error(e)));
                    }
                }
            }
            Command::Abort(id) => {
                self.scheduler.abort(id);
                if let Some(l) = self.live.remove(&id) {
                    let _ = l.tx.send(Ok(abort_output()));
                }
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    fn step(&mut self) {
        let out = self.scheduler.schedule();
        if out.seqs.is_empty() {
            // Nothing runnable right now (e.g. a follower waiting for its prefix leader,
            // or no free blocks): wait briefly for a command instead of spinning.
            if let Ok(c) = self.rx.recv_timeout(Duration::from_millis(2)) {
                self.handle(c);
            }
            return;
        }
        let batch = layout_for(&out);
        let model = &mut self.model;
        let result = self.pool.install(|| model.forward(&batch));
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "backend step failed; marking the engine unhealthy");
                self.shared.healthy.store(false, Ordering::SeqCst);
                let ids: Vec<RequestId> = out.seqs.iter().map(|s| s.id).collect();
                for id in ids {
                    self.scheduler.abort(id);
                    if let Some(l) = self.live.remove(&id) {
                        let _ = l.tx.send(Err(EngineError::Backend(e.to_string())));
                    }
                }
                return;
            }
        };
        let sampling_ids: Vec<RequestId> =
            out.seqs.iter().filter(|s| s.sample && !s.token_ids.is_empty()).map(|s| s.id).collect();
        let mut sampled = Vec::with_capacity(sampling_ids.len());
        {
            let mut ctxs = Vec::with_capacity(sampling_ids.len());
            for id in &sampling_ids {
                let (Some(req), Some(live)) = (self.scheduler.request(*id), self.live.get(id)) else {
                    continue;
                };
                ctxs.push(SamplingContext {
                    params: req.params(),
                    prompt_token_ids: req.prompt_token_ids(),
                    output_token_ids: req.output_token_ids(),
                    eos_token_ids: &self.eos_token_ids,
                    seed: live.seed,
                });
            }
            if ctxs.len() == sampling_ids.len() {
                let pool = &self.pool;
                let vocab = self.vocab_size;
                let picks = pool.install(|| sample_batch(&mut logits, vocab, &ctxs));
                sampled.extend(sampling_ids.iter().copied().zip(picks));
            }
        }
        let pairs: Vec<(RequestId, u32)> = sampled.iter().map(|(id, s)| (*id, s.token_id)).collect();
        let mut logprobs: HashMap<RequestId, baton_core::api::TokenLogprob> =
            sampled.into_iter().filter_map(|(id, s)| s.logprobs.map(|l| (id, l))).collect();
        let updates = self.scheduler.update(&out, &pairs);
        // Publish before sending, so a client that sees a token also sees the load it implies.
        self.publish_stats();
        for u in updates {
            let Some(live) = self.live.get(&u.id) else { continue };
            let output = EngineOutput {
                new_token_ids: vec![u.new_token],
                logprobs: logprobs.remove(&u.id).into_iter().collect(),
                finish_reason: u.finish_reason,
                stop_token: u.stop_token,
                num_prompt_tokens: u.num_prompt_tokens,
                num_cached_tokens: u.num_cached_tokens,
            };
            let gone = live.tx.send(Ok(output)).is_err();
            if u.finish_reason.is_some() {
                self.live.remove(&u.id);
            } else if gone {
                // The client went away: free its blocks now rather than at the next token.
                self.scheduler.abort(u.id);
                self.live.remove(&u.id);
            }
        }
    }

    fn publish_stats(&self) {
        let s = self.scheduler.stats();
        if let Ok(mut g) = self.shared.stats.lock() {
            *g = s;
        }
    }

    fn fail_all(&mut self, err: EngineError) {
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
    }
}

fn submit_to_engine_error(e: SubmitError) -> EngineError {
    EngineError::Unschedulable(e.to_string())
}

/// A seed for requests that did not give one: process-random, never repeated in practice.
fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}
