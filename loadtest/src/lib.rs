//! `baton-loadtest`: a load generator for OpenAI-compatible servers and
//! Baton's gRPC API that measures TTFT, TPOT, ITL, end-to-end latency,
//! throughput and goodput with the definitions of `vllm bench serve`, so its
//! numbers are comparable with vLLM's.
//!
//! The flow: a [`RunConfig`] → [`Target::prepare`] (connect, build prompts) →
//! [`Target::execute`] (warmup, timed arrivals, one [`RequestRecord`] per
//! request) → [`Summary`] → console table, JSON, charts. [`run`] does it all.

pub mod arrival;
pub mod backends;
pub mod cli;
pub mod compare;
pub mod config;
pub mod dataset;
pub mod error;
pub mod metrics;
pub mod plot;
pub mod record;
pub mod report;
pub mod runner;
pub mod sse;
pub mod timeseries;
pub mod tokenizer;

pub use config::{BackendKind, DatasetConfig, Rate, RunConfig, Slo};
pub use error::LoadtestError;
pub use metrics::{Stats, Summary};
pub use record::RequestRecord;
pub use runner::{RunResult, Target, run, sweep};
