//! The KV cache's element type (`--kv-cache-dtype`) and the per-layer FP8 scales.
//!
//! `auto` keeps the backend's own storage (f32 on the CPU, bf16 on CUDA: the model's
//! compute dtype); `fp8` (or vLLM's spelling `fp8_e4m3`) stores E4M3 codes, one byte per
//! element, which doubles the KV blocks a bf16 budget holds. `fp8_e5m2` is refused by name
//! (not implemented).
//!
//! Scales: one f32 for K and one for V in each layer; a cached value is stored as
//! `e4m3(x / scale)` and read as `code × scale` (`baton_kernels::cpu::fp8`). They come from
//! the checkpoint where it has them, under vLLM's names
//! (`model.layers.N.self_attn.k_scale` / `v_scale`, or the older single
//! `model.layers.N.self_attn.kv_scale` for both), else 1.0, which suits activations within
//! ±448. Invariant: every scale the engine uses is finite and positive; a NaN, infinite,
//! zero or negative scale, or one that is not a single value, is refused at load, naming the
//! tensor. No calibration pass is run: a checkpoint whose K or V exceed ±448 needs its scales.

use baton_core::kv_transfer::KvDtype;
use baton_formats::WeightStore;
use std::str::FromStr;

/// What `--kv-cache-dtype` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The backend's own storage (the model's compute dtype).
    #[default]
    Auto,
    /// bfloat16 (the CUDA backend's storage).
    Bf16,
    /// FP8 E4M3 with per-layer K and V scales.
    Fp8E4M3,
}

/// A `--kv-cache-dtype` value Baton does not implement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseKvCacheDtypeError {
    /// vLLM's E5M2 FP8 cache: a known format this build does not store.
    #[error("--kv-cache-dtype {0} is not implemented; use fp8 (fp8_e4m3), bf16 or auto")]
    Unimplemented(String),
    /// Not a KV cache dtype at all.
    #[error("invalid --kv-cache-dtype '{0}': expected auto, bf16, fp8 or fp8_e4m3")]
    Unknown(String),
}

impl FromStr for KvCacheDtype {
    type Err = ParseKvCacheDtypeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4M3),
            "fp8_e5m2" => Err(ParseKvCacheDtypeError::Unimplemented(s.trim().to_string())),
            _ => Err(ParseKvCacheDtypeError::Unknown(s.to_string())),
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Bf16 => "bf16",
            Self::Fp8E4M3 => "fp8_e4m3",
        })
    }
}

/// Config files spell it as the flag does (`kv_cache_dtype = "fp8"`); a bad value is an
/// error naming it.
impl<'de> serde::Deserialize<'de> for KvCacheDtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl KvCacheDtype {
    /// The element type to store, on a backend whose own storage is `native`.
    pub fn resolve(self, native: KvDtype) -> KvDtype {
        match self {
            Self::Auto => native,
            Self::Bf16 => KvDtype::BF16,
            Self::Fp8E4M3 => KvDtype::Fp8E4M3,
        }
    }
}

/// One layer's FP8 scales: a K value `x` is stored as `e4m3(x / k)`, read as `code × k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScale {
    /// The keys' scale.
    pub k: f32,
    /// The values' scale.
    pub v: f32,
}

impl Default for KvScale {
    fn default() -> Self {
        Self { k: 1.0, v: 1.0 }
    }
}

/// A checkpoint's KV scale that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvScaleError {
    /// Not one value (a per-head or per-channel scale is not implemented).
    #[error("KV scale tensor {name} has shape {shape:?}; expected a single value")]
    Shape {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// NaN, infinite, zero or negative.
    #[error("KV scale tensor {name} is {value}; a scale must be finite and positive")]
    Value {
        /// The tensor.
        name: String,
        /// Its value.
        value: f32,
    },
    /// The store failed to read it.
    #[error("KV scale tensor {name}: {message}")]
    Read {
        /// The tensor.
        name: String,
        /// What went wrong.
        message: String,
    },
}

/// The FP8 scales of each of `num_layers` layers from `store` (see the module doc for the
/// names read and the defaults), every one checked.
pub fn load_kv_scales(store: &dyn WeightStore, num_layers: usize) -> Result<Vec<KvScale>, KvScaleError> {
    let names: std::collections::HashSet<String> = store.names().into_iter().collect();
    let read = |name: String| -> Result<Option<f32>, KvScaleError> {
        if !names.contains(&name) {
            return Ok(None);
        }
        let t = store.get(&name).map_err(|e| KvScaleError::Read { name: name.clone(), message: e.to_string() })?;
        if t.numel() != 1 {
            return Err(KvScaleError::Shape { name, shape: t.shape.clone() });
        }
        // Read as NaN (refused below) if the bytes fall short of the one element.
        let value = t.to_f32().first().copied().unwrap_or(f32::NAN);
        if !(value.is_finite() && value > 0.0) {
            return Err(KvScaleError::Value { name, value });
        }
        Ok(Some(value))
    };
    (0..num_layers)
        .map(|i| {
            let prefix = format!("model.layers.{i}.self_attn");
            let both = read(format!("{prefix}.kv_scale"))?;
            let k = read(format!("{prefix}.k_scale"))?.or(both).unwrap_or(1.0);
            let v = read(format!("{prefix}.v_scale"))?.or(both).unwrap_or(1.0);
            Ok(KvScale { k, v })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_formats::{DType, FormatError, TensorView};
    use std::collections::HashMap;

    /// Named f32 tensors in memory.
    struct Store(HashMap<String, (Vec<usize>, Vec<f32>)>);

    impl WeightStore for Store {
        fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
            let (shape, data) = self
                .0
                .get(name)
                .ok_or_else(|| FormatError::MissingTensor { path: "mem".into(), name: name.to_string() })?;
            Ok(TensorView {
                name: name.to_string(),
                shape: shape.clone(),
                dtype: DType::F32,
                bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into(),
            })
        }
        fn names(&self) -> Vec<String> {
            self.0.keys().cloned().collect()
        }
    }

    fn store(entries: &[(&str, Vec<usize>, f32)]) -> Store {
        Store(entries.iter().map(|(n, s, v)| (n.to_string(), (s.clone(), vec![*v; s.iter().product()]))).collect())
    }

    #[test]
    fn scales_come_from_the_checkpoint_else_one() {
        let s = store(&[
            ("model.layers.0.self_attn.k_scale", vec![], 0.5),
            ("model.layers.0.self_attn.v_scale", vec![1], 0.25),
            ("model.layers.2.self_attn.kv_scale", vec![], 2.0),
            ("model.layers.2.self_attn.v_scale", vec![], 3.0),
        ]);
        let scales = load_kv_scales(&s, 3).expect("valid scales");
        assert_eq!(
            scales,
            vec![KvScale { k: 0.5, v: 0.25 }, KvScale { k: 1.0, v: 1.0 }, KvScale { k: 2.0, v: 3.0 }],
            "layer 1 has none: 1.0; layer 2's kv_scale serves K, its own v_scale V"
        );
    }

    #[test]
    fn bad_scales_are_refused_naming_the_tensor() {
        for (value, shape) in
            [(f32::NAN, vec![]), (0.0, vec![]), (-1.0, vec![1]), (f32::INFINITY, vec![]), (1.0, vec![2])]
        {
            let name = "model.layers.1.self_attn.v_scale";
            let err = load_kv_scales(&store(&[(name, shape.clone(), value)]), 2).expect_err("refused");
            assert!(err.to_string().contains(name), "{err}");
            match err {
                KvScaleError::Shape { shape: got, .. } => assert_eq!(got, shape),
                KvScaleError::Value { value: got, .. } => assert!(got.is_nan() || got == value),
                KvScaleError::Read { .. } => panic!("read error for {value} {shape:?}"),
            }
        }
    }

    #[test]
    fn parses_vllm_spellings_and_refuses_e5m2_by_name() {
        assert_eq!("auto".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Auto));
        assert_eq!("fp8".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Fp8E4M3));
        assert_eq!("FP8_E4M3".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Fp8E4M3));
        assert_eq!("bf16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
        let e5m2 = "fp8_e5m2".parse::<KvCacheDtype>().expect_err("not implemented");
        assert!(e5m2.to_string().contains("fp8_e5m2"), "{e5m2}");
        assert!(matches!("int8".parse::<KvCacheDtype>(), Err(ParseKvCacheDtypeError::Unknown(_))));
        for d in [KvCacheDtype::Auto, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4M3] {
            assert_eq!(d.to_string().parse::<KvCacheDtype>(), Ok(d));
        }
        assert_eq!(KvCacheDtype::Auto.resolve(KvDtype::F32), KvDtype::F32);
        assert_eq!(KvCacheDtype::Fp8E4M3.resolve(KvDtype::BF16), KvDtype::Fp8E4M3);
    }
}
