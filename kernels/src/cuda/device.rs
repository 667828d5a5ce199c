//! [`CudaDevice`]: one GPU's context, its single stream, the cuBLAS handle, the loaded
//! kernels ([`KernelTable`]) and device memory (allocation, copies, growth). Every launcher
//! is handed one.
//!
//! Invariants: one context and one stream per device, and every launch, copy and GEMM is
//! enqueued on that stream, so stream order orders every read after its write (cudarc's
//! cross-stream event tracking is turned off); while a CUDA graph is being recorded
//! (`graph.rs`) the device refuses to allocate, upload or download; every allocation a graph
//! may use bumps [`CudaDevice::alloc_generation`].

use super::carveout::{CarveoutPins, CarveoutPolicy, CarveoutState};
use super::compile;
use super::error::CudaError;
use super::gemv::GEMV_L2_PREFETCH_DEFAULT;
use super::kernel_table::KernelTable;
use super::launch::shape_check;
use super::sources;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, DeviceRepr};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The one NVRTC target whose build of the warpgroup-MMA prefill kernel runs (wgmma needs the
/// architecture-specific Hopper target; other builds trap, see prefill_wg.cu).
const WGMMA_ARCH: &str = "sm_90a";
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Bytes of the workspace cuBLAS gets at open: given one, it allocates nothing per call, which
/// a GEMM recorded into a CUDA graph requires.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

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
    /// Which kernel modules to compile and load (default: every one).
    pub needs: sources::KernelNeeds,
}

/// One GPU: context, stream, cuBLAS handle and the loaded kernels.
pub struct CudaDevice {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) kernels: KernelTable,
    name: String,
    arch: String,
    /// Streaming multiprocessors, for sizing grids.
    sm_count: usize,
    compile_ms: f64,
    /// How each kernel module was obtained (cache or NVRTC) and what it cost.
    module_reports: Vec<compile::ModuleReport>,
    /// Whether a graph is being recorded on `stream` (see `graph.rs`).
    pub(crate) capturing: AtomicBool,
    /// Allocations made so far (see [`CudaDevice::alloc_generation`]).
    alloc_gen: AtomicU64,
    /// Whether kernels launch with programmatic dependent launch (see [`CudaDevice::pdl`]).
    pdl: AtomicBool,
    /// Whether the device can launch that way (compute capability 9.0 and later).
    pdl_capable: bool,
    /// Bytes of a skinny GEMM's weights pulled into L2 before it waits for the previous kernel
    /// (see [`CudaDevice::gemv_l2_prefetch`]).
    gemv_l2_prefetch: AtomicUsize,
    /// Whether the mixed-batch router sends prefill chunks to the warpgroup-MMA kernel where it
    /// applies (see [`CudaDevice::prefill_wgmma`]).
    prefill_wgmma: AtomicBool,
    /// Rows from which a RoPE launch groups heads into a CTA (see
    /// [`CudaDevice::rope_grouped_min_rows`]).
    rope_grouped_min_rows: AtomicUsize,
    /// Whether the default decode attention may take the streaming kernel
    /// ([`CudaDevice::stream_attention`]).
    stream_attention: AtomicBool,
    /// The shared-memory carve-outs the launches ask for ([`CudaDevice::carveout_pins`]).
    carveout: CarveoutState,
    /// cuBLAS's workspace; kept alive as long as the handle.
    _blas_workspace: CudaSlice<u8>,
    /// cuBLASLt with measured algorithm choice, when the library loads (see `lt.rs`).
    pub(crate) lt: Option<super::lt::LtGemm>,
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
        let arch = compile::device_arch(major, minor);
        let wgmma_capable = arch == WGMMA_ARCH;
        let name = ctx.name()?;
        let t0 = std::time::Instant::now();
        let (modules, module_reports) = compile::load_modules(&ctx, &arch, opts.cache_dir.as_deref(), &opts.needs)?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let by_module: HashMap<sources::Module, Arc<CudaModule>> = modules.into_iter().collect();
        let kernels = KernelTable::load(&opts.needs, |module, n| match by_module.get(&module) {
            Some(m) => Ok(m.load_function(n)?),
            None => Err(CudaError::Compile(format!("no module {} for kernel {n}", module.name()))),
        })?;
        kernels.prepare(major >= 9)?;
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
        let l2_bytes =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as usize;
        let lt = super::lt::LtGemm::new(&stream, l2_bytes)?;
        Ok(Self {
            ctx,
            stream,
            blas,
            kernels,
            name,
            arch,
            sm_count,
            compile_ms,
            module_reports,
            capturing: AtomicBool::new(false),
            alloc_gen: AtomicU64::new(0),
            // Hopper and later: kernels overlap their launch and prologue with the previous
            // kernel's tail (griddepcontrol needs sm_90).
            pdl: AtomicBool::new(major >= 9),
            gemv_l2_prefetch: AtomicUsize::new(GEMV_L2_PREFETCH_DEFAULT),
            pdl_capable: major >= 9,
            prefill_wgmma: AtomicBool::new(wgmma_capable),
            rope_grouped_min_rows: AtomicUsize::new(super::rope::ROPE_GROUPED_MIN_ROWS),
            stream_attention: AtomicBool::new(major >= 9),
            carveout: CarveoutState::new(),
            _blas_workspace: blas_workspace,
            lt,
        })
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The NVRTC target the kernels were built for (e.g. `sm_90a`).
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

    /// Milliseconds spent compiling or loading the kernel modules (wall time: modules compile
    /// in parallel), and whether every one came from the cache.
    pub fn module_load(&self) -> (f64, bool) {
        (self.compile_ms, self.module_reports.iter().all(|r| r.from_cache))
    }

    /// How each kernel module was obtained (cache or NVRTC), and its milliseconds.
    pub fn module_reports(&self) -> &[compile::ModuleReport] {
        &self.module_reports
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
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        self.not_capturing("allocating")?;
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the contents are unspecified by contract; every reader writes first.
        Ok(unsafe { self.stream.alloc::<T>(len.max(1)) }?)
    }

    /// [`CudaDevice::alloc`] for a buffer that no CUDA graph may ever use: it leaves
    /// [`CudaDevice::alloc_generation`] alone, so recorded graphs stay valid.
    pub(crate) fn alloc_outside_graphs<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        self.not_capturing("allocating")?;
        // SAFETY: as in `alloc`.
        Ok(unsafe { self.stream.alloc::<T>(len.max(1)) }?)
    }

    /// Replaces `buf` by one of at least `len` elements (a power of two, contents
    /// unspecified) when it is shorter; buffers only grow, so after the largest step they keep
    /// their addresses.
    pub(crate) fn grow<T: DeviceRepr>(&self, buf: &mut CudaSlice<T>, len: usize) -> Result<(), CudaError> {
        if buf.len() < len {
            *buf = self.alloc(len.next_power_of_two())?;
        }
        Ok(())
    }

    /// [`CudaDevice::grow`] for a buffer no CUDA graph uses (see
    /// [`CudaDevice::alloc_outside_graphs`]).
    pub(crate) fn grow_outside_graphs<T: DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        len: usize,
    ) -> Result<(), CudaError> {
        if buf.len() < len {
            *buf = self.alloc_outside_graphs(len.next_power_of_two())?;
        }
        Ok(())
    }

    /// Copies host data to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if data.is_empty() {
            return self.alloc(1);
        }
        self.not_capturing("uploading")?;
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        Ok(self.stream.clone_htod(data)?)
    }

    /// Copies `data` into the start of `dst` (which must be at least as long).
    pub fn upload_into<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<(), CudaError> {
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
    pub fn download<T: DeviceRepr + Default + Clone>(
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
    pub fn copy<T: DeviceRepr>(&self, src: &CudaSlice<T>, dst: &mut CudaSlice<T>, len: usize) -> Result<(), CudaError> {
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

    /// Whether a recording is in progress.
    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::SeqCst)
    }

    /// Whether kernels launch with programmatic dependent launch (on by default from compute
    /// capability 9.0, Hopper): each kernel may start while the previous one finishes and
    /// waits for it inside (`PDL_ENTER` in the prelude).
    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch on or off (for comparisons; a device below compute
    /// capability 9.0 ignores `on`). Recorded graphs hold the old launches, so this counts as
    /// an allocation for [`CudaDevice::alloc_generation`] and they are dropped.
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on && self.pdl_capable, Ordering::Relaxed);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether the attention router sends prefill chunks of a shape it computes (head_dim 128,
    /// bf16 cache, no options) to the warpgroup-MMA kernel (`prefill_wg.cu`) rather than the
    /// mma.sync one: on by default where the kernels were built for `sm_90a` (Hopper), the only
    /// target that runs it.
    pub fn prefill_wgmma(&self) -> bool {
        self.prefill_wgmma.load(Ordering::Relaxed)
    }

    /// Whether the streaming decode attention kernel (`paged_attention_st_*`, the bulk copy
    /// engine) can run here: sm_90 or later.
    pub fn stream_attention_capable(&self) -> bool {
        // The same condition as programmatic dependent launch: Hopper (sm_90) or later.
        self.pdl_capable
    }

    /// Whether the default decode attention launch takes the streaming kernel where the launch
    /// is large enough (`attn_default`): on by default where it can run
    /// ([`CudaDevice::stream_attention_capable`]).
    pub fn stream_attention(&self) -> bool {
        self.stream_attention.load(Ordering::Relaxed)
    }

    /// Turns [`CudaDevice::stream_attention`] on or off (for comparisons; ignored where the
    /// kernel cannot run). Recorded graphs hold the old launches, so this counts as an
    /// allocation for [`CudaDevice::alloc_generation`].
    pub fn set_stream_attention(&self, on: bool) {
        self.stream_attention.store(on && self.stream_attention_capable(), Ordering::Relaxed);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether the warpgroup-MMA prefill kernel can run here (kernels built for `sm_90a`).
    pub fn prefill_wgmma_capable(&self) -> bool {
        self.arch == WGMMA_ARCH
    }

    /// Turns [`CudaDevice::prefill_wgmma`] on or off (for comparisons; ignored off `sm_90a`).
    /// Recorded graphs hold the old launches, so this counts as an allocation for
    /// [`CudaDevice::alloc_generation`].
    pub fn set_prefill_wgmma(&self, on: bool) {
        self.prefill_wgmma.store(on && self.prefill_wgmma_capable(), Ordering::Relaxed);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// The shared-memory carve-outs the launches ask for now (`carveout.rs`): under the
    /// default [`CarveoutPolicy::PerStep`] those the backend set for the current step.
    pub fn carveout_pins(&self) -> CarveoutPins {
        self.carveout.pins()
    }

    /// The shared memory per SM decode attention's split rule plans CTAs in
    /// (`paged_attention::split_smem`): the SM's whole, or attention's pinned share when the
    /// pins say to plan in it.
    pub fn attention_split_smem(&self) -> usize {
        let pins = self.carveout.pins();
        super::paged_attention::split_smem(pins.attention.filter(|_| pins.split_by_pin))
    }

    /// Sets how the launches get their carve-out (for comparisons; the default is
    /// [`CarveoutPolicy::PerStep`]). Recorded graphs hold the old launches, so this counts as an
    /// allocation for [`CudaDevice::alloc_generation`].
    pub fn set_carveout_policy(&self, policy: CarveoutPolicy) {
        self.carveout.set_policy(policy);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Under [`CarveoutPolicy::PerStep`], the carve-out every launch of the step about to run
    /// asks for (`carveout::step_carveout`); ignored under a fixed policy. Not an allocation:
    /// the rule is a function of the step's shape, so a graph recorded for that shape holds
    /// the same pins.
    pub fn set_step_carveout(&self, pin: Option<u32>) {
        self.carveout.set_step(pin);
    }

    /// How many bytes of its weight matrix a skinny GEMM pulls into L2 before it waits for the
    /// previous kernel under programmatic dependent launch: at least its first round of loads
    /// (`gemv_prefetch_l2` in gemv.cu), at most the whole matrix, spread evenly over the rows.
    /// While the previous kernel is latency-bound (a norm, RoPE, attention over a short
    /// context) DRAM would otherwise idle; the weights are never written during a step.
    pub fn gemv_l2_prefetch(&self) -> usize {
        self.gemv_l2_prefetch.load(Ordering::Relaxed)
    }

    /// Sets [`CudaDevice::gemv_l2_prefetch`] (0: the first round only). Recorded graphs hold
    /// the old launches, so this counts as an allocation for [`CudaDevice::alloc_generation`].
    pub fn set_gemv_l2_prefetch(&self, bytes: usize) {
        self.gemv_l2_prefetch.store(bytes, Ordering::Relaxed);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Rows from which a RoPE + KV-write launch gives each CTA several heads of its row
    /// (`rope.rs`: `ROPE_HEADS_PER_CTA`) rather than one.
    pub fn rope_grouped_min_rows(&self) -> usize {
        self.rope_grouped_min_rows.load(Ordering::Relaxed)
    }

    /// Sets [`CudaDevice::rope_grouped_min_rows`] (for comparisons; the results are the same
    /// bits either way). Recorded graphs hold the old launches, so this counts as an
    /// allocation for [`CudaDevice::alloc_generation`].
    pub fn set_rope_grouped_min_rows(&self, rows: usize) {
        self.rope_grouped_min_rows.store(rows, Ordering::Relaxed);
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether cuBLASLt's FP8 (W8A8) products use fast accumulation (`lt.rs`; on by default);
    /// false without cuBLASLt.
    pub fn lt_fp8_fast_accum(&self) -> bool {
        self.lt.as_ref().is_some_and(|lt| lt.fp8_fast_accum())
    }

    /// Sets [`CudaDevice::lt_fp8_fast_accum`] (nothing to do without cuBLASLt). Recorded graphs
    /// hold the old plans, so this counts as an allocation for [`CudaDevice::alloc_generation`].
    pub fn set_lt_fp8_fast_accum(&self, on: bool) -> Result<(), CudaError> {
        if let Some(lt) = &self.lt {
            lt.set_fp8_fast_accum(on)?;
        }
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Which cuBLASLt configurations each new product shape is timed over (`lt.rs`,
    /// `lt_search.rs`; [`super::DEFAULT_SEARCH`] unless set); `None` without cuBLASLt.
    pub fn lt_search(&self) -> Result<Option<super::LtSearch>, CudaError> {
        self.lt.as_ref().map(|lt| lt.search()).transpose()
    }

    /// Sets [`CudaDevice::lt_search`] (nothing to do without cuBLASLt); every shape is timed
    /// again at its next eager call, and recorded graphs hold the old choices, so this counts as
    /// an allocation for [`CudaDevice::alloc_generation`].
    pub fn set_lt_search(&self, search: super::LtSearch) -> Result<(), CudaError> {
        if let Some(lt) = &self.lt {
            lt.set_search(search)?;
        }
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Whether cuBLASLt's candidates are timed with L2 flushed first (`lt.rs`,
    /// `LtGemm::flushed_timing`); false without cuBLASLt.
    pub fn lt_flushed_timing(&self) -> bool {
        self.lt.as_ref().is_some_and(|lt| lt.flushed_timing())
    }

    /// Sets [`CudaDevice::lt_flushed_timing`] (nothing to do without cuBLASLt); as
    /// [`CudaDevice::set_lt_search`], every shape is timed again and graphs are re-recorded.
    pub fn set_lt_flushed_timing(&self, on: bool) -> Result<(), CudaError> {
        if let Some(lt) = &self.lt {
            lt.set_flushed_timing(on)?;
        }
        self.alloc_gen.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// For benchmarks: the cuBLASLt candidates `search` gives for a bf16 product shape, each
    /// launchable with [`CudaDevice::lt_probe_launch`].
    pub fn lt_probe(&self, shape: super::LtShape, search: super::LtSearch) -> Result<super::LtProbe, CudaError> {
        let lt = self.lt.as_ref().ok_or_else(|| CudaError::BlasLt("cuBLASLt is not loaded".into()))?;
        lt.probe(&self.stream, shape, search)
    }

    /// Runs candidate `i` of `probe`: `out = x · wᵀ`.
    pub fn lt_probe_launch<O>(
        &self,
        probe: &super::LtProbe,
        i: usize,
        x: &CudaSlice<half::bf16>,
        w: &CudaSlice<half::bf16>,
        out: &mut CudaSlice<O>,
    ) -> Result<(), CudaError> {
        let lt = self.lt.as_ref().ok_or_else(|| CudaError::BlasLt("cuBLASLt is not loaded".into()))?;
        lt.probe_launch(&self.stream, probe, i, x, w, out)
    }

    /// How many device allocations this device has made; a graph recorded at one generation
    /// may hold pointers to buffers replaced since.
    pub fn alloc_generation(&self) -> u64 {
        self.alloc_gen.load(Ordering::SeqCst)
    }

    /// An error when a recording is in progress (for calls that must not be recorded).
    pub(crate) fn not_capturing(&self, what: &str) -> Result<(), CudaError> {
        if self.is_capturing() {
            return Err(CudaError::Capture(format!("{what} while recording a graph")));
        }
        Ok(())
    }
}
