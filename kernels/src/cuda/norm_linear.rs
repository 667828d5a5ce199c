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
//! Both take bf16 weights or FP8 ones ([`ProjWeights`]; the FP8 kernels are gemv_fp8.cu's, with
//! the row or block scales applied as [`Fp8GemvCall`](super::Fp8GemvCall) applies them).
//!
//! Invariants: `stats` is `m × parts` f32 with `parts = `[`norm_stat_parts`]`(width)`, written
//! whole by the residual product and read whole by the norm-input product, in a fixed order (so
//! every CTA, and every run, computes the same `1 / rms`); the normalized value of an element is
//! the norm kernel's `bf16(r · inv · w)`; shapes are those of the skinny GEMM ([`gemv_supports`])
//! and every check is made before anything is enqueued.

use super::fp8_linear::{Fp8Epilogue, Fp8Weights, gemv_fp8_default, gemv_fp8_function, gemv_fp8_scaling};
use super::gemv::{GEMV_KERNEL_MAX_M, GEMV_MAX_MS, GEMV_ROWS_PER_CTA, GemvEpilogue, gemv_default, gemv_supports};
use super::launch::{Args, cfg, int, need, shape_check, shape_error};
use super::linear::gemv_function;
use super::{CudaDevice, CudaError, CudaSlice};
use cudarc::driver::{CudaFunction, LaunchConfig};
use half::bf16;

/// Most bytes of dynamic shared memory an FP8 norm-input kernel takes for its normalized x
/// (`min(m, tile rows) × k` bf16): 8 rows of a 4,096-wide model's hidden state, or 16 rows up
/// to 3,072.
pub const NORM_X_SHARED_MAX: usize = 96 << 10;

/// Whether [`NormLinearCall`] takes `m` rows of a `k`-wide residual over FP8 weights: its x
/// fits [`NORM_X_SHARED_MAX`]. (bf16 weights normalize on the loads and take any skinny shape.)
pub fn norm_linear_fp8_fits(m: usize, k: usize) -> bool {
    norm_x_shared_bytes(m, k) <= NORM_X_SHARED_MAX
}

/// The FP8 norm-input kernel's shared memory: the normalized rows of its tile.
fn norm_x_shared_bytes(m: usize, k: usize) -> usize {
    let tile_rows = if m > GEMV_MAX_MS[0] { GEMV_MAX_MS[1] } else { GEMV_MAX_MS[0] };
    m.min(tile_rows) * k * 2
}

/// Sums of squares a residual product writes per row of x for an output `width` wide: one per
/// CTA of [`GEMV_ROWS_PER_CTA`] columns.
pub fn norm_stat_parts(width: usize) -> usize {
    width.div_ceil(GEMV_ROWS_PER_CTA)
}

/// A boundary product's weights: bf16 (`rows × k`, row-major) or FP8 codes and scales.
#[derive(Clone, Copy)]
pub enum ProjWeights<'a> {
    /// bf16 weights.
    Bf16(&'a CudaSlice<bf16>),
    /// E4M3 weights with per-row or block scales (one CTA's 16 rows of x at most).
    Fp8(&'a Fp8Weights),
}

/// A boundary product's kernel: the weights, the product's shape and which kernel kind.
struct Product<'a> {
    op: &'static str,
    w: ProjWeights<'a>,
    /// Rows of x.
    m: usize,
    /// Rows of the weights (twice the output width for a gated product).
    rows: usize,
    /// The reduction length.
    k: usize,
    variant: Option<usize>,
    bf16_kind: GemvEpilogue,
    fp8_kind: Fp8Epilogue,
}

/// What [`Product::pick`] chose: the kernel, its CTA size, and what its argument list ends with.
struct Picked<'d> {
    func: &'d CudaFunction,
    threads: u32,
    tail: Tail,
    /// Dynamic shared memory (the FP8 norm-input kernels' normalized x).
    shared: usize,
}

/// The arguments after the sizes: the bf16 kernels' L2 prefetch bytes, the FP8 ones' scale
/// blocks.
enum Tail {
    Bf16 { pf: usize },
    Fp8 { row_block: usize, col_block: usize },
}

impl<'a> Product<'a> {
    /// Checks the shape against the weights, picks the kernel (`variant` or the plain product's
    /// default) and appends the weights to `args` (bf16: the matrix; FP8: codes and scales).
    fn pick<'d>(&self, dev: &'d CudaDevice, args: Args<'a>) -> Result<(Picked<'d>, Args<'a>), CudaError> {
        let Self { op, w, m, rows, k, variant, bf16_kind, fp8_kind } = *self;
        match w {
            ProjWeights::Bf16(w) => {
                shape_check(op, gemv_supports(m, k), || {
                    format!("m = {m}, k = {k}: the kernel needs 1 ≤ m ≤ {GEMV_KERNEL_MAX_M} and k a multiple of 8")
                })?;
                need(op, "w", w, rows * k)?;
                let variant = variant.unwrap_or_else(|| gemv_default(rows, dev.sm_count()));
                let (v, func) = gemv_function(dev, op, m, variant, bf16_kind)?;
                let pf = v.prefetch_row_bytes(rows, k, dev.gemv_l2_prefetch());
                Ok((Picked { func, threads: v.warps * 32, tail: Tail::Bf16 { pf }, shared: 0 }, args.buf(w)))
            }
            ProjWeights::Fp8(w) => {
                let fits =
                    (1..=GEMV_KERNEL_MAX_M).contains(&m) && k.is_multiple_of(16) && (w.rows, w.cols) == (rows, k);
                let Some(scaling) = gemv_fp8_scaling(k, w.col_block).filter(|_| fits) else {
                    let (r, c, cb) = (w.rows, w.cols, w.col_block);
                    let message = format!("m = {m}, {rows} × {k} over {r} × {c} FP8 weights, column block {cb}");
                    return Err(shape_error(op, message));
                };
                need(op, "codes", &w.codes, rows * k)?;
                need(op, "scales", &w.scales, rows.div_ceil(w.row_block) * k.div_ceil(w.col_block))?;
                let variant = variant.unwrap_or_else(|| gemv_fp8_default(rows, m, dev.sm_count()));
                let (v, func) = gemv_fp8_function(dev, op, m, variant, scaling, fp8_kind)?;
                let tail = Tail::Fp8 { row_block: w.row_block, col_block: w.col_block };
                let shared = match fp8_kind {
                    Fp8Epilogue::Norm | Fp8Epilogue::NormSilu => {
                        shape_check(op, norm_linear_fp8_fits(m, k), || {
                            format!("m = {m}, k = {k}: the normalized x exceeds {NORM_X_SHARED_MAX} bytes")
                        })?;
                        norm_x_shared_bytes(m, k)
                    }
                    Fp8Epilogue::Plain | Fp8Epilogue::Residual => 0,
                };
                Ok((Picked { func, threads: v.warps * 32, tail, shared }, args.buf(&w.codes).buf(&w.scales)))
            }
        }
    }
}

impl Picked<'_> {
    /// `args` with the sizes (m, output width, k) and the tail appended, and the launch shape of
    /// `ctas` CTAs.
    fn finish<'a>(
        &self,
        op: &'static str,
        args: Args<'a>,
        sizes: [usize; 3],
        ctas: usize,
    ) -> Result<(Args<'a>, LaunchConfig), CudaError> {
        let [m, n, k] = sizes;
        let args = args.int(m)?.int(n)?.int(k)?;
        let args = match self.tail {
            Tail::Bf16 { pf } => args.int(pf)?,
            Tail::Fp8 { row_block, col_block } => args.int(row_block)?.int(col_block)?,
        };
        let mut launch = cfg((int(op, ctas)? as u32, 1, 1), self.threads);
        launch.shared_mem_bytes = self.shared as u32;
        Ok((args, launch))
    }
}

/// `residual += bf16(x · wᵀ)` and the new residual's per-CTA sums of squares into `stats`.
pub struct ResidualLinearCall<'a> {
    /// `m × k` bf16: the branch's last activation (attention output, SiLU·mul).
    pub x: &'a CudaSlice<bf16>,
    /// Rows of `x`.
    pub m: usize,
    /// The reduction length.
    pub k: usize,
    /// `n × k` weights.
    pub w: ProjWeights<'a>,
    /// Rows of `w`: the residual's width.
    pub n: usize,
    /// `m × n` f32, updated in place.
    pub residual: &'a mut CudaSlice<f32>,
    /// `m × `[`norm_stat_parts`]`(n)` f32, overwritten.
    pub stats: &'a mut CudaSlice<f32>,
    /// Index in [`GEMV_VARIANTS`](super::GEMV_VARIANTS) (FP8: in
    /// [`GEMV_FP8_VARIANTS`](super::GEMV_FP8_VARIANTS)), or `None` for the plain product's default.
    pub variant: Option<usize>,
}

impl ResidualLinearCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "residual_linear";
        let Self { x, m, k, w, n, residual, stats, variant } = self;
        need(OP, "x", x, m * k)?;
        need(OP, "residual", residual, m * n)?;
        need(OP, "stats", stats, m * norm_stat_parts(n))?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let product = Product {
            op: OP,
            w,
            m,
            rows: n,
            k,
            variant,
            bf16_kind: GemvEpilogue::Residual,
            fp8_kind: Fp8Epilogue::Residual,
        };
        let (picked, args) = product.pick(dev, Args::new(OP).buf(x))?;
        let (args, grid) = picked.finish(OP, args.buf(residual).buf(stats), [m, n, k], norm_stat_parts(n))?;
        // SAFETY: x holds m × k, the weights n × k (and their scales), residual m × n and stats
        // m × parts (checked above and in `pick`); the kernel reads whole 16-byte rows (k % 8 or
        // % 16 == 0) and writes residual rows < m, columns < n, and stats[row][cta] for rows < m
        // and one entry per CTA.
        unsafe { args.launch(dev, picked.func, grid) }
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

/// `out = (rms_norm(residual) · norm) · wᵀ`, plain or gated, with `1 / rms` from the stats a
/// [`ResidualLinearCall`] left.
pub struct NormLinearCall<'a> {
    /// `m × k` f32: the residual stream.
    pub residual: &'a CudaSlice<f32>,
    /// `m × `[`norm_stat_parts`]`(k)` f32: the sums of squares of `residual`'s rows.
    pub stats: &'a CudaSlice<f32>,
    /// `k` bf16: the norm's weight.
    pub norm: &'a CudaSlice<bf16>,
    /// Added to the mean square.
    pub eps: f32,
    /// Rows.
    pub m: usize,
    /// The residual's width: the reduction length.
    pub k: usize,
    /// The projection's weights (`n × k`, or `2d × k` gated).
    pub w: ProjWeights<'a>,
    /// Plain or gated.
    pub kind: NormLinearOut,
    /// `m × n` (or `m × d`) bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Index in [`GEMV_VARIANTS`](super::GEMV_VARIANTS) (FP8: in
    /// [`GEMV_FP8_VARIANTS`](super::GEMV_FP8_VARIANTS)), or `None` for the variant the unfused
    /// product picks.
    pub variant: Option<usize>,
}

impl NormLinearCall<'_> {
    /// Checks the sizes and enqueues the product.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "norm_linear";
        let Self { residual, stats, norm, eps, m, k, w, kind, out, variant } = self;
        let parts = norm_stat_parts(k);
        // Output columns, weight rows, columns per CTA, and the epilogue.
        let (cols, rows, per_cta, bf16_kind, fp8_kind) = match kind {
            NormLinearOut::Plain { n } => (n, n, GEMV_ROWS_PER_CTA, GemvEpilogue::NormBf16, Fp8Epilogue::Norm),
            NormLinearOut::GatedSilu { d } => {
                (d, 2 * d, GEMV_ROWS_PER_CTA / 2, GemvEpilogue::NormSilu, Fp8Epilogue::NormSilu)
            }
        };
        need(OP, "residual", residual, m * k)?;
        need(OP, "stats", stats, m * parts)?;
        need(OP, "norm", norm, k)?;
        need(OP, "out", out, m * cols)?;
        if m == 0 || cols == 0 {
            return Ok(());
        }
        let product = Product { op: OP, w, m, rows, k, variant, bf16_kind, fp8_kind };
        let args = Args::new(OP).buf(residual).buf(stats).int(parts)?.buf(norm).f32(eps);
        let (picked, args) = product.pick(dev, args)?;
        let (args, grid) = picked.finish(OP, args.buf(out), [m, cols, k], cols.div_ceil(per_cta))?;
        // SAFETY: residual holds m × k, stats m × parts, norm k, the weights rows × k (and their
        // scales) and out m × cols (checked above and in `pick`); the kernel reads whole 16-byte
        // rows, weight rows below `rows`, and writes only columns < cols of out's m rows.
        unsafe { args.launch(dev, picked.func, grid) }
    }
}
