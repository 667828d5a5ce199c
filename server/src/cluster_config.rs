//! Settings of `baton router` and `baton worker`, with the same layering as `serve`:
//! flag > `BATON_*` env > the config file's `[router]` / `[worker]` table > default.
//!
//! A worker is a `serve` without the OpenAI API: its `[worker]` table takes every `[serve]`
//! key (model, device, engine knobs; `port` is its `/health`+`/metrics` port and `grpc_port`
//! its Worker service's, both 0 = any free port by default) plus `role`, `router`,
//! `kv_port`, `advertise_host`, `kv_deadline_ms` and `kv_transport`. Both tables also take the
//! internal plane's security keys (`cluster_secret_file`, `insecure_cluster`, `tls_cert`,
//! `tls_key`, `tls_ca`: [`crate::cluster_security`]). Unknown keys are errors in both tables.

use crate::cli::{RouterArgs, ToolArgs, WorkerArgs};
use crate::cluster_security::{SECURITY_KEYS, SecurityError, SecurityFile, SecuritySettings};
use crate::config::{ConfigError, ConfigFile, DEFAULT_MODEL, ServeFile, resolve};
use crate::worker::WorkerSettings;
use baton_proto::Role;
use baton_router::cluster::{ClusterSettings, TransferFailurePolicy};
use baton_router::openai::tools::choice::ToolConfig;
use baton_router::openai::tools::{ReasoningParser, ToolCallParser};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default port of the worker-facing registry.
pub const DEFAULT_REGISTRY_PORT: u16 = 50100;

/// The `[router]` table; every key optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterFile {
    /// See `--enable-auto-tool-choice`.
    pub enable_auto_tool_choice: Option<bool>,
    /// See `--tool-call-parser`.
    pub tool_call_parser: Option<ToolCallParser>,
    /// See `--reasoning-parser`.
    pub reasoning_parser: Option<ReasoningParser>,
    /// See `--model`.
    pub model: Option<PathBuf>,
    /// See `--load-format`.
    pub load_format: Option<String>,
    /// See `--host`.
    pub host: Option<String>,
    /// See `--port`.
    pub port: Option<u16>,
    /// See `--grpc-port`.
    pub grpc_port: Option<u16>,
    /// See `--registry-port`.
    pub registry_port: Option<u16>,
    /// See `--api-key`.
    pub api_key: Option<String>,
    /// See `--served-model-name`.
    pub served_model_name: Option<String>,
    /// See `--max-model-len`.
    pub max_model_len: Option<usize>,
    /// See `--max-body-bytes`.
    pub max_body_bytes: Option<usize>,
    /// See `--policy`.
    pub policy: Option<String>,
    /// See `--prefix-load-weight`.
    pub prefix_load_weight: Option<f64>,
    /// See `--disagg-threshold`.
    pub disagg_threshold: Option<usize>,
    /// See `--on-transfer-failure`.
    pub on_transfer_failure: Option<String>,
    /// See `--max-prefill-retries`.
    pub max_prefill_retries: Option<usize>,
    /// See `--kv-deadline-ms`.
    pub kv_deadline_ms: Option<u64>,
    /// See `--idle-timeout-ms`.
    pub idle_timeout_ms: Option<u64>,
    /// See `--heartbeat-interval-ms`.
    pub heartbeat_interval_ms: Option<u64>,
    /// See `--eject-after-ms`.
    pub eject_after_ms: Option<u64>,
    /// See `--min-prefill-workers`.
    pub min_prefill_workers: Option<usize>,
    /// See `--min-decode-workers`.
    pub min_decode_workers: Option<usize>,
    /// See `--cluster-secret-file`.
    pub cluster_secret_file: Option<PathBuf>,
    /// See `--insecure-cluster`.
    pub insecure_cluster: Option<bool>,
    /// See `--tls-cert`.
    pub tls_cert: Option<PathBuf>,
    /// See `--tls-key`.
    pub tls_key: Option<PathBuf>,
    /// See `--tls-ca`.
    pub tls_ca: Option<PathBuf>,
    /// See `--max-inflight`.
    pub max_inflight: Option<usize>,
    /// See `--rpc-timeout-ms`.
    pub rpc_timeout_ms: Option<u64>,
    /// See `--prefill-queue-timeout-ms`.
    pub prefill_queue_timeout_ms: Option<u64>,
}

impl RouterFile {
    fn security(&self) -> SecurityFile {
        SecurityFile {
            cluster_secret_file: self.cluster_secret_file.clone(),
            insecure_cluster: self.insecure_cluster,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_ca: self.tls_ca.clone(),
        }
    }
}

/// Fully resolved router settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSettings {
    /// Model path (tokenizer, template and config are read; weights are not).
    pub model: PathBuf,
    /// Whether `model` is the built-in default.
    pub model_is_default: bool,
    /// `auto`, `safetensors`, `gguf` or `dummy`.
    pub load_format: String,
    /// Bind address.
    pub host: String,
    /// HTTP port.
    pub port: u16,
    /// Public gRPC port.
    pub grpc_port: u16,
    /// Worker-facing registry port.
    pub registry_port: u16,
    /// Bearer token for `/v1/*`.
    pub api_key: Option<String>,
    /// Name clients use in `model`.
    pub served_model_name: Option<String>,
    /// Context length (`None`: the model's); workers must hold at least this.
    pub max_model_len: Option<usize>,
    /// Request body limit.
    pub max_body_bytes: usize,
    /// `round_robin`, `least_loaded` or `prefix_aware`.
    pub policy: String,
    /// `prefix_aware`: tokens of queued prefill one cached token is worth.
    pub prefix_load_weight: f64,
    /// Worker heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Silence after which a worker is ejected.
    pub eject_after: Duration,
    /// Routing and hand-off behaviour.
    pub cluster: ClusterSettings,
    /// Cluster secret and TLS of the internal plane.
    pub security: SecuritySettings,
    /// Engine sequences in flight beyond which requests get 429.
    pub max_inflight: usize,
    /// Tool calling and reasoning options of the chat endpoint.
    pub tools: ToolConfig,
}

/// A router or worker setting that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum ClusterConfigError {
    /// The config file.
    #[error(transparent)]
    File(#[from] ConfigError),
    /// A security setting.
    #[error(transparent)]
    Security(#[from] SecurityError),
    /// A value out of its domain.
    #[error("invalid {key}: {message}")]
    Invalid {
        /// The flag/key.
        key: &'static str,
        /// Why.
        message: String,
    },
}

fn invalid(key: &'static str, message: impl Into<String>) -> ClusterConfigError {
    ClusterConfigError::Invalid { key, message: message.into() }
}

fn load(path: Option<&Path>) -> Result<ConfigFile, ConfigError> {
    match path {
        Some(p) => ConfigFile::load(p),
        None => Ok(ConfigFile::default()),
    }
}

/// Resolves `baton router` settings from flags/env and the `[router]` table.
pub fn router_settings(args: &RouterArgs, file: &RouterFile) -> Result<RouterSettings, ClusterConfigError> {
    let model = args.model.clone().or_else(|| file.model.clone());
    let d = ClusterSettings::default();
    let ms = |a: Option<u64>, f: Option<u64>, default: Duration| a.or(f).map_or(default, Duration::from_millis);
    let on_failure = args.on_transfer_failure.clone().or_else(|| file.on_transfer_failure.clone());
    let retries = args.max_prefill_retries.or(file.max_prefill_retries).unwrap_or(1);
    let on_transfer_failure = match on_failure.as_deref().unwrap_or("recompute") {
        "recompute" => TransferFailurePolicy::Recompute,
        "retry" => TransferFailurePolicy::Retry { max_retries: retries },
        other => return Err(invalid("on_transfer_failure", format!("{other:?}: expected recompute or retry"))),
    };
    let heartbeat_interval = ms(args.heartbeat_interval_ms, file.heartbeat_interval_ms, Duration::from_millis(500));
    let eject_after = ms(args.eject_after_ms, file.eject_after_ms, heartbeat_interval * 4);
    if heartbeat_interval.is_zero() || eject_after <= heartbeat_interval {
        return Err(invalid("eject_after_ms", "must exceed a non-zero heartbeat_interval_ms"));
    }
    let policy = args.policy.clone().or_else(|| file.policy.clone()).unwrap_or_else(|| "prefix_aware".into());
    let prefix_load_weight = args.prefix_load_weight.or(file.prefix_load_weight).unwrap_or(1.0);
    baton_router::cluster::policy_by_name(&policy, prefix_load_weight).map_err(|e| invalid("policy", e.to_string()))?;
    if !(prefix_load_weight.is_finite() && prefix_load_weight >= 0.0) {
        return Err(invalid("prefix_load_weight", "must be a finite number >= 0"));
    }
    Ok(RouterSettings {
        model_is_default: model.is_none(),
        model: model.unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL)),
        load_format: args.load_format.clone().or_else(|| file.load_format.clone()).unwrap_or_else(|| "auto".into()),
        host: args.host.clone().or_else(|| file.host.clone()).unwrap_or_else(|| crate::config::DEFAULT_HOST.into()),
        port: args.port.or(file.port).unwrap_or(crate::config::DEFAULT_PORT),
        grpc_port: args.grpc_port.or(file.grpc_port).unwrap_or(crate::config::DEFAULT_GRPC_PORT),
        registry_port: args.registry_port.or(file.registry_port).unwrap_or(DEFAULT_REGISTRY_PORT),
        api_key: args.api_key.clone().or_else(|| file.api_key.clone()).filter(|k| !k.is_empty()),
        served_model_name: args.served_model_name.clone().or_else(|| file.served_model_name.clone()),
        max_model_len: args.max_model_len.or(file.max_model_len),
        max_body_bytes: args
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(baton_router::http::DEFAULT_MAX_BODY_BYTES),
        policy,
        prefix_load_weight,
        heartbeat_interval,
        eject_after,
        max_inflight: args.max_inflight.or(file.max_inflight).unwrap_or(baton_router::admission::DEFAULT_MAX_INFLIGHT),
        tools: args.tools.resolve(ToolArgs {
            enable_auto_tool_choice: file.enable_auto_tool_choice,
            tool_call_parser: file.tool_call_parser,
            reasoning_parser: file.reasoning_parser,
        }),
        cluster: ClusterSettings {
            disagg_threshold: args.disagg_threshold.or(file.disagg_threshold).unwrap_or(d.disagg_threshold),
            on_transfer_failure,
            kv_deadline: ms(args.kv_deadline_ms, file.kv_deadline_ms, d.kv_deadline),
            idle_timeout: ms(args.idle_timeout_ms, file.idle_timeout_ms, d.idle_timeout),
            min_prefill_workers: args.min_prefill_workers.or(file.min_prefill_workers).unwrap_or(d.min_prefill_workers),
            min_decode_workers: args.min_decode_workers.or(file.min_decode_workers).unwrap_or(d.min_decode_workers),
            rpc_timeout: ms(args.rpc_timeout_ms, file.rpc_timeout_ms, d.rpc_timeout),
            prefill_queue_timeout: ms(
                args.prefill_queue_timeout_ms,
                file.prefill_queue_timeout_ms,
                d.prefill_queue_timeout,
            ),
            ..d
        },
        security: crate::cluster_security::resolve(&args.security, &file.security())?,
    })
}

/// Loads `--config` and resolves the router's settings.
pub fn router(args: &RouterArgs) -> Result<RouterSettings, ClusterConfigError> {
    let file = load(args.config.as_deref())?;
    router_settings(args, &file.router)
}

/// The worker-only keys of a `[worker]` table.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerOwn {
    role: Option<String>,
    router: Option<String>,
    kv_port: Option<u16>,
    advertise_host: Option<String>,
    kv_deadline_ms: Option<u64>,
    kv_transport: Option<String>,
}

const WORKER_KEYS: [&str; 6] = ["role", "router", "kv_port", "advertise_host", "kv_deadline_ms", "kv_transport"];

fn split_table(table: &toml::Table, keys: &[&str]) -> (toml::Table, toml::Table) {
    table.clone().into_iter().partition(|(k, _)| keys.contains(&k.as_str()))
}

/// Resolves `baton worker` settings from flags/env and a `[worker]` table (`path` names the
/// file in errors).
pub fn worker_settings(
    args: &WorkerArgs,
    table: &toml::Table,
    path: &Path,
) -> Result<WorkerSettings, ClusterConfigError> {
    let (own, rest) = split_table(table, &WORKER_KEYS);
    let (security, rest) = split_table(&rest, &SECURITY_KEYS);
    let parse_err =
        |e: toml::de::Error| ConfigError::Parse { path: path.to_owned(), message: format!("[worker]: {e}") };
    let own: WorkerOwn = own.try_into().map_err(parse_err)?;
    let security: SecurityFile = security.try_into().map_err(parse_err)?;
    let mut serve_file: ServeFile = rest.try_into().map_err(parse_err)?;
    // Workers register their real addresses, so any free port is a fine default.
    serve_file.port = serve_file.port.or(Some(0));
    serve_file.grpc_port = serve_file.grpc_port.or(Some(0));
    let role = match args.role.clone().or(own.role).as_deref() {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some("unified") => Role::Unified,
        Some(other) => return Err(invalid("role", format!("{other:?}: expected prefill, decode or unified"))),
        None => return Err(invalid("role", "required: --role prefill|decode|unified")),
    };
    let router = args
        .router
        .clone()
        .or(own.router)
        .ok_or_else(|| invalid("router", "required: --router http://HOST:PORT (the router's registry port)"))?;
    let router = if router.contains("://") { router } else { format!("http://{router}") };
    Ok(WorkerSettings {
        serve: resolve(&args.serve, &serve_file),
        role,
        router,
        kv_port: args.kv_port.or(own.kv_port).unwrap_or(0),
        advertise_host: args.advertise_host.clone().or(own.advertise_host),
        kv_deadline: Duration::from_millis(args.kv_deadline_ms.or(own.kv_deadline_ms).unwrap_or(10_000)),
        kv_transport: match args.kv_transport.clone().or(own.kv_transport).as_deref().unwrap_or("tcp") {
            "tcp" => crate::worker::KvTransportKind::Tcp,
            "nccl" => crate::worker::KvTransportKind::Nccl,
            other => return Err(invalid("kv_transport", format!("{other:?}: expected tcp or nccl"))),
        },
        security: crate::cluster_security::resolve(&args.security, &security)?,
        chaos: crate::worker::Chaos {
            exit_after_kv_layers: args.chaos_exit_after_kv_layers,
            exit_after_tokens: args.chaos_exit_after_tokens,
        },
    })
}

/// Loads `--config` and resolves the worker's settings.
pub fn worker(args: &WorkerArgs) -> Result<WorkerSettings, ClusterConfigError> {
    let path = args.serve.config.clone().unwrap_or_default();
    let file = load(args.serve.config.as_deref())?;
    worker_settings(args, &file.worker, &path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn router_args(argv: &[&str]) -> RouterArgs {
        let mut full = vec!["baton", "router"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Router(a) => *a,
            other => panic!("not router: {other:?}"),
        }
    }

    fn worker_args(argv: &[&str]) -> WorkerArgs {
        let mut full = vec!["baton", "worker"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Worker(a) => *a,
            other => panic!("not worker: {other:?}"),
        }
    }

    fn configs() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
    }

    #[test]
    fn router_flags_beat_the_file_and_bad_values_are_named() {
        let file = ConfigFile::parse("[router]\npolicy = \"round_robin\"\nport = 9000\n", Path::new("r.toml"))
            .expect("parses")
            .router;
        let s = router_settings(&router_args(&["--port", "7000"]), &file).expect("valid");
        assert_eq!((s.port, s.policy.as_str()), (7000, "round_robin"));
        assert_eq!(s.max_inflight, baton_router::admission::DEFAULT_MAX_INFLIGHT);
        let s = router_settings(&router_args(&["--max-inflight", "64"]), &file).expect("valid");
        assert_eq!(s.max_inflight, 64);
        let timeouts = ConfigFile::parse("[router]\nrpc_timeout_ms = 2000\n", Path::new("r.toml")).expect("ok").router;
        let s = router_settings(&router_args(&["--prefill-queue-timeout-ms", "5000"]), &timeouts).expect("valid");
        let want = (Duration::from_secs(2), Duration::from_secs(5));
        assert_eq!((s.cluster.rpc_timeout, s.cluster.prefill_queue_timeout), want);
        assert_eq!(s.registry_port, DEFAULT_REGISTRY_PORT);
        let err = router_settings(&router_args(&["--policy", "fastest"]), &file).expect_err("bad policy");
        assert!(err.to_string().contains("fastest"), "{err}");
        let err = router_settings(&router_args(&["--on-transfer-failure", "pray"]), &file).expect_err("bad");
        assert!(err.to_string().contains("pray"), "{err}");
        let s = router_settings(&router_args(&["--on-transfer-failure", "retry", "--max-prefill-retries", "3"]), &file)
            .expect("valid");
        assert_eq!(s.cluster.on_transfer_failure, TransferFailurePolicy::Retry { max_retries: 3 });
        let err = ConfigFile::parse("[router]\npolcy = \"x\"\n", Path::new("r.toml")).expect_err("typo");
        assert!(err.to_string().contains("polcy"), "{err}");
    }

    #[test]
    fn worker_tables_take_serve_keys_plus_their_own_and_reject_typos() {
        let table: toml::Table = toml::from_str(
            "role = \"decode\"\nrouter = \"127.0.0.1:50100\"\nmax_num_seqs = 8\ndevice = \"cpu\"\nkv_port = 6000\n",
        )
        .expect("toml");
        let s = worker_settings(&worker_args(&[]), &table, Path::new("w.toml")).expect("valid");
        assert_eq!(s.role, Role::Decode);
        assert_eq!(s.router, "http://127.0.0.1:50100");
        assert_eq!((s.serve.max_num_seqs, s.serve.device.as_str(), s.kv_port), (Some(8), "cpu", 6000));
        assert_eq!((s.serve.port, s.serve.grpc_port), (0, 0), "free ports by default");
        let s = worker_settings(&worker_args(&["--role", "prefill", "--port", "9100"]), &table, Path::new("w.toml"))
            .expect("valid");
        assert_eq!((s.role, s.serve.port), (Role::Prefill, 9100));
        let typo: toml::Table = toml::from_str("rol = \"decode\"\n").expect("toml");
        let err = worker_settings(&worker_args(&["--router", "x:1"]), &typo, Path::new("w.toml")).expect_err("typo");
        assert!(err.to_string().contains("rol"), "{err}");
        let err = worker_settings(&worker_args(&["--router", "x:1"]), &toml::Table::new(), Path::new("w.toml"))
            .expect_err("no role");
        assert!(err.to_string().contains("--role"), "{err}");
    }

    #[test]
    fn example_cluster_configs_parse_and_resolve() {
        for (name, policy, prefill, decode) in
            [("1p1d.toml", "least_loaded", 1, 1), ("2p2d.toml", "prefix_aware", 2, 2)]
        {
            let path = configs().join(name);
            let file = ConfigFile::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            let r = router_settings(&router_args(&[]), &file.router).expect("router settings");
            assert_eq!(r.policy, policy, "{name}");
            assert_eq!((r.cluster.min_prefill_workers, r.cluster.min_decode_workers), (prefill, decode), "{name}");
            for role in ["prefill", "decode"] {
                let w = worker_settings(&worker_args(&["--role", role]), &file.worker, &path).expect("worker settings");
                assert_eq!(w.role.as_str(), role);
                assert_eq!(
                    w.router,
                    format!("http://127.0.0.1:{}", r.registry_port),
                    "{name}: workers find the router"
                );
            }
        }
    }

    #[test]
    fn both_tables_take_the_security_keys() {
        let text = "[router]\ncluster_secret_file = \"/s\"\ntls_cert = \"c\"\ntls_key = \"k\"\ntls_ca = \"a\"\n\
                    [worker]\nrole = \"decode\"\nrouter = \"x:1\"\ncluster_secret_file = \"/s\"\ninsecure_cluster = true\n";
        let file = ConfigFile::parse(text, Path::new("s.toml")).expect("parses");
        let r = router_settings(&router_args(&[]), &file.router).expect("router");
        assert_eq!(r.security.cluster_secret_file, Some(PathBuf::from("/s")));
        assert!(r.security.tls.is_some() && !r.security.insecure_cluster);
        let r = router_settings(&router_args(&["--cluster-secret-file", "/flag"]), &file.router).expect("router");
        assert_eq!(r.security.cluster_secret_file, Some(PathBuf::from("/flag")), "the flag wins");
        let w = worker_settings(&worker_args(&[]), &file.worker, Path::new("s.toml")).expect("worker");
        assert_eq!(w.security.cluster_secret_file, Some(PathBuf::from("/s")));
        assert!(w.security.insecure_cluster && w.security.tls.is_none());
        let partial: toml::Table =
            toml::from_str("role = \"decode\"\nrouter = \"x:1\"\ntls_cert = \"c\"\n").expect("toml");
        let err = worker_settings(&worker_args(&[]), &partial, Path::new("s.toml")).expect_err("partial TLS");
        assert!(err.to_string().contains("--tls-key, --tls-ca"), "{err}");
    }
}
