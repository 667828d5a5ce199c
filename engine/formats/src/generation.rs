//! Sampling defaults and stop tokens ([`GenerationConfig`]) from `generation_config.json`, or
//! from the model config alone; re-exported by `config`.

use std::path::Path;

use serde_json::{Value, json};

use crate::config::{ModelConfig, parse_id_list, read_json};
use crate::error::FormatError;

/// Sampling defaults and stop tokens from `generation_config.json` (or the model file).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Default temperature.
    pub temperature: Option<f32>,
    /// Default nucleus threshold.
    pub top_p: Option<f32>,
    /// Default top-k.
    pub top_k: Option<usize>,
}

impl GenerationConfig {
    /// Defaults taken from the model config alone (no generation_config.json).
    pub fn from_model(config: &ModelConfig) -> Self {
        Self { eos_token_ids: config.eos_token_ids.clone(), bos_token_id: config.bos_token_id, ..Self::default() }
    }

    /// Parses `generation_config.json`, filling eos/bos from `config` when the file has none.
    pub fn from_hf_file(path: &Path, config: &ModelConfig) -> Result<Self, FormatError> {
        let v = read_json(path)?;
        let mut eos = parse_id_list(v.get("eos_token_id"));
        for id in &config.eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        Ok(Self {
            eos_token_ids: eos,
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32).or(config.bos_token_id),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
        })
    }

    /// The `generation_config.json` for these defaults.
    pub fn to_hf_json(&self) -> Value {
        json!({
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "do_sample": self.temperature.is_some_and(|t| t > 0.0),
        })
    }
}
