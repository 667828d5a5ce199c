//! The W8A8 FP8 linear for more rows of x than the skinny kernel takes (prefill, large batches):
//! [`QuantizeRowsCall`] quantizes the bf16 activations per token to E4M3 (`quantize_rows_e4m3`
//! in `kernels/cuda/fp8_linear.cu`, bit for bit [`crate::cpu::quantize_rows_per_token`]'s codes
//! and scales; the same call quantizes f32 random weights per channel at load), and [`Fp8W8A8Call`] runs it then cuBLASLt's FP8 tensor-core GEMM (`lt.rs`,
//! [`LtShape::fp8`](super::LtShape)) with the weights' per-row and the tokens' scales applied as
//! outer-vector scales. The reference is [`crate::cpu::linear_fp8`] with
//! [`crate::cpu::ActivationScale::PerToken`] (what `--quantization fp8` means, as in vLLM).
//!
//! Invariants: only weights whose scales are constant along each row ([`Fp8Weights::row_scales`]:
//! per channel, per tensor) take this path; 128 × 128 block-scaled weights would need per-128
//! activation groups (a different reference), so they are refused here and stay on
//! dequantization + the bf16 GEMM. Every size is checked before anything is enqueued; a
//! cuBLASLt without the FP8 outer-vector mode returns [`CudaError::BlasLt`] (nothing enqueued
//! but the quantization, whose outputs are scratch) and the caller falls back.

use super::launch::{Args, cfg, int, need, shape_check, shape_error};
use super::lt::{LtScales, LtShape};
use super::{CudaDevice, CudaError, CudaSlice, Fp8Weights};
use half::bf16;

/// Fewest rows of x for which the engine prefers this path to the skinny FP8 kernel when both
/// apply. The skinny kernel re-reads x per 16-row weight tile: m/8 bytes of x through L1/L2 per
/// weight byte (and L1 stops holding x past 16 rows or at k = 14,336), while this path reads the
/// weights once and runs on the FP8 tensor cores; the kernel bench (`cuda_bench_fp8_linear`)
/// shows both at 16 and 64 rows to place the crossover.
pub const W8A8_MIN_M: usize = 17;

/// Threads per CTA of the quantization (one CTA per row).
const QUANT_THREADS: u32 = 256;

/// The rows [`QuantizeRowsCall`] quantizes.
pub enum QuantRows<'a> {
    /// bf16 activations (per-token quantization, the W8A8 GEMM's input).
    Bf16(&'a CudaSlice<bf16>),
    /// f32 weights (per-channel quantization of random weights drawn on the device).
    F32(&'a CudaSlice<f32>),
}

/// `codes[row0 + r] = e4m3(x[r] / s_r)`, `scales[row0 + r] = s_r = amax(|x[r]|) / 448` (1 for a
/// zero row) for `r < m`; k a multiple of 8 (16-byte loads). The one rule of both
/// [`crate::cpu::quantize_rows_per_token`] and [`crate::cpu::Fp8Matrix::quantize_per_channel`].
pub struct QuantizeRowsCall<'a> {
    /// `m × k` values.
    pub x: QuantRows<'a>,
    /// Rows.
    pub m: usize,
    /// Columns.
    pub k: usize,
    /// E4M3 codes, `(row0 + m) × k` at least.
    pub codes: &'a mut CudaSlice<u8>,
    /// f32 scales, `row0 + m` at least.
    pub scales: &'a mut CudaSlice<f32>,
    /// The row of `codes` and `scales` that row 0 of x goes to (a chunk of a larger matrix).
    pub row0: usize,
}

impl QuantizeRowsCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "quantize_rows_e4m3";
        let Self { x, m, k, codes, scales, row0 } = self;
        shape_check(OP, k.is_multiple_of(8), || format!("k = {k}: the kernel reads 8 values a load"))?;
        let rows = row0.checked_add(m).ok_or_else(|| shape_error(OP, format!("rows {row0} + {m} overflow")))?;
        match x {
            QuantRows::Bf16(x) => need(OP, "x", x, m * k)?,
            QuantRows::F32(x) => need(OP, "x", x, m * k)?,
        }
        need(OP, "codes", codes, rows * k)?;
        need(OP, "scales", scales, rows)?;
        if m == 0 {
            return Ok(());
        }
        let (args, func) = match x {
            QuantRows::Bf16(x) => (Args::new(OP).buf(x), &dev.kernels.fp8()?.quantize_rows_e4m3),
            QuantRows::F32(x) => (Args::new(OP).buf(x), &dev.kernels.fp8()?.quantize_rows_e4m3_f32),
        };
        let args = args.buf(codes).buf(scales).int(k)?.long(row0)?;
        // SAFETY: CTA r reads row r of x and writes row row0 + r of codes and scales[row0 + r],
        // r < m, in whole 8-value pieces (k % 8 == 0): sizes checked above.
        unsafe { args.launch(dev, func, cfg((int(OP, m)? as u32, 1, 1), QUANT_THREADS)) }
    }
}

/// SiLU·mul of a gated projection's `[gate | up]` rows ([`SiluMulCall`](super::SiluMulCall)'s
/// values), written as bf16 and quantized per token as [`QuantizeRowsCall`] quantizes them: the
/// W8A8 down projection's input in one pass ([`Fp8W8A8QuantizedCall`] takes the codes).
pub struct SiluMulQuantCall<'a> {
    /// `m × 2d` bf16, `[gate | up]` per row.
    pub gate_up: &'a CudaSlice<bf16>,
    /// Rows.
    pub m: usize,
    /// Outputs per row.
    pub d: usize,
    /// `m × d` bf16: SiLU(gate) · up.
    pub act: &'a mut CudaSlice<bf16>,
    /// `m × d` E4M3 codes of `act`.
    pub codes: &'a mut CudaSlice<u8>,
    /// `m` per-token scales.
    pub scales: &'a mut CudaSlice<f32>,
}

impl SiluMulQuantCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "silu_mul_quant_e4m3";
        let Self { gate_up, m, d, act, codes, scales } = self;
        shape_check(OP, d.is_multiple_of(8), || format!("d = {d}: the kernel reads 8 values a load"))?;
        need(OP, "gate_up", gate_up, 2 * m * d)?;
        need(OP, "act", act, m * d)?;
        need(OP, "codes", codes, m * d)?;
        need(OP, "scales", scales, m)?;
        if m == 0 {
            return Ok(());
        }
        let args = Args::new(OP).buf(gate_up).buf(act).buf(codes).buf(scales).int(d)?;
        // SAFETY: CTA r reads row r of gate_up (2d values) and writes row r of act and codes
        // (d each) and scales[r], r < m, in whole 8-value pieces (d % 8 == 0): sizes checked above.
        unsafe {
            args.launch(dev, &dev.kernels.fp8()?.silu_mul_quant_e4m3, cfg((int(OP, m)? as u32, 1, 1), QUANT_THREADS))
        }
    }
}

/// Whether [`Fp8W8A8Call`] takes `w` (scales constant along rows, k a multiple of 16: the
/// 16-byte leading dimension FP8 cuBLASLt needs) on this device (cuBLASLt loaded).
pub fn w8a8_supports(dev: &CudaDevice, w: &Fp8Weights) -> bool {
    dev.lt.is_some() && w.row_scales().is_some() && w.cols.is_multiple_of(16) && w.rows.is_multiple_of(8)
}

/// `out = linear_fp8(x, w, PerToken)`: the activations quantized per token into `xq`/`xs`
/// (scratch), then the FP8 GEMM with both scale vectors.
pub struct Fp8W8A8Call<'a> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of x.
    pub m: usize,
    /// The weights (`n × k`), row-constant scales.
    pub w: &'a Fp8Weights,
    /// Scratch for `m × k` activation codes.
    pub xq: &'a mut CudaSlice<u8>,
    /// Scratch for `m` activation scales.
    pub xs: &'a mut CudaSlice<f32>,
    /// `m × n` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl Fp8W8A8Call<'_> {
    /// Checks the sizes, quantizes x and enqueues the GEMM.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "linear_w8a8";
        let Self { x, m, w, xq, xs, out } = self;
        let (n, k) = (w.rows, w.cols);
        shape_check(OP, w8a8_supports(dev, w), || {
            format!(
                "{n}×{k} with {}×{} scale blocks: needs row scales, k % 16 == 0, n % 8 == 0 and cuBLASLt",
                w.row_block, w.col_block
            )
        })?;
        let Some(row_scales) = w.row_scales() else { return Err(shape_error(OP, "no row scales")) };
        let Some(lt) = &dev.lt else { return Err(shape_error(OP, "no cuBLASLt")) };
        need(OP, "x", x, m * k)?;
        need(OP, "codes", &w.codes, n * k)?;
        need(OP, "row scales", row_scales, n)?;
        need(OP, "out", out, m * n)?;
        need(OP, "activation codes", xq, m * k)?;
        need(OP, "activation scales", xs, m)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        QuantizeRowsCall { x: QuantRows::Bf16(x), m, k, codes: xq, scales: xs, row0: 0 }.launch(dev)?;
        let shape = LtShape { m, n, k, f32_out: false, fp8: true };
        lt.run_fp8(dev, shape, xq, &w.codes, LtScales { w: row_scales, x: xs }, out)?;
        Ok(())
    }
}

/// [`Fp8W8A8Call`]'s GEMM on activations already quantized per token (by the op before it:
/// [`AddRmsNormQuantCall`](super::AddRmsNormQuantCall)).
pub struct Fp8W8A8QuantizedCall<'a> {
    /// `m × k` E4M3 activation codes.
    pub xq: &'a CudaSlice<u8>,
    /// `m` activation scales.
    pub xs: &'a CudaSlice<f32>,
    /// Rows of x.
    pub m: usize,
    /// The weights (`n × k`), row-constant scales.
    pub w: &'a Fp8Weights,
    /// `m × n` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl Fp8W8A8QuantizedCall<'_> {
    /// Checks the sizes and enqueues the GEMM; [`CudaError::BlasLt`] (nothing enqueued) where
    /// cuBLASLt has no FP8 outer-vector mode.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "linear_w8a8_quantized";
        let Self { xq, xs, m, w, out } = self;
        let (n, k) = (w.rows, w.cols);
        shape_check(OP, w8a8_supports(dev, w), || format!("{n}×{k}: not a W8A8 matrix on this device"))?;
        let Some(row_scales) = w.row_scales() else { return Err(shape_error(OP, "no row scales")) };
        let Some(lt) = &dev.lt else { return Err(shape_error(OP, "no cuBLASLt")) };
        need(OP, "activation codes", xq, m * k)?;
        need(OP, "activation scales", xs, m)?;
        need(OP, "codes", &w.codes, n * k)?;
        need(OP, "row scales", row_scales, n)?;
        need(OP, "out", out, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let shape = LtShape { m, n, k, f32_out: false, fp8: true };
        lt.run_fp8(dev, shape, xq, &w.codes, LtScales { w: row_scales, x: xs }, out)?;
        Ok(())
    }
}
