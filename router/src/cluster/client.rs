//! [`ClusterClient`]: the router's [`EngineClient`] over remote worker pools. The HTTP and
//! gRPC edges talk to it exactly as `baton serve` talks to its in-process engine.
//!
//! Each request is routed when it is submitted (so "no workers" is a clean 503 before any
//! streaming) and then driven by one task ([`super::relay`]). Aborting the request (client
//! gone, `Abort` RPC, shutdown) aborts the task, which drops its worker streams; the workers
//! see the cancellation and free the request's KV blocks.
//!
//! Unseeded requests get a seed here, so the prefill worker, the decode worker and any
//! recompute sample the same tokens, and the router can drop the duplicates a recompute or
//! retry produces by output position.

use super::policy::{PrefillPolicy, RouteRequest, pick_decode};
use super::registry::{Picked, Registry};
use super::relay::{Route, drive};
use baton_core::api::{
    AbortSink, EngineClient, EngineError, EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason,
    OutputStream, RequestId, SubmitError,
};
use baton_core::block_hash::hash_full_blocks;
use baton_proto::Role;
use baton_proto::cluster_auth::{ClusterSecurity, SignedChannel};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// What to do when a prefill worker fails during a hand-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferFailurePolicy {
    /// The decode worker recomputes the prompt itself.
    Recompute,
    /// Another prefill worker computes it again into the same reservation, up to
    /// `max_retries` times; then the decode worker recomputes.
    Retry {
        /// Extra prefill attempts.
        max_retries: usize,
    },
}

/// How the cluster client routes and hands off, and how long it waits for what (see
/// [`super::relay`] for where each deadline applies).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSettings {
    /// Prompts shorter than this many tokens skip the hand-off and run on the decode worker
    /// (conditional disaggregation); 0 disaggregates everything.
    pub disagg_threshold: usize,
    /// See [`TransferFailurePolicy`].
    pub on_transfer_failure: TransferFailurePolicy,
    /// The hand-off's deadline, counted from the moment the prefill worker's engine starts
    /// the prompt (not from its enqueue) and renewed by each progress report after that:
    /// past it, the prefill is cancelled and the decode worker recomputes (or another prefill
    /// worker retries). Also bounds each network wait of the KV transfer itself.
    pub kv_deadline: Duration,
    /// Longest a relayed prompt may wait in its prefill worker's queue before the prefill is
    /// cancelled and the decode worker computes it instead.
    pub prefill_queue_timeout: Duration,
    /// A request with no event from any of its workers for this long fails (never hangs).
    /// Workers report progress while their engine steps, so only a stuck, stopped or
    /// unreachable worker is silent that long.
    pub idle_timeout: Duration,
    /// A worker's answer to a call (a reservation, the start of a stream, a recompute).
    pub rpc_timeout: Duration,
    /// Connecting to a worker.
    pub connect_timeout: Duration,
    /// HTTP/2 pings to each worker this often, even when no call is open, so a stopped or
    /// partitioned worker is noticed without waiting for TCP to give up.
    pub keepalive_interval: Duration,
    /// A ping unanswered for this long closes the connection and fails its calls.
    pub keepalive_timeout: Duration,
    /// Prefill workers required before `/health` reports ready.
    pub min_prefill_workers: usize,
    /// Decode (or unified) workers required before `/health` reports ready.
    pub min_decode_workers: usize,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            disagg_threshold: 0,
            on_transfer_failure: TransferFailurePolicy::Recompute,
            kv_deadline: Duration::from_secs(10),
            prefill_queue_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            rpc_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(10),
            min_prefill_workers: 0,
            min_decode_workers: 1,
        }
    }
}

pub(crate) type OutputTx = UnboundedSender<Result<EngineOutput, EngineError>>;

/// Cancelled streams per worker connection whose late frames are ignored (h2's default is
/// 10; see [`Inner::channel`]).
const REMEMBERED_RESET_STREAMS: usize = 8192;

/// Local error resets (frames for forgotten cancelled streams) a worker connection tolerates
/// over its life before h2 closes it (h2's default is 1,024).
const MAX_LOCAL_ERROR_RESETS: usize = 1 << 20;

/// TCP keepalive on worker connections: the kernel's own check under HTTP/2's pings.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

pub(crate) struct Inner {
    pub registry: Arc<Registry>,
    pub policy: Box<dyn PrefillPolicy>,
    pub settings: ClusterSettings,
    info: EngineInfo,
    security: ClusterSecurity,
    channels: Mutex<HashMap<String, tonic::transport::Channel>>,
    tasks: Mutex<HashMap<RequestId, (tokio::task::AbortHandle, OutputTx)>>,
    next_id: AtomicU64,
    decode_turn: AtomicU64,
}

impl Inner {
    /// A (lazily connecting) channel to a worker's gRPC service, shared by its requests;
    /// every call on it is signed (with a cluster secret) and runs over TLS (when configured).
    pub fn channel(&self, url: &str) -> Result<SignedChannel, String> {
        if let Ok(c) = self.channels.lock()
            && let Some(ch) = c.get(url)
        {
            return Ok(self.security.client(ch.clone()));
        }
        let endpoint = self
            .security
            .endpoint(url)
            .map_err(|e| format!("bad worker URL {url}: {e}"))?
            .connect_timeout(self.settings.connect_timeout)
            .tcp_nodelay(true)
            .tcp_keepalive(Some(TCP_KEEPALIVE))
            .http2_keep_alive_interval(self.settings.keepalive_interval)
            .keep_alive_timeout(self.settings.keepalive_timeout)
            .keep_alive_while_idle(true)
            // Every client disconnect cancels its relay stream (RST_STREAM), and the worker's
            // frames already in flight for it arrive afterwards. HTTP/2 ignores those only
            // for the resets it still remembers (h2 keeps 10 by default); each frame for a
            // forgotten one counts as a local error reset, and at 1,024 of them h2 closes the
            // connection with GOAWAY, failing every stream on it. A soak with ~2,000 client
            // disconnects a minute hit exactly that ("locally-reset streams reached limit").
            // So remember many resets, and keep a cap only as a bound on a broken peer.
            .http2_max_concurrent_reset_streams(REMEMBERED_RESET_STREAMS)
            .http2_max_local_error_reset_streams(MAX_LOCAL_ERROR_RESETS);
        let ch = endpoint.connect_lazy();
        if let Ok(mut c) = self.channels.lock() {
            c.insert(url.to_owned(), ch.clone());
        }
        Ok(self.security.client(ch))
    }

    fn finish_task(&self, id: RequestId) {
        if let Ok(mut t) = self.tasks.lock() {
            t.remove(&id);
        }
    }
}

impl AbortSink for Inner {
    fn abort(&self, id: RequestId) {
        let entry = self.tasks.lock().ok().and_then(|mut t| t.remove(&id));
        if let Some((task, tx)) = entry {
            task.abort();
            let _ = tx.send(Ok(EngineOutput {
                new_token_ids: Vec::new(),
                logprobs: Vec::new(),
                finish_reason: Some(FinishReason::Abort),
                stop_token: None,
                num_prompt_tokens: 0,
                num_cached_tokens: 0,
                prompt_logprobs: Vec::new(),
            }));
        }
    }
}

/// An [`EngineClient`] whose engines are the registered workers.
#[derive(Clone)]
pub struct ClusterClient {
    inner: Arc<Inner>,
}

impl ClusterClient {
    /// A client routing over `registry` with `policy`; `info` describes the served model
    /// (vocabulary, EOS, context length) as the router was configured; `security` signs (and
    /// encrypts) its calls to the workers.
    pub fn new(
        registry: Arc<Registry>,
        policy: Box<dyn PrefillPolicy>,
        settings: ClusterSettings,
        info: EngineInfo,
        security: ClusterSecurity,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                registry,
                policy,
                settings,
                info,
                security,
                channels: Mutex::new(HashMap::new()),
                tasks: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                decode_turn: AtomicU64::new(0),
            }),
        }
    }

    /// The worker registry.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.inner.registry
    }

    /// Requests being driven now.
    pub fn num_active(&self) -> usize {
        self.inner.tasks.lock().map(|t| t.len()).unwrap_or(0)
    }

    /// Picks where `request` runs: a decode worker always; a prefill worker too unless the
    /// prompt is short, it wants prompt logprobs, there is no prefill pool, or the pick is the
    /// decode worker itself.
    fn route(&self, request: &EngineRequest) -> Result<Route, SubmitError> {
        let reg = &self.inner.registry;
        let decoders = reg.candidates(Role::decodes, None);
        let block_size = decoders.first().map_or(16, |(_, p)| p.info.layout.block_size);
        let prompt_tokens = request.prompt_token_ids.len();
        let rr = RouteRequest {
            prompt_tokens,
            total_tokens: prompt_tokens + request.params.max_tokens.unwrap_or(1),
            block_size,
        };
        let cands: Vec<_> = decoders.iter().map(|(c, _)| c.clone()).collect();
        let turn = self.inner.decode_turn.fetch_add(1, Ordering::Relaxed) as usize;
        let decode: Picked = pick_decode(&rr, &cands, turn)
            .and_then(|i| decoders.get(i))
            .map(|(_, p)| p.clone())
            .ok_or_else(|| SubmitError::Unavailable("no decode or unified worker is registered".into()))?;
        // Prompt logprobs come from the prompt's logits, which only the worker computing the
        // prompt sees: such a request runs whole on one worker.
        if prompt_tokens < self.inner.settings.disagg_threshold || request.params.prompt_logprobs.is_some() {
            return Ok(Route::Local(decode));
        }
        let hashes =
            self.inner.policy.uses_prefix_cache().then(|| hash_full_blocks(&request.prompt_token_ids, block_size));
        let prefillers: Vec<_> = reg
            .candidates(Role::prefills, hashes.as_deref())
            .into_iter()
            .filter(|(_, p)| p.info.role == Role::Prefill || p.info.id != decode.info.id)
            .collect();
        let cands: Vec<_> = prefillers.iter().map(|(c, _)| c.clone()).collect();
        match self.inner.policy.pick(&rr, &cands).and_then(|i| prefillers.get(i)) {
            Some((c, p)) => {
                let uncached = prompt_tokens.saturating_sub(c.cached_prefix_blocks * block_size);
                Ok(Route::Relay { prefill: p.clone(), decode, uncached_tokens: uncached })
            }
            None => Ok(Route::Local(decode)),
        }
    }
}

impl EngineClient for ClusterClient {
    fn submit(&self, mut request: EngineRequest) -> Result<OutputStream, SubmitError> {
        request.check(&self.inner.info)?;
        let route = self.route(&request)?;
        if request.params.seed.is_none() {
            request.params.seed = Some(baton_core::api::fresh_seed());
        }
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::SeqCst));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let inner = self.inner.clone();
        let task_tx = tx.clone();
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| SubmitError::Unavailable("the router has no async runtime".into()))?;
        // Hold the task table while spawning so the task cannot finish (and remove itself)
        // before it is registered.
        let mut tasks = self.inner.tasks.lock().map_err(|_| SubmitError::Unavailable("poisoned".into()))?;
        let handle = runtime.spawn(async move {
            if let Err(e) = drive(&inner, route, request, &task_tx).await {
                let _ = task_tx.send(Err(e));
            }
            inner.finish_task(id);
        });
        tasks.insert(id, (handle.abort_handle(), tx));
        drop(tasks);
        let sink: Arc<dyn AbortSink> = self.inner.clone();
        Ok(OutputStream::new(id, rx, sink))
    }

    fn abort(&self, id: RequestId) {
        AbortSink::abort(self.inner.as_ref(), id);
    }

    fn info(&self) -> EngineInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> EngineStats {
        let load = self.inner.registry.total_load();
        EngineStats {
            num_running: load.num_running as usize,
            num_waiting: load.num_waiting as usize,
            num_used_blocks: load.num_used_blocks as usize,
            num_total_blocks: load.num_total_blocks as usize,
            ..EngineStats::default()
        }
    }

    /// Ready when the configured minimum of workers per pool has registered.
    fn is_healthy(&self) -> bool {
        let (p, d, u) = self.inner.registry.counts();
        let s = &self.inner.settings;
        p + u >= s.min_prefill_workers && d + u >= s.min_decode_workers.max(1)
    }
}
