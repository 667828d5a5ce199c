//! cuBLASLt GEMMs with the algorithm chosen by measurement ([`LtGemm`]), for the batched decode
//! shapes (17 to 512 rows) where plain cuBLAS leaves bandwidth unused: measured on an H100 at
//! b = 64, its pick for the o projection (4096 × 4096) read the weights at 63 % of copy and
//! the qkv one at 69 %, plausibly a tile choice with too few CTAs for a 64-row product.
//!
//! For each shape (rows, output width, reduction length, output type) the first call asks
//! cuBLASLt's heuristic for up to [`CANDIDATES`] algorithms, times each on the call's own
//! operands ([`TIMED_REPS`] runs after a warm-up, CUDA events) and keeps the fastest; the last
//! run leaves the product in `out`, so the first call is the op too. Later calls of the shape
//! launch the kept algorithm. A shape met first while a CUDA graph is being recorded (no
//! timing is possible then) takes the heuristic's first choice and is timed at its next
//! eager call. Each timed run starts from an idle stream (its launch latency is in the figure) on
//! weights the previous run left in L2. Two other rules were measured on an H100 and chose
//! nothing faster: L2 scrubbed before each run (Llama-3.1-8B FP8, b=256: 13.68 ms a step against
//! 13.61; 4d14f82), and each run queued behind a write over twice the L2
//! ([`LtGemm::set_flushed_timing`], off by default; session 33: every step within the ±1 % two
//! isolated tunings differ by).
//!
//! Which configurations are timed is [`LtSearch`] (`lt_search.rs`): the heuristic's first
//! [`CANDIDATES`] by default. Session 33 timed, per 8B decode product at 32-256 rows, the
//! heuristic's picks, their split-K variants and 1,500 configurations of the exhaustive walk
//! from DRAM (`kernels/examples/cuda_bench_lt.rs`): none beat the heuristic's best by more than
//! 0.8 µs, so the wider searches are for benchmarks.
//!
//! The same machinery runs the W8A8 FP8 product ([`LtShape::fp8`]): E4M3 weights and E4M3
//! activations (quantized per token by `quantize_rows_e4m3`), f32 accumulation (cuBLASLt's fast
//! mode by default, [`LtGemm::set_fp8_fast_accum`]), bf16 out, the
//! weights' per-row and the activations' per-token scales applied by cuBLASLt as "outer
//! vector" scales (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`, CUDA 12.9+); their device
//! pointers are set on the descriptor before each launch.
//!
//! Invariants: every descriptor lives as long as its [`Plan`]; the GEMMs run on the device's
//! stream with this module's own workspace (fixed at open, so nothing is allocated per call
//! and the launches can be recorded); a shape no algorithm supports is an error the caller
//! turns into plain cuBLAS.

use super::lt_search::{self, LtAlgoInfo, LtDescs, LtSearch};
use super::{CudaError, CudaSlice};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Algorithms asked of the heuristic and timed per shape.
pub const CANDIDATES: usize = 12;
/// Timed runs per candidate (after one warm-up); the median decides.
pub const TIMED_REPS: usize = 5;
/// What a new shape is timed over unless [`LtGemm::set_search`] says otherwise.
pub const DEFAULT_SEARCH: LtSearch = LtSearch::Heuristic(CANDIDATES);
/// Whether candidates are timed with L2 flushed first unless [`LtGemm::set_flushed_timing`]
/// says otherwise.
pub const DEFAULT_FLUSHED_TIMING: bool = false;
/// The least flush buffer (bytes), for a device that reports no L2 size.
const MIN_FLUSH_BYTES: usize = 64 << 20;
/// Bytes of the cuBLASLt workspace (split-K algorithms keep partial sums there).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A product's shape: `m` rows of x, `n` rows of w, reduction `k`, f32 (or bf16) output, bf16
/// (or FP8) operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtShape {
    /// Rows of x and of the output.
    pub m: usize,
    /// Rows of w: columns of the output.
    pub n: usize,
    /// Columns of x and of w.
    pub k: usize,
    /// Whether the output is f32 (else bf16).
    pub f32_out: bool,
    /// Whether the operands are E4M3 with outer-vector scales (W8A8; bf16 output), else bf16.
    pub fp8: bool,
}

/// The outer-vector scales of an FP8 product: one per row of w (`n`) and one per row of x
/// (`m`).
#[derive(Clone, Copy)]
pub(crate) struct LtScales<'a> {
    /// `n` f32: the weights' per-row scales.
    pub w: &'a CudaSlice<f32>,
    /// `m` f32: the activations' per-token scales.
    pub x: &'a CudaSlice<f32>,
}

/// The descriptors and the chosen algorithm of one shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    candidates: Vec<sys::cublasLtMatmulHeuristicResult_t>,
    /// What each candidate is (same order).
    infos: Vec<LtAlgoInfo>,
    /// Index in `candidates` of the one measured fastest; `None` until measured.
    chosen: Option<usize>,
}

// SAFETY: the descriptors are plain heap objects of cuBLASLt, used only under the mutex.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created for this plan and is destroyed once; errors at
        // teardown are ignored (nothing to do about them).
        unsafe {
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.d);
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// The cuBLASLt handle, its workspace and the plans per shape.
pub(crate) struct LtGemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<LtShape, Plan>>,
    /// Whether FP8 products accumulate in the tensor cores' fast mode (see
    /// [`LtGemm::set_fp8_fast_accum`]).
    fp8_fast_accum: AtomicBool,
    /// The configurations each new shape is timed over ([`LtGemm::set_search`]).
    search: Mutex<LtSearch>,
    /// Whether each timed run follows a write over a buffer larger than L2
    /// ([`LtGemm::set_flushed_timing`]).
    flushed: AtomicBool,
    /// Bytes of that buffer: twice the L2.
    flush_bytes: usize,
    /// The buffer, allocated at the first flushed timing (on the stream, outside the device's
    /// allocation count: no graph points at it).
    flush: Mutex<Option<CudaSlice<u8>>>,
}

// SAFETY: the handle is used from one stream and every use holds the `plans` mutex.
unsafe impl Send for LtGemm {}
// SAFETY: as above.
unsafe impl Sync for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created in `new`, destroyed once, after every plan.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// What one [`LtGemm::run`] did, for benchmarks: the candidates timed (microseconds each)
/// when this call chose the algorithm.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LtChoice {
    /// Microseconds of each candidate, in the heuristic's order (empty: nothing timed).
    pub timed_us: Vec<f64>,
    /// The candidate kept.
    pub chosen: usize,
}

fn lt_err(e: cudarc::cublaslt::result::CublasError) -> CudaError {
    CudaError::BlasLt(format!("{e:?}"))
}

impl LtGemm {
    /// A handle and a workspace on `stream`; `None` when cuBLASLt cannot be loaded.
    /// `l2_bytes` is the device's L2 size (what a flushed timing writes over, twice).
    pub fn new(stream: &std::sync::Arc<CudaStream>, l2_bytes: usize) -> Result<Option<Self>, CudaError> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        let handle = result::create_handle().map_err(lt_err)?;
        // SAFETY: the workspace's contents never matter.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }?;
        Ok(Some(Self {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
            fp8_fast_accum: AtomicBool::new(true),
            search: Mutex::new(DEFAULT_SEARCH),
            flushed: AtomicBool::new(DEFAULT_FLUSHED_TIMING),
            flush_bytes: (2 * l2_bytes).max(MIN_FLUSH_BYTES),
            flush: Mutex::new(None),
        }))
    }

    /// Whether FP8 (W8A8) products run with cuBLASLt's fast accumulation
    /// (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`: the tensor cores' FP8 partial sums are not promoted to
    /// full f32 at every step), as vLLM's and TensorRT-LLM's Hopper FP8 GEMMs do by default. On
    /// by default: on an H100 (02ae33f) it took the 8B shape's 2,048-token TTFT from 35.0 to
    /// 32.1 ms and its b=256 decode step from 13.33 to 12.96 ms, while the products' relative
    /// error against the f32 reference went from 1.68e-3 to 2.20e-3 at k = 4,096 (1.91e-3 at
    /// 1,792; `gpu_fp8_w8a8_matches_the_per_token_reference` checks both settings).
    pub fn fp8_fast_accum(&self) -> bool {
        self.fp8_fast_accum.load(Ordering::Relaxed)
    }

    /// Sets [`LtGemm::fp8_fast_accum`]; forgets every plan (each shape is planned and timed
    /// again at its next call).
    pub fn set_fp8_fast_accum(&self, on: bool) -> Result<(), CudaError> {
        self.fp8_fast_accum.store(on, Ordering::Relaxed);
        self.plans.lock().map_err(|_| CudaError::BlasLt("the plans' lock is poisoned".into()))?.clear();
        Ok(())
    }

    /// The configurations each new shape is timed over.
    pub fn search(&self) -> Result<LtSearch, CudaError> {
        Ok(*self.search.lock().map_err(|_| CudaError::BlasLt("the search's lock is poisoned".into()))?)
    }

    /// Sets [`LtGemm::search`]; forgets every plan, as [`LtGemm::set_fp8_fast_accum`] does.
    pub fn set_search(&self, search: LtSearch) -> Result<(), CudaError> {
        *self.search.lock().map_err(|_| CudaError::BlasLt("the search's lock is poisoned".into()))? = search;
        self.plans.lock().map_err(|_| CudaError::BlasLt("the plans' lock is poisoned".into()))?.clear();
        Ok(())
    }

    /// Whether candidates are timed "flushed": each timed run queued right behind a write over
    /// twice the L2, so that it starts on a busy stream (no host launch latency in the figure)
    /// with its weights out of L2, as inside a captured decode step. Otherwise each run is
    /// timed from an idle stream, launch latency included, with the weights left in L2 by the
    /// run before.
    pub fn flushed_timing(&self) -> bool {
        self.flushed.load(Ordering::Relaxed)
    }

    /// Sets [`LtGemm::flushed_timing`]; forgets every plan, as [`LtGemm::set_search`] does.
    pub fn set_flushed_timing(&self, on: bool) -> Result<(), CudaError> {
        self.flushed.store(on, Ordering::Relaxed);
        self.plans.lock().map_err(|_| CudaError::BlasLt("the plans' lock is poisoned".into()))?.clear();
        Ok(())
    }

    /// Writes over the flush buffer (allocating it the first time).
    fn flush_l2(&self, stream: &std::sync::Arc<CudaStream>) -> Result<(), CudaError> {
        let mut buf = self.flush.lock().map_err(|_| CudaError::BlasLt("the flush buffer's lock is poisoned".into()))?;
        if buf.is_none() {
            // SAFETY: the contents never matter; they are overwritten before every use.
            *buf = Some(unsafe { stream.alloc::<u8>(self.flush_bytes) }?);
        }
        if let Some(b) = buf.as_mut() {
            stream.memset_zeros(b)?;
        }
        Ok(())
    }

    /// For benchmarks: the candidates `search` gives for the bf16 shape `shape`, described and
    /// launchable one by one ([`LtGemm::probe_launch`]); nothing is timed or kept.
    pub fn probe(&self, stream: &CudaStream, shape: LtShape, search: LtSearch) -> Result<LtProbe, CudaError> {
        if shape.fp8 {
            return Err(CudaError::BlasLt(format!("{shape:?}: probes are for bf16 shapes")));
        }
        Ok(LtProbe { shape, plan: self.plan(stream, shape, None, search)? })
    }

    /// Runs candidate `i` of `probe` on `x` (`m × k`), `w` (`n × k`) into `out` (`m × n`).
    pub fn probe_launch<O>(
        &self,
        stream: &CudaStream,
        probe: &LtProbe,
        i: usize,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<O>,
    ) -> Result<(), CudaError> {
        let LtShape { m, n, k, f32_out, .. } = probe.shape;
        let out_elem = if f32_out { 4 } else { 2 };
        if x.len() < m * k
            || w.len() < n * k
            || out.len() < m * n
            || std::mem::size_of::<O>() != out_elem
            || i >= probe.plan.candidates.len()
        {
            return Err(CudaError::BlasLt(format!(
                "probe {:?}: candidate {i} of {}, x {}, w {}, out {}",
                probe.shape,
                probe.plan.candidates.len(),
                x.len(),
                w.len(),
                out.len()
            )));
        }
        self.launch(stream, &probe.plan, i, x, w, out)
    }

    /// The descriptors of `s` and the heuristic's candidates (an FP8 shape's scale pointers are
    /// set first, from `scales`: the heuristic sees a complete descriptor).
    fn plan(
        &self,
        stream: &CudaStream,
        s: LtShape,
        scales: Option<LtScales<'_>>,
        search: LtSearch,
    ) -> Result<Plan, CudaError> {
        use sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        use sys::cudaDataType::{CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_32F};
        let (m, n, k) = (s.m as u64, s.n as u64, s.k as u64);
        let desc = result::create_matmul_desc(CUBLAS_COMPUTE_32F, CUDA_R_32F).map_err(lt_err)?;
        // Column-major view, as for plain cuBLAS: outᵀ (n × m) = op(W) · xᵀ, where W is
        // stored k × n (ld k) and transposed, xᵀ is k × m (ld k).
        let transa = 1i32;
        // SAFETY: `desc` is live; the attribute is a 32-bit operation code.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transa as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(lt_err)?;
        if s.fp8 {
            // Both operands scaled by a vector along their outer (non-reduced) dimension.
            let mode = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
            for attr in [
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            ] {
                // SAFETY: `desc` is live; the attribute is a 32-bit scale mode.
                unsafe { result::set_matmul_desc_attribute(desc, attr, (&mode as *const i32).cast(), 4) }
                    .map_err(lt_err)?;
            }
            let fast = i8::from(self.fp8_fast_accum());
            // SAFETY: `desc` is live; the attribute is an 8-bit flag.
            unsafe {
                result::set_matmul_desc_attribute(
                    desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    (&fast as *const i8).cast(),
                    1,
                )
            }
            .map_err(lt_err)?;
        }
        if let Some(sc) = scales {
            set_scale_pointers(stream, desc, sc)?;
        }
        let operand = if s.fp8 { CUDA_R_8F_E4M3 } else { CUDA_R_16BF };
        let a = result::create_matrix_layout(operand, k, n, k as i64).map_err(lt_err)?;
        let b = result::create_matrix_layout(operand, k, m, k as i64).map_err(lt_err)?;
        let d = result::create_matrix_layout(if s.f32_out { CUDA_R_32F } else { CUDA_R_16BF }, n, m, n as i64)
            .map_err(lt_err)?;
        let mut plan = Plan { desc, a, b, d, candidates: Vec::new(), infos: Vec::new(), chosen: None };
        let descs = LtDescs { handle: self.handle, desc, a, b, d, workspace: WORKSPACE_BYTES };
        let out_type = if s.f32_out { CUDA_R_32F } else { CUDA_R_16BF };
        let found =
            lt_search::candidates(&descs, search, (CUBLAS_COMPUTE_32F, CUDA_R_32F, operand, out_type, out_type))?;
        if found.is_empty() {
            return Err(CudaError::BlasLt(format!("no algorithm for {s:?}")));
        }
        plan.infos = found.iter().map(|(f, h)| lt_search::describe(f, *h)).collect();
        plan.candidates = found.into_iter().map(|(f, _)| f).collect();
        Ok(plan)
    }

    /// `out = x · wᵀ` with the shape's chosen algorithm (choosing it by measurement on the
    /// first eager call). `x`, `w` and `out` hold `m × k`, `n × k` and `m × n` (the caller
    /// checked). `O` is the output element (bf16 or f32, matching `shape.f32_out`).
    pub fn run<O>(
        &self,
        dev: &super::CudaDevice,
        shape: LtShape,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<O>,
    ) -> Result<LtChoice, CudaError> {
        if shape.fp8 {
            return Err(CudaError::BlasLt(format!("{shape:?}: an FP8 shape needs run_fp8")));
        }
        self.run_any(dev, shape, x, w, out, None)
    }

    /// `out = (sx ⊗ sw) ∘ (x · wᵀ)` on E4M3 operands (`shape.fp8`, bf16 out): `x` `m × k` codes
    /// with per-row scales `scales.x`, `w` `n × k` codes with per-row scales `scales.w` (the
    /// caller checked every size). Algorithm choice as [`Self::run`].
    pub fn run_fp8(
        &self,
        dev: &super::CudaDevice,
        shape: LtShape,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        scales: LtScales<'_>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<LtChoice, CudaError> {
        if !shape.fp8 || shape.f32_out {
            return Err(CudaError::BlasLt(format!("{shape:?}: not an FP8 shape with bf16 output")));
        }
        self.run_any(dev, shape, x, w, out, Some(scales))
    }

    fn run_any<E, O>(
        &self,
        dev: &super::CudaDevice,
        shape: LtShape,
        x: &CudaSlice<E>,
        w: &CudaSlice<E>,
        out: &mut CudaSlice<O>,
        scales: Option<LtScales<'_>>,
    ) -> Result<LtChoice, CudaError> {
        let mut plans = self.plans.lock().map_err(|_| CudaError::BlasLt("the plans' lock is poisoned".into()))?;
        let stream = dev.stream();
        let plan = match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.plan(stream, shape, scales, self.search()?)?)
            }
        };
        if let Some(sc) = scales {
            set_scale_pointers(stream, plan.desc, sc)?;
        }
        let mut choice = LtChoice::default();
        if plan.chosen.is_none() && !dev.is_capturing() {
            let flushed = self.flushed_timing();
            for i in 0..plan.candidates.len() {
                self.launch(stream, plan, i, x, w, out)?;
                let mut t = Vec::with_capacity(TIMED_REPS);
                for _ in 0..TIMED_REPS {
                    if flushed {
                        self.flush_l2(stream)?;
                    }
                    let (a, b) = (dev.event()?, dev.event()?);
                    a.record(stream)?;
                    self.launch(stream, plan, i, x, w, out)?;
                    b.record(stream)?;
                    b.synchronize()?;
                    t.push(f64::from(a.elapsed_ms(&b)?) * 1e3);
                }
                t.sort_by(|p, q| p.total_cmp(q));
                choice.timed_us.push(t[t.len() / 2]);
            }
            let best = choice.timed_us.iter().enumerate().min_by(|p, q| p.1.total_cmp(q.1)).map_or(0, |(i, _)| i);
            plan.chosen = Some(best);
        }
        choice.chosen = plan.chosen.unwrap_or(0);
        // The op itself (after timing too, so `out` holds the chosen algorithm's product).
        self.launch(stream, plan, choice.chosen, x, w, out)?;
        Ok(choice)
    }

    fn launch<E, O>(
        &self,
        stream: &CudaStream,
        plan: &Plan,
        algo: usize,
        x: &CudaSlice<E>,
        w: &CudaSlice<E>,
        out: &mut CudaSlice<O>,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _gw) = w.device_ptr(stream);
        let (xp, _gx) = x.device_ptr(stream);
        let (op, _go) = out.device_ptr_mut(stream);
        let (ws, _gws) = self.workspace.device_ptr(stream);
        let algo = &plan.candidates[algo].algo;
        stream.context().bind_to_thread()?;
        // SAFETY: the descriptors describe exactly these buffers (the caller checked their
        // sizes for the shape the plan was made for); the pointers live while the guards do;
        // C aliases D with beta 0, so C is never read.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                wp as *const _,
                plan.a,
                xp as *const _,
                plan.b,
                op as *const _,
                plan.d,
                op as *mut _,
                plan.d,
                algo,
                ws as *mut _,
                WORKSPACE_BYTES,
                stream.cu_stream() as _,
            )
        }
        .map_err(lt_err)
    }
}

/// A shape's candidates for a benchmark ([`LtGemm::probe`]).
pub struct LtProbe {
    shape: LtShape,
    plan: Plan,
}

impl LtProbe {
    /// What each candidate is, in launch-index order (the heuristic's first).
    pub fn infos(&self) -> &[LtAlgoInfo] {
        &self.plan.infos
    }
}

/// Points the FP8 descriptor's A (weights) and B (activations) scales at `sc` (read by the
/// launches that follow, so every launch sets its own matrix's scales first).
fn set_scale_pointers(stream: &CudaStream, desc: sys::cublasLtMatmulDesc_t, sc: LtScales<'_>) -> Result<(), CudaError> {
    let (wp, _gw) = sc.w.device_ptr(stream);
    let (xp, _gx) = sc.x.device_ptr(stream);
    for (attr, ptr) in [
        (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, wp),
        (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, xp),
    ] {
        // SAFETY: `desc` is live; the attribute is a device pointer (8 bytes), copied by the call.
        unsafe {
            result::set_matmul_desc_attribute(desc, attr, (&ptr as *const u64).cast(), std::mem::size_of::<u64>())
        }
        .map_err(lt_err)?;
    }
    Ok(())
}
