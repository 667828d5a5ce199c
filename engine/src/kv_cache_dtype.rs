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
//! tensor.
//!
//! Calibration (`--calculate-kv-scales`, vLLM's option and semantics): on the first forward
//! step that has prefill tokens, each layer's scales become `amax(|K|) / K_SCALE_CONSTANT` and
//! `amax(|V|) / V_SCALE_CONSTANT` ([`calibrated_scale`]), over that step's new K (after RoPE,
//! and after the q/k norm where the model has one, exactly the values the cache stores) and V,
//! computed before the step writes them; they are then fixed for the life of the engine. As in
//! vLLM, calculated scales replace the checkpoint's where it has them (the user asked for
//! them). A zero or non-finite amax keeps the layer's scale (1.0 unless the checkpoint gave
//! one) and says so in a warning. Invariant: every scale the engine uses stays finite and
//! positive, calibrated or not.

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

/// How one layer's FP8 codes were written, as a hand-off carries it: keys as
/// `e4m3((k - k_shift) / scale.k)`, values as `e4m3(v / scale.v)` (see
/// [`crate::kv_k_smoothing`]; an empty `k_shift` is none).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvCoding {
    /// The layer's scales.
    pub scale: KvScale,
    /// The layer's key shift, `n_kv_heads × head_dim` values or empty.
    pub k_shift: Vec<f32>,
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

/// vLLM's `K_SCALE_CONSTANT` (`vllm/envs.py`, default 200): a calibrated K scale maps the
/// step's largest |K| to code 200, leaving E4M3's range up to 448 for later, larger keys.
pub const K_SCALE_CONSTANT: f32 = 200.0;

/// vLLM's `V_SCALE_CONSTANT` (default 100): the largest |V| maps to code 100.
pub const V_SCALE_CONSTANT: f32 = 100.0;

/// The largest magnitudes of one layer's new K and V in a calibration step (NaN when a value
/// was NaN: the reductions propagate it, so a bad step cannot pass for a good one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvAmax {
    /// max |K| over the step's rows.
    pub k: f32,
    /// max |V| over the step's rows.
    pub v: f32,
}

/// Layer `layer`'s scales from its calibration amax (see the module doc): `amax / constant`
/// for K and V, each falling back to `old`'s where its amax is zero or not finite (a warning
/// names the layer and the value).
pub fn calibrated_scale(layer: usize, amax: KvAmax, old: KvScale) -> KvScale {
    let one = |which: &str, amax: f32, constant: f32, old: f32| {
        let s = amax / constant;
        if amax.is_finite() && amax > 0.0 && s.is_finite() && s > 0.0 {
            s
        } else {
            tracing::warn!(
                layer,
                which,
                amax,
                kept = old,
                "FP8 KV scale calibration: unusable amax; keeping the scale"
            );
            old
        }
    };
    KvScale { k: one("k", amax.k, K_SCALE_CONSTANT, old.k), v: one("v", amax.v, V_SCALE_CONSTANT, old.v) }
}

/// Ok when both of layer `layer`'s scales are finite and positive (what every backend holds
/// to), else a device error naming the layer.
pub fn check_scale(layer: usize, s: &KvScale) -> Result<(), crate::backend::BackendError> {
    if s.k.is_finite() && s.k > 0.0 && s.v.is_finite() && s.v > 0.0 {
        Ok(())
    } else {
        Err(crate::backend::BackendError::Device(format!(
            "layer {layer}'s FP8 KV scales {s:?} are not finite and positive"
        )))
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
    /// `--calculate-kv-scales` on a cache that is not FP8.
    #[error("--calculate-kv-scales needs an FP8 KV cache (--kv-cache-dtype fp8); this cache stores {dtype}")]
    CalibrationWithoutFp8 {
        /// The cache's element type.
        dtype: String,
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
                KvScaleError::Read { .. } | KvScaleError::CalibrationWithoutFp8 { .. } => {
                    panic!("unexpected error for {value} {shape:?}")
                }
            }
        }
    }

    #[test]
    fn calibrated_scales_are_amax_over_vllm_constants_and_bad_amax_keeps_the_old() {
        let old = KvScale { k: 0.5, v: 2.0 };
        let s = calibrated_scale(3, KvAmax { k: 50.0, v: 3.0 }, old);
        assert_eq!(s, KvScale { k: 50.0 / 200.0, v: 3.0 / 100.0 });
        for bad in [0.0, f32::NAN, f32::INFINITY, -1.0] {
            assert_eq!(calibrated_scale(0, KvAmax { k: bad, v: 7.0 }, old), KvScale { k: 0.5, v: 0.07 }, "{bad}");
            assert_eq!(calibrated_scale(0, KvAmax { k: 7.0, v: bad }, old), KvScale { k: 0.035, v: 2.0 }, "{bad}");
        }
        // A subnormal amax whose quotient underflows to zero keeps the old scale too.
        assert_eq!(calibrated_scale(0, KvAmax { k: f32::from_bits(1), v: 1.0 }, old).k, 0.5);
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
