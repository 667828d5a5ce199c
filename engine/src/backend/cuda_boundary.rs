//! The CUDA backend's branch boundary ([`Backend::branch_boundary`]): for decode-sized batches
//! over bf16 weights, two skinny-GEMM launches instead of three ops. The ending projection adds
//! its output to the residual stream in its epilogue and leaves each row's per-CTA sums of
//! squares in `norm_stats` ([`ResidualLinearCall`]); the next projection normalizes the
//! residual on its loads ([`NormLinearCall`]), so the RMSNorm kernel's launch goes.
//!
//! Invariants: the fused route updates `residual` exactly as the unfused one (the same bf16
//! rounding of the projection, the same f32 add) and its `out` differs only where the row's
//! `1 / rms`, summed in another order, lands on the other side of a bf16 rounding; every case
//! it does not cover (more rows than the skinny GEMM takes, FP8 weights, a bias on the ending
//! projection, a GELU gate, the switch off) runs [`branch_boundary_unfused`]. FP8 weights stay
//! unfused on purpose: the same fusion in the FP8 skinny GEMM (c686c61..00d922e, reverted) made
//! Llama-3.1-8B's b = 1 step 3.5–16 % slower and b = 8 up to 71 % (BENCHMARKS.md, session 16).

use super::{CudaBackend, CudaBuf, CudaRes, gemv_applies, kerr, record_mark};
use crate::backend::{BackendError, BoundaryScratch, BranchBoundary, GateAct, branch_boundary_unfused};
use baton_kernels::cuda::{
    BiasAddCall, GEMV_KERNEL_MAX_M, NormLinearCall, NormLinearOut, ResidualLinearCall, norm_stat_parts,
};

impl CudaBackend {
    /// [`Backend::branch_boundary`] on this device.
    pub(super) fn branch_boundary_cuda(
        &mut self,
        s: BranchBoundary<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let (m, width) = (s.m, s.w.rows);
        let kind = match s.gate {
            None => Some(NormLinearOut::Plain { n: s.next.rows }),
            Some(g) if g.act == GateAct::Silu && s.next.rows == 2 * g.d && self.fuse_gate => {
                Some(NormLinearOut::GatedSilu { d: g.d })
            }
            Some(_) => None,
        };
        let fusable = self.fuse_norm
            && s.bias.is_none()
            && s.w.fp8.is_none()
            && s.next.fp8.is_none()
            && s.next.cols == width
            && gemv_applies(self.gemv, m, s.w.cols)
            && gemv_applies(self.gemv, m, width);
        let Some(kind) = kind.filter(|_| fusable) else {
            return branch_boundary_unfused(self, s, residual, scratch, out);
        };
        if s.x.len < m * s.w.cols || residual.len != m * width {
            let message = format!("x {}, residual {} for {m} rows of {}→{width}", s.x.len, residual.len, s.w.cols);
            return Err(kerr("branch_boundary", message));
        }
        let cols = match kind {
            NormLinearOut::Plain { n } => n,
            NormLinearOut::GatedSilu { d } => d,
        };
        if let Some(b) = s.next_bias.filter(|b| b.len != cols) {
            return Err(kerr("branch_boundary", format!("bias has {} values for {cols} outputs", b.len)));
        }
        // Sized once for the most rows a skinny GEMM takes, so a recorded graph's pointer stays.
        let need = GEMV_KERNEL_MAX_M * norm_stat_parts(width);
        let mut stats = match self.norm_stats.take() {
            Some(b) if b.len() >= need => b,
            _ => self.dev.alloc(need)?,
        };
        self.ensure(out, m * cols)?;
        record_mark(&self.dev, &mut self.profile, s.labels.0);
        let end = ResidualLinearCall {
            x: &s.x.data,
            m,
            k: s.w.cols,
            w: &s.w.data,
            n: width,
            residual: &mut residual.data,
            stats: &mut stats,
            variant: None,
        };
        let launched = end.launch(&self.dev).and_then(|()| {
            record_mark(&self.dev, &mut self.profile, s.labels.1);
            let next = NormLinearCall {
                residual: &residual.data,
                stats: &stats,
                norm: &s.norm.data,
                eps: s.eps,
                m,
                k: width,
                w: &s.next.data,
                kind,
                out: &mut out.data,
                variant: None,
            };
            next.launch(&self.dev)
        });
        self.norm_stats = Some(stats);
        launched?;
        if let Some(b) = s.next_bias {
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: cols }.launch(&self.dev)?;
        }
        Ok(())
    }
}
