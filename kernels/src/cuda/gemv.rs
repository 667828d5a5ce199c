//! Launchers for the skinny GEMM of `kernels/cuda/gemv.cu`: `out = x · wᵀ` for a few rows of
//! `x` (decode), where cuBLAS reads the weights well below the memory bandwidth.
//!
//! This module owns the kernel's variants (warps per CTA × k-steps in flight), the rule that
//! picks one per shape, and the conditions under which the kernel applies at all
//! ([`gemv_supports`]: 1 ≤ m ≤ [`GEMV_KERNEL_MAX_M`], k a multiple of 8 so that every row
//! starts on a 16-byte boundary). Invariants, as for every launcher: sizes are checked against
//! the slices before anything is enqueued, and a refusal is a [`CudaError::Shape`], never a
//! panic. Callers that may see other shapes ask [`gemv_supports`] first and fall back to
//! [`CudaDevice::linear`].

use super::ops::{Arg, ArgList, cfg, int, need};
use super::{CudaDevice, CudaError, shape_check};
use cudarc::driver::CudaSlice;
use half::bf16;

/// Most rows of `x` one launch takes: two 8-column tiles of the tensor-core product.
pub const GEMV_KERNEL_MAX_M: usize = 16;

/// Rows of `x` one 8-column tile holds: up to this many rows use the cheaper instantiation.
const TILE_M: usize = 8;

/// Rows of `w` per CTA (the M of the m16n8k16 product).
const ROWS_PER_CTA: usize = 16;

/// One compiled shape of the kernel (see `GEMV_INSTANCE` in gemv.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvVariant {
    /// Warps per CTA; they split k between them and meet in shared memory.
    pub warps: u32,
    /// k-steps of 32 per batch: each thread has `2 · unroll` 16-byte weight loads in flight.
    pub unroll: u32,
}

impl GemvVariant {
    /// The kernel's name for up to `max_m` rows of `x` (8 or 16) and the output type.
    pub fn kernel_name(&self, max_m: usize, f32_out: bool) -> String {
        let ty = if f32_out { "f32" } else { "bf16" };
        format!("gemv_m{max_m}_w{}_u{}_{ty}", self.warps, self.unroll)
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
    if n.div_ceil(ROWS_PER_CTA) >= 4 * sms.max(1) { 0 } else { 1 }
}

/// Whether the kernel takes an `m × k` input: 1 ≤ m ≤ [`GEMV_KERNEL_MAX_M`] and k a multiple
/// of 8 (16-byte rows). Anything else goes to [`CudaDevice::linear`].
pub fn gemv_supports(m: usize, k: usize) -> bool {
    (1..=GEMV_KERNEL_MAX_M).contains(&m) && k.is_multiple_of(8)
}

impl CudaDevice {
    /// `out = x · wᵀ` with the skinny-GEMM kernel (bf16 in and out, f32 accumulation): `x` is
    /// `m × k`, `w` is `n × k` row-major, `out` is `m × n`; the same contract as
    /// [`CudaDevice::linear`] for the shapes [`gemv_supports`] accepts (others are refused).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.gemv_variant(gemv_default(n, self.sm_count), x, m, k, w, n, out)
    }

    /// [`CudaDevice::gemv`] with an f32 output (the LM head's logits; see
    /// [`CudaDevice::linear_f32_out`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out(
        &self,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.gemv_f32_out_variant(gemv_default(n, self.sm_count), x, m, k, w, n, out)
    }

    /// [`CudaDevice::gemv`] with the variant `GEMV_VARIANTS[variant]` (for benchmarks and tests).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_variant(
        &self,
        variant: usize,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv";
        need(OP, "out", out, m * n)?;
        self.gemv_launch(OP, variant, x, m, k, w, n, Arg::Bf(out), false)
    }

    /// [`CudaDevice::gemv_f32_out`] with the variant `GEMV_VARIANTS[variant]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out_variant(
        &self,
        variant: usize,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv_f32_out";
        need(OP, "out", out, m * n)?;
        self.gemv_launch(OP, variant, x, m, k, w, n, Arg::F32(out), true)
    }

    /// Checks the inputs (the caller checked `out`) and launches one CTA per 16 rows of `w`.
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(
        &self,
        op: &'static str,
        variant: usize,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: Arg<'_>,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        need(op, "x", x, m * k)?;
        need(op, "w", w, n * k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        shape_check(op, gemv_supports(m, k), || {
            format!("m = {m}, k = {k}: the kernel needs 1 ≤ m ≤ {GEMV_KERNEL_MAX_M} and k a multiple of 8")
        })?;
        let tile = usize::from(m > TILE_M);
        let (v, funcs) = match (GEMV_VARIANTS.get(variant), self.funcs.gemv[tile].get(variant)) {
            (Some(v), Some(f)) => (*v, f),
            _ => return Err(CudaError::Shape { op, message: format!("no gemv variant {variant}") }),
        };
        let ctas = int(op, n.div_ceil(ROWS_PER_CTA))?;
        let (mi, ni, ki) = (int(op, m)?, int(op, n)?, int(op, k)?);
        self.run(
            &funcs[usize::from(f32_out)],
            cfg((ctas as u32, 1, 1), v.warps * 32),
            &mut ArgList(vec![Arg::Bf(x), Arg::Bf(w), out, Arg::I(mi), Arg::I(ni), Arg::I(ki)]),
        )
    }
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
    fn kernel_names() {
        assert_eq!(GEMV_VARIANTS[1].kernel_name(8, false), "gemv_m8_w8_u4_bf16");
        assert_eq!(GEMV_VARIANTS[0].kernel_name(16, true), "gemv_m16_w4_u4_f32");
    }
}
