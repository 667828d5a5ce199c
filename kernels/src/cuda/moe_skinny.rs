//! The grouped expert product for decode-sized steps (moe_skinny.cu): the tensor-core skinny
//! GEMM over the experts in use only, alone ([`MoeExpertKernel::Skinny`](super::MoeExpertKernel))
//! or with the gated activation fused into its epilogue ([`MoeGateUpActCall`]: the `gate_up`
//! product and SiLU·mul / gpt-oss's clamped SwiGLU in one launch), or with the un-permute
//! fused after it ([`MoeDownUnpermuteCall`]: the `down` product and the weighted sum of each
//! token's k expert outputs in one launch).
//!
//! Invariants: the grid's height is `min(n_experts, assignments)`, a bound the host knows
//! without reading the routing (CTA column y finds the y-th expert with entries on the device),
//! so the launch records into a CUDA graph; the fused output is bit-identical to the
//! unfused pair (the skinny product then [`super::SiluMulCall`] / [`super::ClampedSwigluCall`],
//! or [`super::MoeUnpermuteCall`]), which the GPU tests check; the fused un-permute's tile
//! counters are zero between launches (each launch's last CTA of a tile resets its counter); `offsets` and `order` come from the permutation of the same
//! assignments (trusted, as everywhere in the MoE kernels).

use super::launch::{Args, MAX_GRID_YZ, cfg, int, need, shape_check};
use super::moe::MOE_MAX_EXPERTS;
use super::{CudaDevice, CudaError, CudaSlice};
use crate::cpu::MoeRows;
use half::bf16;

/// The epilogues of the skinny product, in the kernel table's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoeSkinnyAct {
    /// Plain product (16 output columns a CTA).
    None,
    /// `silu(gate) · up` over `[gate | up]` halves.
    Silu,
    /// gpt-oss's clamped SwiGLU over interleaved `[gate, up]` columns.
    Swiglu,
    /// Plain product, then the un-permute of its 16 columns by the tile's last CTA.
    Unpermute,
    /// [`Self::Unpermute`] with the rows added to the f32 residual stream (and their sums of
    /// squares left for the next norm-input product) instead of stored.
    UnpermuteResid,
}

/// Every epilogue, in the kernel table's order.
pub(crate) const MOE_SKINNY_ACTS: [MoeSkinnyAct; 5] = [
    MoeSkinnyAct::None,
    MoeSkinnyAct::Silu,
    MoeSkinnyAct::Swiglu,
    MoeSkinnyAct::Unpermute,
    MoeSkinnyAct::UnpermuteResid,
];

/// The k-steps of 32 inputs per batch (`U`) of the compiled variants: 2 for narrow inputs (the
/// `down` projection's 768), 4 from [`WIDE_INPUT`] on (hidden 2,048), so each of the 4 warps
/// gets several batches either way.
pub(crate) const MOE_SKINNY_VARIANTS: [usize; 2] = [2, 4];

/// Inputs from which the wider variant runs.
const WIDE_INPUT: usize = 2048;

/// Threads per CTA (4 warps splitting the input dimension).
const SKINNY_THREADS: u32 = 128;

/// Output columns per CTA of the plain product, so the column tiles of the fused un-permute.
const UNPERMUTE_TILE: usize = 16;

/// Tile counters a [`MoeDownUnpermuteCall`] with `n` output columns needs (one per column tile).
pub fn moe_unpermute_counters(n: usize) -> usize {
    n.div_ceil(UNPERMUTE_TILE)
}

impl MoeSkinnyAct {
    /// The kernel of this epilogue with `u` k-steps per batch (moe_skinny.cu).
    pub(crate) fn kernel_name(self, u: usize) -> String {
        let act = match self {
            Self::None => "",
            Self::Silu => "silu_",
            Self::Swiglu => "swiglu_",
            Self::Unpermute => "unpermute_",
            Self::UnpermuteResid => "unpermute_resid_",
        };
        format!("moe_skinny_{act}bf16_u{u}")
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Output columns per CTA: 16 weight rows a CTA, one per column plain, a (gate, up) pair
    /// per column fused.
    fn cols_per_cta(self) -> usize {
        if self.plain() { UNPERMUTE_TILE } else { 8 }
    }

    /// One output column per weight row (no gated activation pairing them).
    fn plain(self) -> bool {
        matches!(self, Self::None | Self::Unpermute | Self::UnpermuteResid)
    }

    /// Whether the tile's last CTA un-permutes (so the launch carries an [`UnpermuteTail`]).
    fn unpermutes(self) -> bool {
        matches!(self, Self::Unpermute | Self::UnpermuteResid)
    }
}

/// The gated activation a [`MoeGateUpActCall`] fuses, with the `gate_up` layout it implies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MoeGatedAct {
    /// `silu(gate) · up`; each expert's rows are `[gate (I) | up (I)]` (Qwen3-MoE, Mixtral).
    SiluMul,
    /// gpt-oss's `(clamp(up, ±limit) + 1) · g · σ(alpha · g)`, `g = min(gate, limit)`; each
    /// expert's rows are interleaved `[gate, up]` pairs.
    ClampedSwiglu {
        /// `swiglu_alpha` (1.702).
        alpha: f32,
        /// `swiglu_limit` (7).
        limit: f32,
    },
}

/// The operands of a grouped expert product as every kernel reads them (the skinny kernel,
/// plain or fused, and the first GEMV and the GEMM of moe.rs): [`Self::checked`] is the one
/// size check they share.
pub(crate) struct SkinnyLaunch<'a> {
    pub x: &'a CudaSlice<bf16>,
    pub rows: MoeRows,
    pub k: usize,
    pub w: &'a CudaSlice<bf16>,
    pub bias: Option<&'a CudaSlice<bf16>>,
    pub offsets: &'a CudaSlice<i32>,
    pub order: &'a CudaSlice<i32>,
    pub out: &'a mut CudaSlice<bf16>,
    /// Rows of each expert's weight matrix (`2I` for `gate_up`).
    pub n: usize,
    pub d: usize,
    pub n_experts: usize,
    pub assignments: usize,
    pub act: MoeSkinnyAct,
    pub alpha: f32,
    pub limit: f32,
    /// The fused un-permute's operands (with [`MoeSkinnyAct::Unpermute`] and
    /// [`MoeSkinnyAct::UnpermuteResid`] only): position, weights, where the `rows × n` result
    /// goes, and the tile counters.
    pub unpermute: Option<UnpermuteTail<'a>>,
}

/// What an un-permuting launch passes after the product's operands.
pub(crate) struct UnpermuteTail<'a> {
    pub position: &'a CudaSlice<i32>,
    pub weights: &'a CudaSlice<f32>,
    pub out: MoeDownOut<'a>,
    pub counters: &'a mut CudaSlice<u32>,
}

/// Where a [`MoeDownUnpermuteCall`] puts each token's weighted sum of its experts' outputs.
pub enum MoeDownOut<'a> {
    /// `rows × n` bf16, written.
    Rows(&'a mut CudaSlice<bf16>),
    /// Added to the f32 residual stream (`rows × n`: `residual[r, c] += bf16(sum)`, as the
    /// residual add of an RMSNorm kernel does), with each row's sum of squares of the new
    /// residual over every 16-column tile in `stats` (`rows × n / 16`, the layout
    /// [`super::ResidualLinearCall`] leaves for a [`super::NormLinearCall`]); at most
    /// [`MOE_UNPERMUTE_RESID_MAX_ROWS`] rows.
    Residual {
        /// `rows × n` f32, updated.
        residual: &'a mut CudaSlice<f32>,
        /// `rows ×` [`super::norm_stat_parts`]`(n)` f32, written.
        stats: &'a mut CudaSlice<f32>,
    },
}

/// Most token rows of a [`MoeDownOut::Residual`] launch (the tile's shared sums).
pub const MOE_UNPERMUTE_RESID_MAX_ROWS: usize = 16;

impl SkinnyLaunch<'_> {
    /// Output columns per assignment: `n`, or `n / 2` when a gated activation pairs rows.
    fn out_cols(&self) -> usize {
        if self.act.plain() { self.n } else { self.n / 2 }
    }

    /// Checks the expert count, `d`, `k` and every operand's size; `false` when the product
    /// is empty (nothing to enqueue).
    pub(crate) fn checked(&self, op: &'static str) -> Result<bool, CudaError> {
        let (ne, d, k, a) = (self.n_experts, self.d, self.k, self.assignments);
        shape_check(op, (1..=MOE_MAX_EXPERTS).contains(&ne) && ne <= MAX_GRID_YZ, || format!("{ne} experts"))?;
        shape_check(op, d > 0 && d.is_multiple_of(8), || format!("d = {d} is not a positive multiple of 8"))?;
        shape_check(op, k >= 1 && a.is_multiple_of(k), || format!("{a} assignments with k = {k}"))?;
        let x_rows = match self.rows {
            MoeRows::PerToken => a / k,
            MoeRows::Permuted => a,
        };
        need(op, "x", self.x, x_rows * d)?;
        need(op, "w", self.w, ne * self.n * d)?;
        if let Some(b) = self.bias {
            need(op, "bias", b, ne * self.n)?;
        }
        need(op, "offsets", self.offsets, ne + 1)?;
        need(op, "order", self.order, a)?;
        need(op, "out", self.out, a * self.out_cols())?;
        Ok(a > 0 && self.out_cols() > 0)
    }

    /// Enqueues the skinny kernel of `self.act` (after [`Self::checked`] said `true`).
    pub(crate) fn launch(self, op: &'static str, dev: &CudaDevice) -> Result<(), CudaError> {
        let (ne, a) = (self.n_experts, self.assignments);
        let cols = self.out_cols();
        let variant = usize::from(self.d >= WIDE_INPUT);
        let func = &dev.kernels.moe()?.skinny[self.act.index()][variant];
        let args = Args::new(op).buf(self.x).i32(i32::from(self.rows == MoeRows::PerToken)).int(self.k)?.buf(self.w);
        // A null pointer tells the kernel there is no bias.
        let args = match self.bias {
            Some(b) => args.buf(b),
            None => args.u64(0),
        };
        let args = args
            .buf(self.offsets)
            .buf(self.order)
            .buf(self.out)
            .int(self.n)?
            .int(self.d)?
            .int(ne)?
            .f32(self.alpha)
            .f32(self.limit);
        let args = match &self.unpermute {
            Some(t) => {
                let args = args.buf(t.position).buf(t.weights).int(a / self.k)?;
                match (&t.out, self.act) {
                    (MoeDownOut::Rows(out), MoeSkinnyAct::Unpermute) => args.buf(&**out),
                    (MoeDownOut::Residual { residual, stats }, MoeSkinnyAct::UnpermuteResid) => {
                        args.buf(&**residual).buf(&**stats)
                    }
                    _ => return Err(super::launch::shape_error(op, "an un-permute output of the other kind")),
                }
                .buf(&*t.counters)
            }
            None if self.act.unpermutes() => {
                return Err(super::launch::shape_error(op, "the fused un-permute without its operands"));
            }
            None => args,
        };
        let grid = (int(op, cols.div_ceil(self.act.cols_per_cta()))? as u32, ne.min(a) as u32, 1);
        // SAFETY: CTA (c, y) finds the y-th expert e with entries in offsets (n_experts + 1
        // values, written by the permutation within 0..assignments) or returns; it reads expert
        // e's rows < n of `w` (n_experts × n × d) and of `bias` (n_experts × n), the rows of `x`
        // of its entries (through `order`: assignment indices < assignments, so token rows <
        // assignments / k when per-token, else entries < assignments), and writes its entries'
        // columns < cols of `out` (assignments × cols). With the fused un-permute, CTA (c, y)
        // increments counters[c] (c < n / 16, checked by the caller) and the tile's last CTA
        // reads its 16 columns of the entries of every token row (positions < assignments,
        // written by the permutation) and writes them to the `rows × n` output (or updates
        // those columns of the `rows × n` residual and writes stats[r][c] of `rows × n / 16`),
        // weights `rows × k`. Sizes checked by the caller.
        unsafe { args.launch(dev, func, cfg(grid, SKINNY_THREADS)) }
    }
}

/// The `gate_up` product of every permuted entry with the activation fused:
/// `out[p, c] = act(bf16(x[src(p)] · w[e, gate(c)] + b), bf16(x[src(p)] · w[e, up(c)] + b))`,
/// `out` is `assignments × inter` bf16, bit-identical to [`super::MoeGroupedGemvCall`] on
/// [`MoeExpertKernel::Skinny`](super::MoeExpertKernel::Skinny) followed by
/// [`super::SiluMulCall`] (or [`super::ClampedSwigluCall`]), one launch instead of two and
/// without the `assignments × 2I` intermediate. Decode-sized steps: an expert's weights are
/// re-read (from L2) per 8 of its entries, so prefill-sized steps want the grouped GEMM and
/// the activation apart ([`super::moe_gemm_preferred`]).
pub struct MoeGateUpActCall<'a> {
    /// `rows × d` ([`MoeRows::PerToken`]) or `assignments × d` ([`MoeRows::Permuted`]) bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Which rows of `x` the entries read.
    pub rows: MoeRows,
    /// Experts per token (`assignments = rows · k`).
    pub k: usize,
    /// All experts' `gate_up` weights, `n_experts × 2·inter × d` bf16, laid out as `act` says.
    pub w: &'a CudaSlice<bf16>,
    /// All experts' `gate_up` biases, `n_experts × 2·inter` bf16 (gpt-oss); `None` for none.
    pub bias: Option<&'a CudaSlice<bf16>>,
    /// Experts, at most [`MOE_MAX_EXPERTS`].
    pub n_experts: usize,
    /// Expert width `I` (output columns).
    pub inter: usize,
    /// Input width, a multiple of 8.
    pub d: usize,
    /// The activation (and the layout of `w`'s rows).
    pub act: MoeGatedAct,
    /// The [`super::MoePermuteCall`]'s offsets.
    pub offsets: &'a CudaSlice<i32>,
    /// The [`super::MoePermuteCall`]'s order.
    pub order: &'a CudaSlice<i32>,
    /// Assignments (`rows · k`).
    pub assignments: usize,
    /// `assignments × inter` bf16 (written for every placed assignment).
    pub out: &'a mut CudaSlice<bf16>,
}

impl MoeGateUpActCall<'_> {
    /// Checks the sizes and enqueues the fused skinny kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_gate_up_act";
        let (act, alpha, limit) = match self.act {
            MoeGatedAct::SiluMul => (MoeSkinnyAct::Silu, 0.0, 0.0),
            MoeGatedAct::ClampedSwiglu { alpha, limit } => {
                shape_check(OP, alpha.is_finite() && limit.is_finite() && limit > 0.0, || {
                    format!("alpha {alpha} / limit {limit}")
                })?;
                (MoeSkinnyAct::Swiglu, alpha, limit)
            }
        };
        let product = SkinnyLaunch {
            x: self.x,
            rows: self.rows,
            k: self.k,
            w: self.w,
            bias: self.bias,
            offsets: self.offsets,
            order: self.order,
            out: self.out,
            n: 2 * self.inter,
            d: self.d,
            n_experts: self.n_experts,
            assignments: self.assignments,
            act,
            alpha,
            limit,
            unpermute: None,
        };
        if !product.checked(OP)? {
            return Ok(());
        }
        product.launch(OP, dev)
    }
}

/// The `down` product of every permuted entry with the un-permute fused after it: the
/// entries' outputs go to `expert_out` as [`super::MoeGroupedGemvCall`] on
/// [`MoeExpertKernel::Skinny`](super::MoeExpertKernel::Skinny) writes them, and each token's
/// `out[r] = Σ_j weights[r·k + j] · expert_out[position[r·k + j]]` is written by the last CTA
/// of each 16-column tile to finish, bit-identical to that product followed by
/// [`super::MoeUnpermuteCall`] (no shared expert), in one launch. For decode-sized steps: the last
/// CTA of a tile sums `rows · 16 · k` values. `counters` must be zero before the first launch
/// (each launch leaves them zero); a launch must not overlap another using the same counters
/// (launches on one stream never do).
pub struct MoeDownUnpermuteCall<'a> {
    /// `assignments × d` bf16 in permuted order (the activated `gate_up` output).
    pub x: &'a CudaSlice<bf16>,
    /// Experts per token (`assignments = rows · k`).
    pub k: usize,
    /// All experts' `down` weights, `n_experts × n × d` bf16.
    pub w: &'a CudaSlice<bf16>,
    /// All experts' `down` biases, `n_experts × n` bf16 (gpt-oss); `None` for none.
    pub bias: Option<&'a CudaSlice<bf16>>,
    /// Experts, at most [`MOE_MAX_EXPERTS`].
    pub n_experts: usize,
    /// Output width (hidden).
    pub n: usize,
    /// Input width (expert width), a multiple of 8.
    pub d: usize,
    /// The [`super::MoePermuteCall`]'s offsets, order and position.
    pub offsets: &'a CudaSlice<i32>,
    pub order: &'a CudaSlice<i32>,
    pub position: &'a CudaSlice<i32>,
    /// The routing weights, `rows × k` f32.
    pub weights: &'a CudaSlice<f32>,
    /// Assignments (`rows · k`).
    pub assignments: usize,
    /// `assignments × n` bf16: the entries' outputs (written, then read back by the tiles).
    pub expert_out: &'a mut CudaSlice<bf16>,
    /// [`moe_unpermute_counters`]`(n)` tile counters, zero (left zero).
    pub counters: &'a mut CudaSlice<u32>,
    /// Where the rows go.
    pub out: MoeDownOut<'a>,
}

impl MoeDownUnpermuteCall<'_> {
    /// Checks the sizes and enqueues the fused kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "moe_down_unpermute";
        let (n, k, a) = (self.n, self.k, self.assignments);
        need(OP, "counters", self.counters, moe_unpermute_counters(n))?;
        need(OP, "position", self.position, a)?;
        need(OP, "weights", self.weights, a)?;
        let rows = a / k.max(1);
        let act = match &self.out {
            MoeDownOut::Rows(out) => {
                need(OP, "out", out, rows * n)?;
                MoeSkinnyAct::Unpermute
            }
            MoeDownOut::Residual { residual, stats } => {
                shape_check(OP, rows <= MOE_UNPERMUTE_RESID_MAX_ROWS, || {
                    format!("{rows} rows into the residual (at most {MOE_UNPERMUTE_RESID_MAX_ROWS})")
                })?;
                need(OP, "residual", residual, rows * n)?;
                need(OP, "stats", stats, rows * moe_unpermute_counters(n))?;
                MoeSkinnyAct::UnpermuteResid
            }
        };
        let product = SkinnyLaunch {
            x: self.x,
            rows: MoeRows::Permuted,
            k,
            w: self.w,
            bias: self.bias,
            offsets: self.offsets,
            order: self.order,
            out: self.expert_out,
            n,
            d: self.d,
            n_experts: self.n_experts,
            assignments: a,
            act,
            alpha: 0.0,
            limit: 0.0,
            unpermute: Some(UnpermuteTail {
                position: self.position,
                weights: self.weights,
                out: self.out,
                counters: self.counters,
            }),
        };
        if !product.checked(OP)? {
            return Ok(());
        }
        product.launch(OP, dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_and_variants_match_the_source() {
        let src = include_str!("../../cuda/moe_skinny.cu");
        for act in MOE_SKINNY_ACTS {
            for u in MOE_SKINNY_VARIANTS {
                let name = act.kernel_name(u);
                assert!(src.contains(&format!("void {name}(")), "{name} missing");
                assert!(src.lines().any(|l| l.contains(&format!(", {u}>(")) && l.contains("moe_skinny_body")));
            }
        }
        // The CTA size the launcher uses is the kernel's launch bound, and the warps the body splits over.
        assert!(src.contains(&format!("__launch_bounds__({SKINNY_THREADS}, 6)")));
        assert!(src.contains(&format!("#define MOE_SK_WARPS {}", SKINNY_THREADS / 32)));
        // The wide variant takes 4 k-steps a batch: 16 chunks of 8 inputs per warp a batch, so
        // hidden 2,048 gives each of the 4 warps 4 batches.
        assert_eq!(WIDE_INPUT / 8 / (4 * MOE_SKINNY_VARIANTS[1]) / (SKINNY_THREADS as usize / 32), 4);
    }
}
