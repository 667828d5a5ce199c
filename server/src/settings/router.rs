//! `baton router` settings: the `[router]` table ([`RouterFile`]) and its resolution with the
//! flags ([`router_settings`] into [`RouterSettings`]), with the same layering as `serve`:
//! flag > `BATON_*` env > the config file's `[router]` table > default. The table also takes
//! the internal plane's security keys (`cluster_secret_file`, `insecure_cluster`, `tls_cert`,
//! `tls_key`, `tls_ca`: [`super::security`]). Unknown keys are errors.

use super::error::{SettingsError, invalid};
use super::security::{SecurityFile, SecuritySettings};
use super::serve::{DEFAULT_GRPC_PORT, DEFAULT_HOST, DEFAULT_MODEL, DEFAULT_PORT};
use crate::cli::{RouterArgs, ToolArgs};
use baton_router::cluster::{ClusterSettings, TransferFailurePolicy};
use baton_router::openai::tools::choice::ToolConfig;
use baton_router::openai::tools::{ReasoningParser, ToolCallParser};
use serde::Deserialize;
use std::path::PathBuf;
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
    /// See `--quantization`.
    pub quantization: Option<baton_engine::weight_quantization::WeightQuantization>,
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
    /// The security keys of the table.
    pub fn security(&self) -> SecurityFile {
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
    /// The workers' weight quantization, part of the fingerprint they must match.
    pub quantization: baton_engine::weight_quantization::WeightQuantization,
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

/// Resolves `baton router` settings from flags/env and the `[router]` table.
pub fn router_settings(args: &RouterArgs, file: &RouterFile) -> Result<RouterSettings, SettingsError> {
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
        host: args.host.clone().or_else(|| file.host.clone()).unwrap_or_else(|| DEFAULT_HOST.into()),
        port: args.port.or(file.port).unwrap_or(DEFAULT_PORT),
        grpc_port: args.grpc_port.or(file.grpc_port).unwrap_or(DEFAULT_GRPC_PORT),
        registry_port: args.registry_port.or(file.registry_port).unwrap_or(DEFAULT_REGISTRY_PORT),
        api_key: args.api_key.clone().or_else(|| file.api_key.clone()).filter(|k| !k.is_empty()),
        served_model_name: args.served_model_name.clone().or_else(|| file.served_model_name.clone()),
        max_model_len: args.max_model_len.or(file.max_model_len),
        quantization: args.quantization.or(file.quantization).unwrap_or_default(),
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
        security: super::security::resolve(&args.security, &file.security())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use crate::settings::file::ConfigFile;
    use clap::Parser;
    use std::path::Path;

    fn router_args(argv: &[&str]) -> RouterArgs {
        let mut full = vec!["baton", "router"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Router(a) => *a,
            other => panic!("not router: {other:?}"),
        }
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
    fn router_quantization_from_flag_or_file_and_bad_values_named() {
        use baton_engine::weight_quantization::WeightQuantization;
        let none = ConfigFile::parse("", Path::new("r.toml")).expect("parses").router;
        assert_eq!(router_settings(&router_args(&[]), &none).expect("valid").quantization, WeightQuantization::None);
        let file = ConfigFile::parse("[router]\nquantization = \"fp8\"\n", Path::new("r.toml")).expect("ok").router;
        assert_eq!(router_settings(&router_args(&[]), &file).expect("valid").quantization, WeightQuantization::Fp8);
        let flag = router_settings(&router_args(&["--quantization", "none"]), &file).expect("valid");
        assert_eq!(flag.quantization, WeightQuantization::None, "the flag beats the file");
        let err = Cli::try_parse_from(["baton", "router", "--quantization", "awq"]).expect_err("awq");
        assert!(err.to_string().contains("awq"), "{err}");
        let err = ConfigFile::parse("[router]\nquantization = \"gptq\"\n", Path::new("r.toml")).expect_err("gptq");
        assert!(err.to_string().contains("gptq"), "{err}");
    }
}
