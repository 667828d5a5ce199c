//! Writes a loaded model back out as a Hugging Face model folder that
//! `transformers.AutoModelForCausalLM.from_pretrained` (and Baton's own safetensors loader)
//! reads: `config.json`, `model.safetensors`, `generation_config.json` and, when the model
//! has one, `tokenizer.json` + `tokenizer_config.json`.
//!
//! The point is comparison: a GGUF model exported here carries exactly the weights Baton's
//! GGUF loader serves (dequantized, Q/K rows already back in HF order), so a reference
//! implementation that cannot read GGUF runs on the same numbers Baton does. Only the
//! tensors [`ModelConfig::expected_tensors`] lists are written (what the engine uses;
//! e.g. no `lm_head.weight` for tied embeddings, no llama.cpp-only tensors).
//!
//! Output folder policy: the folder may not exist yet or be empty. A non-empty folder is
//! refused unless [`ExportOptions::force`] is set; then the files this module writes are
//! replaced and every other `*.safetensors` file and `model.safetensors.index.json` in it
//! is deleted, because the safetensors loaders would otherwise read those stale shards
//! alongside the new file. Other files are left alone.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use half::bf16;
use serde_json::{Value, json};

use crate::LoadedModel;
use crate::config::{GenerationConfig, ModelConfig};
use crate::error::FormatError;
use crate::tensor::{DType, WeightStore, f32_to_bytes};
use crate::tokenizer::Tokenizer;

/// Element type of the exported `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDType {
    /// float32: exact for every source (f32, f16, bf16 and dequantized GGUF data).
    #[default]
    F32,
    /// bfloat16 (round to nearest even): half the size; exact only for bf16 sources.
    BF16,
}

impl ExportDType {
    /// The `torch_dtype` string of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
        }
    }
}

impl FromStr for ExportDType {
    type Err = FormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::BF16),
            other => {
                Err(FormatError::InvalidArgument(format!("unknown export dtype {other:?} (expected f32 or bf16)")))
            }
        }
    }
}

/// How [`export_hf`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportOptions {
    /// Weight element type.
    pub dtype: ExportDType,
    /// Write into a non-empty folder (see the module doc for what is replaced).
    pub force: bool,
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The model folder.
    pub dir: PathBuf,
    /// Every file written, in writing order.
    pub files: Vec<PathBuf>,
    /// Number of tensors in `model.safetensors`.
    pub tensors: usize,
    /// Bytes of tensor data (excluding the safetensors header).
    pub tensor_bytes: u64,
    /// Whether `tokenizer.json` was written.
    pub tokenizer: bool,
}

/// The HF `config.json` of `config` for weights stored as `dtype`
/// ([`ModelConfig::to_hf_json`] plus `torch_dtype`).
pub fn hf_config_json(config: &ModelConfig, dtype: ExportDType) -> Value {
    let mut v = config.to_hf_json();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("torch_dtype".into(), json!(dtype.torch_name()));
    }
    v
}

/// The `tokenizer_config.json` that goes with an exported `tokenizer.json`: bos/eos strings,
/// the chat template, and the fast-tokenizer class (the only kind a bare `tokenizer.json`
/// can back). `add_bos_token` is false because Baton never prepends one itself.
pub fn hf_tokenizer_config_json(tokenizer: &Tokenizer, chat_template: Option<&str>, config: &ModelConfig) -> Value {
    let mut v = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": config.max_position_embeddings,
    });
    if let Some(obj) = v.as_object_mut() {
        if let Some(b) = tokenizer.bos_token() {
            obj.insert("bos_token".into(), json!(b));
        }
        if let Some(e) = tokenizer.eos_token() {
            obj.insert("eos_token".into(), json!(e));
        }
        if let Some(t) = chat_template {
            obj.insert("chat_template".into(), json!(t));
        }
    }
    v
}

/// The bytes of tensor `name` as `dtype`, borrowed from the store when it already is.
fn tensor_bytes<'a>(store: &'a dyn WeightStore, name: &str, dtype: ExportDType) -> Result<Cow<'a, [u8]>, FormatError> {
    let view = store.get(name)?;
    Ok(match (dtype, view.dtype) {
        (ExportDType::F32, DType::F32) | (ExportDType::BF16, DType::BF16) => view.bytes,
        (ExportDType::F32, _) => Cow::Owned(f32_to_bytes(&view.to_f32())),
        (ExportDType::BF16, _) => {
            Cow::Owned(view.to_f32().into_iter().flat_map(|x| bf16::from_f32(x).to_le_bytes()).collect())
        }
    })
}

/// Writes the tensors `config` needs from `store` into one safetensors file at `path`
/// (metadata `format: pt`, as `save_pretrained` writes). Returns (tensor count, data bytes).
/// The `safetensors` crate writes a sibling temporary file and renames it, so an interrupted
/// export never leaves a truncated file under `path`.
pub fn write_safetensors(
    store: &dyn WeightStore,
    config: &ModelConfig,
    path: &Path,
    dtype: ExportDType,
) -> Result<(usize, u64), FormatError> {
    let st_dtype = match dtype {
        ExportDType::F32 => safetensors::Dtype::F32,
        ExportDType::BF16 => safetensors::Dtype::BF16,
    };
    let mut data = Vec::new();
    for (name, shape) in config.expected_tensors() {
        let actual = store.shape(&name)?;
        if actual != shape {
            return Err(FormatError::ShapeMismatch { path: path.to_path_buf(), name, expected: shape, actual });
        }
        let bytes = tensor_bytes(store, &name, dtype)?;
        data.push((name, shape, bytes));
    }
    let total: u64 = data.iter().map(|(_, _, b)| b.len() as u64).sum();
    let views = data
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| FormatError::Safetensors { path: path.to_path_buf(), message: format!("{n}: {e}") })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(io) => FormatError::io(path, io),
        other => FormatError::Safetensors { path: path.to_path_buf(), message: other.to_string() },
    })?;
    // That temporary file is created private (0600) and keeps its mode through the rename;
    // the weights are no more secret than the config beside them, so give them the mode of
    // an ordinary file (a server under another user must be able to read the folder).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).map_err(|e| FormatError::io(path, e))?;
    }
    Ok((data.len(), total))
}

fn write_json(path: &Path, v: &Value) -> Result<(), FormatError> {
    let mut text = serde_json::to_string_pretty(v)
        .map_err(|e| FormatError::Json { path: path.to_path_buf(), message: e.to_string() })?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| FormatError::io(path, e))
}

/// Creates `dir` or checks that it may be written into (see the module doc); with `force`,
/// deletes the stale shards the loaders would otherwise pick up.
fn prepare_dir(dir: &Path, force: bool) -> Result<(), FormatError> {
    if dir.exists() && !dir.is_dir() {
        return Err(FormatError::InvalidArgument(format!("{}: exists and is not a folder", dir.display())));
    }
    std::fs::create_dir_all(dir).map_err(|e| FormatError::io(dir, e))?;
    let mut entries = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| FormatError::io(dir, e))? {
        entries.push(e.map_err(|e| FormatError::io(dir, e))?.path());
    }
    if entries.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(FormatError::InvalidArgument(format!(
            "{}: output folder is not empty ({} entries); pass --force to overwrite",
            dir.display(),
            entries.len()
        )));
    }
    for p in entries {
        let stale = p.extension().is_some_and(|x| x == "safetensors")
            || p.file_name().is_some_and(|n| n == "model.safetensors.index.json");
        if stale && p.is_file() {
            std::fs::remove_file(&p).map_err(|e| FormatError::io(&p, e))?;
        }
    }
    Ok(())
}

/// Exports `model` as a HF folder in `dir` (see the module doc for the folder policy).
pub fn export_hf(model: &LoadedModel, dir: &Path, opts: &ExportOptions) -> Result<ExportSummary, FormatError> {
    model.config.validate()?;
    prepare_dir(dir, opts.force)?;
    let mut files = Vec::new();

    let st = dir.join("model.safetensors");
    let (tensors, tensor_bytes) = write_safetensors(model.weights.as_ref(), &model.config, &st, opts.dtype)?;
    files.push(st);

    let cfg = dir.join("config.json");
    write_json(&cfg, &hf_config_json(&model.config, opts.dtype))?;
    files.push(cfg);

    // The generation defaults carry every stop id the source knows (GGUF eot/eom ids too).
    let gen_path = dir.join("generation_config.json");
    let generation = GenerationConfig {
        eos_token_ids: merged_eos(&model.generation, &model.config),
        bos_token_id: model.generation.bos_token_id.or(model.config.bos_token_id),
        ..model.generation.clone()
    };
    write_json(&gen_path, &generation.to_hf_json())?;
    files.push(gen_path);

    if let Some(tok) = &model.tokenizer {
        let tok_path = dir.join("tokenizer.json");
        tok.inner()
            .save(&tok_path, true)
            .map_err(|e| FormatError::Tokenizer { context: tok_path.display().to_string(), message: e.to_string() })?;
        files.push(tok_path);
        let tc = dir.join("tokenizer_config.json");
        let template = model.chat_template.as_ref().map(|t| t.source());
        write_json(&tc, &hf_tokenizer_config_json(tok, template, &model.config))?;
        files.push(tc);
    }
    Ok(ExportSummary { dir: dir.to_path_buf(), files, tensors, tensor_bytes, tokenizer: model.tokenizer.is_some() })
}

fn merged_eos(generation: &GenerationConfig, config: &ModelConfig) -> Vec<u32> {
    let mut eos = generation.eos_token_ids.clone();
    for id in &config.eos_token_ids {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }
    eos
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_parses_and_names_torch_types() {
        assert_eq!("f32".parse::<ExportDType>().expect("f32"), ExportDType::F32);
        assert_eq!("BF16".parse::<ExportDType>().expect("bf16"), ExportDType::BF16);
        assert!("q4".parse::<ExportDType>().is_err());
        assert_eq!(ExportDType::BF16.torch_name(), "bfloat16");
    }
}
