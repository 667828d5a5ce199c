//! Which implementation a product of the CUDA backend runs: the skinny GEMM for decode-sized
//! rows, cuBLASLt's measured-fastest algorithm for batched decode, plain cuBLAS for prefill
//! chunks. Pure rules, unit-tested without a device; the launches are in `cuda.rs`,
//! `cuda_gated.rs`, `cuda_moe.rs` and `cuda_fp8_linear.rs`.

use baton_kernels::cuda::{LinearKernel, gemv_supports};

/// Largest batch (rows of `x`) whose GEMMs go to the skinny-GEMM kernel instead of cuBLAS.
///
/// Up to 8 rows the kernel costs what one row costs: one 8-column tensor-core tile, and the
/// weights are read once whatever m is, while cuBLAS reads them at 40–90% of copy bandwidth
/// on an H100, with the same time at M = 1, 8 and 32 on all five Llama-3.1-8B shapes
/// (bench/results/cuda-kernels-split-*). The kernel takes up to 16 rows (a second tile) and
/// would likely win there too, but every CTA re-reads m × k of x from L1 or L2 (at m = 16 as
/// many bytes as its weights; more than L1 holds at k = 14336), which may make it L2-bound;
/// so 9–16 stays on cuBLAS until `cuda_bench`'s M = 16 rows show gemv ahead on every shape.
pub const GEMV_MAX_M: usize = 8;

/// Whether a product of `m` rows over `k` columns goes to the skinny-GEMM kernel.
pub(super) fn gemv_applies(enabled: bool, m: usize, k: usize) -> bool {
    enabled && m <= GEMV_MAX_M && gemv_supports(m, k)
}

/// The implementation of a product of `m` rows over `k` columns: the skinny GEMM (its default
/// variant) where [`gemv_applies`], else cuBLAS.
pub(super) fn linear_kernel(gemv: bool, m: usize, k: usize) -> LinearKernel {
    if gemv_applies(gemv, m, k) {
        LinearKernel::GEMV
    } else if gemv && m <= TUNED_MAX_M {
        // Batched decode: cuBLASLt's algorithm measured fastest per shape (the skinny GEMM's
        // switch turns this off too: `--cublas` compares against plain cuBLAS).
        LinearKernel::Tuned
    } else {
        LinearKernel::Cublas
    }
}

/// Most rows whose products go to [`LinearKernel::Tuned`]: decode batches (graphs pad them
/// to at most 512); prefill chunks, which are larger, keep plain cuBLAS (compute-bound, where
/// it does well, and too many distinct shapes to time each).
const TUNED_MAX_M: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_dispatch_rule() {
        assert!(gemv_applies(true, 1, 4096) && gemv_applies(true, GEMV_MAX_M, 14336));
        assert!(!gemv_applies(false, 1, 4096), "switched off: cuBLAS");
        assert!(!gemv_applies(true, GEMV_MAX_M + 1, 4096), "larger batches: cuBLAS");
        assert!(!gemv_applies(true, 0, 4096));
        assert!(!gemv_applies(true, 1, 4100), "k off a multiple of 8: cuBLAS");
        assert_eq!(linear_kernel(true, 1, 4096), LinearKernel::GEMV);
        assert_eq!(linear_kernel(true, GEMV_MAX_M + 1, 4096), LinearKernel::Tuned, "batched decode: cuBLASLt");
        assert_eq!(linear_kernel(true, TUNED_MAX_M, 4096), LinearKernel::Tuned);
        assert_eq!(linear_kernel(true, TUNED_MAX_M + 1, 4096), LinearKernel::Cublas, "prefill chunks: cuBLAS");
        assert_eq!(linear_kernel(false, 1, 4096), LinearKernel::Cublas);
        assert_eq!(linear_kernel(false, 64, 4096), LinearKernel::Cublas);
    }
}
