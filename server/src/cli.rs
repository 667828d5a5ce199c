//! The `baton` command line: subcommands and flags. Every `serve` flag is optional here so
//! that [`crate::config::resolve`] can tell "not given" from "given" and apply the
//! flag > env > file > default precedence; defaults are stated in the help text.

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
    /// Example clients.
    #[command(subcommand)]
    Client(ClientCommand),
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
    /// Require `Authorization: Bearer KEY` on /v1/* (/health and /metrics stay open)
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
    /// KV-cache blocks to allocate [default: sized from available memory]
    #[arg(long, env = "BATON_NUM_KV_BLOCKS", value_name = "N")]
    pub num_kv_blocks: Option<usize>,
    /// Fraction of GPU memory for weights, workspaces and KV cache [default: 0.9]
    #[arg(long, env = "BATON_GPU_MEMORY_UTILIZATION", value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f32>,
    /// Waiting requests beyond which new ones get 429 [default: engine default]
    #[arg(long, env = "BATON_MAX_WAITING", value_name = "N")]
    pub max_waiting: Option<usize>,
    /// Disable the prefix cache (also --disable-prefix-caching=false) [default: false]
    #[arg(long, env = "BATON_DISABLE_PREFIX_CACHING", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub disable_prefix_caching: Option<bool>,
    /// Prefill each prompt in one step instead of chunks [default: false]
    #[arg(long, env = "BATON_DISABLE_CHUNKED_PREFILL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub disable_chunked_prefill: Option<bool>,
    /// CPU threads for the CPU backend [default: all cores]
    #[arg(long, env = "BATON_THREADS", value_name = "N")]
    pub threads: Option<usize>,
    /// Largest accepted HTTP request body in bytes; larger gets 413 [default: 8388608]
    #[arg(long, env = "BATON_MAX_BODY_BYTES", value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
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
}
