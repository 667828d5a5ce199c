//! CPU reference kernels over plain f32 slices. Every function checks its
//! shapes up front and returns a [`KernelError`] instead of indexing out of
//! bounds, so a shape bug surfaces as an error naming the op.

mod activation;
mod attention;
mod embed;
pub mod fp8;
mod fp8_linear;
mod kv_fp8;
mod linear;
mod logprobs;
mod moe;
mod norm;
mod rope;

pub use activation::{clamped_swiglu, gelu_tanh, gelu_tanh_mul, silu_mul, softcap};
pub use attention::{AttnExtras, KvLayerMut, KvLayerRef, SeqSpan, paged_attention, paged_attention_ext, write_kv};
pub use embed::embed;
pub use fp8_linear::{ActivationScale, Fp8Matrix, linear_fp8, quantize_rows_per_token};
pub use kv_fp8::{
    Fp8KvLayerMut, Fp8KvLayerRef, abs_max, paged_attention_fp8, requantize_e4m3, requantize_keys_e4m3, write_kv_fp8,
};
pub use linear::linear;
pub use logprobs::prompt_logprob;
pub use moe::{
    ExpertWeights, MoePermutation, MoeRouting, MoeRows, MoeScoring, moe_grouped_linear, moe_permute, moe_route,
    moe_unpermute,
};
pub use norm::{NormWeight, add_rms_norm, head_rms_norm, rms_norm};
pub use rope::{RopeScalingKind, RopeTable};

/// A kernel was called with inconsistent shapes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct KernelError {
    /// The op that refused its arguments.
    pub op: &'static str,
    /// What was inconsistent.
    pub message: String,
}

pub(crate) fn check(op: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok { Ok(()) } else { Err(KernelError { op, message: message() }) }
}
