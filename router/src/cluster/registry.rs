//! The router's view of its workers: who is registered, in which role, how loaded, and which
//! prompt blocks each holds in its prefix cache.
//!
//! Workers register over the `Registry` gRPC service and then heartbeat. A worker not heard
//! from for `eject_after` is ejected ([`Registry::eject_stale`], run periodically); a
//! heartbeat from an id the registry does not know is answered `known = false`, and the
//! worker registers again, so an ejected or restarted worker rejoins by itself. A new
//! registration from the same worker URL replaces the old entry (a restart).
//!
//! Invariants: each entry's prefix index holds exactly the hashes the worker reported stored
//! and not since evicted (since its registration); in-flight counters are owned by
//! [`InflightGuard`]s, so they return to zero on every path, including a cancelled request.

use super::policy::Candidate;
use super::wire::layout_from_wire;
use baton_core::block_hash::BlockHash;
use baton_core::kv_transfer::KvLayout;
use baton_proto::worker as pb;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes prompts and hands their KV off.
    Prefill,
    /// Receives KV and generates.
    Decode,
    /// Does both (also the target of a recompute or a short prompt).
    Unified,
}

impl Role {
    /// Whether it can compute a prompt for a hand-off.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Unified)
    }

    /// Whether it can generate (and so receive KV or run a whole request).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Unified)
    }

    /// The config/CLI name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Unified => "unified",
        }
    }
}

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
}

/// Static facts of one registered worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    /// Registry id (new on every registration).
    pub id: u64,
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
    next_id: AtomicU64,
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
        Self { settings, workers: RwLock::new(HashMap::new()), next_id: AtomicU64::new(1) }
    }

    /// The settings workers are held to.
    pub fn settings(&self) -> &RegistrySettings {
        &self.settings
    }

    /// Admits a worker (replacing any entry with the same URL) and returns its id.
    pub fn register(&self, req: &pb::RegisterRequest) -> Result<u64, RegisterError> {
        let role = match pb::Role::try_from(req.role) {
            Ok(pb::Role::Prefill) => Role::Prefill,
            Ok(pb::Role::Decode) => Role::Decode,
            Ok(pb::Role::Unified) => Role::Unified,
            _ => return Err(RegisterError::Invalid(format!("unknown role {}", req.role))),
        };
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
        let layout = req
            .layout
            .as_ref()
            .ok_or_else(|| RegisterError::Invalid("no KV layout".into()))
            .and_then(|l| layout_from_wire(l).map_err(|e| RegisterError::Invalid(e.to_string())))?;
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let info = WorkerInfo {
            id,
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
            healthy: true,
            last_seen: Instant::now(),
            cached: HashSet::new(),
            inflight: Arc::default(),
            queued_prefill_tokens: Arc::default(),
        };
        if let Ok(mut w) = self.workers.write() {
            w.retain(|_, e| e.info.url != req.worker_url);
            w.insert(id, entry);
        }
        tracing::info!(worker = id, role = role.as_str(), url = %req.worker_url, device = %req.device, "worker registered");
        Ok(id)
    }

    /// Applies a heartbeat; false when the worker is unknown (it should register again).
    pub fn heartbeat(&self, req: &pb::HeartbeatRequest) -> bool {
        let Ok(mut w) = self.workers.write() else { return false };
        let Some(e) = w.get_mut(&req.worker_id) else { return false };
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
        true
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
        let mut out: Vec<(Candidate, Picked)> = w
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
                (c, p)
            })
            .collect();
        // Stable order (by id) so round-robin and tie-breaks are deterministic.
        out.sort_by_key(|(c, _)| c.id);
        out
    }

    /// Every registered worker, for operators.
    pub fn describe(&self) -> Vec<WorkerStatus> {
        let now = Instant::now();
        let Ok(w) = self.workers.read() else { return Vec::new() };
        let mut out: Vec<WorkerStatus> = w
            .values()
            .map(|e| WorkerStatus {
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
            })
            .collect();
        out.sort_by_key(|s| s.id);
        out
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
}

impl RegistryService {
    /// Serves `registry`.
    pub fn new(registry: Arc<Registry>) -> Self {
        Self { registry }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::registry_server::RegistryServer<Self> {
        pb::registry_server::RegistryServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::registry_server::Registry for RegistryService {
    async fn register(
        &self,
        request: tonic::Request<pb::RegisterRequest>,
    ) -> Result<tonic::Response<pb::RegisterResponse>, tonic::Status> {
        let req = request.into_inner();
        match self.registry.register(&req) {
            Ok(worker_id) => Ok(tonic::Response::new(pb::RegisterResponse {
                worker_id,
                heartbeat_interval_ms: self.registry.settings.heartbeat_interval.as_millis() as u32,
            })),
            Err(e) => {
                tracing::warn!(url = %req.worker_url, error = %e, "worker registration refused");
                Err(tonic::Status::failed_precondition(e.to_string()))
            }
        }
    }

    async fn heartbeat(
        &self,
        request: tonic::Request<pb::HeartbeatRequest>,
    ) -> Result<tonic::Response<pb::HeartbeatResponse>, tonic::Status> {
        let known = self.registry.heartbeat(&request.into_inner());
        Ok(tonic::Response::new(pb::HeartbeatResponse { known }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::wire::layout_to_wire;
    use baton_core::kv_transfer::KvDtype;

    fn settings() -> RegistrySettings {
        RegistrySettings {
            model_fingerprint: "m1".into(),
            max_model_len: 256,
            heartbeat_interval: Duration::from_millis(100),
            eject_after: Duration::from_millis(300),
        }
    }

    fn reg(role: pb::Role, url: &str) -> pb::RegisterRequest {
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
            instance: "i".into(),
            eos_token_ids: vec![],
        }
    }

    #[test]
    fn registration_checks_the_model_the_context_and_the_role() {
        let r = Registry::new(settings());
        assert!(r.register(&reg(pb::Role::Prefill, "http://p")).is_ok());
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.model_fingerprint = "m2".into();
        assert!(matches!(r.register(&bad), Err(RegisterError::ModelMismatch { .. })));
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.max_model_len = 128;
        let err = r.register(&bad).expect_err("too short");
        assert!(err.to_string().contains("--max-model-len 256"), "{err}");
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.role = 42;
        assert!(matches!(r.register(&bad), Err(RegisterError::Invalid(_))));
        let mut bad = reg(pb::Role::Decode, "http://d");
        bad.kv_addr.clear();
        assert!(matches!(r.register(&bad), Err(RegisterError::Invalid(_))));
        assert_eq!(r.counts(), (1, 0, 0));
    }

    #[test]
    fn silent_workers_are_ejected_and_rejoin_by_registering_again() {
        let r = Registry::new(settings());
        let p = r.register(&reg(pb::Role::Prefill, "http://p")).expect("p");
        let d = r.register(&reg(pb::Role::Decode, "http://d")).expect("d");
        let later = Instant::now() + Duration::from_millis(200);
        assert!(r.eject_stale(later).is_empty(), "within the limit");
        let hb = |id| pb::HeartbeatRequest { worker_id: id, load: None, events: vec![], healthy: true };
        std::thread::sleep(Duration::from_millis(50));
        assert!(r.heartbeat(&hb(d)));
        let ejected = r.eject_stale(Instant::now() + Duration::from_millis(280));
        assert_eq!(ejected, vec![p], "only the silent one goes");
        assert!(!r.heartbeat(&hb(p)), "an ejected worker is told it is unknown");
        let p2 = r.register(&reg(pb::Role::Prefill, "http://p")).expect("rejoins");
        assert_ne!(p2, p);
        // A restart at the same URL replaces the old entry instead of duplicating it.
        let d2 = r.register(&reg(pb::Role::Decode, "http://d")).expect("restart");
        assert_eq!(r.counts(), (1, 1, 0));
        assert!(!r.heartbeat(&hb(d)) && r.heartbeat(&hb(d2)));
    }

    #[test]
    fn cache_events_build_the_prefix_index_and_inflight_guards_count() {
        let r = Registry::new(settings());
        let p = r.register(&reg(pb::Role::Prefill, "http://p")).expect("p");
        let ev = |h, stored| pb::CacheEvent { block_hash: h, stored };
        let hb = pb::HeartbeatRequest {
            worker_id: p,
            load: Some(pb::Load { num_running: 2, num_waiting: 1, num_used_blocks: 5, num_total_blocks: 64 }),
            events: vec![ev(1, true), ev(2, true), ev(3, true), ev(2, false), ev(2, true), ev(3, false)],
            healthy: true,
        };
        assert!(r.heartbeat(&hb));
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
}
