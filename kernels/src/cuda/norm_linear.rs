//! RMSNorm fused into the skinny GEMMs on either side of it (decode at small batch, where the
//! norm's own single-CTA launch sat on the step's critical path twice a layer):
//!
//! - [`ResidualLinearCall`], the product that ends a residual branch (o_proj, down):
//!   `residual += bf16(x · wᵀ)` in f32, as [`AddRmsNormCall`](super::AddRmsNormCall) adds the
//!   branch output, and each row's sum of squares over each CTA's 16 columns into `stats`;
//! - [`NormLinearCall`], the product that starts the next branch (qkv, gate_up): it reads the
//!   residual and the stats instead of a bf16 activation and normalizes on the loads of x, so
//!   `rms_norm(residual) · w_norm` is never stored.
//!
//! Invariants: `stats` is `m × parts` f32 with `parts = `[`norm_stat_parts`]`(width)`, written
//! whole by the residual product and read whole by the norm-input product, in a fixed order (so
//! every CTA, and every run, computes the same `1 / rms`); the normalized value of an element is
//! the norm kernel's `bf16(r · inv · w)`; shapes are those of the skinny GEMM ([`gemv_supports`])
//! and every check is made before anything is enqueued.

use super::gemv::{GEMV_KERNEL_MAX_M, GEMV_ROWS_PER_CTA, GemvEpilogue, gemv_default, gemv_supports};
use super::launch::{Args, cfg, int, need, shape_check};
use super::linear::gemv_function;
use super::{CudaDevice, CudaError, CudaSlice};
use half::bf16;

/// Sums of squares a residual product writes per row of x for an output `width` wide: one per
/// CTA of [`GEMV_ROWS_PER_CTA`] columns.
pub fn norm_stat_parts(width: usize) -> usize {
    width.div_ceil(GEMV_ROWS_PER_CTA)
}

/// The skinny GEMM's shape rule ([`gemv_supports`]) as an error naming `op`.
pub(super) fn gemv_shape_ok(op: &'static str, m: usize, k: usize) -> Result<(), CudaError> {
    shape_check(op, gemv_supports(m, k), || {
        format!("m = {m}, k = {k}: the kernel needs 1 ≤ m ≤ {GEMV_KERNEL_MAX_M} and k a multiple of 8")
    })
}

/// `residual += bf16(x · wᵀ)` and the new residual's per-CTA sums of squares into `stats`.
pub struct ResidualLinearCall<'a> {
    /// `m × k` bf16: the branch's last activation (attention output, SiLU·mul).
    pub x: &'a CudaSlice<bf16>,
    /// Rows of `x`.
    pub m: usize,
    /// The reduction length.
    pub k: usize,
    /// `n × k` bf16, row-major.
    pub w: &'a CudaSlice<bf16>,
    /// Rows of `w`: the residual's width.
    pub n: usize,
    /// `m × n` f32, updated in place.
    pub residual: &'a mut CudaSlice<f32>,
    /// `m × `[`norm_stat_parts`]`(n)` f32, overwritten.
    pub stats: &'a mut CudaSlice<f32>,
    /// Index in [`GEMV_VARIANTS`](super::GEMV_VARIANTS), or `None` for the plain product's default.
    pub variant: Option<usize>,
}

impl ResidualLinearCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "residual_linear";
        let Self { x, m, k, w, n, residual, stats, variant } = self;
        need(OP, "x", x, m * k)?;
        need(OP, "w", w, n * k)?;
        need(OP, "residual", residual, m * n)?;
        need(OP, "stats", stats, m * norm_stat_parts(n))?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        gemv_shape_ok(OP, m, k)?;
        let variant = variant.unwrap_or_else(|| gemv_default(n, dev.sm_count()));
        let (v, func) = gemv_function(dev, OP, m, variant, GemvEpilogue::Residual)?;
        let grid = cfg((int(OP, norm_stat_parts(n))? as u32, 1, 1), v.warps * 32);
        let pf = v.prefetch_row_bytes(n, k, dev.gemv_l2_prefetch());
        let args = Args::new(OP).buf(x).buf(w).buf(residual).buf(stats).int(m)?.int(n)?.int(k)?.int(pf)?;
        // SAFETY: x holds m × k, w n × k, residual m × n and stats m × parts (checked above);
        // the kernel reads whole 16-byte rows (k % 8 == 0) and writes residual rows < m,
        // columns < n, and stats[row][cta] for rows < m and one entry per CTA.
        unsafe { args.launch(dev, func, grid) }
    }
}

/// What a [`NormLinearCall`] computes from the normalized activation `h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormLinearOut {
    /// `h · wᵀ` (`n × k` weights).
    Plain {
        /// Rows of `w`: columns of the output.
        n: usize,
    },
    /// `silu(gate) · up` of `h · [gate; up]ᵀ` (`2d × k` weights), as
    /// [`GatedLinearCall`](super::GatedLinearCall) computes it.
    GatedSilu {
        /// The intermediate size: columns of the output.
        d: usize,
    },
}

/// What a norm-input product reads instead of a bf16 activation (gemv.cu's `GemvNormIn`): the
/// residual stream, the sums of squares a [`ResidualLinearCall`] left, and the norm.
#[derive(Clone, Copy)]
pub struct NormInput<'a> {
    /// `m × k` f32: the residual stream.
    pub residual: &'a CudaSlice<f32>,
    /// `m × `[`norm_stat_parts`]`(k)` f32: the sums of squares of `residual`'s rows.
    pub stats: &'a CudaSlice<f32>,
    /// `k` bf16: the norm's weight.
    pub norm: &'a CudaSlice<bf16>,
    /// Added to the mean square.
    pub eps: f32,
}

impl<'a> NormInput<'a> {
    /// Checks the sizes for `m` rows of width `k` (naming `op`).
    pub(super) fn check(&self, op: &'static str, m: usize, k: usize) -> Result<(), CudaError> {
        need(op, "residual", self.residual, m * k)?;
        need(op, "stats", self.stats, m * norm_stat_parts(k))?;
        need(op, "norm", self.norm, k)
    }

    /// The kernel's leading arguments for a residual `k` wide: residual, stats, parts, norm, eps.
    pub(super) fn args(&self, op: &'static str, k: usize) -> Result<Args<'a>, CudaError> {
        let args = Args::new(op).buf(self.residual).buf(self.stats).int(norm_stat_parts(k))?;
        Ok(args.buf(self.norm).f32(self.eps))
    }
}

/// `out = (rms_norm(residual) · norm) · wᵀ`, plain or gated, with `1 / rms` from the stats a
/// [`ResidualLinearCall`] left.
pub struct NormLinearCall<'a> {
    /// The normalized activation's source.
    pub input: NormInput<'a>,
    /// Rows.
    pub m: usize,
    /// The residual's width: the reduction length.
    pub k: usize,
    /// The projection's weights (`n × k`, or `2d × k` gated).
    pub w: &'a CudaSlice<bf16>,
    /// Plain or gated.
    pub kind: NormLinearOut,
    /// `m × n` (or `m × d`) bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Index in [`GEMV_VARIANTS`](super::GEMV_VARIANTS), or `None` for the variant the unfused
    /// product picks.
    pub variant: Option<usize>,
}

impl NormLinearCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "norm_linear";
        let Self { input, m, k, w, kind, out, variant } = self;
        // Output columns, weight rows, columns per CTA, and the epilogue.
        let (cols, rows, per_cta, epilogue) = match kind {
            NormLinearOut::Plain { n } => (n, n, GEMV_ROWS_PER_CTA, GemvEpilogue::NormBf16),
            NormLinearOut::GatedSilu { d } => (d, 2 * d, GEMV_ROWS_PER_CTA / 2, GemvEpilogue::NormSilu),
        };
        input.check(OP, m, k)?;
        need(OP, "w", w, rows * k)?;
        need(OP, "out", out, m * cols)?;
        if m == 0 || cols == 0 {
            return Ok(());
        }
        gemv_shape_ok(OP, m, k)?;
        let variant = variant.unwrap_or_else(|| gemv_default(rows, dev.sm_count()));
        let (v, func) = gemv_function(dev, OP, m, variant, epilogue)?;
        let grid = cfg((int(OP, cols.div_ceil(per_cta))? as u32, 1, 1), v.warps * 32);
        let pf = v.prefetch_row_bytes(rows, k, dev.gemv_l2_prefetch());
        let args = input.args(OP, k)?.buf(w).buf(out).int(m)?.int(cols)?.int(k)?.int(pf)?;
        // SAFETY: residual holds m × k, stats m × norm_stat_parts(k), norm k, w rows × k and out m × cols
        // (checked above); the kernel reads whole 16-byte rows (k % 8 == 0), weight rows below
        // `rows`, and writes only columns < cols of out's m rows.
        unsafe { args.launch(dev, func, grid) }
    }
}

/// A MoE layer's router from the residual stream: `logits = h · wᵀ` in f32 with
/// `h = rms_norm(residual) · norm` normalized on the loads as [`NormLinearCall`] does, and `h`
/// itself stored to `hidden` (by the first CTA, which loads all of it), since the experts read it
/// next. One launch where the norm kernel and the router product were two; `hidden` holds the
/// bits a [`NormLinearCall`] over the same stats normalizes to.
pub struct NormRouterCall<'a> {
    /// The normalized activation's source.
    pub input: NormInput<'a>,
    /// Rows.
    pub m: usize,
    /// The residual's width: the reduction length.
    pub k: usize,
    /// The router's weights, `n × k` bf16.
    pub w: &'a CudaSlice<bf16>,
    /// Experts: rows of `w`, columns of `logits`.
    pub n: usize,
    /// `m × n` f32, written.
    pub logits: &'a mut CudaSlice<f32>,
    /// `m × k` bf16, written: the normalized activation.
    pub hidden: &'a mut CudaSlice<bf16>,
}

impl NormRouterCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "norm_router";
        let Self { input, m, k, w, n, logits, hidden } = self;
        input.check(OP, m, k)?;
        need(OP, "w", w, n * k)?;
        need(OP, "logits", logits, m * n)?;
        need(OP, "hidden", hidden, m * k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        gemv_shape_ok(OP, m, k)?;
        let variant = gemv_default(n, dev.sm_count());
        let (v, func) = gemv_function(dev, OP, m, variant, GemvEpilogue::NormF32X)?;
        let grid = cfg((int(OP, n.div_ceil(GEMV_ROWS_PER_CTA))? as u32, 1, 1), v.warps * 32);
        let pf = v.prefetch_row_bytes(n, k, dev.gemv_l2_prefetch());
        let args = input.args(OP, k)?.buf(w).buf(logits).buf(hidden).int(m)?.int(n)?.int(k)?.int(pf)?;
        // SAFETY: residual holds m × k, stats m × norm_stat_parts(k), norm k, w n × k, logits
        // m × n and hidden m × k (checked above); the kernel reads whole 16-byte rows (k % 8 ==
        // 0) and weight rows below n, writes only columns < n of logits' m rows, and (CTA 0)
        // the m rows of hidden.
        unsafe { args.launch(dev, func, grid) }
    }
}
