//! The CUDA kernels: CUDA C sources under `kernels/cuda/`, compiled at run time with NVRTC
//! for the device's architecture, and typed launchers over `cudarc` device slices.
//!
//! Nothing here needs a CUDA toolkit at build time: `cudarc` loads the driver, NVRTC and
//! cuBLAS dynamically when a [`CudaDevice`] is opened. Compiled PTX is cached on disk in the
//! directory the caller passes (never read from the environment here), keyed by a hash of the
//! source, the target architecture, the NVRTC flags and the NVRTC version, so a source edit,
//! another GPU or another flag never reuses a stale module.
//!
//! Invariants: one [`CudaDevice`] owns one context and one stream; every launcher enqueues
//! on that stream, validates its sizes against the slices before launching and returns a
//! [`CudaError`] (never panics); storage is bf16 (the residual stream and the logits f32),
//! arithmetic f32.

mod compile;
mod gemv;
mod graph;
mod ops;
mod prefill;
mod sampling;
mod staging;
mod step_ids;
mod step_meta;
mod util;

pub use compile::compile_ptx;
pub use cudarc::driver::{CudaSlice, CudaStream};
pub use gemv::{GEMV_KERNEL_MAX_M, GEMV_VARIANTS, GemvVariant, gemv_default, gemv_supports};
pub use graph::StepGraph;
pub use half::bf16;
pub use ops::{
    ATTN_VARIANTS, AttentionMeta, AttnKind, AttnSplit, AttnVariant, HostSeq, KvGeometry, KvWriteMeta, StepMeta,
    attn_default, plan_splits,
};
pub use prefill::{
    PREFILL_DEFAULT_VARIANT, PREFILL_MAX_GROUP, PREFILL_MIN_TOKENS, PREFILL_WARPS, prefill_smem_bytes,
    prefill_supported,
};
pub use sampling::{DeviceOp, DeviceOpKind, DeviceRow, DeviceSample, SAMPLE_MAX_TOP, SAMPLE_MAX_VOCAB, SampleBuffers};
pub use step_ids::StepIds;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes of the workspace cuBLAS gets at open: given one, it allocates nothing per call, which
/// a GEMM recorded into a CUDA graph requires.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A CUDA failure, from the driver, NVRTC, cuBLAS, the kernel cache or a launcher's checks.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver library (libcuda) could not be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver library is not present on this machine")]
    NoDriver,
    /// A CUDA library the backend needs (NVRTC, cuBLAS) could not be loaded.
    #[error("the CUDA library {0} could not be loaded (set LD_LIBRARY_PATH to the toolkit's lib64)")]
    MissingLibrary(&'static str),
    /// A driver call failed (out of memory, launch failure, illegal address...).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC refused the kernel sources.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// cuBLAS failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// The on-disk kernel cache could not be used.
    #[error("kernel cache {path}: {message}")]
    Cache {
        /// The cache file or directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A call that must not happen while a CUDA graph is being recorded, or a failed recording.
    #[error("CUDA graph: {0}")]
    Capture(String),
    /// A launcher was given inconsistent sizes (a bug in the caller).
    #[error("{op}: {message}")]
    Shape {
        /// The op that refused its arguments.
        op: &'static str,
        /// What was inconsistent.
        message: String,
    },
}

pub(crate) fn shape_check(op: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok { Ok(()) } else { Err(CudaError::Shape { op, message: message() }) }
}

/// Whether the CUDA driver library can be loaded here. Cheap, creates no context; call it
/// before [`CudaDevice::open`] to decide between CUDA and CPU.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda and reports whether it succeeded.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// How to open a device.
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// Device ordinal.
    pub ordinal: usize,
    /// Where compiled kernels are cached; `None` compiles every time.
    pub cache_dir: Option<PathBuf>,
}

/// The kernels of the module, looked up once.
pub(crate) struct Funcs {
    pub embed: CudaFunction,
    pub rms_norm: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub silu_mul: CudaFunction,
    pub bias_add: CudaFunction,
    pub copy_cols: CudaFunction,
    pub gather_rows: CudaFunction,
    pub gather_rows_f32: CudaFunction,
    pub bf16_to_f32: CudaFunction,
    pub f32_to_bf16: CudaFunction,
    pub rope_write_kv: CudaFunction,
    pub rope_qkv_write_kv: CudaFunction,
    /// Paged attention: `[head_dim 16, 32, 64, 128][variant of ops::ATTN_VARIANTS]`.
    pub attention: Vec<Vec<CudaFunction>>,
    /// The merge of split-attention partials, per head_dim as above.
    pub attention_combine: Vec<CudaFunction>,
    /// Prefill flash attention: `[head_dim of prefill::PREFILL_HEAD_DIMS][variant of PREFILL_WARPS]`.
    pub prefill: Vec<Vec<CudaFunction>>,
    /// Skinny GEMM: `[up to 8, up to 16 rows of x][variant of gemv::GEMV_VARIANTS]`, each
    /// `[bf16 out, f32 out]`.
    pub gemv: [Vec<[CudaFunction; 2]>; 2],
    /// Sampling, one CTA per row (sampling.cu).
    pub sample_rows: CudaFunction,
    /// Sampled tokens into the next step's ids (sampling.cu).
    pub take_sampled_ids: CudaFunction,
    /// Counter-generated random weights (util.cu).
    pub fill_counter: CudaFunction,
    /// A timed wait (util.cu).
    pub spin: CudaFunction,
}

/// One GPU: context, stream, cuBLAS handle and the loaded kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: Funcs,
    name: String,
    arch: String,
    /// Streaming multiprocessors, for sizing grids.
    pub(crate) sm_count: usize,
    compile_ms: f64,
    from_cache: bool,
    /// Whether a graph is being recorded on `stream` (see `graph.rs`).
    capturing: AtomicBool,
    /// Allocations made so far (see [`CudaDevice::alloc_generation`]).
    alloc_gen: AtomicU64,
    /// cuBLAS's workspace; kept alive as long as the handle.
    _blas_workspace: cudarc::driver::CudaSlice<u8>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("name", &self.name).field("arch", &self.arch).finish()
    }
}

impl CudaDevice {
    /// Opens device `opts.ordinal`: creates its context and stream, compiles (or loads from
    /// the cache) the kernels for its architecture, and creates the cuBLAS handle.
    pub fn open(opts: &CudaOptions) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        // cudarc panics on the first call into a library it cannot load, so check each first.
        // SAFETY: these only try to dlopen the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::MissingLibrary("nvrtc"));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::MissingLibrary("cublas"));
        }
        let ctx = CudaContext::new(opts.ordinal)?;
        // One stream only: cudarc's cross-stream event tracking is unnecessary work per launch.
        // SAFETY: every buffer of this context is used on `stream` alone, so stream order
        // already orders every read after its write.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        // The `a` targets unlock wgmma/setmaxnreg; PTX for them only runs on that exact chip.
        let arch = if major >= 9 { format!("compute_{major}{minor}a") } else { format!("compute_{major}{minor}") };
        let name = ctx.name()?;
        let t0 = std::time::Instant::now();
        let (module, from_cache) = compile::load_module(&ctx, &arch, opts.cache_dir.as_deref())?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let f = |n: &str| module.load_function(n);
        let funcs = Funcs {
            embed: f("embed_f32")?,
            rms_norm: f("rms_norm_f32")?,
            add_rms_norm: f("add_rms_norm_f32")?,
            silu_mul: f("silu_mul_bf16")?,
            bias_add: f("bias_add_bf16")?,
            copy_cols: f("copy_cols_bf16")?,
            gather_rows: f("gather_rows_bf16")?,
            gather_rows_f32: f("gather_rows_f32")?,
            bf16_to_f32: f("bf16_to_f32")?,
            f32_to_bf16: f("f32_to_bf16")?,
            rope_write_kv: f("rope_write_kv_bf16")?,
            rope_qkv_write_kv: f("rope_qkv_write_kv_bf16")?,
            attention: [16, 32, 64, 128]
                .iter()
                .map(|hd| ops::ATTN_VARIANTS.iter().map(|v| f(&v.kernel_name(*hd))).collect::<Result<Vec<_>, _>>())
                .collect::<Result<Vec<_>, _>>()?,
            attention_combine: [16, 32, 64, 128]
                .iter()
                .map(|hd| f(&format!("attention_combine_hd{hd}")))
                .collect::<Result<Vec<_>, _>>()?,
            prefill: prefill::load_funcs(&f)?,
            gemv: [gemv_funcs(&f, 8)?, gemv_funcs(&f, 16)?],
            sample_rows: f("sample_rows")?,
            take_sampled_ids: f("take_sampled_ids")?,
            fill_counter: f("fill_counter_bf16")?,
            spin: f("spin_ns")?,
        };
        let blas = CudaBlas::new(stream.clone())?;
        // SAFETY: cuBLAS only scratches in the workspace; its contents never matter.
        let blas_workspace = unsafe { stream.alloc::<u8>(CUBLAS_WORKSPACE_BYTES) }?;
        {
            let (ptr, _guard) = cudarc::driver::DevicePtr::device_ptr(&blas_workspace, &stream);
            // SAFETY: the handle and the buffer both live as long as this device (the buffer
            // is kept in `_blas_workspace`), and both belong to `stream`.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            name,
            arch,
            sm_count,
            compile_ms,
            from_cache,
            capturing: AtomicBool::new(false),
            alloc_gen: AtomicU64::new(0),
            _blas_workspace: blas_workspace,
        })
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The NVRTC target the kernels were built for (e.g. `compute_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Free and total device memory in bytes, as the driver reports them now.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.bind_to_thread()?;
        Ok(self.ctx.mem_get_info()?)
    }

    /// Milliseconds spent compiling or loading the kernel module, and whether it came from the cache.
    pub fn module_load(&self) -> (f64, bool) {
        (self.compile_ms, self.from_cache)
    }

    /// The stream every launcher enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes this device's context current on the calling thread (the engine thread is not
    /// the one that opened the device).
    pub fn bind(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Waits for all enqueued work; surfaces any asynchronous kernel fault.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// A device buffer of `len` elements with unspecified contents (`len` 0 allocates one).
    pub fn alloc<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        self.not_capturing("allocating")?;
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the contents are unspecified by contract; every reader writes first.
        Ok(unsafe { self.stream.alloc::<T>(len.max(1)) }?)
    }

    /// [`CudaDevice::alloc`] for a buffer that no CUDA graph may ever use: it leaves
    /// [`CudaDevice::alloc_generation`] alone, so recorded graphs stay valid.
    pub(crate) fn alloc_outside_graphs<T: cudarc::driver::DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.not_capturing("allocating")?;
        // SAFETY: as in `alloc`.
        Ok(unsafe { self.stream.alloc::<T>(len.max(1)) }?)
    }

    /// Copies host data to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if data.is_empty() {
            return self.alloc(1);
        }
        self.not_capturing("uploading")?;
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        Ok(self.stream.clone_htod(data)?)
    }

    /// Copies `data` into the start of `dst` (which must be at least as long).
    pub fn upload_into<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        self.not_capturing("uploading")?;
        shape_check("upload_into", dst.len() >= data.len(), || {
            format!("{} values into a buffer of {}", data.len(), dst.len())
        })?;
        if data.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(..data.len());
        Ok(self.stream.memcpy_htod(data, &mut view)?)
    }

    /// Copies the first `len` elements of `src` to the host (synchronizes the stream).
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.not_capturing("downloading")?;
        shape_check("download", src.len() >= len, || format!("{len} values from a buffer of {}", src.len()))?;
        let mut out = vec![T::default(); len];
        if len > 0 {
            self.stream.memcpy_dtoh(&src.slice(..len), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Device-to-device copy of the first `len` elements.
    pub fn copy<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
        len: usize,
    ) -> Result<(), CudaError> {
        shape_check("copy", src.len() >= len && dst.len() >= len, || {
            format!("{len} values from {} into {}", src.len(), dst.len())
        })?;
        if len == 0 {
            return Ok(());
        }
        let mut d = dst.slice_mut(..len);
        Ok(self.stream.memcpy_dtod(&src.slice(..len), &mut d)?)
    }

    /// A timing event on this device's stream.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        Ok(self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }
}

/// The bf16- and f32-output kernels of every gemv variant for up to `max_m` rows of x.
fn gemv_funcs<E>(f: &impl Fn(&str) -> Result<CudaFunction, E>, max_m: usize) -> Result<Vec<[CudaFunction; 2]>, E> {
    gemv::GEMV_VARIANTS
        .iter()
        .map(|v| Ok([f(&v.kernel_name(max_m, false))?, f(&v.kernel_name(max_m, true))?]))
        .collect()
}

/// The kernel cache file for `key` under `dir`.
pub(crate) fn cache_file(dir: &Path, key: u128) -> PathBuf {
    dir.join(format!("{key:032x}.ptx"))
}
