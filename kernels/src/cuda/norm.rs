//! RMSNorm of the residual stream (`rms_norm_f32`, `add_rms_norm_f32` in elementwise.cu):
//! [`RmsNormCall`] and [`AddRmsNormCall`], scaling by `w` or, with `launch_with`, by Gemma's
//! `1 + w` ([`NormWeight`]); and [`AddRmsNormQuantCall`], the add + norm whose output is the
//! FP8 W8A8 GEMM's per-token quantized input instead of a bf16 row.
//!
//! Invariants: the residual stream is f32 and is never rounded to bf16 (the fused add keeps
//! the sum in f32); the normalized output is bf16; one CTA per row, sized so that the row
//! fits in its threads' registers (`NORM_V` float4 chunks each, elementwise.cu).

use super::launch::{Args, int, need, per_row, row_threads, shape_check};
use super::{CudaDevice, CudaError, CudaSlice};
use crate::cpu::NormWeight;
use half::bf16;

/// Elements of a row each thread holds (`4 · NORM_V` in elementwise.cu).
const NORM_ELEMS_PER_THREAD: usize = 16;

/// `out = x / rms(x) * weight` for `rows` rows of width `dim`: `x` is the f32 residual
/// stream, `out` the bf16 activation.
pub struct RmsNormCall<'a> {
    /// `rows × dim` f32.
    pub x: &'a CudaSlice<f32>,
    /// `dim` bf16.
    pub weight: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Row width.
    pub dim: usize,
    /// Added to the mean square.
    pub eps: f32,
    /// `rows × dim` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl RmsNormCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        self.launch_with(dev, NormWeight::Plain)
    }

    /// As [`launch`](Self::launch), scaling by the weights as `style` says (`1 + w`, computed
    /// in f32, for Gemma; reference [`crate::cpu::rms_norm`] with the weights offset).
    pub fn launch_with(self, dev: &CudaDevice, style: NormWeight) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        let n = self.rows * self.dim;
        need(OP, "x", self.x, n)?;
        need(OP, "weight", self.weight, self.dim)?;
        need(OP, "out", self.out, n)?;
        if self.rows == 0 {
            return Ok(());
        }
        let grid = per_row(OP, self.rows, row_threads(self.dim, NORM_ELEMS_PER_THREAD))?;
        let args =
            Args::new(OP).buf(self.x).buf(self.weight).buf(self.out).int(self.dim)?.f32(self.eps).f32(style.offset());
        // SAFETY: one CTA per row reads `x` and writes `out` within `rows × dim`, and reads
        // `dim` weights: all checked above.
        unsafe { args.launch(dev, &dev.kernels.rms_norm, grid) }
    }
}

/// `residual += x; out = rms_norm(residual) * weight`, row by row: the residual is f32 (the
/// bf16 branch output `x` is added without rounding the sum), `out` is bf16.
pub struct AddRmsNormCall<'a> {
    /// `rows × dim` f32, updated in place.
    pub residual: &'a mut CudaSlice<f32>,
    /// `rows × dim` bf16: the branch output added to the residual.
    pub x: &'a CudaSlice<bf16>,
    /// `dim` bf16.
    pub weight: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Row width.
    pub dim: usize,
    /// Added to the mean square.
    pub eps: f32,
    /// `rows × dim` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl AddRmsNormCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        self.launch_with(dev, NormWeight::Plain)
    }

    /// As [`launch`](Self::launch), scaling by the weights as `style` says (`1 + w` for Gemma).
    pub fn launch_with(self, dev: &CudaDevice, style: NormWeight) -> Result<(), CudaError> {
        const OP: &str = "add_rms_norm";
        let n = self.rows * self.dim;
        need(OP, "residual", self.residual, n)?;
        need(OP, "x", self.x, n)?;
        need(OP, "weight", self.weight, self.dim)?;
        need(OP, "out", self.out, n)?;
        if self.rows == 0 {
            return Ok(());
        }
        let grid = per_row(OP, self.rows, row_threads(self.dim, NORM_ELEMS_PER_THREAD))?;
        let d = int(OP, self.dim)?;
        let args = Args::new(OP)
            .buf(self.residual)
            .buf(self.x)
            .buf(self.weight)
            .buf(self.out)
            .i32(d)
            .f32(self.eps)
            .f32(style.offset());
        // SAFETY: one CTA per row touches `residual`, `x` and `out` within `rows × dim` and
        // `dim` weights: all checked above.
        unsafe { args.launch(dev, &dev.kernels.add_rms_norm, grid) }
    }
}

/// Widest row [`AddRmsNormQuantCall`] takes: the row must sit in its CTA's registers (1,024
/// threads of 16 values).
pub const NORM_QUANT_MAX_DIM: usize = 1024 * NORM_ELEMS_PER_THREAD;

/// Whether [`AddRmsNormQuantCall`] takes rows `dim` wide: a multiple of 4, at most
/// [`NORM_QUANT_MAX_DIM`].
pub fn norm_quant_supports(dim: usize) -> bool {
    dim > 0 && dim.is_multiple_of(4) && dim <= NORM_QUANT_MAX_DIM
}

/// `residual += x; h = bf16(rms_norm(residual) · weight)`, then `h` quantized per row to E4M3
/// (`codes = e4m3(h / s)`, `scales = s = amax(|h|) / 448`, 1 for a zero row): the codes and
/// scales [`QuantizeRowsCall`](super::QuantizeRowsCall) makes from [`AddRmsNormCall`]'s output,
/// without storing `h`.
pub struct AddRmsNormQuantCall<'a> {
    /// `rows × dim` f32, updated in place.
    pub residual: &'a mut CudaSlice<f32>,
    /// `rows × dim` bf16: the branch output added to the residual.
    pub x: &'a CudaSlice<bf16>,
    /// `dim` bf16.
    pub weight: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Row width.
    pub dim: usize,
    /// Added to the mean square.
    pub eps: f32,
    /// `rows × dim` E4M3 codes.
    pub codes: &'a mut CudaSlice<u8>,
    /// `rows` f32 scales.
    pub scales: &'a mut CudaSlice<f32>,
}

impl AddRmsNormQuantCall<'_> {
    /// Checks the sizes and enqueues the kernel (plain `w` scaling).
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "add_rms_norm_quant";
        let Self { residual, x, weight, rows, dim, eps, codes, scales } = self;
        shape_check(OP, norm_quant_supports(dim), || {
            format!("dim = {dim}: needs a multiple of 4 up to {NORM_QUANT_MAX_DIM}")
        })?;
        let n = rows * dim;
        need(OP, "residual", residual, n)?;
        need(OP, "x", x, n)?;
        need(OP, "weight", weight, dim)?;
        need(OP, "codes", codes, n)?;
        need(OP, "scales", scales, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let grid = per_row(OP, rows, row_threads(dim, NORM_ELEMS_PER_THREAD))?;
        let args = Args::new(OP).buf(residual).buf(x).buf(weight).buf(codes).buf(scales).int(dim)?.f32(eps);
        let args = args.f32(NormWeight::Plain.offset());
        // SAFETY: one CTA per row touches `residual`, `x` and `codes` within `rows × dim`,
        // `scales[row]` and `dim` weights: all checked above; the row fits the CTA's registers
        // (norm_quant_supports: dim ≤ 16 · threads, threads from row_threads).
        unsafe { args.launch(dev, &dev.kernels.add_rms_norm_quant, grid) }
    }
}
