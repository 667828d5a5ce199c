//! Baton's compute kernels.
//!
//! `cpu` holds the reference implementation of every op the model runs
//! (embedding gather, RMSNorm with fused residual add, RoPE with every supported
//! scaling, K/V writes into the paged cache, paged attention for mixed
//! prefill/decode batches, SiLU·mul, and the linear layer through the `gemm`
//! crate). These are the CPU backend's kernels and the references the CUDA
//! kernels are tested against. All activations are f32, row-major.

pub mod cpu;
