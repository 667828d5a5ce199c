//! The wire of Baton: generated gRPC types and services, and what both ends of the internal
//! plane share.
//!
//! - [`v1`]: the public API served by `serve` and `router` (`proto/baton.proto`).
//! - [`worker`]: the worker-internal API between the router and its workers
//!   (`proto/worker.proto`).
//! - [`wire`]: engine data ↔ `baton.worker.v1` conversions, decoding totally into
//!   [`wire::WireError`]; [`role`]: what a worker does ([`Role`]).
//! - [`cluster_auth`]: the internal plane's call signing and mutual TLS
//!   ([`ClusterSecurity`]), the tonic side of `baton_core::cluster_auth`.
//!
//! The router and the worker both import these from here, so neither depends on the other.
//! Depends on `baton-core` (the engine's plain data), never the reverse.

/// The public Baton API (`package baton.v1`).
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("baton.v1");
}

/// The worker-internal API (`package baton.worker.v1`).
#[allow(missing_docs, clippy::all)]
pub mod worker {
    tonic::include_proto!("baton.worker.v1");
}

pub mod cluster_auth;
pub mod role;
pub mod wire;

pub use cluster_auth::{ClusterSecurity, ClusterTls};
pub use role::Role;
