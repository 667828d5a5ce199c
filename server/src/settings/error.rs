//! What can go wrong resolving settings: [`ConfigError`] for the config file itself (it
//! cannot be read, or is not valid TOML for its tables), [`SettingsError`] for a router or
//! worker setting (the file's errors, a security setting, or a value out of its domain).
//! Each names the file, flag or key at fault.

use super::security::SecurityError;
use std::path::PathBuf;

/// A config-file problem.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown/mistyped keys.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML error, with line and column.
        message: String,
    },
}

/// A router or worker setting that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The config file.
    #[error(transparent)]
    File(#[from] ConfigError),
    /// A security setting.
    #[error(transparent)]
    Security(#[from] SecurityError),
    /// A value out of its domain.
    #[error("invalid {key}: {message}")]
    Invalid {
        /// The flag/key.
        key: &'static str,
        /// Why.
        message: String,
    },
}

pub(super) fn invalid(key: &'static str, message: impl Into<String>) -> SettingsError {
    SettingsError::Invalid { key, message: message.into() }
}
