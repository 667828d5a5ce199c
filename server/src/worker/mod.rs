//! `baton worker`: one engine serving a router's prefill, decode or unified pool.
//!
//! A worker runs its engine, the Worker gRPC service ([`service`]), a TCP KV listener when
//! it decodes (hand-offs land there), and a small HTTP server with `/health` and `/metrics`
//! (vLLM names, plus `baton_kv_transfer_*`). It registers with the router and heartbeats
//! ([`reporter`]); when the router forgets it (ejected, restarted) it registers again.
//!
//! Security: with a cluster secret every Worker call must be signed (else `UNAUTHENTICATED`,
//! before any handler runs), the KV listener admits only senders that prove the secret,
//! and the registry calls are signed as this worker's instance; with `--tls-*` the Worker
//! service and the registry calls use mutual TLS ([`crate::settings::security`]).
//!
//! Invariant: a KV hand-off is admitted only for a reservation this worker is still
//! expecting (registered by `Decode`, forgotten on completion, recompute, deadline or
//! cancellation), named by its random 128-bit token, and only from the prefill worker
//! instance the reservation is bound to; so a late, stray or forged transfer can never
//! write into blocks that now belong to another request, nor seed the prefix cache with
//! KV of someone else's choosing.

mod reporter;
mod service;
mod slots;

use crate::settings::worker::{Chaos, KvTransportKind, WorkerSettings};
use anyhow::{Context, bail};
use baton_core::api::{EngineClient, RequestId};
use baton_core::cluster_auth::ReservationToken;
use baton_engine::kv_transport::KvCredentials;
use baton_engine::kv_transport::handoff::{ImportError, Received};
use baton_engine::kv_transport::intake::{ImportIntake, IntakeLimits};
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{DeviceSpec, EngineHandle};
use baton_formats::LoadFormat;
use baton_metrics::Metrics;
use baton_proto::Role;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// The exit status of a chaos exit, so a test can tell it from a crash.
pub const CHAOS_EXIT_CODE: i32 = 101;

/// State shared by the worker's services.
pub struct WorkerState {
    /// The engine.
    pub engine: EngineHandle,
    /// This worker's role.
    pub role: Role,
    /// Where peers send KV (`host:port`), empty when it does not decode.
    pub kv_addr: String,
    /// Request metrics of this worker (engine load, KV transfers).
    pub metrics: Metrics,
    /// Reservations waiting for their KV, by token.
    expected: Mutex<HashMap<ReservationToken, Expected>>,
    /// Fault injection.
    pub chaos: Chaos,
    /// Tokens streamed so far (for `Chaos::exit_after_tokens`).
    tokens_streamed: std::sync::atomic::AtomicUsize,
    /// NCCL links: to decode workers by their KV address (prefill side), from prefill
    /// workers by link name (decode side).
    pub links: Arc<baton_engine::kv_connector::Links>,
    /// How this worker sends KV.
    pub kv_transport: KvTransportKind,
    /// Random per process, names this worker's NCCL links.
    pub instance: String,
    /// Serializes NCCL link setups (see `service::ensure_link`).
    pub link_setup: tokio::sync::Mutex<()>,
    /// What this worker proves and claims when it sends KV.
    pub kv_credentials: KvCredentials,
    /// Worker-service streams open, capped by `--max-inflight`.
    pub streams: slots::StreamSlots,
}

/// A reservation waiting for its KV.
#[derive(Debug, Clone)]
struct Expected {
    /// The engine request holding the blocks.
    id: RequestId,
    /// Past this, its KV is no longer admitted.
    deadline: Instant,
    /// The only prefill worker instance that may send it.
    prefill: String,
}

impl WorkerState {
    /// Admits hand-offs for `token` (engine request `id`) from the prefill worker instance
    /// `prefill` until it is forgotten or `deadline` passes.
    pub fn expect_reservation(&self, token: ReservationToken, id: RequestId, deadline: Instant, prefill: String) {
        if let Ok(mut e) = self.expected.lock() {
            e.insert(token, Expected { id, deadline, prefill });
        }
    }

    /// Stops admitting hand-offs for `token`; the engine request if it was still expected.
    pub fn forget_reservation(&self, token: &ReservationToken) -> Option<RequestId> {
        self.expected.lock().ok().and_then(|mut e| e.remove(token)).map(|e| e.id)
    }

    /// Binds a waiting reservation to another prefill worker; false if it is not waiting.
    pub fn rebind_reservation(&self, token: &ReservationToken, prefill: String) -> bool {
        let Ok(mut e) = self.expected.lock() else { return false };
        match e.get_mut(token) {
            Some(x) => {
                x.prefill = prefill;
                true
            }
            None => false,
        }
    }

    /// Counts streamed tokens; exits the process when the chaos limit is reached.
    pub fn count_tokens(&self, n: usize) {
        let total = self.tokens_streamed.fetch_add(n, std::sync::atomic::Ordering::SeqCst) + n;
        if self.chaos.exit_after_tokens.is_some_and(|limit| total >= limit) {
            tracing::error!(total, "chaos: exiting after streaming tokens");
            std::process::exit(CHAOS_EXIT_CODE);
        }
    }

    /// The engine request a hand-off of `token` from `sender` fills, or why it is refused
    /// (the same answer for an unknown token and another sender's, so it reveals nothing).
    fn admit(&self, token: &ReservationToken, sender: &str) -> Result<RequestId, String> {
        let e = self.expected.lock().map_err(|_| "the reservation table is poisoned".to_owned())?;
        match e.get(token) {
            Some(x) if Instant::now() < x.deadline && x.prefill == sender => Ok(x.id),
            _ => Err(format!("reservation {token} is not waiting for KV from {sender} on this worker")),
        }
    }
}

/// Accepts hand-offs forever, a bounded number at once (see [`ImportIntake`]); each is
/// received on its own task.
/// Fails every KV link whose operations are past their deadline, off the engine thread (which
/// may be the one stuck behind a dead peer's transfer); see `baton_engine::kv_connector::link`.
async fn link_watchdog(links: Arc<baton_engine::kv_connector::Links>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let failed = links.enforce_deadlines(Instant::now());
        if failed > 0 {
            tracing::warn!(failed, "KV links past their deadline were aborted");
        }
    }
}

async fn run_kv_listener(listener: TcpKvListener, state: Arc<WorkerState>, deadline: Duration) {
    let intake = ImportIntake::new(state.engine.clone(), state.links.clone(), deadline, IntakeLimits::default());
    let admit = {
        let state = state.clone();
        move |token: &ReservationToken, sender: &str| state.admit(token, sender)
    };
    let on_result = move |result: Result<Received, ImportError>| match result {
        Ok(Received::Import { id, reservation, report }) => {
            state.forget_reservation(&reservation);
            state.metrics.observe_kv_transfer(report.bytes, report.elapsed);
            tracing::debug!(request = %id, bytes = report.bytes, elapsed = ?report.elapsed, "KV received");
        }
        Ok(Received::Link { name }) => tracing::info!(link = %name, "NCCL link offered by a prefill worker"),
        // The router decides between a retry on another prefill worker and a recompute
        // here; the reservation's deadline covers a router that is gone.
        Err(e) => tracing::warn!(request = ?e.request, error = %e, "KV hand-off failed"),
    };
    intake.serve(listener, admit, on_result).await;
}

/// Runs a worker until SIGINT/SIGTERM; `started` is when the process started (the start-up
/// log's total is measured from it).
pub async fn run(settings: WorkerSettings, started: Instant) -> anyhow::Result<()> {
    let s = &settings.serve;
    if s.model_is_default && !s.model.exists() {
        bail!("the default model was not found; run scripts/fetch-default-model.sh or pass --model");
    }
    if s.api_key.is_some() {
        // The flag comes with the serve flags a worker shares; a worker has no public API, so
        // the key protects nothing here. Said aloud rather than dropped: the internal plane is
        // protected by the cluster secret (and TLS), not by an API key.
        tracing::warn!(
            "--api-key (BATON_API_KEY) has no effect on a worker: it serves no public API; \
             the router takes the key, and --cluster-secret-file protects the worker"
        );
    }
    let instance = reporter::instance_id();
    // Checked before the model loads: a refused configuration fails at once.
    let security =
        crate::settings::security::load(&settings.security, &instance, &s.host, "the worker service and KV listener")?;
    let load_format: LoadFormat = s.load_format.parse().context("invalid --load-format")?;
    let device: DeviceSpec = s.device.parse().context("invalid --device")?;
    let model = crate::model::load_model(&s.model, load_format).await?;
    let mut config = s.engine_config();
    // The fingerprint of the model as served: LongRoPE's factor list depends on the context,
    // and `--quantization fp8` changes the weights.
    let served_len = config.max_model_len.unwrap_or(model.config.max_position_embeddings);
    let fingerprint = crate::model::served_fingerprint(&model.config, served_len, config.quantization);
    config.record_cache_events = settings.role.prefills();
    config.kv_transfer_timeout = settings.kv_transfer_timeout;
    let engine = tokio::task::spawn_blocking(move || baton_engine::start_engine(&model, device, config))
        .await
        .context("engine start panicked")?
        .context("cannot start the engine")?;
    let info = engine.info();

    let http_listener = TcpListener::bind((s.host.as_str(), s.port))
        .await
        .with_context(|| format!("cannot bind HTTP to {}:{}", s.host, s.port))?;
    let grpc_listener = TcpListener::bind((s.host.as_str(), s.grpc_port))
        .await
        .with_context(|| format!("cannot bind gRPC to {}:{}", s.host, s.grpc_port))?;
    let advertise = settings.advertise_host.clone().unwrap_or_else(|| s.host.clone());
    let grpc_addr: SocketAddr = grpc_listener.local_addr()?;
    let http_addr: SocketAddr = http_listener.local_addr()?;
    let (kv_listener, kv_addr) = if settings.role.decodes() {
        let l = TcpKvListener::bind(SocketAddr::new(
            s.host.parse().context("--host must be an IP address")?,
            settings.kv_port,
        ))
        .await
        .context("cannot bind the KV listener")?
        .with_secret(security.secret().cloned());
        let port = l.local_addr()?.port();
        (Some(l), format!("{advertise}:{port}"))
    } else {
        (None, String::new())
    };
    let name = s.served_model_name.clone().unwrap_or_else(|| s.model.display().to_string());
    let state = Arc::new(WorkerState {
        engine: engine.clone(),
        role: settings.role,
        kv_addr: kv_addr.clone(),
        metrics: Metrics::new(&name)?,
        expected: Mutex::new(HashMap::new()),
        chaos: settings.chaos,
        tokens_streamed: Default::default(),
        links: Default::default(),
        kv_transport: settings.kv_transport,
        instance: instance.clone(),
        link_setup: tokio::sync::Mutex::new(()),
        kv_credentials: KvCredentials { secret: security.secret().cloned(), identity: instance.clone() },
        streams: slots::StreamSlots::new(s.max_inflight),
    });
    tracing::info!(
        role = settings.role.as_str(),
        device = %info.device,
        kv_blocks = info.num_blocks,
        grpc = %grpc_addr,
        http = %format!("http://{http_addr}"),
        kv = %kv_addr,
        router = %settings.router,
        "worker ready"
    );

    let app = axum::Router::new()
        .route("/health", axum::routing::get(health))
        .route("/metrics", axum::routing::get(metrics))
        .with_state(state.clone());
    // Logged before the servers run, so the line is in the log before the first /health 200.
    baton_engine::log_phase("total", started);
    let http = tokio::spawn(async move { axum::serve(crate::listeners::http(http_listener), app).await });
    let grpc = tokio::spawn(
        crate::listeners::with_keepalive(security.server().context("invalid --tls-cert/--tls-key/--tls-ca")?)
            .add_service(security.guard(service::WorkerService::new(state.clone()).into_server()))
            .serve_with_incoming(crate::listeners::grpc(grpc_listener)),
    );
    if let Some(l) = kv_listener {
        tokio::spawn(run_kv_listener(l, state.clone(), settings.kv_deadline));
    }
    tokio::spawn(link_watchdog(state.links.clone()));
    let registration = reporter::Registration {
        router: settings.router.clone(),
        role: settings.role,
        worker_url: format!("{}://{advertise}:{}", security.scheme(), grpc_addr.port()),
        kv_addr,
        fingerprint,
        security,
    };
    // On its own thread and runtime: request work on this runtime never delays a heartbeat.
    let report = reporter::spawn(registration, state.clone())?;
    tokio::spawn(crate::engine_watch::watch(engine.clone()));
    tokio::select! {
        _ = crate::shutdown::wait_for_termination() => tracing::info!("shutting down"),
        r = http => tracing::error!(result = ?r, "the HTTP server stopped"),
        r = grpc => tracing::error!(result = ?r, "the gRPC server stopped"),
        r = report => tracing::error!(result = ?r, "the reporter stopped"),
    }
    tokio::task::spawn_blocking(move || engine.shutdown()).await.context("engine shutdown panicked")?;
    Ok(())
}

async fn health(axum::extract::State(state): axum::extract::State<Arc<WorkerState>>) -> axum::http::StatusCode {
    if state.engine.is_healthy() { axum::http::StatusCode::OK } else { axum::http::StatusCode::SERVICE_UNAVAILABLE }
}

async fn metrics(axum::extract::State(state): axum::extract::State<Arc<WorkerState>>) -> String {
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    state.metrics.set_process_load(state.streams.open(), tasks);
    state.metrics.render(&state.engine.stats())
}
