//! The CUDA backend's weight loading: counter-drawn random weights (`--load-format dummy`,
//! drawn on the device), stored tensors streamed up through the page-locked weight ring
//! ([`WeightUploader`]: the copies overlap reading the next tensor), and the report of that
//! upload once the last weight is in.
//!
//! Invariant: a buffer returned here may still be filling when the call returns; its copies
//! are on the device's one stream, so every later op sees it complete.

use super::{CudaBackend, kerr};
use crate::backend::{BackendError, WeightUploadReport};
use baton_formats::{CounterInit, DType, TensorView};
use baton_kernels::cuda::{CudaSlice, HostDType, HostTensor, WeightUploader, bf16};

/// f32 values rounded to bf16 (to nearest even).
pub(super) fn to_bf16(data: &[f32]) -> Vec<bf16> {
    data.iter().map(|&v| bf16::from_f32(v)).collect()
}

impl CudaBackend {
    /// The counter draws `parts` (rows each) of `cols` columns, one bf16 buffer.
    pub(super) fn draw(
        &mut self,
        parts: &[(usize, CounterInit)],
        cols: usize,
    ) -> Result<CudaSlice<bf16>, BackendError> {
        let total: usize = parts.iter().map(|p| p.0 * cols).sum();
        let mut data = self.dev.alloc::<bf16>(total)?;
        let mut offset = 0;
        for (rows, init) in parts {
            self.dev.fill_counter(&mut data, offset, rows * cols, (init.key, init.mean, init.amp))?;
            offset += rows * cols;
        }
        Ok(data)
    }

    /// A new bf16 buffer of `len` elements filled from the stored tensors `parts`, stacked,
    /// through the weight ring (the copies may still be in flight on return; they precede
    /// every later op on the stream).
    pub(super) fn stream_weights(
        &mut self,
        op: &'static str,
        parts: &[TensorView<'_>],
        len: usize,
    ) -> Result<CudaSlice<bf16>, BackendError> {
        let host: Vec<HostTensor<'_>> = parts
            .iter()
            .map(|t| {
                let dtype = match t.dtype {
                    DType::BF16 => HostDType::Bf16,
                    DType::F16 => HostDType::F16,
                    DType::F32 => HostDType::F32,
                    // FP8 weights come through `upload_mat_fp8` with their scales.
                    DType::F8E4M3 => return Err(kerr(op, format!("tensor {} is FP8 without its scales", t.name))),
                };
                Ok(HostTensor { bytes: &t.bytes, dtype })
            })
            .collect::<Result<_, BackendError>>()?;
        let have: usize = host.iter().map(HostTensor::len).sum();
        if have != len || parts.iter().any(|t| t.bytes.len() != t.numel() * t.dtype.size()) {
            return Err(kerr(op, format!("{have} stored values for {len} elements")));
        }
        let mut data = self.dev.alloc::<bf16>(len)?;
        self.uploader.get_or_insert_with(WeightUploader::default).upload(&self.dev, &host, &mut data)?;
        Ok(data)
    }

    /// Waits for the streamed weights and reports the upload (None when nothing was streamed).
    pub(super) fn finish_upload(&mut self) -> Result<Option<WeightUploadReport>, BackendError> {
        let Some(mut up) = self.uploader.take() else { return Ok(None) };
        let s = up.finish(&self.dev)?;
        Ok(Some(WeightUploadReport {
            bytes_read: s.bytes_read,
            bytes_uploaded: s.bytes_uploaded,
            read_s: s.fill_s,
            wait_s: s.wait_s,
        }))
    }
}
