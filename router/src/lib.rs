//! baton-router: the front door of Baton.
//!
//! - [`pipeline`]: the protocol-neutral request pipeline (validate → template → tokenize →
//!   fan out → engine streams) and [`generation`]: per-choice text events (incremental
//!   detokenization, stop strings).
//! - [`openai`] + [`http`]: the OpenAI-compatible HTTP API (axum).
//! - [`grpc`]: the public gRPC API (tonic, `baton.v1`).
//! - [`metrics`]: Prometheus metrics with vLLM's names.
//! - [`auth`]: the public API key, for HTTP and gRPC.
//!
//! Errors are [`error::FrontendError`] inside and become HTTP/gRPC statuses only at the edges.

pub mod auth;
pub mod cluster;
pub mod error;
pub mod generation;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod pipeline;
pub mod text;

pub use auth::ApiKey;
pub use error::FrontendError;
pub use generation::{ChoiceDelta, ChoiceEnd, ChoiceEvent, Generation, StopCause};
pub use grpc::GrpcService;
pub use http::{HttpConfig, http_router};
pub use metrics::Metrics;
pub use pipeline::{Frontend, GenerateRequest, PreparedRequest, PromptInput, ServedModel};
pub use text::{ChatTurn, TextCodec};
