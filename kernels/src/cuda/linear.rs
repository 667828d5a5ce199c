//! The linear layer `out = x · wᵀ` (bf16 operands, f32 accumulation): [`LinearCall`] runs it
//! on cuBLAS or on the skinny-GEMM kernel of gemv.cu (described in `gemv.rs`), with a bf16
//! output (activations) or an f32 one (the LM head's logits, so they reach the sampler
//! without bf16 rounding: a 1/16 grid at |logit| ≈ 16).
//!
//! Invariants: `x` is `m × k`, `w` is `n × k` row-major (the Hugging Face layout), `out` is
//! `m × n`; sizes are checked before anything is enqueued; an empty product (m or n = 0)
//! enqueues nothing; the skinny GEMM refuses the shapes [`gemv_supports`] rejects (callers
//! that may see them pick cuBLAS); cuBLAS runs on the device's stream with the workspace it
//! got at open, so it allocates nothing and can be recorded into a CUDA graph.
//!
//! [`GatedLinearCall`] is the gated MLP's first half (`act(gate) · up` of `x · [gate; up]ᵀ`)
//! in one skinny-GEMM launch, for decode-sized batches: bit-identical to [`LinearCall`]
//! followed by [`super::SiluMulCall`] (or [`super::GeluTanhMulCall`]) with the same variant.

use super::gemv::{
    GEMV_KERNEL_MAX_M, GEMV_ROWS_PER_CTA, GEMV_VARIANTS, GemvEpilogue, GemvVariant, gemv_default, gemv_supports,
    gemv_tile_index,
};
use super::launch::{Args, Elem, cfg, int, need, shape_check, shape_error};
use super::{CudaDevice, CudaError, CudaSlice};
use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::CudaFunction;
use half::bf16;

/// Which implementation computes the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearKernel {
    /// cuBLAS: any shape.
    Cublas,
    /// The skinny-GEMM kernel with `GEMV_VARIANTS[variant]`, or when `None` the default for
    /// the output width ([`gemv_default`]): only shapes [`gemv_supports`] accepts.
    Gemv {
        /// Index in [`GEMV_VARIANTS`].
        variant: Option<usize>,
    },
    /// cuBLASLt with the algorithm measured fastest for the shape (`lt.rs`); plain cuBLAS
    /// where cuBLASLt is missing or has no algorithm for it.
    Tuned,
}

impl LinearKernel {
    /// The skinny GEMM with the default variant for the output width.
    pub const GEMV: Self = Self::Gemv { variant: None };
}

/// `out = x · wᵀ`; `O` is the output element: bf16, or f32 for logits.
pub struct LinearCall<'a, O> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of `x`.
    pub m: usize,
    /// The reduction length: columns of `x` and `w`.
    pub k: usize,
    /// `n × k` bf16, row-major.
    pub w: &'a CudaSlice<bf16>,
    /// Rows of `w`: columns of `out`.
    pub n: usize,
    /// `m × n`.
    pub out: &'a mut CudaSlice<O>,
    /// Which implementation.
    pub kernel: LinearKernel,
}

impl LinearCall<'_, bf16> {
    /// Checks the sizes and enqueues the product with a bf16 output.
    pub fn launch(mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        if self.kernel == LinearKernel::Tuned && tuned(&mut self, dev, "linear", false)? {
            return Ok(());
        }
        match self.kernel {
            LinearKernel::Gemv { variant } => gemv(self, dev, "gemv", variant, false),
            LinearKernel::Cublas | LinearKernel::Tuned => {
                const OP: &str = "linear";
                if !self.checked(OP)? {
                    return Ok(());
                }
                let (m, n, k) = (int(OP, self.m)?, int(OP, self.n)?, int(OP, self.k)?);
                // Column-major view: outᵀ (n × m) = W (k × n col-major, transposed) · xᵀ (k × m).
                let c = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: n,
                    n: m,
                    k,
                    alpha: bf16::ONE,
                    lda: k,
                    ldb: k,
                    beta: bf16::ZERO,
                    ldc: n,
                };
                dev.ctx.bind_to_thread()?;
                // SAFETY: the sizes were checked against the slices above.
                unsafe { dev.blas.gemm(c, self.w, self.x, self.out) }?;
                Ok(())
            }
        }
    }
}

impl LinearCall<'_, f32> {
    /// Checks the sizes and enqueues the product with an f32 output (bf16 operands, f32
    /// accumulation and output).
    pub fn launch(mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        use cudarc::cublas::{result::gemm_ex, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        if self.kernel == LinearKernel::Tuned && tuned(&mut self, dev, "linear_f32_out", true)? {
            return Ok(());
        }
        match self.kernel {
            LinearKernel::Gemv { variant } => gemv(self, dev, "gemv_f32_out", variant, true),
            LinearKernel::Cublas | LinearKernel::Tuned => {
                const OP: &str = "linear_f32_out";
                if !self.checked(OP)? {
                    return Ok(());
                }
                let (mi, ni, ki) = (int(OP, self.m)?, int(OP, self.n)?, int(OP, self.k)?);
                let (alpha, beta) = (1.0f32, 0.0f32);
                dev.ctx.bind_to_thread()?;
                let (wp, _gw) = self.w.device_ptr(&dev.stream);
                let (xp, _gx) = self.x.device_ptr(&dev.stream);
                let (op, _go) = self.out.device_ptr_mut(&dev.stream);
                // Column-major view as for bf16: outᵀ (n × m) = Wᵀ-view (n × k) · xᵀ (k × m).
                // SAFETY: the sizes were checked against the slices above; the pointers stay
                // valid while the guards live, and the handle enqueues on the device's stream.
                unsafe {
                    gemm_ex(
                        *dev.blas.handle(),
                        sys::cublasOperation_t::CUBLAS_OP_T,
                        sys::cublasOperation_t::CUBLAS_OP_N,
                        ni,
                        mi,
                        ki,
                        (&alpha) as *const f32 as *const _,
                        wp as *const _,
                        sys::cudaDataType_t::CUDA_R_16BF,
                        ki,
                        xp as *const _,
                        sys::cudaDataType_t::CUDA_R_16BF,
                        ki,
                        (&beta) as *const f32 as *const _,
                        op as *mut _,
                        sys::cudaDataType_t::CUDA_R_32F,
                        ni,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }?;
                Ok(())
            }
        }
    }
}

impl<O> LinearCall<'_, O> {
    /// The size checks every implementation makes; `false` when the product is empty.
    fn checked(&self, op: &'static str) -> Result<bool, CudaError> {
        need(op, "x", self.x, self.m * self.k)?;
        need(op, "w", self.w, self.n * self.k)?;
        need(op, "out", self.out, self.m * self.n)?;
        Ok(self.m > 0 && self.n > 0)
    }
}

/// The activation a [`GatedLinearCall`] applies to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedAct {
    /// `silu(gate) · up` (Llama, Qwen, Mistral, Phi).
    Silu,
    /// `gelu_tanh(gate) · up` (Gemma's GeGLU).
    GeluTanh,
}

/// `out = act(gate) · up` where `gate = x · w[..d]ᵀ` and `up = x · w[d..]ᵀ` (`w` is the
/// checkpoint's `[gate; up]`, `2d × k`): the skinny GEMM with the activation in its epilogue,
/// for 1 ≤ m ≤ [`GEMV_KERNEL_MAX_M`] rows and k a multiple of 8 ([`gemv_supports`]; larger
/// batches run [`LinearCall`] and the activation kernel).
pub struct GatedLinearCall<'a> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of `x`.
    pub m: usize,
    /// The reduction length.
    pub k: usize,
    /// `2d × k` bf16: the gate rows, then the up rows.
    pub w: &'a CudaSlice<bf16>,
    /// The intermediate size: columns of `out`.
    pub d: usize,
    /// The activation.
    pub act: GatedAct,
    /// `m × d` bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Index in [`GEMV_VARIANTS`], or `None` for the variant [`LinearCall`] would pick for the
    /// unfused `2d`-row product (same CTA count, same sums: the results agree bit for bit).
    pub variant: Option<usize>,
}

impl GatedLinearCall<'_> {
    /// Checks the sizes and enqueues the fused product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "gated_linear";
        let Self { x, m, k, w, d, act, out, variant } = self;
        need(OP, "x", x, m * k)?;
        need(OP, "w", w, 2 * d * k)?;
        need(OP, "out", out, m * d)?;
        if m == 0 || d == 0 {
            return Ok(());
        }
        shape_check(OP, gemv_supports(m, k), || {
            format!("m = {m}, k = {k}: the kernel needs 1 ≤ m ≤ {GEMV_KERNEL_MAX_M} and k a multiple of 8")
        })?;
        let epilogue = match act {
            GatedAct::Silu => GemvEpilogue::Silu,
            GatedAct::GeluTanh => GemvEpilogue::GeluTanh,
        };
        let (v, func) =
            gemv_function(dev, OP, m, variant.unwrap_or_else(|| gemv_default(2 * d, dev.sm_count())), epilogue)?;
        // One CTA per 8 output columns: 8 gate rows and their 8 up rows.
        let grid = cfg((int(OP, d.div_ceil(GEMV_ROWS_PER_CTA / 2))? as u32, 1, 1), v.warps * 32);
        let pf = v.prefetch_row_bytes(2 * d, k, dev.gemv_l2_prefetch());
        let args = Args::new(OP).buf(x).buf(w).buf(out).int(m)?.int(d)?.int(k)?.int(pf)?;
        // SAFETY: x holds m × k, w 2d × k and out m × d (checked above); the kernel reads whole
        // 16-byte rows (k % 8 == 0), rows below 2d of w, and writes only columns < d of out.
        unsafe { args.launch(dev, func, grid) }
    }
}

/// The product through cuBLASLt's measured choice; `false` (nothing enqueued) when there is
/// no cuBLASLt or no algorithm for the shape, so the caller runs plain cuBLAS.
fn tuned<O>(
    call: &mut LinearCall<'_, O>,
    dev: &CudaDevice,
    op: &'static str,
    f32_out: bool,
) -> Result<bool, CudaError> {
    let Some(lt) = &dev.lt else { return Ok(false) };
    if !call.checked(op)? {
        return Ok(true);
    }
    let shape = super::lt::LtShape { m: call.m, n: call.n, k: call.k, f32_out, fp8: false };
    match lt.run(dev, shape, call.x, call.w, call.out) {
        Ok(_) => Ok(true),
        Err(CudaError::BlasLt(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The skinny GEMM: one CTA per 16 rows of `w`; `f32_out` (`O` is f32) picks the
/// instantiation.
fn gemv<O: Elem>(
    call: LinearCall<'_, O>,
    dev: &CudaDevice,
    op: &'static str,
    variant: Option<usize>,
    f32_out: bool,
) -> Result<(), CudaError> {
    let (m, k, n) = (call.m, call.k, call.n);
    if !call.checked(op)? {
        return Ok(());
    }
    shape_check(op, gemv_supports(m, k), || {
        format!("m = {m}, k = {k}: the kernel needs 1 ≤ m ≤ {GEMV_KERNEL_MAX_M} and k a multiple of 8")
    })?;
    let epilogue = if f32_out { GemvEpilogue::F32 } else { GemvEpilogue::Bf16 };
    let (v, func) = gemv_function(dev, op, m, variant.unwrap_or_else(|| gemv_default(n, dev.sm_count())), epilogue)?;
    let grid = cfg((int(op, n.div_ceil(GEMV_ROWS_PER_CTA))? as u32, 1, 1), v.warps * 32);
    let pf = v.prefetch_row_bytes(n, k, dev.gemv_l2_prefetch());
    let args = Args::new(op).buf(call.x).buf(call.w).buf(call.out).int(m)?.int(n)?.int(k)?.int(pf)?;
    // SAFETY: x holds m × k, w n × k and out m × n (checked above); the kernel reads whole
    // 16-byte rows, which k % 8 == 0 guarantees, prefetches at most each row's 2k bytes (pf),
    // and writes only rows < n of out.
    unsafe { args.launch(dev, func, grid) }
}

/// The compiled skinny GEMM for `m` rows of x (its 8- or 16-row instantiation), `variant` of
/// [`GEMV_VARIANTS`] and `epilogue`; refused (naming `op`) for a variant that does not exist.
pub(super) fn gemv_function<'d>(
    dev: &'d CudaDevice,
    op: &'static str,
    m: usize,
    variant: usize,
    epilogue: GemvEpilogue,
) -> Result<(GemvVariant, &'d CudaFunction), CudaError> {
    let funcs = dev.kernels.gemv[gemv_tile_index(m)].get(variant);
    match (GEMV_VARIANTS.get(variant), funcs.and_then(|f| f.get(epilogue.index()))) {
        (Some(v), Some(f)) => Ok((*v, f)),
        _ => Err(shape_error(op, format!("no gemv variant {variant}"))),
    }
}
