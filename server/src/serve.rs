//! `baton serve`: load the model, start the engine, and serve the OpenAI-compatible HTTP API
//! and the public gRPC API from one process until SIGINT/SIGTERM. `--api-key` guards both;
//! there is no internal plane here, so no cluster secret.
//!
//! Startup logs name the device, the model, the KV capacity (blocks and tokens) and the bound
//! addresses (the real ports, also when 0 asked for any free port).

use crate::config::{DEFAULT_MODEL, ServeSettings};
use anyhow::{Context, bail};
use baton_core::api::EngineClient;
use baton_engine::{DeviceSpec, EngineConfig};
use baton_formats::LoadFormat;
use baton_metrics::Metrics;
use baton_router::{AdmissionLimits, ApiKey, Frontend, GrpcService, HttpConfig, ServedModel, TextCodec, http_router};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The engine configuration from the settings (engine defaults for what is unset).
pub fn engine_config(s: &ServeSettings) -> EngineConfig {
    let d = EngineConfig::default();
    EngineConfig {
        block_size: s.block_size.unwrap_or(d.block_size),
        num_kv_blocks: s.num_kv_blocks.or(d.num_kv_blocks),
        gpu_memory_utilization: s.gpu_memory_utilization.unwrap_or(d.gpu_memory_utilization),
        kernel_cache_dir: s.kernel_cache_dir.clone(),
        max_num_seqs: s.max_num_seqs.unwrap_or(d.max_num_seqs),
        max_num_batched_tokens: s.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
        max_model_len: s.max_model_len.or(d.max_model_len),
        enable_prefix_caching: !s.disable_prefix_caching,
        enable_chunked_prefill: !s.disable_chunked_prefill,
        max_waiting: s.max_waiting.unwrap_or(d.max_waiting),
        num_threads: s.threads.or(d.num_threads),
        enforce_eager: s.enforce_eager,
        async_scheduling: s.async_scheduling,
        stall_timeout: s.engine_stall_timeout,
        fault: s.engine_fault,
        ..d
    }
}

/// Reads the model's files (config, tokenizer, chat template, weight headers) off the async
/// runtime, logging the `config_tokenizer` start-up phase.
pub(crate) async fn load_model(
    path: &std::path::Path,
    format: LoadFormat,
) -> anyhow::Result<baton_formats::LoadedModel> {
    let t0 = std::time::Instant::now();
    let owned = path.to_path_buf();
    let model = tokio::task::spawn_blocking(move || baton_formats::load_model(&owned, format))
        .await
        .context("model loading panicked")?
        .with_context(|| format!("cannot load model {}", path.display()))?;
    baton_engine::log_phase("config_tokenizer", t0);
    Ok(model)
}

pub(crate) async fn shutdown_signal(mut stop: watch::Receiver<bool>) {
    // Resolves when the flag flips or the sender is gone.
    let _ = stop.wait_for(|s| *s).await;
}

pub(crate) async fn wait_for_termination() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Runs the unified server until a termination signal; `started` is when the process
/// started (the start-up log's total is measured from it).
pub async fn run(settings: ServeSettings, started: std::time::Instant) -> anyhow::Result<()> {
    crate::config::check_tool_config(&settings.tools).map_err(anyhow::Error::msg)?;
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
    let config = engine_config(&settings);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_config_takes_settings_and_defaults() {
        let args = crate::cli::ServeArgs::default();
        let mut s = crate::config::resolve(&args, &Default::default());
        // The kernel cache defaults to a directory from the environment (or none without one).
        let d = EngineConfig { kernel_cache_dir: crate::config::default_kernel_cache_dir(), ..EngineConfig::default() };
        assert_eq!(engine_config(&s), d);
        s.kernel_cache_dir = Some("/tmp/k".into());
        assert_eq!(engine_config(&s).kernel_cache_dir, Some("/tmp/k".into()));
        s.block_size = Some(8);
        s.num_kv_blocks = Some(40);
        s.max_model_len = Some(128);
        s.disable_prefix_caching = true;
        s.threads = Some(2);
        let c = engine_config(&s);
        assert_eq!((c.block_size, c.num_kv_blocks, c.max_model_len), (8, Some(40), Some(128)));
        assert!(!c.enable_prefix_caching && c.enable_chunked_prefill);
        assert_eq!(c.num_threads, Some(2));
    }
}
