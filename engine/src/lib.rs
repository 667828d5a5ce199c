//! The Baton engine: the model runner and the architectures (one per file, behind a
//! registry) over a backend trait, the CPU and CUDA backends, and the engine thread with
//! its async handle.
//!
//! [`start_engine`] loads a model's weights into a backend, sizes the paged KV
//! cache, and spawns the engine thread, which owns the backend and the
//! scheduler; the returned [`EngineHandle`] implements
//! [`baton_core::api::EngineClient`] and is what every frontend talks to.

pub mod backend;
pub mod batch;
pub mod config;
mod engine_loop;
pub mod fault;
mod gpu_memory;
mod grammar_pool;
mod handle;
pub mod kv_cache_dtype;
pub mod kv_connector;
pub mod kv_k_smoothing;
pub mod kv_transport;
mod liveness;
pub mod models;
pub mod relay;
pub mod runner;
mod step_timing;
mod structured;
pub mod synthetic;
pub mod weight_quantization;

pub use config::{DeviceSpec, EngineConfig, ParseDeviceError};
pub use fault::{FaultInjection, FaultKind};
pub use handle::EngineHandle;
pub use liveness::EngineHealth;
pub use step_timing::StepTiming;

use baton_core::api::{EngineInfo, EngineStats};
use baton_core::kv_transfer::{KvDtype, KvLayout};
use baton_core::scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
use baton_formats::LoadedModel;
use engine_loop::{EngineLoop, Shared};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    /// The requested device cannot be used.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: DeviceSpec,
        /// Why not.
        reason: String,
    },
    /// A configuration value is inconsistent with the model or with itself.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// Loading the weights failed.
    #[error(transparent)]
    Model(#[from] models::ModelLoadError),
    /// The backend failed while setting up.
    #[error(transparent)]
    Backend(#[from] backend::BackendError),
    /// The OS refused a thread.
    #[error("could not start the engine thread: {0}")]
    Thread(String),
}

/// Resolves `auto` to a concrete device: CUDA device 0 when the CUDA driver library loads
/// and reports at least one device, else the CPU; the choice and its reason are logged.
/// `Cuda(n)` is checked the same way and refused with a clear reason when it cannot work.
pub fn resolve_device(spec: DeviceSpec) -> Result<DeviceSpec, EngineStartError> {
    match spec {
        DeviceSpec::Cpu => Ok(DeviceSpec::Cpu),
        DeviceSpec::Auto => match cuda_device_count() {
            Ok(n) if n > 0 => {
                tracing::info!(devices = n, "device auto: CUDA driver present, using cuda:0");
                Ok(DeviceSpec::Cuda(0))
            }
            Ok(_) => {
                tracing::info!("device auto: CUDA driver present but it reports no device, using the CPU");
                Ok(DeviceSpec::Cpu)
            }
            Err(reason) => {
                tracing::info!(%reason, "device auto: using the CPU");
                Ok(DeviceSpec::Cpu)
            }
        },
        DeviceSpec::Cuda(n) => match cuda_device_count() {
            Ok(count) if n < count => Ok(spec),
            Ok(count) => Err(EngineStartError::DeviceUnavailable {
                device: spec,
                reason: format!("the CUDA driver reports {count} device(s)"),
            }),
            Err(reason) => Err(EngineStartError::DeviceUnavailable { device: spec, reason }),
        },
    }
}

/// Devices the CUDA driver reports; an error when the driver library is absent or fails.
fn cuda_device_count() -> Result<usize, String> {
    // Checked before any driver call: cudarc panics on a call into a library it cannot load.
    if !baton_kernels::cuda::driver_present() {
        return Err("no CUDA driver library (libcuda) on this machine".into());
    }
    cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| format!("the CUDA driver failed to initialise: {e}"))
}

/// Loads `model` onto `device`, allocates the KV cache and starts the engine thread.
pub fn start_engine(
    model: &LoadedModel,
    device: DeviceSpec,
    config: EngineConfig,
) -> Result<EngineHandle, EngineStartError> {
    let started = std::time::Instant::now();
    let device = resolve_device(device)?;
    let max_model_len = config.max_model_len.unwrap_or(model.config.max_position_embeddings);
    // What the engine runs: the model as served up to `max_model_len` (LongRoPE's factor list
    // depends on it).
    let mut served = model.config.with_served_context(max_model_len);
    config.quantization.apply(&mut served);
    let cfg = &served;
    if max_model_len == 0 {
        return Err(EngineStartError::Config("max_model_len must be positive".into()));
    }
    if max_model_len > cfg.max_position_embeddings {
        return Err(EngineStartError::Config(format!(
            "max_model_len {max_model_len} exceeds the model's max_position_embeddings {}",
            cfg.max_position_embeddings
        )));
    }
    if config.calculate_kv_scales && config.kv_cache_dtype != kv_cache_dtype::KvCacheDtype::Fp8E4M3 {
        return Err(EngineStartError::Config(format!(
            "--calculate-kv-scales needs --kv-cache-dtype fp8 (the KV cache is {})",
            config.kv_cache_dtype
        )));
    }
    if config.block_size == 0 || config.block_size > 1024 {
        return Err(EngineStartError::Config(format!("block_size must be in [1, 1024], got {}", config.block_size)));
    }
    let threads =
        config.num_threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("baton-cpu-{i}"))
        .build()
        .map_err(|e| EngineStartError::Thread(e.to_string()))?;
    let calibration = smoothing_tokens(model, config.kv_cache_dtype, config.kv_k_smoothing);
    let (model_box, num_blocks, device_name, kv_dtype): (Box<dyn engine_loop::StepModel>, usize, String, KvDtype) =
        match device {
            DeviceSpec::Cuda(ordinal) => {
                let opts = baton_kernels::cuda::CudaOptions {
                    ordinal,
                    cache_dir: config.kernel_cache_dir.clone(),
                    needs: backend::cuda::kernel_needs(cfg),
                };
                let mut backend = backend::cuda::CudaBackend::new(&opts)?;
                backend.set_graphs(!config.enforce_eager);
                let mut llama = runner::ModelRunner::load(cfg, model.weights.as_ref(), backend)?;
                llama.set_kv_cache_dtype(config.kv_cache_dtype, model.weights.as_ref())?;
                let kv_started = std::time::Instant::now();
                let config = gpu_memory::size_from_free_memory(&mut llama, &config)?;
                let sized = size_kv(llama, &config, max_model_len, (&calibration, &pool))?;
                log_phase("kv_cache", kv_started);
                sized
            }
            DeviceSpec::Cpu | DeviceSpec::Auto => {
                let backend = if config.cpu_emulates_bf16 {
                    backend::cpu::CpuBackend::emulating_bf16()
                } else {
                    backend::cpu::CpuBackend::new()
                };
                let mut llama = pool.install(|| runner::ModelRunner::load(cfg, model.weights.as_ref(), backend))?;
                llama.set_kv_cache_dtype(config.kv_cache_dtype, model.weights.as_ref())?;
                let kv_started = std::time::Instant::now();
                let sized = size_kv(llama, &config, max_model_len, (&calibration, &pool))?;
                log_phase("kv_cache", kv_started);
                sized
            }
        };
    let sched_cfg = SchedulerConfig {
        block_size: config.block_size,
        num_blocks,
        max_num_seqs: config.max_num_seqs,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_model_len,
        enable_chunked_prefill: config.enable_chunked_prefill,
        enable_prefix_caching: config.enable_prefix_caching,
        policy: SchedulingPolicy::Fcfs,
        max_waiting: config.max_waiting,
    };
    let mut scheduler = Scheduler::new(sched_cfg).map_err(|e| EngineStartError::Config(e.to_string()))?;
    scheduler.record_cache_events(config.record_cache_events);
    let kv_layout = KvLayout {
        num_layers: cfg.num_hidden_layers,
        block_size: config.block_size,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        dtype: kv_dtype,
    };
    let mut eos: Vec<u32> = model.generation.eos_token_ids.clone();
    for e in &cfg.eos_token_ids {
        if !eos.contains(e) {
            eos.push(*e);
        }
    }
    let info = EngineInfo {
        max_model_len,
        vocab_size: cfg.vocab_size,
        block_size: config.block_size,
        num_blocks,
        eos_token_ids: eos.clone(),
        device: device_name,
    };
    let shared = Arc::new(Shared {
        stats: Mutex::new(EngineStats { num_total_blocks: num_blocks, ..Default::default() }),
        liveness: liveness::Liveness::new(config.stall_timeout),
        reservations: Mutex::new(Default::default()),
        pending: AtomicUsize::new(0),
        cache_events: Mutex::new(Vec::new()),
        timing: Mutex::new(StepTiming::default()),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let model_box: Box<dyn engine_loop::StepModel> = match config.fault {
        Some(fault) => Box::new(fault::FaultyModel::new(model_box, fault)),
        None => model_box,
    };
    let connector = Box::new(kv_connector::RelayConnector::new(kv_layout, config.kv_transfer_timeout));
    let mut engine =
        EngineLoop::new(scheduler, model_box, rx, shared.clone(), eos, pool, kv_layout, cfg.vocab_size, connector);
    engine.async_scheduling = config.async_scheduling;
    let grammars =
        grammar_pool::GrammarPool::start(model.tokenizer.clone(), info.eos_token_ids.clone(), cfg.vocab_size)
            .map_err(|e| EngineStartError::Thread(e.to_string()))?;
    let boundary = shared.clone();
    // Dropped when the thread's body returns (or unwinds): what the last handle's drop waits for.
    let (exited_tx, exited) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("baton-engine".into())
        .spawn(move || {
            let _exited = exited_tx;
            run_engine_thread(engine, &boundary)
        })
        .map_err(|e| EngineStartError::Thread(e.to_string()))?;
    tracing::info!(device = %device, num_blocks, block_size = config.block_size, kv_tokens = num_blocks * config.block_size, max_model_len, threads, "engine started");
    // CUDA graphs are recorded by the first decode step of each batch size, not here.
    log_phase("engine", started);
    Ok(EngineHandle::new(tx, shared, info, kv_layout, config.max_waiting, thread, exited, grammars))
}

/// Logs one phase of start-up, `started` until now, in the format every phase uses
/// (`startup phase phase=NAME ms=N`, what `bench_startup` reads back).
pub fn log_phase(phase: &'static str, started: std::time::Instant) {
    tracing::info!(phase, ms = format_args!("{:.0}", started.elapsed().as_secs_f64() * 1e3), "startup phase");
}

/// The engine thread's boundary: runs the loop and records how it ended. A panic is caught
/// here, so the handle reports it instead of a healthy engine that never answers; it is
/// recorded before the requests still in the loop are failed (the loop is owned out here, so
/// unwinding does not close their channels first).
fn run_engine_thread(mut engine: EngineLoop, shared: &Shared) {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run())) {
        Ok(()) => shared.liveness.end(EngineHealth::Stopped),
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            tracing::error!(%message, "the engine thread panicked; the engine reports unhealthy");
            shared.liveness.end(EngineHealth::Panicked(message.clone()));
            let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.fail_after_panic(baton_core::api::EngineError::Backend(format!(
                    "the engine thread panicked: {message}"
                )))
            }));
            if failed.is_err() {
                tracing::error!("failing the requests after the panic panicked too; their streams just end");
            }
        }
    }
}

/// The tokens of the key-smoothing calibration text ([`kv_k_smoothing::CALIBRATION_TEXT`])
/// when an FP8 cache is asked for with smoothing on: `Ok(None)` when it is not asked for,
/// `Err(reason)` when it cannot be encoded (no tokenizer).
fn smoothing_tokens(
    model: &baton_formats::LoadedModel,
    dtype: kv_cache_dtype::KvCacheDtype,
    smoothing: kv_k_smoothing::KvKSmoothing,
) -> Result<Option<Vec<u32>>, String> {
    if dtype != kv_cache_dtype::KvCacheDtype::Fp8E4M3 || smoothing == kv_k_smoothing::KvKSmoothing::Off {
        return Ok(None);
    }
    let tokenizer = model.tokenizer.as_ref().ok_or("the model has no tokenizer to encode the calibration text")?;
    let encoded = tokenizer
        .encode(kv_k_smoothing::CALIBRATION_TEXT, true)
        .map_err(|e| format!("the calibration text does not encode: {e}"))?;
    Ok(Some(encoded))
}

/// Sizes the KV pool for `llama` (at its cache's element type), allocates it, smooths an FP8
/// cache's keys from `calibration`'s tokens (see [`smoothing_tokens`]; run in `pool`), and
/// boxes the model.
fn size_kv<B: backend::Backend>(
    mut llama: runner::ModelRunner<B>,
    config: &EngineConfig,
    max_model_len: usize,
    (calibration, pool): (&Result<Option<Vec<u32>>, String>, &rayon::ThreadPool),
) -> Result<(Box<dyn engine_loop::StepModel>, usize, String, KvDtype), EngineStartError> {
    let shape = llama.kv_shape(1, config.block_size);
    let num_blocks = config.num_kv_blocks.unwrap_or(shape.blocks_in(config.kv_cache_memory_bytes));
    let needed = max_model_len.div_ceil(config.block_size);
    if num_blocks < needed {
        return Err(EngineStartError::Config(format!(
            "the KV cache has {num_blocks} blocks ({} tokens) but one sequence of max_model_len {max_model_len} needs {needed}; raise the KV budget or lower --max-model-len",
            num_blocks * config.block_size
        )));
    }
    llama.alloc_kv_cache(num_blocks, config.block_size)?;
    // Before the scale calibration arms: this prefill must not set the scales.
    let smoothed = match calibration {
        Ok(None) => None,
        Ok(Some(tokens)) => {
            let started = std::time::Instant::now();
            let geometry = (num_blocks, config.block_size);
            let done = pool.install(|| kv_k_smoothing::calibrate(&mut llama, tokens, geometry, max_model_len))?;
            log_phase("kv_k_smoothing", started);
            Some(done)
        }
        Err(why) => Some(kv_k_smoothing::Smoothing::Unshifted(why.clone())),
    };
    match smoothed {
        Some(kv_k_smoothing::Smoothing::Shifted { tokens, retained, max_abs }) => tracing::info!(
            tokens,
            retained,
            max_abs_shift = max_abs,
            "FP8 KV keys smoothed: each layer's keys are stored less their mean (--kv-k-smoothing off turns it off)"
        ),
        Some(kv_k_smoothing::Smoothing::Unshifted(reason)) => {
            tracing::info!(%reason, "FP8 KV keys stored unshifted (no key smoothing)")
        }
        None => {}
    }
    // After the CUDA profiling step (its dummy tokens must not calibrate anything).
    if config.calculate_kv_scales {
        llama.calculate_kv_scales()?;
    }
    let name = llama.device_name();
    let dtype = llama.kv_dtype();
    Ok((Box::new(llama), num_blocks, name, dtype))
}

#[cfg(test)]
mod device_tests {
    use super::*;

    #[test]
    fn device_resolution_never_fails_for_auto_and_refuses_missing_gpus() {
        // Holds with and without a GPU: auto always resolves to something usable, and no
        // machine has device 4096.
        let auto = resolve_device(DeviceSpec::Auto).expect("auto resolves");
        assert!(matches!(auto, DeviceSpec::Cpu | DeviceSpec::Cuda(0)));
        assert_eq!(auto == DeviceSpec::Cpu, cuda_device_count().map_or(true, |n| n == 0));
        let err = resolve_device(DeviceSpec::Cuda(4096)).expect_err("device 4096 refused");
        assert!(matches!(err, EngineStartError::DeviceUnavailable { .. }), "{err}");
        assert_eq!(resolve_device(DeviceSpec::Cpu).expect("cpu"), DeviceSpec::Cpu);
    }
}
