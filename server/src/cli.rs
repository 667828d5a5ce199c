//! The `baton` command line: subcommands and flags. Every `serve` flag is optional here so
//! that the settings layer (`settings::serve::resolve`) can tell "not given" from "given" and
//! apply the flag > env > file > default precedence; defaults are stated in the help text.

use baton_router::openai::tools::choice::ToolConfig;
use baton_router::openai::tools::{ReasoningParser, ToolCallParser};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Baton: an LLM inference server with an OpenAI-compatible HTTP API and a gRPC API.
#[derive(Debug, Parser)]
#[command(name = "baton", version, about, long_about = None)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve one model from this process: OpenAI-compatible HTTP and the public gRPC API.
    Serve(Box<ServeArgs>),
    /// Serve the same APIs over pools of `baton worker`s (disaggregated prefill/decode).
    Router(Box<RouterArgs>),
    /// Run one engine in a router's prefill, decode or unified pool.
    Worker(Box<WorkerArgs>),
    /// Example clients.
    #[command(subcommand)]
    Client(ClientCommand),
    /// CUDA kernel tools.
    #[command(subcommand)]
    Kernels(KernelsCommand),
}

/// `baton kernels ...`.
#[derive(Debug, Subcommand)]
pub enum KernelsCommand {
    /// Compile every CUDA kernel module for an architecture into a kernel cache directory, with
    /// no GPU (NVRTC only): a server given that directory (--kernel-cache-dir) on a GPU of that
    /// architecture, with the same NVRTC version, then starts without compiling.
    Build(KernelsBuildArgs),
}

/// Flags of `baton kernels build`.
#[derive(Debug, Clone, Args)]
pub struct KernelsBuildArgs {
    /// Target: sm_XY or sm_XYa for machine code (sm_90a: H100/H200), compute_XY[a] for PTX
    #[arg(long, default_value = "sm_90a")]
    pub arch: String,
    /// The kernel cache directory to fill (modules already there are kept) [default: the
    /// servers' default kernel cache: $XDG_CACHE_HOME/baton/kernels or ~/.cache/baton/kernels]
    #[arg(long, env = "BATON_KERNEL_CACHE_DIR", value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Flags of `baton serve`. Each also reads `BATON_<NAME>` and the `[serve]` table of
/// `--config`.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// TOML config file with a [serve] table (keys: flag names with '_' for '-').
    #[arg(long, env = "BATON_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model: a Hugging Face folder, a GGUF file, or (with --load-format dummy) a config JSON
    /// [default: models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, env = "BATON_MODEL", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Device: auto (CUDA when available, else CPU), cpu, cuda or cuda:N [default: auto]
    #[arg(long, env = "BATON_DEVICE")]
    pub device: Option<String>,
    /// Address to bind both servers to [default: 127.0.0.1]
    #[arg(long, env = "BATON_HOST")]
    pub host: Option<String>,
    /// HTTP port; 0 picks a free one [default: 8000]
    #[arg(long, env = "BATON_PORT")]
    pub port: Option<u16>,
    /// gRPC port; 0 picks a free one [default: 50051]
    #[arg(long, env = "BATON_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and the gRPC API
    /// (/health and /metrics stay open)
    #[arg(long, env = "BATON_API_KEY", value_name = "KEY")]
    pub api_key: Option<String>,
    /// Model name clients send in `model` [default: the --model path]
    #[arg(long, env = "BATON_SERVED_MODEL_NAME", value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Weight format: auto, safetensors, gguf or dummy (random weights) [default: auto]
    #[arg(long, env = "BATON_LOAD_FORMAT", value_name = "FORMAT")]
    pub load_format: Option<String>,
    /// Maximum tokens (prompt + output) per sequence [default: the model's context length]
    #[arg(long, env = "BATON_MAX_MODEL_LEN", value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    /// Maximum sequences in the running batch [default: engine default]
    #[arg(long, env = "BATON_MAX_NUM_SEQS", value_name = "N")]
    pub max_num_seqs: Option<usize>,
    /// Maximum tokens computed per engine step [default: engine default]
    #[arg(long, env = "BATON_MAX_NUM_BATCHED_TOKENS", value_name = "TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV-cache block [default: engine default]
    #[arg(long, env = "BATON_BLOCK_SIZE", value_name = "TOKENS")]
    pub block_size: Option<usize>,
    /// KV-cache element type: auto (the model's: f32 on CPU, bf16 on CUDA), bf16, or fp8
    /// (= fp8_e4m3, with per-layer k_scale/v_scale from the checkpoint, else 1.0) [default: auto]
    #[arg(long, env = "BATON_KV_CACHE_DTYPE", value_name = "DTYPE")]
    pub kv_cache_dtype: Option<baton_engine::kv_cache_dtype::KvCacheDtype>,
    /// Calculate the FP8 KV cache's per-layer scales from the first prefill step (vLLM's
    /// --calculate-kv-scales: amax(|K|)/200 and amax(|V|)/100, replacing the checkpoint's),
    /// then keep them; needs --kv-cache-dtype fp8 [default: false]
    #[arg(long, env = "BATON_CALCULATE_KV_SCALES", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub calculate_kv_scales: Option<bool>,
    /// FP8 KV key smoothing: auto stores each layer's keys less their mean (measured at
    /// start-up on a fixed text; exact for softmax attention, so skipped for models with
    /// attention soft-caps or sinks), off stores them as they are [default: auto]
    #[arg(long, env = "BATON_KV_K_SMOOTHING", value_name = "auto|off")]
    pub kv_k_smoothing: Option<baton_engine::kv_k_smoothing::KvKSmoothing>,
    /// Weight quantization: none (as the checkpoint says: FP8 checkpoints load as FP8) or fp8
    /// (quantize a bf16 checkpoint's projections at load, per output channel) [default: none]
    #[arg(long, env = "BATON_QUANTIZATION", value_name = "METHOD")]
    pub quantization: Option<baton_engine::weight_quantization::WeightQuantization>,
    /// KV-cache blocks to allocate [default: sized from available memory]
    #[arg(long, env = "BATON_NUM_KV_BLOCKS", value_name = "N")]
    pub num_kv_blocks: Option<usize>,
    /// Fraction of GPU memory for weights, workspaces and KV cache [default: 0.9]
    #[arg(long, env = "BATON_GPU_MEMORY_UTILIZATION", value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f32>,
    /// Disk cache of compiled CUDA kernels [default: $XDG_CACHE_HOME/baton/kernels or ~/.cache/baton/kernels]
    #[arg(long, env = "BATON_KERNEL_CACHE_DIR", value_name = "DIR")]
    pub kernel_cache_dir: Option<std::path::PathBuf>,
    /// Waiting requests beyond which new ones get 429 [default: engine default]
    #[arg(long, env = "BATON_MAX_WAITING", value_name = "N")]
    pub max_waiting: Option<usize>,
    /// Disable the prefix cache (also --disable-prefix-caching=false) [default: false]
    #[arg(long, env = "BATON_DISABLE_PREFIX_CACHING", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub disable_prefix_caching: Option<bool>,
    /// Prefill each prompt in one step instead of chunks [default: false]
    #[arg(long, env = "BATON_DISABLE_CHUNKED_PREFILL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub disable_chunked_prefill: Option<bool>,
    /// Run every CUDA step op by op, without CUDA graphs (also --enforce-eager=false) [default: false]
    #[arg(long, env = "BATON_ENFORCE_EAGER", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub enforce_eager: Option<bool>,
    /// Plan each decode step while the previous one runs on the device; --async-scheduling=false plans after its tokens arrive [default: true]
    #[arg(long, env = "BATON_ASYNC_SCHEDULING", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub async_scheduling: Option<bool>,
    /// CPU threads for the CPU backend [default: all cores]
    #[arg(long, env = "BATON_THREADS", value_name = "N")]
    pub threads: Option<usize>,
    /// Largest accepted HTTP request body in bytes; larger gets 413 [default: 8388608]
    #[arg(long, env = "BATON_MAX_BODY_BYTES", value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// An engine step running longer than this makes /health answer 503 (and a worker's
    /// heartbeat unhealthy) until it returns [default: 60000]
    #[arg(long, env = "BATON_ENGINE_STALL_TIMEOUT_MS", value_name = "MS")]
    pub engine_stall_timeout_ms: Option<u64>,
    /// Fault injection for failure tests: panic@N, stall=MS@N, error@N or fatal@N makes the
    /// engine's Nth forward pass panic, hang, fail recoverably or lose its device.
    #[arg(long, hide = true, value_name = "FAULT")]
    pub chaos_engine_fault: Option<baton_engine::FaultInjection>,
    /// Engine sequences in flight (all requests × n) beyond which new requests get 429;
    /// on a worker, its open streams [default: 4096]
    #[arg(long, env = "BATON_MAX_INFLIGHT", value_name = "N")]
    pub max_inflight: Option<usize>,
    /// Tool calling and reasoning output.
    #[command(flatten)]
    pub tools: ToolArgs,
}

/// The tool-calling and reasoning flags, shared by `serve` and `router` (the front end
/// parses tool calls; workers never see them). Each key is also read from the command's
/// config table under the same name.
#[derive(Debug, Clone, Default, Args)]
pub struct ToolArgs {
    /// Let the model decide to call tools (`tool_choice: "auto"`, the default when a request
    /// has tools); needs --tool-call-parser [default: false]
    #[arg(long, env = "BATON_ENABLE_AUTO_TOOL_CHOICE", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub enable_auto_tool_choice: Option<bool>,
    /// How the model writes tool calls: hermes, llama3_json, mistral, pythonic or openai [default: none]
    #[arg(long, env = "BATON_TOOL_CALL_PARSER", value_name = "NAME")]
    pub tool_call_parser: Option<ToolCallParser>,
    /// Split `<think>` reasoning into `reasoning_content`: qwen3 or deepseek_r1 [default: none]
    #[arg(long, env = "BATON_REASONING_PARSER", value_name = "NAME")]
    pub reasoning_parser: Option<ReasoningParser>,
}

impl ToolArgs {
    /// Flag beats `file` (the same keys from the config table) beats the default.
    pub fn resolve(&self, file: ToolArgs) -> ToolConfig {
        ToolConfig {
            enable_auto_tool_choice: self.enable_auto_tool_choice.or(file.enable_auto_tool_choice).unwrap_or(false),
            tool_call_parser: self.tool_call_parser.or(file.tool_call_parser),
            reasoning_parser: self.reasoning_parser.or(file.reasoning_parser),
        }
    }
}

/// Flags of `baton router`. Each also reads `BATON_ROUTER_<NAME>` and the `[router]` table of
/// `--config`.
#[derive(Debug, Clone, Default, Args)]
pub struct RouterArgs {
    /// TOML config file with a [router] table (keys: flag names with '_' for '-').
    #[arg(long, env = "BATON_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model whose tokenizer, chat template and config the router uses (no weights are loaded)
    /// [default: models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, env = "BATON_MODEL", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Format of --model: auto, safetensors, gguf or dummy [default: auto]
    #[arg(long, env = "BATON_LOAD_FORMAT", value_name = "FORMAT")]
    pub load_format: Option<String>,
    /// Address to bind to [default: 127.0.0.1]
    #[arg(long, env = "BATON_HOST")]
    pub host: Option<String>,
    /// HTTP port (OpenAI API, /health, /metrics, /workers) [default: 8000]
    #[arg(long, env = "BATON_PORT")]
    pub port: Option<u16>,
    /// Public gRPC port [default: 50051]
    #[arg(long, env = "BATON_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// Port where workers register and heartbeat [default: 50100]
    #[arg(long, env = "BATON_ROUTER_REGISTRY_PORT")]
    pub registry_port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize, /workers and the
    /// public gRPC API (/health and /metrics stay open)
    #[arg(long, env = "BATON_API_KEY", value_name = "KEY")]
    pub api_key: Option<String>,
    /// Internal-plane security (cluster secret, TLS).
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Model name clients send in `model` [default: the --model path]
    #[arg(long, env = "BATON_SERVED_MODEL_NAME", value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Context length; workers must hold at least this much [default: the model's]
    #[arg(long, env = "BATON_MAX_MODEL_LEN", value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    /// The workers' weight quantization (their --quantization: none or fp8); part of the model
    /// fingerprint, so a worker quantized otherwise is refused [default: none]
    #[arg(long, env = "BATON_QUANTIZATION", value_name = "METHOD")]
    pub quantization: Option<baton_engine::weight_quantization::WeightQuantization>,
    /// Largest accepted HTTP request body in bytes [default: 8388608]
    #[arg(long, env = "BATON_MAX_BODY_BYTES", value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Prefill routing: round_robin, least_loaded or prefix_aware [default: prefix_aware]
    #[arg(long, env = "BATON_ROUTER_POLICY")]
    pub policy: Option<String>,
    /// prefix_aware: tokens of queued prefill that one cached prompt token is worth [default: 1.0]
    #[arg(long, env = "BATON_ROUTER_PREFIX_LOAD_WEIGHT", value_name = "W")]
    pub prefix_load_weight: Option<f64>,
    /// Prompts shorter than this prefill on the decode worker itself [default: 0 (always hand off)]
    #[arg(long, env = "BATON_ROUTER_DISAGG_THRESHOLD", value_name = "TOKENS")]
    pub disagg_threshold: Option<usize>,
    /// When a prefill worker fails mid-hand-off: recompute (on the decode worker) or retry
    /// (another prefill worker, then recompute) [default: recompute]
    #[arg(long, env = "BATON_ROUTER_ON_TRANSFER_FAILURE", value_name = "POLICY")]
    pub on_transfer_failure: Option<String>,
    /// Extra prefill attempts under `retry` [default: 1]
    #[arg(long, env = "BATON_ROUTER_MAX_PREFILL_RETRIES", value_name = "N")]
    pub max_prefill_retries: Option<usize>,
    /// Hand-off deadline, from the start of the prefill (not its enqueue), renewed while the
    /// prefill worker makes progress; past it the decode worker recomputes [default: 10000]
    #[arg(long, env = "BATON_ROUTER_KV_DEADLINE_MS", value_name = "MS")]
    pub kv_deadline_ms: Option<u64>,
    /// A request with no event (tokens or progress) from its workers for this long fails [default: 60000]
    #[arg(long, env = "BATON_ROUTER_IDLE_TIMEOUT_MS", value_name = "MS")]
    pub idle_timeout_ms: Option<u64>,
    /// How often workers report [default: 500]
    #[arg(long, env = "BATON_ROUTER_HEARTBEAT_INTERVAL_MS", value_name = "MS")]
    pub heartbeat_interval_ms: Option<u64>,
    /// Silence after which a worker is ejected [default: 4 heartbeat intervals]
    #[arg(long, env = "BATON_ROUTER_EJECT_AFTER_MS", value_name = "MS")]
    pub eject_after_ms: Option<u64>,
    /// Prefill (or unified) workers needed before /health is 200 [default: 0]
    #[arg(long, env = "BATON_ROUTER_MIN_PREFILL_WORKERS", value_name = "N")]
    pub min_prefill_workers: Option<usize>,
    /// Decode (or unified) workers needed before /health is 200 [default: 1]
    #[arg(long, env = "BATON_ROUTER_MIN_DECODE_WORKERS", value_name = "N")]
    pub min_decode_workers: Option<usize>,
    /// Engine sequences in flight (all requests × n) beyond which new requests get 429 [default: 4096]
    #[arg(long, env = "BATON_MAX_INFLIGHT", value_name = "N")]
    pub max_inflight: Option<usize>,
    /// Longest a worker may take to answer a call (reservation, stream start, recompute) before
    /// another worker is tried [default: 10000]
    #[arg(long, env = "BATON_ROUTER_RPC_TIMEOUT_MS", value_name = "MS")]
    pub rpc_timeout_ms: Option<u64>,
    /// Longest a relayed prompt waits in its prefill worker's queue before the decode worker
    /// computes it instead [default: 60000]
    #[arg(long, env = "BATON_ROUTER_PREFILL_QUEUE_TIMEOUT_MS", value_name = "MS")]
    pub prefill_queue_timeout_ms: Option<u64>,
    /// Tool calling and reasoning output.
    #[command(flatten)]
    pub tools: ToolArgs,
}

/// Flags of `baton worker`: every `serve` flag (model, device, engine; `--port` serves
/// /health and /metrics, `--grpc-port` the Worker service, both any free port by default)
/// plus the worker's own. The config file's `[worker]` table takes the same keys.
#[derive(Debug, Clone, Default, Args)]
pub struct WorkerArgs {
    /// Model, device, engine and bind flags, as for `serve`.
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Pool to join: prefill, decode or unified
    #[arg(long, env = "BATON_WORKER_ROLE")]
    pub role: Option<String>,
    /// The router's registry address, e.g. http://127.0.0.1:50100
    #[arg(long, env = "BATON_WORKER_ROUTER", value_name = "ADDR")]
    pub router: Option<String>,
    /// Port of the TCP KV listener (decode/unified) [default: any free port]
    #[arg(long, env = "BATON_WORKER_KV_PORT")]
    pub kv_port: Option<u16>,
    /// Host the router and other workers use to reach this one [default: --host]
    #[arg(long, env = "BATON_WORKER_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Longest a received KV hand-off may stall between frames [default: 10000]
    #[arg(long, env = "BATON_WORKER_KV_DEADLINE_MS", value_name = "MS")]
    pub kv_deadline_ms: Option<u64>,
    /// Longest an NCCL link operation, a trailer held for its layers, or a gap in a link's
    /// layer notices may wait before the link is aborted and its hand-offs recompute
    /// [default: 30000]
    #[arg(long, env = "BATON_WORKER_KV_TRANSFER_TIMEOUT_MS", value_name = "MS")]
    pub kv_transfer_timeout_ms: Option<u64>,
    /// How a prefill worker sends KV: tcp (host-staged) or nccl (GPU to GPU; CUDA on both
    /// ends) [default: tcp]
    #[arg(long, env = "BATON_WORKER_KV_TRANSPORT", value_name = "TRANSPORT")]
    pub kv_transport: Option<String>,
    /// Internal-plane security (cluster secret, TLS).
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Fault injection for failure tests: the process exits after sending this many KV layers.
    #[arg(long, hide = true, value_name = "N")]
    pub chaos_exit_after_kv_layers: Option<usize>,
    /// Fault injection for failure tests: the process exits after streaming this many tokens.
    #[arg(long, hide = true, value_name = "N")]
    pub chaos_exit_after_tokens: Option<usize>,
}

/// Security flags of the internal plane, shared by `baton router` and `baton worker` (the
/// `[router]`/`[worker]` tables take the same keys).
#[derive(Debug, Clone, Default, Args)]
pub struct SecurityArgs {
    /// File holding the cluster secret (>= 16 bytes; a trailing newline is ignored), the same
    /// on the router and every worker: every internal call and KV hand-off proves it
    #[arg(long, env = "BATON_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Allow binding a non-loopback address without a cluster secret (anyone who can reach
    /// the ports can then join and call the cluster) [default: false]
    #[arg(long, env = "BATON_INSECURE_CLUSTER", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub insecure_cluster: Option<bool>,
    /// TLS certificate chain (PEM) this process presents on the internal plane (with --tls-key, --tls-ca)
    #[arg(long, env = "BATON_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) of --tls-cert
    #[arg(long, env = "BATON_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// CA certificate (PEM) that signed every cluster member's certificate (mutual TLS)
    #[arg(long, env = "BATON_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
}

/// `baton client ...`.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Stream one generation from a Baton gRPC server and print the text.
    Grpc(GrpcClientArgs),
}

/// Flags of `baton client grpc`.
#[derive(Debug, Clone, Args)]
pub struct GrpcClientArgs {
    /// Server address.
    #[arg(long, env = "BATON_GRPC_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as one user message through the chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seed for sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Request id (for `Abort` from another client).
    #[arg(long, default_value = "")]
    pub request_id: String,
    /// API key of the server (sent as `authorization: Bearer KEY`).
    #[arg(long, env = "BATON_API_KEY", value_name = "KEY")]
    pub api_key: Option<String>,
}
