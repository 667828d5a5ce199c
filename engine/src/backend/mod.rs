//! The backend seam: the small set of ops the models are written over.
//!
//! [`Backend`] holds the core ops every backend has; each architecture
//! ([`crate::models`]) writes its forward once against them, and the runner
//! ([`crate::runner`]) drives the step. What only some backends can do is a capability
//! trait reached through an accessor that returns `None` where it is missing
//! ([`Backend::graph_replay`], [`Backend::device_sampler`], [`Backend::kv_io`]): the runner
//! then takes the portable path (op by op, host sampling), so a missing capability never
//! fails a step. Ops a model may need beyond the core set ([`OptionalOp`]) are checked
//! with [`Backend::supports`] when the model loads, so a backend without one refuses the
//! model at load rather than failing (or serving wrong tokens) at run time.
//!
//! `cpu` implements everything with the reference kernels of `baton-kernels`; `cuda`
//! implements the same ops on the GPU (bf16 storage). A backend owns its buffers and the
//! paged KV cache; the models own only handles. Activations are row-major
//! `tokens × features`.

mod boundary;
pub mod cpu;
pub mod cuda;
mod moe_branch;

pub use boundary::{BoundaryRope, BoundaryScratch, BranchBoundary, branch_boundary_unfused};
pub(crate) use boundary::{check_boundary, end_branch_and_norm, rope_after};
pub use moe_branch::{MoeBranch, moe_branch_unfused};

use baton_core::api::PromptLogprob;
use baton_core::sampling::{RowPlan, Sampled, prompt_logprob};
use baton_formats::{CounterInit, TensorView};
use baton_kernels::cpu::{ActivationScale, Fp8Matrix, KernelError, MoeRouting, NormWeight, RopeTable};

pub use crate::kv_cache_dtype::KvScale;
use rayon::prelude::*;

/// The host's draw of [`Backend::random_mat`]: `parts` (rows each) of `cols` columns.
pub fn counter_values(parts: &[(usize, CounterInit)], cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.0 * cols).sum());
    for (rows, init) in parts {
        let start = out.len();
        out.resize(start + rows * cols, 0.0);
        out[start..].par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
            let first = (c << 16) as u64;
            for (i, x) in chunk.iter_mut().enumerate() {
                *x = init.value(first + i as u64);
            }
        });
    }
    out
}

/// The host's draw of [`Backend::random_mat_fp8`]: [`counter_values`] of each part quantized
/// per output channel as a bf16 checkpoint would be at load
/// ([`Fp8Matrix::quantize_per_channel`]), the parts stacked by rows ([`Fp8Matrix::stack`]).
pub fn counter_fp8(parts: &[(usize, CounterInit)], cols: usize) -> Result<Fp8Matrix, KernelError> {
    let mats = parts
        .iter()
        .map(|p| Fp8Matrix::quantize_per_channel(&counter_values(std::slice::from_ref(p), cols), p.0, cols))
        .collect::<Result<Vec<_>, _>>()?;
    Fp8Matrix::stack(&mats)
}

/// The stored tensors `parts` stacked by rows and quantized per output channel on the host
/// ([`Fp8Matrix::quantize_per_channel`]): [`Backend::quantize_mat_fp8`]'s rule, and its way for
/// what a device backend does not quantize itself.
pub fn quantize_stacked_fp8(parts: &[TensorView<'_>], rows: usize, cols: usize) -> Result<Fp8Matrix, KernelError> {
    Fp8Matrix::quantize_per_channel(&stacked_f32(parts), rows, cols)
}

/// The elements of `parts`, stacked in order, as f32 (how the default
/// [`Backend::upload_mat_raw`] reads stored tensors).
pub fn stacked_f32(parts: &[TensorView<'_>]) -> Vec<f32> {
    let mut out = Vec::with_capacity(parts.iter().map(TensorView::numel).sum());
    for p in parts {
        out.extend(p.to_f32());
    }
    out
}

/// What streaming stored weights to a device cost (see [`Backend::finish_weights`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WeightUploadReport {
    /// Bytes read from the stored tensors.
    pub bytes_read: u64,
    /// Bytes written to the device.
    pub bytes_uploaded: u64,
    /// Seconds the host spent reading (and converting) them, wall time.
    pub read_s: f64,
    /// Seconds the host waited for copies to the device.
    pub wait_s: f64,
}

/// A backend failure. It fails the requests of the step it happened in; only
/// [`BackendError::DeviceLost`] is fatal to the engine (see [`BackendError::is_fatal`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// An op was called with inconsistent shapes (a bug in the caller).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The device refused or failed one operation (out of memory, a bad argument) and is
    /// still usable.
    #[error("device error: {0}")]
    Device(String),
    /// The device's context is lost: every later call fails the same way (CUDA's "sticky"
    /// errors: an illegal address, a launch failure, an uncorrectable ECC error...). Only a
    /// new process can use the device again.
    #[error("device lost: {0}")]
    DeviceLost(String),
}

impl BackendError {
    /// Whether the engine cannot go on after this error (the process must restart).
    pub fn is_fatal(&self) -> bool {
        matches!(self, BackendError::DeviceLost(_))
    }
}

/// Where one sequence's chunk of the batch sits: rows `row_start..row_start + n_tokens`
/// of the activations, positions `start_pos..`, blocks from `block_table`.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqLayout {
    /// First activation row of this sequence's chunk.
    pub row_start: usize,
    /// Rows (tokens) in the chunk.
    pub n_tokens: usize,
    /// Tokens already in the KV cache before this chunk.
    pub start_pos: usize,
    /// Physical KV blocks of the sequence, covering `start_pos + n_tokens` tokens.
    pub block_table: Vec<u32>,
}

/// The token-level layout of one forward step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BatchLayout {
    /// Token ids of every row, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Position of every row.
    pub positions: Vec<usize>,
    /// Per-sequence spans.
    pub seqs: Vec<SeqLayout>,
    /// Rows whose logits are wanted (the last row of each chunk that samples), in output order.
    pub logit_rows: Vec<usize>,
    /// `(row, i)`: the token of `row` is the one the previous step's sampling picked for its
    /// `i`-th row, still unknown to the host when this step was planned (`tokens[row]` holds
    /// `baton_core::scheduler::PENDING_TOKEN`). See [`crate::runner::ModelRunner::forward_with`].
    pub pending: Vec<(usize, usize)>,
    /// Rows whose logits give a prompt token's logprob (requests with `prompt_logprobs`);
    /// computed by [`crate::runner::ModelRunner::forward_with`] and taken with
    /// [`crate::runner::ModelRunner::take_prompt_logprobs`]. Empty on every other step.
    pub prompt_logprobs: Vec<PromptLogprobRow>,
}

/// One row of a step whose logits score the prompt token that follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLogprobRow {
    /// Activation row (a prompt position `p`).
    pub row: usize,
    /// The prompt token at `p + 1`, whose logprob the row's logits give.
    pub target: u32,
    /// How many top alternatives to return (at most `baton_core::params::MAX_TOP_LOGPROBS`).
    pub top_k: usize,
}

/// What a backend does with a step offered for replay (see [`GraphReplay::begin_replay`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayStart {
    /// The backend declines: run the unpadded step's ops as usual.
    Eager,
    /// The step ran from a recording: its work up to the LM head is enqueued; run no ops.
    Replayed,
    /// No recording yet: run the padded step's ops (they execute), then run them again between
    /// [`GraphReplay::begin_recording`] and [`GraphReplay::end_recording`] to record them.
    Record,
}

/// Shape of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    /// Transformer layers.
    pub num_layers: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Element type stored (FP8 caches also carry per-layer scales, see
    /// [`Backend::set_kv_cache_dtype`]).
    pub dtype: baton_core::kv_transfer::KvDtype,
}

impl KvCacheShape {
    /// Bytes of K plus V per token across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size()
    }

    /// Blocks of `block_size` tokens that fit in `budget_bytes` (at least 0; a shape with no
    /// bytes per token counts as one byte, so this never divides by zero).
    pub fn blocks_in(&self, budget_bytes: usize) -> usize {
        budget_bytes / (self.bytes_per_token() * self.block_size).max(1)
    }
}

/// The ops a model step needs. Every method validates shapes and returns an error
/// rather than panicking.
pub trait Backend: Send + 'static {
    /// An activation buffer on the device.
    type Buf: Send;
    /// A weight matrix `[out, in]` prepared for `linear`.
    type Mat: Send + Sync;
    /// The residual stream: at least f32 precision even where activations are stored
    /// narrower, so that rounding does not accumulate over the layers.
    type Res: Send;

    /// "cpu" or "cuda:N".
    fn device_name(&self) -> String;
    /// Uploads a `rows × cols` f32 matrix.
    fn upload_mat(&mut self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Mat, BackendError>;
    /// Uploads a vector (norm weights, biases).
    fn upload_vec(&mut self, data: Vec<f32>) -> Result<Self::Buf, BackendError>;
    /// Uploads a `rows × cols` matrix whose rows are the stored tensors `parts` stacked in
    /// order (one tensor, or a fused `[q; k; v]`), their elements totalling `rows × cols` (the
    /// caller checked each tensor's shape). The default converts them to f32 on the host and
    /// calls [`Backend::upload_mat`]; a device backend streams the stored bytes as they are
    /// and may return before the copies finish ([`Backend::finish_weights`] waits for them).
    fn upload_mat_raw(
        &mut self,
        parts: &[TensorView<'_>],
        rows: usize,
        cols: usize,
    ) -> Result<Self::Mat, BackendError> {
        self.upload_mat(stacked_f32(parts), rows, cols)
    }
    /// Uploads an FP8 weight matrix for `linear`, whose inputs are quantized as `act` says.
    /// The default uploads its dequantized values as an ordinary matrix (the product then
    /// differs from the FP8 reference by the activation quantization and the backend's
    /// storage rounding); the CPU backend computes the reference
    /// ([`baton_kernels::cpu::linear_fp8`]).
    fn upload_mat_fp8(&mut self, w: Fp8Matrix, act: ActivationScale) -> Result<Self::Mat, BackendError> {
        let _ = act;
        let (rows, cols) = (w.rows(), w.cols());
        self.upload_mat(w.dequantize(), rows, cols)
    }
    /// A `rows × cols` FP8 matrix for `linear` (inputs quantized as `act` says), quantized at
    /// load from the stored tensors `parts` stacked in order (a bf16 or f32 checkpoint served
    /// with `--quantization fp8`): per output channel, the codes and scales
    /// [`Fp8Matrix::quantize_per_channel`] gives for the stored values. The default quantizes
    /// on the host and calls [`Backend::upload_mat_fp8`]; a device backend may quantize where
    /// the weights are uploaded to, to the same codes and scales.
    fn quantize_mat_fp8(
        &mut self,
        parts: &[TensorView<'_>],
        rows: usize,
        cols: usize,
        act: ActivationScale,
    ) -> Result<Self::Mat, BackendError> {
        self.upload_mat_fp8(quantize_stacked_fp8(parts, rows, cols)?, act)
    }
    /// Uploads a vector stacked from stored tensors (see [`Backend::upload_mat_raw`]).
    fn upload_vec_raw(&mut self, parts: &[TensorView<'_>]) -> Result<Self::Buf, BackendError> {
        self.upload_vec(stacked_f32(parts))
    }
    /// Ends loading weights: waits for uploads still in flight and frees their staging.
    /// Returns what streaming them cost; `None` where uploads complete as they are made (the
    /// default).
    fn finish_weights(&mut self) -> Result<Option<WeightUploadReport>, BackendError> {
        Ok(None)
    }
    /// A `rows × cols` matrix of random weights: its rows are `parts` in order, each
    /// `(rows, init)` drawn by the counter generator (element `i` of a part is
    /// `init.value(i)`, row-major). The default draws them on the host and uploads them; a
    /// device backend draws them where they live.
    fn random_mat(&mut self, parts: &[(usize, CounterInit)], cols: usize) -> Result<Self::Mat, BackendError> {
        let rows = parts.iter().map(|p| p.0).sum();
        self.upload_mat(counter_values(parts, cols), rows, cols)
    }
    /// A `rows × cols` FP8 matrix of random weights for `linear` (inputs quantized as `act`
    /// says): the draws of [`Backend::random_mat`] in f32, quantized per output channel and
    /// stacked ([`counter_fp8`]). The default does that on the host and calls
    /// [`Backend::upload_mat_fp8`]; a device backend may draw and quantize where the weights
    /// live, to the same codes and scales.
    fn random_mat_fp8(
        &mut self,
        parts: &[(usize, CounterInit)],
        cols: usize,
        act: ActivationScale,
    ) -> Result<Self::Mat, BackendError> {
        self.upload_mat_fp8(counter_fp8(parts, cols)?, act)
    }
    /// A vector of random weights, `parts` in order (see [`Backend::random_mat`]).
    fn random_vec(&mut self, parts: &[(usize, CounterInit)]) -> Result<Self::Buf, BackendError> {
        self.upload_vec(counter_values(parts, 1))
    }
    /// A buffer of `len` elements (contents unspecified).
    fn alloc(&mut self, len: usize) -> Result<Self::Buf, BackendError>;
    /// A residual-stream buffer of `len` elements (contents unspecified).
    fn alloc_res(&mut self, len: usize) -> Result<Self::Res, BackendError>;
    /// Resizes `buf` to `len` elements, reusing its storage where possible.
    fn resize(&mut self, buf: &mut Self::Buf, len: usize) -> Result<(), BackendError>;
    /// Allocates the paged KV cache; replaces any previous one.
    fn alloc_kv_cache(&mut self, shape: KvCacheShape) -> Result<(), BackendError>;

    /// `out[i] = table[tokens[i]]`, into the residual stream; each `(row, i)` of `pending`
    /// embeds instead the pick for row `i` of the last [`DeviceSampler::launch_device_sample`]
    /// (where it still is: on the device). Backends that sample nothing on a device refuse
    /// a non-empty `pending`.
    fn embed(
        &mut self,
        tokens: &[u32],
        pending: &[(usize, usize)],
        table: &Self::Mat,
        out: &mut Self::Res,
    ) -> Result<(), BackendError>;
    /// `out = x · wᵀ (+ bias)` for `m` rows.
    fn linear(
        &mut self,
        x: &Self::Buf,
        m: usize,
        w: &Self::Mat,
        bias: Option<&Self::Buf>,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `out = rms_norm(x) * weight` of the residual stream `x`.
    fn rms_norm(
        &mut self,
        x: &Self::Res,
        weight: &Self::Buf,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `residual += x; out = rms_norm(residual) * weight` (the sum kept at the residual's precision).
    fn add_rms_norm(
        &mut self,
        residual: &mut Self::Res,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `out[i] = x[rows[i]]` for residual-stream rows of width `width`.
    fn gather_res_rows(
        &mut self,
        x: &Self::Res,
        width: usize,
        rows: &[usize],
        out: &mut Self::Res,
    ) -> Result<(), BackendError>;
    /// The LM head: `x · wᵀ` for `m` rows in f32 (`m × w.rows`, row-major), so logits carry
    /// no bf16 rounding. The backend keeps them (on the device, where it has one) for
    /// [`Backend::logit_rows`] and [`DeviceSampler::launch_device_sample`] until the next call.
    fn lm_head(&mut self, x: &Self::Buf, m: usize, w: &Self::Mat) -> Result<(), BackendError>;
    /// Rows of the last [`Backend::lm_head`] output copied to the host, in the order given
    /// (`rows.len() × vocab`, row-major). A row that sampling on the device rewrote holds
    /// processed values, not logits: take each row one way only.
    fn logit_rows(&mut self, rows: &[usize]) -> Result<Vec<f32>, BackendError>;
    /// For each of the first `targets.len()` rows of the last [`Backend::lm_head`] output: the
    /// raw logprob and rank of `targets[i]` and the row's `k` most likely entries (see
    /// `baton_core::sampling::prompt_logprob`). The default downloads the rows and computes
    /// on the host; a device backend computes where the logits are and downloads only the
    /// answers.
    fn logit_row_logprobs(&mut self, targets: &[u32], k: usize) -> Result<Vec<PromptLogprob>, BackendError> {
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<usize> = (0..targets.len()).collect();
        let mut logits = self.logit_rows(&rows)?;
        let vocab = logits.len() / targets.len();
        if vocab == 0 {
            return Err(BackendError::Device("the LM head output is empty".into()));
        }
        Ok(logits.chunks_exact_mut(vocab).zip(targets).map(|(row, &t)| prompt_logprob(row, t, k)).collect())
    }
    /// Applies RoPE to `q` and `k` at the batch's positions, then writes `k`, `v` into layer `layer` of the cache.
    fn rope_and_write_kv(
        &mut self,
        layer: usize,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        n_heads: usize,
        batch: &BatchLayout,
    ) -> Result<(), BackendError>;
    /// Splits fused rows `[q | k | v]` of widths `(qd, kvd, kvd)`, applies RoPE to q and k,
    /// and writes k and v into layer `layer` of the cache; afterwards `q` holds the rotated q
    /// and `k`, `v` are unspecified (a backend may skip them: the cache holds k and v). The
    /// default is [`Backend::split3`] then [`Backend::rope_and_write_kv`].
    fn split_rope_and_write_kv(
        &mut self,
        layer: usize,
        qkv: &Self::Buf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        self.split3(qkv, widths, q, k, v)?;
        self.rope_and_write_kv(layer, q, k, v, n_heads, batch)
    }
    /// Paged causal attention of `q` over layer `layer` of the cache, for every sequence of the batch.
    fn attention(
        &mut self,
        layer: usize,
        q: &Self::Buf,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `out = silu(gate) * up` with rows `[gate | up]` of width `2d`.
    fn silu_mul(&mut self, gate_up: &Self::Buf, d: usize, out: &mut Self::Buf) -> Result<(), BackendError>;
    /// The gated MLP's first half: `out = act(gate) * up` where `[gate | up] = x · gate_upᵀ`
    /// (`gate_up` is `2 · gate.d` rows: the gate rows, then the up rows). The default runs
    /// [`Backend::linear`] into `scratch` and then [`Backend::silu_mul`] or
    /// [`Backend::gelu_tanh_mul`]; a backend may fuse the two (CUDA does for decode-sized
    /// batches, leaving `scratch` untouched) as long as `out` is the same.
    fn gated_linear(
        &mut self,
        x: &Self::Buf,
        m: usize,
        gate_up: &Self::Mat,
        gate: Gate,
        scratch: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        gated_linear_unfused(self, x, m, gate_up, gate, scratch, out)
    }
    /// The boundary between two residual branches ([`BranchBoundary`]): the ending branch's
    /// projection added to `residual`, the norm, and the next branch's first projection into
    /// `out`, and with [`BranchBoundary::rope`] the qkv projection's RoPE and KV write. The
    /// default runs the ops one by one ([`branch_boundary_unfused`]); a backend may fuse them
    /// (CUDA does for decode-sized batches) as long as `residual` and `out` (with a rope: its
    /// `q` and the cache) are the same.
    fn branch_boundary(
        &mut self,
        s: BranchBoundary<'_, Self>,
        residual: &mut Self::Res,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        branch_boundary_unfused(self, s, residual, scratch, out)
    }
    /// A MoE layer's MLP branch up to the next layer's qkv product ([`MoeBranch`]): o_proj
    /// added to `residual`, the norm, the MoE block added to `residual`, the next norm and the
    /// qkv product into `out`. The default runs the ops one by one ([`moe_branch_unfused`]); a
    /// backend may fuse them (CUDA does for decode-sized batches) as long as `residual` and
    /// `out` are the same (to the rounding of `1 / rms` that [`Backend::branch_boundary`]
    /// allows). Optional as [`Backend::moe`] is: the default fails where `moe` does.
    fn moe_branch(
        &mut self,
        s: MoeBranch<'_, Self>,
        residual: &mut Self::Res,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        moe_branch_unfused(self, s, residual, scratch, out)
    }
    /// `out[i] = x[rows[i]]` for rows of width `width`.
    fn gather_rows(
        &mut self,
        x: &Self::Buf,
        width: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// Splits fused rows `[a | b | c]` of widths `(wa, wb, wc)` into three buffers.
    fn split3(
        &mut self,
        x: &Self::Buf,
        widths: (usize, usize, usize),
        a: &mut Self::Buf,
        b: &mut Self::Buf,
        c: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// Copies a buffer's first `len` elements to the host.
    fn to_host(&mut self, buf: &Self::Buf, len: usize) -> Result<Vec<f32>, BackendError>;
    /// Sets the rotary table used by `rope_and_write_kv`.
    fn set_rope(&mut self, table: baton_kernels::cpu::RopeTable) -> Result<(), BackendError>;

    /// Element type of the KV cache (what [`KvIo::read_kv_blocks`] bytes hold).
    fn kv_dtype(&self) -> baton_core::kv_transfer::KvDtype;
    /// Chooses the KV cache's element type before [`Backend::alloc_kv_cache`], with one
    /// [`KvScale`] per layer when it is [`KvDtype::Fp8E4M3`] (empty otherwise). The default
    /// accepts only the backend's own [`Backend::kv_dtype`]; a backend refuses a type it
    /// cannot store, naming it, so the engine never starts with one.
    ///
    /// [`KvDtype::Fp8E4M3`]: baton_core::kv_transfer::KvDtype::Fp8E4M3
    fn set_kv_cache_dtype(
        &mut self,
        dtype: baton_core::kv_transfer::KvDtype,
        _scales: Vec<KvScale>,
    ) -> Result<(), BackendError> {
        if dtype == self.kv_dtype() {
            Ok(())
        } else {
            Err(BackendError::Device(format!(
                "{} cannot store its KV cache as {dtype:?} (it stores {:?})",
                self.device_name(),
                self.kv_dtype()
            )))
        }
    }
    /// The FP8 cache's scales in use, one per layer (empty when the cache is not FP8).
    fn kv_scales(&self) -> Vec<KvScale> {
        Vec::new()
    }
    /// Replaces layer `layer`'s FP8 scales (finite and positive, else refused): a decode
    /// worker adopting a prefill worker's calibrated scales before it stores that worker's
    /// codes. Only sound while the layer's cache holds nothing written under the old scales.
    fn set_kv_scale(&mut self, layer: usize, _scale: KvScale) -> Result<(), BackendError> {
        Err(BackendError::Device(format!("{} has no FP8 KV scales to set (layer {layer})", self.device_name())))
    }
    /// Layer `layer`'s FP8 key shift ([`crate::kv_k_smoothing`]): each key is stored as the
    /// code of `(k - shift) / k_scale`, one shift value per (KV head, dim); empty for none
    /// (and for a cache that is not FP8).
    fn kv_k_shift(&self, _layer: usize) -> Vec<f32> {
        Vec::new()
    }
    /// Replaces layer `layer`'s key shift (`n_kv_heads × head_dim` values, or empty for none;
    /// else refused). Only sound while the layer's cache holds no key a later step reads: keys
    /// stored under two shifts in one sequence would be scored inconsistently.
    fn set_kv_k_shift(&mut self, layer: usize, _shift: &[f32]) -> Result<(), BackendError> {
        Err(BackendError::Device(format!("{} has no FP8 KV key shift to set (layer {layer})", self.device_name())))
    }
    /// FP8 KV scale calibration (`--calculate-kv-scales`, see [`crate::kv_cache_dtype`]):
    /// from now on, each KV write into a layer `i` with `layers[i]` first sets that layer's
    /// scales from the write's own new K (as stored: rotated, normed) and V
    /// ([`crate::kv_cache_dtype::calibrated_scale`] of their amax over the step's rows), then
    /// quantizes with them. An empty `layers` stops it. Never called while a step is being
    /// recorded (calibration steps are prefill steps, which run op by op).
    fn calibrate_kv_scales(&mut self, layers: &[bool]) -> Result<(), BackendError> {
        if layers.is_empty() {
            return Ok(());
        }
        Err(BackendError::Device(format!("{} cannot calibrate FP8 KV scales", self.device_name())))
    }
    /// Marks the start of the op `label` for a step profile (see
    /// `CudaBackend::profile_begin`); a no-op unless the backend is profiling.
    fn mark(&mut self, _label: &'static str) {}

    /// Whether the backend implements the optional op `op` (checked when a model that needs
    /// it loads; see [`OptionalOp`]). The default implements none.
    fn supports(&self, _op: OptionalOp) -> bool {
        false
    }
    /// `x[r, h·d..(h+1)·d] = rms_norm(x[r, h·d..(h+1)·d]) * weight` for every row `r` and
    /// head `h` of `x`, rows of `heads × head_dim` values: RMSNorm over each head's
    /// `head_dim` values with one `head_dim`-long weight shared by all heads (Qwen3's
    /// q/k norm). The default [`Backend::split_qk_norm_rope_and_write_kv`] uses it; a backend
    /// that fuses the norm into its RoPE kernel (CUDA) need not have it.
    fn head_rms_norm(
        &mut self,
        _x: &mut Self::Buf,
        _weight: &Self::Buf,
        _head_dim: usize,
        _eps: f32,
    ) -> Result<(), BackendError> {
        Err(BackendError::Device(format!("{} has no per-head RMSNorm", self.device_name())))
    }

    /// [`Backend::split_rope_and_write_kv`] with q and k RMS-normalised per head before the
    /// rotation (Qwen3's `q_norm`/`k_norm`: `norms` = (q weight, k weight, eps), each weight
    /// `head_dim` long). Optional ([`OptionalOp::HeadRmsNorm`]); the default is
    /// [`Backend::split3`], [`Backend::head_rms_norm`] of q and of k, then
    /// [`Backend::rope_and_write_kv`].
    fn split_qk_norm_rope_and_write_kv(
        &mut self,
        layer: usize,
        qkv: &Self::Buf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        norms: (&Self::Buf, &Self::Buf, f32),
        out: (&mut Self::Buf, &mut Self::Buf, &mut Self::Buf),
    ) -> Result<(), BackendError> {
        let (q, k, v) = out;
        let head_dim = widths.0.checked_div(n_heads).unwrap_or(0);
        self.split3(qkv, widths, q, k, v)?;
        self.head_rms_norm(q, norms.0, head_dim, norms.2)?;
        self.head_rms_norm(k, norms.1, head_dim, norms.2)?;
        self.rope_and_write_kv(layer, q, k, v, n_heads, batch)
    }

    /// A mixture-of-experts MLP over `m` rows of `x` (the post-attention normed hidden
    /// states, `m × hidden`), into `out` (`m × hidden`, the branch [`Backend::add_rms_norm`]
    /// adds to the residual): the router's logits (kept in f32, plus the router's bias where
    /// it has one), each row's top-k experts and weights as `routing` says, every chosen
    /// expert's gated MLP (activation and biases as `w` says), and their weighted sum.
    /// Optional ([`OptionalOp::Moe`]); the default refuses.
    fn moe(
        &mut self,
        _x: &Self::Buf,
        _m: usize,
        _w: MoeWeights<'_, Self::Mat, Self::Buf>,
        _routing: MoeRouting,
        _out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        Err(BackendError::Device(format!("{} has no mixture-of-experts op", self.device_name())))
    }
    /// `out = rms_norm(x) * w` (or `* (1 + w)`, by `style`) of the residual stream `x`
    /// (optional: [`OptionalOp::GemmaNorms`]; the default refuses anything but `Plain`).
    fn rms_norm_styled(
        &mut self,
        x: &Self::Res,
        weight: &Self::Buf,
        eps: f32,
        style: NormWeight,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        match style {
            NormWeight::Plain => self.rms_norm(x, weight, eps, out),
            NormWeight::OnePlus => Err(self.missing(OptionalOp::GemmaNorms)),
        }
    }
    /// [`Backend::add_rms_norm`] with the weight applied by `style` (optional:
    /// [`OptionalOp::GemmaNorms`]; the default refuses anything but `Plain`).
    fn add_rms_norm_styled(
        &mut self,
        residual: &mut Self::Res,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        style: NormWeight,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        match style {
            NormWeight::Plain => self.add_rms_norm(residual, x, weight, eps, out),
            NormWeight::OnePlus => Err(self.missing(OptionalOp::GemmaNorms)),
        }
    }
    /// `out = rms_norm(x) * w` (or `* (1 + w)`) of an activation buffer `x` of rows as wide as
    /// `weight`: Gemma's norms after attention and after the MLP, before the residual add
    /// (optional: [`OptionalOp::GemmaNorms`]).
    fn buf_rms_norm(
        &mut self,
        _x: &Self::Buf,
        _weight: &Self::Buf,
        _eps: f32,
        _style: NormWeight,
        _out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::GemmaNorms))
    }
    /// [`Backend::split_qk_norm_rope_and_write_kv`] with the q/k norm weights applied by
    /// `style` (Gemma 3's `(1 + w)`). Optional ([`OptionalOp::GemmaNorms`] for `OnePlus`); the
    /// default passes `Plain` on and refuses `OnePlus`.
    fn split_qk_norm_rope_and_write_kv_styled(
        &mut self,
        layer: usize,
        qkv: &Self::Buf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        norms: (&Self::Buf, &Self::Buf, f32, NormWeight),
        out: (&mut Self::Buf, &mut Self::Buf, &mut Self::Buf),
    ) -> Result<(), BackendError> {
        match norms.3 {
            NormWeight::Plain => self.split_qk_norm_rope_and_write_kv(
                layer,
                qkv,
                widths,
                n_heads,
                batch,
                (norms.0, norms.1, norms.2),
                out,
            ),
            NormWeight::OnePlus => Err(self.missing(OptionalOp::GemmaNorms)),
        }
    }
    /// `x *= s` over the embedded rows of the residual stream, in the activation dtype (`s`
    /// and the products rounded where the backend stores activations narrower, as
    /// transformers multiplies Gemma's `√hidden` normalizer in the model dtype). Optional
    /// ([`OptionalOp::EmbedScale`]).
    fn scale_embedding(&mut self, _x: &mut Self::Res, _s: f32) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::EmbedScale))
    }
    /// `out = gelu_tanh(gate) * up` with rows `[gate | up]` of width `2d` (Gemma's GeGLU).
    /// Optional ([`OptionalOp::GeluTanhMul`]).
    fn gelu_tanh_mul(&mut self, _gate_up: &Self::Buf, _d: usize, _out: &mut Self::Buf) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::GeluTanhMul))
    }
    /// `x = cap · tanh(x / cap)` over every row of the last [`Backend::lm_head`] output
    /// (Gemma 2's final logit soft-capping), where the logits are. Optional
    /// ([`OptionalOp::LogitSoftcap`]).
    fn softcap_logits(&mut self, _cap: f32) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::LogitSoftcap))
    }
    /// [`Backend::attention`] with a sliding window and/or score soft-capping (`extras`), and
    /// with attention sinks when `sinks` is given (one logit per query head, `n_heads` long:
    /// an extra softmax column without a value, gpt-oss); keys outside a query's window are
    /// never read. Optional ([`OptionalOp::AttentionExtras`]).
    fn attention_ext(
        &mut self,
        _layer: usize,
        _q: &Self::Buf,
        _n_heads: usize,
        _scale: f32,
        _batch: &BatchLayout,
        _extras: AttentionExtras,
        _sinks: Option<&Self::Buf>,
        _out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::AttentionExtras))
    }
    /// Sets one rotary table per layer kind: layer `i` is rotated with
    /// `tables[layer_table[i]]` by `rope_and_write_kv` and its variants from then on (Gemma
    /// 3's local and global RoPE), instead of the one [`Backend::set_rope`] table. Optional
    /// ([`OptionalOp::LayerRope`]).
    fn set_layer_ropes(&mut self, _tables: Vec<RopeTable>, _layer_table: Vec<usize>) -> Result<(), BackendError> {
        Err(self.missing(OptionalOp::LayerRope))
    }
    /// The error of an optional op this backend lacks (only reached when a model skipped its
    /// load-time [`Backend::supports`] check).
    fn missing(&self, op: OptionalOp) -> BackendError {
        BackendError::Device(format!("{} has no {}", self.device_name(), op.name()))
    }

    /// Replaying recorded steps (CUDA graphs), on backends that record them; `None` elsewhere
    /// (every step runs op by op).
    fn graph_replay(&mut self) -> Option<&mut dyn GraphReplay> {
        None
    }
    /// Sampling where the logits are, on backends that can; `None` elsewhere (rows are
    /// downloaded and sampled on the host).
    fn device_sampler(&mut self) -> Option<&mut dyn DeviceSampler> {
        None
    }
    /// Copying KV blocks to and from host bytes (the TCP hand-off between workers), on
    /// backends that can; `None` elsewhere.
    fn kv_io(&mut self) -> Option<&mut dyn KvIo> {
        None
    }
    /// The device side of the KV cache, on backends that have one (CUDA), for connectors
    /// that move KV device to device; `None` elsewhere.
    fn kv_device(&mut self) -> Option<&mut dyn KvDeviceAccess> {
        None
    }
}

/// An op beyond the core set of [`Backend`] that some models need. A model checks
/// [`Backend::supports`] for each one it uses when it loads, and refuses the backend there
/// (naming the op) if it is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OptionalOp {
    /// q/k RMSNorm per head before RoPE: [`Backend::split_qk_norm_rope_and_write_kv`]
    /// (Qwen3's q/k norm).
    HeadRmsNorm,
    /// A routed mixture-of-experts MLP: [`Backend::moe`] (Qwen3-MoE, Mixtral).
    Moe,
    /// Gemma's norms: weights applied as `1 + w` ([`Backend::rms_norm_styled`],
    /// [`Backend::add_rms_norm_styled`], the q/k norm of
    /// [`Backend::split_qk_norm_rope_and_write_kv_styled`]) and norms of activation buffers
    /// ([`Backend::buf_rms_norm`]).
    GemmaNorms,
    /// [`Backend::scale_embedding`] (Gemma's `√hidden` embedding normalizer).
    EmbedScale,
    /// [`Backend::gelu_tanh_mul`] (GeGLU MLPs).
    GeluTanhMul,
    /// [`Backend::softcap_logits`] (final logit soft-capping).
    LogitSoftcap,
    /// [`Backend::attention_ext`] (sliding windows shorter than the context, score
    /// soft-capping, attention sinks).
    AttentionExtras,
    /// [`Backend::set_layer_ropes`] (a rotary table per layer kind).
    LayerRope,
}

impl OptionalOp {
    /// The op's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::HeadRmsNorm => "per-head RMSNorm (q/k norm)",
            Self::Moe => "mixture-of-experts MLP",
            Self::GemmaNorms => "RMSNorm with (1 + w) weights and of activation buffers (Gemma norms)",
            Self::EmbedScale => "embedding scale",
            Self::GeluTanhMul => "GELU-tanh gated MLP",
            Self::LogitSoftcap => "final logit soft-capping",
            Self::AttentionExtras => "attention with a sliding window, score soft-capping or sinks",
            Self::LayerRope => "rotary tables per layer kind",
        }
    }
}

/// One MoE layer's weights on a backend (see [`Backend::moe`]): matrices `M`, bias vectors
/// `V`. Expert `e`'s matrices are rows `e · rows_per_expert ..` of the stacked matrices, each
/// in the HF `[out, in]` layout, which is the layout the grouped expert kernels read.
#[derive(Debug)]
pub struct MoeWeights<'a, M, V> {
    /// The router (`gate`), `num_experts × hidden`.
    pub router: &'a M,
    /// The router's bias, `num_experts` (gpt-oss), added to its f32 logits.
    pub router_bias: Option<&'a V>,
    /// Every expert's gate and up rows, stacked: `num_experts · 2 · intermediate_size` rows of
    /// `hidden`, each expert's in the order `activation` reads them.
    pub gate_up: &'a M,
    /// Every expert's gate/up bias, `num_experts · 2 · intermediate_size`, in the rows' order.
    pub gate_up_bias: Option<&'a V>,
    /// Every expert's down projection, stacked: `num_experts · hidden` rows of `intermediate_size`.
    pub down: &'a M,
    /// Every expert's down bias, `num_experts · hidden`.
    pub down_bias: Option<&'a V>,
    /// Experts.
    pub num_experts: usize,
    /// Inner width of each expert.
    pub intermediate_size: usize,
    /// The experts' gated activation.
    pub activation: MoeActivation,
}

impl<M, V> Clone for MoeWeights<'_, M, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M, V> Copy for MoeWeights<'_, M, V> {}

/// The gated activation of an MoE layer's experts, and the order of their gate/up rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MoeActivation {
    /// `silu(gate) · up`; each expert's rows are its gate rows, then its up rows (Qwen3-MoE,
    /// Mixtral).
    SiluGated,
    /// gpt-oss's `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with `g = min(gate, limit)`;
    /// each expert's rows interleave gate and up (`gate_i` is row `2i`, `up_i` row `2i + 1`),
    /// as the checkpoint's `gate_up_proj` columns do.
    ClampedSwiglu {
        /// `swiglu_alpha`.
        alpha: f32,
        /// `swiglu_limit`.
        limit: f32,
    },
}

/// The gated MLP's activation and width ([`Backend::gated_linear`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// What is applied to the gate before it multiplies up.
    pub act: GateAct,
    /// The intermediate size: the width of gate, of up and of the output.
    pub d: usize,
}

/// The activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateAct {
    /// SwiGLU: `silu(gate) · up` (Llama, Qwen, Mistral, Phi).
    Silu,
    /// GeGLU with the tanh approximation: `gelu_tanh(gate) · up` (Gemma; an optional op,
    /// [`OptionalOp::GeluTanhMul`]).
    GeluTanh,
}

/// [`Backend::gated_linear`] as two ops: the product into `scratch`, then the activation
/// (each op marked for a step profile under its own name).
pub fn gated_linear_unfused<B: Backend + ?Sized>(
    b: &mut B,
    x: &B::Buf,
    m: usize,
    gate_up: &B::Mat,
    gate: Gate,
    scratch: &mut B::Buf,
    out: &mut B::Buf,
) -> Result<(), BackendError> {
    b.linear(x, m, gate_up, None, scratch)?;
    gate_activation(b, gate, scratch, out)
}

/// The gated MLP's activation on a computed `[gate | up]` (`gate_up`, `2 · gate.d` wide):
/// `out = act(gate) · up`, marked for a step profile under the activation's name.
pub fn gate_activation<B: Backend + ?Sized>(
    b: &mut B,
    gate: Gate,
    gate_up: &B::Buf,
    out: &mut B::Buf,
) -> Result<(), BackendError> {
    match gate.act {
        GateAct::Silu => {
            b.mark("silu_mul");
            b.silu_mul(gate_up, gate.d, out)
        }
        GateAct::GeluTanh => {
            b.mark("gelu_tanh_mul");
            b.gelu_tanh_mul(gate_up, gate.d, out)
        }
    }
}

/// What [`Backend::attention_ext`] adds to plain causal attention.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionExtras {
    /// The query at position `p` sees keys `j` with `p - window < j <= p` (the window counts
    /// the query itself, as transformers does); `None`: the whole causal context.
    pub window: Option<usize>,
    /// Each scaled score `s` becomes `cap · tanh(s / cap)` before the softmax.
    pub softcap: Option<f32>,
}

/// Replaying recorded decode steps (CUDA graphs). The runner offers a pure decode step with
/// [`GraphReplay::replay_rows`], pads it, and either replays a recording or records one.
pub trait GraphReplay {
    /// Rows a step of `batch` would be padded to for replay from a recording, or `None`
    /// when it must run op by op: steps that are not pure decode (one token per sequence,
    /// every row sampled in order), batches past the largest recorded size, recordings
    /// switched off.
    fn replay_rows(&self, batch: &BatchLayout) -> Option<usize>;
    /// Stages `padded` (a [`GraphReplay::replay_rows`]-sized batch whose first `real_rows`
    /// rows are real and the rest padding: no sequence, token 0, logits never read): uploads
    /// its per-step data, then replays the matching recording or asks for one. Until
    /// [`GraphReplay::finish_replay`], ops called with `padded` read the staged data.
    fn begin_replay(&mut self, padded: &BatchLayout, real_rows: usize) -> Result<ReplayStart, BackendError>;
    /// Starts recording the staged step's ops instead of running them.
    fn begin_recording(&mut self) -> Result<(), BackendError>;
    /// Ends a recording: keeps it for later replays when `ok` (every op succeeded), else
    /// discards it and runs this batch shape op by op from then on.
    fn end_recording(&mut self, ok: bool) -> Result<(), BackendError>;
    /// Ends the staged step (ops run op by op again).
    fn finish_replay(&mut self);
}

/// Sampling rows of the last [`Backend::lm_head`] output where they are (on the device).
pub trait DeviceSampler {
    /// Whether [`DeviceSampler::launch_device_sample`] can sample this row of a
    /// `vocab`-wide output exactly as `baton_core::sampling::sample` would; the runner
    /// downloads the rows it cannot and samples them on the host.
    fn can_sample_on_device(&self, vocab: usize, plan: &RowPlan) -> bool;
    /// Starts sampling rows of the last [`Backend::lm_head`] output, each given as
    /// `(row, plan)` with a plan that [`DeviceSampler::can_sample_on_device`] accepted, and
    /// returns without waiting for the answers.
    fn launch_device_sample(&mut self, rows: &[(usize, &RowPlan)]) -> Result<(), BackendError>;
    /// The answers of the last [`DeviceSampler::launch_device_sample`], one per row in order
    /// (waits for them); each launch is collected once.
    fn collect_device_sample(&mut self) -> Result<Vec<Sampled>, BackendError>;
}

/// Copying KV blocks of the paged cache to and from host bytes (see
/// [`Backend::kv_dtype`] for their element type).
pub trait KvIo {
    /// Copies layer `layer`'s K and V of `blocks`, in the given order, to host bytes (native
    /// byte order, each block `block_size × kv_heads × head_dim` elements). Used to hand a
    /// prompt's KV to another worker.
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError>;
    /// Writes bytes produced by `read_kv_blocks` on a cache of the same layout into `blocks`
    /// of layer `layer`, in order.
    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError>;
}

/// The device side of a backend's paged KV cache: the one capability a device-to-device KV
/// connector (a link) needs, and nothing of the model.
pub trait KvDeviceAccess {
    /// The stream the backend computes on.
    fn compute_stream(&self) -> std::sync::Arc<cudarc::driver::CudaStream>;
    /// A new stream on the backend's device, for one link's transfers (so they never queue
    /// behind, or block, compute).
    fn new_transfer_stream(&self) -> Result<std::sync::Arc<cudarc::driver::CudaStream>, BackendError>;
    /// Layer `layer`'s K and V caches, after checking every block of `runs` `(first, count)`
    /// is in the pool.
    fn layer_cache(&mut self, layer: usize, runs: &[(usize, usize)]) -> Result<LayerCache<'_>, BackendError>;
}

/// One layer's K and V caches on the device; block `b` is elements
/// `b * block_len .. (b + 1) * block_len` of each.
pub struct LayerCache<'a> {
    /// Keys.
    pub k: &'a mut cudarc::driver::CudaSlice<baton_kernels::cuda::bf16>,
    /// Values.
    pub v: &'a mut cudarc::driver::CudaSlice<baton_kernels::cuda::bf16>,
    /// Elements per block.
    pub block_len: usize,
}
