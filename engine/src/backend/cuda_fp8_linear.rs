//! The CUDA backend's products over FP8 (E4M3) projection weights (`--quantization fp8`):
//! which kernel a product of `m` rows takes, and the device scratch the choice needs; and the
//! FP8 matrices themselves, uploaded or (random weights, `--load-format dummy`) drawn and
//! quantized on the device.
//!
//! Random FP8 weights are the host's ([`crate::backend::counter_fp8`]) bit for bit: the counter
//! draws in f32 as the host makes them (`fill_counter_f32`, not rounded to bf16: the host
//! quantizes the f32 values), then per-channel quantization by the same rule
//! (`quantize_rows_e4m3_f32`), a bounded chunk of rows at a time through one f32 temporary
//! freed before returning.
//!
//! Invariants: up to 16 rows take the skinny W8A16 kernel (activations stay bf16); from
//! `W8A8_MIN_M` rows a matrix whose activations are quantized per token takes cuBLASLt's FP8
//! GEMM, until cuBLASLt refuses one (then every later product dequantizes, after one warning);
//! otherwise the skinny kernel up to `GEMV_FP8_MAX_M` rows, and past it the matrix dequantized
//! into the scratch buffer sized at upload (no allocation in a step) and the bf16 GEMM.

use super::{CudaBackend, CudaBuf, CudaMat, kerr, linear_kernel};
use crate::backend::{Backend, BackendError, counter_fp8, quantize_stacked_fp8};
use baton_formats::{CounterInit, DType, TensorView};
use baton_kernels::cpu::ActivationScale;
use baton_kernels::cuda::{CudaSlice, Fp8Weights, LinearCall, QuantRows, QuantizeRowsCall, bf16};

/// Most f32 values drawn at once by [`CudaBackend::draw_fp8`] (256 MiB of temporary): a whole
/// part up to Llama-3.1-8B's gate (14,336 × 4,096), a few chunks for 70B-sized matrices.
const DRAW_CHUNK: usize = 1 << 26;

/// An FP8 projection and how its activations are meant to be quantized.
pub(super) struct Fp8Mat {
    pub(super) w: baton_kernels::cuda::Fp8Weights,
    /// Dynamic per-token activation quantization (W8A8, `--quantization fp8`): products past
    /// the skinny kernel's rows take the FP8 tensor-core GEMM. Else (W8A16) they dequantize.
    pub(super) per_token: bool,
}

impl CudaBackend {
    /// A matrix over the FP8 weights `w`, with the dequantization scratch grown to its size.
    pub(super) fn fp8_mat(&mut self, w: Fp8Weights, act: ActivationScale) -> Result<CudaMat, BackendError> {
        // Decode-sized products are weights-only FP8 (W8A16: the CPU reference with
        // `ActivationScale::None` is what the skinny kernel matches); larger ones follow `act`
        // (`linear_fp8`).
        let per_token = act == ActivationScale::PerToken;
        let (rows, cols) = (w.rows, w.cols);
        let len = rows * cols;
        if self.fp8_scratch.as_ref().is_none_or(|s| s.len() < len) {
            self.fp8_scratch = Some(self.dev.alloc::<bf16>(len.max(1))?);
        }
        let fp8 = Some(Fp8Mat { w, per_token });
        Ok(CudaMat { data: self.dev.alloc::<bf16>(1)?, rows, cols, fp8 })
    }

    /// [`Backend::random_mat_fp8`] on the device (see the module docs): the codes and scales
    /// [`counter_fp8`] gives on the host. Shapes the quantization kernel does not take (`cols`
    /// not a multiple of 8, nothing to draw) go the host's way.
    pub(super) fn draw_fp8(
        &mut self,
        parts: &[(usize, CounterInit)],
        cols: usize,
        act: ActivationScale,
    ) -> Result<CudaMat, BackendError> {
        let rows: usize = parts.iter().map(|p| p.0).sum();
        if rows == 0 || cols == 0 || !cols.is_multiple_of(8) {
            return self.upload_mat_fp8(counter_fp8(parts, cols)?, act);
        }
        let dev = &self.dev;
        let mut codes = dev.alloc::<u8>(rows * cols)?;
        let mut scales = dev.alloc::<f32>(rows)?;
        let largest = parts.iter().map(|p| p.0).max().unwrap_or(1);
        let chunk = (DRAW_CHUNK / cols).clamp(1, largest);
        let mut drawn = dev.alloc::<f32>(chunk * cols)?;
        let mut row0 = 0;
        for (part_rows, init) in parts {
            for r in (0..*part_rows).step_by(chunk) {
                let m = chunk.min(part_rows - r);
                dev.fill_counter_f32(&mut drawn, r * cols, m * cols, (init.key, init.mean, init.amp))?;
                let x = QuantRows::F32(&drawn);
                QuantizeRowsCall { x, m, k: cols, codes: &mut codes, scales: &mut scales, row0: row0 + r }
                    .launch(dev)?;
            }
            row0 += part_rows;
        }
        // Freed in stream order, after the last quantization read it.
        drop(drawn);
        // One scale per row: what `Fp8Matrix::quantize_per_channel` and `stack` give.
        let w = Fp8Weights { codes, scales, rows, cols, row_block: 1, col_block: cols, expanded_row_scales: None };
        self.fp8_mat(w, act)
    }

    /// [`Backend::quantize_mat_fp8`] on the device: the stored bf16 rows streamed up as any
    /// weight is (`stream_weights`), then quantized per row there (`quantize_rows_e4m3`: the
    /// rule of [`Fp8Matrix::quantize_per_channel`](baton_kernels::cpu::Fp8Matrix), bit for bit).
    /// The host quantized an 8B checkpoint at 0.03 GB/s, one tensor at a time (70 s to
    /// healthy on the H200). Tensors not stored as bf16 (f16, f32: their values are not
    /// bf16's), and shapes the kernel does not take, go the host's way.
    pub(super) fn quantize_fp8(
        &mut self,
        parts: &[TensorView<'_>],
        rows: usize,
        cols: usize,
        act: ActivationScale,
    ) -> Result<CudaMat, BackendError> {
        let device_takes = rows > 0 && cols.is_multiple_of(8) && parts.iter().all(|t| t.dtype == DType::BF16);
        if !device_takes {
            return self.upload_mat_fp8(quantize_stacked_fp8(parts, rows, cols)?, act);
        }
        let stored = self.stream_weights("quantize_mat_fp8", parts, rows * cols)?;
        let dev = &self.dev;
        let mut codes = dev.alloc::<u8>(rows * cols)?;
        let mut scales = dev.alloc::<f32>(rows)?;
        let x = QuantRows::Bf16(&stored);
        QuantizeRowsCall { x, m: rows, k: cols, codes: &mut codes, scales: &mut scales, row0: 0 }.launch(dev)?;
        // Freed in stream order, after the quantization read it.
        drop(stored);
        let w = Fp8Weights { codes, scales, rows, cols, row_block: 1, col_block: cols, expanded_row_scales: None };
        self.fp8_mat(w, act)
    }

    /// Whether `m` rows through `f` run the skinny W8A16 kernel (`linear_fp8`'s first route, which
    /// the fused FP8 epilogues take only where it holds): a shape the kernel takes, and fewer
    /// rows than the W8A8 GEMM starts at or no W8A8 route for `f`.
    pub(super) fn fp8_skinny_takes(&self, f: &Fp8Mat, m: usize) -> bool {
        use baton_kernels::cuda::{W8A8_MIN_M, gemv_fp8_supports};
        gemv_fp8_supports(m, f.w.cols, f.w.col_block) && (m < W8A8_MIN_M || !self.w8a8_takes(f))
    }

    /// Whether `f` takes the W8A8 GEMM (activations quantized per token, cuBLASLt's FP8 GEMM).
    fn w8a8_takes(&self, f: &Fp8Mat) -> bool {
        f.per_token && self.w8a8 && baton_kernels::cuda::w8a8_supports(&self.dev, &f.w)
    }

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
            CudaError, Fp8DequantCall, Fp8GemvCall, Fp8W8A8Call, Fp8W8A8QuantizedCall, gemv_fp8_supports,
        };
        let w = &f.w;
        if self.fp8_skinny_takes(f, m) {
            return Ok(Fp8GemvCall { x: &x.data, m, w, out: &mut out.data, variant: None }.launch(&self.dev)?);
        }
        if self.w8a8_takes(f) {
            // The codes of x as the op that wrote it made them (`BranchBoundary::then`), or made
            // here from the stored rows.
            let handed = self.act_codes.take().is_some_and(|c| c == ActCodes::of(x, m, w.cols));
            let launched = match (handed, &self.fp8_act) {
                (true, Some((xq, xs))) => {
                    let call = Fp8W8A8QuantizedCall { xq, xs, m, w, out: &mut out.data }.launch(&self.dev);
                    self.handoffs += u64::from(call.is_ok());
                    call
                }
                _ => {
                    let act = self.take_fp8_act(m, w.cols)?;
                    let (xq, xs) = self.fp8_act.insert(act);
                    Fp8W8A8Call { x: &x.data, m, w, xq, xs, out: &mut out.data }.launch(&self.dev)
                }
            };
            match launched {
                Ok(()) => return Ok(()),
                Err(CudaError::BlasLt(message)) => {
                    // x is stored either way: the fallbacks below read it.
                    tracing::warn!(%message, "cuBLASLt refused the FP8 (W8A8) GEMM: dequantizing instead from now on");
                    self.w8a8 = false;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if gemv_fp8_supports(m, w.cols, w.col_block) {
            // Only after cuBLASLt refused the W8A8 GEMM above.
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

impl CudaBackend {
    /// The per-token activation scratch (codes and scales) taken out of the backend, grown to
    /// `m` rows of `k`; the caller puts it back (`self.fp8_act`) once its launches are enqueued.
    pub(super) fn take_fp8_act(&mut self, m: usize, k: usize) -> Result<(CudaSlice<u8>, CudaSlice<f32>), BackendError> {
        // Whatever codes were handed over are about to be overwritten.
        self.act_codes = None;
        let (codes, scales) = (m * k, m);
        Ok(match self.fp8_act.take() {
            Some((c, s)) if c.len() >= codes && s.len() >= scales => (c, s),
            _ => (self.dev.alloc::<u8>(codes.next_power_of_two())?, self.dev.alloc::<f32>(scales.next_power_of_two())?),
        })
    }
}

/// Which buffer's per-token codes `CudaBackend::fp8_act` holds: the buffer object (its host
/// address: the same `CudaBuf` the writer wrote and the reader reads) and the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ActCodes {
    buf: usize,
    m: usize,
    k: usize,
}

impl ActCodes {
    /// The tag of `m` rows of `k` values in `buf`.
    pub(super) fn of(buf: &CudaBuf, m: usize, k: usize) -> Self {
        Self { buf: std::ptr::from_ref(buf) as usize, m, k }
    }
}

impl CudaMat {
    /// The FP8 codes and scales (on the device) of an FP8 matrix; `None` for a bf16 one. For
    /// tests and tools that check what a load produced.
    pub fn fp8_weights(&self) -> Option<&Fp8Weights> {
        self.fp8.as_ref().map(|f| &f.w)
    }
}
