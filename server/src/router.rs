//! `baton router`: the OpenAI HTTP API and the public gRPC API (as `serve`), over pools of
//! `baton worker`s that register on the worker-facing `Registry` gRPC port.
//!
//! The router loads only the model's tokenizer, chat template and config (no weights): it
//! validates, templates and tokenizes, then [`ClusterClient`] routes each request to a
//! prefill/decode pair. `GET /workers` lists the pools for operators (behind `--api-key`).
//!
//! Security: `--api-key` guards the public HTTP and gRPC APIs; the registry and the calls to
//! workers are signed with the cluster secret and optionally run over mutual TLS
//! ([`crate::settings::security`]); binding a non-loopback address without a secret is refused.
//!
//! The registry (workers' registrations and heartbeats) and its ejector run on a thread and
//! runtime of their own ([`spawn_registry`]): however busy the request side is, heartbeats are
//! answered and staleness is judged on time, so a healthy worker is never ejected because the
//! router was slow.

use crate::settings::check_tool_config;
use crate::settings::router::RouterSettings;
use crate::shutdown::{shutdown_signal, wait_for_termination};
use anyhow::{Context, bail};
use baton_core::api::EngineInfo;
use baton_formats::LoadFormat;
use baton_metrics::Metrics;
use baton_proto::ClusterSecurity;
use baton_router::cluster::{ClusterClient, Registry, RegistryService, RegistrySettings, policy_by_name};
use baton_router::{AdmissionLimits, ApiKey, Frontend, GrpcService, HttpConfig, ServedModel, TextCodec, http_router};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Runs the router until a termination signal.
pub async fn run(s: RouterSettings) -> anyhow::Result<()> {
    check_tool_config(&s.tools).map_err(anyhow::Error::msg)?;
    if s.model_is_default && !s.model.exists() {
        bail!("the default model was not found; run scripts/fetch-default-model.sh or pass --model");
    }
    let security = crate::settings::security::load(&s.security, "router", &s.host, "the worker registry")?;
    let format: LoadFormat = s.load_format.parse().context("invalid --load-format")?;
    let path = s.model.clone();
    let model = tokio::task::spawn_blocking(move || baton_formats::load_model_info(&path, format))
        .await
        .context("model loading panicked")?
        .with_context(|| format!("cannot read model {}", s.model.display()))?;
    let tokenizer = model
        .tokenizer
        .clone()
        .with_context(|| format!("model {} has no tokenizer; the router needs one", s.model.display()))?;
    let cfg = &model.config;
    let max_model_len = s.max_model_len.unwrap_or(cfg.max_position_embeddings);
    if max_model_len > cfg.max_position_embeddings {
        bail!("--max-model-len {max_model_len} exceeds the model's context {}", cfg.max_position_embeddings);
    }
    let mut eos = model.generation.eos_token_ids.clone();
    for e in &cfg.eos_token_ids {
        if !eos.contains(e) {
            eos.push(*e);
        }
    }
    let info = EngineInfo {
        max_model_len,
        vocab_size: cfg.vocab_size,
        block_size: 0,
        num_blocks: 0,
        eos_token_ids: eos,
        device: "cluster".into(),
    };
    let registry = Arc::new(Registry::new(RegistrySettings {
        // As served: a worker whose context picks other LongRoPE factors, or whose weights are
        // quantized otherwise, is refused.
        model_fingerprint: crate::model::served_fingerprint(cfg, max_model_len, s.quantization),
        max_model_len,
        heartbeat_interval: s.heartbeat_interval,
        eject_after: s.eject_after,
    }));
    let policy = policy_by_name(&s.policy, s.prefix_load_weight)?;
    tracing::info!(policy = policy.name(), disagg_threshold = s.cluster.disagg_threshold, on_transfer_failure = ?s.cluster.on_transfer_failure, "routing");
    let client = ClusterClient::new(registry.clone(), policy, s.cluster.clone(), info, security.clone());

    let root = s.model.display().to_string();
    let name = s.served_model_name.clone().unwrap_or_else(|| root.clone());
    let metrics = Arc::new(Metrics::new(&name)?);
    let frontend = Frontend::new(
        Arc::new(client.clone()),
        Arc::new(TextCodec::new(tokenizer, model.chat_template.clone())),
        ServedModel { name, root },
        metrics,
    )
    .with_admission(AdmissionLimits { max_inflight: s.max_inflight, ..AdmissionLimits::default() });
    let api_key = ApiKey::from_config(s.api_key.as_deref());
    let workers_registry = registry.clone();
    // Worker addresses are for operators: behind the API key like the rest of the API.
    let workers = baton_router::auth::protect(
        axum::Router::new().route(
            "/workers",
            axum::routing::get(move || {
                let r = workers_registry.clone();
                async move { axum::Json(r.describe()) }
            }),
        ),
        api_key.clone(),
    );
    let app = http_router(
        frontend.clone(),
        HttpConfig { api_key: s.api_key.clone(), max_body_bytes: s.max_body_bytes, tools: s.tools },
    )
    .merge(workers);
    let bind = |port: u16, what: &'static str| {
        let host = s.host.clone();
        async move {
            TcpListener::bind((host.as_str(), port))
                .await
                .with_context(|| format!("cannot bind {what} to {host}:{port}"))
        }
    };
    let http_listener = bind(s.port, "HTTP").await?;
    let grpc_listener = bind(s.grpc_port, "gRPC").await?;
    let registry_listener = bind(s.registry_port, "the worker registry").await?;
    let http_addr: SocketAddr = http_listener.local_addr()?;
    let grpc_addr: SocketAddr = grpc_listener.local_addr()?;
    let registry_addr: SocketAddr = registry_listener.local_addr()?;
    tracing::info!(http = %format!("http://{http_addr}"), grpc = %grpc_addr, registry = %format!("http://{registry_addr}"), "router listening");

    let (stop_tx, stop_rx) = watch::channel(false);
    let http = axum::serve(crate::listeners::http(http_listener), app)
        .with_graceful_shutdown(shutdown_signal(stop_rx.clone()));
    let grpc = crate::listeners::grpc_server()
        .add_service(GrpcService::new(frontend).into_server(api_key))
        .serve_with_incoming_shutdown(crate::listeners::grpc(grpc_listener), shutdown_signal(stop_rx.clone()));
    let registry_server = security.server().context("invalid --tls-cert/--tls-key/--tls-ca")?;
    let registry_done =
        spawn_registry(registry.clone(), security, registry_server, registry_listener.into_std()?, stop_rx)?;
    let http_task = tokio::spawn(async move { http.await });
    let grpc_task = tokio::spawn(grpc);
    wait_for_termination().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    // Open client streams end when their worker streams do; do not wait on them forever.
    let wait = async {
        let _ = http_task.await;
        let _ = grpc_task.await;
        let _ = registry_done.await;
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), wait).await;
    Ok(())
}

/// Serves the registry on `listener` with `server` (TLS when configured; calls checked
/// against `security`) and runs its ejector, on a thread with a runtime of its own, until
/// `stop` flips. The receiver resolves when it has stopped.
fn spawn_registry(
    registry: Arc<Registry>,
    security: ClusterSecurity,
    server: tonic::transport::Server,
    listener: std::net::TcpListener,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::sync::oneshot::Receiver<()>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot build the registry's runtime")?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("baton-registry".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot serve the worker registry");
                        return;
                    }
                };
                let ejector = tokio::spawn(registry.clone().run_ejector());
                let served = crate::listeners::with_keepalive(server)
                    .add_service(RegistryService::new(registry, security).into_server())
                    .serve_with_incoming_shutdown(crate::listeners::grpc(listener), shutdown_signal(stop))
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "the worker registry stopped");
                }
                ejector.abort();
            });
            let _ = done_tx.send(());
        })
        .context("cannot start the registry's thread")?;
    Ok(done_rx)
}
