//! `baton serve` settings: the `[serve]` table ([`ServeFile`]), its resolution with the flags
//! ([`resolve`] into [`ServeSettings`]), the defaults, and the engine configuration the
//! settings give ([`ServeSettings::engine_config`], used by `serve` and by workers).
//!
//! The `[serve]` table's keys are the flag names with `_` for `-` (`max_model_len = 2048`).
//! Unknown keys are an error, so a typo never silently falls back to a default.

use crate::cli::{ServeArgs, ToolArgs};
use baton_engine::EngineConfig;
use baton_router::openai::tools::choice::ToolConfig;
use baton_router::openai::tools::{ReasoningParser, ToolCallParser};
use serde::Deserialize;
use std::path::PathBuf;

/// The default model, relative to the working directory.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Default HTTP port.
pub const DEFAULT_PORT: u16 = 8000;
/// Default gRPC port.
pub const DEFAULT_GRPC_PORT: u16 = 50051;
/// Default bind address.
pub const DEFAULT_HOST: &str = "127.0.0.1";

/// The `[serve]` table of a config file; every key optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFile {
    /// See `--model`.
    pub model: Option<PathBuf>,
    /// See `--device`.
    pub device: Option<String>,
    /// See `--host`.
    pub host: Option<String>,
    /// See `--port`.
    pub port: Option<u16>,
    /// See `--grpc-port`.
    pub grpc_port: Option<u16>,
    /// See `--api-key`.
    pub api_key: Option<String>,
    /// See `--served-model-name`.
    pub served_model_name: Option<String>,
    /// See `--load-format`.
    pub load_format: Option<String>,
    /// See `--max-model-len`.
    pub max_model_len: Option<usize>,
    /// See `--max-num-seqs`.
    pub max_num_seqs: Option<usize>,
    /// See `--max-num-batched-tokens`.
    pub max_num_batched_tokens: Option<usize>,
    /// See `--block-size`.
    pub block_size: Option<usize>,
    /// See `--num-kv-blocks`.
    pub num_kv_blocks: Option<usize>,
    /// See `--kv-cache-dtype`.
    pub kv_cache_dtype: Option<baton_engine::kv_cache_dtype::KvCacheDtype>,
    /// See `--calculate-kv-scales`.
    pub calculate_kv_scales: Option<bool>,
    /// See `--kv-k-smoothing`.
    pub kv_k_smoothing: Option<baton_engine::kv_k_smoothing::KvKSmoothing>,
    /// See `--quantization`.
    pub quantization: Option<baton_engine::weight_quantization::WeightQuantization>,
    /// See `--gpu-memory-utilization`.
    pub gpu_memory_utilization: Option<f32>,
    /// See `--kernel-cache-dir`.
    pub kernel_cache_dir: Option<PathBuf>,
    /// See `--max-waiting`.
    pub max_waiting: Option<usize>,
    /// See `--disable-prefix-caching`.
    pub disable_prefix_caching: Option<bool>,
    /// See `--enforce-eager`.
    pub enforce_eager: Option<bool>,
    /// See `--async-scheduling`.
    pub async_scheduling: Option<bool>,
    /// See `--disable-chunked-prefill`.
    pub disable_chunked_prefill: Option<bool>,
    /// See `--threads`.
    pub threads: Option<usize>,
    /// See `--max-body-bytes`.
    pub max_body_bytes: Option<usize>,
    /// See `--engine-stall-timeout-ms`.
    pub engine_stall_timeout_ms: Option<u64>,
    /// See `--max-inflight`.
    pub max_inflight: Option<usize>,
    /// See `--enable-auto-tool-choice`.
    pub enable_auto_tool_choice: Option<bool>,
    /// See `--tool-call-parser`.
    pub tool_call_parser: Option<ToolCallParser>,
    /// See `--reasoning-parser`.
    pub reasoning_parser: Option<ReasoningParser>,
}

/// Fully resolved `serve` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeSettings {
    /// Model path.
    pub model: PathBuf,
    /// Whether `model` is the built-in default (changes the error when it is missing).
    pub model_is_default: bool,
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Bind address of both servers.
    pub host: String,
    /// HTTP port (0: any free port).
    pub port: u16,
    /// gRPC port (0: any free port).
    pub grpc_port: u16,
    /// Required bearer token for `/v1/*`.
    pub api_key: Option<String>,
    /// Name clients use in `model`.
    pub served_model_name: Option<String>,
    /// `auto`, `safetensors`, `gguf` or `dummy`.
    pub load_format: String,
    /// Context length cap (`None`: the model's).
    pub max_model_len: Option<usize>,
    /// Running sequences cap.
    pub max_num_seqs: Option<usize>,
    /// Tokens per engine step cap.
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV block.
    pub block_size: Option<usize>,
    /// KV blocks (`None`: sized from memory).
    pub num_kv_blocks: Option<usize>,
    /// The KV cache's element type.
    pub kv_cache_dtype: baton_engine::kv_cache_dtype::KvCacheDtype,
    /// FP8 KV scales calculated from the first prefill (checked against the dtype at start).
    pub calculate_kv_scales: bool,
    /// FP8 KV keys stored less their start-up mean.
    pub kv_k_smoothing: baton_engine::kv_k_smoothing::KvKSmoothing,
    /// The projection weights' quantization.
    pub quantization: baton_engine::weight_quantization::WeightQuantization,
    /// Fraction of GPU memory the engine may use (`None`: the engine's default).
    pub gpu_memory_utilization: Option<f32>,
    /// Disk cache of compiled kernels (`None`: none could be determined).
    pub kernel_cache_dir: Option<PathBuf>,
    /// Waiting-queue cap (beyond it: 429).
    pub max_waiting: Option<usize>,
    /// Turn the prefix cache off.
    pub disable_prefix_caching: bool,
    /// Prefill whole prompts in one step.
    pub disable_chunked_prefill: bool,
    /// No CUDA graphs: every step op by op.
    pub enforce_eager: bool,
    /// Plan decode steps while the previous one runs.
    pub async_scheduling: bool,
    /// CPU threads (`None`: all cores).
    pub threads: Option<usize>,
    /// Request body limit in bytes.
    pub max_body_bytes: usize,
    /// A step running longer makes the engine report itself stalled.
    pub engine_stall_timeout: std::time::Duration,
    /// Fault injection (hidden flag), for the failure tests.
    pub engine_fault: Option<baton_engine::FaultInjection>,
    /// Engine sequences in flight beyond which requests get 429 (worker: open streams).
    pub max_inflight: usize,
    /// Tool calling and reasoning options of the chat endpoint (unused by workers).
    pub tools: ToolConfig,
}

impl ServeSettings {
    /// The engine configuration these settings give (engine defaults for what is unset).
    pub fn engine_config(&self) -> EngineConfig {
        let d = EngineConfig::default();
        EngineConfig {
            block_size: self.block_size.unwrap_or(d.block_size),
            num_kv_blocks: self.num_kv_blocks.or(d.num_kv_blocks),
            kv_cache_dtype: self.kv_cache_dtype,
            calculate_kv_scales: self.calculate_kv_scales,
            kv_k_smoothing: self.kv_k_smoothing,
            quantization: self.quantization,
            gpu_memory_utilization: self.gpu_memory_utilization.unwrap_or(d.gpu_memory_utilization),
            kernel_cache_dir: self.kernel_cache_dir.clone(),
            max_num_seqs: self.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_num_batched_tokens: self.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
            max_model_len: self.max_model_len.or(d.max_model_len),
            enable_prefix_caching: !self.disable_prefix_caching,
            enable_chunked_prefill: !self.disable_chunked_prefill,
            max_waiting: self.max_waiting.unwrap_or(d.max_waiting),
            num_threads: self.threads.or(d.num_threads),
            enforce_eager: self.enforce_eager,
            async_scheduling: self.async_scheduling,
            stall_timeout: self.engine_stall_timeout,
            fault: self.engine_fault,
            ..d
        }
    }
}

/// Merges flags/env (`args`) over the file over the defaults.
pub fn resolve(args: &ServeArgs, file: &ServeFile) -> ServeSettings {
    let model = args.model.clone().or_else(|| file.model.clone());
    ServeSettings {
        model_is_default: model.is_none(),
        model: model.unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL)),
        device: args.device.clone().or_else(|| file.device.clone()).unwrap_or_else(|| "auto".to_owned()),
        host: args.host.clone().or_else(|| file.host.clone()).unwrap_or_else(|| DEFAULT_HOST.to_owned()),
        port: args.port.or(file.port).unwrap_or(DEFAULT_PORT),
        grpc_port: args.grpc_port.or(file.grpc_port).unwrap_or(DEFAULT_GRPC_PORT),
        api_key: args.api_key.clone().or_else(|| file.api_key.clone()).filter(|k| !k.is_empty()),
        served_model_name: args.served_model_name.clone().or_else(|| file.served_model_name.clone()),
        load_format: args.load_format.clone().or_else(|| file.load_format.clone()).unwrap_or_else(|| "auto".to_owned()),
        max_model_len: args.max_model_len.or(file.max_model_len),
        max_num_seqs: args.max_num_seqs.or(file.max_num_seqs),
        max_num_batched_tokens: args.max_num_batched_tokens.or(file.max_num_batched_tokens),
        block_size: args.block_size.or(file.block_size),
        num_kv_blocks: args.num_kv_blocks.or(file.num_kv_blocks),
        kv_cache_dtype: args.kv_cache_dtype.or(file.kv_cache_dtype).unwrap_or_default(),
        calculate_kv_scales: args.calculate_kv_scales.or(file.calculate_kv_scales).unwrap_or(false),
        kv_k_smoothing: args.kv_k_smoothing.or(file.kv_k_smoothing).unwrap_or_default(),
        quantization: args.quantization.or(file.quantization).unwrap_or_default(),
        gpu_memory_utilization: args.gpu_memory_utilization.or(file.gpu_memory_utilization),
        // The default comes from the environment, read here at the binary's edge.
        kernel_cache_dir: args
            .kernel_cache_dir
            .clone()
            .or_else(|| file.kernel_cache_dir.clone())
            .or_else(default_kernel_cache_dir),
        max_waiting: args.max_waiting.or(file.max_waiting),
        disable_prefix_caching: args.disable_prefix_caching.or(file.disable_prefix_caching).unwrap_or(false),
        disable_chunked_prefill: args.disable_chunked_prefill.or(file.disable_chunked_prefill).unwrap_or(false),
        enforce_eager: args.enforce_eager.or(file.enforce_eager).unwrap_or(false),
        async_scheduling: args.async_scheduling.or(file.async_scheduling).unwrap_or(true),
        threads: args.threads.or(file.threads),
        max_body_bytes: args
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(baton_router::http::DEFAULT_MAX_BODY_BYTES),
        engine_stall_timeout: args
            .engine_stall_timeout_ms
            .or(file.engine_stall_timeout_ms)
            .map_or(baton_engine::EngineConfig::default().stall_timeout, std::time::Duration::from_millis),
        engine_fault: args.chaos_engine_fault,
        max_inflight: args.max_inflight.or(file.max_inflight).unwrap_or(baton_router::admission::DEFAULT_MAX_INFLIGHT),
        tools: args.tools.resolve(ToolArgs {
            enable_auto_tool_choice: file.enable_auto_tool_choice,
            tool_call_parser: file.tool_call_parser,
            reasoning_parser: file.reasoning_parser,
        }),
    }
}

/// The default kernel cache: `$XDG_CACHE_HOME/baton/kernels`, else `$HOME/.cache/baton/kernels`;
/// `None` when neither is set. Read here, in the binary's config layer, and handed to the
/// engine as `EngineConfig::kernel_cache_dir`.
pub fn default_kernel_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("baton").join("kernels"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use crate::settings::check_tool_config;
    use crate::settings::error::ConfigError;
    use crate::settings::file::ConfigFile;
    use clap::Parser;
    use std::path::Path;

    fn serve_args(argv: &[&str]) -> ServeArgs {
        let mut full = vec!["baton", "serve"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            crate::cli::Command::Serve(args) => *args,
            other => panic!("not serve: {other:?}"),
        }
    }

    #[test]
    fn defaults_when_nothing_is_given() {
        let s = resolve(&serve_args(&[]), &ServeFile::default());
        assert_eq!(s.model, PathBuf::from(DEFAULT_MODEL));
        assert!(s.model_is_default);
        assert_eq!((s.host.as_str(), s.port, s.grpc_port), (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_GRPC_PORT));
        assert_eq!((s.device.as_str(), s.load_format.as_str()), ("auto", "auto"));
        assert!(!s.disable_prefix_caching && !s.disable_chunked_prefill);
        assert!(!s.enforce_eager, "CUDA graphs are on by default");
        assert!(s.async_scheduling, "async scheduling is on by default");
        assert_eq!(s.max_inflight, baton_router::admission::DEFAULT_MAX_INFLIGHT);
        let capped = ConfigFile::parse("[serve]\nmax_inflight = 8\n", Path::new("t.toml")).expect("valid").serve;
        assert_eq!(resolve(&serve_args(&[]), &capped).max_inflight, 8);
        assert_eq!(resolve(&serve_args(&["--max-inflight", "3"]), &capped).max_inflight, 3, "the flag beats the file");
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let file = ConfigFile::parse(
            "[serve]\nport = 9000\ngrpc_port = 9001\nmax_model_len = 512\ndisable_prefix_caching = true\n",
            Path::new("t.toml"),
        )
        .expect("valid")
        .serve;
        let s = resolve(&serve_args(&["--port", "7000", "--disable-prefix-caching=false"]), &file);
        assert_eq!(s.port, 7000);
        assert_eq!(s.grpc_port, 9001);
        assert_eq!(s.max_model_len, Some(512));
        assert!(!s.disable_prefix_caching);
        let s = resolve(&serve_args(&["--disable-chunked-prefill"]), &file);
        assert!(s.disable_chunked_prefill && s.disable_prefix_caching);
        let eager = ConfigFile::parse("[serve]\nenforce_eager = true\n", Path::new("t.toml")).expect("valid").serve;
        assert!(resolve(&serve_args(&[]), &eager).enforce_eager);
        assert!(!resolve(&serve_args(&["--enforce-eager=false"]), &eager).enforce_eager, "the flag beats the file");
        assert!(resolve(&serve_args(&["--enforce-eager"]), &ServeFile::default()).enforce_eager);
        let sync = ConfigFile::parse("[serve]\nasync_scheduling = false\n", Path::new("t.toml")).expect("valid").serve;
        assert!(!resolve(&serve_args(&[]), &sync).async_scheduling);
        assert!(resolve(&serve_args(&["--async-scheduling"]), &sync).async_scheduling, "the flag beats the file");
        assert!(!resolve(&serve_args(&["--async-scheduling=false"]), &ServeFile::default()).async_scheduling);
    }

    #[test]
    fn tool_and_reasoning_parsers_resolve_and_unknown_names_are_refused() {
        let file = ConfigFile::parse(
            "[serve]\nenable_auto_tool_choice = true\ntool_call_parser = \"hermes\"\nreasoning_parser = \"qwen3\"\n",
            Path::new("t.toml"),
        )
        .expect("valid")
        .serve;
        let s = resolve(&serve_args(&[]), &file);
        assert_eq!(s.tools.tool_call_parser, Some(ToolCallParser::Hermes));
        assert_eq!(s.tools.reasoning_parser, Some(ReasoningParser::Qwen3));
        assert!(s.tools.enable_auto_tool_choice);
        let s = resolve(&serve_args(&["--tool-call-parser", "pythonic", "--enable-auto-tool-choice=false"]), &file);
        assert_eq!(s.tools.tool_call_parser, Some(ToolCallParser::Pythonic), "the flag beats the file");
        assert!(!s.tools.enable_auto_tool_choice);
        assert_eq!(resolve(&serve_args(&[]), &ServeFile::default()).tools, ToolConfig::default());
        // Unknown names fail at start-up, listing the choices.
        let e = ConfigFile::parse("[serve]\ntool_call_parser = \"nope\"\n", Path::new("t.toml")).expect_err("unknown");
        assert!(e.to_string().contains("llama3_json"), "{e}");
        let e = Cli::try_parse_from(["baton", "serve", "--reasoning-parser", "r2"]).expect_err("unknown");
        assert!(e.to_string().contains("deepseek_r1"), "{e}");
        let e = check_tool_config(&resolve(&serve_args(&["--enable-auto-tool-choice"]), &ServeFile::default()).tools)
            .expect_err("no parser");
        assert!(e.contains("--tool-call-parser") && e.contains("hermes"), "{e}");
    }

    #[test]
    fn stall_timeout_and_fault_injection() {
        use std::time::Duration;
        assert_eq!(resolve(&serve_args(&[]), &ServeFile::default()).engine_stall_timeout, Duration::from_secs(60));
        assert_eq!(resolve(&serve_args(&[]), &ServeFile::default()).engine_fault, None);
        let file =
            ConfigFile::parse("[serve]\nengine_stall_timeout_ms = 5000\n", Path::new("t.toml")).expect("valid").serve;
        assert_eq!(resolve(&serve_args(&[]), &file).engine_stall_timeout, Duration::from_secs(5));
        let s = resolve(&serve_args(&["--engine-stall-timeout-ms", "250", "--chaos-engine-fault", "panic@3"]), &file);
        assert_eq!(s.engine_stall_timeout, Duration::from_millis(250));
        assert_eq!(s.engine_fault, Some("panic@3".parse().expect("fault")));
        let bad = Cli::try_parse_from(["baton", "serve", "--chaos-engine-fault", "boom"]).map(|_| ());
        assert!(bad.is_err_and(|e| e.to_string().contains("boom")));
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let err = ConfigFile::parse("[serve]\nmax_modle_len = 5\n", Path::new("x.toml")).expect_err("typo");
        assert!(err.to_string().contains("max_modle_len"), "{err}");
        let err = ConfigFile::parse("[serve]\nport = \"eighty\"\n", Path::new("x.toml")).expect_err("type");
        assert!(err.to_string().contains("x.toml"), "{err}");
        let err = ConfigFile::load(Path::new("/nonexistent/baton.toml")).expect_err("missing");
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    }

    #[test]
    fn example_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let unified = ConfigFile::load(&dir.join("unified.toml")).expect("configs/unified.toml parses");
        let s = resolve(&serve_args(&[]), &unified.serve);
        assert_eq!(s.port, DEFAULT_PORT);
        assert_eq!(s.model, PathBuf::from(DEFAULT_MODEL));
        assert_eq!(s.max_num_seqs, Some(64));
    }

    #[test]
    fn engine_config_takes_settings_and_defaults() {
        let args = crate::cli::ServeArgs::default();
        let mut s = resolve(&args, &Default::default());
        // The kernel cache defaults to a directory from the environment (or none without one).
        let d = EngineConfig { kernel_cache_dir: default_kernel_cache_dir(), ..EngineConfig::default() };
        assert_eq!(s.engine_config(), d);
        s.kernel_cache_dir = Some("/tmp/k".into());
        assert_eq!(s.engine_config().kernel_cache_dir, Some("/tmp/k".into()));
        s.block_size = Some(8);
        s.num_kv_blocks = Some(40);
        s.max_model_len = Some(128);
        s.disable_prefix_caching = true;
        s.threads = Some(2);
        let c = s.engine_config();
        assert_eq!((c.block_size, c.num_kv_blocks, c.max_model_len), (8, Some(40), Some(128)));
        assert!(!c.enable_prefix_caching && c.enable_chunked_prefill);
        assert_eq!(c.num_threads, Some(2));
    }

    #[test]
    fn kv_cache_dtype_from_flag_and_file_and_e5m2_refused_by_name() {
        use baton_engine::kv_cache_dtype::KvCacheDtype;
        let none = resolve(&serve_args(&[]), &ServeFile::default());
        assert_eq!(none.engine_config().kv_cache_dtype, KvCacheDtype::Auto);
        let flag = resolve(&serve_args(&["--kv-cache-dtype", "fp8"]), &ServeFile::default());
        assert_eq!(flag.engine_config().kv_cache_dtype, KvCacheDtype::Fp8E4M3);
        let file = ConfigFile::parse("[serve]\nkv_cache_dtype = \"fp8_e4m3\"\n", Path::new("t.toml")).expect("valid");
        assert_eq!(resolve(&serve_args(&[]), &file.serve).kv_cache_dtype, KvCacheDtype::Fp8E4M3);
        assert_eq!(
            resolve(&serve_args(&["--kv-cache-dtype", "bf16"]), &file.serve).kv_cache_dtype,
            KvCacheDtype::Bf16,
            "the flag beats the file"
        );
        let mut argv = vec!["baton", "serve", "--kv-cache-dtype", "fp8_e5m2"];
        let err = Cli::try_parse_from(&argv).expect_err("e5m2 refused").to_string();
        assert!(err.contains("fp8_e5m2") && err.contains("not implemented"), "{err}");
        argv[3] = "int4";
        assert!(Cli::try_parse_from(&argv).is_err());
        let bad = ConfigFile::parse("[serve]\nkv_cache_dtype = \"fp8_e5m2\"\n", Path::new("t.toml"))
            .expect_err("e5m2 refused in the file")
            .to_string();
        assert!(bad.contains("fp8_e5m2"), "{bad}");
    }

    #[test]
    fn kv_k_smoothing_from_flag_and_file_and_bad_values_named() {
        use baton_engine::kv_k_smoothing::KvKSmoothing;
        assert_eq!(resolve(&serve_args(&[]), &ServeFile::default()).engine_config().kv_k_smoothing, KvKSmoothing::Auto);
        let off = resolve(&serve_args(&["--kv-k-smoothing", "off"]), &ServeFile::default());
        assert_eq!(off.engine_config().kv_k_smoothing, KvKSmoothing::Off);
        let file = ConfigFile::parse("[serve]\nkv_k_smoothing = \"off\"\n", Path::new("t.toml")).expect("valid");
        assert_eq!(resolve(&serve_args(&[]), &file.serve).kv_k_smoothing, KvKSmoothing::Off);
        let flag_wins = resolve(&serve_args(&["--kv-k-smoothing", "auto"]), &file.serve);
        assert_eq!(flag_wins.kv_k_smoothing, KvKSmoothing::Auto);
        let bad = ConfigFile::parse("[serve]\nkv_k_smoothing = \"on\"\n", Path::new("t.toml"))
            .expect_err("on is not a value")
            .to_string();
        assert!(bad.contains("kv-k-smoothing") && bad.contains("'on'"), "{bad}");
    }

    #[test]
    fn calculate_kv_scales_from_flag_and_file() {
        assert!(!resolve(&serve_args(&[]), &ServeFile::default()).engine_config().calculate_kv_scales);
        let on = resolve(&serve_args(&["--kv-cache-dtype", "fp8", "--calculate-kv-scales"]), &ServeFile::default());
        assert!(on.engine_config().calculate_kv_scales);
        let file = ConfigFile::parse("[serve]\ncalculate_kv_scales = true\n", Path::new("t.toml")).expect("valid");
        assert!(resolve(&serve_args(&[]), &file.serve).calculate_kv_scales);
        assert!(
            !resolve(&serve_args(&["--calculate-kv-scales=false"]), &file.serve).calculate_kv_scales,
            "the flag beats the file"
        );
    }
}
