//! The CUDA backend: bf16 weights, activations and paged KV cache on one GPU, an f32
//! residual stream and f32 logits, f32 arithmetic inside the kernels of
//! `baton_kernels::cuda`, GEMMs through cuBLAS except small-batch ones (at most
//! [`GEMV_MAX_M`] rows, k a multiple of 8), which go to the skinny-GEMM kernel.
//!
//! Invariants: every op enqueues on the device's single stream, so ops are ordered without
//! events; only the copies to the host (`to_host`, `logit_rows`, KV reads) and collecting a
//! sampling made on the device (which downloads a few hundred bytes per row instead of the
//! logits) synchronize, and so report asynchronous kernel faults. Buffers only grow: after
//! the largest step has run once, a step allocates nothing on the device. The per-step
//! metadata (positions, cache slots, block tables) and the token ids go up through
//! page-locked staging without waiting, once per batch layout, and are reused by every layer;
//! a sampling's picks stay on the device for a following step's pending rows. Any CUDA
//! failure is returned as [`BackendError::Device`]; shape errors as [`BackendError::Kernel`].
//!
//! The optional ops of some architectures (Gemma's norms, embedding scale, GELU-tanh,
//! soft-caps, windowed attention, per-layer-kind RoPE) live in cuda_arch_ops.rs; the trait
//! methods here pass them on, as they do the RoPE + KV write entry points (cuda_rope.rs). KV
//! block I/O is in cuda_kv_io.rs, weight loading in cuda_weights.rs, the rule that picks a
//! product's implementation in cuda_linear_rule.rs, the mapping of CUDA failures to backend
//! errors in cuda_errors.rs.

use super::{
    AttentionExtras, Backend, BackendError, BatchLayout, BoundaryScratch, BranchBoundary, DeviceSampler, Gate,
    GraphReplay, KvCacheShape, KvIo, MoeWeights, OptionalOp, WeightUploadReport,
};
use baton_core::api::PromptLogprob;
use baton_formats::{CounterInit, TensorView};
use baton_kernels::cpu::{KernelError, MoeRouting, NormWeight, RopeTable};
use baton_kernels::cuda::{
    BiasAddCall, CopyColsCall, CudaDevice, CudaError, CudaOptions, CudaSlice, EmbedCall, GatherRowsCall, HostSeq,
    KvGeometry, LinearCall, SampleBuffers, SiluMulCall, StepIds, StepMeta, WeightUploader, bf16,
};

/// An activation buffer: `len` live bf16 values in an allocation that may be larger.
pub struct CudaBuf {
    data: CudaSlice<bf16>,
    len: usize,
}

impl CudaBuf {
    /// Live elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no live elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A residual-stream buffer: `len` live f32 values in an allocation that may be larger.
pub struct CudaRes {
    data: CudaSlice<f32>,
    len: usize,
}

/// A `rows × cols` row-major bf16 weight matrix on the device, or an FP8 one (then `data` is
/// a one-element placeholder: FP8 matrices are projections, which only `linear` reads).
pub struct CudaMat {
    data: CudaSlice<bf16>,
    rows: usize,
    cols: usize,
    fp8: Option<Fp8Mat>,
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    /// The bf16 dequantization of one FP8 matrix, for products of more rows than the skinny
    /// FP8 kernel takes: sized at upload for the largest FP8 matrix (no allocation in a step).
    fp8_scratch: Option<CudaSlice<bf16>>,
    /// The per-token E4M3 codes and scales of a W8A8 product's activations (grown as needed).
    fp8_act: Option<(CudaSlice<u8>, CudaSlice<f32>)>,
    /// Set when `fp8_act` holds the per-token codes of a buffer's current contents, handed over
    /// by the op that wrote it (`BranchBoundary::then`) to the W8A8 product that reads it next;
    /// taken by that product, dropped by any other use of `fp8_act`.
    act_codes: Option<ActCodes>,
    /// W8A8 products that took their input's codes that way (see [`CudaBackend::w8a8_handoffs`]).
    handoffs: u64,
    /// FP8 skinny products launched with the gated activation in their epilogue (see
    /// [`CudaBackend::fp8_fused_epilogues`]).
    fp8_gated_epilogues: u64,
    /// FP8 skinny products launched with RoPE + the KV write in their epilogue (the same).
    fp8_rope_epilogues: u64,
    /// Dense branch boundaries and MoE branches launched with their norms fused (see
    /// [`CudaBackend::norm_fusions`]).
    norm_fusions: (u64, u64),
    /// Which norms a MoE branch fuses, if any ([`CudaBackend::set_moe_norm_fusion`]).
    moe_norm_fusion: Option<moe_branch::MoeNormFusion>,
    /// Whether W8A8 products use cuBLASLt's FP8 GEMM; cleared (with a warning) the first time
    /// cuBLASLt refuses one, after which they dequantize like W8A16.
    w8a8: bool,
    dev: CudaDevice,
    ordinal: usize,
    kv: Vec<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    /// The FP8 cache and its scales when `--kv-cache-dtype fp8` (then `kv` is empty).
    fp8: Option<kv_fp8::Fp8Cache>,
    geo: Option<KvGeometry>,
    inv_freq: Option<CudaSlice<f64>>,
    /// Rotated dims per head when fewer than head_dim (partial rotary), from the table.
    rotary_dim: Option<usize>,
    /// YaRN's / LongRoPE's factor on cos and sin, when not 1.
    rope_attention_factor: Option<f32>,
    meta: StepMeta,
    /// The batch layout `meta` was built for.
    meta_for: Option<BatchLayout>,
    ids: StepIds,
    rows: CudaSlice<i32>,
    /// f32 LM-head output, grown to the largest step.
    logits: CudaSlice<f32>,
    /// Small-batch GEMMs through the skinny-GEMM kernel (see [`GEMV_MAX_M`]); off = cuBLAS
    /// for every GEMM, for comparisons.
    gemv: bool,
    /// The gated MLP's activation fused into the skinny GEMM where it applies
    /// ([`Backend::gated_linear`]); off = the product and the activation kernel, for
    /// comparisons.
    fuse_gate: bool,
    /// The RMSNorm between two residual branches fused into the skinny GEMMs on either side,
    /// or (prefill into a W8A8 projection) quantizing its rows for the FP8 GEMM
    /// ([`Backend::branch_boundary`]); off = the three ops, for comparisons.
    fuse_norm: bool,
    /// A fused boundary into the qkv projection also rotates q and k and writes the cache in
    /// that product's epilogue ([`crate::backend::BoundaryRope`]); off = the RoPE kernel after
    /// it, for comparisons.
    fuse_rope: bool,
    /// Whether a decode step's qkv product has carried RoPE in its epilogue: the steps that
    /// take the per-step carve-out (`set_step_carveout`).
    rope_epilogue_seen: bool,
    /// The per-CTA sums of squares the fused boundary passes from one GEMM to the next
    /// (allocated at the first fused boundary, for the most rows a skinny GEMM takes).
    norm_stats: Option<CudaSlice<f32>>,
    /// Prefill chunks through the tensor-core prefill kernel (`AttnKernel::Mixed`);
    /// off = the decode kernel for every row, for comparisons.
    prefill_kernel: bool,
    /// Rows and width of the live LM-head output in `logits`.
    logit_shape: (usize, usize),
    /// Device buffers of the sampler.
    sample_bufs: SampleBuffers,
    /// Prompt logprobs: the rows' target tokens and the kernel's answers.
    prompt_targets: CudaSlice<u32>,
    prompt_out: CudaSlice<u32>,
    /// The plans' `logprobs` of the rows of the launched, not yet collected sampling.
    sample_logprobs: Vec<Option<usize>>,
    /// Decode steps recorded as CUDA graphs, and the staged step (cuda_graph.rs).
    graphs: graph::GraphState,
    /// Events of the step being profiled, one per [`Backend::mark`] (see
    /// [`CudaBackend::profile_begin`]); `None` when not profiling.
    profile: Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    /// The page-locked ring stored weights stream through while a model loads (created by
    /// the first [`Backend::upload_mat_raw`], freed by [`Backend::finish_weights`]).
    uploader: Option<WeightUploader>,
    /// Scratch of the mixture-of-experts op (cuda_moe.rs).
    moe: moe::MoeScratch,
    /// What the optional ops of some architectures keep (cuda_arch_ops.rs).
    arch: arch_ops::ArchState,
}

/// [`Backend::mark`] on the backend's parts, for ops that hold other fields borrowed (the MoE
/// layer marks its kernels): records an event labelled `label` when a profile is running.
fn record_mark(
    dev: &CudaDevice,
    profile: &mut Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    label: &'static str,
) {
    if let Some(events) = profile {
        match dev.event().and_then(|e| Ok(e.record(dev.stream()).map(|_| e)?)) {
            Ok(e) => events.push((label, e)),
            Err(err) => tracing::warn!(error = %err, "cannot record a profile event; the profile stops"),
        }
    }
}

fn kerr(op: &'static str, message: String) -> BackendError {
    BackendError::Kernel(KernelError { op, message })
}

/// The kernel modules a device serving `cfg` compiles and loads: attention for its head_dim,
/// the experts' kernels where it has experts, FP8 weights' kernels where its weights are
/// FP8 (as stored, or quantized at load), and the modules every model runs.
pub fn kernel_needs(cfg: &baton_formats::ModelConfig) -> baton_kernels::cuda::KernelNeeds {
    baton_kernels::cuda::KernelNeeds::model(cfg.head_dim, cfg.moe.is_some(), cfg.quantization.is_some())
}

impl CudaBackend {
    /// Opens the device in `opts` and compiles (or loads from the cache) the kernels.
    pub fn new(opts: &CudaOptions) -> Result<Self, BackendError> {
        let opened = std::time::Instant::now();
        let dev = CudaDevice::open(opts)?;
        let meta = StepMeta::new(&dev)?;
        let ids = StepIds::new(&dev)?;
        let rows = dev.alloc(64)?;
        let logits = dev.alloc(1)?;
        let sample_bufs = SampleBuffers::new(&dev)?;
        let (prompt_targets, prompt_out) = (dev.alloc(1)?, dev.alloc(1)?);
        let moe = moe::MoeScratch::new(&dev)?;
        for m in dev.module_reports() {
            tracing::info!(
                module = %m.name,
                from_cache = m.from_cache,
                ms = format_args!("{:.0}", m.ms),
                bytes = m.bytes,
                "kernel module"
            );
        }
        let (ms, cached) = dev.module_load();
        let hits = dev.module_reports().iter().filter(|m| m.from_cache).count();
        tracing::info!(
            phase = "kernels",
            ms = format_args!("{ms:.0}"),
            modules = dev.module_reports().len(),
            from_cache = hits,
            all_cached = cached,
            arch = dev.arch(),
            "startup phase"
        );
        tracing::info!(
            phase = "device",
            ms = format_args!("{:.0}", opened.elapsed().as_secs_f64() * 1e3 - ms),
            device = dev.name(),
            arch = dev.arch(),
            "startup phase"
        );
        Ok(Self {
            fp8_scratch: None,
            fp8_act: None,
            act_codes: None,
            handoffs: 0,
            norm_fusions: (0, 0),
            moe_norm_fusion: None,
            fp8_gated_epilogues: 0,
            fp8_rope_epilogues: 0,
            w8a8: true,
            dev,
            ordinal: opts.ordinal,
            kv: Vec::new(),
            fp8: None,
            geo: None,
            inv_freq: None,
            rotary_dim: None,
            rope_attention_factor: None,
            meta,
            meta_for: None,
            ids,
            rows,
            logits,
            gemv: true,
            fuse_gate: true,
            fuse_norm: true,
            fuse_rope: true,
            rope_epilogue_seen: false,
            norm_stats: None,
            prefill_kernel: true,
            logit_shape: (0, 0),
            sample_bufs,
            prompt_targets,
            prompt_out,
            sample_logprobs: Vec::new(),
            graphs: graph::GraphState::new(),
            profile: None,
            uploader: None,
            moe,
            arch: arch_ops::ArchState::default(),
        })
    }

    fn ensure(&self, buf: &mut CudaBuf, len: usize) -> Result<(), BackendError> {
        if buf.data.len() < len {
            buf.data = self.dev.alloc(len.next_power_of_two())?;
        }
        buf.len = len;
        Ok(())
    }

    fn ensure_res(&self, buf: &mut CudaRes, len: usize) -> Result<(), BackendError> {
        if buf.data.len() < len {
            buf.data = self.dev.alloc(len.next_power_of_two())?;
        }
        buf.len = len;
        Ok(())
    }

    fn geo(&self) -> Result<KvGeometry, BackendError> {
        self.geo.ok_or_else(|| BackendError::Device("the KV cache was not allocated".into()))
    }

    /// Builds the step metadata unless it was built for this very layout (every layer of a
    /// step passes the same layout).
    fn step_meta(&mut self, batch: &BatchLayout) -> Result<(), BackendError> {
        let geo = self.geo()?;
        // Before the early return: a graph's recording pass repeats its eager pass's layout, and
        // must run under the pins that pass settled (it is the first decode step that shows
        // whether the qkv product carries RoPE). A few atomic stores per op, host side only.
        self.set_step_carveout(batch, geo);
        if self.meta_for.as_ref() == Some(batch) {
            return Ok(());
        }
        let seqs: Vec<HostSeq<'_>> = batch
            .seqs
            .iter()
            .map(|s| HostSeq {
                row_start: s.row_start,
                n_tokens: s.n_tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
            })
            .collect();
        self.meta_for = None;
        let rows = batch.tokens.len();
        // A staged replay's padding rows belong to no sequence; every other batch must be
        // covered row for row.
        let real = match self.graphs.staged {
            Some(s) if s.key.rows == rows => s.real_rows,
            _ => rows,
        };
        self.meta.set_padded(&self.dev, &seqs, real, rows, geo.block_size, geo.num_blocks)?;
        self.meta_for = Some(batch.clone());
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Mat = CudaMat;
    type Res = CudaRes;

    fn device_name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn upload_mat(&mut self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CudaMat, BackendError> {
        if data.len() != rows * cols {
            return Err(kerr("upload_mat", format!("{} values for a {rows}×{cols} matrix", data.len())));
        }
        Ok(CudaMat { data: self.dev.upload(&to_bf16(&data))?, rows, cols, fp8: None })
    }

    fn upload_mat_fp8(
        &mut self,
        w: baton_kernels::cpu::Fp8Matrix,
        act: baton_kernels::cpu::ActivationScale,
    ) -> Result<CudaMat, BackendError> {
        let weights = baton_kernels::cuda::Fp8Weights::upload(&self.dev, &w)?;
        self.fp8_mat(weights, act)
    }

    fn random_mat_fp8(
        &mut self,
        parts: &[(usize, CounterInit)],
        cols: usize,
        act: baton_kernels::cpu::ActivationScale,
    ) -> Result<CudaMat, BackendError> {
        self.draw_fp8(parts, cols, act)
    }

    fn quantize_mat_fp8(
        &mut self,
        parts: &[TensorView<'_>],
        rows: usize,
        cols: usize,
        act: baton_kernels::cpu::ActivationScale,
    ) -> Result<CudaMat, BackendError> {
        self.quantize_fp8(parts, rows, cols, act)
    }

    fn upload_vec(&mut self, data: Vec<f32>) -> Result<CudaBuf, BackendError> {
        Ok(CudaBuf { data: self.dev.upload(&to_bf16(&data))?, len: data.len() })
    }

    fn upload_mat_raw(&mut self, parts: &[TensorView<'_>], rows: usize, cols: usize) -> Result<CudaMat, BackendError> {
        Ok(CudaMat { data: self.stream_weights("upload_mat_raw", parts, rows * cols)?, rows, cols, fp8: None })
    }

    fn upload_vec_raw(&mut self, parts: &[TensorView<'_>]) -> Result<CudaBuf, BackendError> {
        let len = parts.iter().map(TensorView::numel).sum();
        Ok(CudaBuf { data: self.stream_weights("upload_vec_raw", parts, len)?, len })
    }

    fn finish_weights(&mut self) -> Result<Option<WeightUploadReport>, BackendError> {
        self.finish_upload()
    }

    fn random_mat(&mut self, parts: &[(usize, CounterInit)], cols: usize) -> Result<CudaMat, BackendError> {
        let rows = parts.iter().map(|p| p.0).sum();
        Ok(CudaMat { data: self.draw(parts, cols)?, rows, cols, fp8: None })
    }

    fn random_vec(&mut self, parts: &[(usize, CounterInit)]) -> Result<CudaBuf, BackendError> {
        let data = self.draw(parts, 1)?;
        Ok(CudaBuf { len: parts.iter().map(|p| p.0).sum(), data })
    }

    fn mark(&mut self, label: &'static str) {
        record_mark(&self.dev, &mut self.profile, label);
    }

    fn alloc(&mut self, len: usize) -> Result<CudaBuf, BackendError> {
        Ok(CudaBuf { data: self.dev.alloc(len.max(1))?, len })
    }

    fn alloc_res(&mut self, len: usize) -> Result<CudaRes, BackendError> {
        Ok(CudaRes { data: self.dev.alloc(len.max(1))?, len })
    }

    fn resize(&mut self, buf: &mut CudaBuf, len: usize) -> Result<(), BackendError> {
        if buf.data.len() < len {
            // Keep the live prefix, as the CPU backend's Vec::resize does.
            let mut bigger = self.dev.alloc::<bf16>(len.next_power_of_two())?;
            self.dev.copy(&buf.data, &mut bigger, buf.len)?;
            buf.data = bigger;
        }
        buf.len = len;
        Ok(())
    }

    fn alloc_kv_cache(&mut self, shape: KvCacheShape) -> Result<(), BackendError> {
        let geo = KvGeometry {
            num_blocks: shape.num_blocks,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        // Free the old cache before allocating the new one.
        self.kv.clear();
        self.geo = None;
        self.meta_for = None;
        let n = geo.layer_len();
        if shape.dtype != self.kv_dtype() {
            return Err(BackendError::Device(format!(
                "a {:?} KV cache was asked of a backend set to {:?}",
                shape.dtype,
                self.kv_dtype()
            )));
        }
        let fp8 = self.alloc_fp8_layers(&shape, n)?;
        for _ in 0..if fp8 { 0 } else { shape.num_layers } {
            self.kv.push((self.dev.alloc(n)?, self.dev.alloc(n)?));
        }
        self.geo = Some(geo);
        Ok(())
    }

    fn embed(
        &mut self,
        tokens: &[u32],
        pending: &[(usize, usize)],
        table: &CudaMat,
        out: &mut CudaRes,
    ) -> Result<(), BackendError> {
        self.ensure_res(out, tokens.len() * table.cols)?;
        self.graphs.vocab = Some(table.rows);
        // A staged replay's ids are on the device already (checked and uploaded, pending rows
        // included, by stage_replay), and a recording must not upload.
        if self.graphs.staged.is_none_or(|s| s.key.rows != tokens.len()) {
            self.ids.stage(&self.dev, tokens, table.rows, pending, Some(&self.sample_bufs))?;
        }
        let call =
            EmbedCall { ids: &self.ids, table: &table.data, vocab: table.rows, dim: table.cols, out: &mut out.data };
        Ok(call.launch(&self.dev)?)
    }

    fn linear(
        &mut self,
        x: &CudaBuf,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        if x.len < m * w.cols {
            return Err(kerr("linear", format!("input has {} values, need {m}×{}", x.len, w.cols)));
        }
        self.ensure(out, m * w.rows)?;
        if let Some(f) = &w.fp8 {
            self.linear_fp8(x, m, f, out)?;
        } else {
            let kernel = linear_kernel(self.gemv, m, w.cols);
            LinearCall { x: &x.data, m, k: w.cols, w: &w.data, n: w.rows, out: &mut out.data, kernel }
                .launch(&self.dev)?;
        }
        if let Some(b) = bias {
            if b.len != w.rows {
                return Err(kerr("linear", format!("bias has {} values for {} outputs", b.len, w.rows)));
            }
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: w.rows }.launch(&self.dev)?;
        }
        Ok(())
    }

    fn rms_norm(&mut self, x: &CudaRes, weight: &CudaBuf, eps: f32, out: &mut CudaBuf) -> Result<(), BackendError> {
        self.norm_styled(x, weight, eps, NormWeight::Plain, out)
    }

    fn add_rms_norm(
        &mut self,
        residual: &mut CudaRes,
        x: &CudaBuf,
        weight: &CudaBuf,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.add_norm_styled(residual, x, weight, eps, NormWeight::Plain, out)
    }

    fn gather_res_rows(
        &mut self,
        x: &CudaRes,
        width: usize,
        rows: &[usize],
        out: &mut CudaRes,
    ) -> Result<(), BackendError> {
        if width == 0 || !x.len.is_multiple_of(width) {
            return Err(kerr("gather_res_rows", format!("{} values is not rows of width {width}", x.len)));
        }
        self.ensure_res(out, rows.len() * width)?;
        let src_rows = x.len / width;
        let call = GatherRowsCall { src: &x.data, src_rows, width, rows, scratch: &mut self.rows, dst: &mut out.data };
        Ok(call.launch(&self.dev)?)
    }

    fn lm_head(&mut self, x: &CudaBuf, m: usize, w: &CudaMat) -> Result<(), BackendError> {
        if x.len < m * w.cols {
            return Err(kerr("lm_head", format!("input has {} values, need {m}×{}", x.len, w.cols)));
        }
        let n = m * w.rows;
        self.logit_shape = (0, w.rows);
        if self.logits.len() < n {
            self.logits = self.dev.alloc(n.next_power_of_two())?;
        }
        let kernel = linear_kernel(self.gemv, m, w.cols);
        LinearCall { x: &x.data, m, k: w.cols, w: &w.data, n: w.rows, out: &mut self.logits, kernel }
            .launch(&self.dev)?;
        self.logit_shape = (m, w.rows);
        Ok(())
    }

    fn logit_rows(&mut self, rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        let (have, vocab) = self.logit_shape;
        if let Some(bad) = rows.iter().find(|&&r| r >= have) {
            return Err(kerr("logit_rows", format!("row {bad} of {have} logit rows")));
        }
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            // The common case (every row, in order) is one copy.
            return Ok(self.dev.download(&self.logits, rows.len() * vocab)?);
        }
        let mut out = vec![0f32; rows.len() * vocab];
        let stream = self.dev.stream();
        for (dst, &r) in out.chunks_exact_mut(vocab.max(1)).zip(rows) {
            stream.memcpy_dtoh(&self.logits.slice(r * vocab..(r + 1) * vocab), dst).map_err(CudaError::from)?;
        }
        stream.synchronize().map_err(CudaError::from)?;
        Ok(out)
    }

    fn logit_row_logprobs(&mut self, targets: &[u32], k: usize) -> Result<Vec<PromptLogprob>, BackendError> {
        let (have, vocab) = self.logit_shape;
        if targets.len() > have {
            return Err(kerr("logit_row_logprobs", format!("{} targets for {have} logit rows", targets.len())));
        }
        let rows = self.dev.prompt_logprobs(
            &self.logits,
            vocab,
            targets,
            k,
            &mut self.prompt_targets,
            &mut self.prompt_out,
        )?;
        Ok(rows
            .into_iter()
            .zip(targets)
            .map(|(r, &token_id)| PromptLogprob { token_id, logprob: r.logprob, rank: r.rank, top: r.top })
            .collect())
    }

    fn rope_and_write_kv(
        &mut self,
        layer: usize,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        n_heads: usize,
        batch: &BatchLayout,
    ) -> Result<(), BackendError> {
        self.rope_split_write_kv(layer, q, k, v, n_heads, batch)
    }

    fn split_rope_and_write_kv(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        q: &mut CudaBuf,
        _k: &mut CudaBuf,
        _v: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.rope_fused_write_kv(layer, qkv, widths, n_heads, batch, q)
    }

    fn supports(&self, op: OptionalOp) -> bool {
        match op {
            // Fused into the RoPE + KV write kernel (`split_qk_norm_rope_and_write_kv`).
            OptionalOp::HeadRmsNorm => true,
            // cuda_moe.rs: routing, permutation and the grouped expert GEMVs on the device.
            OptionalOp::Moe => true,
            // cuda_arch_ops.rs.
            OptionalOp::GemmaNorms
            | OptionalOp::EmbedScale
            | OptionalOp::GeluTanhMul
            | OptionalOp::LogitSoftcap
            | OptionalOp::AttentionExtras
            | OptionalOp::LayerRope => true,
        }
    }

    fn rms_norm_styled(
        &mut self,
        x: &CudaRes,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.norm_styled(x, weight, eps, style, out)
    }

    fn add_rms_norm_styled(
        &mut self,
        residual: &mut CudaRes,
        x: &CudaBuf,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.add_norm_styled(residual, x, weight, eps, style, out)
    }

    fn buf_rms_norm(
        &mut self,
        x: &CudaBuf,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.buf_norm(x, weight, eps, style, out)
    }

    fn scale_embedding(&mut self, x: &mut CudaRes, s: f32) -> Result<(), BackendError> {
        self.scale_residual(x, s)
    }

    fn gelu_tanh_mul(&mut self, gate_up: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<(), BackendError> {
        self.gelu_mul(gate_up, d, out)
    }

    fn softcap_logits(&mut self, cap: f32) -> Result<(), BackendError> {
        self.softcap_last_logits(cap)
    }

    fn attention_ext(
        &mut self,
        layer: usize,
        q: &CudaBuf,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        extras: AttentionExtras,
        sinks: Option<&CudaBuf>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.attention_with(layer, q, n_heads, scale, batch, extras, sinks, out)
    }

    fn set_layer_ropes(&mut self, tables: Vec<RopeTable>, layer_table: Vec<usize>) -> Result<(), BackendError> {
        self.layer_ropes(tables, layer_table)
    }

    fn split_qk_norm_rope_and_write_kv(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        (qd, kvd, kvd2): (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        (q_norm, k_norm, eps): (&CudaBuf, &CudaBuf, f32),
        out: (&mut CudaBuf, &mut CudaBuf, &mut CudaBuf),
    ) -> Result<(), BackendError> {
        let norms = (q_norm, k_norm, eps, NormWeight::Plain);
        self.split_qk_norm_rope_and_write_kv_styled(layer, qkv, (qd, kvd, kvd2), n_heads, batch, norms, out)
    }

    fn split_qk_norm_rope_and_write_kv_styled(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        norms: (&CudaBuf, &CudaBuf, f32, NormWeight),
        out: (&mut CudaBuf, &mut CudaBuf, &mut CudaBuf),
    ) -> Result<(), BackendError> {
        self.rope_fused_qk_norm_write_kv(layer, qkv, widths, n_heads, batch, norms, out.0)
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &CudaBuf,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        // One router for every layer: the tuned kernels where they have the head_dim, the
        // simple kernel elsewhere (either cache type).
        self.attention_with(layer, q, n_heads, scale, batch, AttentionExtras::default(), None, out)
    }
    fn silu_mul(&mut self, gate_up: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<(), BackendError> {
        if d == 0 || !gate_up.len.is_multiple_of(2 * d) {
            return Err(kerr("silu_mul", format!("{} values is not rows of width {}", gate_up.len, 2 * d)));
        }
        let rows = gate_up.len / (2 * d);
        self.ensure(out, rows * d)?;
        Ok(SiluMulCall { gate_up: &gate_up.data, rows, d, out: &mut out.data }.launch(&self.dev)?)
    }

    fn gated_linear(
        &mut self,
        x: &CudaBuf,
        m: usize,
        gate_up: &CudaMat,
        gate: Gate,
        scratch: &mut CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.gated_linear_cuda(x, m, gate_up, gate, scratch, out)
    }

    fn branch_boundary(
        &mut self,
        s: BranchBoundary<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.branch_boundary_cuda(s, residual, scratch, out)
    }

    fn gather_rows(
        &mut self,
        x: &CudaBuf,
        width: usize,
        rows: &[usize],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        if width == 0 || !x.len.is_multiple_of(width) {
            return Err(kerr("gather_rows", format!("{} values is not rows of width {width}", x.len)));
        }
        self.ensure(out, rows.len() * width)?;
        let src_rows = x.len / width;
        let call = GatherRowsCall { src: &x.data, src_rows, width, rows, scratch: &mut self.rows, dst: &mut out.data };
        Ok(call.launch(&self.dev)?)
    }

    fn split3(
        &mut self,
        x: &CudaBuf,
        (wa, wb, wc): (usize, usize, usize),
        a: &mut CudaBuf,
        b: &mut CudaBuf,
        c: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let w = wa + wb + wc;
        if w == 0 || !x.len.is_multiple_of(w) {
            return Err(kerr("split3", format!("{} values is not a multiple of {w}", x.len)));
        }
        let rows = x.len / w;
        self.ensure(a, rows * wa)?;
        self.ensure(b, rows * wb)?;
        self.ensure(c, rows * wc)?;
        for (col0, dst, dst_width) in [(0, a, wa), (wa, b, wb), (wa + wb, c, wc)] {
            CopyColsCall { src: &x.data, rows, src_width: w, col0, dst: &mut dst.data, dst_width }.launch(&self.dev)?;
        }
        Ok(())
    }

    fn to_host(&mut self, buf: &CudaBuf, len: usize) -> Result<Vec<f32>, BackendError> {
        if len > buf.len {
            return Err(kerr("to_host", format!("{len} values requested from a buffer of {}", buf.len)));
        }
        let v = self.dev.download(&buf.data, len)?;
        Ok(v.iter().map(|x| x.to_f32()).collect())
    }

    fn set_rope(&mut self, table: RopeTable) -> Result<(), BackendError> {
        self.inv_freq = Some(self.dev.upload(table.inv_freq())?);
        // The table is built for the rotated dims; the cache's head_dim may be larger.
        self.rotary_dim = Some(table.head_dim());
        self.rope_attention_factor = Some(table.attention_factor()).filter(|f| *f != 1.0);
        Ok(())
    }

    fn kv_dtype(&self) -> baton_core::kv_transfer::KvDtype {
        if self.fp8.is_some() {
            baton_core::kv_transfer::KvDtype::Fp8E4M3
        } else {
            baton_core::kv_transfer::KvDtype::BF16
        }
    }

    fn set_kv_cache_dtype(
        &mut self,
        dtype: baton_core::kv_transfer::KvDtype,
        scales: Vec<super::KvScale>,
    ) -> Result<(), BackendError> {
        self.choose_kv_dtype(dtype, scales)
    }

    fn kv_scales(&self) -> Vec<super::KvScale> {
        self.fp8.as_ref().map(|f| f.scales.clone()).unwrap_or_default()
    }

    fn set_kv_scale(&mut self, layer: usize, scale: super::KvScale) -> Result<(), BackendError> {
        self.set_fp8_scale(layer, scale)
    }

    fn kv_k_shift(&self, layer: usize) -> Vec<f32> {
        self.fp8.as_ref().and_then(|f| f.k_shift.get(layer)).map(|(h, _)| h.clone()).unwrap_or_default()
    }

    fn set_kv_k_shift(&mut self, layer: usize, shift: &[f32]) -> Result<(), BackendError> {
        self.set_fp8_k_shift(layer, shift)
    }

    fn calibrate_kv_scales(&mut self, layers: &[bool]) -> Result<(), BackendError> {
        self.calibrate_fp8(layers)
    }

    fn moe(
        &mut self,
        x: &CudaBuf,
        m: usize,
        w: MoeWeights<'_, CudaMat, CudaBuf>,
        routing: MoeRouting,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.moe_layer(x, m, w, routing, out)
    }

    fn moe_branch(
        &mut self,
        s: crate::backend::MoeBranch<'_, Self>,
        residual: &mut CudaRes,
        scratch: crate::backend::BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.moe_branch_cuda(s, residual, scratch, out)
    }

    fn kv_device(&mut self) -> Option<&mut dyn super::KvDeviceAccess> {
        Some(self)
    }

    fn graph_replay(&mut self) -> Option<&mut dyn GraphReplay> {
        Some(self)
    }

    fn device_sampler(&mut self) -> Option<&mut dyn DeviceSampler> {
        Some(self)
    }

    fn kv_io(&mut self) -> Option<&mut dyn KvIo> {
        Some(self)
    }
}

#[path = "cuda_kv_io.rs"]
mod kv_io;

#[path = "cuda_rope.rs"]
mod rope;

#[path = "cuda_kv_device.rs"]
mod kv_device;

#[path = "cuda_kv_fp8.rs"]
mod kv_fp8;

#[path = "cuda_graph.rs"]
mod graph;

#[path = "cuda_arch_ops.rs"]
mod arch_ops;
#[path = "cuda_boundary.rs"]
mod boundary;
#[path = "cuda_errors.rs"]
mod errors;
#[path = "cuda_fp8_linear.rs"]
mod fp8_linear;
#[path = "cuda_gated.rs"]
mod gated;
#[path = "cuda_linear_rule.rs"]
mod linear_rule;
#[path = "cuda_moe.rs"]
mod moe;
#[path = "cuda_moe_branch.rs"]
mod moe_branch;
#[path = "cuda_sampler.rs"]
mod sampler;
#[path = "cuda_switches.rs"]
mod switches;
#[path = "cuda_weights.rs"]
mod weights;
pub use errors::{driver_error, is_sticky};
use fp8_linear::{ActCodes, Fp8Mat};
pub use graph::{GRAPH_MAX_ROWS, GraphStats, graph_bucket, is_pure_decode};
pub use linear_rule::GEMV_MAX_M;
use linear_rule::{gemv_applies, linear_kernel};
pub use moe::MoeKernels;
pub use moe_branch::MoeNormFusion;
pub use sampler::{device_ops, device_row, sampled};
use weights::to_bf16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_loads_the_kernel_modules_it_runs() {
        use crate::weight_quantization::WeightQuantization;
        use baton_kernels::cuda::KernelNeeds;
        let config = |name: &str| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/models").join(name);
            baton_formats::ModelConfig::from_hf_file(&path).expect("config")
        };
        let mut llama = config("llama-3.1-8b.json");
        assert_eq!(kernel_needs(&llama), KernelNeeds::model(128, false, false));
        WeightQuantization::Fp8.apply(&mut llama);
        assert_eq!(kernel_needs(&llama), KernelNeeds::model(128, false, true), "quantized at load");
        assert_eq!(kernel_needs(&config("qwen3-30b-a3b.json")), KernelNeeds::model(128, true, false));
        assert_eq!(kernel_needs(&config("gemma-3-12b.json")), KernelNeeds::model(256, false, false));
    }
}
