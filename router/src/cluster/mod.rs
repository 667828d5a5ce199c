//! Disaggregated serving, router side: the worker registry and its gRPC service
//! ([`registry`]), the internal plane's authentication and TLS ([`auth`], shared with the
//! workers), routing policies ([`policy`]), the wire conversions shared with the
//! worker ([`wire`]), and [`ClusterClient`], the [`baton_core::api::EngineClient`] that
//! runs each request on a prefill/decode pair ([`relay`]) so the HTTP and gRPC edges are the
//! same as `baton serve`'s.

pub mod auth;
pub mod client;
pub mod policy;
pub mod registry;
mod relay;
pub mod wire;

pub use auth::{ClusterSecurity, ClusterTls};
pub use client::{ClusterClient, ClusterSettings, TransferFailurePolicy};
pub use policy::{Candidate, PrefillPolicy, RouteRequest, UnknownPolicy, pick_decode, policy_by_name};
pub use registry::{Registry, RegistryService, RegistrySettings, Role, WorkerStatus};
