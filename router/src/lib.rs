//! baton-router: the front door of Baton.
//!
//! - [`pipeline`]: the protocol-neutral request pipeline (admit → validate → template →
//!   tokenize → fan out → engine streams) and [`generation`]: per-choice text events
//!   (incremental detokenization, stop strings).
//! - [`admission`]: the in-flight and per-request caps; [`offload`]: CPU-heavy text work on
//!   a bounded blocking pool, off the async runtime.
//! - [`openai`] + [`http`]: the OpenAI-compatible HTTP API (axum).
//! - [`grpc`]: the public gRPC API (tonic, `baton.v1`).
//! - Prometheus metrics with vLLM's names are `baton-metrics`' (shared with the workers).
//! - [`auth`]: the public API key, for HTTP and gRPC.
//!
//! Errors are [`error::FrontendError`] inside and become HTTP/gRPC statuses only at the edges.

pub mod admission;
pub mod auth;
pub mod cluster;
pub mod error;
pub mod generation;
pub mod grpc;
pub mod http;
pub mod offload;
pub mod openai;
pub mod pipeline;
pub mod text;

pub use admission::{Admission, AdmissionLimits};
pub use auth::ApiKey;
pub use error::FrontendError;
pub use generation::{ChoiceDelta, ChoiceEnd, ChoiceEvent, Generation, StopCause};
pub use grpc::GrpcService;
pub use http::{HttpConfig, http_router};
pub use offload::Offload;
pub use pipeline::{Frontend, GenerateRequest, GrammarCheck, PreparedRequest, PromptInput, ServedModel};
pub use text::{ChatTurn, TextCodec};
