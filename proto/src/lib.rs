//! Generated gRPC types and services. `baton.v1` is the public API served by
//! `serve` and `router` (`proto/baton.proto`); `baton.worker.v1` is the
//! worker-internal API between the router and its workers (`proto/worker.proto`).

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
