//! The CUDA backend's products over FP8 (E4M3) projection weights (`--quantization fp8`):
//! which kernel a product of `m` rows takes, and the device scratch the choice needs.
//!
//! Invariants: up to 16 rows take the skinny W8A16 kernel (activations stay bf16); from
//! `W8A8_MIN_M` rows a matrix whose activations are quantized per token takes cuBLASLt's FP8
//! GEMM, until cuBLASLt refuses one (then every later product dequantizes, after one warning);
//! otherwise the skinny kernel up to `GEMV_FP8_MAX_M` rows, and past it the matrix dequantized
//! into the scratch buffer sized at upload (no allocation in a step) and the bf16 GEMM.

use super::{CudaBackend, CudaBuf, kerr, linear_kernel};
use crate::backend::BackendError;
use baton_kernels::cuda::LinearCall;

/// An FP8 projection and how its activations are meant to be quantized.
pub(super) struct Fp8Mat {
    pub(super) w: baton_kernels::cuda::Fp8Weights,
    /// Dynamic per-token activation quantization (W8A8, `--quantization fp8`): products past
    /// the skinny kernel's rows take the FP8 tensor-core GEMM. Else (W8A16) they dequantize.
    pub(super) per_token: bool,
}

impl CudaBackend {
    /// `out = x · W_dqᵀ` for an FP8 matrix: the skinny W8A16 kernel up to `W8A8_MIN_M - 1` (16)
    /// rows; from `W8A8_MIN_M`, for per-token activation quantization and row-constant scales,
    /// the W8A8 FP8 GEMM (activations quantized per token, cuBLASLt); else the skinny kernel up
    /// to `GEMV_FP8_MAX_M` (64) rows, and past it the matrix dequantized into the scratch buffer
    /// and the bf16 GEMM.
    pub(super) fn linear_fp8(
        &mut self,
        x: &CudaBuf,
        m: usize,
        f: &Fp8Mat,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        use baton_kernels::cuda::{
            CudaError, Fp8DequantCall, Fp8GemvCall, Fp8W8A8Call, W8A8_MIN_M, gemv_fp8_supports, w8a8_supports,
        };
        let w = &f.w;
        let skinny = gemv_fp8_supports(m, w.cols, w.col_block);
        if skinny && m < W8A8_MIN_M {
            return Ok(Fp8GemvCall { x: &x.data, m, w, out: &mut out.data, variant: None }.launch(&self.dev)?);
        }
        if f.per_token && self.w8a8 && w8a8_supports(&self.dev, w) {
            let (codes, scales) = (m * w.cols, m);
            let act = match self.fp8_act.take() {
                Some((c, s)) if c.len() >= codes && s.len() >= scales => (c, s),
                _ => (
                    self.dev.alloc::<u8>(codes.next_power_of_two())?,
                    self.dev.alloc::<f32>(scales.next_power_of_two())?,
                ),
            };
            let (xq, xs) = self.fp8_act.insert(act);
            match (Fp8W8A8Call { x: &x.data, m, w, xq, xs, out: &mut out.data }).launch(&self.dev) {
                Ok(()) => return Ok(()),
                Err(CudaError::BlasLt(message)) => {
                    tracing::warn!(%message, "cuBLASLt refused the FP8 (W8A8) GEMM: dequantizing instead from now on");
                    self.w8a8 = false;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if skinny {
            return Ok(Fp8GemvCall { x: &x.data, m, w, out: &mut out.data, variant: None }.launch(&self.dev)?);
        }
        let scratch = self
            .fp8_scratch
            .as_mut()
            .ok_or_else(|| kerr("linear", "no FP8 scratch buffer (no FP8 matrix was uploaded)".into()))?;
        Fp8DequantCall { w, out: scratch }.launch(&self.dev)?;
        let kernel = linear_kernel(self.gemv, m, w.cols);
        LinearCall { x: &x.data, m, k: w.cols, w: scratch, n: w.rows, out: &mut out.data, kernel }.launch(&self.dev)?;
        Ok(())
    }
}
