//! The CUDA backend's MoE branch ([`Backend::moe_branch`](crate::backend::Backend::moe_branch)):
//! for decode-sized steps over bf16 weights, the two RMSNorms of a MoE layer can leave the launch
//! sequence, as the dense layer's do in the branch boundary (`cuda_boundary.rs`). Off by default:
//! on the H100 each choice measured slower than the norm kernels (BENCHMARKS.md, session 32);
//! [`CudaBackend::set_moe_norm_fusion`] picks one for comparisons.
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
    AddRmsNormCall, BiasAddCall, CudaSlice, LinearCall, LinearKernel, NormInput, NormLinearCall, NormLinearOut,
    ResidualLinearCall, bf16,
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
        let fusion = self.moe_norm_fusion.filter(|_| {
            self.fuse_norm
                && s.o_bias.is_none()
                && [s.o, s.next, s.moe.router].iter().all(|w| w.fp8.is_none())
                && s.moe.router.cols == h
                && s.next.cols == h
                && gemv_applies(self.gemv, m, s.o.cols)
                && gemv_applies(self.gemv, m, h)
                && self.moe_takes_residual(m, &s.moe, s.routing.k)
        });
        let Some(fusion) = fusion else {
            return moe_branch_unfused(self, s, residual, scratch, out);
        };
        if residual.len < m * h || s.x.len < m * s.o.cols {
            return Err(kerr(
                "moe_branch",
                format!("residual {} / input {} values for {m} rows of {h} / {}", residual.len, s.x.len, s.o.cols),
            ));
        }
        if let Some(b) = s.next_bias.filter(|b| b.len != s.next.rows) {
            return Err(kerr("moe_branch", format!("qkv bias has {} values for {} outputs", b.len, s.next.rows)));
        }
        let mut stats = self.take_norm_stats(h)?;
        let hidden = scratch.hidden;
        self.ensure(hidden, m * h)?;
        self.ensure(out, m * s.next.rows)?;
        let proj = scratch.proj;
        self.ensure(proj, m * h)?;
        let launched = self.moe_branch_launches(&s, fusion, residual, &mut stats, hidden, proj, out);
        self.norm_stats = Some(stats);
        launched?;
        self.norm_fusions.1 += 1;
        if let Some(b) = s.next_bias {
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: s.next.rows }.launch(&self.dev)?;
        }
        Ok(())
    }

    /// The fused route's launches (both norms fused, or the one `mode` picks, the other as the
    /// norm kernel): o_proj, the MoE block, the next qkv product.
    fn moe_branch_launches(
        &mut self,
        s: &MoeBranch<'_, Self>,
        mode: MoeNormFusion,
        residual: &mut CudaRes,
        stats: &mut CudaSlice<f32>,
        hidden: &mut CudaBuf,
        proj: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let (m, h) = (s.m, s.o.rows);
        let dev = &self.dev;
        let profile = &mut self.profile;
        record_mark(dev, profile, "o_proj");
        if mode == MoeNormFusion::Down {
            LinearCall {
                x: &s.x.data,
                m,
                k: s.o.cols,
                w: &s.o.data,
                n: h,
                out: &mut proj.data,
                kernel: LinearKernel::GEMV,
            }
            .launch(dev)?;
            record_mark(dev, profile, "norm");
            add_rms_norm(dev, residual, proj, &s.norm.data, s.eps, (m, h), hidden)?;
        } else {
            let w = &s.o.data;
            ResidualLinearCall {
                x: &s.x.data,
                m,
                k: s.o.cols,
                w,
                n: h,
                residual: &mut residual.data,
                stats,
                variant: None,
            }
            .launch(dev)?;
        }
        record_mark(dev, profile, "moe");
        let (res, norm, eps) = (&mut residual.data, &s.norm.data, s.eps);
        let io = match mode {
            MoeNormFusion::Both => MoeIo::Residual { residual: res, stats, norm, eps, hidden: &mut hidden.data },
            MoeNormFusion::Down => MoeIo::RowsToResidual { x: &hidden.data, residual: res, stats },
            MoeNormFusion::Router => MoeIo::ResidualToRows {
                input: NormInput { residual: res, stats, norm, eps },
                hidden: &mut hidden.data,
                out: &mut proj.data,
            },
        };
        self.moe_run(io, m, s.moe, s.routing)?;
        let dev = &self.dev;
        let profile = &mut self.profile;
        if mode == MoeNormFusion::Router {
            record_mark(dev, profile, "norm");
            add_rms_norm(dev, residual, proj, &s.next_norm.data, s.eps, (m, h), hidden)?;
            record_mark(dev, profile, "qkv");
            let n = s.next.rows;
            let kernel = LinearKernel::GEMV;
            return Ok(
                LinearCall { x: &hidden.data, m, k: h, w: &s.next.data, n, out: &mut out.data, kernel }.launch(dev)?
            );
        }
        record_mark(dev, profile, "qkv");
        let input = NormInput { residual: &residual.data, stats, norm: &s.next_norm.data, eps: s.eps };
        let kind = NormLinearOut::Plain { n: s.next.rows };
        NormLinearCall { input, m, k: h, w: &s.next.data, kind, out: &mut out.data, variant: None }.launch(dev)?;
        Ok(())
    }
}

/// The unfused norm of the half that is not fused: `residual += proj`, `hidden = rms_norm ·
/// weight`, over `rows` rows of `dim`.
fn add_rms_norm(
    dev: &baton_kernels::cuda::CudaDevice,
    residual: &mut CudaRes,
    proj: &CudaBuf,
    weight: &CudaSlice<bf16>,
    eps: f32,
    (rows, dim): (usize, usize),
    hidden: &mut CudaBuf,
) -> Result<(), BackendError> {
    let (residual, x, out) = (&mut residual.data, &proj.data, &mut hidden.data);
    Ok(AddRmsNormCall { residual, x, weight, rows, dim, eps, out }.launch(dev)?)
}

/// Which of a MoE layer's two norms [`Backend::moe_branch`](crate::backend::Backend::moe_branch)
/// fuses on CUDA when the fused norm is on ([`CudaBackend::set_moe_norm_fusion`]; by default
/// neither, and the norms stay kernels of their own). Each measured slower on the H100
/// (Qwen3-30B-A3B shape; BENCHMARKS.md, session 32): removing a norm's launch saves less than
/// the norm-input products (the router's 8 CTAs among them) add to the step's critical path
/// under PDL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeNormFusion {
    /// Both: o_proj into the residual, the router from it, down's un-permute into it, qkv from it.
    Both,
    /// The post-attention norm only: o_proj into the residual and the router from it.
    Router,
    /// The next layer's input norm only: down's un-permute into the residual and qkv from it.
    Down,
}

impl MoeNormFusion {
    /// The name `bench_cuda --moe-norm` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Router => "router",
            Self::Down => "down",
        }
    }

    /// The fusion `name` (as [`Self::name`] writes it), if any.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::Both, Self::Router, Self::Down].into_iter().find(|f| f.name() == name)
    }
}
