//! FP8 (E4M3) weight matrices on the device and their two launches: [`Fp8GemvCall`], the
//! weights-only (W8A16) skinny GEMM of `kernels/cuda/gemv_fp8.cu` (bf16 x, the FP8 weights read
//! once on the tensor cores, f32 accumulation, scales per block), and [`Fp8DequantCall`]
//! (`kernels/cuda/fp8_linear.cu`), the dequantization to bf16 that products of more rows feed to
//! the bf16 GEMM. The reference is [`crate::cpu::linear_fp8`] with
//! [`crate::cpu::ActivationScale::None`].
//!
//! Invariants: an [`Fp8Weights`] holds exactly `rows × cols` codes and the block scales of
//! its [`Fp8Matrix`]; [`gemv_fp8_scaling`] is the one rule for which scale layouts the skinny
//! kernel takes (one column block over the row, or column blocks of a multiple of 64 codes, so
//! that no 64-code k-step straddles two) and [`gemv_fp8_supports`] the one rule for which
//! products the engine sends to it (k a multiple of 16, 1 ≤ m ≤ [`GEMV_FP8_MAX_M`]);
//! [`GEMV_FP8_VARIANTS`] lists the `GEMV_FP8_INSTANCE` lines of gemv_fp8.cu in order (a unit
//! test of `sources.rs` compares them), each instantiated for up to 8 and up to 16 rows of x
//! per CTA, for both [`Fp8Scaling`]s and every [`Fp8Epilogue`]; [`fp8_gemv_plan`] is the one
//! place that checks a launch of any of them and picks its function and grid (the fused
//! epilogues' calls are in `fp8_fused.rs`).

use super::gemv::{GEMV_MAX_MS, GEMV_ROWS_PER_CTA, GemvVariant};
use super::launch::{Args, cfg, grid_stride, int, need, shape_check, shape_error};
use super::{CudaDevice, CudaError, CudaSlice};
use crate::cpu::Fp8Matrix;
use cudarc::driver::{CudaFunction, LaunchConfig};
use half::bf16;

/// Most rows of x the engine sends to the skinny FP8 kernel. Up to 16 one CTA per weight tile
/// covers them; beyond, each tile has one CTA per 16 rows of x, adjacent in launch order, so the
/// tile comes from HBM once and from L2 for the others. Past 64 rows the L2 re-reads and the
/// mma work outgrow one pass of dequantization + the bf16 GEMM (see bench/notes/fp8-weights.md).
pub const GEMV_FP8_MAX_M: usize = 64;

/// Codes per k-step of the kernel (4 threads × 16): column blocks must be a multiple of it.
const KSTEP_CODES: usize = 64;

/// How the kernel applies the scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One column block over the whole row (per tensor, per output channel): the row's scale
    /// multiplies the finished sum.
    Row,
    /// Column blocks of a multiple of 64 codes (DeepSeek's 128 × 128): each k-step's partial
    /// sums are scaled by their block's scale.
    Block,
}

impl Fp8Scaling {
    /// Both, in the order of the kernel table's entries per variant.
    pub const ALL: [Self; 2] = [Self::Row, Self::Block];

    fn suffix(self) -> &'static str {
        match self {
            Self::Row => "row",
            Self::Block => "blk",
        }
    }

    /// Index in [`Self::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What the kernel's epilogue does with the finished sums (gemv_fp8.cu's `GEMV_FP8_EPILOGUES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Epilogue {
    /// Stores the product.
    Plain,
    /// `silu(gate) · up` of a `[gate; up]` product.
    Silu,
    /// `gelu_tanh(gate) · up` of a `[gate; up]` product.
    GeluTanh,
    /// RoPE on q and k, the KV write into a bf16 cache.
    Rope,
    /// RoPE on q and k, the KV write into an FP8 cache.
    RopeFp8,
}

impl Fp8Epilogue {
    /// Every epilogue, in the order of the kernel table's entries per variant.
    pub const ALL: [Self; 5] = [Self::Plain, Self::Silu, Self::GeluTanh, Self::Rope, Self::RopeFp8];

    fn suffix(self) -> &'static str {
        match self {
            Self::Plain => "",
            Self::Silu => "_silu",
            Self::GeluTanh => "_gelu_tanh",
            Self::Rope => "_rope",
            Self::RopeFp8 => "_rope_fp8",
        }
    }

    /// Index in [`Self::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// The compiled (warps, k-steps of 64 codes per batch) shapes of the FP8 kernel, in the order of
/// `GEMV_FP8_VARIANTS` in gemv_fp8.cu.
pub const GEMV_FP8_VARIANTS: [GemvVariant; 4] = [
    GemvVariant { warps: 4, unroll: 4 },
    GemvVariant { warps: 8, unroll: 4 },
    GemvVariant { warps: 4, unroll: 2 },
    GemvVariant { warps: 8, unroll: 2 },
];

impl GemvVariant {
    /// The FP8 kernel's name for up to `max_m` rows of x per CTA (8 or 16), `scaling` and
    /// `epilogue`.
    pub fn fp8_kernel_name(&self, max_m: usize, scaling: Fp8Scaling, epilogue: Fp8Epilogue) -> String {
        format!("gemv_fp8_m{max_m}_w{}_u{}_{}{}", self.warps, self.unroll, scaling.suffix(), epilogue.suffix())
    }
}

/// How the kernel would apply the scales of a `k`-wide matrix with column block `cb`, or `None`
/// when it cannot (a column block that some 64-code k-step would straddle).
pub fn gemv_fp8_scaling(k: usize, cb: usize) -> Option<Fp8Scaling> {
    if cb >= k && cb > 0 {
        Some(Fp8Scaling::Row)
    } else if cb > 0 && cb.is_multiple_of(KSTEP_CODES) {
        Some(Fp8Scaling::Block)
    } else {
        None
    }
}

/// Whether [`Fp8GemvCall`] takes `m` rows against a `k`-wide matrix with column block `cb`
/// within the engine's range: 1 ≤ m ≤ [`GEMV_FP8_MAX_M`], k a multiple of 16 (16-byte code
/// rows), and a scale layout [`gemv_fp8_scaling`] accepts.
pub fn gemv_fp8_supports(m: usize, k: usize, cb: usize) -> bool {
    (1..=GEMV_FP8_MAX_M).contains(&m) && k.is_multiple_of(16) && gemv_fp8_scaling(k, cb).is_some()
}

/// Index in [`GEMV_FP8_VARIANTS`] of the variant used for `n` output rows and `m` rows of x on
/// `sms` SMs. Fewer than 4 CTAs per SM (qkv, o, down at decode) take 8 warps, so that k is split
/// further and more loads are in flight; up to 8 rows of x take 4 k-steps per batch (8 loads of
/// 16 codes in flight per thread), more rows 2 (their x fragments double the registers).
pub fn gemv_fp8_default(n: usize, m: usize, sms: usize) -> usize {
    let ctas = n.div_ceil(GEMV_ROWS_PER_CTA) * fp8_groups(m);
    let wide = ctas >= 4 * sms.max(1);
    match (m <= GEMV_MAX_MS[0], wide) {
        (true, true) => 0,
        (true, false) => 1,
        (false, true) => 2,
        (false, false) => 3,
    }
}

/// CTAs per weight tile: one per 16 rows of x (one for up to 16).
fn fp8_groups(m: usize) -> usize {
    m.div_ceil(GEMV_MAX_MS[1]).max(1)
}

/// An FP8 weight matrix on the device.
pub struct Fp8Weights {
    /// `rows × cols` E4M3 codes.
    pub codes: CudaSlice<u8>,
    /// `⌈rows/row_block⌉ × ⌈cols/col_block⌉` f32 scales.
    pub scales: CudaSlice<f32>,
    /// Output rows (n).
    pub rows: usize,
    /// Input columns (k).
    pub cols: usize,
    /// Rows per scale block.
    pub row_block: usize,
    /// Columns per scale block.
    pub col_block: usize,
    /// One scale per row when the scales are constant along rows but blocked over several
    /// (per tensor, or row blocks > 1 with one column block): what the W8A8 product's per-row
    /// scale vector needs. `None` otherwise (per channel needs no copy: see
    /// [`Self::row_scales`]).
    pub expanded_row_scales: Option<CudaSlice<f32>>,
}

impl Fp8Weights {
    /// Uploads `w`'s codes and scales (and the per-row expansion of row-constant block scales).
    pub fn upload(dev: &CudaDevice, w: &Fp8Matrix) -> Result<Self, CudaError> {
        let (row_block, col_block) = w.block();
        let expanded = col_block >= w.cols() && row_block > 1;
        Ok(Self {
            codes: dev.upload(w.codes())?,
            scales: dev.upload(w.scales())?,
            rows: w.rows(),
            cols: w.cols(),
            row_block,
            col_block,
            expanded_row_scales: if expanded { Some(dev.upload(w.per_row().scales())?) } else { None },
        })
    }

    /// The `rows` per-row scales when the scales are constant along each row (one column block
    /// over the row), else `None` (block-scaled along k).
    pub fn row_scales(&self) -> Option<&CudaSlice<f32>> {
        if self.col_block < self.cols {
            None
        } else if self.row_block == 1 {
            Some(&self.scales)
        } else {
            self.expanded_row_scales.as_ref()
        }
    }
}

/// `out = x · W_dqᵀ` (bf16 out): the W8A16 decode product.
pub struct Fp8GemvCall<'a> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of x (any positive number: the launcher takes more than [`GEMV_FP8_MAX_M`], for
    /// benchmarks; the engine stops there).
    pub m: usize,
    /// The weights (`n × k`).
    pub w: &'a Fp8Weights,
    /// `m × n` bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Index in [`GEMV_FP8_VARIANTS`], or `None` for [`gemv_fp8_default`].
    pub variant: Option<usize>,
}

/// A checked launch of the skinny FP8 kernel: its function, its grid, and the trailing
/// arguments (`m, n, k, rb, cb, groups`) to append after the epilogue's own.
pub(super) struct Fp8GemvPlan<'d> {
    pub(super) func: &'d CudaFunction,
    pub(super) grid: LaunchConfig,
    groups: usize,
}

impl Fp8GemvPlan<'_> {
    /// `args` followed by `m, n, k, row_block, col_block, groups` (n: the kernel's output width).
    pub(super) fn tail<'a>(&self, args: Args<'a>, m: usize, n: usize, w: &Fp8Weights) -> Result<Args<'a>, CudaError> {
        args.int(m)?.int(n)?.int(w.cols)?.int(w.row_block)?.int(w.col_block)?.int(self.groups)
    }
}

/// Checks `m` rows of a bf16 `x` against `w` for the skinny FP8 kernel (naming `op`) and plans
/// its launch with `epilogue` over `tiles` weight tiles (16 rows of `w`, or 8 gate + 8 up rows
/// gated): every check of x, the codes and the scales, made before anything is enqueued. The
/// variant is `variant` or the default for `w`'s rows. `None`: nothing to launch (no tiles).
pub(super) fn fp8_gemv_plan<'d>(
    dev: &'d CudaDevice,
    op: &'static str,
    x: &CudaSlice<bf16>,
    m: usize,
    w: &Fp8Weights,
    epilogue: Fp8Epilogue,
    tiles: usize,
    variant: Option<usize>,
) -> Result<Option<Fp8GemvPlan<'d>>, CudaError> {
    let (n, k) = (w.rows, w.cols);
    let scaling = gemv_fp8_scaling(k, w.col_block);
    shape_check(op, m > 0 && k.is_multiple_of(16) && scaling.is_some(), || {
        format!("m = {m}, k = {k}, column block {}: not a skinny FP8 shape", w.col_block)
    })?;
    let scaling = scaling.unwrap_or(Fp8Scaling::Row);
    need(op, "x", x, m * k)?;
    need(op, "codes", &w.codes, n * k)?;
    need(op, "scales", &w.scales, n.div_ceil(w.row_block) * k.div_ceil(w.col_block))?;
    if tiles == 0 {
        return Ok(None);
    }
    let variant = variant.unwrap_or_else(|| gemv_fp8_default(n, m, dev.sm_count()));
    let tile = usize::from(m > GEMV_MAX_MS[0]);
    let funcs = dev.kernels.fp8()?.gemv[tile].get(variant).and_then(|e| e.get(epilogue.index()));
    let (v, funcs) = match (GEMV_FP8_VARIANTS.get(variant), funcs) {
        (Some(v), Some(f)) => (*v, f),
        _ => return Err(shape_error(op, format!("no gemv_fp8 variant {variant}"))),
    };
    let groups = fp8_groups(m);
    let ctas = int(op, tiles * groups)? as u32;
    Ok(Some(Fp8GemvPlan { func: &funcs[scaling.index()], grid: cfg((ctas, 1, 1), v.warps * 32), groups }))
}

impl Fp8GemvCall<'_> {
    /// Checks the shapes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "gemv_fp8";
        let Self { x, m, w, out, variant } = self;
        let n = w.rows;
        let plan = fp8_gemv_plan(dev, OP, x, m, w, Fp8Epilogue::Plain, n.div_ceil(GEMV_ROWS_PER_CTA), variant)?;
        need(OP, "out", out, m * n)?;
        let Some(plan) = plan else { return Ok(()) };
        let args = plan.tail(Args::new(OP).buf(x).buf(&w.codes).buf(&w.scales).buf(out), m, n, w)?;
        // SAFETY: CTA b reads the 16 weight rows of tile b / groups (clamped to n - 1) over k
        // codes, their scales, and rows of x clamped to m - 1 over k columns; it writes out[i][row]
        // for i < m, row < n only: all sizes checked above (k % 16 == 0: 16-byte code rows).
        unsafe { args.launch(dev, plan.func, plan.grid) }
    }
}

/// `out = bf16(W_dq)`: the dequantized `n × k` matrix.
pub struct Fp8DequantCall<'a> {
    /// The weights.
    pub w: &'a Fp8Weights,
    /// `n × k` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl Fp8DequantCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "fp8_dequant";
        let w = self.w;
        let total = w.rows * w.cols;
        need(OP, "codes", &w.codes, total)?;
        need(OP, "scales", &w.scales, w.rows.div_ceil(w.row_block) * w.cols.div_ceil(w.col_block))?;
        need(OP, "out", self.out, total)?;
        if total == 0 {
            return Ok(());
        }
        // 16 weights a thread when every 16-code chunk lies in one row and one column block.
        let wide = w.cols.is_multiple_of(16) && (w.col_block >= w.cols || w.col_block.is_multiple_of(16));
        let (func, units) =
            if wide { (&dev.kernels.fp8()?.dequant16, total / 16) } else { (&dev.kernels.fp8()?.dequant, total) };
        let args = Args::new(OP)
            .buf(&w.codes)
            .buf(&w.scales)
            .buf(self.out)
            .int(w.cols)?
            .int(w.row_block)?
            .int(w.col_block)?
            .long(units)?;
        // SAFETY: the grid-stride loop writes `total` outputs (16 per unit for the wide kernel,
        // whose rows are whole 16-byte chunks) and reads as many codes and the scales of their
        // blocks, checked above.
        unsafe { args.launch(dev, func, grid_stride(units)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skinny_shapes() {
        assert!(gemv_fp8_supports(1, 4096, 128) && gemv_fp8_supports(16, 4096, 4096) && gemv_fp8_supports(3, 64, 64));
        assert!(gemv_fp8_supports(64, 14336, 128) && gemv_fp8_supports(17, 4096, 4096));
        assert!(!gemv_fp8_supports(65, 4096, 128), "past 64 rows: dequantize and the bf16 GEMM");
        assert!(!gemv_fp8_supports(1, 4104, 4104), "k not a multiple of 16");
        assert!(!gemv_fp8_supports(1, 96, 48), "a 64-code k-step would straddle 48-column blocks");
        assert!(gemv_fp8_supports(1, 96, 96) && gemv_fp8_supports(1, 80, 4096), "one block over the row");
        assert!(!gemv_fp8_supports(0, 64, 64));
        assert_eq!(gemv_fp8_scaling(4096, 4096), Some(Fp8Scaling::Row));
        assert_eq!(gemv_fp8_scaling(4096, 128), Some(Fp8Scaling::Block));
        assert_eq!(gemv_fp8_scaling(4096, 0), None);
        assert_eq!([1, 16, 17, 64].map(fp8_groups), [1, 1, 2, 4]);
    }

    #[test]
    fn default_variants_and_names() {
        // Llama-3.1-8B on 132 SMs: qkv, o, down narrow (8 warps); gate_up wide.
        for n in [6144usize, 4096] {
            assert_eq!(GEMV_FP8_VARIANTS[gemv_fp8_default(n, 1, 132)].warps, 8, "n = {n}");
        }
        assert_eq!(GEMV_FP8_VARIANTS[gemv_fp8_default(28672, 1, 132)], GemvVariant { warps: 4, unroll: 4 });
        assert_eq!(GEMV_FP8_VARIANTS[gemv_fp8_default(28672, 16, 132)], GemvVariant { warps: 4, unroll: 2 });
        assert_eq!(GEMV_FP8_VARIANTS[gemv_fp8_default(4096, 64, 132)].warps, 4, "4 CTAs a tile: wide");
        let name = |v: usize, m, s, e| GEMV_FP8_VARIANTS[v].fp8_kernel_name(m, s, e);
        assert_eq!(name(1, 8, Fp8Scaling::Row, Fp8Epilogue::Plain), "gemv_fp8_m8_w8_u4_row");
        assert_eq!(name(2, 16, Fp8Scaling::Block, Fp8Epilogue::Plain), "gemv_fp8_m16_w4_u2_blk");
        assert_eq!(name(0, 8, Fp8Scaling::Row, Fp8Epilogue::Silu), "gemv_fp8_m8_w4_u4_row_silu");
        assert_eq!(name(3, 16, Fp8Scaling::Block, Fp8Epilogue::RopeFp8), "gemv_fp8_m16_w8_u2_blk_rope_fp8");
        for (i, s) in Fp8Scaling::ALL.into_iter().enumerate() {
            assert_eq!(s.index(), i);
        }
        for (i, e) in Fp8Epilogue::ALL.into_iter().enumerate() {
            assert_eq!(e.index(), i);
        }
    }
}
