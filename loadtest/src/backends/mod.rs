//! The APIs requests are sent through.
//!
//! A backend turns a [`RequestSpec`] into one streaming call and reports what
//! arrives to a [`Stopwatch`]; it does no timing of its own, so every backend
//! is measured the same way. Per-request failures are [`RequestError`]s,
//! which the runner records instead of stopping the run.

pub mod grpc;
pub mod openai;

use crate::config::{BackendKind, RunConfig};
use crate::dataset::RequestSpec;
use crate::error::LoadtestError;
use crate::record::Stopwatch;

/// Why one request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// The server answered with a non-success HTTP status.
    #[error("HTTP {status}: {body}")]
    Http {
        /// The status code.
        status: u16,
        /// The (truncated) response body.
        body: String,
    },
    /// The connection failed or broke.
    #[error("transport: {0}")]
    Transport(String),
    /// The server reported an error inside the stream.
    #[error("server error: {0}")]
    Server(String),
    /// The stream was malformed or ended early.
    #[error("stream: {0}")]
    Stream(String),
    /// The request ran past `--request-timeout`.
    #[error("timed out after {0} s")]
    Timeout(f64),
}

/// A connected backend, cheap to clone into each request task.
#[derive(Clone)]
pub enum Backend {
    /// OpenAI completions or chat completions over SSE.
    OpenAi(openai::OpenAiBackend),
    /// Baton gRPC.
    Grpc(grpc::GrpcBackend),
}

impl Backend {
    /// Connects to the server named in `config` (and, for OpenAI, finds the
    /// model name when none is given).
    pub async fn connect(config: &RunConfig, client: reqwest::Client) -> Result<Self, LoadtestError> {
        Ok(match config.backend {
            BackendKind::Openai | BackendKind::OpenaiChat => {
                Self::OpenAi(openai::OpenAiBackend::connect(config, client).await?)
            }
            BackendKind::Grpc => Self::Grpc(grpc::GrpcBackend::connect(config).await?),
        })
    }

    /// The model name requests are sent for, when the backend has one.
    pub fn model(&self) -> Option<&str> {
        match self {
            Self::OpenAi(b) => Some(b.model()),
            Self::Grpc(_) => None,
        }
    }

    /// Sends one streaming request, reporting content and usage to `watch`.
    pub async fn send(&self, spec: &RequestSpec, watch: &mut Stopwatch) -> Result<(), RequestError> {
        match self {
            Self::OpenAi(b) => b.send(spec, watch).await,
            Self::Grpc(b) => b.send(spec, watch).await,
        }
    }
}
