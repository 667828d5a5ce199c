//! The MoE router of decode-sized steps fused with the routing and the permutation
//! (moe_router.cu): [`MoeRouterCall`] computes the router logits (f32, plus the router's bias
//! in f32) and then does what [`super::MoeRoutePermuteCall`] does with them, in one launch
//! instead of a GEMV and the route + permute kernel.
//!
//! Invariants: the counter is zero between launches (the last CTA of each launch resets it), so
//! a launch records into a CUDA graph and replays; two launches sharing a counter never overlap
//! (launches on one stream do not); the grid is sized from the expert count alone; the routing
//! is `moe_route_row` itself (the ids and weights of given logits are those of
//! `moe_route_f32`), the permutation the stable one of `moe_permute` (assignment order within
//! an expert). The logits are summed in another order than the router GEMV's, so the fused
//! path matches the split one to f32 rounding (tests compare both with the CPU).

use super::launch::{cfg, int, need, shape_check};
use super::moe::{MoeRoutePermuteCall, route_args};
use super::{CudaDevice, CudaError, CudaSlice};
use half::bf16;

/// Most token rows the fused router takes (one routing warp a row in the last CTA).
pub const MOE_ROUTER_MAX_ROWS: usize = 16;

/// Warps per CTA: one expert's logits each, and the routing warps of the last CTA.
const ROUTER_WARPS: usize = 16;

/// The router GEMM, routing and permutation of `rows ≤ MOE_ROUTER_MAX_ROWS` token rows in
/// one launch: `logits = x · routerᵀ (+ bias)` in f32, then each row's top-k and the
/// assignments grouped by expert, as [`MoeRoutePermuteCall`] gives them from those logits.
pub struct MoeRouterCall<'a> {
    /// `rows × h` bf16 (the normed hidden states).
    pub x: &'a CudaSlice<bf16>,
    /// Hidden width, a multiple of 8.
    pub h: usize,
    /// The router, `n_experts × h` bf16.
    pub w: &'a CudaSlice<bf16>,
    /// The router's bias, `n_experts` bf16, added in f32 (gpt-oss); `None` for none.
    pub bias: Option<&'a CudaSlice<bf16>>,
    /// One counter, zero before the first launch (each launch leaves it zero).
    pub counter: &'a mut CudaSlice<u32>,
    /// The routing and permutation; `route.logits` (`rows × n_experts` f32) is scratch this
    /// launch writes, `route.rows` the token rows.
    pub then: MoeRoutePermuteCall<'a>,
}

impl MoeRouterCall<'_> {
    /// Checks the sizes and enqueues `moe_router_route_permute`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_router";
        let Self { x, h, w, bias, counter, then } = self;
        let MoeRoutePermuteCall { route, offsets, order, position } = then;
        let (rows, ne) = (route.rows, route.n_experts);
        shape_check(OP, rows <= MOE_ROUTER_MAX_ROWS, || {
            format!("{rows} rows (the fused router takes at most {MOE_ROUTER_MAX_ROWS})")
        })?;
        shape_check(OP, h > 0 && h.is_multiple_of(8), || format!("hidden {h} is not a positive multiple of 8"))?;
        let args = route_args(OP, &route)?;
        let n = rows * route.routing.k;
        need(OP, "offsets", offsets, ne + 1)?;
        need(OP, "order", order, n)?;
        need(OP, "position", position, n)?;
        need(OP, "x", x, rows * h)?;
        need(OP, "router", w, ne * h)?;
        if let Some(b) = bias {
            need(OP, "bias", b, ne)?;
        }
        need(OP, "counter", counter, 1)?;
        let args = args.buf(&*offsets).buf(&*order).buf(&*position).buf(x).int(h)?.buf(w);
        // A null pointer tells the kernel there is no bias.
        let args = match bias {
            Some(b) => args.buf(b),
            None => args.u64(0),
        };
        let args = args.buf(&*counter);
        let grid = cfg((int(OP, ne.div_ceil(ROUTER_WARPS))? as u32, 1, 1), (32 * ROUTER_WARPS) as u32);
        // Launched even for no rows: the offsets are still written (all zero).
        // SAFETY: warp w of CTA c reads expert c·16 + w's router row (< n_experts, `w` is
        // n_experts × h) and bias, the rows < `rows` of `x` (rows × h), and writes that
        // expert's logit of each row (rows × n_experts); the last CTA reads the logits, writes
        // `rows · k` ids and weights, n_experts + 1 offsets and `rows · k` order and position
        // entries (ranks within 0..rows · k), and one counter; all sizes checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.router_route_permute, grid) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_match_the_kernel_source() {
        let src = include_str!("../../cuda/moe_router.cu");
        assert!(src.contains(&format!("#define MOE_RRP_WARPS {ROUTER_WARPS}")));
        assert!(src.contains(&format!("#define MOE_RRP_MAX_ROWS {MOE_ROUTER_MAX_ROWS}")));
        // One routing warp per row in the last CTA.
        const { assert!(MOE_ROUTER_MAX_ROWS <= ROUTER_WARPS) };
    }
}
