//! The element-wise kernels of elementwise.cu: [`SiluMulCall`], [`GeluTanhMulCall`],
//! [`SoftcapCall`], [`ScaleRoundCall`], [`BiasAddCall`], [`CopyColsCall`] and [`CastCall`]
//! (bf16 ↔ f32).
//!
//! Invariants: every one is a grid-stride loop over the elements it writes (`grid_stride`),
//! so any size launches at most 65,535 CTAs; an empty op enqueues nothing.

use super::launch::{Args, Elem, grid_stride, need, shape_check};
use super::{CudaDevice, CudaError, CudaSlice};
use cudarc::driver::CudaFunction;
use half::bf16;

/// `out = silu(gate) * up` for `rows` rows `[gate | up]` of width `2d`.
pub struct SiluMulCall<'a> {
    /// `rows × 2d` bf16.
    pub gate_up: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Width of the output rows (half the input's).
    pub d: usize,
    /// `rows × d` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl SiluMulCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        gated_mul("silu_mul", dev, &dev.kernels.silu_mul, self.gate_up, self.rows, self.d, self.out)
    }
}

/// `out = gelu_tanh(gate) * up` for `rows` rows `[gate | up]` of width `2d`: the GeGLU MLP of
/// Gemma 1/2/3 (`hidden_activation = "gelu_pytorch_tanh"`); reference
/// [`crate::cpu::gelu_tanh_mul`]. The same shapes and launch as [`SiluMulCall`].
pub struct GeluTanhMulCall<'a> {
    /// `rows × 2d` bf16.
    pub gate_up: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Width of the output rows (half the input's).
    pub d: usize,
    /// `rows × d` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl GeluTanhMulCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        gated_mul("gelu_tanh_mul", dev, &dev.kernels.gelu_tanh_mul, self.gate_up, self.rows, self.d, self.out)
    }
}

/// The launch both gated activations share (`gate_up`, `out`, `d`, `total`).
fn gated_mul(
    op: &'static str,
    dev: &CudaDevice,
    func: &CudaFunction,
    gate_up: &CudaSlice<bf16>,
    rows: usize,
    d: usize,
    out: &CudaSlice<bf16>,
) -> Result<(), CudaError> {
    need(op, "gate_up", gate_up, rows * 2 * d)?;
    need(op, "out", out, rows * d)?;
    let total = rows * d;
    if total == 0 {
        return Ok(());
    }
    let args = Args::new(op).buf(gate_up).buf(out).int(d)?.long(total)?;
    // With d % 8 == 0 each thread takes 8 outputs (see elementwise.cu).
    let threads = if d.is_multiple_of(8) { total / 8 } else { total };
    // SAFETY: the loop writes `total` outputs and reads their gate and up, checked above.
    unsafe { args.launch(dev, func, grid_stride(threads)) }
}

/// `x = cap · tanh(x / cap)` over the first `n` f32 values in place: Gemma 2's final logit
/// soft-capping (`final_logit_softcapping`), on the logits before sampling; reference
/// [`crate::cpu::softcap`].
pub struct SoftcapCall<'a> {
    /// At least `n` f32 (the logits, `rows × vocab`).
    pub x: &'a mut CudaSlice<f32>,
    /// Values capped.
    pub n: usize,
    /// The cap, > 0.
    pub cap: f32,
}

impl SoftcapCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "softcap";
        need(OP, "x", self.x, self.n)?;
        shape_check(OP, self.cap.is_finite() && self.cap > 0.0, || format!("cap {} is not > 0", self.cap))?;
        if self.n == 0 {
            return Ok(());
        }
        let args = Args::new(OP).buf(self.x).long(self.n)?.f32(self.cap);
        // SAFETY: the loop updates the first `n` values of `x`, checked above.
        unsafe { args.launch(dev, &dev.kernels.softcap, grid_stride(self.n)) }
    }
}

/// `x = bf16(x · bf16(scale))` over the first `n` f32 values in place: Gemma's `√hidden`
/// embedding normalizer on the f32 residual stream, rounded as transformers' product in the
/// model dtype (bf16) is.
pub struct ScaleRoundCall<'a> {
    /// At least `n` f32 (the embedded rows).
    pub x: &'a mut CudaSlice<f32>,
    /// Values scaled.
    pub n: usize,
    /// The factor (rounded to bf16 before use); finite.
    pub scale: f32,
}

impl ScaleRoundCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "scale_round";
        need(OP, "x", self.x, self.n)?;
        shape_check(OP, self.scale.is_finite(), || format!("scale {} is not finite", self.scale))?;
        if self.n == 0 {
            return Ok(());
        }
        let s = bf16::from_f32(self.scale).to_f32();
        let args = Args::new(OP).buf(self.x).long(self.n)?.f32(s);
        // SAFETY: the loop updates the first `n` values of `x`, checked above.
        unsafe { args.launch(dev, &dev.kernels.scale_round, grid_stride(self.n)) }
    }
}

/// `x[r, j] += bias[j]` for `rows` rows of width `n`.
pub struct BiasAddCall<'a> {
    /// `rows × n` bf16, updated in place.
    pub x: &'a mut CudaSlice<bf16>,
    /// `n` bf16.
    pub bias: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Row width.
    pub n: usize,
}

impl BiasAddCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        launch_bias_add(dev, "bias_add", &dev.kernels.bias_add, self.x, self.bias, (self.rows, self.n))
    }
}

/// `x[r, j] += bias[j]` in f32 for `rows` f32 rows of width `n` and a bf16 bias (gpt-oss's
/// router logits).
pub struct BiasAddF32Call<'a> {
    /// `rows × n` f32, updated in place.
    pub x: &'a mut CudaSlice<f32>,
    /// `n` bf16.
    pub bias: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Row width.
    pub n: usize,
}

impl BiasAddF32Call<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        launch_bias_add(dev, "bias_add_f32", &dev.kernels.bias_add_f32, self.x, self.bias, (self.rows, self.n))
    }
}

/// The launch behind [`BiasAddCall`] and [`BiasAddF32Call`]: `func` adds the `n` biases to
/// each of `rows` rows of `x` (the kernels share their argument list).
fn launch_bias_add<T: Elem>(
    dev: &CudaDevice,
    op: &'static str,
    func: &CudaFunction,
    x: &CudaSlice<T>,
    bias: &CudaSlice<bf16>,
    (rows, n): (usize, usize),
) -> Result<(), CudaError> {
    need(op, "x", x, rows * n)?;
    need(op, "bias", bias, n)?;
    let total = rows * n;
    if total == 0 {
        return Ok(());
    }
    let args = Args::new(op).buf(x).buf(bias).int(n)?.long(total)?;
    // SAFETY: the loop updates `total` elements of `x` and reads `n` biases, checked above.
    unsafe { args.launch(dev, func, grid_stride(total)) }
}

/// `dst[r, c] = src[r, col0 + c]` for `rows` rows and `c < dst_width`: a band of columns.
pub struct CopyColsCall<'a> {
    /// `rows × src_width` bf16.
    pub src: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Width of a `src` row.
    pub src_width: usize,
    /// First column of the band.
    pub col0: usize,
    /// `rows × dst_width` bf16.
    pub dst: &'a mut CudaSlice<bf16>,
    /// Width of the band.
    pub dst_width: usize,
}

impl CopyColsCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "copy_cols";
        let (rows, src_w, col0, dst_w) = (self.rows, self.src_width, self.col0, self.dst_width);
        shape_check(OP, col0 + dst_w <= src_w, || format!("columns {col0}..{} of width {src_w}", col0 + dst_w))?;
        need(OP, "src", self.src, rows * src_w)?;
        need(OP, "dst", self.dst, rows * dst_w)?;
        let total = rows * dst_w;
        if total == 0 {
            return Ok(());
        }
        let args = Args::new(OP).buf(self.src).int(src_w)?.int(col0)?.buf(self.dst).int(dst_w)?.long(total)?;
        // SAFETY: the band lies inside each `src` row and `dst` holds `total`, checked above.
        unsafe { args.launch(dev, &dev.kernels.copy_cols, grid_stride(total)) }
    }
}

/// `dst[i] = src[i]` for the first `n` values, converted: bf16 → f32 widens exactly, f32 →
/// bf16 rounds to nearest even.
pub struct CastCall<'a, S, D> {
    /// At least `n` values.
    pub src: &'a CudaSlice<S>,
    /// At least `n` values.
    pub dst: &'a mut CudaSlice<D>,
    /// Values converted.
    pub n: usize,
}

impl CastCall<'_, bf16, f32> {
    /// Checks the sizes and enqueues `bf16_to_f32`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        cast("bf16_to_f32", dev, &dev.kernels.bf16_to_f32, self.src, self.dst, self.n)
    }
}

impl CastCall<'_, f32, bf16> {
    /// Checks the sizes and enqueues `f32_to_bf16`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        cast("f32_to_bf16", dev, &dev.kernels.f32_to_bf16, self.src, self.dst, self.n)
    }
}

/// The launch both casts share (`src`, `dst`, `n`).
fn cast<S: Elem, D: Elem>(
    op: &'static str,
    dev: &CudaDevice,
    func: &CudaFunction,
    src: &CudaSlice<S>,
    dst: &CudaSlice<D>,
    n: usize,
) -> Result<(), CudaError> {
    need(op, "src", src, n)?;
    need(op, "dst", dst, n)?;
    if n == 0 {
        return Ok(());
    }
    let args = Args::new(op).buf(src).buf(dst).long(n)?;
    // SAFETY: both slices hold at least `n` values, checked above.
    unsafe { args.launch(dev, func, grid_stride(n)) }
}
