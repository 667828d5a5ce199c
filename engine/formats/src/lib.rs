//! Model files for Baton: HF `config.json` + safetensors folders, GGUF files (with
//! dequantization and llama.cpp name/permutation mapping), dummy random weights, the
//! tokenizer (from `tokenizer.json` or GGUF metadata), streaming detokenization, stop
//! strings and chat templates. Whatever the source, weights are served under HF Llama
//! tensor names in HF shapes, and [`load_model`] checks every tensor before returning.
//! [`export_hf`] writes any loaded model back out as a HF folder (for comparisons with
//! transformers on exactly the weights Baton uses).

pub mod chat_template;
pub mod config;
mod config_json;
pub mod dummy;
pub mod error;
pub mod export;
pub mod generation;
pub mod gguf;
mod hf_options;
pub mod mxfp4;
pub mod quantization;
pub mod rope;
pub mod safetensors_store;
pub mod tensor;
pub mod testing;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{
    Architecture, ConfigDType, ExpertProj, GemmaOptions, GenerationConfig, GptOssOptions, LayerType, LongRope,
    ModelConfig, MoeConfig, RopeParameters, RopeScaling, declared_dtype,
};
pub use dummy::{DummyKind, DummyStore};
pub use error::FormatError;
pub use export::{ExportDType, ExportOptions, ExportSummary, export_hf};
pub use gguf::GgufType;
pub use quantization::{
    ActivationQuant, Fp8ScaleLayout, Fp8Weight, QuantSource, Quantization, read_fp8_scales, read_fp8_weight,
};
pub use safetensors_store::SafetensorsStore;
pub use tensor::{CounterInit, DType, TensorView, WeightStore, check_tensors};
pub use tokenizer::{IncrementalDetokenizer, StopMatcher, StopOutput, Tokenizer};

/// Seed of `--load-format dummy` weights.
pub const DUMMY_SEED: u64 = 0;
/// Init std of `--load-format dummy` linears (the usual 0.02).
pub const DUMMY_STD: f32 = 0.02;

/// How to interpret a model path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// `.gguf` file → GGUF; folder with `*.safetensors` → safetensors.
    #[default]
    Auto,
    /// HF folder with safetensors weights.
    Safetensors,
    /// A GGUF file.
    Gguf,
    /// Random weights for a `config.json` (or a folder holding one).
    Dummy,
}

impl FromStr for LoadFormat {
    type Err = FormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "safetensors" => Ok(Self::Safetensors),
            "gguf" => Ok(Self::Gguf),
            "dummy" => Ok(Self::Dummy),
            other => Err(FormatError::InvalidArgument(format!(
                "unknown load format {other:?} (expected auto, safetensors, gguf or dummy)"
            ))),
        }
    }
}

/// A loaded, checked model.
pub struct LoadedModel {
    /// Hyperparameters.
    pub config: ModelConfig,
    /// Tensors under HF names (every expected tensor present with the right shape).
    pub weights: Box<dyn WeightStore>,
    /// The tokenizer, when the source has one.
    pub tokenizer: Option<Tokenizer>,
    /// The chat template, when the source has one.
    pub chat_template: Option<ChatTemplate>,
    /// Sampling defaults and stop tokens.
    pub generation: GenerationConfig,
    /// The path it was loaded from.
    pub source: PathBuf,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("config", &self.config)
            .field("tokenizer", &self.tokenizer)
            .field("chat_template", &self.chat_template.is_some())
            .field("generation", &self.generation)
            .field("source", &self.source)
            .finish()
    }
}

/// Loads the model at `path` (see [`LoadFormat`]); every failure is a [`FormatError`]
/// naming the file.
pub fn load_model(path: &Path, format: LoadFormat) -> Result<LoadedModel, FormatError> {
    match resolve_format(path, format)? {
        LoadFormat::Gguf => load_gguf(path),
        LoadFormat::Dummy => load_dummy(path),
        LoadFormat::Safetensors | LoadFormat::Auto => load_hf(path),
    }
}

fn resolve_format(path: &Path, format: LoadFormat) -> Result<LoadFormat, FormatError> {
    if format != LoadFormat::Auto {
        return Ok(format);
    }
    if !path.exists() {
        return Err(FormatError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "model path does not exist"),
        ));
    }
    if path.is_file() {
        let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            || std::fs::File::open(path)
                .and_then(|mut f| {
                    let mut magic = [0u8; 4];
                    std::io::Read::read_exact(&mut f, &mut magic).map(|_| magic == *b"GGUF")
                })
                .unwrap_or(false);
        return match is_gguf {
            true => Ok(LoadFormat::Gguf),
            false => Err(FormatError::InvalidArgument(format!(
                "{}: not a GGUF file or model folder (for random weights from a config.json use --load-format dummy)",
                path.display()
            ))),
        };
    }
    Ok(LoadFormat::Safetensors)
}

/// Everything about a model except its weights: what the router needs (tokenizer, chat
/// template, stop tokens, context length) without mapping or dequantizing tensors.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Hyperparameters.
    pub config: ModelConfig,
    /// The tokenizer, when the source has one.
    pub tokenizer: Option<Tokenizer>,
    /// The chat template, when the source has one.
    pub chat_template: Option<ChatTemplate>,
    /// Sampling defaults and stop tokens.
    pub generation: GenerationConfig,
    /// The path it was read from.
    pub source: PathBuf,
}

/// Reads the config, tokenizer, chat template and generation defaults of the model at
/// `path` without loading weights (a GGUF file's header is parsed, its tensors untouched).
pub fn load_model_info(path: &Path, format: LoadFormat) -> Result<ModelInfo, FormatError> {
    match resolve_format(path, format)? {
        LoadFormat::Gguf => {
            let (file, config) = gguf::model::open_gguf(path)?;
            gguf_info(&file, config, path)
        }
        LoadFormat::Dummy => dummy_info(path),
        LoadFormat::Safetensors | LoadFormat::Auto => hf_info(path),
    }
}

impl LoadedModel {
    fn from_info(info: ModelInfo, weights: Box<dyn WeightStore>) -> Self {
        Self {
            config: info.config,
            weights,
            tokenizer: info.tokenizer,
            chat_template: info.chat_template,
            generation: info.generation,
            source: info.source,
        }
    }
}

fn hf_info(dir: &Path) -> Result<ModelInfo, FormatError> {
    let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
    let tokenizer = match dir.join("tokenizer.json").is_file() {
        true => Some(Tokenizer::from_hf_folder(dir)?),
        false => None,
    };
    let tc = dir.join("tokenizer_config.json");
    let chat_template = match tc.is_file() {
        true => ChatTemplate::from_tokenizer_config(&tc)?,
        false => None,
    };
    let gc = dir.join("generation_config.json");
    let generation = match gc.is_file() {
        true => GenerationConfig::from_hf_file(&gc, &config)?,
        false => GenerationConfig::from_model(&config),
    };
    Ok(ModelInfo { config, tokenizer, chat_template, generation, source: dir.to_path_buf() })
}

fn load_hf(dir: &Path) -> Result<LoadedModel, FormatError> {
    let info = hf_info(dir)?;
    let store = SafetensorsStore::open_dir(dir)?;
    store.check_dtypes(&info.config)?;
    check_tensors(&store, &info.config, dir)?;
    check_fp8_weights(&store, &info.config, dir)?;
    Ok(LoadedModel::from_info(info, Box::new(store)))
}

/// Checks every FP8 (`F8_E4M3`) tensor `config` needs: the config declares an FP8 checkpoint
/// that does not skip its module, the tensor is a matrix, and its scale tensor has the
/// layout's shape and finite positive values. Errors name the tensor.
pub fn check_fp8_weights(store: &dyn WeightStore, config: &ModelConfig, path: &Path) -> Result<(), FormatError> {
    for (name, shape) in config.expected_tensors() {
        if store.get(&name)?.dtype != DType::F8E4M3 {
            continue;
        }
        let q = match &config.quantization {
            Some(q) if q.source != QuantSource::AtLoad && !q.skips(&name) => q,
            Some(_) => {
                return Err(FormatError::unsupported(
                    path,
                    format!("tensor {name:?} is F8_E4M3 but quantization_config leaves its module unquantized"),
                ));
            }
            None => {
                return Err(FormatError::unsupported(
                    path,
                    format!("tensor {name:?} is F8_E4M3 but config.json has no quantization_config"),
                ));
            }
        };
        let [rows, cols] = shape[..] else {
            return Err(FormatError::unsupported(path, format!("tensor {name:?} is F8_E4M3 but not a matrix")));
        };
        read_fp8_scales(store, q, &name, rows, cols, path)?;
    }
    Ok(())
}

fn gguf_info(file: &gguf::GgufFile, config: ModelConfig, path: &Path) -> Result<ModelInfo, FormatError> {
    let tokenizer = match file.get("tokenizer.ggml.model") {
        Some(_) => Some(tokenizer::tokenizer_from_gguf(file)?),
        None => None,
    };
    Ok(ModelInfo {
        generation: GenerationConfig::from_model(&config),
        config,
        tokenizer,
        chat_template: ChatTemplate::from_gguf(file)?,
        source: path.to_path_buf(),
    })
}

fn load_gguf(path: &Path) -> Result<LoadedModel, FormatError> {
    let (file, config) = gguf::model::open_gguf(path)?;
    let info = gguf_info(&file, config, path)?;
    let store = gguf::GgufStore::new(file, &info.config)?;
    check_tensors(&store, &info.config, path)?;
    Ok(LoadedModel::from_info(info, Box::new(store)))
}

fn dummy_info(path: &Path) -> Result<ModelInfo, FormatError> {
    let (cfg_path, dir) =
        if path.is_dir() { (path.join("config.json"), Some(path)) } else { (path.to_path_buf(), None) };
    let config = ModelConfig::from_hf_file(&cfg_path)?;
    // A folder may carry a real tokenizer next to the config; a lone config file does not.
    let tokenizer = match dir {
        Some(d) if d.join("tokenizer.json").is_file() => Some(Tokenizer::from_hf_folder(d)?),
        _ => None,
    };
    let chat_template = match dir.map(|d| d.join("tokenizer_config.json")) {
        Some(tc) if tc.is_file() => ChatTemplate::from_tokenizer_config(&tc)?,
        _ => None,
    };
    Ok(ModelInfo {
        generation: GenerationConfig::from_model(&config),
        config,
        tokenizer,
        chat_template,
        source: path.to_path_buf(),
    })
}

fn load_dummy(path: &Path) -> Result<LoadedModel, FormatError> {
    let info = dummy_info(path)?;
    // The counter generator: the engine may draw these weights on its device.
    let store = DummyStore::new(&info.config, DUMMY_SEED, DUMMY_STD, DType::BF16).with_kind(DummyKind::Counter);
    Ok(LoadedModel::from_info(info, Box::new(store)))
}
