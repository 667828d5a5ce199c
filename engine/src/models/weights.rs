//! Reading an architecture's tensors into a backend: [`WeightLoader`] takes named tensors
//! from a `baton_formats::WeightStore` (always in Hugging Face naming and layout), checks
//! each one's element count against the config, and stacks several by rows into one
//! backend matrix or vector (the fused `[q; k; v]` and `[gate; up]`), or transposes a stack of
//! `[in, out]` matrices (gpt-oss's experts) into the `[out, in]` layout. Random weights
//! (`--load-format dummy`) are drawn by the backend itself instead of read.
//!
//! The projections of a layer (q/k/v/o, gate/up/down) are read with [`WeightLoader::linear`]:
//! under FP8 quantization ([`Quantization`]) they become [`Fp8Matrix`]es, read as stored from
//! an FP8 checkpoint or quantized per output channel at load from a bf16/f32 one (random
//! weights too); embeddings, the LM head, norms and MoE experts stay as stored, except that the
//! FP8 experts of an FP8 checkpoint (Qwen3-MoE-FP8, DeepSeek-style block scales) are dequantized
//! at load to bf16 by [`WeightLoader::experts`]: Baton has no FP8 grouped expert GEMM yet.
//!
//! Invariant: every tensor handed to the backend has exactly the elements the caller said,
//! both by its shape and by its bytes (what a device upload reads); an FP8 tensor reaches the
//! backend only as an [`Fp8Matrix`] with its scales.

use super::ModelLoadError;
use crate::backend::Backend;
use baton_formats::{
    ActivationQuant, CounterInit, DType, Fp8ScaleLayout, QuantSource, Quantization, TensorView, WeightStore,
    read_fp8_weight,
};
use baton_kernels::cpu::{ActivationScale, Fp8Matrix};
use rayon::prelude::*;
use std::borrow::Cow;

/// The model's tensors, read from a store or drawn by the backend: each call takes named
/// tensors of `rows × cols` (vectors: `cols` 1) and stacks them by rows into one matrix or
/// vector.
pub struct WeightLoader<'a> {
    store: &'a dyn WeightStore,
    /// Tensors read from the store so far.
    read: usize,
    /// FP8 weight quantization of the projections, when any.
    quantization: Option<Quantization>,
    /// FP8 expert matrices dequantized to bf16 so far ([`WeightLoader::experts`]).
    experts_dequantized: usize,
}

impl<'a> WeightLoader<'a> {
    /// A loader over `store`.
    pub fn new(store: &'a dyn WeightStore) -> Self {
        Self { store, read: 0, quantization: None, experts_dequantized: 0 }
    }

    /// The same loader reading projections under `quantization` (see [`WeightLoader::linear`]).
    pub fn with_quantization(mut self, quantization: Option<Quantization>) -> Self {
        self.quantization = quantization;
        self
    }

    /// A projection (`names` stacked as in [`WeightLoader::mat`]): an FP8 matrix under FP8
    /// quantization unless the quantization skips its modules, else as [`WeightLoader::mat`].
    pub fn linear<B: Backend>(
        &mut self,
        b: &mut B,
        names: &[(String, usize)],
        cols: usize,
    ) -> Result<B::Mat, ModelLoadError> {
        let Some(q) = self.quantization.clone() else { return self.mat(b, names, cols) };
        let act = match q.activations {
            ActivationQuant::None => ActivationScale::None,
            ActivationQuant::DynamicPerToken => ActivationScale::PerToken,
        };
        let skipped: Vec<bool> = names.iter().map(|(n, _)| q.skips(n)).collect();
        if skipped.iter().all(|s| *s) {
            return self.mat(b, names, cols);
        }
        if skipped.iter().any(|s| *s) {
            return Err(ModelLoadError::Fp8 {
                name: names[0].0.clone(),
                message: "some of the fused projections are quantized and some are not".into(),
            });
        }
        if let Some(parts) = self.drawn(names, cols)? {
            // Random weights: drawn and quantized as a bf16 checkpoint would be, by the backend
            // (a device backend where they live).
            return Ok(b.random_mat_fp8(&parts, cols, act)?);
        }
        let store = self.store;
        if q.source == QuantSource::AtLoad && !self.any_stored_fp8(names)? {
            // A bf16/f32 checkpoint quantized per output channel, by the backend (on the device
            // the weights are uploaded to): per row, so the stack quantizes as its parts would.
            let rows = names.iter().map(|n| n.1).sum();
            let views = self.views(names, cols)?;
            return Ok(b.quantize_mat_fp8(&views, rows, cols, act)?);
        }
        let mut mats = Vec::with_capacity(names.len());
        for (name, rows) in names {
            let stored_fp8 = store.get(name)?.dtype == DType::F8E4M3;
            let m = if stored_fp8 {
                let w = read_fp8_weight(store, &q, name, *rows, cols, std::path::Path::new("<checkpoint>"))?;
                let (rb, cb) = match w.layout {
                    Fp8ScaleLayout::PerTensor => (w.rows.max(1), w.cols.max(1)),
                    Fp8ScaleLayout::PerChannel => (1, w.cols.max(1)),
                    Fp8ScaleLayout::Block { rows, cols } => (rows, cols),
                };
                Fp8Matrix::new(w.rows, w.cols, w.codes, w.scales, rb, cb)
            } else if q.source == QuantSource::AtLoad {
                let view = self.views(&[(name.clone(), *rows)], cols)?;
                Fp8Matrix::quantize_per_channel(&view[0].to_f32(), *rows, cols)
            } else {
                return Err(ModelLoadError::Fp8 {
                    name: name.clone(),
                    message: format!(
                        "stored as {:?}, but the checkpoint's quantization covers it",
                        store.get(name)?.dtype
                    ),
                });
            };
            mats.push(m.map_err(|e| ModelLoadError::Fp8 { name: name.clone(), message: e.to_string() })?);
            if stored_fp8 {
                self.read += 1;
            }
        }
        self.upload_fp8(b, names, &mats, act)
    }

    fn upload_fp8<B: Backend>(
        &mut self,
        b: &mut B,
        names: &[(String, usize)],
        mats: &[Fp8Matrix],
        act: ActivationScale,
    ) -> Result<B::Mat, ModelLoadError> {
        let stacked = Fp8Matrix::stack(mats)
            .map_err(|e| ModelLoadError::Fp8 { name: names[0].0.clone(), message: e.to_string() })?;
        Ok(b.upload_mat_fp8(stacked, act)?)
    }

    /// Tensors read from the store so far (0 when every one was drawn).
    pub fn tensors_read(&self) -> usize {
        self.read
    }

    /// The tensors `names`, each `(name, rows)` of `cols` columns, stacked into one matrix.
    pub fn mat<B: Backend>(
        &mut self,
        b: &mut B,
        names: &[(String, usize)],
        cols: usize,
    ) -> Result<B::Mat, ModelLoadError> {
        if let Some(parts) = self.drawn(names, cols)? {
            return Ok(b.random_mat(&parts, cols)?);
        }
        let rows = names.iter().map(|n| n.1).sum();
        Ok(b.upload_mat_raw(&self.views(names, cols)?, rows, cols)?)
    }

    /// MoE expert matrices `names`, stacked as in [`WeightLoader::mat`]. An expert stored as FP8
    /// (an FP8 checkpoint whose quantization covers the experts; `load_model` has checked its
    /// scales) is dequantized here, each value `code × scale` in f32 rounded once to bf16: the
    /// precision a device backend keeps bf16 weights in, and half the host memory of f32 while a
    /// layer's experts are staged. Anything else is read as stored.
    pub fn experts<B: Backend>(
        &mut self,
        b: &mut B,
        names: &[(String, usize)],
        cols: usize,
    ) -> Result<B::Mat, ModelLoadError> {
        let store = self.store;
        let mut any_fp8 = false;
        for (name, _) in names {
            any_fp8 |= store.get(name)?.dtype == DType::F8E4M3;
        }
        if !any_fp8 {
            return self.mat(b, names, cols);
        }
        let q = match &self.quantization {
            Some(q) if q.source != QuantSource::AtLoad => q.clone(),
            _ => {
                let message = "stored as FP8, but the checkpoint declares no FP8 quantization".into();
                return Err(ModelLoadError::Fp8 { name: names[0].0.clone(), message });
            }
        };
        // The FP8 experts dequantized in parallel (a model's experts are most of its weights).
        let dequantized = names
            .par_iter()
            .map(|(name, rows)| -> Result<Option<TensorView<'a>>, ModelLoadError> {
                if store.get(name)?.dtype != DType::F8E4M3 {
                    return Ok(None);
                }
                let w = read_fp8_weight(store, &q, name, *rows, cols, std::path::Path::new("<checkpoint>"))?;
                let bytes = w.dequantize().into_iter().flat_map(|v| half::bf16::from_f32(v).to_le_bytes()).collect();
                let shape = vec![*rows, cols];
                Ok(Some(TensorView { name: name.clone(), shape, dtype: DType::BF16, bytes: Cow::Owned(bytes) }))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut views = Vec::with_capacity(names.len());
        for ((name, rows), view) in names.iter().zip(dequantized) {
            match view {
                Some(v) => {
                    views.push(v);
                    self.read += 1;
                    self.experts_dequantized += 1;
                }
                None => views.extend(self.views(&[(name.clone(), *rows)], cols)?),
            }
        }
        let rows = names.iter().map(|n| n.1).sum();
        Ok(b.upload_mat_raw(&views, rows, cols)?)
    }

    /// FP8 expert matrices dequantized to bf16 so far ([`WeightLoader::experts`]).
    pub fn experts_dequantized(&self) -> usize {
        self.experts_dequantized
    }

    /// The vectors `names`, each `(name, len)`, stacked into one.
    pub fn vec<B: Backend>(&mut self, b: &mut B, names: &[(String, usize)]) -> Result<B::Buf, ModelLoadError> {
        if let Some(parts) = self.drawn(names, 1)? {
            return Ok(b.random_vec(&parts)?);
        }
        Ok(b.upload_vec_raw(&self.views(names, 1)?)?)
    }

    /// The stored tensor `name`, `batches` matrices of `cols × rows` (`[in, out]`, the layout
    /// `x @ W` reads: gpt-oss's `gate_up_proj` `[E, hidden, 2·inter]`), as one matrix of
    /// `batches · rows` rows of `cols`: each batch transposed to the `[out, in]` layout
    /// [`Backend::linear`] reads, the batches stacked in order. The bytes are moved as stored
    /// (no conversion), so a device upload streams them as it does any tensor.
    pub fn mat_transposed<B: Backend>(
        &mut self,
        b: &mut B,
        name: &str,
        batches: usize,
        rows: usize,
        cols: usize,
    ) -> Result<B::Mat, ModelLoadError> {
        let names = [(name.to_string(), batches * rows)];
        if let Some(parts) = self.drawn(&names, cols)? {
            // Random weights are i.i.d.: their layout does not matter.
            return Ok(b.random_mat(&parts, cols)?);
        }
        let stored = self.views(&names, cols)?.remove(0);
        let size = stored.dtype.size();
        let mut bytes = vec![0u8; stored.bytes.len()];
        // (At least 1: an empty tensor has no chunks either way.)
        let matrix = (rows * cols * size).max(1);
        // One matrix (expert) per task, in tiles so that both sides stay in cache (gpt-oss-20b's
        // expert matrices are 2880 × 5760).
        const TILE: usize = 64;
        bytes.par_chunks_exact_mut(matrix).zip(stored.bytes.par_chunks_exact(matrix)).for_each(|(dst, src)| {
            // src is [cols][rows], dst [rows][cols]: element (r, c) moves from c·rows + r.
            for r0 in (0..rows).step_by(TILE) {
                for c0 in (0..cols).step_by(TILE) {
                    for r in r0..(r0 + TILE).min(rows) {
                        for c in c0..(c0 + TILE).min(cols) {
                            let (from, to) = ((c * rows + r) * size, (r * cols + c) * size);
                            dst[to..to + size].copy_from_slice(&src[from..from + size]);
                        }
                    }
                }
            }
        });
        let view = TensorView {
            name: stored.name,
            shape: vec![batches * rows, cols],
            dtype: stored.dtype,
            bytes: Cow::Owned(bytes),
        };
        Ok(b.upload_mat_raw(&[view], batches * rows, cols)?)
    }

    /// Whether any of `names` is stored as FP8.
    fn any_stored_fp8(&self, names: &[(String, usize)]) -> Result<bool, ModelLoadError> {
        for (name, _) in names {
            if self.store.get(name)?.dtype == DType::F8E4M3 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The stored tensors `names`, each checked to hold `rows × cols` elements.
    fn views(&mut self, names: &[(String, usize)], cols: usize) -> Result<Vec<TensorView<'a>>, ModelLoadError> {
        let store = self.store;
        let views = names
            .iter()
            .map(|(name, rows)| {
                let t = store.get(name)?;
                if t.dtype == DType::F8E4M3 {
                    // Its codes mean nothing without their scales (read by `linear`).
                    return Err(ModelLoadError::Fp8 {
                        name: name.clone(),
                        message: "stored as FP8, but Baton reads this tensor unquantized".into(),
                    });
                }
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
    ) -> Result<Option<Vec<(usize, CounterInit)>>, ModelLoadError> {
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
