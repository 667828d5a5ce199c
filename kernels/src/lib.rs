//! Baton's compute kernels.
//!
//! `cpu` holds the reference implementation of every op the model runs
//! (embedding gather, RMSNorm with fused residual add, RoPE with every supported
//! scaling, K/V writes into the paged cache, paged attention for mixed
//! prefill/decode batches, SiLU·mul, and the linear layer through the `gemm`
//! crate). These are the CPU backend's kernels and the references the CUDA
//! kernels are tested against. All activations are f32, row-major.
//!
//! `cuda` holds the CUDA C kernels (compiled at run time with NVRTC) and their typed
//! launchers: bf16 storage, f32 arithmetic, checked against `cpu` by the `gpu_*` tests.

pub mod cpu;
pub mod cuda;
