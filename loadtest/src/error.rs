//! Typed errors of the load generator.
//!
//! Every failure that stops a run (bad configuration, unreadable dataset,
//! unreachable server, unwritable output) is a [`LoadtestError`]. Failures of
//! single requests are not errors of the run: they are recorded per request
//! (see [`crate::record`]) and counted in the summary.

use std::path::PathBuf;

/// Why a run, a dataset load, a report or a comparison could not be done.
#[derive(Debug, thiserror::Error)]
pub enum LoadtestError {
    /// The configuration is inconsistent (e.g. `--duration` with an infinite
    /// rate and no concurrency limit).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A dataset file exists but its content is not what was expected.
    #[error("dataset {path}: {message}")]
    Dataset {
        /// The dataset file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// Tokenizing or detokenizing failed (local file or server endpoint).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The server could not be reached or answered a setup call badly.
    #[error("server: {0}")]
    Server(String),
    /// Every warmup request failed, so the timed run would be meaningless.
    #[error("all {count} warmup requests failed; first error: {first_error}")]
    Warmup {
        /// How many warmup requests were sent.
        count: usize,
        /// The error of the first one.
        first_error: String,
    },
    /// A results JSON file could not be parsed or written.
    #[error("results JSON {path}: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A request task ended abnormally (a bug, not a server problem).
    #[error("internal: {0}")]
    Internal(String),
    /// Drawing a chart failed.
    #[error("plot: {0}")]
    Plot(String),
}

impl LoadtestError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
