//! The CUDA backend's gated MLP projection ([`Backend::gated_linear`]): for decode-sized
//! batches, one skinny-GEMM launch with the activation in its epilogue ([`GatedLinearCall`] over
//! bf16 weights, [`Fp8GatedGemvCall`] over FP8 weights where the FP8 product would take the
//! skinny kernel), which saves the activation kernel's launch and the `[gate | up]` round trip
//! through memory; every other case (more rows than the skinny GEMM takes, the W8A8 route, the
//! skinny GEMM or the switch off) runs the unfused pair.
//!
//! Invariant: both routes write the same bits to `out` (the fused epilogue rounds gate and up
//! to bf16 and applies the activation kernel's own formula, with the variant the unfused
//! product would pick); the fused route leaves `scratch` as it was.

use super::{CudaBackend, CudaBuf, CudaMat, gemv_applies, kerr};
use crate::backend::{BackendError, Gate, GateAct, gated_linear_unfused};
use baton_kernels::cuda::{Fp8GatedGemvCall, GatedAct, GatedLinearCall};

impl CudaBackend {
    /// [`Backend::gated_linear`] on this device.
    pub(super) fn gated_linear_cuda(
        &mut self,
        x: &CudaBuf,
        m: usize,
        w: &CudaMat,
        gate: Gate,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let shaped = self.fuse_gate && w.rows == 2 * gate.d;
        let fusable = match &w.fp8 {
            None => shaped && gemv_applies(self.gemv, m, w.cols),
            Some(f) => shaped && self.fp8_skinny_takes(f, m),
        };
        if !fusable {
            return gated_linear_unfused(self, x, m, w, gate, scratch, out);
        }
        if x.len < m * w.cols {
            return Err(kerr("gated_linear", format!("input has {} values, need {m}×{}", x.len, w.cols)));
        }
        self.ensure(out, m * gate.d)?;
        let act = match gate.act {
            GateAct::Silu => GatedAct::Silu,
            GateAct::GeluTanh => GatedAct::GeluTanh,
        };
        let (d, out) = (gate.d, &mut out.data);
        match &w.fp8 {
            Some(f) => {
                Fp8GatedGemvCall { x: &x.data, m, w: &f.w, d, act, out, variant: None }.launch(&self.dev)?;
                self.fp8_gated_epilogues += 1;
                Ok(())
            }
            None => {
                let call = GatedLinearCall { x: &x.data, m, k: w.cols, w: &w.data, d, act, out, variant: None };
                Ok(call.launch(&self.dev)?)
            }
        }
    }
}
