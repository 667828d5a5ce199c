//! The CPU backend: f32 weights and activations, f32 paged KV cache, kernels
//! from `baton_kernels::cpu`, parallel through the rayon pool the engine
//! thread runs the step in. It is the reference the CUDA backend is checked
//! against, so it favours exactness over speed (f64 norms and RoPE angles).
//!
//! [`CpuBackend::emulating_bf16`] is a second reference: it rounds to bf16 exactly where the
//! CUDA backend stores bf16 (weights; the outputs of every linear, bias add, RMSNorm, RoPE,
//! attention and SiLU·mul; so the KV cache too) and keeps the residual stream and the logits
//! in f32, as the CUDA backend does. A bf16 backend cannot match the exact f32 reference
//! token for token on peaked models (rounding the weights alone changes greedy tokens), but
//! it must match this one.
//!
//! With an FP8 cache ([`Backend::set_kv_cache_dtype`] with `Fp8E4M3`) the cache holds E4M3
//! codes (one byte each) and per-layer K/V scales: writing quantizes, attention
//! dequantizes ([`baton_kernels::cpu::write_kv_fp8`], [`baton_kernels::cpu::paged_attention_fp8`]),
//! and the KV I/O moves the codes. It is the reference for the CUDA FP8 cache.

mod kv_fp8;

use super::{
    AttentionExtras, Backend, BackendError, BatchLayout, KvCacheShape, KvIo, KvScale, MoeActivation, MoeWeights,
    OptionalOp,
};
use crate::kv_cache_dtype::check_scale;
use baton_core::kv_transfer::KvDtype;
use baton_kernels::cpu::{
    self as k, AttnExtras, KernelError, KvLayerMut, KvLayerRef, MoeRouting, NormWeight, RopeTable, SeqSpan,
};

/// A `rows × cols` row-major f32 weight matrix; for an FP8 weight, its dequantized values
/// and how `linear` quantizes its inputs (the reference [`k::linear_fp8`] computes).
#[derive(Debug, Clone)]
pub struct CpuMat {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    /// `Some` for an FP8 weight: the activation quantization of its inputs.
    fp8_act: Option<k::ActivationScale>,
}

/// One layer's FP8 cache: K codes, V codes.
type Fp8Codes = (Vec<u8>, Vec<u8>);

/// The CPU backend. Holds the KV cache and the rotary table.
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// The f32 cache, per layer (K, V); empty with an FP8 cache.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// The FP8 cache's codes, per layer (K, V); empty with an f32 cache.
    kv_fp8: Vec<Fp8Codes>,
    /// The FP8 scales per layer when the cache is FP8, `None` for f32.
    fp8_scales: Option<Vec<KvScale>>,
    /// Layers whose next FP8 write calibrates their scales ([`Backend::calibrate_kv_scales`]).
    kv_calibrate: Vec<bool>,
    /// The FP8 cache's key shift per layer ([`Backend::set_kv_k_shift`]), each empty for none.
    fp8_k_shift: Vec<Vec<f32>>,
    shape: Option<KvCacheShape>,
    rope: Option<RopeTable>,
    /// Rotary tables per layer kind and each layer's index into them (see
    /// [`Backend::set_layer_ropes`]); empty unless a model set them.
    layer_ropes: (Vec<RopeTable>, Vec<usize>),
    /// Round to bf16 where the CUDA backend stores bf16 (see the module doc).
    bf16: bool,
    /// The last LM-head output, `rows × vocab`.
    logits: Vec<f32>,
    vocab: usize,
    /// Claim no optional op (tests of the load-time refusal a GPU backend gives).
    without_optional_ops: bool,
}

impl CpuBackend {
    /// A backend with no KV cache yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend that emulates the CUDA backend's bf16 storage (see the module doc).
    pub fn emulating_bf16() -> Self {
        Self { bf16: true, ..Self::default() }
    }

    /// A backend that implements no [`OptionalOp`], as a device backend may not: models that
    /// need one must refuse it at load.
    pub fn without_optional_ops() -> Self {
        Self { without_optional_ops: true, ..Self::default() }
    }

    /// Rounds `xs` to bf16 in place when emulating bf16 storage.
    fn store(&self, xs: &mut [f32]) {
        if self.bf16 {
            for x in xs {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
    }

    fn shape(&self) -> Result<KvCacheShape, BackendError> {
        self.shape.ok_or_else(|| BackendError::Device("the KV cache was not allocated".into()))
    }

    fn layer(&self, layer: usize) -> Result<&(Vec<f32>, Vec<f32>), BackendError> {
        self.kv.get(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))
    }

    /// Layer `layer`'s FP8 codes and scales.
    fn fp8_layer(&self, layer: usize) -> Result<(&Fp8Codes, KvScale), BackendError> {
        let scale = self.fp8_scales.as_ref().and_then(|s| s.get(layer).copied());
        match (self.kv_fp8.get(layer), scale) {
            (Some(codes), Some(scale)) => Ok((codes, scale)),
            _ => Err(BackendError::Device(format!("layer {layer} has no FP8 KV cache"))),
        }
    }
}

/// `weight` as the factor it scales by under `style` (`1 + w` for Gemma's norms), computed in
/// f32 as transformers does (`1.0 + weight.float()`).
fn styled(weight: &[f32], style: NormWeight) -> Vec<f32> {
    weight.iter().map(|w| w + style.offset()).collect()
}

fn kerr(op: &'static str, message: String) -> BackendError {
    BackendError::Kernel(KernelError { op, message })
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Mat = CpuMat;
    type Res = Vec<f32>;

    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn upload_mat(&mut self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CpuMat, BackendError> {
        if data.len() != rows * cols {
            return Err(kerr("upload_mat", format!("{} values for a {rows}×{cols} matrix", data.len())));
        }
        let mut data = data;
        self.store(&mut data);
        Ok(CpuMat { data, rows, cols, fp8_act: None })
    }

    fn upload_mat_fp8(&mut self, w: k::Fp8Matrix, act: k::ActivationScale) -> Result<CpuMat, BackendError> {
        // Dequantized once, exactly, and not rounded to bf16 even when emulating it: the
        // values are the FP8 codes times their scales, whatever the storage.
        Ok(CpuMat { data: w.dequantize(), rows: w.rows(), cols: w.cols(), fp8_act: Some(act) })
    }

    fn upload_vec(&mut self, data: Vec<f32>) -> Result<Vec<f32>, BackendError> {
        let mut data = data;
        self.store(&mut data);
        Ok(data)
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn alloc_res(&mut self, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn resize(&mut self, buf: &mut Vec<f32>, len: usize) -> Result<(), BackendError> {
        buf.resize(len, 0.0);
        Ok(())
    }

    fn alloc_kv_cache(&mut self, shape: KvCacheShape) -> Result<(), BackendError> {
        if shape.dtype != self.kv_dtype() {
            return Err(BackendError::Device(format!(
                "a {:?} KV cache was asked of a backend set to {:?}",
                shape.dtype,
                self.kv_dtype()
            )));
        }
        let per_layer = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        self.kv.clear();
        self.kv_fp8.clear();
        match &self.fp8_scales {
            Some(scales) => {
                if scales.len() != shape.num_layers {
                    return Err(BackendError::Device(format!(
                        "{} FP8 KV scales for {} layers",
                        scales.len(),
                        shape.num_layers
                    )));
                }
                self.kv_fp8 = (0..shape.num_layers).map(|_| (vec![0; per_layer], vec![0; per_layer])).collect();
            }
            None => {
                self.kv = (0..shape.num_layers).map(|_| (vec![0.0; per_layer], vec![0.0; per_layer])).collect();
            }
        }
        self.shape = Some(shape);
        Ok(())
    }

    fn embed(
        &mut self,
        tokens: &[u32],
        pending: &[(usize, usize)],
        table: &CpuMat,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        if !pending.is_empty() {
            // The model resolves picks made on the host itself; this backend makes no others.
            return Err(BackendError::Kernel(KernelError {
                op: "embed",
                message: "the CPU backend has no device-side sampler picks to embed".into(),
            }));
        }
        out.resize(tokens.len() * table.cols, 0.0);
        Ok(k::embed(tokens, &table.data, table.cols, out)?)
    }

    fn linear(
        &mut self,
        x: &Vec<f32>,
        m: usize,
        w: &CpuMat,
        bias: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        out.resize(m * w.rows, 0.0);
        let x = x
            .get(..m * w.cols)
            .ok_or_else(|| kerr("linear", format!("input has {} values, need {m}×{}", x.len(), w.cols)))?;
        // An FP8 weight with dynamic per-token activation scales: the input rows are quantized
        // first, as `k::linear_fp8` does.
        let quantized;
        let x = if w.fp8_act == Some(k::ActivationScale::PerToken) {
            quantized = {
                let mut q = x.to_vec();
                k::quantize_rows_per_token(&mut q, w.cols);
                q
            };
            &quantized[..]
        } else {
            x
        };
        if !self.bf16 {
            return Ok(k::linear(x, &w.data, bias.map(|b| b.as_slice()), m, w.cols, w.rows, out)?);
        }
        // As on the GPU: the product is stored in bf16, then the bias is added and stored again.
        k::linear(x, &w.data, None, m, w.cols, w.rows, out)?;
        self.store(out);
        if let Some(b) = bias {
            for row in out.chunks_exact_mut(w.rows) {
                for (o, bv) in row.iter_mut().zip(b) {
                    *o += bv;
                }
            }
            self.store(out);
        }
        Ok(())
    }

    fn rms_norm(&mut self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.resize(x.len(), 0.0);
        k::rms_norm(x, weight, eps, out)?;
        self.store(out);
        Ok(())
    }

    fn add_rms_norm(
        &mut self,
        residual: &mut Vec<f32>,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        out.resize(x.len(), 0.0);
        k::add_rms_norm(residual, x, weight, eps, out)?;
        self.store(out);
        Ok(())
    }

    fn gather_res_rows(
        &mut self,
        x: &Vec<f32>,
        width: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.gather_rows(x, width, rows, out)
    }

    fn lm_head(&mut self, x: &Vec<f32>, m: usize, w: &CpuMat) -> Result<(), BackendError> {
        // Not through `linear`: the logits stay f32 (as the CUDA backend's f32-output LM head
        // writes them) even when emulating bf16 storage.
        let x = x
            .get(..m * w.cols)
            .ok_or_else(|| kerr("lm_head", format!("input has {} values, need {m}×{}", x.len(), w.cols)))?;
        self.logits.resize(m * w.rows, 0.0);
        k::linear(x, &w.data, None, m, w.cols, w.rows, &mut self.logits)?;
        self.vocab = w.rows;
        Ok(())
    }

    fn logit_rows(&mut self, rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        let v = self.vocab;
        let have = self.logits.len().checked_div(v).unwrap_or(0);
        if let Some(bad) = rows.iter().find(|&&r| r >= have) {
            return Err(kerr("logit_rows", format!("row {bad} of {have} logit rows")));
        }
        let mut out = Vec::with_capacity(rows.len() * v);
        for &r in rows {
            out.extend_from_slice(&self.logits[r * v..(r + 1) * v]);
        }
        Ok(out)
    }

    fn rope_and_write_kv(
        &mut self,
        layer: usize,
        q: &mut Vec<f32>,
        kb: &mut Vec<f32>,
        v: &Vec<f32>,
        n_heads: usize,
        batch: &BatchLayout,
    ) -> Result<(), BackendError> {
        let shape = self.shape()?;
        let per_layer = self.layer_ropes.1.get(layer).and_then(|&t| self.layer_ropes.0.get(t));
        let rope =
            per_layer.or(self.rope.as_ref()).ok_or_else(|| BackendError::Device("rotary table not set".into()))?;
        // The table covers the rotated dims (all of head_dim unless the rotation is partial).
        rope.apply_partial(q, n_heads, shape.head_dim, &batch.positions)?;
        rope.apply_partial(kb, shape.num_kv_heads, shape.head_dim, &batch.positions)?;
        self.store(q);
        self.store(kb);
        if self.fp8_scales.is_some() {
            return self.write_kv_fp8(layer, kb, v, batch);
        }
        let stride = shape.num_kv_heads * shape.head_dim;
        let (kc, vc) =
            self.kv.get_mut(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let mut cache = KvLayerMut {
            k: kc,
            v: vc,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        for s in &batch.seqs {
            let rows = s.row_start * stride..(s.row_start + s.n_tokens) * stride;
            let (kr, vr) = match (kb.get(rows.clone()), v.get(rows)) {
                (Some(a), Some(b)) => (a, b),
                _ => {
                    return Err(kerr(
                        "write_kv",
                        format!("rows {}..{} outside the batch", s.row_start, s.row_start + s.n_tokens),
                    ));
                }
            };
            k::write_kv(
                kr,
                vr,
                SeqSpan { start_pos: s.start_pos, n_tokens: s.n_tokens, block_table: &s.block_table },
                &mut cache,
            )?;
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &Vec<f32>,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let shape = self.shape()?;
        if self.fp8_scales.is_some() {
            return self.attention_fp8(layer, q, n_heads, scale, batch, AttnExtras::default(), out);
        }
        let (kc, vc) = self.layer(layer)?;
        let width = n_heads * shape.head_dim;
        let cache = KvLayerRef {
            k: kc,
            v: vc,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        attend_per_sequence(q, out, width, batch, |qr, span, or| {
            k::paged_attention(qr, n_heads, scale, span, cache, or)
        })?;
        self.store(out);
        Ok(())
    }

    fn silu_mul(&mut self, gate_up: &Vec<f32>, d: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.resize(gate_up.len() / 2, 0.0);
        k::silu_mul(gate_up, out, d)?;
        self.store(out);
        Ok(())
    }

    fn gather_rows(
        &mut self,
        x: &Vec<f32>,
        width: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        out.resize(rows.len() * width, 0.0);
        for (dst, &r) in out.chunks_mut(width).zip(rows) {
            let src = x
                .get(r * width..(r + 1) * width)
                .ok_or_else(|| kerr("gather_rows", format!("row {r} outside the buffer")))?;
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn split3(
        &mut self,
        x: &Vec<f32>,
        (wa, wb, wc): (usize, usize, usize),
        a: &mut Vec<f32>,
        b: &mut Vec<f32>,
        c: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let w = wa + wb + wc;
        if w == 0 || !x.len().is_multiple_of(w) {
            return Err(kerr("split3", format!("{} values is not a multiple of {w}", x.len())));
        }
        let rows = x.len() / w;
        a.resize(rows * wa, 0.0);
        b.resize(rows * wb, 0.0);
        c.resize(rows * wc, 0.0);
        for (i, row) in x.chunks(w).enumerate() {
            a[i * wa..(i + 1) * wa].copy_from_slice(&row[..wa]);
            b[i * wb..(i + 1) * wb].copy_from_slice(&row[wa..wa + wb]);
            c[i * wc..(i + 1) * wc].copy_from_slice(&row[wa + wb..]);
        }
        Ok(())
    }

    fn to_host(&mut self, buf: &Vec<f32>, len: usize) -> Result<Vec<f32>, BackendError> {
        buf.get(..len)
            .map(<[f32]>::to_vec)
            .ok_or_else(|| kerr("to_host", format!("{len} values requested from a buffer of {}", buf.len())))
    }

    fn set_rope(&mut self, table: RopeTable) -> Result<(), BackendError> {
        self.rope = Some(table);
        Ok(())
    }

    fn kv_dtype(&self) -> KvDtype {
        if self.fp8_scales.is_some() { KvDtype::Fp8E4M3 } else { KvDtype::F32 }
    }

    fn kv_scales(&self) -> Vec<KvScale> {
        self.fp8_scales.clone().unwrap_or_default()
    }

    fn set_kv_scale(&mut self, layer: usize, scale: KvScale) -> Result<(), BackendError> {
        check_scale(layer, &scale)?;
        let slot = self.fp8_scales.as_mut().and_then(|s| s.get_mut(layer));
        *slot.ok_or_else(|| BackendError::Device(format!("layer {layer} has no FP8 KV cache")))? = scale;
        Ok(())
    }

    fn kv_k_shift(&self, layer: usize) -> Vec<f32> {
        self.fp8_k_shift.get(layer).cloned().unwrap_or_default()
    }

    fn set_kv_k_shift(&mut self, layer: usize, shift: &[f32]) -> Result<(), BackendError> {
        self.set_fp8_k_shift(layer, shift)
    }

    fn calibrate_kv_scales(&mut self, layers: &[bool]) -> Result<(), BackendError> {
        match &self.fp8_scales {
            Some(s) if layers.is_empty() || layers.len() == s.len() => {}
            _ if layers.is_empty() => {}
            _ => {
                return Err(BackendError::Device(
                    "FP8 KV scale calibration needs an FP8 cache, one flag a layer".into(),
                ));
            }
        }
        self.kv_calibrate = layers.to_vec();
        Ok(())
    }

    fn set_kv_cache_dtype(&mut self, dtype: KvDtype, scales: Vec<KvScale>) -> Result<(), BackendError> {
        match dtype {
            KvDtype::F32 => {
                self.fp8_scales = None;
                self.fp8_k_shift.clear();
            }
            KvDtype::Fp8E4M3 => {
                for (i, s) in scales.iter().enumerate() {
                    check_scale(i, s)?;
                }
                self.fp8_k_shift = vec![Vec::new(); scales.len()];
                self.fp8_scales = Some(scales);
            }
            other => {
                return Err(BackendError::Device(format!(
                    "the CPU backend stores its KV cache as f32 or fp8_e4m3, not {other:?}"
                )));
            }
        }
        // A cache of the old type is gone: the next `alloc_kv_cache` makes one of the new.
        self.kv.clear();
        self.kv_fp8.clear();
        self.shape = None;
        Ok(())
    }

    fn kv_io(&mut self) -> Option<&mut dyn KvIo> {
        Some(self)
    }

    fn supports(&self, op: OptionalOp) -> bool {
        match op {
            OptionalOp::HeadRmsNorm
            | OptionalOp::Moe
            | OptionalOp::GemmaNorms
            | OptionalOp::EmbedScale
            | OptionalOp::GeluTanhMul
            | OptionalOp::LogitSoftcap
            | OptionalOp::AttentionExtras
            | OptionalOp::LayerRope => !self.without_optional_ops,
        }
    }

    fn rms_norm_styled(
        &mut self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        style: NormWeight,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.buf_rms_norm(x, weight, eps, style, out)
    }

    fn add_rms_norm_styled(
        &mut self,
        residual: &mut Vec<f32>,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        style: NormWeight,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let w = styled(weight, style);
        self.add_rms_norm(residual, x, &w, eps, out)
    }

    fn buf_rms_norm(
        &mut self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        style: NormWeight,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let w = styled(weight, style);
        self.rms_norm(x, &w, eps, out)
    }

    fn split_qk_norm_rope_and_write_kv_styled(
        &mut self,
        layer: usize,
        qkv: &Vec<f32>,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        norms: (&Vec<f32>, &Vec<f32>, f32, NormWeight),
        out: (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<(), BackendError> {
        let (q_w, k_w, eps, style) = norms;
        let (q, kb, v) = out;
        let head_dim = widths.0.checked_div(n_heads).unwrap_or(0);
        for w in [q_w, k_w] {
            if w.len() != head_dim {
                return Err(kerr("head_rms_norm", format!("weight has {} values for head_dim {head_dim}", w.len())));
            }
        }
        self.split3(qkv, widths, q, kb, v)?;
        // Unrounded until after the rotation, as in `split_qk_norm_rope_and_write_kv` (the
        // CUDA kernel fuses the norm into the rotation and rounds once).
        k::head_rms_norm(q, q_w, eps, style)?;
        k::head_rms_norm(kb, k_w, eps, style)?;
        self.rope_and_write_kv(layer, q, kb, v, n_heads, batch)
    }

    fn scale_embedding(&mut self, x: &mut Vec<f32>, s: f32) -> Result<(), BackendError> {
        let mut s = [s];
        self.store(&mut s);
        x.iter_mut().for_each(|v| *v *= s[0]);
        self.store(x);
        Ok(())
    }

    fn gelu_tanh_mul(&mut self, gate_up: &Vec<f32>, d: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.resize(gate_up.len() / 2, 0.0);
        k::gelu_tanh_mul(gate_up, out, d)?;
        self.store(out);
        Ok(())
    }

    fn moe(
        &mut self,
        x: &Vec<f32>,
        m: usize,
        w: MoeWeights<'_, CpuMat, Vec<f32>>,
        routing: MoeRouting,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let (ne, inter) = (w.num_experts, w.intermediate_size);
        let h = w.router.cols;
        let shapes_ok = w.router.rows == ne
            && (w.gate_up.rows, w.gate_up.cols) == (ne * 2 * inter, h)
            && (w.down.rows, w.down.cols) == (ne * h, inter)
            && w.router_bias.is_none_or(|b| b.len() == ne)
            && w.gate_up_bias.is_none_or(|b| b.len() == ne * 2 * inter)
            && w.down_bias.is_none_or(|b| b.len() == ne * h);
        if !shapes_ok || inter == 0 {
            return Err(kerr(
                "moe",
                format!(
                    "router {}×{}, gate_up {}×{}, down {}×{} for {ne} experts of width {inter}",
                    w.router.rows, w.router.cols, w.gate_up.rows, w.gate_up.cols, w.down.rows, w.down.cols
                ),
            ));
        }
        let x = x.get(..m * h).ok_or_else(|| kerr("moe", format!("input has {} values, need {m}×{h}", x.len())))?;
        // Router logits stay f32 (the CUDA backend computes them with an f32-output GEMM and
        // adds the bias in f32).
        let mut logits = vec![0.0; m * ne];
        k::linear(x, &w.router.data, w.router_bias.map(Vec::as_slice), m, h, ne, &mut logits)?;
        let kk = routing.k;
        let (mut ids, mut weights) = (vec![0u32; m * kk], vec![0.0f32; m * kk]);
        k::moe_route(&logits, ne, routing, &mut ids, &mut weights)?;
        let perm = k::moe_permute(&ids, ne)?;
        // Each op's output rounded where the CUDA kernels store bf16 (grouped GEMVs with their
        // bias added before the one rounding, the activation, the un-permuted sum); the
        // routing weights stay f32 there too.
        let mut gate_up = vec![0.0; m * kk * 2 * inter];
        let gu = k::ExpertWeights { w: &w.gate_up.data, n: 2 * inter, d: h, bias: w.gate_up_bias.map(Vec::as_slice) };
        k::moe_grouped_linear(x, k::MoeRows::PerToken, gu, &perm, kk, &mut gate_up)?;
        self.store(&mut gate_up);
        let mut act = vec![0.0; m * kk * inter];
        match w.activation {
            MoeActivation::SiluGated => k::silu_mul(&gate_up, &mut act, inter)?,
            MoeActivation::ClampedSwiglu { alpha, limit } => {
                k::clamped_swiglu(&gate_up, &mut act, inter, alpha, limit)?
            }
        }
        self.store(&mut act);
        let mut expert_out = vec![0.0; m * kk * h];
        let dw = k::ExpertWeights { w: &w.down.data, n: h, d: inter, bias: w.down_bias.map(Vec::as_slice) };
        k::moe_grouped_linear(&act, k::MoeRows::Permuted, dw, &perm, kk, &mut expert_out)?;
        self.store(&mut expert_out);
        out.resize(m * h, 0.0);
        k::moe_unpermute(&expert_out, h, &perm, &weights, kk, None, out)?;
        self.store(out);
        Ok(())
    }

    fn softcap_logits(&mut self, cap: f32) -> Result<(), BackendError> {
        Ok(k::softcap(&mut self.logits, cap)?)
    }

    fn attention_ext(
        &mut self,
        layer: usize,
        q: &Vec<f32>,
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        extras: AttentionExtras,
        sinks: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let shape = self.shape()?;
        let extras = AttnExtras { window: extras.window, softcap: extras.softcap, sinks: sinks.map(Vec::as_slice) };
        if self.fp8_scales.is_some() {
            return self.attention_fp8(layer, q, n_heads, scale, batch, extras, out);
        }
        let (kc, vc) = self.layer(layer)?;
        let width = n_heads * shape.head_dim;
        let cache = KvLayerRef {
            k: kc,
            v: vc,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        attend_per_sequence(q, out, width, batch, |qr, span, or| {
            k::paged_attention_ext(qr, n_heads, scale, span, cache, extras, or)
        })?;
        self.store(out);
        Ok(())
    }

    fn set_layer_ropes(&mut self, tables: Vec<RopeTable>, layer_table: Vec<usize>) -> Result<(), BackendError> {
        if let Some(bad) = layer_table.iter().find(|&&t| t >= tables.len()) {
            return Err(kerr("set_layer_ropes", format!("table {bad} of {}", tables.len())));
        }
        self.layer_ropes = (tables, layer_table);
        Ok(())
    }

    fn head_rms_norm(
        &mut self,
        x: &mut Vec<f32>,
        weight: &Vec<f32>,
        head_dim: usize,
        eps: f32,
    ) -> Result<(), BackendError> {
        head_norm_unrounded(x, weight, head_dim, eps)?;
        self.store(x);
        Ok(())
    }

    /// Split, per-head norm and RoPE with one rounding, after the rotation: the CUDA kernel
    /// fuses the norm into the rotation in f32 and stores bf16 once, and the bf16 emulation
    /// must round where it does (an extra rounding of q and k between the norm and the
    /// rotation moved greedy tokens by up to 0.1 nats on the H100 comparison).
    fn split_qk_norm_rope_and_write_kv(
        &mut self,
        layer: usize,
        qkv: &Vec<f32>,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        (q_norm, k_norm, eps): (&Vec<f32>, &Vec<f32>, f32),
        (q, k, v): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<(), BackendError> {
        if !self.supports(OptionalOp::HeadRmsNorm) {
            return Err(BackendError::Device(format!("{} has no per-head RMSNorm", self.device_name())));
        }
        let head_dim = widths.0.checked_div(n_heads).unwrap_or(0);
        self.split3(qkv, widths, q, k, v)?;
        head_norm_unrounded(q, q_norm, head_dim, eps)?;
        head_norm_unrounded(k, k_norm, head_dim, eps)?;
        self.rope_and_write_kv(layer, q, k, v, n_heads, batch)
    }
}

/// Per-head RMSNorm in f32 (no bf16 rounding): rows of `heads × head_dim` are `heads` rows of
/// `head_dim`, so the row-wise RMSNorm kernel over `head_dim`-wide rows is the per-head norm.
/// Runs `attend` over each sequence's rows of `q` and `out` (`width` values per row), after
/// sizing `out` to the batch: the one loop of the CPU attention variants.
fn attend_per_sequence(
    q: &[f32],
    out: &mut Vec<f32>,
    width: usize,
    batch: &BatchLayout,
    mut attend: impl FnMut(&[f32], SeqSpan<'_>, &mut [f32]) -> Result<(), KernelError>,
) -> Result<(), BackendError> {
    out.resize(batch.tokens.len() * width, 0.0);
    for s in &batch.seqs {
        let rows = s.row_start * width..(s.row_start + s.n_tokens) * width;
        let qr = q.get(rows.clone()).ok_or_else(|| kerr("attention", "query rows outside the batch".into()))?;
        let or = out.get_mut(rows).ok_or_else(|| kerr("attention", "output rows outside the batch".into()))?;
        attend(qr, SeqSpan { start_pos: s.start_pos, n_tokens: s.n_tokens, block_table: &s.block_table }, or)?;
    }
    Ok(())
}

fn head_norm_unrounded(x: &mut [f32], weight: &[f32], head_dim: usize, eps: f32) -> Result<(), BackendError> {
    if weight.len() != head_dim {
        return Err(kerr("head_rms_norm", format!("weight has {} values for head_dim {head_dim}", weight.len())));
    }
    let src = x.to_vec();
    k::rms_norm(&src, weight, eps, x)?;
    Ok(())
}

impl KvIo for CpuBackend {
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError> {
        let block_len = self.kv_block_len(blocks)?;
        if self.fp8_scales.is_some() {
            // The codes as they are: one byte per element.
            let ((kc, vc), _) = self.fp8_layer(layer)?;
            let mut k = Vec::with_capacity(blocks.len() * block_len);
            let mut v = Vec::with_capacity(blocks.len() * block_len);
            for &b in blocks {
                let r = b as usize * block_len..(b as usize + 1) * block_len;
                k.extend_from_slice(&kc[r.clone()]);
                v.extend_from_slice(&vc[r]);
            }
            return Ok((k, v));
        }
        let (kc, vc) =
            self.kv.get(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let mut k = Vec::with_capacity(blocks.len() * block_len * 4);
        let mut v = Vec::with_capacity(blocks.len() * block_len * 4);
        for &b in blocks {
            let r = b as usize * block_len..(b as usize + 1) * block_len;
            k.extend(kc[r.clone()].iter().flat_map(|x| x.to_ne_bytes()));
            v.extend(vc[r].iter().flat_map(|x| x.to_ne_bytes()));
        }
        Ok((k, v))
    }

    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        let block_len = self.kv_block_len(blocks)?;
        let want = blocks.len() * block_len * self.kv_dtype().size();
        if k.len() != want || v.len() != want {
            return Err(BackendError::Kernel(KernelError {
                op: "write_kv_blocks",
                message: format!(
                    "{} blocks need {want} bytes each of K and V, got {} and {}",
                    blocks.len(),
                    k.len(),
                    v.len()
                ),
            }));
        }
        if self.fp8_scales.is_some() {
            let (kc, vc) = self
                .kv_fp8
                .get_mut(layer)
                .ok_or_else(|| BackendError::Device(format!("layer {layer} has no FP8 KV cache")))?;
            for (i, &b) in blocks.iter().enumerate() {
                let dst = b as usize * block_len..(b as usize + 1) * block_len;
                let src = i * block_len..(i + 1) * block_len;
                kc[dst.clone()].copy_from_slice(&k[src.clone()]);
                vc[dst].copy_from_slice(&v[src]);
            }
            return Ok(());
        }
        let (kc, vc) =
            self.kv.get_mut(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        for (i, &b) in blocks.iter().enumerate() {
            let dst = b as usize * block_len..(b as usize + 1) * block_len;
            let src = i * block_len * 4..(i + 1) * block_len * 4;
            for (d, s) in kc[dst.clone()].iter_mut().zip(k[src.clone()].chunks_exact(4)) {
                *d = f32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
            }
            for (d, s) in vc[dst].iter_mut().zip(v[src].chunks_exact(4)) {
                *d = f32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_rms_norm_normalises_each_head_on_its_own() {
        // Two rows of three heads of 4, heads of very different scales.
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * (1 + i / 4) as f32).collect();
        let w = vec![0.5f32, -1.0, 2.0, 0.25];
        let mut b = CpuBackend::new();
        assert!(b.supports(OptionalOp::HeadRmsNorm));
        let mut got = x.clone();
        b.head_rms_norm(&mut got, &w, 4, 1e-6).expect("head norm");
        for (h, src) in x.chunks(4).enumerate() {
            let rms = (src.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / 4.0 + 1e-6).sqrt();
            for i in 0..4 {
                let want = f64::from(src[i]) / rms * f64::from(w[i]);
                assert!((f64::from(got[h * 4 + i]) - want).abs() < 1e-5, "head {h} elem {i}");
            }
        }
        // The weight must be one head wide, and the buffer whole heads.
        assert!(b.head_rms_norm(&mut x.clone(), &w, 8, 1e-6).is_err());
        assert!(b.head_rms_norm(&mut vec![0.0; 6], &w, 4, 1e-6).is_err());
        // The bf16 emulation rounds the output like every other op.
        let mut e = CpuBackend::emulating_bf16();
        let mut rounded = x.clone();
        e.head_rms_norm(&mut rounded, &w, 4, 1e-6).expect("bf16 head norm");
        assert!(rounded.iter().all(|v| half::bf16::from_f32(*v).to_f32() == *v));
        assert!(rounded.iter().zip(&got).all(|(a, b)| (a - b).abs() <= 1e-2 * b.abs().max(1e-3)));
    }
}
