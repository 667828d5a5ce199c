//! The CUDA backend's optional ops for Gemma 2 and Gemma 3 (text) (see
//! [`OptionalOp`](crate::backend::OptionalOp)): norms scaling by `1 + w` and norms of bf16
//! activation buffers, the bf16-rounded embedding scale, GELU-tanh·mul, final logit
//! soft-capping, attention with a sliding window, score soft-capping or sinks (gpt-oss; through
//! the tuned kernels where they have the head_dim, else the extended kernel), and a rotary
//! table per layer kind; and the tuned attention kernels' launch ([`CudaBackend::attention_tuned`])
//! that plain attention and these options share. The trait methods in cuda.rs call these.
//!
//! Invariants (those of cuda.rs, and for CUDA graphs): every op only enqueues kernels on the
//! device's stream, with no upload and no synchronization; scratch buffers only grow, and
//! grow in the op-by-op pass that precedes a recording, so a recorded step allocates nothing;
//! the per-layer rotary tables are uploaded once, at [`CudaBackend::layer_ropes`] (model
//! preparation), never during a step.

use super::{CudaBackend, CudaBuf, CudaRes, kerr};
use crate::backend::{AttentionExtras, BackendError, BatchLayout};
use baton_kernels::cpu::{NormWeight, RopeTable};
use baton_kernels::cuda::{
    AddRmsNormCall, AttentionCall, AttentionExtCall, AttentionOptions, AttnKernel, CastCall, CudaSlice,
    GeluTanhMulCall, KvCacheRef, KvGeometry, RmsNormCall, ScaleRoundCall, SoftcapCall, attention_supports,
};

/// What the optional ops keep on the backend.
#[derive(Default)]
pub(super) struct ArchState {
    /// f32 copy of a bf16 activation buffer, the input of [`CudaBackend::buf_norm`] (the norm
    /// kernels read f32 rows); grown to the largest step.
    norm_in: Option<CudaRes>,
    /// One `inv_freq` table per layer kind, and each layer's index into them; empty unless a
    /// model set them (every layer then uses the one table of `set_rope`).
    layer_inv_freq: Vec<CudaSlice<f64>>,
    layer_table: Vec<usize>,
    /// The sink logits of the layer being attended, widened to f32 (the kernel reads f32;
    /// the weights are stored bf16, as transformers' bf16 model holds them); grown to the
    /// largest head count.
    sinks_f32: Option<CudaSlice<f32>>,
}

/// The rotary table layer `layer` rotates with: its layer kind's, or the one `set_rope` table.
/// A free function over the two fields so that callers can borrow the KV cache mutably beside
/// it.
pub(super) fn inv_freq_for<'a>(
    arch: &'a ArchState,
    shared: Option<&'a CudaSlice<f64>>,
    layer: usize,
) -> Result<&'a CudaSlice<f64>, BackendError> {
    let own = arch.layer_table.get(layer).and_then(|&t| arch.layer_inv_freq.get(t));
    own.or(shared).ok_or_else(|| BackendError::Device("rotary table not set".into()))
}

impl CudaBackend {
    /// `out = rms_norm(x) · w` of the residual stream, the weights applied as `style` says.
    pub(super) fn norm_styled(
        &mut self,
        x: &CudaRes,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let d = weight.len;
        if d == 0 || !x.len.is_multiple_of(d) {
            return Err(kerr("rms_norm", format!("x {} values, weight {d}", x.len)));
        }
        self.ensure(out, x.len)?;
        let call = RmsNormCall { x: &x.data, weight: &weight.data, rows: x.len / d, dim: d, eps, out: &mut out.data };
        Ok(call.launch_with(&self.dev, style)?)
    }

    /// `residual += x; out = rms_norm(residual) · w`, the weights applied as `style` says.
    pub(super) fn add_norm_styled(
        &mut self,
        residual: &mut CudaRes,
        x: &CudaBuf,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let d = weight.len;
        if d == 0 || !x.len.is_multiple_of(d) || residual.len != x.len {
            return Err(kerr("add_rms_norm", format!("residual {}, x {}, weight {d}", residual.len, x.len)));
        }
        self.ensure(out, x.len)?;
        let call = AddRmsNormCall {
            residual: &mut residual.data,
            x: &x.data,
            weight: &weight.data,
            rows: x.len / d,
            dim: d,
            eps,
            out: &mut out.data,
        };
        Ok(call.launch_with(&self.dev, style)?)
    }

    /// `out = rms_norm(x) · w` of a bf16 activation buffer: widened to f32 exactly (a copy in
    /// the backend's scratch), then the residual-stream norm, so the result is what the
    /// f32 reference computes from the same bf16 values.
    pub(super) fn buf_norm(
        &mut self,
        x: &CudaBuf,
        weight: &CudaBuf,
        eps: f32,
        style: NormWeight,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let mut wide = match self.arch.norm_in.take() {
            Some(w) => w,
            None => CudaRes { data: self.dev.alloc(1)?, len: 0 },
        };
        let run = (|| {
            self.ensure_res(&mut wide, x.len)?;
            CastCall { src: &x.data, dst: &mut wide.data, n: x.len }.launch(&self.dev)?;
            self.norm_styled(&wide, weight, eps, style, out)
        })();
        self.arch.norm_in = Some(wide);
        run
    }

    /// `x = bf16(x · bf16(s))` over the live values of the residual stream.
    pub(super) fn scale_residual(&mut self, x: &mut CudaRes, s: f32) -> Result<(), BackendError> {
        Ok(ScaleRoundCall { x: &mut x.data, n: x.len, scale: s }.launch(&self.dev)?)
    }

    /// `out = gelu_tanh(gate) · up` of rows `[gate | up]` of width `2d`.
    pub(super) fn gelu_mul(&mut self, gate_up: &CudaBuf, d: usize, out: &mut CudaBuf) -> Result<(), BackendError> {
        if d == 0 || !gate_up.len.is_multiple_of(2 * d) {
            return Err(kerr("gelu_tanh_mul", format!("{} values is not rows of width {}", gate_up.len, 2 * d)));
        }
        let rows = gate_up.len / (2 * d);
        self.ensure(out, rows * d)?;
        Ok(GeluTanhMulCall { gate_up: &gate_up.data, rows, d, out: &mut out.data }.launch(&self.dev)?)
    }

    /// `cap · tanh(x / cap)` over every value of the last LM-head output (a recorded step's
    /// rows are its bucket's, so the count is fixed per graph).
    pub(super) fn softcap_last_logits(&mut self, cap: f32) -> Result<(), BackendError> {
        let (rows, vocab) = self.logit_shape;
        Ok(SoftcapCall { x: &mut self.logits, n: rows * vocab, cap }.launch(&self.dev)?)
    }

    /// Attention with `extras` and `sinks`: every layer at a head_dim the tuned kernels have
    /// ([`attention_supports`]: 16 to 256 in powers of two) takes them
    /// ([`CudaBackend::attention_tuned`], the options as runtime arguments; a windowed row's
    /// splits cover its window only); other head dims the window/soft-cap/sinks kernel
    /// ([`AttentionExtCall`], or over an FP8 cache its FP8 entry). None reads a key before a
    /// row's window.
    pub(super) fn attention_with(
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
        let geo = self.geo()?;
        if attention_supports(geo.head_dim) {
            if let Some(s) = sinks {
                self.widen_sinks(s, n_heads)?;
            }
            // Out of `self` for the call's borrow, put back after it.
            let wide = if sinks.is_some() { self.arch.sinks_f32.take() } else { None };
            let options = AttentionOptions { window: extras.window, softcap: extras.softcap, sinks: wide.as_ref() };
            let done = self.attention_tuned(layer, q, n_heads, scale, batch, options, out);
            if wide.is_some() {
                self.arch.sinks_f32 = wide;
            }
            return done;
        }
        self.attention_prologue("attention_ext", q, n_heads, batch, out)?;
        if let Some(s) = sinks {
            self.widen_sinks(s, n_heads)?;
        }
        // A replay keys its graph by the heads (for the tuned kernel's splits, which this
        // kernel does not use: any split count replays it alike).
        self.graphs.n_heads = Some(n_heads);
        if self.fp8.is_some() {
            let options = (extras, sinks.and(self.arch.sinks_f32.as_ref()));
            return self.attention_fp8(layer, &q.data, n_heads, scale, geo, options, &mut out.data);
        }
        let (kc, vc) =
            self.kv.get(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let call = AttentionExtCall {
            q: &q.data,
            k_cache: kc,
            v_cache: vc,
            meta: &self.meta,
            n_heads,
            geo,
            scale,
            window: extras.window,
            softcap: extras.softcap,
            sinks: sinks.and(self.arch.sinks_f32.as_ref()),
            out: &mut out.data,
        };
        Ok(call.launch(&self.dev)?)
    }

    /// Widens the layer's `n_heads` bf16 sink logits into `arch.sinks_f32` (grown on demand:
    /// the op-by-op pass before a recording grows it).
    fn widen_sinks(&mut self, s: &CudaBuf, n_heads: usize) -> Result<(), BackendError> {
        if s.len != n_heads {
            return Err(kerr("attention_ext", format!("{} sinks for {n_heads} heads", s.len)));
        }
        let scratch = match self.arch.sinks_f32.take() {
            Some(buf) if buf.len() >= n_heads => buf,
            _ => self.dev.alloc(n_heads)?,
        };
        let wide = self.arch.sinks_f32.insert(scratch);
        Ok(CastCall { src: &s.data, dst: wide, n: n_heads }.launch(&self.dev)?)
    }

    /// Uploads one `inv_freq` table per layer kind; layer `i` rotates with
    /// `tables[layer_table[i]]` from then on.
    pub(super) fn layer_ropes(&mut self, tables: Vec<RopeTable>, layer_table: Vec<usize>) -> Result<(), BackendError> {
        if let Some(bad) = layer_table.iter().find(|&&t| t >= tables.len()) {
            return Err(kerr("set_layer_ropes", format!("table {bad} of {}", tables.len())));
        }
        // The kernel takes the rotated dims and the attention factor per launch, from
        // `set_rope`'s table: the layer kinds' tables must agree on both (Gemma's do: full
        // rotation, no factor).
        if let Some(first) = tables.first()
            && let Some(other) = tables
                .iter()
                .find(|t| t.head_dim() != first.head_dim() || t.attention_factor() != first.attention_factor())
        {
            return Err(kerr(
                "set_layer_ropes",
                format!(
                    "rotary tables of {} and {} dims, attention factors {} and {}",
                    first.head_dim(),
                    other.head_dim(),
                    first.attention_factor(),
                    other.attention_factor()
                ),
            ));
        }
        let uploaded = tables.iter().map(|t| self.dev.upload(t.inv_freq())).collect::<Result<Vec<_>, _>>()?;
        if let Some(first) = tables.first() {
            self.rotary_dim = Some(first.head_dim());
            self.rope_attention_factor = Some(first.attention_factor()).filter(|f| *f != 1.0);
        }
        self.arch.layer_inv_freq = uploaded;
        self.arch.layer_table = layer_table;
        Ok(())
    }
}

impl CudaBackend {
    /// What every attention launcher does first: the step's metadata staged, `q` checked to hold
    /// the batch's rows of `n_heads` heads, and `out` sized like it. Returns the cache geometry.
    fn attention_prologue(
        &mut self,
        op: &'static str,
        q: &CudaBuf,
        n_heads: usize,
        batch: &BatchLayout,
        out: &mut CudaBuf,
    ) -> Result<KvGeometry, BackendError> {
        let geo = self.geo()?;
        self.step_meta(batch)?;
        let rows = batch.tokens.len();
        let width = n_heads * geo.head_dim;
        if q.len != rows * width {
            return Err(kerr(op, format!("q has {} values for {rows} rows of {width}", q.len)));
        }
        self.ensure(out, rows * width)?;
        Ok(geo)
    }

    /// The tuned attention kernels ([`AttentionCall`]) with `options`, over the bf16 or FP8
    /// cache, at a head_dim they have ([`baton_kernels::cuda::attention_supports`]);
    /// `attention_with` is the router that sends every layer here or to the simple kernel.
    pub(super) fn attention_tuned(
        &mut self,
        layer: usize,
        q: &CudaBuf,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        options: AttentionOptions<'_>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let geo = self.attention_prologue("attention", q, n_heads, batch, out)?;
        self.graphs.n_heads = Some(n_heads);
        let cache = match self.fp8.as_ref() {
            Some(fp8) => fp8.cache_ref(layer)?,
            None => {
                let (k, v) =
                    self.kv.get(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
                KvCacheRef::Bf16 { k, v }
            }
        };
        let split = self.attention_policy();
        // A staged replay is pure decode (and needs its exact split count).
        let kernel =
            if self.graphs.staged.is_some() || !self.prefill_kernel { AttnKernel::DECODE } else { AttnKernel::Mixed };
        let call = AttentionCall {
            q: &q.data,
            cache,
            meta: &mut self.meta,
            n_heads,
            geo,
            scale,
            out: &mut out.data,
            kernel,
            split,
            options,
        };
        Ok(call.launch(&self.dev)?)
    }
}
