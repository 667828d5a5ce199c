//! The CUDA backend's mixture-of-experts op ([`Backend::moe`](crate::backend::Backend::moe)):
//! the router GEMM with an f32 output (plus the router's bias in f32, gpt-oss), then the moe
//! kernels of `baton_kernels::cuda` in the order their module documents (routing and
//! permutation, in one launch for decode-sized steps; the grouped `[gate | up]` product with
//! its bias and the activation (SiLU·mul, or gpt-oss's clamped SwiGLU over interleaved rows),
//! fused into one launch over the experts in use for decode-sized steps, a tiled GEMM then the
//! activation for prefill-sized ones (64 × 128 tiles on the default set when experts average
//! 64 entries); the grouped `down` product with its bias; the weighted
//! un-permute). Steps of at most [`MOE_ROUTER_MAX_ROWS`] rows run four launches a layer
//! ([`MoeKernels::Fused`], the default): the router GEMV, routing with the permutation, gate_up
//! with its activation, and down with the un-permute ([`MoeDownUnpermuteCall`]).
//! [`CudaBackend::set_moe_kernels`] selects the other sets for comparisons:
//! [`MoeKernels::FusedRouter`] (three launches: the router GEMV with the routing and
//! permutation, [`MoeRouterCall`]; measured slower on the H100, see the variant),
//! [`MoeKernels::Split`] (five launches, and the 64 × 64 GEMM tiles at every prefill size) and
//! [`MoeKernels::First`] (routing and permutation apart, the CUDA-core GEMV over every expert,
//! the activation apart). Each kernel gets a profile mark (`moe_*`), so `bench_cuda`'s per-op
//! profile splits the layer.
//!
//! Invariants: the scratch buffers only grow (through the device allocator, so a growth
//! moves the allocation generation and drops recorded graphs); the fused kernels' counters are
//! zero between launches (allocated zeroed, each launch leaves them zero); every launch has a shape fixed
//! by the row count alone (the grouped products' grids are sized by `min(experts, rows · k)` or
//! every expert, the routing and permutation one CTA), and nothing synchronizes with the host,
//! so a decode step with MoE layers records and replays as a CUDA graph like any other. The
//! kernel choice is a function of the row count and the shapes, so a replayed step runs what
//! it recorded. Padding rows of a replayed step are routed like real ones; their outputs are
//! never read.

use super::{CudaBackend, CudaBuf, CudaMat, gemv_applies, kerr, linear_kernel, record_mark};
use crate::backend::{BackendError, MoeActivation, MoeWeights};
use baton_kernels::cpu::{MoeRouting, MoeRows};
use baton_kernels::cuda::{
    BiasAddF32Call, ClampedSwigluCall, CudaDevice, CudaSlice, LinearCall, MOE_MAX_EXPERTS, MOE_MAX_K,
    MOE_ROUTER_MAX_ROWS, MOE_UNPERMUTE_RESID_MAX_ROWS, MoeDownOut, MoeDownUnpermuteCall, MoeExpertKernel,
    MoeGateUpActCall, MoeGatedAct, MoeGroupedGemvCall, MoePermuteCall, MoeRouteCall, MoeRoutePermuteCall,
    MoeRouterCall, MoeUnpermuteCall, NormInput, NormRouterCall, SiluMulCall, bf16, moe_gemm_preferred,
    moe_unpermute_counters,
};
use cudarc::driver::DeviceRepr;

/// Which set of kernels the MoE op runs ([`CudaBackend::set_moe_kernels`]); all compute the
/// same function (to bf16 rounding; the router's f32 logits are summed in another order by the
/// fused router).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKernels {
    /// The first kernels: routing and permutation as two launches, the CUDA-core grouped GEMV
    /// with a CTA column for every expert, the activation as its own launch.
    First,
    /// Five launches at decode sizes: the router GEMV, route + permute, gate_up with its
    /// activation, down, un-permute (the tensor-core skinny product over the experts in use);
    /// prefill-sized steps on the 64 × 64 grouped GEMM.
    Split,
    /// [`Self::Split`] with, for steps of at most [`MOE_ROUTER_MAX_ROWS`] rows, the un-permute
    /// fused into down (four launches), and the wide (64 × 128) grouped GEMM for experts
    /// averaging 64 entries (the default).
    Fused,
    /// [`Self::Fused`] with the router GEMV fused with route + permute as well (three
    /// launches). Slower than [`Self::Fused`] on the H100 (Qwen3-30B-A3B shape, session 14:
    /// 18.7 against 15.4 µs a layer eager at one row, 52 against 21 µs at 16): its 8 CTAs of
    /// one warp per expert row stream the 0.5 MB router more slowly than the GEMV's grid, and
    /// the last CTA's routing waits for all of them. Kept for the comparison.
    FusedRouter,
}

impl MoeKernels {
    /// The name `bench_cuda --moe-kernel` and its records use.
    pub fn name(self) -> &'static str {
        match self {
            Self::First => "legacy",
            Self::Split => "split",
            Self::Fused => "new",
            Self::FusedRouter => "fused-router",
        }
    }
}

/// Device scratch of the MoE op, grown to the largest step and reused by every layer.
pub(super) struct MoeScratch {
    /// Router logits, `rows × experts` f32.
    logits: CudaSlice<f32>,
    /// `rows × k` expert ids and weights.
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    /// The permutation: `experts + 1` offsets, `rows × k` order and position.
    offsets: CudaSlice<i32>,
    order: CudaSlice<i32>,
    position: CudaSlice<i32>,
    /// `rows · k × 2I` (`[gate | up]`), `rows · k × I` (activated), `rows · k × hidden`.
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    expert_out: CudaSlice<bf16>,
    /// The fused router's counter (one) and the fused un-permute's tile counters; zero
    /// between launches.
    router_counter: CudaSlice<u32>,
    tile_counters: CudaSlice<u32>,
    /// The kernel set ([`CudaBackend::set_moe_kernels`]).
    kernels: MoeKernels,
}

/// Replaces `buf` with a larger allocation when it holds fewer than `len` elements.
fn grow<T: DeviceRepr>(dev: &CudaDevice, buf: &mut CudaSlice<T>, len: usize) -> Result<(), BackendError> {
    if buf.len() < len {
        *buf = dev.alloc(len.next_power_of_two())?;
    }
    Ok(())
}

/// [`grow`] for counters: the new allocation is zeroed (the fused kernels' precondition).
fn grow_zeroed(dev: &CudaDevice, buf: &mut CudaSlice<u32>, len: usize) -> Result<(), BackendError> {
    if buf.len() < len {
        *buf = dev.upload(&vec![0u32; len.next_power_of_two()])?;
    }
    Ok(())
}

impl MoeScratch {
    /// Empty scratch (one element each; the first MoE step grows it).
    pub(super) fn new(dev: &CudaDevice) -> Result<Self, BackendError> {
        Ok(Self {
            logits: dev.alloc(1)?,
            ids: dev.alloc(1)?,
            weights: dev.alloc(1)?,
            offsets: dev.alloc(1)?,
            order: dev.alloc(1)?,
            position: dev.alloc(1)?,
            gate_up: dev.alloc(1)?,
            act: dev.alloc(1)?,
            expert_out: dev.alloc(1)?,
            router_counter: dev.upload(&[0u32])?,
            tile_counters: dev.upload(&[0u32])?,
            kernels: MoeKernels::Fused,
        })
    }
}

impl CudaBackend {
    /// Runs the MoE layer on the kernel set `kernels` ([`MoeKernels::Fused`] by default): for
    /// `bench_cuda --moe-kernel` comparisons. All compute the same function (to bf16 rounding).
    /// Switching drops the recorded graphs (they hold the other kernels' launches).
    pub fn set_moe_kernels(&mut self, kernels: MoeKernels) {
        if self.moe.kernels != kernels {
            self.moe.kernels = kernels;
            // `set_graphs` with the current setting clears the recorded graphs.
            self.set_graphs(self.graphs.enabled);
        }
    }

    /// [`Self::set_moe_kernels`] with [`MoeKernels::First`] (`true`) or the default
    /// [`MoeKernels::Fused`] (`false`).
    pub fn set_moe_legacy(&mut self, legacy: bool) {
        self.set_moe_kernels(if legacy { MoeKernels::First } else { MoeKernels::Fused });
    }

    /// [`Backend::moe`](crate::backend::Backend::moe) on the device.
    pub(super) fn moe_layer(
        &mut self,
        x: &CudaBuf,
        m: usize,
        w: MoeWeights<'_, CudaMat, CudaBuf>,
        routing: MoeRouting,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        if x.len < m * w.router.cols {
            return Err(kerr("moe", format!("input has {} values, need {m}×{}", x.len, w.router.cols)));
        }
        self.ensure(out, m * w.router.cols)?;
        self.moe_run(MoeIo::Rows { x: &x.data, out: &mut out.data }, m, w, routing)
    }

    /// Whether [`Self::moe_run`] takes the residual stream's forms of [`MoeIo`] for `m` rows of
    /// these weights: the fused set,
    /// a decode-sized step on the skinny products (gate_up with its activation, down with the
    /// un-permute) and no router bias.
    pub(super) fn moe_takes_residual(&self, m: usize, w: &MoeWeights<'_, CudaMat, CudaBuf>, k: usize) -> bool {
        let (ne, a) = (w.num_experts, m * k);
        self.moe.kernels == MoeKernels::Fused
            && m <= MOE_ROUTER_MAX_ROWS.min(MOE_UNPERMUTE_RESID_MAX_ROWS)
            && w.router_bias.is_none()
            && !moe_gemm_preferred(a, ne, w.router.cols)
            && !moe_gemm_preferred(a, ne, w.intermediate_size)
            && gemv_applies(self.gemv, m, w.router.cols)
    }

    /// The MoE block over `m` rows (the shapes of [`Self::moe_layer`]), from and to where `io`
    /// says; the residual stream's forms only where [`Self::moe_takes_residual`].
    pub(super) fn moe_run(
        &mut self,
        io: MoeIo<'_>,
        m: usize,
        w: MoeWeights<'_, CudaMat, CudaBuf>,
        routing: MoeRouting,
    ) -> Result<(), BackendError> {
        let (ne, inter, k) = (w.num_experts, w.intermediate_size, routing.k);
        let h = w.router.cols;
        if !matches!(io, MoeIo::Rows { .. }) && !self.moe_takes_residual(m, &w, k) {
            return Err(kerr(
                "moe",
                format!("{m} rows: the residual stream's input or output is for decode-sized steps"),
            ));
        }
        let shapes_ok = w.router.rows == ne
            && (w.gate_up.rows, w.gate_up.cols) == (ne * 2 * inter, h)
            && (w.down.rows, w.down.cols) == (ne * h, inter)
            && w.router_bias.is_none_or(|b| b.len == ne)
            && w.gate_up_bias.is_none_or(|b| b.len == ne * 2 * inter)
            && w.down_bias.is_none_or(|b| b.len == ne * h);
        if !shapes_ok || inter == 0 {
            return Err(kerr(
                "moe",
                format!(
                    "router {}×{}, gate_up {}×{}, down {}×{} for {ne} experts of width {inter}",
                    w.router.rows, w.router.cols, w.gate_up.rows, w.gate_up.cols, w.down.rows, w.down.cols
                ),
            ));
        }
        // The kernels' limits, named here rather than as a launch's shape error.
        if ne > MOE_MAX_EXPERTS || k > MOE_MAX_K || !h.is_multiple_of(8) || !inter.is_multiple_of(8) {
            return Err(kerr(
                "moe",
                format!(
                    "{ne} experts (at most {MOE_MAX_EXPERTS}), top-{k} (at most {MOE_MAX_K}), hidden {h} and \
                     expert width {inter} (multiples of 8) are outside what the CUDA MoE kernels take"
                ),
            ));
        }
        let a = m * k;
        let dev = &self.dev;
        let s = &mut self.moe;
        grow(dev, &mut s.logits, m * ne)?;
        grow(dev, &mut s.ids, a)?;
        grow(dev, &mut s.weights, a)?;
        grow(dev, &mut s.offsets, ne + 1)?;
        grow(dev, &mut s.order, a)?;
        grow(dev, &mut s.position, a)?;
        grow(dev, &mut s.gate_up, a * 2 * inter)?;
        grow(dev, &mut s.act, a * inter)?;
        grow(dev, &mut s.expert_out, a * h)?;
        grow_zeroed(dev, &mut s.tile_counters, moe_unpermute_counters(h))?;
        let dev = &self.dev;
        let s = &mut self.moe;
        let profile = &mut self.profile;
        let legacy = s.kernels == MoeKernels::First;
        // Prefill-sized steps run a tiled GEMM (its activation apart): the wide tiles on the
        // fused set when experts average 64 entries, else the 64 × 64 ones; decode-sized ones
        // the skinny product over the experts in use, gate_up fused with its activation (the
        // first kernels: the CUDA-core GEMV over every expert, the activation apart).
        let (gate_up_kernel, down_kernel) = match s.kernels {
            MoeKernels::Fused | MoeKernels::FusedRouter => (MoeExpertKernel::Auto, MoeExpertKernel::Auto),
            MoeKernels::Split | MoeKernels::First => {
                let small = if legacy { MoeExpertKernel::Gemv } else { MoeExpertKernel::Skinny };
                let pick = |d| if moe_gemm_preferred(a, ne, d) { MoeExpertKernel::Gemm } else { small };
                (pick(h), pick(inter))
            }
        };
        let fused_act = !legacy && !moe_gemm_preferred(a, ne, h);
        // Small steps on the fused sets: the un-permute inside down (which then runs the skinny
        // product, as gate_up does), and with `FusedRouter` the router with the routing and
        // permutation.
        let small = matches!(s.kernels, MoeKernels::Fused | MoeKernels::FusedRouter) && m <= MOE_ROUTER_MAX_ROWS;
        let fused_down = small && !moe_gemm_preferred(a, ne, inter);
        let fused_router = small && s.kernels == MoeKernels::FusedRouter;
        // The experts' input: the given rows, or the ones the norm-input router stores; and
        // where their weighted sum goes.
        let (x, out) = match io {
            MoeIo::Rows { x, out } => {
                if !fused_router {
                    plain_router(dev, self.gemv, profile, x, m, &w, &mut s.logits)?;
                }
                (x, MoeDownOut::Rows(out))
            }
            MoeIo::RowsToResidual { x, residual, stats } => {
                plain_router(dev, self.gemv, profile, x, m, &w, &mut s.logits)?;
                (x, MoeDownOut::Residual { residual, stats })
            }
            MoeIo::ResidualToRows { input, hidden, out } => {
                norm_router(dev, profile, input, m, &w, &mut s.logits, hidden)?;
                (&*hidden, MoeDownOut::Rows(out))
            }
            MoeIo::Residual { residual, stats, norm, eps, hidden } => {
                norm_router(dev, profile, NormInput { residual, stats, norm, eps }, m, &w, &mut s.logits, hidden)?;
                (&*hidden, MoeDownOut::Residual { residual, stats })
            }
        };
        let route = MoeRouteCall {
            logits: &s.logits,
            rows: m,
            n_experts: ne,
            routing,
            ids: &mut s.ids,
            weights: &mut s.weights,
        };
        if fused_router {
            // The same logits, summed by the fused kernel (in f32 too), then routed as above.
            record_mark(dev, profile, "moe_router_route");
            MoeRouterCall {
                x,
                h,
                w: &w.router.data,
                bias: w.router_bias.map(|b| &b.data),
                counter: &mut s.router_counter,
                then: MoeRoutePermuteCall {
                    route,
                    offsets: &mut s.offsets,
                    order: &mut s.order,
                    position: &mut s.position,
                },
            }
            .launch(dev)?;
        } else if legacy {
            record_mark(dev, profile, "moe_route");
            route.launch(dev)?;
            MoePermuteCall {
                ids: &s.ids,
                assignments: a,
                n_experts: ne,
                offsets: &mut s.offsets,
                order: &mut s.order,
                position: &mut s.position,
            }
            .launch(dev)?;
        } else {
            record_mark(dev, profile, "moe_route");
            MoeRoutePermuteCall { route, offsets: &mut s.offsets, order: &mut s.order, position: &mut s.position }
                .launch(dev)?;
        }
        record_mark(dev, profile, "moe_gate_up");
        if fused_act {
            let act = match w.activation {
                MoeActivation::SiluGated => MoeGatedAct::SiluMul,
                MoeActivation::ClampedSwiglu { alpha, limit } => MoeGatedAct::ClampedSwiglu { alpha, limit },
            };
            MoeGateUpActCall {
                x,
                rows: MoeRows::PerToken,
                k,
                w: &w.gate_up.data,
                bias: w.gate_up_bias.map(|b| &b.data),
                n_experts: ne,
                inter,
                d: h,
                act,
                offsets: &s.offsets,
                order: &s.order,
                assignments: a,
                out: &mut s.act,
            }
            .launch(dev)?;
        } else {
            MoeGroupedGemvCall {
                x,
                rows: MoeRows::PerToken,
                k,
                w: &w.gate_up.data,
                bias: w.gate_up_bias.map(|b| &b.data),
                n_experts: ne,
                n: 2 * inter,
                d: h,
                offsets: &s.offsets,
                order: &s.order,
                assignments: a,
                out: &mut s.gate_up,
            }
            .launch_with(dev, gate_up_kernel)?;
            record_mark(dev, profile, "moe_act");
            match w.activation {
                MoeActivation::SiluGated => {
                    SiluMulCall { gate_up: &s.gate_up, rows: a, d: inter, out: &mut s.act }.launch(dev)?;
                }
                MoeActivation::ClampedSwiglu { alpha, limit } => {
                    ClampedSwigluCall { gate_up: &s.gate_up, rows: a, d: inter, alpha, limit, out: &mut s.act }
                        .launch(dev)?;
                }
            }
        }
        if fused_down {
            record_mark(dev, profile, "moe_down_unpermute");
            return Ok(MoeDownUnpermuteCall {
                x: &s.act,
                k,
                w: &w.down.data,
                bias: w.down_bias.map(|b| &b.data),
                n_experts: ne,
                n: h,
                d: inter,
                offsets: &s.offsets,
                order: &s.order,
                position: &s.position,
                weights: &s.weights,
                assignments: a,
                expert_out: &mut s.expert_out,
                counters: &mut s.tile_counters,
                out,
            }
            .launch(dev)?);
        }
        let MoeDownOut::Rows(out) = out else {
            return Err(kerr("moe", "the residual output without the fused down product".into()));
        };
        record_mark(dev, profile, "moe_down");
        MoeGroupedGemvCall {
            x: &s.act,
            rows: MoeRows::Permuted,
            k,
            w: &w.down.data,
            bias: w.down_bias.map(|b| &b.data),
            n_experts: ne,
            n: h,
            d: inter,
            offsets: &s.offsets,
            order: &s.order,
            assignments: a,
            out: &mut s.expert_out,
        }
        .launch_with(dev, down_kernel)?;
        record_mark(dev, profile, "moe_unpermute");
        MoeUnpermuteCall {
            expert_out: &s.expert_out,
            position: &s.position,
            weights: &s.weights,
            rows: m,
            k,
            d: h,
            shared: None,
            out,
        }
        .launch(dev)?;
        Ok(())
    }
}

/// Where [`CudaBackend::moe_run`] reads the block's input and puts its output. The residual
/// stream's forms: the router normalizes on its loads (`rms_norm(residual) · norm`, from the
/// sums of squares a residual product left) and stores the normalized rows to `hidden`
/// (`m × hidden`) for the experts; or the down product adds the experts' weighted sum to
/// `residual` (`m × hidden` f32) and leaves the new sums of squares in `stats` for the next
/// norm-input product; or both.
pub(super) enum MoeIo<'a> {
    /// `x`: `m × hidden` bf16, the normalized rows; `out`: `m × hidden` bf16, written.
    Rows { x: &'a CudaSlice<bf16>, out: &'a mut CudaSlice<bf16> },
    /// From normalized rows, into the residual stream.
    RowsToResidual { x: &'a CudaSlice<bf16>, residual: &'a mut CudaSlice<f32>, stats: &'a mut CudaSlice<f32> },
    /// From the residual stream, into `out` (`m × hidden` bf16).
    ResidualToRows { input: NormInput<'a>, hidden: &'a mut CudaSlice<bf16>, out: &'a mut CudaSlice<bf16> },
    /// From the residual stream and back into it.
    Residual {
        residual: &'a mut CudaSlice<f32>,
        stats: &'a mut CudaSlice<f32>,
        norm: &'a CudaSlice<bf16>,
        eps: f32,
        hidden: &'a mut CudaSlice<bf16>,
    },
}

/// The router in f32 over the normalized rows `x`, as transformers' softmax reads it (an f32
/// GEMM output, no bf16 rounding of the logits), plus its bias; `gemv`: the skinny GEMM's
/// switch.
fn plain_router(
    dev: &CudaDevice,
    gemv: bool,
    profile: &mut Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    x: &CudaSlice<bf16>,
    m: usize,
    w: &MoeWeights<'_, CudaMat, CudaBuf>,
    logits: &mut CudaSlice<f32>,
) -> Result<(), BackendError> {
    let (h, ne) = (w.router.cols, w.num_experts);
    record_mark(dev, profile, "moe_router");
    let kernel = linear_kernel(gemv, m, h);
    LinearCall { x, m, k: h, w: &w.router.data, n: ne, out: logits, kernel }.launch(dev)?;
    if let Some(b) = w.router_bias {
        BiasAddF32Call { x: logits, bias: &b.data, rows: m, n: ne }.launch(dev)?;
    }
    Ok(())
}

/// The router from the residual stream (no bias: [`CudaBackend::moe_takes_residual`]), storing
/// the normalized rows to `hidden`.
fn norm_router(
    dev: &CudaDevice,
    profile: &mut Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    input: NormInput<'_>,
    m: usize,
    w: &MoeWeights<'_, CudaMat, CudaBuf>,
    logits: &mut CudaSlice<f32>,
    hidden: &mut CudaSlice<bf16>,
) -> Result<(), BackendError> {
    record_mark(dev, profile, "moe_router");
    let (k, n) = (w.router.cols, w.num_experts);
    Ok(NormRouterCall { input, m, k, w: &w.router.data, n, logits, hidden }.launch(dev)?)
}
