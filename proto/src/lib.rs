//! Generated gRPC types and services. `baton.v1` is the public API served by
//! `serve` and `router`; see `proto/baton.proto` for the contract.

/// The public Baton API (`package baton.v1`).
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("baton.v1");
}
