//! The CUDA backend's FP8 (E4M3) KV cache (`--kv-cache-dtype fp8`): one byte an element,
//! with one K and one V scale per layer. RoPE + KV write quantizes ([`RopeKvFp8Call`]),
//! attention dequantizes as it reads: the tuned decode and prefill kernels through
//! [`KvCacheRef::Fp8`] ([`Fp8Cache::cache_ref`]) for the head dims they are built for, the
//! simple [`AttentionExtFp8Call`] for the others; the KV I/O of the TCP hand-off moves the
//! codes as they are. FP8 KV scale calibration (`--calculate-kv-scales`) runs a read-only
//! pass of the same RoPE ([`RopeKvAmaxCall`]) before a calibrating layer's write. The CPU
//! backend's FP8 cache is the reference (same codes, same scales).
//!
//! Invariants: [`Fp8Cache::layers`] is empty or holds one (K, V) pair of `geo.layer_len()`
//! bytes per layer; `scales` holds one finite, positive [`KvScale`] per layer. While the
//! cache is FP8 the bf16 `kv` is empty, so no bf16 kernel can read it. The device-to-device
//! (NCCL) connector does not move FP8 caches yet: [`CudaBackend::layer_cache`] refuses them.

use super::CudaBackend;
use crate::backend::{AttentionExtras, BackendError, KvCacheShape, KvScale};
use crate::kv_cache_dtype::KvAmax;
use baton_core::kv_transfer::KvDtype;
use baton_kernels::cuda::{
    AttentionExtFp8Call, CudaSlice, KvCacheRef, KvGeometry, RopeExtras, RopeInput, RopeKvAmaxCall, RopeKvFp8Call, bf16,
};

/// The FP8 cache: its per-layer scales and, once allocated, its codes.
pub(super) struct Fp8Cache {
    /// One per layer.
    pub(super) scales: Vec<KvScale>,
    /// (K codes, V codes) per layer.
    pub(super) layers: Vec<(CudaSlice<u8>, CudaSlice<u8>)>,
    /// Layers whose next write calibrates their scales
    /// ([`crate::backend::Backend::calibrate_kv_scales`]); empty when none.
    pub(super) calibrate: Vec<bool>,
    /// A calibration pass's `[max |k|, max |v|]`, allocated by the first calibration.
    pub(super) amax: Option<CudaSlice<f32>>,
    /// Per layer, its key shift ([`crate::kv_k_smoothing`]): the host values (empty for
    /// none) and their device copy, which every key write of the layer reads.
    pub(super) k_shift: Vec<(Vec<f32>, Option<CudaSlice<f32>>)>,
}

impl Fp8Cache {
    /// `layer`'s codes and scales as the tuned attention kernels read them.
    pub(super) fn cache_ref(&self, layer: usize) -> Result<KvCacheRef<'_>, BackendError> {
        let scale = self.scales.get(layer).ok_or_else(|| no_layer(layer))?;
        let (k, v) = self.layers.get(layer).ok_or_else(|| no_layer(layer))?;
        Ok(KvCacheRef::Fp8 { k, v, k_scale: scale.k, v_scale: scale.v })
    }
}

fn no_layer(layer: usize) -> BackendError {
    BackendError::Device(format!("layer {layer} has no FP8 KV cache"))
}

impl CudaBackend {
    /// [`crate::backend::Backend::set_kv_cache_dtype`]: bf16 (the default) or FP8 with
    /// `scales`; drops the cache of the old type.
    pub(super) fn choose_kv_dtype(&mut self, dtype: KvDtype, scales: Vec<KvScale>) -> Result<(), BackendError> {
        match dtype {
            KvDtype::BF16 => self.fp8 = None,
            KvDtype::Fp8E4M3 => {
                for (i, s) in scales.iter().enumerate() {
                    crate::kv_cache_dtype::check_scale(i, s)?;
                }
                let k_shift = (0..scales.len()).map(|_| (Vec::new(), None)).collect();
                self.fp8 = Some(Fp8Cache { scales, layers: Vec::new(), calibrate: Vec::new(), amax: None, k_shift });
            }
            other => {
                return Err(BackendError::Device(format!(
                    "the CUDA backend stores its KV cache as bf16 or fp8_e4m3, not {other:?}"
                )));
            }
        }
        self.kv.clear();
        self.geo = None;
        self.meta_for = None;
        Ok(())
    }

    /// Allocates the FP8 layers of `shape` (`n` bytes each of K and V) when the cache is FP8;
    /// returns whether it did.
    pub(super) fn alloc_fp8_layers(&mut self, shape: &KvCacheShape, n: usize) -> Result<bool, BackendError> {
        let Some(fp8) = self.fp8.as_mut() else { return Ok(false) };
        if fp8.scales.len() != shape.num_layers {
            return Err(BackendError::Device(format!(
                "{} FP8 KV scales for {} layers",
                fp8.scales.len(),
                shape.num_layers
            )));
        }
        fp8.layers.clear();
        for _ in 0..shape.num_layers {
            fp8.layers.push((self.dev.alloc(n)?, self.dev.alloc(n)?));
        }
        Ok(true)
    }

    /// RoPE on `input` and the quantizing write of its k and v into `layer`'s FP8 cache; when
    /// the layer is being calibrated, its scales are set first from a read-only pass over the
    /// same input ([`RopeKvAmaxCall`]; one device-to-host copy of two floats, so this step
    /// waits for the device once per layer: calibration runs once, in an eager prefill step).
    pub(super) fn rope_fp8(
        &mut self,
        layer: usize,
        mut input: RopeInput<'_>,
        n_heads: usize,
        geo: KvGeometry,
        extras: RopeExtras<'_>,
    ) -> Result<(), BackendError> {
        let inv = super::arch_ops::inv_freq_for(&self.arch, self.inv_freq.as_ref(), layer)?;
        let fp8 = self.fp8.as_mut().ok_or_else(|| no_layer(layer))?;
        if fp8.calibrate.get(layer).copied().unwrap_or(false) {
            let amax = match &mut fp8.amax {
                Some(a) => a,
                empty => empty.insert(self.dev.alloc(2)?),
            };
            let stream = self.dev.stream().clone();
            let zero = [0.0f32; 2];
            stream.memcpy_htod(&zero, amax).map_err(super::driver_error)?;
            let call = RopeKvAmaxCall { input: input.reborrow(), amax, meta: &self.meta, inv_freq: inv, n_heads, geo };
            call.launch_with(&self.dev, extras.clone())?;
            let mut got = [0.0f32; 2];
            stream.memcpy_dtoh(&*amax, &mut got).map_err(super::driver_error)?;
            stream.synchronize().map_err(super::driver_error)?;
            let slot = fp8.scales.get_mut(layer).ok_or_else(|| no_layer(layer))?;
            *slot = crate::kv_cache_dtype::calibrated_scale(layer, KvAmax { k: got[0], v: got[1] }, *slot);
        }
        let scale = *fp8.scales.get(layer).ok_or_else(|| no_layer(layer))?;
        let k_shift = fp8.k_shift.get(layer).and_then(|(_, d)| d.as_ref());
        let (kc, vc) = fp8.layers.get_mut(layer).ok_or_else(|| no_layer(layer))?;
        let call = RopeKvFp8Call {
            input,
            k_cache: kc,
            v_cache: vc,
            k_scale: scale.k,
            v_scale: scale.v,
            k_shift,
            meta: &self.meta,
            inv_freq: inv,
            n_heads,
            geo,
        };
        Ok(call.launch_with(&self.dev, extras)?)
    }

    /// [`crate::backend::Backend::set_kv_scale`]: recorded graphs hold the old scales as
    /// launch arguments, so they are dropped.
    pub(super) fn set_fp8_scale(&mut self, layer: usize, scale: KvScale) -> Result<(), BackendError> {
        crate::kv_cache_dtype::check_scale(layer, &scale)?;
        let fp8 = self.fp8.as_mut().ok_or_else(|| no_layer(layer))?;
        *fp8.scales.get_mut(layer).ok_or_else(|| no_layer(layer))? = scale;
        self.drop_graphs();
        Ok(())
    }

    /// [`crate::backend::Backend::set_kv_k_shift`]: the shift is uploaded (or dropped when
    /// empty); recorded graphs hold the old pointer as a launch argument, so they are dropped.
    pub(super) fn set_fp8_k_shift(&mut self, layer: usize, shift: &[f32]) -> Result<(), BackendError> {
        let geo = self.geo()?;
        crate::kv_k_smoothing::check_shift(layer, shift, geo.n_kv_heads * geo.head_dim)?;
        let device = if shift.is_empty() { None } else { Some(self.dev.upload(shift)?) };
        let fp8 = self.fp8.as_mut().ok_or_else(|| no_layer(layer))?;
        *fp8.k_shift.get_mut(layer).ok_or_else(|| no_layer(layer))? = (shift.to_vec(), device);
        self.drop_graphs();
        Ok(())
    }

    /// [`crate::backend::Backend::calibrate_kv_scales`]; stopping drops the recorded graphs
    /// (none should exist before the first prefill, but a recording with the old scales
    /// must never replay).
    pub(super) fn calibrate_fp8(&mut self, layers: &[bool]) -> Result<(), BackendError> {
        match self.fp8.as_mut() {
            Some(fp8) if layers.is_empty() || layers.len() == fp8.scales.len() => fp8.calibrate = layers.to_vec(),
            None if layers.is_empty() => return Ok(()),
            _ => {
                return Err(BackendError::Device(
                    "FP8 KV scale calibration needs an FP8 cache, one flag a layer".into(),
                ));
            }
        }
        self.drop_graphs();
        Ok(())
    }

    /// Causal attention of `q` over `layer`'s FP8 cache (step metadata already set) through
    /// the extended kernel, for head dims the tuned kernels lack, with `extras` and `sinks`
    /// (f32, one per query head).
    pub(super) fn attention_fp8(
        &self,
        layer: usize,
        q: &CudaSlice<bf16>,
        n_heads: usize,
        scale: f32,
        geo: KvGeometry,
        (extras, sinks): (AttentionExtras, Option<&CudaSlice<f32>>),
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), BackendError> {
        let fp8 = self.fp8.as_ref().ok_or_else(|| no_layer(layer))?;
        let kv_scale = *fp8.scales.get(layer).ok_or_else(|| no_layer(layer))?;
        let (kc, vc) = fp8.layers.get(layer).ok_or_else(|| no_layer(layer))?;
        let call = AttentionExtFp8Call {
            q,
            k_cache: kc,
            v_cache: vc,
            k_scale: kv_scale.k,
            v_scale: kv_scale.v,
            meta: &self.meta,
            n_heads,
            geo,
            scale,
            window: extras.window,
            softcap: extras.softcap,
            sinks,
            out,
        };
        Ok(call.launch(&self.dev)?)
    }

    /// [`crate::backend::KvIo::read_kv_blocks`] of an FP8 cache: the codes of `blocks`
    /// (`block_len` bytes each of K and V).
    pub(super) fn read_fp8_blocks(
        &self,
        layer: usize,
        blocks: &[u32],
        block_len: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), BackendError> {
        let fp8 = self.fp8.as_ref().ok_or_else(|| no_layer(layer))?;
        let (kc, vc) = fp8.layers.get(layer).ok_or_else(|| no_layer(layer))?;
        let mut k = vec![0u8; blocks.len() * block_len];
        let mut v = vec![0u8; blocks.len() * block_len];
        let stream = self.dev.stream();
        let mut at = 0;
        for (start, len) in crate::kv_connector::block_runs(blocks) {
            let src = start * block_len..(start + len) * block_len;
            let dst = at..at + len * block_len;
            stream.memcpy_dtoh(&kc.slice(src.clone()), &mut k[dst.clone()]).map_err(super::driver_error)?;
            stream.memcpy_dtoh(&vc.slice(src), &mut v[dst]).map_err(super::driver_error)?;
            at += len * block_len;
        }
        stream.synchronize().map_err(super::driver_error)?;
        Ok((k, v))
    }

    /// [`crate::backend::KvIo::write_kv_blocks`] into an FP8 cache (sizes already checked:
    /// `blocks.len() × block_len` bytes each).
    pub(super) fn write_fp8_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        block_len: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), BackendError> {
        let stream = self.dev.stream().clone();
        let fp8 = self.fp8.as_mut().ok_or_else(|| no_layer(layer))?;
        let (kc, vc) = fp8.layers.get_mut(layer).ok_or_else(|| no_layer(layer))?;
        let mut at = 0;
        for (start, len) in crate::kv_connector::block_runs(blocks) {
            let dst = start * block_len..(start + len) * block_len;
            let src = at..at + len * block_len;
            stream.memcpy_htod(&k[src.clone()], &mut kc.slice_mut(dst.clone())).map_err(super::driver_error)?;
            stream.memcpy_htod(&v[src], &mut vc.slice_mut(dst)).map_err(super::driver_error)?;
            at += len * block_len;
        }
        // The caller's slices must outlive the copies.
        stream.synchronize().map_err(super::driver_error)
    }
}
