//! The CUDA backend's RoPE + KV write entry points: q (and k) rotated, k and v written to
//! the paged cache of one layer, from separate q/k/v buffers or from the fused QKV GEMM output,
//! optionally with the per-head q/k norm fused in. Each picks the layer's rotary table
//! (per layer kind where the model has several), the partial rotation and attention factor, and
//! the FP8 path when the cache is e4m3 (cuda_kv_fp8.rs).
//!
//! Invariants: shapes are checked before any launch; nothing here allocates beyond growing `q`
//! to the step's rows (graph-safe once the largest step has run).

use super::{CudaBackend, CudaBuf, arch_ops, kerr};
use crate::backend::{BackendError, BatchLayout};
use baton_kernels::cpu::NormWeight;
use baton_kernels::cuda::{KvGeometry, QkNorm, RopeExtras, RopeInput, RopeKvCall};

impl CudaBackend {
    pub(super) fn rope_split_write_kv(
        &mut self,
        layer: usize,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        n_heads: usize,
        batch: &BatchLayout,
    ) -> Result<(), BackendError> {
        let geo = self.geo()?;
        self.step_meta(batch)?;
        let rows = batch.tokens.len();
        let kvw = geo.n_kv_heads * geo.head_dim;
        if q.len != rows * n_heads * geo.head_dim || k.len != rows * kvw || v.len != rows * kvw {
            return Err(kerr(
                "rope_and_write_kv",
                format!("q {} k {} v {} values for {rows} rows", q.len, k.len, v.len),
            ));
        }
        let input = RopeInput::Split { q: &mut q.data, k: &mut k.data, v: &v.data };
        self.rope_write(layer, input, n_heads, geo, None)
    }

    pub(super) fn rope_fused_write_kv(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        q: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        self.rope_fused(layer, qkv, widths, n_heads, batch, q, None)
    }

    pub(super) fn rope_fused_qk_norm_write_kv(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        widths: (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        (q_norm, k_norm, eps, style): (&CudaBuf, &CudaBuf, f32, NormWeight),
        q: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let head_dim = self.geo()?.head_dim;
        if q_norm.len != head_dim || k_norm.len != head_dim {
            return Err(kerr(
                "split_qk_norm_rope_and_write_kv",
                format!("q/k norm weights of {} and {} values, head_dim {head_dim}", q_norm.len, k_norm.len),
            ));
        }
        // The norm is fused into the rotation: normalised heads never round-trip through memory.
        let qk_norm = QkNorm { q_weight: &q_norm.data, k_weight: &k_norm.data, eps, weight: style };
        self.rope_fused(layer, qkv, widths, n_heads, batch, q, Some(qk_norm))
    }

    /// The fused-QKV entry points: checks the widths, then rotates q into `q` and writes k, v.
    fn rope_fused(
        &mut self,
        layer: usize,
        qkv: &CudaBuf,
        (qd, kvd, kvd2): (usize, usize, usize),
        n_heads: usize,
        batch: &BatchLayout,
        q: &mut CudaBuf,
        qk_norm: Option<QkNorm<'_>>,
    ) -> Result<(), BackendError> {
        let geo = self.geo()?;
        self.step_meta(batch)?;
        let rows = batch.tokens.len();
        let kvw = geo.n_kv_heads * geo.head_dim;
        if qd != n_heads * geo.head_dim || kvd != kvw || kvd2 != kvw || qkv.len != rows * (qd + 2 * kvw) {
            return Err(kerr(
                "split_rope_and_write_kv",
                format!("qkv {} values, widths ({qd}, {kvd}, {kvd2}) for {rows} rows of {n_heads} heads", qkv.len),
            ));
        }
        self.ensure(q, rows * qd)?;
        let input = RopeInput::Fused { qkv: &qkv.data, q_out: &mut q.data };
        self.rope_write(layer, input, n_heads, geo, qk_norm)
    }

    /// One launch of the RoPE + KV write into layer `layer`'s cache with the layer's rotary
    /// table, partial rotation and attention factor: the FP8 kernel when the cache is e4m3.
    fn rope_write(
        &mut self,
        layer: usize,
        input: RopeInput<'_>,
        n_heads: usize,
        geo: KvGeometry,
        qk_norm: Option<QkNorm<'_>>,
    ) -> Result<(), BackendError> {
        let extras = RopeExtras { qk_norm, rotary_dim: self.rotary_dim, attention_factor: self.rope_attention_factor };
        if self.fp8.is_some() {
            return self.rope_fp8(layer, input, n_heads, geo, extras);
        }
        let inv = arch_ops::inv_freq_for(&self.arch, self.inv_freq.as_ref(), layer)?;
        let (kc, vc) =
            self.kv.get_mut(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let call = RopeKvCall { input, k_cache: kc, v_cache: vc, meta: &self.meta, inv_freq: inv, n_heads, geo };
        Ok(call.launch_with(&self.dev, extras)?)
    }
}
