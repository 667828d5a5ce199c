//! The loader-independent weight interface: [`WeightStore`] hands out [`TensorView`]s by
//! HF tensor name, in HF shapes, whatever the file format. A view's `bytes` are
//! little-endian elements of `dtype`, exactly `numel * dtype.size()` long.

use std::borrow::Cow;
use std::path::Path;

use half::{bf16, f16};

use crate::config::ModelConfig;
use crate::error::FormatError;

/// Element type of a tensor handed to the engine (quantized GGUF data is dequantized to F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// FP8 E4M3 (`e4m3fn`) codes of a quantized weight; their scales are separate tensors
    /// (see [`crate::quantization`]).
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::F8E4M3 => 1,
        }
    }
}

/// One tensor, borrowed from a memory map where possible.
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    /// HF name.
    pub name: String,
    /// HF shape (row-major, `[out, in]` for linears).
    pub shape: Vec<usize>,
    /// Element type of `bytes`.
    pub dtype: DType,
    /// Little-endian element data.
    pub bytes: Cow<'a, [u8]>,
}

impl TensorView<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements converted to f32 (a copy); FP8 codes become their unscaled values.
    pub fn to_f32(&self) -> Vec<f32> {
        let b = &self.bytes;
        match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::F8E4M3 => b.iter().map(|&c| crate::quantization::e4m3_value(c)).collect(),
        }
    }
}

/// A tensor drawn by the counter generator: element `i` is
/// `mean + amp · (2u − 1)` with `u = (splitmix64(key + (i + 1)·γ) >> 40) · 2⁻²⁴`, computed in
/// f32 one correctly rounded operation at a time (no fused multiply-add), so every device
/// that follows the recipe draws bit-identical values; the CUDA kernel `fill_counter_bf16`
/// does. Uniform on `mean ± amp`, i.e. std `amp / √3`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CounterInit {
    /// Per-tensor key (from the seed and the tensor name).
    pub key: u64,
    /// Centre of the distribution.
    pub mean: f32,
    /// Half-width of the distribution.
    pub amp: f32,
}

/// The golden-ratio increment of splitmix64.
pub const COUNTER_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl CounterInit {
    /// A uniform draw with the given mean and standard deviation.
    pub fn uniform(key: u64, mean: f32, std: f32) -> Self {
        Self { key, mean, amp: std * 3f32.sqrt() }
    }

    /// Element `i`.
    pub fn value(&self, i: u64) -> f32 {
        let mut z = self.key.wrapping_add(i.wrapping_add(1).wrapping_mul(COUNTER_GAMMA));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 24 random bits: exact in f32, as is the scaling by 2⁻²⁴ and 2u − 1.
        let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
        self.mean + self.amp * (2.0 * u - 1.0)
    }
}

/// Source of a model's tensors, by HF name.
pub trait WeightStore: Send + Sync {
    /// The tensor called `name`, or [`FormatError::MissingTensor`].
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError>;
    /// Every tensor name the store can serve.
    fn names(&self) -> Vec<String>;
    /// The shape of `name` without materializing its data where the store can avoid it.
    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        Ok(self.get(name)?.shape)
    }
    /// When `name`'s values are drawn by the counter generator (random weights), how: the
    /// engine may then draw them on its device instead of asking for them. `None` (the
    /// default) for stored weights.
    fn counter_init(&self, _name: &str) -> Option<CounterInit> {
        None
    }
}

/// Checks that `store` has every tensor `config` needs, in the right shape; errors name `path`.
pub fn check_tensors(store: &dyn WeightStore, config: &ModelConfig, path: &Path) -> Result<(), FormatError> {
    let names: std::collections::HashSet<String> = store.names().into_iter().collect();
    for (name, expected) in config.expected_tensors() {
        if !names.contains(&name) {
            return Err(FormatError::MissingTensor { path: path.to_path_buf(), name });
        }
        let shape = store.shape(&name)?;
        if shape != expected {
            return Err(FormatError::ShapeMismatch { path: path.to_path_buf(), name, expected, actual: shape });
        }
    }
    Ok(())
}

/// Little-endian bytes of an f32 slice.
pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
