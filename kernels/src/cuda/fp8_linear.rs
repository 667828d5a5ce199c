//! FP8 (E4M3) weight matrices on the device and their two launches (`kernels/cuda/fp8_linear.cu`):
//! [`Fp8GemvCall`], the weights-only (W8A16) skinny GEMM for decode (m ≤ 16 rows of bf16 x, the
//! FP8 weights read once, f32 accumulation, scales per block), and [`Fp8DequantCall`], the
//! dequantization to bf16 that larger products feed to the bf16 GEMM. The reference is
//! [`crate::cpu::linear_fp8`] with [`crate::cpu::ActivationScale::None`].
//!
//! Invariants: an [`Fp8Weights`] holds exactly `rows × cols` codes and the block scales of
//! its [`Fp8Matrix`]; [`gemv_fp8_supports`] is the one rule for which shapes the skinny kernel
//! takes (k a multiple of 16, a column block that no 16-code chunk straddles).

use super::launch::{Args, cfg, grid_stride, need, shape_check};
use super::{CudaDevice, CudaError, CudaSlice};
use crate::cpu::Fp8Matrix;
use half::bf16;

/// Most rows of x the skinny FP8 kernel takes.
pub const GEMV_FP8_MAX_M: usize = 16;

/// Weight rows per CTA of the skinny kernel (one warp each).
const ROWS_PER_CTA: usize = 8;

/// An FP8 weight matrix on the device.
pub struct Fp8Weights {
    /// `rows × cols` E4M3 codes.
    pub codes: CudaSlice<u8>,
    /// `⌈rows/row_block⌉ × ⌈cols/col_block⌉` f32 scales.
    pub scales: CudaSlice<f32>,
    /// Output rows (n).
    pub rows: usize,
    /// Input columns (k).
    pub cols: usize,
    /// Rows per scale block.
    pub row_block: usize,
    /// Columns per scale block.
    pub col_block: usize,
}

impl Fp8Weights {
    /// Uploads `w`'s codes and scales.
    pub fn upload(dev: &CudaDevice, w: &Fp8Matrix) -> Result<Self, CudaError> {
        let (row_block, col_block) = w.block();
        Ok(Self {
            codes: dev.upload(w.codes())?,
            scales: dev.upload(w.scales())?,
            rows: w.rows(),
            cols: w.cols(),
            row_block,
            col_block,
        })
    }
}

/// Whether [`Fp8GemvCall`] takes `m` rows against a `k`-wide matrix with column block `cb`.
pub fn gemv_fp8_supports(m: usize, k: usize, cb: usize) -> bool {
    (1..=GEMV_FP8_MAX_M).contains(&m) && k.is_multiple_of(16) && (cb.is_multiple_of(16) || cb >= k) && cb > 0
}

/// `out = x · W_dqᵀ` (bf16 out) for `m` ≤ 16 rows: the W8A16 decode product.
pub struct Fp8GemvCall<'a> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of x.
    pub m: usize,
    /// The weights (`n × k`).
    pub w: &'a Fp8Weights,
    /// `m × n` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl Fp8GemvCall<'_> {
    /// Checks the shapes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "gemv_fp8";
        let w = self.w;
        let (n, k) = (w.rows, w.cols);
        shape_check(OP, gemv_fp8_supports(self.m, k, w.col_block), || {
            format!("m = {}, k = {k}, column block {}: not a skinny FP8 shape", self.m, w.col_block)
        })?;
        need(OP, "x", self.x, self.m * k)?;
        need(OP, "codes", &w.codes, n * k)?;
        need(OP, "scales", &w.scales, n.div_ceil(w.row_block) * k.div_ceil(w.col_block))?;
        need(OP, "out", self.out, self.m * n)?;
        if n == 0 {
            return Ok(());
        }
        let args = Args::new(OP)
            .buf(self.x)
            .buf(&w.codes)
            .buf(&w.scales)
            .buf(self.out)
            .int(self.m)?
            .int(n)?
            .int(k)?
            .int(w.row_block)?
            .int(w.col_block)?;
        let grid = u32::try_from(n.div_ceil(ROWS_PER_CTA))
            .map_err(|_| CudaError::Shape { op: OP, message: format!("{n} rows") })?;
        // SAFETY: one warp per weight row < n reads `k` codes of it, its scales, and k values of
        // each of the m rows of x; it writes out[i][row] for i < m: all sizes checked above.
        unsafe { args.launch(dev, &dev.kernels.gemv_fp8, cfg((grid, 1, 1), (ROWS_PER_CTA * 32) as u32)) }
    }
}

/// `out = bf16(W_dq)`: the dequantized `n × k` matrix.
pub struct Fp8DequantCall<'a> {
    /// The weights.
    pub w: &'a Fp8Weights,
    /// `n × k` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl Fp8DequantCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "fp8_dequant";
        let w = self.w;
        let total = w.rows * w.cols;
        need(OP, "codes", &w.codes, total)?;
        need(OP, "scales", &w.scales, w.rows.div_ceil(w.row_block) * w.cols.div_ceil(w.col_block))?;
        need(OP, "out", self.out, total)?;
        if total == 0 {
            return Ok(());
        }
        let args = Args::new(OP)
            .buf(&w.codes)
            .buf(&w.scales)
            .buf(self.out)
            .int(w.cols)?
            .int(w.row_block)?
            .int(w.col_block)?
            .long(total)?;
        // SAFETY: the grid-stride loop writes `total` outputs and reads as many codes and the
        // scales of their blocks, checked above.
        unsafe { args.launch(dev, &dev.kernels.fp8_dequant, grid_stride(total)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skinny_shapes() {
        assert!(gemv_fp8_supports(1, 4096, 128) && gemv_fp8_supports(16, 4096, 4096) && gemv_fp8_supports(3, 64, 64));
        assert!(!gemv_fp8_supports(17, 4096, 128), "m > 16 dequantizes and uses the bf16 GEMM");
        assert!(!gemv_fp8_supports(1, 4104, 4104), "k not a multiple of 16");
        assert!(!gemv_fp8_supports(1, 96, 40), "a 16-code chunk would straddle column blocks");
        assert!(gemv_fp8_supports(1, 96, 48), "48-column blocks start on 16-code chunks");
        assert!(!gemv_fp8_supports(0, 64, 64));
    }
}
