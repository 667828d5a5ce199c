//! Architectures: each one holds only its weights and its forward, written over the
//! [`Backend`] ops, one file per family. The runner ([`crate::runner`]) owns everything that
//! is the same for every architecture (batch layout, graph replay, sampling, prompt
//! logprobs, KV hand-off) and drives an architecture through the [`Architecture`] trait;
//! the [`registry`] maps a checkpoint's architecture to its builder.
//!
//! Invariants:
//! - An architecture is built from a config that passed `ModelConfig::validate` and from
//!   [`LayerSpec`]s; a layer kind or backend op it does not implement is refused at load
//!   ([`ModelLoadError::Unsupported`]), naming it, never at run time.
//! - [`Architecture::forward_layers`] writes every layer's K/V into the backend's cache and
//!   calls `after_kv` once per layer, in order, right after that layer's write (the runner
//!   hands the KV to another worker there while later layers run).
//! - [`Architecture::logits`] leaves its output in the backend (see `Backend::lm_head`).

pub mod gemma;
pub mod gpt_oss;
pub mod llama;
pub mod moe;
pub mod registry;
pub mod spec;
pub mod weights;

pub use registry::{Registration, build_architecture};
pub use spec::{AttentionKind, LayerSpec, MlpKind, RopeSpec};
pub use weights::WeightLoader;

use crate::backend::{Backend, BackendError, BatchLayout};
use baton_formats::ModelConfig;

/// Why a model could not be built from its weights.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    /// A tensor is missing or unreadable.
    #[error(transparent)]
    Format(#[from] baton_formats::FormatError),
    /// A tensor has the wrong number of elements for the config.
    #[error("tensor {name} has {got} elements, expected {want} for this config")]
    Shape {
        /// Tensor name.
        name: String,
        /// Elements found.
        got: usize,
        /// Elements expected.
        want: usize,
    },
    /// An FP8 weight cannot be read as the model needs it.
    #[error("tensor {name}: {message}")]
    Fp8 {
        /// Tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The backend refused an upload.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A KV cache scale in the checkpoint cannot be used (FP8 KV cache).
    #[error(transparent)]
    KvScale(#[from] crate::kv_cache_dtype::KvScaleError),
    /// The model needs something this build or this backend does not implement.
    #[error("{architecture} on {device}: unsupported: {what}")]
    Unsupported {
        /// The architecture (HF `model_type`).
        architecture: &'static str,
        /// The backend's device.
        device: String,
        /// What is missing.
        what: String,
    },
}

/// Called by [`Architecture::forward_layers`] after each layer wrote its K/V: the backend
/// and the layer's index.
pub type AfterKv<'a, B> = dyn FnMut(&mut B, usize) -> Result<(), BackendError> + 'a;

/// A decoder architecture bound to a backend's weights: the forward from token ids to the
/// LM head's logits. Everything around it (batching, replay, sampling, KV I/O) is the
/// runner's.
pub trait Architecture<B: Backend>: Send {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// One spec per layer, in order.
    fn layers(&self) -> &[LayerSpec];
    /// Layer `layer`'s rotary table as the forward rotates its keys with it (its inverse
    /// frequencies cover the rotated dims; the others pass through). The default is the
    /// layer spec's table over the whole head; an architecture with partial rotary or
    /// per-context factors overrides it. [`crate::kv_k_smoothing`] reads the frequencies.
    fn key_rope(&self, layer: usize) -> Result<baton_kernels::cpu::RopeTable, BackendError> {
        let spec = self.layers().get(layer).ok_or_else(|| BackendError::Device(format!("no layer {layer}")))?;
        Ok(spec.rope.table(spec.head_dim)?)
    }
    /// What in this model's attention would see one shift of every key of a layer (a
    /// soft-cap on the scores, sink logits), or `None` where nothing does: a plain softmax
    /// over `q · k` moves every score of a query by the same `q · shift`
    /// ([`crate::kv_k_smoothing`]). The default: nothing.
    fn key_shift_blocker(&self) -> Option<&'static str> {
        None
    }
    /// Called once after the weights are on the device (the backend finished uploading):
    /// sets what the forward reads besides weights (rotary tables).
    fn prepare(&mut self, b: &mut B) -> Result<(), BackendError>;
    /// Embeds `batch` (with its pending rows) and runs every layer, writing K/V into the
    /// cache; `after_kv(b, i)` runs right after layer `i` wrote its K/V. The last layer's
    /// output stays in the architecture's buffers for [`Architecture::logits`]. `batch` has
    /// at least one row.
    fn forward_layers(
        &mut self,
        b: &mut B,
        batch: &BatchLayout,
        after_kv: &mut AfterKv<'_, B>,
    ) -> Result<(), BackendError>;
    /// The final norm and the LM head of rows `rows` of the last forward, left in the
    /// backend as `rows.len()` logit rows. With `last_use`, this is the step's last read of
    /// the activations, which may then be consumed in place (when `rows` is every row in
    /// order); otherwise they are kept for later calls.
    fn logits(&mut self, b: &mut B, rows: &[usize], last_use: bool) -> Result<(), BackendError>;
}
