//! The TOML config file (`--config`): one table per subcommand. `[serve]` and `[router]` are
//! typed here; `[worker]` stays a raw table until a worker splits it into its own keys, the
//! security keys and the `[serve]` keys ([`super::worker`]). Unknown keys are errors.

use super::error::ConfigError;
use super::router::RouterFile;
use super::serve::ServeFile;
use serde::Deserialize;
use std::path::Path;

/// A whole config file: `[serve]` for `baton serve`, `[router]` for `baton router`, and
/// `[worker]` for `baton worker` (the `[serve]` keys for model and engine plus the worker's
/// own; see [`super::worker`]).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Settings of `baton serve`.
    #[serde(default)]
    pub serve: ServeFile,
    /// Settings of `baton router`.
    #[serde(default)]
    pub router: RouterFile,
    /// Settings of `baton worker`, checked when a worker reads them.
    #[serde(default)]
    pub worker: toml::Table,
}

impl ConfigFile {
    /// Parses TOML text; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path)
    }

    /// Reads and parses `path` when one is given; the empty file otherwise.
    pub fn load_optional(path: Option<&Path>) -> Result<Self, ConfigError> {
        match path {
            Some(p) => Self::load(p),
            None => Ok(Self::default()),
        }
    }
}
