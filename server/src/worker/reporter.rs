//! Registration and heartbeats: keeps this worker in the router's pool.
//!
//! Registers (retrying until the router answers), then heartbeats every interval the router
//! asked for with the engine's load and the prefix-cache events since the last beat. A beat
//! answered `known = false` (the router ejected or restarted) or failing repeatedly starts a
//! fresh registration, so a worker rejoins by itself. Cache events of a beat that failed are
//! kept for the next one; on re-registration they are dropped, since the router starts the
//! new entry's prefix index empty.
//!
//! Every registry call is signed as this worker's instance (with a cluster secret) and runs
//! over TLS when configured; every heartbeat presents the session its registration got.
//!
//! The reporter runs on its own thread with its own single-threaded runtime ([`spawn`]), so
//! no amount of request work on the worker's main runtime can delay a heartbeat and get a
//! healthy worker ejected. Its connection to the router pings (HTTP/2 keepalive), so a
//! vanished router is noticed and the registration retried.

use super::WorkerState;
use baton_core::api::EngineClient;
use baton_core::block_manager::CacheEvent;
use baton_proto::Role;
use baton_proto::cluster_auth::{ClusterSecurity, SignedChannel};
use baton_proto::wire::layout_to_wire;
use baton_proto::worker as pb;
use baton_proto::worker::registry_client::RegistryClient;
use std::sync::Arc;
use std::time::Duration;

/// What this worker tells the router about itself.
pub struct Registration {
    /// The router's registry URL.
    pub router: String,
    /// Pool to join.
    pub role: Role,
    /// Where the router reaches the Worker service.
    pub worker_url: String,
    /// Where peers send KV.
    pub kv_addr: String,
    /// The model's identity.
    pub fingerprint: String,
    /// Signs (and encrypts) the registry calls.
    pub security: ClusterSecurity,
}

/// A registration the router accepted.
struct Session {
    client: RegistryClient<SignedChannel>,
    worker_id: u64,
    session: Vec<u8>,
    interval: Duration,
}

const RETRY: Duration = Duration::from_millis(500);
/// Connecting to the router, and its answer to a registration.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 ping interval and timeout on the connection to the router.
const KEEPALIVE: Duration = Duration::from_secs(10);

/// Runs [`run`] on a thread of its own, with a single-threaded runtime of its own. The
/// returned receiver resolves if the reporter ever stops (it should not).
pub fn spawn(reg: Registration, state: Arc<WorkerState>) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("baton-reporter".into()).spawn(move || {
        runtime.block_on(run(reg, state));
        let _ = stopped_tx.send(());
    })?;
    Ok(stopped_rx)
}

async fn register(reg: &Registration, state: &WorkerState, instance: &str) -> Option<Session> {
    let info = state.engine.info();
    let req = pb::RegisterRequest {
        role: reg.role.to_wire() as i32,
        worker_url: reg.worker_url.clone(),
        kv_addr: reg.kv_addr.clone(),
        model_fingerprint: reg.fingerprint.clone(),
        vocab_size: info.vocab_size as u32,
        max_model_len: info.max_model_len as u32,
        num_blocks: info.num_blocks as u32,
        layout: Some(layout_to_wire(&state.engine.kv_layout())),
        device: info.device.clone(),
        instance: instance.to_owned(),
        eos_token_ids: info.eos_token_ids.clone(),
    };
    let endpoint = match reg.security.endpoint(&reg.router) {
        Ok(e) => e
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE)
            .keep_alive_while_idle(true),
        Err(e) => {
            // Permanent until someone changes the configuration.
            tracing::error!(router = %reg.router, error = %e, "cannot use the router address");
            tokio::time::sleep(RETRY * 10).await;
            return None;
        }
    };
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(router = %reg.router, error = %e, "router not reachable yet");
            return None;
        }
    };
    let mut client = RegistryClient::new(reg.security.client(channel));
    match tokio::time::timeout(CONNECT_TIMEOUT, client.register(req))
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!("no answer within {CONNECT_TIMEOUT:?}"))))
    {
        Ok(r) => {
            let r = r.into_inner();
            let interval = Duration::from_millis(u64::from(r.heartbeat_interval_ms.max(10)));
            tracing::info!(router = %reg.router, worker_id = r.worker_id, ?interval, "registered with the router");
            Some(Session { client, worker_id: r.worker_id, session: r.session, interval })
        }
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::FailedPrecondition
                    | tonic::Code::Unauthenticated
                    | tonic::Code::PermissionDenied
                    | tonic::Code::AlreadyExists
            ) =>
        {
            // Permanent until someone changes the configuration: say so loudly, keep trying.
            tracing::error!(router = %reg.router, reason = %s.message(), "the router refused this worker");
            tokio::time::sleep(RETRY * 10).await;
            None
        }
        Err(s) => {
            tracing::warn!(router = %reg.router, error = %s.message(), "registration failed");
            None
        }
    }
}

/// Keeps the worker registered, forever.
pub async fn run(reg: Registration, state: Arc<WorkerState>) {
    let instance = state.instance.clone();
    loop {
        let Some(Session { mut client, worker_id, session, interval }) = register(&reg, &state, &instance).await else {
            tokio::time::sleep(RETRY).await;
            continue;
        };
        // Start the new entry's index from now.
        let _ = state.engine.take_cache_events();
        let mut pending: Vec<pb::CacheEvent> = Vec::new();
        let mut failures = 0;
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            let stats = state.engine.stats();
            pending.extend(state.engine.take_cache_events().into_iter().map(|e| match e {
                CacheEvent::Stored(h) => pb::CacheEvent { block_hash: h.0, stored: true },
                CacheEvent::Evicted(h) => pb::CacheEvent { block_hash: h.0, stored: false },
            }));
            let beat = pb::HeartbeatRequest {
                worker_id,
                load: Some(pb::Load {
                    num_running: stats.num_running as u32,
                    num_waiting: stats.num_waiting as u32,
                    num_used_blocks: stats.num_used_blocks as u32,
                    num_total_blocks: stats.num_total_blocks as u32,
                }),
                events: pending.clone(),
                healthy: state.engine.is_healthy(),
                session: session.clone(),
            };
            match tokio::time::timeout(interval * 2, client.heartbeat(beat)).await {
                Ok(Ok(r)) if r.get_ref().known => {
                    pending.clear();
                    failures = 0;
                    evict_departed(&state, &r.get_ref().live_peers);
                }
                Ok(Ok(_)) => {
                    tracing::warn!("the router no longer knows this worker; registering again");
                    break;
                }
                _ => {
                    failures += 1;
                    if failures >= 3 {
                        tracing::warn!(router = %reg.router, "heartbeats keep failing; registering again");
                        break;
                    }
                }
            }
        }
    }
}

/// Drops the KV links to peers the router no longer lists. An empty list (a router that
/// predates `live_peers`) evicts nothing: a known worker is always listed itself.
fn evict_departed(state: &WorkerState, live_peers: &[String]) {
    if live_peers.is_empty() {
        return;
    }
    let live: std::collections::HashSet<String> = live_peers.iter().cloned().collect();
    let evicted = state.links.retain_peers(&live);
    if evicted > 0 {
        tracing::warn!(evicted, "KV links to workers that left the cluster were aborted");
    }
}

/// Random per process start (a restarted worker is a new instance): 128 random bits in hex.
pub(super) fn instance_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}
