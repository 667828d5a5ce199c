//! The mixture-of-experts kernels (moe.cu, moe_skinny.cu), in the order a MoE layer runs them:
//!
//! 1. [`MoeRouteCall`]: router logits (f32, `rows × n_experts`, e.g. a [`super::LinearCall`]
//!    with f32 output) → each token's top-k expert ids and weights;
//! 2. [`MoePermuteCall`]: the ids → the assignments grouped by expert (`offsets`, `order`,
//!    `position`, as [`crate::cpu::MoePermutation`]); [`MoeRoutePermuteCall`] runs 1 and 2
//!    in one launch for small decode steps (the kernel takes up to
//!    [`MOE_ROUTE_PERMUTE_MAX_ROWS`] rows; the launcher picks it up to 16, where it measured
//!    no slower than the two kernels);
//! 3. [`MoeGroupedGemvCall`] with [`MoeRows::PerToken`]: the hidden states × every used
//!    expert's `gate_up` (`n_experts × 2I × hidden`: gate rows then up rows, so the output
//!    rows are `[gate | up]`), one output row per assignment in permuted order;
//! 4. [`super::SiluMulCall`] (or [`super::GeluTanhMulCall`]; gpt-oss: [`ClampedSwigluCall`]
//!    over its interleaved `[gate, up]` columns, with expert biases in the GEMVs) over those
//!    `rows · k` rows; at decode sizes 3 and 4 are one launch, [`super::MoeGateUpActCall`]
//!    (the skinny product with the activation in its epilogue, bit-identical to the pair);
//! 5. [`MoeGroupedGemvCall`] with [`MoeRows::Permuted`]: × every used expert's `down`
//!    (`n_experts × hidden × I`);
//! 6. [`MoeUnpermuteCall`]: each token's k outputs summed with its weights, plus the shared
//!    expert's output when the model has one, into the branch output that
//!    [`super::AddRmsNormCall`] adds to the residual stream.
//!
//! The grouped product has four kernels ([`MoeExpertKernel`]): the tensor-core skinny GEMM
//! over the experts in use (decode), the tiled tensor-core GEMM (64 × 64 tiles, moe.cu) for
//! prefill-sized steps and its wider-tiled version (64 × 128, three stages, moe_gemm.cu) for
//! experts averaging at least 64 entries, and the first CUDA-core GEMV (kept for comparison:
//! its grid has a CTA column for every expert).
//!
//! References: [`crate::cpu::moe_route`], [`crate::cpu::moe_permute`],
//! [`crate::cpu::moe_grouped_linear`], [`crate::cpu::moe_unpermute`].
//!
//! Invariants: ids, weights, offsets, order and position are device data written by steps 1
//! and 2 (the kernels that read them trust them; nothing else should write them); every
//! launcher checks the slice sizes and the limits below before enqueueing; nothing here
//! synchronizes with the host and every grid is sized from host-known counts (rows, k,
//! experts), so the layer can be captured in a CUDA graph.
//!
//! Floors of one Qwen3-30B-A3B MoE layer (hidden 2,048, 128 experts of width 768, top-8), the
//! bytes each op must move over the H100's measured 2.99 TB/s copy bandwidth:
//!
//! | op | b = 1 | b = 64 (125.9 experts touched) |
//! |---|---:|---:|
//! | router (128 × 2,048 bf16) | 0.52 MB, 0.18 µs | 0.55 MB, 0.18 µs |
//! | route + permute | < 10 KB | < 10 KB |
//! | gate_up (8 / 125.9 experts × 1,536 × 2,048) | 50.3 MB, 16.8 µs | 792 MB, 265 µs |
//! | SiLU·mul (fused into gate_up) | 37 KB | 2.4 MB |
//! | down (× 2,048 × 768) | 25.2 MB, 8.4 µs | 396 MB, 132 µs |
//! | un-permute | 37 KB | 2.4 MB |
//!
//! so 25.4 µs a layer at b = 1 (1.22 ms over 48 layers) and 398 µs at b = 64 (19.1 ms): only
//! the two expert products matter for bytes; the other ops matter for their launches (7
//! launches a layer before this module's fusions, 5 after: router, route + permute, gate_up
//! with its activation, down, un-permute; a launch costs ~2 to 5 µs of mostly fixed time even
//! in a graph with PDL, so about 10 µs a layer, ~0.5 ms a step, are the launches saved) and
//! for the first GEMV's grid of every expert (at b = 1, 120 of 128 CTA columns that only
//! return: 23,040 empty CTAs a gate_up launch).

use super::launch::{Args, MAX_GRID_YZ, cfg, grid_stride, int, need, row_threads, shape_check};
use super::moe_skinny::{MoeSkinnyAct, SkinnyLaunch};
use super::{CudaDevice, CudaError, CudaSlice};
use crate::cpu::{MoeRouting, MoeRows, MoeScoring};
use half::bf16;

/// Most experts a router may have (the routing kernel keeps a row in registers, and the
/// permutation keeps one cursor per expert in shared memory).
pub const MOE_MAX_EXPERTS: usize = 256;

/// Most experts per token (one lane of the routing warp per choice).
pub const MOE_MAX_K: usize = 32;

// The routing warp holds MOE_MAX_EXPERTS / 32 logits a lane and one choice a lane.
const _: () = assert!(MOE_MAX_EXPERTS.is_multiple_of(32) && MOE_MAX_K <= 32);

/// Token rows routed per CTA (one warp each).
const ROUTE_ROWS_PER_CTA: usize = 4;

/// Output columns per CTA of the grouped GEMV (one warp each).
const GEMV_COLS_PER_CTA: usize = 8;

/// The grouped GEMM's tile: entries × columns per CTA, and its input step (`d` must be a
/// multiple of it).
const GEMM_TILE: usize = 64;
const GEMM_K_STEP: usize = 32;

/// The wide GEMM's tile columns and threads (its entries per tile are [`GEMM_TILE`]).
const GEMM_WIDE_COLS: usize = 128;
const GEMM_WIDE_THREADS: u32 = 256;

/// Most rows the fused routing + permutation kernel takes (one CTA of 32 warps: two rows a
/// warp at most).
pub const MOE_ROUTE_PERMUTE_MAX_ROWS: usize = 64;

/// Rows up to which [`MoeRoutePermuteCall::launch`] takes the fused kernel. Measured on the
/// H100 (Qwen3-30B-A3B shape, one eager step, 48 layers, commit 3e2fc16): at 1 row fused and
/// split cost the same (464 vs 475 µs a step), at 64 rows the fused CTA is twice as slow
/// (1,337 vs 725 µs: one CTA routes all 64 rows); so only small decode steps take it, where
/// under CUDA graphs it saves one launch a layer.
const MOE_ROUTE_PERMUTE_FUSED_ROWS: usize = 16;

/// Which kernel computes a grouped expert product ([`MoeGroupedGemvCall::launch_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeExpertKernel {
    /// `moe_grouped_gemv_bf16`, the first decode kernel: one warp per column on the CUDA
    /// cores, a CTA column for every expert (the unused ones return at once); reads each used
    /// expert's weights once per 8 entries. Kept for comparison (`bench_cuda --moe-kernel legacy`).
    Gemv,
    /// `moe_skinny_*` (moe_skinny.cu): the tensor-core skinny GEMM over the experts in use
    /// only (grid height `min(n_experts, assignments)`); reads each used expert's weights once
    /// per 8 entries. For few entries per expert (decode).
    Skinny,
    /// `moe_grouped_gemm_bf16`: 64 × 64 tiles on the tensor cores; needs `d % 32 == 0`.
    Gemm,
    /// `moe_grouped_gemm_wide_bf16` (moe_gemm.cu): 64 entries × 128 columns a CTA of 8 warps,
    /// three cp.async stages; needs `d % 32 == 0`. For experts with many entries (prefill).
    GemmWide,
    /// The wide GEMM when [`moe_gemm_wide_preferred`], the GEMM when [`moe_gemm_preferred`],
    /// else the skinny product.
    Auto,
}

/// Whether the tiled grouped GEMM suits a product of `assignments` entries over `n_experts`
/// experts of input width `d`: every expert averages at least 16 entries (so its 64-entry
/// tiles are not mostly padding) and `d` is a multiple of its input step.
pub fn moe_gemm_preferred(assignments: usize, n_experts: usize, d: usize) -> bool {
    d.is_multiple_of(GEMM_K_STEP) && assignments >= 16 * n_experts
}

/// Whether the wide-tiled grouped GEMM suits the product: experts average at least 64 entries
/// (a full 64-entry tile each, so the 128 columns of a tile amortize its x rows) and `d` is a
/// multiple of the input step.
pub fn moe_gemm_wide_preferred(assignments: usize, n_experts: usize, d: usize) -> bool {
    d.is_multiple_of(GEMM_K_STEP) && assignments >= 64 * n_experts
}

/// Each token's top-k experts: `ids[r·k + j]` and `weights[r·k + j]`, best first.
/// A row of NaN logits still gets in-range ids (with NaN weights), as the CPU reference
/// gives, so the permutation and un-permute never meet an id they cannot place.
pub struct MoeRouteCall<'a> {
    /// Router logits, `rows × n_experts` f32.
    pub logits: &'a CudaSlice<f32>,
    /// Token rows.
    pub rows: usize,
    /// Experts, at most [`MOE_MAX_EXPERTS`].
    pub n_experts: usize,
    /// Scoring, k (at most [`MOE_MAX_K`] and `n_experts`), renormalization and scale.
    pub routing: MoeRouting,
    /// `rows × k` expert ids (written).
    pub ids: &'a mut CudaSlice<i32>,
    /// `rows × k` weights (written).
    pub weights: &'a mut CudaSlice<f32>,
}

impl MoeRouteCall<'_> {
    /// Checks the sizes and enqueues `moe_route_f32`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_route";
        let rows = self.rows;
        let args = route_args(OP, &self)?;
        if rows == 0 {
            return Ok(());
        }
        let grid = cfg((int(OP, rows.div_ceil(ROUTE_ROWS_PER_CTA))? as u32, 1, 1), (32 * ROUTE_ROWS_PER_CTA) as u32);
        // SAFETY: warp r reads row r's `n_experts` logits and writes its `k` ids and weights, for
        // r < rows (the kernel skips the rest), all checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.route, grid) }
    }
}

/// The routing kernels' checks (limits and sizes), then their leading arguments (logits
/// through weights, in the kernels' order).
pub(super) fn route_args<'a>(op: &'static str, c: &'a MoeRouteCall<'_>) -> Result<Args<'a>, CudaError> {
    let (rows, ne, r) = (c.rows, c.n_experts, c.routing);
    shape_check(op, (1..=MOE_MAX_EXPERTS).contains(&ne), || {
        format!("{ne} experts (1 to {MOE_MAX_EXPERTS} supported)")
    })?;
    shape_check(op, r.k >= 1 && r.k <= ne.min(MOE_MAX_K), || format!("k = {} with {ne} experts", r.k))?;
    shape_check(op, r.scale.is_finite(), || format!("scale {}", r.scale))?;
    need(op, "logits", c.logits, rows * ne)?;
    need(op, "ids", c.ids, rows * r.k)?;
    need(op, "weights", c.weights, rows * r.k)?;
    let sigmoid = matches!(r.scoring, MoeScoring::Sigmoid);
    Ok(Args::new(op)
        .buf(c.logits)
        .int(rows)?
        .int(ne)?
        .int(r.k)?
        .i32(i32::from(sigmoid))
        .i32(i32::from(r.renormalize))
        .f32(r.scale)
        .buf(&*c.ids)
        .buf(&*c.weights))
}

/// Groups `assignments` expert ids by expert (stably): `offsets` (`n_experts + 1`), `order`
/// and `position` (`assignments` each), as [`crate::cpu::moe_permute`].
pub struct MoePermuteCall<'a> {
    /// Expert ids, `assignments` of them (a [`MoeRouteCall`]'s `ids`: `rows · k`).
    pub ids: &'a CudaSlice<i32>,
    /// Assignments (`rows · k`).
    pub assignments: usize,
    /// Experts, at most [`MOE_MAX_EXPERTS`].
    pub n_experts: usize,
    /// `n_experts + 1` prefix offsets (written).
    pub offsets: &'a mut CudaSlice<i32>,
    /// Assignment index of each permuted entry (written).
    pub order: &'a mut CudaSlice<i32>,
    /// Permuted entry of each assignment (written).
    pub position: &'a mut CudaSlice<i32>,
}

impl MoePermuteCall<'_> {
    /// Checks the sizes and enqueues `moe_permute` (one CTA: the permutation is a small
    /// global problem, `rows · k` ids, and one CTA needs no grid-wide synchronization).
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_permute";
        let (n, ne) = (self.assignments, self.n_experts);
        shape_check(OP, (1..=MOE_MAX_EXPERTS).contains(&ne), || {
            format!("{ne} experts (1 to {MOE_MAX_EXPERTS} supported)")
        })?;
        need(OP, "ids", self.ids, n)?;
        need(OP, "offsets", self.offsets, ne + 1)?;
        need(OP, "order", self.order, n)?;
        need(OP, "position", self.position, n)?;
        let args = Args::new(OP).buf(self.ids).int(n)?.int(ne)?.buf(self.offsets).buf(self.order).buf(self.position);
        // Launched even for no assignments: the offsets are still written (all zero).
        // SAFETY: the CTA reads `n` ids, writes `n_experts + 1` offsets and places each in-range
        // id once into `order`/`position` (`n` each), all checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.permute, cfg((1, 1, 1), 1024)) }
    }
}

/// [`MoeRouteCall`] then [`MoePermuteCall`] over its `rows · k` ids, with the same outputs;
/// one launch (`moe_route_permute`, one CTA) for small decode steps, where both kernels are
/// mostly fixed launch cost, else the two.
pub struct MoeRoutePermuteCall<'a> {
    /// The routing (its `ids` and `weights` are written, then permuted).
    pub route: MoeRouteCall<'a>,
    /// `n_experts + 1` prefix offsets (written).
    pub offsets: &'a mut CudaSlice<i32>,
    /// Assignment index of each permuted entry (written).
    pub order: &'a mut CudaSlice<i32>,
    /// Permuted entry of each assignment (written).
    pub position: &'a mut CudaSlice<i32>,
}

impl MoeRoutePermuteCall<'_> {
    /// Checks the sizes and enqueues the fused kernel for few rows, else the two kernels.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        let fused = self.route.rows <= MOE_ROUTE_PERMUTE_FUSED_ROWS;
        self.launch_with(dev, fused)
    }

    /// Checks the sizes and enqueues the fused kernel (`fused`, at any row count: one CTA
    /// routes every row, so large steps are slow but correct) or the two kernels.
    pub fn launch_with(self, dev: &CudaDevice, fused: bool) -> Result<(), CudaError> {
        const OP: &str = "moe_route_permute";
        let Self { route, offsets, order, position } = self;
        let (ne, n) = (route.n_experts, route.rows * route.routing.k);
        if !fused {
            // The permutation's checks come first, so a refused call enqueues nothing.
            need(OP, "offsets", offsets, ne + 1)?;
            need(OP, "order", order, n)?;
            need(OP, "position", position, n)?;
            let MoeRouteCall { logits, rows, n_experts, routing, ids, weights } = route;
            MoeRouteCall { logits, rows, n_experts, routing, ids: &mut *ids, weights }.launch(dev)?;
            return MoePermuteCall { ids, assignments: n, n_experts: ne, offsets, order, position }.launch(dev);
        }
        let args = route_args(OP, &route)?;
        need(OP, "offsets", offsets, ne + 1)?;
        need(OP, "order", order, n)?;
        need(OP, "position", position, n)?;
        let args = args.buf(&*offsets).buf(&*order).buf(&*position);
        // Launched even for no rows: the offsets are still written (all zero).
        // SAFETY: warp w routes rows w, w + 32, ... < rows as moe_route_f32 does (reading their
        // logits, writing their k ids and weights), then the CTA permutes the rows · k ids as
        // moe_permute does (writing n_experts + 1 offsets and rows · k order and position), all
        // sizes checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.route_permute, cfg((1, 1, 1), 1024)) }
    }
}

/// One grouped GEMV over the experts in use: `out[p] = x[src(p)] · w[e]ᵀ` for every permuted
/// entry `p` of expert `e` (`src` as [`MoeRows`] says), `out` is `assignments × n` bf16.
/// Unused experts' weights are never read, a used expert's once per 8 of its rows.
pub struct MoeGroupedGemvCall<'a> {
    /// `rows × d` ([`MoeRows::PerToken`]) or `assignments × d` ([`MoeRows::Permuted`]) bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Which rows of `x` the entries read.
    pub rows: MoeRows,
    /// Experts per token (the `k` of the routing; `assignments = rows · k`).
    pub k: usize,
    /// All experts' weights, `n_experts × n × d` bf16 (each expert's `[out, in]` matrix).
    pub w: &'a CudaSlice<bf16>,
    /// All experts' biases, `n_experts × n` bf16 (gpt-oss), added to every output row; `None`
    /// for none.
    pub bias: Option<&'a CudaSlice<bf16>>,
    /// Experts.
    pub n_experts: usize,
    /// Output width.
    pub n: usize,
    /// Input width, a multiple of 8 (16-byte loads).
    pub d: usize,
    /// The [`MoePermuteCall`]'s offsets.
    pub offsets: &'a CudaSlice<i32>,
    /// The [`MoePermuteCall`]'s order.
    pub order: &'a CudaSlice<i32>,
    /// Assignments (`rows · k`).
    pub assignments: usize,
    /// `assignments × n` bf16 (written for every placed assignment).
    pub out: &'a mut CudaSlice<bf16>,
}

impl MoeGroupedGemvCall<'_> {
    /// Checks the sizes and enqueues the kernel [`MoeExpertKernel::Auto`] picks.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        self.launch_with(dev, MoeExpertKernel::Auto)
    }

    /// Checks the sizes and enqueues `kernel`'s product.
    pub fn launch_with(self, dev: &CudaDevice, kernel: MoeExpertKernel) -> Result<(), CudaError> {
        const OP: &str = "moe_grouped_gemv";
        let (ne, n, d, k, a) = (self.n_experts, self.n, self.d, self.k, self.assignments);
        let product = SkinnyLaunch {
            x: self.x,
            rows: self.rows,
            k,
            w: self.w,
            bias: self.bias,
            offsets: self.offsets,
            order: self.order,
            out: self.out,
            n,
            d,
            n_experts: ne,
            assignments: a,
            act: MoeSkinnyAct::None,
            alpha: 0.0,
            limit: 0.0,
            unpermute: None,
        };
        if !product.checked(OP)? {
            return Ok(());
        }
        let kernel = match kernel {
            MoeExpertKernel::Auto if moe_gemm_wide_preferred(a, ne, d) => MoeExpertKernel::GemmWide,
            MoeExpertKernel::Auto if moe_gemm_preferred(a, ne, d) => MoeExpertKernel::Gemm,
            MoeExpertKernel::Auto => MoeExpertKernel::Skinny,
            gemm @ (MoeExpertKernel::Gemm | MoeExpertKernel::GemmWide) => {
                shape_check(OP, d.is_multiple_of(GEMM_K_STEP), || {
                    format!("the grouped GEMM needs d % {GEMM_K_STEP} == 0, d = {d}")
                })?;
                gemm
            }
            other => other,
        };
        if kernel == MoeExpertKernel::Skinny {
            return product.launch(OP, dev);
        }
        let SkinnyLaunch { x, rows, w, bias, offsets, order, out, .. } = product;
        let args = Args::new(OP).buf(x).i32(i32::from(rows == MoeRows::PerToken)).int(k)?.buf(w);
        // A null pointer tells the kernel there is no bias.
        let args = match bias {
            Some(b) => args.buf(b),
            None => args.u64(0),
        };
        let args = args.buf(offsets).buf(order).buf(out).int(n)?.int(d)?;
        if matches!(kernel, MoeExpertKernel::Gemm | MoeExpertKernel::GemmWide) {
            // Tiles of 64 entries: at most ceil(a / 64) + one partial tile per expert.
            let tiles = a.div_ceil(GEMM_TILE) + ne;
            shape_check(OP, tiles <= MAX_GRID_YZ, || format!("{tiles} entry tiles exceed the grid"))?;
            let (cols, threads, func) = match kernel {
                MoeExpertKernel::GemmWide => (GEMM_WIDE_COLS, GEMM_WIDE_THREADS, &dev.kernels.moe()?.grouped_gemm_wide),
                _ => (GEMM_TILE, 128, &dev.kernels.moe()?.grouped_gemm),
            };
            let grid = cfg((int(OP, n.div_ceil(cols))? as u32, tiles as u32, 1), threads);
            let args = args.int(ne)?;
            // SAFETY: as for the GEMV below: CTA (c, t) finds its expert e and a 64-entry tile
            // inside offsets[e]..offsets[e + 1] (or returns), reads only those entries' rows of
            // `x` (through `order`), expert e's rows < n of `w` (zero-filling the rest) and
            // `bias[e]`, and writes those entries' columns < n of `out`. Sizes checked above.
            return unsafe { args.launch(dev, func, grid) };
        }
        let grid = cfg((int(OP, n.div_ceil(GEMV_COLS_PER_CTA))? as u32, ne as u32, 1), (32 * GEMV_COLS_PER_CTA) as u32);
        // SAFETY: CTA (c, e) reads expert e's columns (< n, inside `w`, and `bias` if given) and the entries of its
        // segment offsets[e]..offsets[e + 1], which the permutation wrote within 0..assignments
        // along with their `order` (assignment indices < assignments, so token rows < a / k);
        // it writes those entries' rows of `out`. Sizes checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.grouped_gemv, grid) }
    }
}

/// `out[r] = shared[r] + Σ_j weights[r·k + j] · expert_out[position[r·k + j]]`: each token's
/// expert outputs summed with its routing weights (and the shared expert's output, if any),
/// `rows × d` bf16.
pub struct MoeUnpermuteCall<'a> {
    /// `rows · k × d` bf16 in permuted order (the second [`MoeGroupedGemvCall`]'s output).
    pub expert_out: &'a CudaSlice<bf16>,
    /// The [`MoePermuteCall`]'s position.
    pub position: &'a CudaSlice<i32>,
    /// The [`MoeRouteCall`]'s weights, `rows × k`.
    pub weights: &'a CudaSlice<f32>,
    /// Token rows.
    pub rows: usize,
    /// Experts per token.
    pub k: usize,
    /// Width.
    pub d: usize,
    /// The shared expert's output (`rows × d` bf16), added in the same pass; `None` without one.
    pub shared: Option<&'a CudaSlice<bf16>>,
    /// `rows × d` bf16 (written).
    pub out: &'a mut CudaSlice<bf16>,
}

impl MoeUnpermuteCall<'_> {
    /// Checks the sizes and enqueues `moe_unpermute_bf16`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_unpermute";
        let (rows, k, d) = (self.rows, self.k, self.d);
        shape_check(OP, k >= 1 && d >= 1, || format!("k = {k}, d = {d}"))?;
        need(OP, "expert_out", self.expert_out, rows * k * d)?;
        need(OP, "position", self.position, rows * k)?;
        need(OP, "weights", self.weights, rows * k)?;
        need(OP, "out", self.out, rows * d)?;
        if let Some(s) = self.shared {
            need(OP, "shared", s, rows * d)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let args = Args::new(OP).buf(self.expert_out).buf(self.position).buf(self.weights).int(k)?;
        // A null pointer tells the kernel there is no shared expert.
        let args = match self.shared {
            Some(s) => args.buf(s),
            None => args.u64(0),
        };
        let args = args.buf(self.out).int(d)?;
        let grid = cfg((int(OP, rows)? as u32, 1, 1), row_threads(d, 1).min(256));
        // SAFETY: CTA r reads its k weights and positions (< rows · k, written by the
        // permutation), those rows of `expert_out` (rows · k × d), its `shared` row if given,
        // and writes its `out` row; sizes checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.unpermute, grid) }
    }
}

/// gpt-oss's expert activation ([`crate::cpu::clamped_swiglu`]): rows of `2d` interleaved
/// `[gate, up]` pairs → `out[r, i] = (clamp(up, ±limit) + 1) · g · σ(alpha · g)` with
/// `g = min(gate, limit)`; `out` is `rows × d`. (gpt-oss stores `gate_up_proj` as
/// `[experts, hidden, 2I]`, input-major: transposed to `[experts, 2I, hidden]` for
/// [`MoeGroupedGemvCall`] the columns keep their interleaved order.)
pub struct ClampedSwigluCall<'a> {
    /// `rows × 2d` bf16, `[gate, up]` interleaved.
    pub gate_up: &'a CudaSlice<bf16>,
    /// Rows.
    pub rows: usize,
    /// Width of the output rows (half the input's).
    pub d: usize,
    /// `swiglu_alpha` (1.702).
    pub alpha: f32,
    /// `swiglu_limit` (7).
    pub limit: f32,
    /// `rows × d` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl ClampedSwigluCall<'_> {
    /// Checks the sizes and enqueues `clamped_swiglu_bf16`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "clamped_swiglu";
        need(OP, "gate_up", self.gate_up, self.rows * 2 * self.d)?;
        need(OP, "out", self.out, self.rows * self.d)?;
        shape_check(OP, self.alpha.is_finite() && self.limit.is_finite() && self.limit > 0.0, || {
            format!("alpha {} / limit {}", self.alpha, self.limit)
        })?;
        let total = self.rows * self.d;
        if total == 0 {
            return Ok(());
        }
        let args =
            Args::new(OP).buf(self.gate_up).buf(self.out).int(self.d)?.long(total)?.f32(self.alpha).f32(self.limit);
        // SAFETY: the loop writes `total` outputs and reads their gate/up pairs, checked above.
        unsafe { args.launch(dev, &dev.kernels.moe()?.clamped_swiglu, grid_stride(total)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemm_is_preferred_from_16_entries_an_expert_when_d_suits_it() {
        // Qwen3-30B-A3B: decode at b = 64 (512 entries over 128 experts) stays on the skinny
        // product; a 2,048-token prefill (16,384 entries) takes the GEMM.
        assert!(!moe_gemm_preferred(64 * 8, 128, 2048));
        assert!(moe_gemm_preferred(2048 * 8, 128, 2048));
        assert!(moe_gemm_preferred(16 * 128, 128, 768));
        assert!(!moe_gemm_preferred(16 * 128 - 1, 128, 768));
        // An input width that is not a multiple of the GEMM's step never takes it.
        assert!(!moe_gemm_preferred(1 << 20, 8, 136));
        // The wide tiles from 64 entries an expert: the 2,048-token prefill (128 an expert).
        assert!(moe_gemm_wide_preferred(2048 * 8, 128, 768));
        assert!(!moe_gemm_wide_preferred(64 * 128 - 1, 128, 2048));
        assert!(!moe_gemm_wide_preferred(1 << 20, 8, 136));
    }

    #[test]
    fn wide_gemm_tile_matches_the_kernel_source() {
        let src = include_str!("../../cuda/moe_gemm.cu");
        assert!(src.contains(&format!("#define MOE_GW_BM {GEMM_TILE}")));
        assert!(src.contains(&format!("#define MOE_GW_BN {GEMM_WIDE_COLS}")));
        assert!(src.contains(&format!("#define MOE_GW_BK {GEMM_K_STEP}")));
        assert!(src.contains(&format!("__launch_bounds__({GEMM_WIDE_THREADS}, 2) void moe_grouped_gemm_wide_bf16(")));
    }

    #[test]
    fn limits_match_the_kernel_source() {
        let src = include_str!("../../cuda/moe.cu");
        assert!(src.contains(&format!("#define MOE_MAX_EXPERTS {MOE_MAX_EXPERTS}")));
        assert!(src.contains(&format!("#define MOE_MAX_K {MOE_MAX_K}")));
        // The fused routing + permutation routes with 32 warps, two rows a warp at most.
        assert!(src.contains("__launch_bounds__(1024) void moe_route_permute("));
        assert_eq!(MOE_ROUTE_PERMUTE_MAX_ROWS, 2 * 32);
        const { assert!(MOE_ROUTE_PERMUTE_FUSED_ROWS <= MOE_ROUTE_PERMUTE_MAX_ROWS) };
    }
}
