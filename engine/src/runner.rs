//! The model runner, written once for every architecture: it owns the backend and an
//! [`Architecture`], and runs a step around the architecture's forward: pending rows
//! (tokens the previous sampling picked and the host does not know yet), replay of recorded
//! decode steps with their padding, prompt logprobs, the LM head of the sampling rows,
//! sampling (launch and collect, on the device where the backend can), and the KV hand-off
//! (the KV connector's hook after each layer, host copies of KV blocks).
//!
//! One call to [`ModelRunner::forward_with`] runs a whole mixed batch (prefill chunks
//! and decode rows alike); [`ModelRunner::sample`] then picks the next tokens from the
//! logits it left in the backend (on the GPU for the CUDA backend). Sampling can also be
//! split in two ([`ModelRunner::sample_launch`], then [`ModelRunner::sample_collect`]) with
//! the next step's forward in between: that step's pending rows ([`BatchLayout::pending`])
//! embed the picks where they were made, the host's as known tokens, the device's on the
//! device.
//!
//! Invariants: capabilities the backend lacks ([`crate::backend::GraphReplay`],
//! [`crate::backend::DeviceSampler`]) are never required: steps then run op by op and
//! sample on the host. A sampling launch is collected at most once.

use crate::backend::{Backend, BackendError, BatchLayout, KvCacheShape, KvScale, PromptLogprobRow, ReplayStart};
use crate::kv_cache_dtype::KvCoding;
use crate::models::{Architecture, ModelLoadError, WeightLoader, build_architecture};
use baton_core::api::PromptLogprob;
use baton_core::sampling::{RowPlan, Sampled, SamplingContext, plan_row, sample_batch};
use baton_formats::{ModelConfig, WeightStore};

/// Where the pick of one row of the last sampling is.
#[derive(Debug, Clone, Copy)]
enum Pick {
    /// Sampled on the host: known.
    Host(u32),
    /// Row `i` of the backend's last device sampling.
    Device(usize),
}

/// A sampling launched and not yet collected.
struct LaunchedSample {
    /// The host-sampled answers, by row; `None` where the device samples.
    host: Vec<Option<Sampled>>,
}

/// A loaded model bound to a backend, ready to run steps.
pub struct ModelRunner<B: Backend> {
    arch: Box<dyn Architecture<B>>,
    backend: B,
    /// Logit rows the last step left in the backend.
    logit_count: usize,
    /// Where each row's pick of the last launched sampling is (for pending rows).
    picks: Vec<Pick>,
    /// The sampling launched and not yet collected.
    launched: Option<LaunchedSample>,
    /// The answers for the last step's [`BatchLayout::prompt_logprobs`], in order.
    prompt_logprobs: Vec<PromptLogprob>,
    /// FP8 KV scale calibration (`--calculate-kv-scales`): per layer, whether its scales are
    /// still to be set, by the first step with prefill tokens or, on a decode worker, by the
    /// first sender whose codes it stores. Empty when calibration is off.
    kv_calibrate: Vec<bool>,
    /// Whether a step has written keys into the cache since it was allocated or calibrated
    /// ([`ModelRunner::forget_written_keys`]): until then a received hand-off's key shift may
    /// be adopted rather than requantized ([`crate::kv_k_smoothing`]).
    keys_written: bool,
}

/// Most rows of vocabulary logits the LM head produces at once for prompt logprobs: a long
/// prompt's positions go through it in slices, so the logits buffer stays at most this many
/// rows (256 × 128k × 4 B = 128 MiB for a Llama-3 vocabulary).
pub const PROMPT_LOGPROB_SLICE: usize = 256;

/// What runs after each layer's KV is written during a forward (the KV connector's worker
/// side): the layer index and the cache.
pub type AfterLayer<'a> =
    dyn FnMut(usize, &mut dyn crate::kv_connector::KvAccess) -> Result<(), BackendError> + Send + 'a;

/// `batch` (pure decode: one row per sequence, every row sampled) padded with `rows - len`
/// rows of token 0 that belong to no sequence, every row a logit row.
fn padded_decode(batch: &BatchLayout, rows: usize) -> BatchLayout {
    let mut p = batch.clone();
    let n = rows.max(batch.tokens.len());
    p.tokens.resize(n, 0);
    p.positions.resize(n, 0);
    p.logit_rows = (0..n).collect();
    p
}

impl<B: Backend> ModelRunner<B> {
    /// Builds `cfg`'s architecture (see [`crate::models::registry`]) and loads every tensor
    /// from `store` into `backend` (random weights are drawn by the backend itself, see
    /// [`WeightStore::counter_init`]).
    pub fn load(cfg: &ModelConfig, store: &dyn WeightStore, mut backend: B) -> Result<Self, ModelLoadError> {
        let started = std::time::Instant::now();
        let mut w = WeightLoader::new(store).with_quantization(cfg.quantization.clone());
        let mut arch = build_architecture(cfg, &mut w, &mut backend)?;
        let upload = backend.finish_weights()?;
        log_weights(started.elapsed(), w.tensors_read(), upload);
        let at_load = cfg.quantization.as_ref().is_some_and(|q| q.source == baton_formats::QuantSource::AtLoad);
        if at_load && cfg.moe.is_some() {
            tracing::info!(
                "--quantization fp8 quantizes the attention and dense projections; the MoE experts stay bf16 (no FP8 grouped expert GEMM yet)"
            );
        }
        if w.experts_dequantized() > 0 {
            tracing::info!(
                matrices = w.experts_dequantized(),
                "FP8 MoE experts dequantized to bf16 at load (no FP8 grouped expert GEMM yet)"
            );
        }
        arch.prepare(&mut backend)?;
        Ok(Self {
            arch,
            backend,
            logit_count: 0,
            picks: Vec::new(),
            launched: None,
            prompt_logprobs: Vec::new(),
            kv_calibrate: Vec::new(),
            keys_written: false,
        })
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.arch.config().num_hidden_layers
    }

    /// `(head_dim, num_key_value_heads)`: the shape of one token's keys in a layer.
    pub fn key_geometry(&self) -> (usize, usize) {
        let cfg = self.arch.config();
        (cfg.head_dim, cfg.num_key_value_heads)
    }

    /// Layer `layer`'s rotary table as its keys are rotated
    /// ([`Architecture::key_rope`]).
    pub fn key_rope(&self, layer: usize) -> Result<baton_kernels::cpu::RopeTable, BackendError> {
        self.arch.key_rope(layer)
    }

    /// What in the model's attention would see a key shift
    /// ([`Architecture::key_shift_blocker`]).
    pub fn key_shift_blocker(&self) -> Option<&'static str> {
        self.arch.key_shift_blocker()
    }

    /// Layer `layer`'s FP8 key shift in use (empty: none; see [`crate::kv_k_smoothing`]).
    pub fn kv_k_shift(&self, layer: usize) -> Vec<f32> {
        self.backend.kv_k_shift(layer)
    }

    /// Sets layer `layer`'s FP8 key shift ([`Backend::set_kv_k_shift`]); only sound while no
    /// stored key a later step reads was written under another.
    pub fn set_kv_k_shift(&mut self, layer: usize, shift: &[f32]) -> Result<(), BackendError> {
        self.backend.set_kv_k_shift(layer, shift)
    }

    /// Declares the cache's keys unread from now on (after [`crate::kv_k_smoothing::calibrate`]'s
    /// prefill: its blocks are free again), so the first hand-off may still set the shift.
    pub fn forget_written_keys(&mut self) {
        self.keys_written = false;
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.arch.config()
    }

    /// The backend (for device queries such as free memory).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (benchmarks fill the KV cache through it).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The backend's device name.
    pub fn device_name(&self) -> String {
        self.backend.device_name()
    }

    /// Allocates the paged KV cache for `num_blocks` blocks of `block_size` tokens.
    pub fn alloc_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), BackendError> {
        let shape = self.kv_shape(num_blocks, block_size);
        self.backend.alloc_kv_cache(shape)?;
        // A new cache holds no key any step will read.
        self.keys_written = false;
        Ok(())
    }

    /// Writes received K/V bytes into `blocks` of layer `layer` (see
    /// [`crate::backend::KvIo::write_kv_blocks`]).
    pub fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        kv_io(&mut self.backend)?.write_kv_blocks(layer, blocks, k, v)
    }

    /// The FP8 KV cache's scales in use, one per layer (empty when the cache is not FP8).
    pub fn kv_scales(&self) -> Vec<KvScale> {
        self.backend.kv_scales()
    }

    /// Turns on FP8 KV scale calibration (`--calculate-kv-scales`, see
    /// [`crate::kv_cache_dtype`]): the first step with prefill tokens sets every layer's
    /// scales from its own K and V, replacing the checkpoint's; they are fixed from then on.
    /// Call it after any profiling step (that step's dummy tokens must not calibrate).
    /// Refused unless the cache is FP8.
    pub fn calculate_kv_scales(&mut self) -> Result<(), ModelLoadError> {
        let dtype = self.backend.kv_dtype();
        if dtype != baton_core::kv_transfer::KvDtype::Fp8E4M3 {
            return Err(
                crate::kv_cache_dtype::KvScaleError::CalibrationWithoutFp8 { dtype: format!("{dtype:?}") }.into()
            );
        }
        self.kv_calibrate = vec![true; self.arch.config().num_hidden_layers];
        tracing::info!(
            k_constant = crate::kv_cache_dtype::K_SCALE_CONSTANT,
            v_constant = crate::kv_cache_dtype::V_SCALE_CONSTANT,
            "FP8 KV scales will be calculated from the first prefill step (replacing any from the checkpoint)"
        );
        Ok(())
    }

    /// Whether some layer's FP8 KV scales still wait for their calibration.
    pub fn kv_scales_pending(&self) -> bool {
        self.kv_calibrate.iter().any(|&c| c)
    }

    /// Element type of the backend's KV cache.
    pub fn kv_dtype(&self) -> baton_core::kv_transfer::KvDtype {
        self.backend.kv_dtype()
    }

    /// The KV cache geometry for a pool of `num_blocks` blocks.
    pub fn kv_shape(&self, num_blocks: usize, block_size: usize) -> KvCacheShape {
        let cfg = self.arch.config();
        KvCacheShape {
            num_layers: cfg.num_hidden_layers,
            num_blocks,
            block_size,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype: self.backend.kv_dtype(),
        }
    }

    /// Chooses the KV cache's element type (before [`ModelRunner::alloc_kv_cache`]): `dtype`
    /// resolved against the backend's own, with the checkpoint's FP8 scales from `store`
    /// when it is FP8 (see [`crate::kv_cache_dtype`]). Refused where the backend cannot
    /// store it or a scale is bad.
    pub fn set_kv_cache_dtype(
        &mut self,
        dtype: crate::kv_cache_dtype::KvCacheDtype,
        store: &dyn WeightStore,
    ) -> Result<(), ModelLoadError> {
        let resolved = dtype.resolve(self.backend.kv_dtype());
        // Windows, soft-caps and sinks (Gemma, gpt-oss) read an FP8 cache too: the CPU
        // reference's `paged_attention_fp8` and, on CUDA, the tuned kernels' FP8 entries with
        // their options (or `AttentionExtFp8Call` for other head dims).
        let scales = if resolved == baton_core::kv_transfer::KvDtype::Fp8E4M3 {
            crate::kv_cache_dtype::load_kv_scales(store, self.arch.config().num_hidden_layers)?
        } else {
            Vec::new()
        };
        Ok(self.backend.set_kv_cache_dtype(resolved, scales)?)
    }

    /// Runs one step and returns `batch.logit_rows.len() × vocab` logits, row-major.
    pub fn forward(&mut self, batch: &BatchLayout) -> Result<Vec<f32>, BackendError> {
        self.forward_with(batch, None)?;
        let rows: Vec<usize> = (0..self.logit_count).collect();
        self.backend.logit_rows(&rows)
    }

    /// The prompt logprobs the last step computed, one per entry of its batch's
    /// [`BatchLayout::prompt_logprobs`], in order (empty after a step that asked for none).
    pub fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprob> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// Samples the logits of the last step, row `i` with `ctxs[i]` (one context per logit
    /// row), exactly as `baton_core::sampling::sample_batch` would. Rows the backend can
    /// sample where the logits are (the CUDA backend) never come to the host; the others
    /// are downloaded and sampled on the CPU.
    pub fn sample(&mut self, ctxs: &[SamplingContext<'_>]) -> Result<Vec<Sampled>, BackendError> {
        if ctxs.len() != self.logit_count {
            return Err(kernel_error(
                "sample",
                format!("{} sampling contexts for {} logit rows", ctxs.len(), self.logit_count),
            ));
        }
        let rows: Vec<(usize, SamplingContext<'_>)> = ctxs.iter().copied().enumerate().collect();
        self.sample_launch(&rows)?;
        self.sample_collect()
    }

    /// Starts [`ModelRunner::sample`] for some logit rows of the last step, each given as
    /// `(logit row, context)` in increasing row order: the device's share is enqueued, the
    /// host's is sampled now. [`ModelRunner::sample_collect`] returns one answer per entry.
    /// Until the next launch, a step's pending row `(row, i)` embeds the pick for entry `i`.
    pub fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError> {
        self.launched = None;
        self.picks.clear();
        if !rows.windows(2).all(|w| w[0].0 < w[1].0) || rows.last().is_some_and(|r| r.0 >= self.logit_count) {
            return Err(kernel_error("sample", format!("logit rows not increasing below {}", self.logit_count)));
        }
        let vocab = self.arch.config().vocab_size;
        let plans: Vec<Option<RowPlan>> = rows
            .iter()
            .map(|(_, ctx)| {
                let plan = plan_row(ctx, vocab);
                let on_device = self.backend.device_sampler().is_some_and(|s| s.can_sample_on_device(vocab, &plan));
                on_device.then_some(plan)
            })
            .collect();
        let on_host: Vec<usize> = (0..rows.len()).filter(|&i| plans[i].is_none()).collect();
        let mut host: Vec<Option<Sampled>> = vec![None; rows.len()];
        if !on_host.is_empty() {
            let logit_rows: Vec<usize> = on_host.iter().map(|&i| rows[i].0).collect();
            let mut logits = self.backend.logit_rows(&logit_rows)?;
            let host_ctxs: Vec<SamplingContext<'_>> = on_host.iter().map(|&i| rows[i].1).collect();
            for (&i, pick) in on_host.iter().zip(sample_batch(&mut logits, vocab, &host_ctxs)) {
                host[i] = Some(pick);
            }
        }
        let on_device: Vec<(usize, &RowPlan)> =
            plans.iter().zip(rows).filter_map(|(p, (row, _))| p.as_ref().map(|p| (*row, p))).collect();
        if !on_device.is_empty() {
            device_sampler(&mut self.backend)?.launch_device_sample(&on_device)?;
        }
        let mut next_device = 0;
        self.picks = host
            .iter()
            .map(|h| match h {
                Some(s) => Pick::Host(s.token_id),
                None => {
                    next_device += 1;
                    Pick::Device(next_device - 1)
                }
            })
            .collect();
        self.launched = Some(LaunchedSample { host });
        Ok(())
    }

    /// The answers of the last [`ModelRunner::sample_launch`], one per entry in order (waits
    /// for the device's share). Each launch is collected once.
    pub fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError> {
        let LaunchedSample { host } =
            self.launched.take().ok_or_else(|| kernel_error("sample", "no sampling was launched".into()))?;
        let mut device = if host.iter().any(Option::is_none) {
            device_sampler(&mut self.backend)?.collect_device_sample()?.into_iter()
        } else {
            Vec::new().into_iter()
        };
        host.into_iter()
            .map(|h| {
                h.or_else(|| device.next())
                    .ok_or_else(|| BackendError::Device("the device sampler returned too few rows".into()))
            })
            .collect()
    }

    /// `batch` with its pending rows that the host picked filled in; the rest stay pending,
    /// renumbered as rows of the backend's device sampling. `None` when `batch` is right as it
    /// is (nothing pending, or every pick made on the device with no host pick before it, the
    /// CUDA case), so the common step copies nothing.
    fn resolve_pending(&self, batch: &BatchLayout) -> Result<Option<BatchLayout>, BackendError> {
        let as_is = batch.pending.iter().all(|&(_, i)| matches!(self.picks.get(i), Some(Pick::Device(k)) if *k == i));
        if as_is {
            return Ok(None);
        }
        let mut b = batch.clone();
        b.pending.clear();
        for &(row, i) in &batch.pending {
            let bad = || kernel_error("embed", format!("pending row {row} names pick {i} of {}", self.picks.len()));
            match (self.picks.get(i), b.tokens.get_mut(row)) {
                (Some(Pick::Host(t)), Some(slot)) => *slot = *t,
                (Some(Pick::Device(k)), Some(_)) => b.pending.push((row, *k)),
                _ => return Err(bad()),
            }
        }
        Ok(Some(b))
    }

    /// [`ModelRunner::forward`] that leaves the logits in the backend (for
    /// [`ModelRunner::sample`]) and, with `after_layer`, calls it as soon as each layer has
    /// written its KV, in layer order, while later layers are still to run: this is how a
    /// prefill worker's KV connector streams a prompt's KV during the step that computes it.
    /// A step with `after_layer` always runs op by op (never from a recording).
    pub fn forward_with(
        &mut self,
        batch: &BatchLayout,
        after_layer: Option<&mut AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        self.logit_count = 0;
        self.prompt_logprobs.clear();
        self.keys_written = true;
        let resolved = self.resolve_pending(batch)?;
        let batch = resolved.as_ref().unwrap_or(batch);
        if self.kv_scales_pending() && has_prefill(batch) {
            return self.calibrating_step(batch, after_layer);
        }
        if after_layer.is_none()
            && batch.prompt_logprobs.is_empty()
            && let Some(rows) = self.backend.graph_replay().and_then(|g| g.replay_rows(batch))
        {
            let padded = padded_decode(batch, rows);
            let real = batch.tokens.len();
            let done = self.replay(&padded, real);
            if let Some(g) = self.backend.graph_replay() {
                g.finish_replay();
            }
            if done? {
                self.logit_count = batch.logit_rows.len();
                return Ok(());
            }
        }
        self.run_ops(batch, after_layer)
    }

    /// The FP8 KV scale calibration step: `batch` op by op (never replayed or recorded) with
    /// the backend setting each pending layer's scales before its KV write. On success the
    /// scales are fixed; a failed step leaves calibration pending for the next prefill.
    fn calibrating_step(
        &mut self,
        batch: &BatchLayout,
        after_layer: Option<&mut AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        self.backend.calibrate_kv_scales(&self.kv_calibrate)?;
        let ran = self.run_ops(batch, after_layer);
        let stopped = self.backend.calibrate_kv_scales(&[]);
        ran?;
        stopped?;
        let scales = self.backend.kv_scales();
        for (layer, s) in scales.iter().enumerate().filter(|(i, _)| self.kv_calibrate.get(*i) == Some(&true)) {
            tracing::debug!(layer, k_scale = s.k, v_scale = s.v, "FP8 KV scales calculated");
        }
        let (k_max, v_max) = scales.iter().fold((0.0f32, 0.0f32), |(k, v), s| (k.max(s.k), v.max(s.v)));
        tracing::info!(
            layers = scales.len(),
            rows = batch.tokens.len(),
            k_scale_max = k_max,
            v_scale_max = v_max,
            "FP8 KV scales calculated from the first prefill step; fixed from now on"
        );
        self.kv_calibrate.fill(false);
        Ok(())
    }

    /// Runs a padded decode step from a recording, recording it first if needed; `false` when
    /// the backend declined (the caller runs the step op by op).
    fn replay(&mut self, padded: &BatchLayout, real_rows: usize) -> Result<bool, BackendError> {
        let Some(g) = self.backend.graph_replay() else { return Ok(false) };
        match g.begin_replay(padded, real_rows)? {
            ReplayStart::Eager => Ok(false),
            ReplayStart::Replayed => Ok(true),
            ReplayStart::Record => {
                // This pass computes the step (and grows every buffer to this shape, so the
                // recording pass allocates nothing); the recording pass only records.
                self.run_ops(padded, None)?;
                graph_replay(&mut self.backend)?.begin_recording()?;
                let recorded = self.run_ops(padded, None);
                graph_replay(&mut self.backend)?.end_recording(recorded.is_ok())?;
                if let Err(e) = recorded {
                    tracing::warn!(rows = padded.tokens.len(), error = %e, "a decode step could not be recorded; this shape runs op by op");
                }
                Ok(true)
            }
        }
    }

    /// The step's ops, one by one (see [`ModelRunner::forward_with`]).
    fn run_ops(
        &mut self,
        batch: &BatchLayout,
        mut after_layer: Option<&mut AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        self.logit_count = 0;
        if batch.tokens.is_empty() {
            return Ok(());
        }
        let b = &mut self.backend;
        let arch = &mut self.arch;
        arch.forward_layers(b, batch, &mut |b: &mut B, i: usize| match after_layer.as_deref_mut() {
            Some(after) => {
                b.mark("kv_export");
                after(i, b)
            }
            None => Ok(()),
        })?;
        if !batch.prompt_logprobs.is_empty() {
            // Before the sampling rows: the LM head output below must be theirs.
            b.mark("prompt_logprobs");
            self.prompt_logprobs = prompt_logprobs(b, arch.as_mut(), &batch.prompt_logprobs)?;
        }
        let rows = &batch.logit_rows;
        if rows.is_empty() {
            return Ok(());
        }
        arch.logits(b, rows, true)?;
        self.logit_count = rows.len();
        Ok(())
    }
}

/// The prompt logprobs of `rows` after the last layer (the architecture's activations are
/// kept): final norm and LM head over at most [`PROMPT_LOGPROB_SLICE`] rows at a time, then
/// each row's target logprob and top alternatives from the backend, truncated to the row's
/// own `top_k`.
fn prompt_logprobs<B: Backend>(
    b: &mut B,
    arch: &mut dyn Architecture<B>,
    rows: &[PromptLogprobRow],
) -> Result<Vec<PromptLogprob>, BackendError> {
    let mut out = Vec::with_capacity(rows.len());
    for slice in rows.chunks(PROMPT_LOGPROB_SLICE) {
        let idx: Vec<usize> = slice.iter().map(|r| r.row).collect();
        let targets: Vec<u32> = slice.iter().map(|r| r.target).collect();
        let k = slice.iter().map(|r| r.top_k).max().unwrap_or(0);
        arch.logits(b, &idx, false)?;
        let answers = b.logit_row_logprobs(&targets, k)?;
        if answers.len() != slice.len() {
            return Err(kernel_error("prompt_logprobs", format!("{} answers for {} rows", answers.len(), slice.len())));
        }
        out.extend(answers.into_iter().zip(slice).map(|(mut a, r)| {
            a.top.truncate(r.top_k);
            a
        }));
    }
    Ok(out)
}

/// The cache as the KV connector sees it: the backend's, except that a received layer whose
/// calibration is still pending adopts the sender's FP8 scales (then fixed) rather than
/// being requantized into scales no prefill has set yet.
impl<B: Backend> crate::kv_connector::KvAccess for ModelRunner<B> {
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError> {
        kv_io(&mut self.backend)?.read_kv_blocks(layer, blocks)
    }

    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        kv_io(&mut self.backend)?.write_kv_blocks(layer, blocks, k, v)
    }

    fn device(&mut self) -> Option<&mut dyn crate::backend::KvDeviceAccess> {
        self.backend.kv_device()
    }

    fn kv_coding(&self, layer: usize) -> Option<KvCoding> {
        crate::kv_connector::KvAccess::kv_coding(&self.backend, layer)
    }

    fn import_kv_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        k: &[u8],
        v: &[u8],
        sender: Option<&KvCoding>,
    ) -> Result<(), BackendError> {
        if let Some(sent) = sender
            && self.kv_calibrate.get(layer).copied().unwrap_or(false)
        {
            self.backend.set_kv_scale(layer, sent.scale)?;
            self.kv_calibrate[layer] = false;
            let (k_scale, v_scale) = (sent.scale.k, sent.scale.v);
            tracing::info!(layer, k_scale, v_scale, "FP8 KV scales adopted from a prefill worker");
        }
        if let Some(sent) = sender
            && !self.keys_written
            && sent.k_shift != self.backend.kv_k_shift(layer)
        {
            self.backend.set_kv_k_shift(layer, &sent.k_shift)?;
            tracing::debug!(layer, "FP8 KV key shift adopted from a prefill worker (no key stored yet)");
        }
        crate::kv_connector::write_in_own_coding(self, layer, blocks, (k, v), sender)
    }
}

/// Whether `batch` has prefill tokens: a chunk of more than one token, or one that starts a
/// sequence (a one-token prompt). A decode row is one token after others.
fn has_prefill(batch: &BatchLayout) -> bool {
    batch.seqs.iter().any(|s| s.n_tokens > 1 || (s.n_tokens == 1 && s.start_pos == 0))
}

/// The backend's KV I/O, or an error naming the missing capability.
fn kv_io<B: Backend>(b: &mut B) -> Result<&mut dyn crate::backend::KvIo, BackendError> {
    let name = b.device_name();
    b.kv_io().ok_or_else(|| BackendError::Device(format!("{name} cannot copy KV blocks to or from the host")))
}

/// The backend's device sampler; only asked for where it was offered rows, so its absence
/// is a bug in the caller.
fn device_sampler<B: Backend>(b: &mut B) -> Result<&mut dyn crate::backend::DeviceSampler, BackendError> {
    let name = b.device_name();
    b.device_sampler().ok_or_else(|| BackendError::Device(format!("{name} cannot sample on a device")))
}

/// The backend's graph replay; only asked for after it staged a step.
fn graph_replay<B: Backend>(b: &mut B) -> Result<&mut dyn crate::backend::GraphReplay, BackendError> {
    let name = b.device_name();
    b.graph_replay().ok_or_else(|| BackendError::Device(format!("{name} cannot record steps")))
}

/// Logs the weights phase of start-up: wall time, and for streamed uploads the bytes, the
/// rate and how the time split between reading and waiting for the device.
fn log_weights(elapsed: std::time::Duration, tensors: usize, upload: Option<crate::backend::WeightUploadReport>) {
    let ms = elapsed.as_secs_f64() * 1e3;
    match upload {
        Some(u) => tracing::info!(
            phase = "weights",
            ms = format_args!("{ms:.0}"),
            tensors,
            gb = format_args!("{:.2}", u.bytes_read as f64 / 1e9),
            gb_per_s = format_args!("{:.2}", u.bytes_read as f64 / 1e9 / elapsed.as_secs_f64().max(1e-9)),
            read_ms = format_args!("{:.0}", u.read_s * 1e3),
            upload_wait_ms = format_args!("{:.0}", u.wait_s * 1e3),
            "startup phase"
        ),
        None if tensors == 0 => {
            tracing::info!(phase = "weights", ms = format_args!("{ms:.0}"), drawn = true, "startup phase")
        }
        None => tracing::info!(phase = "weights", ms = format_args!("{ms:.0}"), tensors, "startup phase"),
    }
}

fn kernel_error(op: &'static str, message: String) -> BackendError {
    BackendError::Kernel(baton_kernels::cpu::KernelError { op, message })
}
