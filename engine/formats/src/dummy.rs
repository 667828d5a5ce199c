//! Random weights for a config's exact shapes (`--load-format dummy`), generated on demand
//! in `get` so an 8B-shaped model costs no memory until the engine asks for a tensor. Each
//! tensor's values depend only on (seed, tensor name), in fixed-size chunks generated in
//! parallel, so they are identical across runs and thread counts.

use std::borrow::Cow;
use std::collections::HashMap;

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::FormatError;
use crate::tensor::{DType, TensorView, WeightStore};

/// Elements generated from one RNG stream; fixed so results do not depend on threading.
const CHUNK: usize = 1 << 16;

/// Seeded random weights: linears and embeddings ~ N(0, std²), norms ~ 1 + N(0, (std/2)²)
/// … kept near one so activations neither vanish nor explode, biases ~ N(0, std²).
#[derive(Debug, Clone)]
pub struct DummyStore {
    shapes: HashMap<String, Vec<usize>>,
    seed: u64,
    std: f32,
    dtype: DType,
}

impl DummyStore {
    /// A store for `config` producing `dtype` tensors with init std `std`.
    pub fn new(config: &ModelConfig, seed: u64, std: f32, dtype: DType) -> Self {
        Self { shapes: config.expected_tensors().into_iter().collect(), seed, std, dtype }
    }

    /// The f32 values of `name` (the same values `get` returns before dtype conversion).
    pub fn values(&self, name: &str) -> Result<Vec<f32>, FormatError> {
        let numel: usize = self.shape_ref(name)?.iter().product();
        let mut out = vec![0f32; numel];
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, chunk)| self.fill_chunk(name, ci, chunk));
        Ok(out)
    }

    fn shape_ref(&self, name: &str) -> Result<&Vec<usize>, FormatError> {
        self.shapes.get(name).ok_or_else(|| FormatError::MissingTensor { path: "dummy".into(), name: name.to_string() })
    }

    /// Fills chunk `ci` (elements `ci * CHUNK ..`) of tensor `name`.
    fn fill_chunk(&self, name: &str, ci: usize, chunk: &mut [f32]) {
        let is_norm = name.ends_with("norm.weight");
        let (mean, std) = if is_norm { (1.0, self.std * 0.5) } else { (0.0, self.std) };
        let stream = fnv1a(name.as_bytes()) ^ self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = StdRng::seed_from_u64(stream.wrapping_add((ci as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)));
        for pair in chunk.chunks_mut(2) {
            let (a, b) = box_muller(&mut rng);
            pair[0] = mean + std * a;
            if let Some(x) = pair.get_mut(1) {
                *x = mean + std * b;
            }
        }
    }
}

/// Two independent standard normals.
fn box_muller(rng: &mut StdRng) -> (f32, f32) {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let t = 2.0 * std::f64::consts::PI * u2;
    ((r * t.cos()) as f32, (r * t.sin()) as f32)
}

/// FNV-1a: a stable (across Rust versions) hash of the tensor name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl WeightStore for DummyStore {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let shape = self.shape_ref(name)?.clone();
        let numel: usize = shape.iter().product();
        let size = self.dtype.size();
        // Generated chunk by chunk straight into the output bytes: no f32 copy of the
        // whole tensor (2 GB for an 8B model's embedding).
        let mut bytes = vec![0u8; numel * size];
        bytes.par_chunks_mut(CHUNK * size).enumerate().for_each(|(ci, out)| {
            let mut vals = vec![0f32; out.len() / size];
            self.fill_chunk(name, ci, &mut vals);
            for (o, v) in out.chunks_exact_mut(size).zip(&vals) {
                match self.dtype {
                    DType::F32 => o.copy_from_slice(&v.to_le_bytes()),
                    DType::F16 => o.copy_from_slice(&f16::from_f32(*v).to_le_bytes()),
                    DType::BF16 => o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes()),
                }
            }
        });
        Ok(TensorView { name: name.to_string(), shape, dtype: self.dtype, bytes: Cow::Owned(bytes) })
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.shapes.keys().cloned().collect();
        v.sort();
        v
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.shapes
            .get(name)
            .cloned()
            .ok_or_else(|| FormatError::MissingTensor { path: "dummy".into(), name: name.to_string() })
    }
}
