//! The one error type of this crate. Every variant names the file (or the input)
//! it is about, so a message read in a log points straight at the problem.

use std::path::PathBuf;

/// Everything that can go wrong while reading, validating or writing model files,
/// tokenizing or rendering chat templates.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// An I/O error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json, index, tokenizer_config.json...) could not be parsed.
    #[error("{path}: invalid JSON: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde said.
        message: String,
    },
    /// A model configuration is inconsistent or out of range.
    #[error("{path}: invalid model config: {message}")]
    InvalidConfig {
        /// The file the config came from.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The architecture is not one Baton implements.
    #[error("{path}: unsupported architecture {name:?} (supported: {})", crate::Architecture::supported_list())]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// The architecture as the file names it.
        name: String,
    },
    /// A feature of the file is valid but not supported (a dtype, a quantization, a tokenizer kind).
    #[error("{path}: unsupported: {message}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is not supported.
        message: String,
    },
    /// A tensor the architecture needs is not in the file(s).
    #[error("{path}: missing tensor {name:?}")]
    MissingTensor {
        /// The model file or folder.
        path: PathBuf,
        /// HF name of the tensor.
        name: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error("{path}: tensor {name:?} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The model file or folder.
        path: PathBuf,
        /// HF name of the tensor.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape found in the file.
        actual: Vec<usize>,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A GGUF file is malformed, truncated, or has a bad magic or version.
    #[error("{path}: invalid GGUF file: {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tokenizer could not be built or failed on an input.
    #[error("tokenizer ({context}): {message}")]
    Tokenizer {
        /// Where the tokenizer came from, or the operation.
        context: String,
        /// What went wrong.
        message: String,
    },
    /// A chat template failed to compile or render (a `raise_exception` message passes through).
    #[error("chat template: {message}")]
    Template {
        /// The message, including the template's own exception text.
        message: String,
    },
    /// Bad argument to an API of this crate (an empty stop string, an unknown load format...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl FormatError {
    /// Wraps an I/O error with the file it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    /// A GGUF format error for `path`.
    pub fn gguf(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Gguf { path: path.into(), message: message.into() }
    }

    /// A config error for `path`.
    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::InvalidConfig { path: path.into(), message: message.into() }
    }

    /// An "unsupported" error for `path`.
    pub fn unsupported(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Unsupported { path: path.into(), message: message.into() }
    }
}
