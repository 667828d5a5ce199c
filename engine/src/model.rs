//! The Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2 with q/k/v
//! biases, SmolLM2), written once over the [`Backend`] ops.
//!
//! Weights are loaded by name from a `baton_formats::WeightStore` (always in
//! Hugging Face naming and layout) and fused where it saves GEMM launches:
//! `[q; k; v]` into one matrix and `[gate; up]` into another. One call to
//! [`LlamaModel::forward`] runs a whole mixed batch (prefill chunks and decode
//! rows alike); [`LlamaModel::sample`] then picks the next tokens from the logits
//! it left in the backend (on the GPU for the CUDA backend).
//!
//! Sampling can also be split in two ([`LlamaModel::sample_launch`], then
//! [`LlamaModel::sample_collect`]) with the next step's forward in between: that step's
//! pending rows ([`BatchLayout::pending`]) embed the picks where they were made, the host's
//! as known tokens, the device's on the device.

use crate::backend::{Backend, BackendError, BatchLayout, KvCacheShape, PromptLogprobRow, ReplayStart};
use baton_core::api::PromptLogprob;
use baton_core::sampling::{RowPlan, Sampled, SamplingContext, plan_row, sample_batch};
use baton_formats::{ModelConfig, RopeScaling, TensorView, WeightStore};
use baton_kernels::cpu::{RopeScalingKind, RopeTable};

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
    /// The backend refused an upload.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attn_norm: B::Buf,
    qkv: B::Mat,
    qkv_bias: Option<B::Buf>,
    o: B::Mat,
    gate_up: B::Mat,
    down: B::Mat,
}

/// Activation buffers reused across steps (resized per batch).
struct Workspace<B: Backend> {
    residual: B::Res,
    hidden: B::Buf,
    qkv: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    proj: B::Buf,
    gate_up: B::Buf,
    act: B::Buf,
    last: B::Buf,
    last_res: B::Res,
}

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

/// A loaded model bound to a backend.
pub struct LlamaModel<B: Backend> {
    cfg: ModelConfig,
    embed: B::Mat,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Mat>,
    final_norm: B::Buf,
    layers: Vec<Layer<B>>,
    ws: Workspace<B>,
    backend: B,
    /// Logit rows the last step left in the backend.
    logit_count: usize,
    /// Where each row's pick of the last launched sampling is (for pending rows).
    picks: Vec<Pick>,
    /// The sampling launched and not yet collected.
    launched: Option<LaunchedSample>,
    /// The answers for the last step's [`BatchLayout::prompt_logprobs`], in order.
    prompt_logprobs: Vec<PromptLogprob>,
}

/// Most rows of vocabulary logits the LM head produces at once for prompt logprobs: a long
/// prompt's positions go through it in slices, so the logits buffer stays at most this many
/// rows (256 × 128k × 4 B = 128 MiB for a Llama-3 vocabulary).
pub const PROMPT_LOGPROB_SLICE: usize = 256;

fn rope_kind(s: &Option<RopeScaling>) -> RopeScalingKind {
    match s {
        None => RopeScalingKind::None,
        Some(RopeScaling::Linear { factor }) => RopeScalingKind::Linear { factor: *factor },
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            RopeScalingKind::Llama3 {
                factor: *factor,
                low_freq_factor: *low_freq_factor,
                high_freq_factor: *high_freq_factor,
                original_max_position_embeddings: *original_max_position_embeddings,
            }
        }
    }
}

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

/// The model's tensors, read from a store or drawn by the backend: each call takes named
/// tensors of `rows × cols` (vectors: `cols` 1) and stacks them by rows into one matrix or
/// vector (the fused `[q; k; v]` and `[gate; up]`).
struct Tensors<'a> {
    store: &'a dyn WeightStore,
    /// Tensors read from the store so far.
    read: usize,
}

impl<'a> Tensors<'a> {
    fn mat<B: Backend>(&mut self, b: &mut B, names: &[(String, usize)], cols: usize) -> Result<B::Mat, ModelLoadError> {
        if let Some(parts) = self.drawn(names, cols)? {
            return Ok(b.random_mat(&parts, cols)?);
        }
        let rows = names.iter().map(|n| n.1).sum();
        Ok(b.upload_mat_raw(&self.views(names, cols)?, rows, cols)?)
    }

    fn vec<B: Backend>(&mut self, b: &mut B, names: &[(String, usize)]) -> Result<B::Buf, ModelLoadError> {
        if let Some(parts) = self.drawn(names, 1)? {
            return Ok(b.random_vec(&parts)?);
        }
        Ok(b.upload_vec_raw(&self.views(names, 1)?)?)
    }

    /// The stored tensors `names`, each checked to hold `rows × cols` elements.
    fn views(&mut self, names: &[(String, usize)], cols: usize) -> Result<Vec<TensorView<'a>>, ModelLoadError> {
        let store = self.store;
        let views = names
            .iter()
            .map(|(name, rows)| {
                let t = store.get(name)?;
                let want = rows * cols;
                // The element count from the shape, and from the bytes (what a device upload reads).
                for got in [t.numel(), t.bytes.len() / t.dtype.size()] {
                    if got != want {
                        return Err(ModelLoadError::Shape { name: name.clone(), got, want });
                    }
                }
                Ok(t)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.read += views.len();
        Ok(views)
    }

    /// The counter draws of `names` when the store draws every one of them (random weights),
    /// checked against the expected shapes; `None` for stored weights.
    fn drawn(
        &self,
        names: &[(String, usize)],
        cols: usize,
    ) -> Result<Option<Vec<(usize, baton_formats::CounterInit)>>, ModelLoadError> {
        let mut parts = Vec::with_capacity(names.len());
        for (name, rows) in names {
            let Some(init) = self.store.counter_init(name) else { return Ok(None) };
            let got: usize = self.store.shape(name)?.iter().product();
            if got != rows * cols {
                return Err(ModelLoadError::Shape { name: name.clone(), got, want: rows * cols });
            }
            parts.push((*rows, init));
        }
        Ok(Some(parts))
    }
}

impl<B: Backend> LlamaModel<B> {
    /// Loads every tensor of `cfg` from `store` into `backend` (random weights are drawn by
    /// the backend itself, see [`WeightStore::counter_init`]).
    pub fn load(cfg: &ModelConfig, store: &dyn WeightStore, mut backend: B) -> Result<Self, ModelLoadError> {
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let qd = cfg.num_attention_heads * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let inter = cfg.intermediate_size;
        let started = std::time::Instant::now();
        let mut w = Tensors { store, read: 0 };
        let b = &mut backend;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(w.mat(b, &[("lm_head.weight".into(), cfg.vocab_size)], h)?)
        };
        let embed = w.mat(b, &[("model.embed_tokens.weight".into(), cfg.vocab_size)], h)?;
        let final_norm = w.vec(b, &[("model.norm.weight".into(), h)])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = |n: &str, rows: usize| (format!("{p}.self_attn.{n}"), rows);
            let qkv_bias = if cfg.attention_bias {
                Some(w.vec(b, &[attn("q_proj.bias", qd), attn("k_proj.bias", kvd), attn("v_proj.bias", kvd)])?)
            } else {
                None
            };
            layers.push(Layer {
                input_norm: w.vec(b, &[(format!("{p}.input_layernorm.weight"), h)])?,
                post_attn_norm: w.vec(b, &[(format!("{p}.post_attention_layernorm.weight"), h)])?,
                qkv: w.mat(
                    b,
                    &[attn("q_proj.weight", qd), attn("k_proj.weight", kvd), attn("v_proj.weight", kvd)],
                    h,
                )?,
                qkv_bias,
                o: w.mat(b, &[attn("o_proj.weight", h)], qd)?,
                gate_up: w.mat(
                    b,
                    &[(format!("{p}.mlp.gate_proj.weight"), inter), (format!("{p}.mlp.up_proj.weight"), inter)],
                    h,
                )?,
                down: w.mat(b, &[(format!("{p}.mlp.down_proj.weight"), h)], inter)?,
            });
        }
        let upload = backend.finish_weights()?;
        log_weights(started.elapsed(), w.read, upload);
        backend
            .set_rope(RopeTable::new(hd, cfg.rope_theta, rope_kind(&cfg.rope_scaling)).map_err(BackendError::from)?)?;
        let ws = Workspace {
            residual: backend.alloc_res(0)?,
            hidden: backend.alloc(0)?,
            qkv: backend.alloc(0)?,
            q: backend.alloc(0)?,
            k: backend.alloc(0)?,
            v: backend.alloc(0)?,
            attn: backend.alloc(0)?,
            proj: backend.alloc(0)?,
            gate_up: backend.alloc(0)?,
            act: backend.alloc(0)?,
            last: backend.alloc(0)?,
            last_res: backend.alloc_res(0)?,
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            lm_head,
            final_norm,
            layers,
            ws,
            backend,
            logit_count: 0,
            picks: Vec::new(),
            launched: None,
            prompt_logprobs: Vec::new(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
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
        self.backend.alloc_kv_cache(shape)
    }

    /// Writes received K/V bytes into `blocks` of layer `layer` (see [`Backend::write_kv_blocks`]).
    pub fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        self.backend.write_kv_blocks(layer, blocks, k, v)
    }

    /// Element type of the backend's KV cache.
    pub fn kv_dtype(&self) -> baton_core::kv_transfer::KvDtype {
        self.backend.kv_dtype()
    }

    /// The KV cache geometry for a pool of `num_blocks` blocks.
    pub fn kv_shape(&self, num_blocks: usize, block_size: usize) -> KvCacheShape {
        KvCacheShape {
            num_layers: self.cfg.num_hidden_layers,
            num_blocks,
            block_size,
            num_kv_heads: self.cfg.num_key_value_heads,
            head_dim: self.cfg.head_dim,
        }
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

    /// Starts [`LlamaModel::sample`] for some logit rows of the last step, each given as
    /// `(logit row, context)` in increasing row order: the device's share is enqueued, the
    /// host's is sampled now. [`LlamaModel::sample_collect`] returns one answer per entry.
    /// Until the next launch, a step's pending row `(row, i)` embeds the pick for entry `i`.
    pub fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError> {
        self.launched = None;
        self.picks.clear();
        if !rows.windows(2).all(|w| w[0].0 < w[1].0) || rows.last().is_some_and(|r| r.0 >= self.logit_count) {
            return Err(kernel_error("sample", format!("logit rows not increasing below {}", self.logit_count)));
        }
        let vocab = self.cfg.vocab_size;
        let plans: Vec<Option<RowPlan>> = rows
            .iter()
            .map(|(_, ctx)| {
                let plan = plan_row(ctx, vocab);
                self.backend.can_sample_on_device(vocab, &plan).then_some(plan)
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
            self.backend.launch_device_sample(&on_device)?;
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

    /// The answers of the last [`LlamaModel::sample_launch`], one per entry in order (waits
    /// for the device's share). Each launch is collected once.
    pub fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError> {
        let LaunchedSample { host } =
            self.launched.take().ok_or_else(|| kernel_error("sample", "no sampling was launched".into()))?;
        let mut device = if host.iter().any(Option::is_none) {
            self.backend.collect_device_sample()?.into_iter()
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

    /// [`LlamaModel::forward`] that leaves the logits in the backend (for
    /// [`LlamaModel::sample`]) and, with `after_layer`, calls it as soon as each layer has
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
        let resolved = self.resolve_pending(batch)?;
        let batch = resolved.as_ref().unwrap_or(batch);
        if after_layer.is_none()
            && batch.prompt_logprobs.is_empty()
            && let Some(rows) = self.backend.replay_rows(batch)
        {
            let padded = padded_decode(batch, rows);
            let real = batch.tokens.len();
            let done = self.replay(&padded, real);
            self.backend.finish_replay();
            if done? {
                self.logit_count = batch.logit_rows.len();
                return Ok(());
            }
        }
        self.run_ops(batch, after_layer)
    }

    /// Runs a padded decode step from a recording, recording it first if needed; `false` when
    /// the backend declined (the caller runs the step op by op).
    fn replay(&mut self, padded: &BatchLayout, real_rows: usize) -> Result<bool, BackendError> {
        match self.backend.begin_replay(padded, real_rows)? {
            ReplayStart::Eager => Ok(false),
            ReplayStart::Replayed => Ok(true),
            ReplayStart::Record => {
                // This pass computes the step (and grows every buffer to this shape, so the
                // recording pass allocates nothing); the recording pass only records.
                self.run_ops(padded, None)?;
                self.backend.begin_recording()?;
                let recorded = self.run_ops(padded, None);
                self.backend.end_recording(recorded.is_ok())?;
                if let Err(e) = recorded {
                    tracing::warn!(rows = padded.tokens.len(), error = %e, "a decode step could not be recorded; this shape runs op by op");
                }
                Ok(true)
            }
        }
    }

    /// The step's ops, one by one (see [`LlamaModel::forward_with`]).
    fn run_ops(
        &mut self,
        batch: &BatchLayout,
        mut after_layer: Option<&mut AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        self.logit_count = 0;
        let cfg = &self.cfg;
        let b = &mut self.backend;
        let ws = &mut self.ws;
        let t = batch.tokens.len();
        let hd = cfg.head_dim;
        let nh = cfg.num_attention_heads;
        let qd = nh * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let eps = cfg.rms_norm_eps;
        let scale = 1.0 / (hd as f32).sqrt();
        if t == 0 {
            return Ok(());
        }
        // `mark` labels each op for a step profile (a no-op unless the backend profiles).
        b.mark("embed");
        b.embed(&batch.tokens, &batch.pending, &self.embed, &mut ws.residual)?;
        for (i, layer) in self.layers.iter().enumerate() {
            b.mark("norm");
            if i == 0 {
                b.rms_norm(&ws.residual, &layer.input_norm, eps, &mut ws.hidden)?;
            } else {
                b.add_rms_norm(&mut ws.residual, &ws.proj, &layer.input_norm, eps, &mut ws.hidden)?;
            }
            b.mark("qkv");
            b.linear(&ws.hidden, t, &layer.qkv, layer.qkv_bias.as_ref(), &mut ws.qkv)?;
            b.mark("rope_kv");
            b.split_rope_and_write_kv(i, &ws.qkv, (qd, kvd, kvd), nh, batch, &mut ws.q, &mut ws.k, &mut ws.v)?;
            if let Some(after) = after_layer.as_deref_mut() {
                b.mark("kv_export");
                after(i, &mut *b)?;
            }
            b.mark("attention");
            b.attention(i, &ws.q, nh, scale, batch, &mut ws.attn)?;
            b.mark("o_proj");
            b.linear(&ws.attn, t, &layer.o, None, &mut ws.proj)?;
            b.mark("norm");
            b.add_rms_norm(&mut ws.residual, &ws.proj, &layer.post_attn_norm, eps, &mut ws.hidden)?;
            b.mark("gate_up");
            b.linear(&ws.hidden, t, &layer.gate_up, None, &mut ws.gate_up)?;
            b.mark("silu_mul");
            b.silu_mul(&ws.gate_up, cfg.intermediate_size, &mut ws.act)?;
            b.mark("down");
            b.linear(&ws.act, t, &layer.down, None, &mut ws.proj)?;
        }
        let h = cfg.hidden_size;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if !batch.prompt_logprobs.is_empty() {
            // Before the sampling rows: the LM head output below must be theirs.
            b.mark("prompt_logprobs");
            self.prompt_logprobs = prompt_logprobs(b, ws, &self.final_norm, head, h, eps, &batch.prompt_logprobs)?;
        }
        let rows = &batch.logit_rows;
        if rows.is_empty() {
            return Ok(());
        }
        // Only the sampling rows need the final norm and the (large) LM head. When that is
        // every row in order (decode), the last layer's buffers are used as they are.
        b.mark("final_norm");
        if rows.iter().copied().eq(0..t) {
            b.add_rms_norm(&mut ws.residual, &ws.proj, &self.final_norm, eps, &mut ws.hidden)?;
        } else {
            b.gather_res_rows(&ws.residual, h, rows, &mut ws.last_res)?;
            b.gather_rows(&ws.proj, h, rows, &mut ws.last)?;
            b.add_rms_norm(&mut ws.last_res, &ws.last, &self.final_norm, eps, &mut ws.hidden)?;
        }
        b.mark("lm_head");
        b.lm_head(&ws.hidden, rows.len(), head)?;
        self.logit_count = rows.len();
        Ok(())
    }
}

/// The prompt logprobs of `rows` after the last layer (residual stream `ws.residual`, last
/// layer's output `ws.proj`, neither modified): final norm and LM head over at most
/// [`PROMPT_LOGPROB_SLICE`] rows at a time, then each row's target logprob and top
/// alternatives from the backend, truncated to the row's own `top_k`.
fn prompt_logprobs<B: Backend>(
    b: &mut B,
    ws: &mut Workspace<B>,
    final_norm: &B::Buf,
    head: &B::Mat,
    h: usize,
    eps: f32,
    rows: &[PromptLogprobRow],
) -> Result<Vec<PromptLogprob>, BackendError> {
    let mut out = Vec::with_capacity(rows.len());
    for slice in rows.chunks(PROMPT_LOGPROB_SLICE) {
        let idx: Vec<usize> = slice.iter().map(|r| r.row).collect();
        let targets: Vec<u32> = slice.iter().map(|r| r.target).collect();
        let k = slice.iter().map(|r| r.top_k).max().unwrap_or(0);
        b.gather_res_rows(&ws.residual, h, &idx, &mut ws.last_res)?;
        b.gather_rows(&ws.proj, h, &idx, &mut ws.last)?;
        b.add_rms_norm(&mut ws.last_res, &ws.last, final_norm, eps, &mut ws.hidden)?;
        b.lm_head(&ws.hidden, slice.len(), head)?;
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
