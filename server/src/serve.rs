//! `baton serve`: load the model, start the engine, and serve the OpenAI-compatible HTTP API
//! and the public gRPC API from one process until SIGINT/SIGTERM. `--api-key` guards both;
//! there is no internal plane here, so no cluster secret.
//!
//! Startup logs name the device, the model, the KV capacity (blocks and tokens) and the bound
//! addresses (the real ports, also when 0 asked for any free port).

use crate::model::load_model;
use crate::settings::check_tool_config;
use crate::settings::serve::{DEFAULT_MODEL, ServeSettings};
use crate::shutdown::{shutdown_signal, wait_for_termination};
use anyhow::{Context, bail};
use baton_core::api::EngineClient;
use baton_engine::DeviceSpec;
use baton_formats::LoadFormat;
use baton_metrics::Metrics;
use baton_router::{AdmissionLimits, ApiKey, Frontend, GrpcService, HttpConfig, ServedModel, TextCodec, http_router};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Runs the unified server until a termination signal; `started` is when the process
/// started (the start-up log's total is measured from it).
pub async fn run(settings: ServeSettings, started: std::time::Instant) -> anyhow::Result<()> {
    check_tool_config(&settings.tools).map_err(anyhow::Error::msg)?;
    if settings.model_is_default && !settings.model.exists() {
        bail!(
            "the default model {DEFAULT_MODEL} was not found (relative to {}); run scripts/fetch-default-model.sh to fetch it, or pass --model",
            std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| ".".into())
        );
    }
    let load_format: LoadFormat = settings.load_format.parse().context("invalid --load-format")?;
    let device: DeviceSpec = settings.device.parse().context("invalid --device")?;
    tracing::info!(model = %settings.model.display(), format = %settings.load_format, "loading model");
    let model = load_model(&settings.model, load_format).await?;
    let tokenizer = model
        .tokenizer
        .clone()
        .with_context(|| format!("model {} has no tokenizer; the server needs one", settings.model.display()))?;
    let chat_template = model.chat_template.clone();
    if chat_template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
    }
    let config = settings.engine_config();
    let engine = tokio::task::spawn_blocking(move || baton_engine::start_engine(&model, device, config))
        .await
        .context("engine start panicked")?
        .context("cannot start the engine")?;
    let info = engine.info();
    let root = settings.model.display().to_string();
    let name = settings.served_model_name.clone().unwrap_or_else(|| root.clone());
    tracing::info!(
        device = %info.device,
        model = %name,
        kv_blocks = info.num_blocks,
        block_size = info.block_size,
        kv_tokens = info.num_blocks * info.block_size,
        max_model_len = info.max_model_len,
        "engine ready"
    );

    let metrics = Arc::new(Metrics::new(&name)?);
    let frontend = Frontend::new(
        Arc::new(engine.clone()),
        Arc::new(TextCodec::new(tokenizer, chat_template)),
        ServedModel { name, root },
        metrics,
    )
    .with_admission(AdmissionLimits { max_inflight: settings.max_inflight, ..AdmissionLimits::default() });
    let app = http_router(
        frontend.clone(),
        HttpConfig {
            api_key: settings.api_key.clone(),
            max_body_bytes: settings.max_body_bytes,
            tools: settings.tools,
        },
    );
    let http_listener = TcpListener::bind((settings.host.as_str(), settings.port))
        .await
        .with_context(|| format!("cannot bind HTTP to {}:{}", settings.host, settings.port))?;
    let grpc_listener = TcpListener::bind((settings.host.as_str(), settings.grpc_port))
        .await
        .with_context(|| format!("cannot bind gRPC to {}:{}", settings.host, settings.grpc_port))?;
    let http_addr: SocketAddr = http_listener.local_addr()?;
    let grpc_addr: SocketAddr = grpc_listener.local_addr()?;
    tracing::info!(
        http = %format!("http://{http_addr}"),
        grpc = %grpc_addr,
        auth = settings.api_key.is_some(),
        "listening"
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let http = axum::serve(crate::listeners::http(http_listener), app)
        .with_graceful_shutdown(shutdown_signal(stop_rx.clone()));
    let grpc = crate::listeners::grpc_server()
        .add_service(GrpcService::new(frontend).into_server(ApiKey::from_config(settings.api_key.as_deref())))
        .serve_with_incoming_shutdown(crate::listeners::grpc(grpc_listener), shutdown_signal(stop_rx));
    // Logged before the servers run, so the line is in the log before the first /health 200
    // (what tests and `bench_startup` read); spawning them is all that is left.
    baton_engine::log_phase("total", started);
    let http_task = tokio::spawn(async move { http.await });
    let grpc_task = tokio::spawn(grpc);
    tokio::spawn(crate::engine_watch::watch(engine.clone()));
    wait_for_termination().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    // Streams still open would keep graceful shutdown waiting; stop the engine so they end.
    tokio::task::spawn_blocking(move || engine.shutdown()).await.context("engine shutdown panicked")?;
    http_task.await.context("HTTP server task failed")?.context("HTTP server failed")?;
    grpc_task.await.context("gRPC server task failed")?.context("gRPC server failed")?;
    Ok(())
}
