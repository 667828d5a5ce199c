//! Random weights for a config's exact shapes (`--load-format dummy`), generated on demand
//! in `get` so an 8B-shaped model costs no memory until the engine asks for a tensor. Each
//! tensor's values depend only on (seed, tensor name), in fixed-size chunks generated in
//! parallel, so they are identical across runs and thread counts.
//!
//! Two generators:
//! - [`DummyKind::Normal`]: N(mean, std²) from seeded streams (Box–Muller). The tiny test
//!   models and their committed golden fixtures are drawn this way, so it never changes.
//! - [`DummyKind::Counter`]: uniform with the same mean and std, each element a pure function
//!   of (seed, tensor name, index) ([`CounterInit::value`]) in exactly rounded f32 steps. A
//!   device can draw a tensor where it lives (the CUDA backend does, in milliseconds, instead
//!   of generating 16 GB on the host and uploading it) and get the very values the host
//!   would: [`WeightStore::counter_init`] tells the engine which tensors it may draw itself.

use std::borrow::Cow;
use std::collections::HashMap;

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::FormatError;
use crate::tensor::{CounterInit, DType, TensorView, WeightStore};

/// Elements generated from one RNG stream; fixed so results do not depend on threading.
const CHUNK: usize = 1 << 16;

/// Which distribution a [`DummyStore`] draws from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DummyKind {
    /// Normal, from seeded streams: the test models' generator.
    Normal,
    /// Uniform, a pure function of (seed, name, index): drawable on any device.
    Counter,
}

/// Seeded random weights: linears and embeddings with mean 0 and std `std`, norms with mean
/// 1 and std `std/2` (kept near one so activations neither vanish nor explode), biases with
/// mean 0 and std `std`; normal or uniform by [`DummyKind`].
#[derive(Debug, Clone)]
pub struct DummyStore {
    shapes: HashMap<String, Vec<usize>>,
    seed: u64,
    std: f32,
    dtype: DType,
    kind: DummyKind,
}

impl DummyStore {
    /// A store for `config` producing `dtype` tensors with init std `std`, normally
    /// distributed ([`DummyKind::Normal`]). FP8 is not drawn directly: an `F8E4M3` store
    /// draws bf16 (the engine quantizes random weights under `--quantization fp8`).
    pub fn new(config: &ModelConfig, seed: u64, std: f32, dtype: DType) -> Self {
        let dtype = if dtype == DType::F8E4M3 { DType::BF16 } else { dtype };
        Self { shapes: config.expected_tensors().into_iter().collect(), seed, std, dtype, kind: DummyKind::Normal }
    }

    /// The same store drawing from `kind`.
    pub fn with_kind(mut self, kind: DummyKind) -> Self {
        self.kind = kind;
        self
    }

    /// The counter generator's parameters for `name` (mean, std and a key from the seed and
    /// the name), whatever this store's kind.
    fn counter(&self, name: &str) -> CounterInit {
        let (mean, std) = mean_std(name, self.std);
        CounterInit::uniform(fnv1a(name.as_bytes()) ^ self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), mean, std)
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
        if self.kind == DummyKind::Counter {
            let init = self.counter(name);
            let first = (ci * CHUNK) as u64;
            for (i, x) in chunk.iter_mut().enumerate() {
                *x = init.value(first + i as u64);
            }
            return;
        }
        let (mean, std) = mean_std(name, self.std);
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

/// Mean and std of tensor `name` for a store of init std `std`.
fn mean_std(name: &str, std: f32) -> (f32, f32) {
    if name.ends_with("norm.weight") { (1.0, std * 0.5) } else { (0.0, std) }
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
                    DType::BF16 | DType::F8E4M3 => o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes()),
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

    fn counter_init(&self, name: &str) -> Option<CounterInit> {
        (self.kind == DummyKind::Counter && self.shapes.contains_key(name)).then(|| self.counter(name))
    }
}
