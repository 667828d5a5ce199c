//! The CPU backend's FP8 (E4M3) KV cache: the quantizing write (with the layer's scales and
//! key shift), FP8 KV scale calibration, and attention over the codes. The reference the CUDA
//! FP8 cache is checked against.
//!
//! Invariants: while the cache is FP8, `fp8_scales` holds one scale per layer and
//! `fp8_k_shift` one shift per layer, each empty (none) or `n_kv_heads × head_dim` long.

use super::{CpuBackend, attend_per_sequence, kerr};
use crate::backend::{BackendError, BatchLayout};
use crate::kv_cache_dtype::{KvAmax, calibrated_scale};
use baton_kernels::cpu::KernelError;
use baton_kernels::cpu::{self as k, AttnExtras, Fp8KvLayerMut, Fp8KvLayerRef, SeqSpan};

impl CpuBackend {
    /// [`Backend::rope_and_write_kv`]'s write into an FP8 cache (`k`, `v` already rotated
    /// and rounded as stored activations).
    pub(super) fn write_kv_fp8(
        &mut self,
        layer: usize,
        kb: &[f32],
        v: &[f32],
        batch: &BatchLayout,
    ) -> Result<(), BackendError> {
        let shape = self.shape()?;
        let stride = shape.num_kv_heads * shape.head_dim;
        if self.kv_calibrate.get(layer).copied().unwrap_or(false) {
            self.calibrate_layer(layer, kb, v, stride, batch)?;
        }
        let scale = self.fp8_layer(layer)?.1;
        let k_shift = self.fp8_k_shift.get(layer).map_or(&[][..], Vec::as_slice);
        let (kc, vc) = self
            .kv_fp8
            .get_mut(layer)
            .ok_or_else(|| BackendError::Device(format!("layer {layer} has no FP8 KV cache")))?;
        let mut cache = Fp8KvLayerMut {
            k: kc,
            v: vc,
            k_scale: scale.k,
            v_scale: scale.v,
            k_shift,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        for s in &batch.seqs {
            let rows = s.row_start * stride..(s.row_start + s.n_tokens) * stride;
            let (Some(kr), Some(vr)) = (kb.get(rows.clone()), v.get(rows)) else {
                return Err(kerr(
                    "write_kv_fp8",
                    format!("rows {}..{} outside the batch", s.row_start, s.row_start + s.n_tokens),
                ));
            };
            k::write_kv_fp8(
                kr,
                vr,
                SeqSpan { start_pos: s.start_pos, n_tokens: s.n_tokens, block_table: &s.block_table },
                &mut cache,
            )?;
        }
        Ok(())
    }

    /// Sets layer `layer`'s scales from the amax of the rows this step writes (each
    /// sequence's chunk; rows of no sequence are never written, so they do not count).
    fn calibrate_layer(
        &mut self,
        layer: usize,
        kb: &[f32],
        v: &[f32],
        stride: usize,
        batch: &BatchLayout,
    ) -> Result<(), BackendError> {
        let mut amax = KvAmax { k: 0.0, v: 0.0 };
        for s in &batch.seqs {
            let rows = s.row_start * stride..(s.row_start + s.n_tokens) * stride;
            let (Some(kr), Some(vr)) = (kb.get(rows.clone()), v.get(rows)) else {
                return Err(kerr(
                    "calibrate_kv_scales",
                    format!("rows of sequence at {} outside the batch", s.row_start),
                ));
            };
            amax = KvAmax { k: k::abs_max(&[amax.k, k::abs_max(kr)]), v: k::abs_max(&[amax.v, k::abs_max(vr)]) };
        }
        let scales =
            self.fp8_scales.as_mut().ok_or_else(|| kerr("calibrate_kv_scales", "the cache is not FP8".into()))?;
        let slot = scales.get_mut(layer).ok_or_else(|| kerr("calibrate_kv_scales", format!("no layer {layer}")))?;
        *slot = calibrated_scale(layer, amax, *slot);
        Ok(())
    }

    /// [`Backend::attention`] (with `extras`: [`Backend::attention_ext`]) over an FP8 cache
    /// (dequantized as it is read).
    pub(super) fn attention_fp8(
        &self,
        layer: usize,
        q: &[f32],
        n_heads: usize,
        scale: f32,
        batch: &BatchLayout,
        extras: AttnExtras<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let shape = self.shape()?;
        let ((kc, vc), kv_scale) = self.fp8_layer(layer)?;
        let width = n_heads * shape.head_dim;
        let cache = Fp8KvLayerRef {
            k: kc,
            v: vc,
            k_scale: kv_scale.k,
            v_scale: kv_scale.v,
            block_size: shape.block_size,
            n_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
        };
        attend_per_sequence(q, out, width, batch, |qr, span, or| {
            k::paged_attention_fp8(qr, n_heads, scale, span, cache, extras, or)
        })?;
        self.store(out);
        Ok(())
    }

    /// [`crate::backend::Backend::set_kv_k_shift`].
    pub(super) fn set_fp8_k_shift(&mut self, layer: usize, shift: &[f32]) -> Result<(), BackendError> {
        let shape = self.shape()?;
        crate::kv_k_smoothing::check_shift(layer, shift, shape.num_kv_heads * shape.head_dim)?;
        let slot = self.fp8_k_shift.get_mut(layer).filter(|_| self.fp8_scales.is_some());
        *slot.ok_or_else(|| BackendError::Device(format!("layer {layer} has no FP8 KV cache")))? = shift.to_vec();
        Ok(())
    }

    /// Elements per block of one layer's K (or V), after checking every block id is in the pool.
    pub(super) fn kv_block_len(&self, blocks: &[u32]) -> Result<usize, BackendError> {
        let shape = self.shape()?;
        if let Some(bad) = blocks.iter().find(|&&b| b as usize >= shape.num_blocks) {
            return Err(BackendError::Kernel(KernelError {
                op: "kv_blocks",
                message: format!("block {bad} is outside the pool of {}", shape.num_blocks),
            }));
        }
        Ok(shape.block_size * shape.num_kv_heads * shape.head_dim)
    }
}
