//! Disaggregated serving, router side: the worker registry and its gRPC service
//! ([`registry`]), routing policies ([`policy`]), and [`ClusterClient`], the
//! [`baton_core::api::EngineClient`] that runs each request on a prefill/decode pair
//! ([`relay`]) so the HTTP and gRPC edges are the same as `baton serve`'s.
//!
//! What the router shares with its workers (the wire conversions, [`baton_proto::Role`], the
//! internal plane's authentication and TLS) lives in `baton-proto`, so the worker does not
//! depend on this crate.

pub mod client;
pub mod policy;
pub mod registry;
mod relay;

pub use client::{ClusterClient, ClusterSettings, TransferFailurePolicy};
pub use policy::{Candidate, PrefillPolicy, RouteRequest, UnknownPolicy, pick_decode, policy_by_name};
pub use registry::{Registry, RegistryService, RegistrySettings, WorkerStatus};
