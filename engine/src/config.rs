//! Engine configuration and device selection.
//!
//! [`EngineConfig`] is plain data filled by the CLI (flags, env, TOML) and
//! validated against the model in [`crate::start_engine`]. KV capacity is
//! either an explicit block count or derived from a memory budget (on CUDA,
//! from free device memory and `gpu_memory_utilization`).

use std::str::FromStr;

/// Which device to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// CUDA when a driver is present, else CPU.
    #[default]
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA backend on device N.
    Cuda(usize),
}

/// A device string that is not `auto`, `cpu`, `cuda` or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid device '{0}': expected auto, cpu, cuda or cuda:N")]
pub struct ParseDeviceError(pub String);

impl FromStr for DeviceSpec {
    type Err = ParseDeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| ParseDeviceError(s.to_string())),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// How the engine batches and caches.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// The KV cache's element type (`--kv-cache-dtype`); FP8 doubles the blocks a budget holds.
    pub kv_cache_dtype: crate::kv_cache_dtype::KvCacheDtype,
    /// `--calculate-kv-scales`: the FP8 cache's per-layer scales are calculated from the
    /// first step with prefill tokens (amax / vLLM's constants, replacing the checkpoint's),
    /// then fixed; see [`crate::kv_cache_dtype`]. Refused at start unless `kv_cache_dtype` is
    /// FP8.
    pub calculate_kv_scales: bool,
    /// `--kv-k-smoothing`: whether an FP8 cache stores each layer's keys less their mean,
    /// measured at start-up ([`crate::kv_k_smoothing`]).
    pub kv_k_smoothing: crate::kv_k_smoothing::KvKSmoothing,
    /// FP8 projection weights (`--quantization`): `None` serves the checkpoint as it is.
    pub quantization: crate::weight_quantization::WeightQuantization,
    /// KV blocks in the pool; `None` derives it from `kv_cache_memory_bytes`.
    pub num_kv_blocks: Option<usize>,
    /// Memory budget for the KV cache when `num_kv_blocks` is `None` (CPU backend).
    pub kv_cache_memory_bytes: usize,
    /// Fraction of the GPU's total memory the engine may use (weights, workspaces and KV
    /// cache together); on CUDA, when `num_kv_blocks` is `None`, the KV pool takes what is
    /// free after the weights and workspaces minus `(1 - utilization) × total`.
    pub gpu_memory_utilization: f32,
    /// Where NVRTC-compiled kernels are cached on disk (CUDA); `None` compiles every start.
    pub kernel_cache_dir: Option<std::path::PathBuf>,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Context length; `None` uses the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Reuse KV blocks of identical prefixes.
    pub enable_prefix_caching: bool,
    /// Split long prompts across steps.
    pub enable_chunked_prefill: bool,
    /// Requests allowed to wait before submissions are refused (`QueueFull`).
    pub max_waiting: usize,
    /// Threads for the CPU backend; `None` uses every core.
    pub num_threads: Option<usize>,
    /// Keep prefix-cache events (blocks stored/evicted) for [`crate::EngineHandle::take_cache_events`];
    /// workers turn this on to feed the router's prefix index.
    pub record_cache_events: bool,
    /// CPU backend only: round to bf16 where the CUDA backend stores bf16
    /// ([`crate::backend::cpu::CpuBackend::emulating_bf16`]), the reference a bf16 GPU run is
    /// compared with token for token. Off for serving.
    pub cpu_emulates_bf16: bool,
    /// CUDA only: run every step op by op instead of replaying decode steps from CUDA graphs
    /// (vLLM's `--enforce-eager`), for debugging and comparisons.
    pub enforce_eager: bool,
    /// Plan each decode step while the one before it runs on the device (vLLM's
    /// `--async-scheduling`): the new step feeds the previous step's tokens from where they
    /// were sampled, and a request that stopped meanwhile has its extra row discarded. Only
    /// pure decode steps with nothing waiting for a seat are planned ahead; everything else is
    /// scheduled after the previous step's tokens are applied, as with this off.
    pub async_scheduling: bool,
    /// A step (one iteration of the engine loop) running longer than this makes the engine
    /// report itself stalled (`/health` 503, an unhealthy heartbeat) until it returns.
    pub stall_timeout: std::time::Duration,
    /// Fault injection for the liveness tests; `None` when serving.
    pub fault: Option<crate::fault::FaultInjection>,
    /// How long a KV link operation, a trailer held for its layers, or a gap in a link's
    /// layer notices may wait before the link is failed (its hand-offs then recompute).
    pub kv_transfer_timeout: std::time::Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_dtype: crate::kv_cache_dtype::KvCacheDtype::Auto,
            calculate_kv_scales: false,
            kv_k_smoothing: crate::kv_k_smoothing::KvKSmoothing::Auto,
            quantization: crate::weight_quantization::WeightQuantization::None,
            num_kv_blocks: None,
            kv_cache_memory_bytes: 1 << 30,
            gpu_memory_utilization: 0.9,
            kernel_cache_dir: None,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            max_waiting: 1024,
            num_threads: None,
            record_cache_events: false,
            cpu_emulates_bf16: false,
            enforce_eager: false,
            async_scheduling: true,
            // Generous: a long prompt's chunk on the CPU backend takes seconds, a GPU step
            // milliseconds; a minute without progress is a hang.
            stall_timeout: std::time::Duration::from_secs(60),
            fault: None,
            kv_transfer_timeout: crate::kv_connector::DEFAULT_TRANSFER_TIMEOUT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("auto".parse::<DeviceSpec>(), Ok(DeviceSpec::Auto));
        assert_eq!("CPU".parse::<DeviceSpec>(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(3)));
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
        assert!("tpu".parse::<DeviceSpec>().is_err());
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
    }
}
