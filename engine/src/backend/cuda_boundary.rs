//! The CUDA backend's branch boundary ([`Backend::branch_boundary`]): for decode-sized batches
//! over bf16 weights, two skinny-GEMM launches instead of three ops. The ending projection adds
//! its output to the residual stream in its epilogue and leaves each row's per-CTA sums of
//! squares in `norm_stats` ([`ResidualLinearCall`]); the next projection normalizes the
//! residual on its loads ([`NormLinearCall`]), so the RMSNorm kernel's launch goes.
//!
//! Invariants: the fused route updates `residual` exactly as the unfused one (the same bf16
//! rounding of the projection, the same f32 add) and its `out` differs only where the row's
//! `1 / rms`, summed in another order, lands on the other side of a bf16 rounding; every case
//! it does not cover (more rows than the skinny GEMMs take, bf16 and FP8 weights mixed, a bias on
//! the ending projection, a GELU gate, the switch off) runs [`branch_boundary_unfused`]. FP8
//! weights take gemv_fp8.cu's fused kernels, whose gated kind also fuses the SiLU·mul that the
//! unfused FP8 path runs as its own kernel.

use super::{CudaBackend, CudaBuf, CudaRes, gemv_applies, kerr, record_mark};
use crate::backend::{BackendError, BoundaryScratch, BranchBoundary, GateAct, branch_boundary_unfused};
use baton_kernels::cuda::{
    BiasAddCall, Fp8Weights, GEMV_KERNEL_MAX_M, NormLinearCall, NormLinearOut, ProjWeights, ResidualLinearCall,
    W8A8_MIN_M, gemv_fp8_supports, norm_linear_fp8_fits, norm_stat_parts,
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
        let fusable = self.fuse_norm && s.bias.is_none() && s.next.cols == width;
        let (Some(kind), Some((end_w, next_w)), true) = (kind, self.boundary_weights(&s), fusable) else {
            return branch_boundary_unfused(self, s, residual, scratch, out);
        };
        if s.x.len < m * s.w.cols || residual.len != m * width {
            let message = format!("x {}, residual {} for {m} rows of {}→{width}", s.x.len, residual.len, s.w.cols);
            return Err(kerr("branch_boundary", message));
        }
        // Sized once for the most rows a skinny GEMM takes, so a recorded graph's pointer stays.
        let need = GEMV_KERNEL_MAX_M * norm_stat_parts(width);
        let mut stats = match self.norm_stats.take() {
            Some(b) if b.len() >= need => b,
            _ => self.dev.alloc(need)?,
        };
        let cols = match kind {
            NormLinearOut::Plain { n } => n,
            NormLinearOut::GatedSilu { d } => d,
        };
        self.ensure(out, m * cols)?;
        record_mark(&self.dev, &mut self.profile, s.labels.0);
        let end = ResidualLinearCall {
            x: &s.x.data,
            m,
            k: s.w.cols,
            w: end_w,
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
                w: next_w,
                kind,
                out: &mut out.data,
                variant: None,
            };
            next.launch(&self.dev)
        });
        self.norm_stats = Some(stats);
        launched?;
        if let Some(b) = s.next_bias {
            if b.len != cols {
                return Err(kerr("branch_boundary", format!("bias has {} values for {cols} outputs", b.len)));
            }
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: cols }.launch(&self.dev)?;
        }
        Ok(())
    }

    /// The two products' weights when the fused kernels take them: both bf16 and a batch the
    /// skinny GEMM takes ([`gemv_applies`]), or both FP8, a batch the skinny FP8 kernel takes
    /// (as `linear_fp8` decides) and a normalized x that fits the kernel's shared memory.
    fn boundary_weights<'a>(&self, s: &BranchBoundary<'a, Self>) -> Option<(ProjWeights<'a>, ProjWeights<'a>)> {
        let m = s.m;
        match (&s.w.fp8, &s.next.fp8) {
            (None, None) => (gemv_applies(self.gemv, m, s.w.cols) && gemv_applies(self.gemv, m, s.w.rows))
                .then_some((ProjWeights::Bf16(&s.w.data), ProjWeights::Bf16(&s.next.data))),
            (Some(a), Some(b)) => {
                let skinny = |w: &Fp8Weights| m < W8A8_MIN_M && gemv_fp8_supports(m, w.cols, w.col_block);
                (skinny(&a.w) && skinny(&b.w) && norm_linear_fp8_fits(m, b.w.cols))
                    .then_some((ProjWeights::Fp8(&a.w), ProjWeights::Fp8(&b.w)))
            }
            _ => None,
        }
    }
}
