//! The CUDA backend's MoE branch ([`Backend::moe_branch`](crate::backend::Backend::moe_branch)): for decode-sized steps over bf16
//! weights, the two RMSNorms of a MoE layer leave the launch sequence, as the dense layer's do
//! in the branch boundary (`cuda_boundary.rs`):
//! - o_proj's skinny GEMM adds its rows to the residual stream and leaves their sums of squares
//!   ([`ResidualLinearCall`]);
//! - the router normalizes on its loads and stores the normalized rows, which the experts'
//!   gate_up reads next (`NormRouterCall`, through [`MoeIo::Residual`]);
//! - the down product's un-permute adds the experts' weighted sum to the residual stream and
//!   leaves the new sums of squares (`MoeDownOut::Residual`);
//! - the next layer's qkv product normalizes on its loads ([`NormLinearCall`]), its bias (if
//!   any) a kernel after it.
//!
//! Invariants: `residual` ends as the unfused ops leave it, bit for bit (the same bf16 rounding
//! of each branch's output, the same f32 adds); the normalized rows and `out` differ from the
//! unfused ones only where `1 / rms`, summed in another order, lands on the other side of a bf16
//! rounding; every case it does not cover (the switch off, more rows than the skinny kernels
//! take, FP8 or biased projections, a router bias, the other MoE kernel sets) runs
//! [`moe_branch_unfused`].

use super::moe::MoeIo;
use super::{CudaBackend, CudaBuf, CudaRes, gemv_applies, kerr, record_mark};
use crate::backend::{BackendError, BoundaryScratch, MoeBranch, moe_branch_unfused};
use baton_kernels::cuda::{
    BiasAddCall, GEMV_KERNEL_MAX_M, NormInput, NormLinearCall, NormLinearOut, ResidualLinearCall, norm_stat_parts,
};

impl CudaBackend {
    /// [`Backend::moe_branch`] on this device.
    pub(super) fn moe_branch_cuda(
        &mut self,
        s: MoeBranch<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let (m, h) = (s.m, s.o.rows);
        let fusable = self.fuse_norm
            && s.o_bias.is_none()
            && [s.o, s.next, s.moe.router].iter().all(|w| w.fp8.is_none())
            && s.moe.router.cols == h
            && s.next.cols == h
            && gemv_applies(self.gemv, m, s.o.cols)
            && gemv_applies(self.gemv, m, h)
            && self.moe_takes_residual(m, &s.moe, s.routing.k);
        if !fusable {
            return moe_branch_unfused(self, s, residual, scratch, out);
        }
        if residual.len < m * h || s.x.len < m * s.o.cols {
            return Err(kerr(
                "moe_branch",
                format!("residual {} / input {} values for {m} rows of {h} / {}", residual.len, s.x.len, s.o.cols),
            ));
        }
        if let Some(b) = s.next_bias.filter(|b| b.len != s.next.rows) {
            return Err(kerr("moe_branch", format!("qkv bias has {} values for {} outputs", b.len, s.next.rows)));
        }
        // Sized once for the most rows a skinny GEMM takes, so a recorded graph's pointer stays.
        let need = GEMV_KERNEL_MAX_M * norm_stat_parts(h);
        let mut stats = match self.norm_stats.take() {
            Some(b) if b.len() >= need => b,
            _ => self.dev.alloc(need)?,
        };
        let hidden = scratch.hidden;
        self.ensure(hidden, m * h)?;
        self.ensure(out, m * s.next.rows)?;
        let launched = self.moe_branch_launches(&s, residual, &mut stats, hidden, out);
        self.norm_stats = Some(stats);
        launched?;
        self.moe_branch_fusions += 1;
        if let Some(b) = s.next_bias {
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: s.next.rows }.launch(&self.dev)?;
        }
        Ok(())
    }

    /// The fused route's launches: o_proj into the residual, the MoE block from and back to it,
    /// the next qkv product from it.
    fn moe_branch_launches(
        &mut self,
        s: &MoeBranch<'_, Self>,
        residual: &mut CudaRes,
        stats: &mut baton_kernels::cuda::CudaSlice<f32>,
        hidden: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let (m, h) = (s.m, s.o.rows);
        record_mark(&self.dev, &mut self.profile, "o_proj");
        ResidualLinearCall {
            x: &s.x.data,
            m,
            k: s.o.cols,
            w: &s.o.data,
            n: h,
            residual: &mut residual.data,
            stats,
            variant: None,
        }
        .launch(&self.dev)?;
        record_mark(&self.dev, &mut self.profile, "moe");
        let io = MoeIo::Residual {
            residual: &mut residual.data,
            stats,
            norm: &s.norm.data,
            eps: s.eps,
            hidden: &mut hidden.data,
        };
        self.moe_run(io, m, s.moe, s.routing)?;
        record_mark(&self.dev, &mut self.profile, "qkv");
        let input = NormInput { residual: &residual.data, stats, norm: &s.next_norm.data, eps: s.eps };
        let kind = NormLinearOut::Plain { n: s.next.rows };
        NormLinearCall { input, m, k: h, w: &s.next.data, kind, out: &mut out.data, variant: None }
            .launch(&self.dev)?;
        Ok(())
    }
}
