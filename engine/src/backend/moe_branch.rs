//! A mixture-of-experts layer's MLP branch, from the attention output to the next layer's qkv
//! product, as one backend op ([`Backend::moe_branch`]): o_proj added to the residual stream,
//! the post-attention norm, the MoE block, its output added to the residual, the next layer's
//! input norm and its qkv product.
//!
//! Seen as one op, a backend may fuse across both norms, as [`Backend::branch_boundary`] does
//! for a dense layer: CUDA adds o_proj to the residual in its skinny GEMM's epilogue, normalizes
//! on the router's loads (which also stores the normalized rows for the experts), adds the
//! experts' weighted sum to the residual in the down product's epilogue and normalizes on the
//! qkv product's loads, so neither norm is a launch of its own.
//!
//! Invariant: every implementation leaves `residual` and `out` as [`moe_branch_unfused`] does,
//! up to the rounding [`Backend::branch_boundary`]'s fusion allows (`1 / rms` summed in another
//! order may move a normalized element by one bf16 step); the scratch buffers
//! ([`BoundaryScratch`]) hold nothing a caller may read afterwards.

use super::{Backend, BackendError, BoundaryScratch, MoeWeights};
use baton_kernels::cpu::MoeRouting;

/// What [`Backend::moe_branch`] computes: `residual += x · oᵀ (+ o_bias)`,
/// `h = rms_norm(residual) · norm`, `residual += moe(h)`, `h' = rms_norm(residual) · next_norm`,
/// `out = h' · nextᵀ (+ next_bias)`.
pub struct MoeBranch<'a, B: Backend + ?Sized> {
    /// Rows (tokens).
    pub m: usize,
    /// The attention output (`m × o.cols`).
    pub x: &'a B::Buf,
    /// The attention branch's output projection.
    pub o: &'a B::Mat,
    /// Its bias, if the checkpoint has one.
    pub o_bias: Option<&'a B::Buf>,
    /// The post-attention norm's weight.
    pub norm: &'a B::Buf,
    /// Added to the mean square of both norms.
    pub eps: f32,
    /// The MoE block's router and experts.
    pub moe: MoeWeights<'a, B::Mat, B::Buf>,
    /// Its routing.
    pub routing: MoeRouting,
    /// The next layer's input norm.
    pub next_norm: &'a B::Buf,
    /// The next layer's qkv projection.
    pub next: &'a B::Mat,
    /// Its bias, if the checkpoint has one.
    pub next_bias: Option<&'a B::Buf>,
}

/// [`Backend::moe_branch`] as its ops, each marked for a step profile: [`Backend::linear`],
/// [`Backend::add_rms_norm`], [`Backend::moe`], [`Backend::add_rms_norm`], [`Backend::linear`].
pub fn moe_branch_unfused<B: Backend + ?Sized>(
    b: &mut B,
    s: MoeBranch<'_, B>,
    residual: &mut B::Res,
    scratch: BoundaryScratch<'_, B>,
    out: &mut B::Buf,
) -> Result<(), BackendError> {
    let BoundaryScratch { proj, hidden, .. } = scratch;
    b.mark("o_proj");
    b.linear(s.x, s.m, s.o, s.o_bias, proj)?;
    b.mark("norm");
    b.add_rms_norm(residual, proj, s.norm, s.eps, hidden)?;
    b.mark("moe");
    b.moe(hidden, s.m, s.moe, s.routing, proj)?;
    b.mark("norm");
    b.add_rms_norm(residual, proj, s.next_norm, s.eps, hidden)?;
    b.mark("qkv");
    b.linear(hidden, s.m, s.next, s.next_bias, out)
}
