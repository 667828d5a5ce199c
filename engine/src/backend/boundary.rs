//! The boundary between two residual branches of a pre-norm transformer layer, as one backend
//! op ([`Backend::branch_boundary`]): the ending branch's output projection added to the
//! residual stream, the RMSNorm, and the next branch's first projection (plain or gated).
//!
//! Seen as one op, a backend may fuse across the norm: CUDA adds the projection to the residual
//! in the skinny GEMM's epilogue and normalizes on the next GEMM's loads, so the norm's
//! single-CTA launch (twice a layer, on the decode step's critical path) disappears.
//!
//! When the next branch is attention, the boundary may also take its RoPE and KV write
//! ([`BoundaryRope`]): CUDA then rotates q and k in the qkv product's epilogue and writes the
//! cache from there, so RoPE's own launch goes too.
//!
//! Invariant: every implementation leaves `residual` and `out` (or, with a [`BoundaryRope`],
//! its `q` and the layer's cache) as [`branch_boundary_unfused`] does; the scratch buffers
//! ([`BoundaryScratch`]) hold nothing a caller may read afterwards.

use super::{Backend, BackendError, BatchLayout, Gate};
use baton_kernels::cpu::KernelError;

/// What [`Backend::branch_boundary`] computes: `residual += x · wᵀ (+ bias)`, then
/// `h = rms_norm(residual) · norm`, then `out = h · nextᵀ (+ next_bias)` or, with a gate, the
/// gated MLP's `act(gate) · up` of `h · nextᵀ` ([`Backend::gated_linear`]).
pub struct BranchBoundary<'a, B: Backend + ?Sized> {
    /// Rows (tokens).
    pub m: usize,
    /// The ending branch's last activation (`m × w.cols`).
    pub x: &'a B::Buf,
    /// The ending branch's output projection (o_proj, down).
    pub w: &'a B::Mat,
    /// Its bias, if the checkpoint has one.
    pub bias: Option<&'a B::Buf>,
    /// The norm's weight.
    pub norm: &'a B::Buf,
    /// Added to the mean square.
    pub eps: f32,
    /// The next branch's first projection (qkv, gate_up).
    pub next: &'a B::Mat,
    /// Its bias (plain projections only: a gated projection with a bias is refused).
    pub next_bias: Option<&'a B::Buf>,
    /// `Some` for the gated MLP projection.
    pub gate: Option<Gate>,
    /// Step-profile labels of the two projections (`("o_proj", "gate_up")`).
    pub labels: (&'static str, &'static str),
    /// The projection that reads `out` next, where it is the very next op to touch `out` (the
    /// gated MLP's down projection): a backend may then also hand `out` over in a form of its
    /// own (CUDA: the per-token FP8 codes of a W8A8 down projection's input, so that it does not
    /// quantize `out` again). `out` is written either way. `None`: nothing is assumed.
    pub then: Option<&'a B::Mat>,
    /// `Some` when `next` is the attention branch's qkv projection and the boundary is to end
    /// with its RoPE and KV write too (plain projections only).
    pub rope: Option<BoundaryRope<'a, B>>,
}

/// The RoPE and KV write that follow a qkv projection ([`Backend::split_rope_and_write_kv`] of
/// the boundary's `out`, with these arguments). Afterwards `q` holds the rotated q and layer
/// `layer`'s cache the step's k and v; `out`, `k` and `v` are unspecified (a fused backend
/// never stores the qkv rows).
pub struct BoundaryRope<'a, B: Backend + ?Sized> {
    /// The layer whose cache is written.
    pub layer: usize,
    /// `(q, k, v)` widths of a qkv row.
    pub widths: (usize, usize, usize),
    /// Query heads.
    pub n_heads: usize,
    /// The step's rows (positions, cache slots).
    pub batch: &'a BatchLayout,
    /// The rotated q.
    pub q: &'a mut B::Buf,
    /// Scratch for k.
    pub k: &'a mut B::Buf,
    /// Scratch for v.
    pub v: &'a mut B::Buf,
}

/// Buffers [`Backend::branch_boundary`] may use on the way; their contents afterwards are
/// unspecified.
pub struct BoundaryScratch<'a, B: Backend + ?Sized> {
    /// The ending projection's output.
    pub proj: &'a mut B::Buf,
    /// The normalized activation.
    pub hidden: &'a mut B::Buf,
    /// `[gate | up]` of a gated projection that is not fused.
    pub gate_up: &'a mut B::Buf,
}

/// Refuses the combinations no implementation takes: a gated projection with a bias, or with a
/// [`BoundaryRope`]. Every implementation calls it before enqueuing anything.
pub(crate) fn check_boundary<B: Backend + ?Sized>(s: &BranchBoundary<'_, B>) -> Result<(), BackendError> {
    let refuse =
        |message: &str| Err(BackendError::Kernel(KernelError { op: "branch_boundary", message: message.to_string() }));
    match (s.gate, s.next_bias, &s.rope) {
        (Some(_), Some(_), _) => refuse("a gated projection with a bias"),
        (Some(_), _, Some(_)) => refuse("RoPE after a gated projection"),
        _ => Ok(()),
    }
}

/// [`Backend::branch_boundary`] as its ops: [`Backend::linear`], [`Backend::add_rms_norm`],
/// [`Backend::linear`] or [`Backend::gated_linear`], then with a [`BoundaryRope`]
/// [`Backend::split_rope_and_write_kv`], each marked for a step profile.
pub fn branch_boundary_unfused<B: Backend + ?Sized>(
    b: &mut B,
    s: BranchBoundary<'_, B>,
    residual: &mut B::Res,
    scratch: BoundaryScratch<'_, B>,
    out: &mut B::Buf,
) -> Result<(), BackendError> {
    check_boundary(&s)?;
    end_branch_and_norm(b, &s, residual, scratch.proj, scratch.hidden)?;
    match s.gate {
        None => b.linear(scratch.hidden, s.m, s.next, s.next_bias, out)?,
        Some(gate) => b.gated_linear(scratch.hidden, s.m, s.next, gate, scratch.gate_up, out)?,
    }
    match s.rope {
        Some(r) => rope_after(b, r, out),
        None => Ok(()),
    }
}

/// The unfused boundary's first two ops, each marked: the ending projection into `proj`, then
/// the residual add and the norm into `hidden` (what the next projection reads). Also the start
/// of a backend's route that fuses only the next projection's epilogue.
pub(crate) fn end_branch_and_norm<B: Backend + ?Sized>(
    b: &mut B,
    s: &BranchBoundary<'_, B>,
    residual: &mut B::Res,
    proj: &mut B::Buf,
    hidden: &mut B::Buf,
) -> Result<(), BackendError> {
    b.mark(s.labels.0);
    b.linear(s.x, s.m, s.w, s.bias, proj)?;
    b.mark("norm");
    b.add_rms_norm(residual, proj, s.norm, s.eps, hidden)?;
    b.mark(s.labels.1);
    Ok(())
}

/// A [`BoundaryRope`] run as its own op over the stored qkv rows `qkv`.
pub(crate) fn rope_after<B: Backend + ?Sized>(
    b: &mut B,
    r: BoundaryRope<'_, B>,
    qkv: &B::Buf,
) -> Result<(), BackendError> {
    b.mark("rope_kv");
    b.split_rope_and_write_kv(r.layer, qkv, r.widths, r.n_heads, r.batch, r.q, r.k, r.v)
}
