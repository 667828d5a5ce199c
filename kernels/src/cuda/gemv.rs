//! The skinny GEMM of `kernels/cuda/gemv.cu` (`out = x · wᵀ` for a few rows of `x`, decode,
//! where cuBLAS reads the weights well below the memory bandwidth), described: its compiled
//! variants (warps per CTA × k-steps in flight) and their names, the rule that picks one per
//! shape, and the shapes it takes at all. Pure data and rules, no device: the launcher is
//! [`LinearCall`](super::LinearCall) with [`LinearKernel::Gemv`](super::LinearKernel::Gemv).
//!
//! Invariants: [`GEMV_VARIANTS`] lists the `GEMV_INSTANCE` lines of gemv.cu in order (a unit
//! test of `compile.rs` compares them), each instantiated for up to 8 and up to 16 rows of x
//! and for every [`GemvEpilogue`] (bf16 and f32 outputs, the gated products whose
//! activation is fused: [`GatedLinearCall`](super::GatedLinearCall), and the residual and
//! norm-input products of the fused RMSNorm: `norm_linear.rs`); the kernel takes `m × k` inputs with 1 ≤ m ≤
//! [`GEMV_KERNEL_MAX_M`] and k a multiple of 8 ([`gemv_supports`]), so that every row starts
//! on a 16-byte boundary. Callers that may see other shapes ask first and use cuBLAS.

/// Most rows of `x` one launch takes: two 8-column tiles of the tensor-core product.
pub const GEMV_KERNEL_MAX_M: usize = 16;

/// Rows of `x` one 8-column tile holds: up to this many rows use the cheaper instantiation.
const TILE_M: usize = 8;

/// Rows of `w` per CTA (the M of the m16n8k16 product).
pub(crate) const GEMV_ROWS_PER_CTA: usize = 16;

/// The instantiations for up to 8 and up to 16 rows of x, in the order of the device's
/// function table.
pub(crate) const GEMV_MAX_MS: [usize; 2] = [TILE_M, GEMV_KERNEL_MAX_M];

/// Index in [`GEMV_MAX_MS`] of the instantiation for `m` rows of x.
pub(crate) fn gemv_tile_index(m: usize) -> usize {
    usize::from(m > TILE_M)
}

/// One compiled shape of the kernel (see `GEMV_INSTANCE` in gemv.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvVariant {
    /// Warps per CTA; they split k between them and meet in shared memory.
    pub warps: u32,
    /// k-steps of 32 per batch: each thread has `2 · unroll` 16-byte weight loads in flight.
    pub unroll: u32,
}

impl GemvVariant {
    /// The kernel's name for up to `max_m` rows of `x` (8 or 16) and the epilogue.
    pub fn kernel_name(&self, max_m: usize, epilogue: GemvEpilogue) -> String {
        format!("gemv_m{max_m}_w{}_u{}_{}", self.warps, self.unroll, epilogue.suffix())
    }
}

/// What a skinny-GEMM instantiation does with its sums: every variant is compiled with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvEpilogue {
    /// `out = x · wᵀ` rounded to bf16.
    Bf16,
    /// `out = x · wᵀ` in f32 (the LM head).
    F32,
    /// The gated MLP: `w = [gate; up]`, `out = silu(gate) · up` (bf16, as `silu_mul` computes
    /// it from the bf16 products).
    Silu,
    /// As [`Self::Silu`] with GELU (tanh approximation), Gemma's GeGLU.
    GeluTanh,
    /// The end of a residual branch (o_proj, down): `residual += bf16(x · wᵀ)` in f32, and each
    /// row's sum of squares per CTA for the next norm-input product
    /// ([`ResidualLinearCall`](super::ResidualLinearCall)).
    Residual,
    /// `out = rms_norm(residual) · w_norm · wᵀ` in bf16, the normalization done on x's loads
    /// from a residual product's sums ([`NormLinearCall`](super::NormLinearCall)).
    NormBf16,
    /// As [`Self::NormBf16`] for the gated MLP with SiLU (as [`Self::Silu`]).
    NormSilu,
    /// As [`Self::NormBf16`] for the qkv projection with RoPE and the KV write in the epilogue:
    /// rotated q out, rotated k and v into a bf16 cache ([`NormRopeCall`](super::NormRopeCall)).
    NormRope,
    /// As [`Self::NormRope`] into an FP8 (E4M3) cache.
    NormRopeFp8,
    /// As [`Self::NormBf16`] with an f32 output, also storing the normalized activation from
    /// the first CTA: a MoE layer's router, whose experts read that activation next
    /// ([`NormRouterCall`](super::NormRouterCall)).
    NormF32X,
}

impl GemvEpilogue {
    /// Every epilogue, in the order of the kernel table's entries per variant.
    pub const ALL: [Self; 10] = [
        Self::Bf16,
        Self::F32,
        Self::Silu,
        Self::GeluTanh,
        Self::Residual,
        Self::NormBf16,
        Self::NormSilu,
        Self::NormRope,
        Self::NormRopeFp8,
        Self::NormF32X,
    ];

    /// The kernel name's last part (`GEMV_INSTANCE` in gemv.cu).
    fn suffix(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
            Self::Silu => "silu",
            Self::GeluTanh => "gelu_tanh",
            Self::Residual => "resid",
            Self::NormBf16 => "norm_bf16",
            Self::NormSilu => "norm_silu",
            Self::NormRope => "norm_rope",
            Self::NormRopeFp8 => "norm_rope_fp8",
            Self::NormF32X => "norm_f32_x",
        }
    }

    /// Index in [`Self::ALL`] (and in the kernel table's entries per variant).
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Every instantiated variant, in the order of `GEMV_VARIANTS` in gemv.cu.
pub const GEMV_VARIANTS: [GemvVariant; 4] = [
    GemvVariant { warps: 4, unroll: 4 },
    GemvVariant { warps: 8, unroll: 4 },
    GemvVariant { warps: 4, unroll: 8 },
    GemvVariant { warps: 8, unroll: 2 },
];

/// Index in [`GEMV_VARIANTS`] of the variant used for `n` output rows on `sms` SMs.
///
/// A CTA of 4 warps keeps 4 · 32 · 8 · 16 B = 16 KiB of weight loads in flight; HBM needs
/// about bandwidth × latency ≈ 3.35 TB/s × ~0.7 µs ≈ 2.3 MB in flight across the chip. With
/// at least 4 CTAs per SM (gate_up, lm_head: ≥ 1,792 CTAs) that is reached several times over
/// by 4-warp CTAs, which keep more CTAs resident; the narrow matrices (qkv, o, down: 256–384
/// CTAs, fewer than 3 per SM) get 8 warps per CTA, so that k is split further and twice the
/// loads are in flight.
pub fn gemv_default(n: usize, sms: usize) -> usize {
    if n.div_ceil(GEMV_ROWS_PER_CTA) >= 4 * sms.max(1) { 0 } else { 1 }
}

/// The default of [`CudaDevice::gemv_l2_prefetch`](super::CudaDevice::gemv_l2_prefetch):
/// bytes of a weight matrix a skinny GEMM pulls into L2 before it waits (0: the first round).
pub const GEMV_L2_PREFETCH_DEFAULT: usize = 0;

impl GemvVariant {
    /// Bytes of each weight row the first round of loads covers (every warp's first batch:
    /// `gemv_prefetch_l2` in gemv.cu always pulls these into L2).
    pub fn first_round_bytes(&self) -> usize {
        self.warps as usize * 4 * self.unroll as usize * 16
    }

    /// The kernel's `pf` argument: bytes of each of `rows` weight rows of `k` bf16 values to
    /// pull into L2 before the wait, for a budget of `budget` bytes over the matrix. At least
    /// the first round, at most the row, a multiple of 128 bytes (whole lines) otherwise.
    pub fn prefetch_row_bytes(&self, rows: usize, k: usize, budget: usize) -> usize {
        let row = 2 * k;
        let first = self.first_round_bytes().min(row);
        (budget / rows.max(1) / 128 * 128).clamp(first, row)
    }
}

/// Whether the kernel takes an `m × k` input: 1 ≤ m ≤ [`GEMV_KERNEL_MAX_M`] and k a multiple
/// of 8 (16-byte rows). Anything else goes to cuBLAS ([`LinearKernel::Cublas`](super::LinearKernel::Cublas)).
pub fn gemv_supports(m: usize, k: usize) -> bool {
    (1..=GEMV_KERNEL_MAX_M).contains(&m) && k.is_multiple_of(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_shapes() {
        assert!(gemv_supports(1, 4096) && gemv_supports(16, 14336) && gemv_supports(3, 8));
        assert!(!gemv_supports(0, 4096), "m = 0 is cuBLAS's (a no-op) case");
        assert!(!gemv_supports(17, 4096));
        assert!(!gemv_supports(1, 4100), "rows off a 16-byte boundary");
        // The 8-row instantiation up to 8 rows, the 16-row one beyond.
        assert_eq!([1, 8, 9, 16].map(gemv_tile_index), [0, 0, 1, 1]);
    }

    #[test]
    fn default_variant_splits_k_further_on_narrow_matrices() {
        // Llama-3.1-8B on 132 SMs: qkv, o, down narrow; gate_up and the LM head wide.
        for n in [6144usize, 4096] {
            assert_eq!(GEMV_VARIANTS[gemv_default(n, 132)].warps, 8, "n = {n}");
        }
        for n in [28672usize, 128_256] {
            assert_eq!(GEMV_VARIANTS[gemv_default(n, 132)].warps, 4, "n = {n}");
        }
        assert!(gemv_default(1, 0) < GEMV_VARIANTS.len());
    }

    #[test]
    fn prefetch_spreads_the_budget_over_the_rows_within_the_first_round_and_the_row() {
        let v = GEMV_VARIANTS[1]; // 8 warps × 4 k-steps: 2 KiB of each row in the first round
        assert_eq!(v.first_round_bytes(), 2048);
        // o_proj of Llama-3.1-8B (4,096 rows of 8 KiB): no budget, the first round.
        assert_eq!(v.prefetch_row_bytes(4096, 4096, 0), 2048);
        // 24 MiB over 32 MiB: three quarters of each row, whole lines.
        assert_eq!(v.prefetch_row_bytes(4096, 4096, 24 << 20), 6144);
        // A budget past the matrix: the whole row, no more.
        assert_eq!(v.prefetch_row_bytes(4096, 4096, 1 << 30), 8192);
        // Rounded down to 128-byte lines (a row of 6 KiB + 16 B at k = 3080).
        assert_eq!(v.prefetch_row_bytes(3, 3080, 3 * 5000), 4992);
        // A row shorter than the first round: the row.
        assert_eq!(v.prefetch_row_bytes(16, 512, 0), 1024);
    }

    #[test]
    fn kernel_names() {
        assert_eq!(GEMV_VARIANTS[1].kernel_name(8, GemvEpilogue::Bf16), "gemv_m8_w8_u4_bf16");
        assert_eq!(GEMV_VARIANTS[0].kernel_name(16, GemvEpilogue::F32), "gemv_m16_w4_u4_f32");
        assert_eq!(GEMV_VARIANTS[3].kernel_name(8, GemvEpilogue::GeluTanh), "gemv_m8_w8_u2_gelu_tanh");
        assert_eq!(GEMV_VARIANTS[1].kernel_name(8, GemvEpilogue::Residual), "gemv_m8_w8_u4_resid");
        assert_eq!(GEMV_VARIANTS[0].kernel_name(16, GemvEpilogue::NormSilu), "gemv_m16_w4_u4_norm_silu");
        for (i, e) in GemvEpilogue::ALL.into_iter().enumerate() {
            assert_eq!(e.index(), i);
        }
    }
}
