//! [`SyntheticEngine`]: an [`EngineClient`] with no model that produces tokens as fast as a
//! fast GPU would, for measuring everything around the engine (the host path: detokenization,
//! stop strings, JSON/SSE encoding, channels, tasks, sockets) on a machine without one.
//!
//! It runs on its own thread like the real engine and talks to the async world the same way:
//! a command channel in, one unbounded output channel per request out, one send per running
//! request per step (as `engine_loop`'s `finish` does). Each step gives every running request
//! (up to `max_num_seqs`, first come first served) one token and then sleeps until the step's
//! deadline, so the engine's nominal rate is `max_num_seqs / step_time`; what a server built
//! on it delivers is bounded only by how fast the host path drains and refills the batch.
//! Prefill is free: a request admitted before a step gets its first token in that step.
//!
//! Tokens are drawn in order from a caller-given pool (e.g. a real text tokenized with the
//! served model's tokenizer, so detokenization costs what it costs), each request starting
//! at its own offset. Finishing follows the real engine's rules for what the pool can
//! produce: `max_tokens` (→ `length`), EOS unless `ignore_eos` and `stop_token_ids`
//! (→ `stop`, after `min_tokens`). No logprobs (a request asking for them, or for prompt logprobs, is refused).
//!
//! Invariants: every accepted request ends with exactly one final output (or an error on
//! shutdown); a request whose receiver is gone is dropped at its next send; the engine
//! thread never blocks on a client.

use baton_core::api::{
    AbortSink, EngineClient, EngineError, EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason,
    OutputStream, RequestId, SubmitError,
};
use baton_core::params::ParamError;
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

/// How a [`SyntheticEngine`] behaves.
#[derive(Debug, Clone)]
pub struct SyntheticConfig {
    /// Wall time of one step (every running request gets one token per step).
    pub step_time: Duration,
    /// Most requests in one step; the rest wait.
    pub max_num_seqs: usize,
    /// Output token ids, used in order (cyclically) from a per-request offset. Non-empty.
    pub tokens: Arc<[u32]>,
    /// What the engine reports about itself (vocabulary, context, EOS ids, device).
    pub info: EngineInfo,
}

/// Why a [`SyntheticEngine`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum SyntheticStartError {
    /// The configuration cannot work.
    #[error("invalid synthetic engine configuration: {0}")]
    Config(String),
    /// The OS refused a thread.
    #[error("could not start the synthetic engine thread: {0}")]
    Thread(String),
}

/// What the engine thread did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyntheticCounters {
    /// Steps run that produced at least one token.
    pub steps: u64,
    /// Tokens produced (sent to a live receiver or not).
    pub tokens: u64,
    /// Steps that started later than their deadline by more than a quarter step (the engine
    /// thread did not get the CPU in time; on a loaded machine this lowers the engine's rate).
    pub late_steps: u64,
    /// Sum over steps of the running batch size (divide by `steps` for the mean occupancy).
    pub batch_sum: u64,
}

type OutputTx = UnboundedSender<Result<EngineOutput, EngineError>>;

enum Command {
    Submit { id: RequestId, request: Box<EngineRequest>, tx: OutputTx },
    Abort(RequestId),
    Shutdown,
}

struct Shared {
    stats: Mutex<EngineStats>,
    counters: Mutex<SyntheticCounters>,
    healthy: AtomicBool,
}

struct Inner {
    tx: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    info: EngineInfo,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Inner {
    fn send(&self, cmd: Command) -> bool {
        self.tx.lock().map(|tx| tx.send(cmd).is_ok()).unwrap_or(false)
    }
}

impl AbortSink for Inner {
    fn abort(&self, id: RequestId) {
        self.send(Command::Abort(id));
    }
}

/// A cloneable handle on a running synthetic engine (see the module docs).
#[derive(Clone)]
pub struct SyntheticEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SyntheticEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyntheticEngine").field("info", &self.inner.info).finish_non_exhaustive()
    }
}

impl SyntheticEngine {
    /// Starts the engine thread.
    pub fn start(config: SyntheticConfig) -> Result<Self, SyntheticStartError> {
        if config.tokens.is_empty() {
            return Err(SyntheticStartError::Config("the token pool is empty".into()));
        }
        if config.max_num_seqs == 0 {
            return Err(SyntheticStartError::Config("max_num_seqs must be at least 1".into()));
        }
        if let Some(bad) = config.tokens.iter().find(|&&t| t as usize >= config.info.vocab_size) {
            return Err(SyntheticStartError::Config(format!(
                "pool token {bad} is outside the vocabulary (size {})",
                config.info.vocab_size
            )));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats { num_total_blocks: config.info.num_blocks, ..EngineStats::default() }),
            counters: Mutex::default(),
            healthy: AtomicBool::new(true),
        });
        let info = config.info.clone();
        let looper = Loop::new(config, rx, shared.clone());
        let thread = std::thread::Builder::new()
            .name("synthetic-engine".into())
            .spawn(move || looper.run())
            .map_err(|e| SyntheticStartError::Thread(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                tx: Mutex::new(tx),
                shared,
                info,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// What the engine thread did so far.
    pub fn counters(&self) -> SyntheticCounters {
        self.inner.shared.counters.lock().map(|c| *c).unwrap_or_default()
    }

    /// Stops the engine thread (in-flight requests get [`EngineError::Shutdown`]) and waits.
    pub fn shutdown(&self) {
        self.inner.send(Command::Shutdown);
        let thread = self.inner.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl EngineClient for SyntheticEngine {
    fn submit(&self, request: EngineRequest) -> Result<OutputStream, SubmitError> {
        if !self.is_healthy() {
            return Err(SubmitError::Unavailable("the synthetic engine has stopped".into()));
        }
        if request.params.n != 1 {
            return Err(ParamError::new("n", "engine requests carry one sequence (the frontend fans out)").into());
        }
        if request.params.logprobs.is_some() {
            return Err(ParamError::new("logprobs", "the synthetic engine does not produce logprobs").into());
        }
        if request.params.prompt_logprobs.is_some() {
            return Err(ParamError::new("prompt_logprobs", "the synthetic engine does not produce logprobs").into());
        }
        request.check(&self.inner.info)?;
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = unbounded_channel();
        if !self.inner.send(Command::Submit { id, request: Box::new(request), tx }) {
            return Err(SubmitError::Unavailable("the synthetic engine thread has stopped".into()));
        }
        Ok(OutputStream::new(id, rx, self.inner.clone()))
    }

    fn abort(&self, id: RequestId) {
        self.inner.abort(id);
    }

    fn info(&self) -> EngineInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn is_healthy(&self) -> bool {
        self.inner.shared.healthy.load(Ordering::SeqCst)
    }
}

/// One request on the engine thread.
struct Running {
    id: RequestId,
    tx: OutputTx,
    next: usize,
    generated: usize,
    max_tokens: usize,
    min_tokens: usize,
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
    prompt_tokens: usize,
}

struct Loop {
    config: SyntheticConfig,
    rx: Receiver<Command>,
    shared: Arc<Shared>,
    waiting: VecDeque<Running>,
    running: Vec<Running>,
    aborted: HashSet<RequestId>,
    counters: SyntheticCounters,
}

impl Loop {
    fn new(config: SyntheticConfig, rx: Receiver<Command>, shared: Arc<Shared>) -> Self {
        Self {
            config,
            rx,
            shared,
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborted: HashSet::new(),
            counters: SyntheticCounters::default(),
        }
    }

    fn run(mut self) {
        let step = self.config.step_time;
        let mut deadline = Instant::now();
        loop {
            // Idle: block for work, and restart the step clock when it comes.
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(cmd) => {
                        if !self.apply(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
                deadline = Instant::now();
            }
            // Commands that arrived before the deadline join this step; wait for them.
            let mut open = true;
            loop {
                let now = Instant::now();
                let cmd = if now >= deadline {
                    match self.rx.try_recv() {
                        Ok(cmd) => Some(cmd),
                        Err(std::sync::mpsc::TryRecvError::Empty) => None,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                } else {
                    match self.rx.recv_timeout(deadline - now) {
                        Ok(cmd) => Some(cmd),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                };
                match cmd {
                    Some(cmd) => {
                        if !self.apply(cmd) {
                            open = false;
                            break;
                        }
                    }
                    None => break,
                }
            }
            if !open {
                break;
            }
            let started = Instant::now();
            if started.saturating_duration_since(deadline) > step / 4 {
                self.counters.late_steps += 1;
            }
            self.step();
            // The next step is due one step time after this one was; a late step does not
            // make the following ones early.
            deadline = (deadline + step).max(started);
        }
        self.shared.healthy.store(false, Ordering::SeqCst);
        for r in self.running.drain(..).chain(self.waiting.drain(..)) {
            let _ = r.tx.send(Err(EngineError::Shutdown));
        }
        self.publish();
    }

    /// False on shutdown.
    fn apply(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { id, request, tx } => {
                let p = &request.params;
                let pool = self.config.tokens.len();
                // Spread requests over the pool so concurrent streams show different text.
                let next = (id.0 as usize).wrapping_mul(7919) % pool;
                self.waiting.push_back(Running {
                    id,
                    tx,
                    next,
                    generated: 0,
                    max_tokens: p.max_tokens.unwrap_or(1).max(1),
                    min_tokens: p.min_tokens,
                    ignore_eos: p.ignore_eos,
                    stop_token_ids: p.stop_token_ids.clone(),
                    prompt_tokens: request.prompt_token_ids.len(),
                });
                true
            }
            Command::Abort(id) => {
                self.aborted.insert(id);
                true
            }
            Command::Shutdown => false,
        }
    }

    fn step(&mut self) {
        if !self.aborted.is_empty() {
            let aborted = std::mem::take(&mut self.aborted);
            let abort_output = |r: &Running| EngineOutput {
                new_token_ids: Vec::new(),
                logprobs: Vec::new(),
                finish_reason: Some(FinishReason::Abort),
                stop_token: None,
                num_prompt_tokens: r.prompt_tokens,
                num_cached_tokens: 0,
                prompt_logprobs: Vec::new(),
            };
            for r in self.running.iter().chain(self.waiting.iter()).filter(|r| aborted.contains(&r.id)) {
                let _ = r.tx.send(Ok(abort_output(r)));
            }
            self.running.retain(|r| !aborted.contains(&r.id));
            self.waiting.retain(|r| !aborted.contains(&r.id));
        }
        while self.running.len() < self.config.max_num_seqs {
            match self.waiting.pop_front() {
                Some(r) => self.running.push(r),
                None => break,
            }
        }
        if self.running.is_empty() {
            self.publish();
            return;
        }
        self.counters.steps += 1;
        self.counters.batch_sum += self.running.len() as u64;
        let pool = &self.config.tokens;
        let eos = &self.config.info.eos_token_ids;
        let mut outputs = Vec::with_capacity(self.running.len());
        for r in &mut self.running {
            let token = pool[r.next % pool.len()];
            r.next += 1;
            r.generated += 1;
            let may_stop = r.generated > r.min_tokens;
            let stop_token = ((!r.ignore_eos && eos.contains(&token)) || r.stop_token_ids.contains(&token))
                .then_some(token)
                .filter(|_| may_stop);
            let finish_reason = if stop_token.is_some() {
                Some(FinishReason::Stop)
            } else if r.generated >= r.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            outputs.push(EngineOutput {
                new_token_ids: vec![token],
                logprobs: Vec::new(),
                finish_reason,
                stop_token,
                num_prompt_tokens: r.prompt_tokens,
                num_cached_tokens: 0,
                prompt_logprobs: Vec::new(),
            });
        }
        // The step's counters and the requests it leaves running are published before its
        // outputs go out, so that a caller that has read a step's outputs sees it counted (a
        // receiver found gone while sending is accounted for by the publish after).
        self.counters.tokens += outputs.len() as u64;
        self.publish_running(outputs.iter().filter(|o| o.finish_reason.is_none()).count());
        let mut outputs = outputs.into_iter();
        // `retain` visits the requests in order, the order the outputs were made in.
        self.running.retain(|r| {
            let Some(output) = outputs.next() else { return true };
            let finished = output.finish_reason.is_some();
            let gone = r.tx.send(Ok(output)).is_err();
            !finished && !gone
        });
        self.publish();
    }

    fn publish(&self) {
        self.publish_running(self.running.len());
    }

    /// Publishes the counters and stats, with `num_running` requests running.
    fn publish_running(&self, num_running: usize) {
        if let Ok(mut s) = self.shared.stats.lock() {
            s.num_running = num_running;
            s.num_waiting = self.waiting.len();
        }
        if let Ok(mut c) = self.shared.counters.lock() {
            *c = self.counters;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::params::SamplingParams;

    fn info() -> EngineInfo {
        EngineInfo {
            max_model_len: 512,
            vocab_size: 100,
            block_size: 16,
            num_blocks: 64,
            eos_token_ids: vec![2],
            device: "synthetic".into(),
        }
    }

    fn engine(step_ms: u64, max_num_seqs: usize, tokens: &[u32]) -> SyntheticEngine {
        SyntheticEngine::start(SyntheticConfig {
            step_time: Duration::from_millis(step_ms),
            max_num_seqs,
            tokens: tokens.into(),
            info: info(),
        })
        .expect("starts")
    }

    fn request(max_tokens: usize, ignore_eos: bool) -> EngineRequest {
        let params = SamplingParams { max_tokens: Some(max_tokens), ignore_eos, ..SamplingParams::default() };
        EngineRequest::new(vec![5, 6, 7], params)
    }

    fn drain(mut out: OutputStream) -> (Vec<u32>, Vec<EngineOutput>) {
        let mut tokens = Vec::new();
        let mut outputs = Vec::new();
        while let Some(item) = out.blocking_next() {
            let o = item.expect("no error");
            tokens.extend(&o.new_token_ids);
            outputs.push(o);
        }
        (tokens, outputs)
    }

    #[test]
    fn produces_max_tokens_from_the_pool_one_per_step() {
        let e = engine(1, 4, &[10, 11, 12, 13, 14]);
        let (tokens, outputs) = drain(e.submit(request(12, true)).expect("accepted"));
        assert_eq!(tokens.len(), 12);
        assert!(outputs.iter().all(|o| o.new_token_ids.len() == 1 && o.num_prompt_tokens == 3));
        // Consecutive pool entries, cyclically.
        for w in tokens.windows(2) {
            assert_eq!(w[1], 10 + (w[0] - 10 + 1) % 5, "{tokens:?}");
        }
        let last = outputs.last().expect("outputs");
        assert_eq!(last.finish_reason, Some(FinishReason::Length));
        assert!(outputs[..outputs.len() - 1].iter().all(|o| o.finish_reason.is_none()));
        assert_eq!(e.counters().tokens, 12);
        e.shutdown();
    }

    #[test]
    fn eos_stops_unless_ignored_and_min_tokens_holds_it_off() {
        let e = engine(1, 4, &[2, 10]);
        let (tokens, outputs) = drain(e.submit(request(9, false)).expect("accepted"));
        assert_eq!(*tokens.last().expect("a token"), 2);
        assert!(tokens.len() <= 2, "{tokens:?}");
        let last = outputs.last().expect("outputs");
        assert_eq!((last.finish_reason, last.stop_token), (Some(FinishReason::Stop), Some(2)));

        let mut r = request(9, false);
        r.params.min_tokens = 4;
        let (tokens, _) = drain(e.submit(r).expect("accepted"));
        assert!(tokens.len() > 4 && tokens.len() <= 6, "{tokens:?}");

        let (tokens, _) = drain(e.submit(request(9, true)).expect("accepted"));
        assert_eq!(tokens.len(), 9);
        e.shutdown();
    }

    #[test]
    fn batch_is_capped_and_the_rate_follows_the_step_time() {
        // 6 requests of 20 tokens over 3 slots: two waves of 20 steps of 5 ms.
        let e = engine(5, 3, &[10, 11, 12]);
        let t0 = Instant::now();
        let streams: Vec<_> = (0..6).map(|_| e.submit(request(20, true)).expect("accepted")).collect();
        let total: usize = streams.into_iter().map(|s| drain(s).0.len()).sum();
        let elapsed = t0.elapsed();
        assert_eq!(total, 120);
        let c = e.counters();
        assert_eq!(c.tokens, 120);
        assert!(c.steps >= 40, "{c:?}");
        assert!(c.batch_sum <= c.steps * 3, "{c:?}");
        assert!(elapsed >= Duration::from_millis(39 * 5), "{elapsed:?}");
        e.shutdown();
    }

    #[test]
    fn dropping_the_stream_aborts_and_frees_the_slot() {
        let e = engine(2, 1, &[10, 11]);
        let mut first = e.submit(request(400, true)).expect("accepted");
        assert!(first.blocking_next().is_some());
        drop(first);
        // The single slot frees up, so a second request completes.
        let (tokens, _) = drain(e.submit(request(3, true)).expect("accepted"));
        assert_eq!(tokens.len(), 3);
        assert_eq!(e.stats().num_running, 0);
        e.shutdown();
    }

    #[test]
    fn refuses_what_it_cannot_do_and_stops_cleanly() {
        let e = engine(1, 2, &[10]);
        let mut r = request(4, true);
        r.params.logprobs = Some(1);
        assert!(matches!(e.submit(r), Err(SubmitError::InvalidParams(_))));
        assert!(matches!(e.submit(request(1000, true)), Err(SubmitError::ContextTooLong { .. })));
        let mut long = e.submit(request(400, true)).expect("accepted");
        assert!(long.blocking_next().is_some());
        e.shutdown();
        let rest: Vec<_> = std::iter::from_fn(|| long.blocking_next()).collect();
        assert!(matches!(rest.last(), Some(Err(EngineError::Shutdown))), "{rest:?}");
        assert!(!e.is_healthy());
        assert!(matches!(e.submit(request(4, true)), Err(SubmitError::Unavailable(_))));

        let bad = SyntheticEngine::start(SyntheticConfig {
            step_time: Duration::from_millis(1),
            max_num_seqs: 1,
            tokens: vec![100].into(),
            info: info(),
        });
        assert!(matches!(bad, Err(SyntheticStartError::Config(_))));
    }
}
