//! The router's view of its workers: who is registered, in which role, how loaded, and which
//! prompt blocks each holds in its prefix cache.
//!
//! Workers register over the `Registry` gRPC service and then heartbeat. A worker not heard
//! from for `eject_after` is ejected ([`Registry::eject_stale`], run periodically); a
//! heartbeat from an id the registry does not know is answered `known = false`, and the
//! worker registers again, so an ejected or restarted worker rejoins by itself.
//!
//! Identity (with a cluster secret, every call is also signed: [`baton_proto::cluster_auth`]):
//! - Worker ids are random 64-bit numbers, and each registration also gets a random
//!   128-bit session; a heartbeat must present the session of the id it names, so knowing
//!   (or guessing) an id from `/workers` is not enough to speak for that worker.
//! - A worker names its instance (random per process; with a secret it must be the identity
//!   its call was signed with). A registration for a URL held by a live entry of another
//!   instance does not evict it: [`Registry::register`] answers
//!   [`RegisterError::UrlInUse`], and the service then asks the URL itself which instance
//!   serves it (`Worker.Identify`). Only when the URL answers with the registering instance
//!   (the old process is gone: a restart) is the old entry replaced
//!   ([`Registry::register_replacing`]). The same instance registering again replaces its
//!   own entry at once.
//!
//! Invariants: each entry's prefix index holds exactly the hashes the worker reported stored
//! and not since evicted (since its registration); in-flight counters are owned by
//! [`InflightGuard`]s, so they return to zero on every path, including a cancelled request;
//! no two entries share a URL or an instance; candidates come in registration order.

use super::policy::Candidate;
use baton_core::block_hash::BlockHash;
use baton_core::kv_transfer::KvLayout;
use baton_proto::Role;
use baton_proto::cluster_auth::{ClusterPeer, ClusterSecurity, RequireClusterAuth};
use baton_proto::wire::layout_from_wire;
use baton_proto::worker as pb;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// A registration the router refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The worker serves a different model.
    #[error("the worker serves model {worker} but this router serves {router}")]
    ModelMismatch {
        /// The router's model fingerprint.
        router: String,
        /// The worker's.
        worker: String,
    },
    /// The worker's context is shorter than the router's.
    #[error(
        "the worker's max_model_len {worker} is below the router's {router}; start it with --max-model-len {router} or more"
    )]
    ContextTooShort {
        /// The router's context length.
        router: usize,
        /// The worker's.
        worker: usize,
    },
    /// The registration is malformed.
    #[error("invalid registration: {0}")]
    Invalid(String),
    /// The signed identity of the call is not the instance the request names.
    #[error("the call was signed as {signed:?} but registers instance {claimed:?}")]
    IdentityMismatch {
        /// The identity the call was signed with.
        signed: String,
        /// The request's `instance`.
        claimed: String,
    },
    /// A live entry of another instance holds the URL.
    #[error("{url} is registered by another live worker instance")]
    UrlInUse {
        /// The URL.
        url: String,
    },
}

/// A successful registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    /// The worker's new (random) id.
    pub worker_id: u64,
    /// What its heartbeats must present.
    pub session: [u8; 16],
}

/// What became of a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    /// Applied.
    Applied,
    /// No such worker (ejected, or never registered): register again.
    Unknown,
    /// The id exists but the session is not its own: refused.
    WrongSession,
}

/// Static facts of one registered worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    /// Registry id (random, new on every registration).
    pub id: u64,
    /// The worker process's instance id (what its signed calls and KV handshakes claim).
    pub instance: String,
    /// Its role.
    pub role: Role,
    /// The Worker gRPC service URL.
    pub url: String,
    /// Its TCP KV listener (`host:port`), empty for prefill-only workers.
    pub kv_addr: String,
    /// Its KV cache layout.
    pub layout: KvLayout,
    /// KV blocks in its pool.
    pub num_blocks: usize,
    /// Its device ("cpu", "cuda:0").
    pub device: String,
}

struct Entry {
    info: WorkerInfo,
    /// Registration order (ids are random; candidates are ordered by this).
    seq: u64,
    session: [u8; 16],
    load: pb::Load,
    healthy: bool,
    last_seen: Instant,
    cached: HashSet<u64>,
    inflight: Arc<AtomicUsize>,
    queued_prefill_tokens: Arc<AtomicUsize>,
}

/// What a registry must agree with.
#[derive(Debug, Clone, PartialEq)]
pub struct RegistrySettings {
    /// The model every worker must serve.
    pub model_fingerprint: String,
    /// The router's context length; workers must hold at least this much.
    pub max_model_len: usize,
    /// How often workers report.
    pub heartbeat_interval: Duration,
    /// Silence after which a worker is ejected.
    pub eject_after: Duration,
}

/// The worker pools.
pub struct Registry {
    settings: RegistrySettings,
    workers: RwLock<HashMap<u64, Entry>>,
    next_seq: AtomicU64,
}

/// A worker chosen for a request, with its router-side load accounting.
#[derive(Debug, Clone)]
pub struct Picked {
    /// Its facts.
    pub info: WorkerInfo,
    inflight: Arc<AtomicUsize>,
    queued_prefill_tokens: Arc<AtomicUsize>,
}

impl Picked {
    /// Counts one request in flight on this worker until the guard drops.
    pub fn track(&self) -> InflightGuard {
        InflightGuard::new(self.inflight.clone(), 1)
    }

    /// Counts `tokens` of queued prefill on this worker until the guard drops.
    pub fn track_prefill(&self, tokens: usize) -> InflightGuard {
        InflightGuard::new(self.queued_prefill_tokens.clone(), tokens)
    }
}

/// Adds to a counter on creation and subtracts on drop.
#[derive(Debug)]
pub struct InflightGuard {
    counter: Arc<AtomicUsize>,
    amount: usize,
}

impl InflightGuard {
    fn new(counter: Arc<AtomicUsize>, amount: usize) -> Self {
        counter.fetch_add(amount, Ordering::SeqCst);
        Self { counter, amount }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.amount, Ordering::SeqCst);
    }
}

/// One row of [`Registry::describe`] (the router's `/workers` endpoint).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WorkerStatus {
    /// Registry id.
    pub id: u64,
    /// "prefill", "decode" or "unified".
    pub role: &'static str,
    /// Worker service URL.
    pub url: String,
    /// KV listener.
    pub kv_addr: String,
    /// Device.
    pub device: String,
    /// Last reported running requests.
    pub running: u32,
    /// Last reported waiting requests.
    pub waiting: u32,
    /// Last reported KV blocks in use.
    pub used_blocks: u32,
    /// KV blocks in its pool.
    pub total_blocks: u32,
    /// Requests the router has in flight there.
    pub inflight: usize,
    /// Prompt blocks in its prefix cache, by its reports.
    pub cached_blocks: usize,
    /// Milliseconds since its last heartbeat.
    pub last_seen_ms: u128,
    /// Whether its engine reports healthy.
    pub healthy: bool,
}

impl Registry {
    /// An empty registry.
    pub fn new(settings: RegistrySettings) -> Self {
        Self { settings, workers: RwLock::new(HashMap::new()), next_seq: AtomicU64::new(0) }
    }

    /// The settings workers are held to.
    pub fn settings(&self) -> &RegistrySettings {
        &self.settings
    }

    /// Admits a worker and returns its id and session. `peer` is the identity its call was
    /// signed with (with a cluster secret). The worker's own earlier entry (same instance)
    /// is replaced; a live entry of another instance at the same URL is not
    /// ([`RegisterError::UrlInUse`]; see [`Registry::register_replacing`]).
    pub fn register(&self, req: &pb::RegisterRequest, peer: Option<&str>) -> Result<Registered, RegisterError> {
        self.admit(req, peer, false)
    }

    /// As [`Registry::register`], but also replaces another instance's entry at the same URL:
    /// only for a registration whose URL was confirmed to be served by the registering
    /// instance (the old process is gone).
    pub fn register_replacing(
        &self,
        req: &pb::RegisterRequest,
        peer: Option<&str>,
    ) -> Result<Registered, RegisterError> {
        self.admit(req, peer, true)
    }

    fn admit(
        &self,
        req: &pb::RegisterRequest,
        peer: Option<&str>,
        replace_url: bool,
    ) -> Result<Registered, RegisterError> {
        let role =
            Role::from_wire(req.role).map_err(|_| RegisterError::Invalid(format!("unknown role {}", req.role)))?;
        if req.model_fingerprint != self.settings.model_fingerprint {
            return Err(RegisterError::ModelMismatch {
                router: self.settings.model_fingerprint.clone(),
                worker: req.model_fingerprint.clone(),
            });
        }
        if (req.max_model_len as usize) < self.settings.max_model_len {
            return Err(RegisterError::ContextTooShort {
                router: self.settings.max_model_len,
                worker: req.max_model_len as usize,
            });
        }
        if req.worker_url.is_empty() || (role.decodes() && req.kv_addr.is_empty()) {
            return Err(RegisterError::Invalid("a worker URL (and, to decode, a KV address) is required".into()));
        }
        if !baton_core::cluster_auth::valid_identity(&req.instance) {
            return Err(RegisterError::Invalid("the instance must be 1 to 64 of [A-Za-z0-9._-]".into()));
        }
        if let Some(signed) = peer
            && signed != req.instance
        {
            return Err(RegisterError::IdentityMismatch { signed: signed.to_owned(), claimed: req.instance.clone() });
        }
        let layout = req
            .layout
            .as_ref()
            .ok_or_else(|| RegisterError::Invalid("no KV layout".into()))
            .and_then(|l| layout_from_wire(l).map_err(|e| RegisterError::Invalid(e.to_string())))?;
        let mut w = self.workers.write().map_err(|_| RegisterError::Invalid("the registry is poisoned".into()))?;
        let taken = w.values().any(|e| e.info.url == req.worker_url && e.info.instance != req.instance);
        if taken && !replace_url {
            return Err(RegisterError::UrlInUse { url: req.worker_url.clone() });
        }
        // Random ids: nothing to learn from one about the others. Zero is never used.
        let id = loop {
            let id: u64 = rand::random();
            if id != 0 && !w.contains_key(&id) {
                break id;
            }
        };
        let session: [u8; 16] = rand::random();
        let info = WorkerInfo {
            id,
            instance: req.instance.clone(),
            role,
            url: req.worker_url.clone(),
            kv_addr: req.kv_addr.clone(),
            layout,
            num_blocks: req.num_blocks as usize,
            device: req.device.clone(),
        };
        let entry = Entry {
            load: pb::Load { num_total_blocks: req.num_blocks, ..Default::default() },
            info,
            seq: self.next_seq.fetch_add(1, Ordering::SeqCst),
            session,
            healthy: true,
            last_seen: Instant::now(),
            cached: HashSet::new(),
            inflight: Arc::default(),
            queued_prefill_tokens: Arc::default(),
        };
        w.retain(|_, e| e.info.url != req.worker_url && e.info.instance != req.instance);
        w.insert(id, entry);
        drop(w);
        tracing::info!(worker = id, role = role.as_str(), url = %req.worker_url, instance = %req.instance, device = %req.device, "worker registered");
        Ok(Registered { worker_id: id, session })
    }

    /// Applies a heartbeat that presents its registration's session.
    pub fn heartbeat(&self, req: &pb::HeartbeatRequest) -> HeartbeatOutcome {
        let Ok(mut w) = self.workers.write() else { return HeartbeatOutcome::Unknown };
        let Some(e) = w.get_mut(&req.worker_id) else { return HeartbeatOutcome::Unknown };
        if !bool::from(subtle::ConstantTimeEq::ct_eq(e.session.as_slice(), req.session.as_slice())) {
            return HeartbeatOutcome::WrongSession;
        }
        e.last_seen = Instant::now();
        e.healthy = req.healthy;
        if let Some(load) = req.load {
            e.load = load;
        }
        for ev in &req.events {
            if ev.stored {
                e.cached.insert(ev.block_hash);
            } else {
                e.cached.remove(&ev.block_hash);
            }
        }
        HeartbeatOutcome::Applied
    }

    /// The instance and the KV address of every registered worker (what a worker's KV links
    /// name their peers by), for heartbeat answers.
    pub fn live_peers(&self) -> Vec<String> {
        let Ok(w) = self.workers.read() else { return Vec::new() };
        let mut peers: Vec<String> = w
            .values()
            .flat_map(|e| [e.info.instance.clone(), e.info.kv_addr.clone()])
            .filter(|p| !p.is_empty())
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Removes workers silent for longer than `eject_after` (as of `now`); returns their ids.
    pub fn eject_stale(&self, now: Instant) -> Vec<u64> {
        let limit = self.settings.eject_after;
        let Ok(mut w) = self.workers.write() else { return Vec::new() };
        let stale: Vec<u64> =
            w.iter().filter(|(_, e)| now.saturating_duration_since(e.last_seen) > limit).map(|(&id, _)| id).collect();
        for id in &stale {
            if let Some(e) = w.remove(id) {
                tracing::warn!(worker = id, url = %e.info.url, silent_for = ?now.saturating_duration_since(e.last_seen), "worker missed its heartbeats; ejected");
            }
        }
        stale
    }

    /// Ejects one worker now (e.g. it refused connections); false if it was not registered.
    pub fn eject(&self, id: u64, reason: &str) -> bool {
        let removed = self.workers.write().ok().and_then(|mut w| w.remove(&id));
        if let Some(e) = &removed {
            tracing::warn!(worker = id, url = %e.info.url, reason, "worker ejected");
        }
        removed.is_some()
    }

    /// Healthy workers that can take `role`'s part, as policy candidates (with the prompt's
    /// cached-prefix overlap when `hashes` is given) alongside what a request needs to use them.
    pub fn candidates(&self, want: fn(Role) -> bool, hashes: Option<&[BlockHash]>) -> Vec<(Candidate, Picked)> {
        let Ok(w) = self.workers.read() else { return Vec::new() };
        let mut out: Vec<(u64, (Candidate, Picked))> = w
            .values()
            .filter(|e| e.healthy && want(e.info.role))
            .map(|e| {
                let cached_prefix_blocks =
                    hashes.map_or(0, |hs| hs.iter().take_while(|h| e.cached.contains(&h.0)).count());
                let c = Candidate {
                    id: e.info.id,
                    running: e.load.num_running as usize,
                    waiting: e.load.num_waiting as usize,
                    used_blocks: e.load.num_used_blocks as usize,
                    total_blocks: e.load.num_total_blocks as usize,
                    inflight: e.inflight.load(Ordering::SeqCst),
                    queued_prefill_tokens: e.queued_prefill_tokens.load(Ordering::SeqCst),
                    cached_prefix_blocks,
                };
                let p = Picked {
                    info: e.info.clone(),
                    inflight: e.inflight.clone(),
                    queued_prefill_tokens: e.queued_prefill_tokens.clone(),
                };
                (e.seq, (c, p))
            })
            .collect();
        // Registration order (ids are random), so round-robin and tie-breaks are deterministic.
        out.sort_by_key(|(seq, _)| *seq);
        out.into_iter().map(|(_, cp)| cp).collect()
    }

    /// Every registered worker, for operators.
    pub fn describe(&self) -> Vec<WorkerStatus> {
        let now = Instant::now();
        let Ok(w) = self.workers.read() else { return Vec::new() };
        let mut out: Vec<(u64, WorkerStatus)> = w
            .values()
            .map(|e| {
                (
                    e.seq,
                    WorkerStatus {
                        id: e.info.id,
                        role: e.info.role.as_str(),
                        url: e.info.url.clone(),
                        kv_addr: e.info.kv_addr.clone(),
                        device: e.info.device.clone(),
                        running: e.load.num_running,
                        waiting: e.load.num_waiting,
                        used_blocks: e.load.num_used_blocks,
                        total_blocks: e.load.num_total_blocks,
                        inflight: e.inflight.load(Ordering::SeqCst),
                        cached_blocks: e.cached.len(),
                        last_seen_ms: now.saturating_duration_since(e.last_seen).as_millis(),
                        healthy: e.healthy,
                    },
                )
            })
            .collect();
        out.sort_by_key(|(seq, _)| *seq);
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// Registered workers per role (prefill, decode, unified).
    pub fn counts(&self) -> (usize, usize, usize) {
        let Ok(w) = self.workers.read() else { return (0, 0, 0) };
        let n = |r: Role| w.values().filter(|e| e.info.role == r).count();
        (n(Role::Prefill), n(Role::Decode), n(Role::Unified))
    }

    /// Sum of the last reported loads (for the router's own `/metrics`).
    pub fn total_load(&self) -> pb::Load {
        let Ok(w) = self.workers.read() else { return pb::Load::default() };
        w.values().fold(pb::Load::default(), |a, e| pb::Load {
            num_running: a.num_running + e.load.num_running,
            num_waiting: a.num_waiting + e.load.num_waiting,
            num_used_blocks: a.num_used_blocks + e.load.num_used_blocks,
            num_total_blocks: a.num_total_blocks + e.load.num_total_blocks,
        })
    }

    /// Runs [`Registry::eject_stale`] every half heartbeat interval, forever.
    pub async fn run_ejector(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.settings.heartbeat_interval / 2);
        loop {
            tick.tick().await;
            self.eject_stale(Instant::now());
        }
    }
}

/// The `Registry` gRPC service over a [`Registry`].
pub struct RegistryService {
    registry: Arc<Registry>,
    security: ClusterSecurity,
    /// Bound on asking a worker URL who serves it.
    identify_timeout: Duration,
}

impl RegistryService {
    /// Serves `registry`; `security` signs the calls it makes back to workers (and, through
    /// [`RegistryService::into_server`], checks the calls it gets).
    pub fn new(registry: Arc<Registry>, security: ClusterSecurity) -> Self {
        Self { registry, security, identify_timeout: Duration::from_secs(3) }
    }

    /// The tonic server wrapper, refusing calls without the cluster secret (when one is set).
    pub fn into_server(self) -> RequireClusterAuth<pb::registry_server::RegistryServer<Self>> {
        let security = self.security.clone();
        security.guard(pb::registry_server::RegistryServer::new(self))
    }

    /// The instance serving `url` now, by its own answer.
    async fn identify(&self, url: &str) -> Result<String, String> {
        let endpoint = self.security.endpoint(url).map_err(|e| e.to_string())?;
        let call = async {
            let channel = endpoint.connect_timeout(self.identify_timeout).connect().await.map_err(|e| e.to_string())?;
            let mut client = pb::worker_client::WorkerClient::new(self.security.client(channel));
            client.identify(pb::IdentifyRequest {}).await.map(|r| r.into_inner().instance).map_err(|s| s.to_string())
        };
        tokio::time::timeout(self.identify_timeout, call).await.map_err(|_| "no answer".to_owned())?
    }
}

#[tonic::async_trait]
impl pb::registry_server::Registry for RegistryService {
    async fn register(
        &self,
        request: tonic::Request<pb::RegisterRequest>,
    ) -> Result<tonic::Response<pb::RegisterResponse>, tonic::Status> {
        let peer = request.extensions().get::<ClusterPeer>().map(|p| p.0.clone());
        let req = request.into_inner();
        let mut result = self.registry.register(&req, peer.as_deref());
        if let Err(RegisterError::UrlInUse { url }) = &result {
            // Replace the live entry only if the URL itself says the registering instance
            // serves it now (the old process is gone).
            match self.identify(url).await {
                Ok(instance) if instance == req.instance => {
                    tracing::info!(url = %url, instance = %instance, "a new instance serves a registered URL; replacing");
                    result = self.registry.register_replacing(&req, peer.as_deref());
                }
                Ok(other) => {
                    tracing::warn!(url = %url, serving = %other, claimed = %req.instance, "a registration for another live worker's URL")
                }
                Err(e) => tracing::warn!(url = %url, error = %e, "cannot confirm who serves a registered URL"),
            }
        }
        match result {
            Ok(r) => Ok(tonic::Response::new(pb::RegisterResponse {
                worker_id: r.worker_id,
                heartbeat_interval_ms: self.registry.settings.heartbeat_interval.as_millis() as u32,
                session: r.session.to_vec(),
            })),
            Err(e) => {
                tracing::warn!(url = %req.worker_url, error = %e, "worker registration refused");
                Err(match e {
                    RegisterError::UrlInUse { .. } => tonic::Status::already_exists(e.to_string()),
                    RegisterError::IdentityMismatch { .. } => tonic::Status::permission_denied(e.to_string()),
                    _ => tonic::Status::failed_precondition(e.to_string()),
                })
            }
        }
    }

    async fn heartbeat(
        &self,
        request: tonic::Request<pb::HeartbeatRequest>,
    ) -> Result<tonic::Response<pb::HeartbeatResponse>, tonic::Status> {
        let req = request.into_inner();
        match self.registry.heartbeat(&req) {
            HeartbeatOutcome::Applied => {
                Ok(tonic::Response::new(pb::HeartbeatResponse { known: true, live_peers: self.registry.live_peers() }))
            }
            HeartbeatOutcome::Unknown => {
                Ok(tonic::Response::new(pb::HeartbeatResponse { known: false, live_peers: Vec::new() }))
            }
            HeartbeatOutcome::WrongSession => {
                tracing::warn!(worker = req.worker_id, "a heartbeat with a wrong session refused");
                Err(tonic::Status::permission_denied("this heartbeat's session is not the one its worker id was given"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::kv_transfer::KvDtype;
    use baton_proto::wire::layout_to_wire;

    fn settings() -> RegistrySettings {
        RegistrySettings {
            model_fingerprint: "m1".into(),
            max_model_len: 256,
            heartbeat_interval: Duration::from_millis(100),
            eject_after: Duration::from_millis(300),
        }
    }

    fn reg(role: pb::Role, url: &str) -> pb::RegisterRequest {
        reg_as(role, url, &format!("inst-{}", url.trim_start_matches("http://")))
    }

    fn reg_as(role: pb::Role, url: &str, instance: &str) -> pb::RegisterRequest {
        let layout = KvLayout { num_layers: 2, block_size: 16, num_kv_heads: 2, head_dim: 8, dtype: KvDtype::F32 };
        pb::RegisterRequest {
            role: role as i32,
            worker_url: url.into(),
            kv_addr: "127.0.0.1:1".into(),
            model_fingerprint: "m1".into(),
            vocab_size: 100,
            max_model_len: 512,
            num_blocks: 64,
            layout: Some(layout_to_wire(&layout)),
            device: "cpu".into(),
            instance: instance.into(),
            eos_token_ids: vec![],
        }
    }

    impl Registry {
        fn register_ok(&self, req: &pb::RegisterRequest) -> Result<Registered, RegisterError> {
            self.register(req, None)
        }
    }

    fn hb(r: &Registered) -> pb::HeartbeatRequest {
        pb::HeartbeatRequest {
            worker_id: r.worker_id,
            load: None,
            events: vec![],
            healthy: true,
            session: r.session.to_vec(),
        }
    }

    #[test]
    fn registration_checks_the_model_the_context_and_the_role() {
        let r = Registry::new(settings());
        assert!(r.register(&reg(pb::Role::Prefill, "http://p"), None).is_ok());
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.model_fingerprint = "m2".into();
        assert!(matches!(r.register(&bad, None), Err(RegisterError::ModelMismatch { .. })));
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.max_model_len = 128;
        let err = r.register(&bad, None).expect_err("too short");
        assert!(err.to_string().contains("--max-model-len 256"), "{err}");
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.role = 42;
        assert!(matches!(r.register(&bad, None), Err(RegisterError::Invalid(_))));
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.kv_addr.clear();
        assert!(matches!(r.register(&bad, None), Err(RegisterError::Invalid(_))));
        assert_eq!(r.counts(), (1, 0, 0));
    }

    #[test]
    fn heartbeat_answers_list_the_live_peers_and_drop_ejected_ones() {
        let r = Registry::new(settings());
        let p = r.register_ok(&reg(pb::Role::Prefill, "http://p")).expect("p");
        let mut d = reg(pb::Role::Decode, "http://d");
        d.kv_addr = "10.0.0.2:7000".into();
        r.register_ok(&d).expect("d");
        assert_eq!(r.live_peers(), vec!["10.0.0.2:7000", "127.0.0.1:1", "inst-d", "inst-p"]);
        assert!(r.eject(p.worker_id, "test"));
        assert_eq!(r.live_peers(), vec!["10.0.0.2:7000", "inst-d"], "an ejected worker's identities are gone");
    }

    #[test]
    fn silent_workers_are_ejected_and_rejoin_by_registering_again() {
        let r = Registry::new(settings());
        let p = r.register_ok(&reg(pb::Role::Prefill, "http://p")).expect("p");
        let d = r.register_ok(&reg(pb::Role::Decode, "http://d")).expect("d");
        let later = Instant::now() + Duration::from_millis(200);
        assert!(r.eject_stale(later).is_empty(), "within the limit");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(r.heartbeat(&hb(&d)), HeartbeatOutcome::Applied);
        let ejected = r.eject_stale(Instant::now() + Duration::from_millis(280));
        assert_eq!(ejected, vec![p.worker_id], "only the silent one goes");
        assert_eq!(r.heartbeat(&hb(&p)), HeartbeatOutcome::Unknown, "an ejected worker is told it is unknown");
        let p2 = r.register_ok(&reg(pb::Role::Prefill, "http://p")).expect("rejoins");
        assert_ne!(p2.worker_id, p.worker_id);
        // The same instance registering again replaces its entry instead of duplicating it.
        let d2 = r.register_ok(&reg(pb::Role::Decode, "http://d")).expect("again");
        assert_eq!(r.counts(), (1, 1, 0));
        assert_eq!(r.heartbeat(&hb(&d)), HeartbeatOutcome::Unknown);
        assert_eq!(r.heartbeat(&hb(&d2)), HeartbeatOutcome::Applied);
    }

    #[test]
    fn cache_events_build_the_prefix_index_and_inflight_guards_count() {
        let r = Registry::new(settings());
        let p = r.register_ok(&reg(pb::Role::Prefill, "http://p")).expect("p");
        let ev = |h, stored| pb::CacheEvent { block_hash: h, stored };
        let hb = pb::HeartbeatRequest {
            worker_id: p.worker_id,
            session: p.session.to_vec(),
            load: Some(pb::Load { num_running: 2, num_waiting: 1, num_used_blocks: 5, num_total_blocks: 64 }),
            events: vec![ev(1, true), ev(2, true), ev(3, true), ev(2, false), ev(2, true), ev(3, false)],
            healthy: true,
        };
        assert_eq!(r.heartbeat(&hb), HeartbeatOutcome::Applied);
        let hashes = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
        let cands = r.candidates(Role::prefills, Some(&hashes));
        assert_eq!(cands.len(), 1);
        let (c, picked) = &cands[0];
        assert_eq!((c.cached_prefix_blocks, c.running, c.waiting, c.used_blocks), (2, 2, 1, 5));
        {
            let _a = picked.track();
            let _b = picked.track_prefill(100);
            let c = &r.candidates(Role::prefills, None)[0].0;
            assert_eq!((c.inflight, c.queued_prefill_tokens), (1, 100));
        }
        let c = &r.candidates(Role::prefills, None)[0].0;
        assert_eq!((c.inflight, c.queued_prefill_tokens), (0, 0), "guards give their counts back");
        assert!(r.candidates(Role::decodes, None).is_empty());
    }

    #[test]
    fn ids_are_random_and_heartbeats_must_present_their_own_session() {
        let r = Registry::new(settings());
        let a = r.register_ok(&reg(pb::Role::Prefill, "http://a")).expect("a");
        let b = r.register_ok(&reg(pb::Role::Decode, "http://b")).expect("b");
        assert_ne!(a.worker_id, b.worker_id);
        assert!(a.worker_id > 2 || b.worker_id > 2, "ids are not a counter: {} {}", a.worker_id, b.worker_id);
        assert_ne!(a.session, b.session);
        // Naming another worker's id with one's own session, or no session, is refused.
        let spoof = pb::HeartbeatRequest { worker_id: b.worker_id, ..hb(&a) };
        assert_eq!(r.heartbeat(&spoof), HeartbeatOutcome::WrongSession);
        let bare = pb::HeartbeatRequest { session: vec![], ..hb(&b) };
        assert_eq!(r.heartbeat(&bare), HeartbeatOutcome::WrongSession);
        assert_eq!(r.heartbeat(&hb(&b)), HeartbeatOutcome::Applied);
        // Candidates come in registration order whatever the random ids.
        let order: Vec<u64> = r.describe().iter().map(|s| s.id).collect();
        assert_eq!(order, vec![a.worker_id, b.worker_id]);
    }

    #[test]
    fn a_live_worker_is_not_evicted_by_another_instance_claiming_its_url() {
        let r = Registry::new(settings());
        let real = r.register_ok(&reg_as(pb::Role::Decode, "http://d", "real")).expect("real");
        let err = r.register_ok(&reg_as(pb::Role::Decode, "http://d", "intruder")).expect_err("URL in use");
        assert_eq!(err, RegisterError::UrlInUse { url: "http://d".into() });
        assert_eq!(r.heartbeat(&hb(&real)), HeartbeatOutcome::Applied, "the real worker is still registered");
        assert_eq!(r.describe()[0].id, real.worker_id);
        // Once the URL is confirmed to serve the new instance (a restart), it replaces the entry.
        let restarted = r.register_replacing(&reg_as(pb::Role::Decode, "http://d", "intruder"), None).expect("ok");
        assert_eq!(r.counts(), (0, 1, 0));
        assert_eq!(r.heartbeat(&hb(&real)), HeartbeatOutcome::Unknown);
        assert_eq!(r.heartbeat(&hb(&restarted)), HeartbeatOutcome::Applied);
    }

    #[test]
    fn a_signed_registration_must_name_its_signer_as_the_instance() {
        let r = Registry::new(settings());
        let err = r.register(&reg_as(pb::Role::Decode, "http://d", "w1"), Some("w2")).expect_err("mismatch");
        assert!(matches!(err, RegisterError::IdentityMismatch { .. }), "{err}");
        assert!(r.register(&reg_as(pb::Role::Decode, "http://d", "w1"), Some("w1")).is_ok());
        let err = r.register(&reg_as(pb::Role::Prefill, "http://p", "bad:id"), None).expect_err("invalid");
        assert!(matches!(err, RegisterError::Invalid(_)), "{err}");
    }
}
