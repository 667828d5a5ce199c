//! `--quantization` (vLLM's flag): how the engine stores the model's projection weights.
//!
//! `none` (or the flag absent) serves the weights as the checkpoint says: an FP8 checkpoint's
//! `quantization_config` is honoured, anything else stays unquantized. `fp8` quantizes a
//! bf16/f16/f32 checkpoint (or `--load-format dummy` weights) at load, per output channel with
//! dynamic per-token activation scales; an FP8 checkpoint keeps its own scheme.
//!
//! Invariant: [`WeightQuantization::apply`] only ever adds quantization to a config that has
//! none; it never rewrites what a checkpoint declares.

use std::str::FromStr;

use baton_formats::{ModelConfig, Quantization};

/// What `--quantization` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightQuantization {
    /// As the checkpoint says.
    #[default]
    None,
    /// FP8 E4M3 weights (quantized at load when the checkpoint is not FP8).
    Fp8,
}

/// A `--quantization` value Baton does not implement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --quantization '{0}': expected none or fp8")]
pub struct ParseWeightQuantizationError(pub String);

impl FromStr for WeightQuantization {
    type Err = ParseWeightQuantizationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Self::None),
            "fp8" => Ok(Self::Fp8),
            _ => Err(ParseWeightQuantizationError(s.to_string())),
        }
    }
}

impl std::fmt::Display for WeightQuantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Fp8 => "fp8",
        })
    }
}

impl<'de> serde::Deserialize<'de> for WeightQuantization {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl WeightQuantization {
    /// `cfg` as the engine loads it: with at-load FP8 quantization when this asks for FP8 and
    /// the checkpoint declares none.
    pub fn apply(self, cfg: &mut ModelConfig) {
        if self == Self::Fp8 && cfg.quantization.is_none() {
            cfg.quantization = Some(Quantization::at_load());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_formats::QuantSource;

    #[test]
    fn parses_and_applies_only_where_the_checkpoint_is_unquantized() {
        assert_eq!("FP8".parse::<WeightQuantization>(), Ok(WeightQuantization::Fp8));
        assert_eq!("none".parse::<WeightQuantization>(), Ok(WeightQuantization::None));
        assert!("awq".parse::<WeightQuantization>().unwrap_err().to_string().contains("'awq'"));
        let mut cfg = baton_formats::testing::TinySpec::llama().config();
        WeightQuantization::None.apply(&mut cfg);
        assert!(cfg.quantization.is_none());
        WeightQuantization::Fp8.apply(&mut cfg);
        assert_eq!(cfg.quantization.as_ref().map(|q| q.source.clone()), Some(QuantSource::AtLoad));
        let mut declared = cfg.clone();
        declared.quantization = baton_formats::Quantization::from_hf(
            &serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
            std::path::Path::new("c"),
        )
        .ok();
        let before = declared.clone();
        WeightQuantization::Fp8.apply(&mut declared);
        assert_eq!(declared, before, "a checkpoint's own scheme is kept");
    }
}
