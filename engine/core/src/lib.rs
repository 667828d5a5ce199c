//! Baton's pure engine core: request and sampling types, the engine API seam,
//! prefix-cache block hashing, the paged KV block manager, the scheduler and the
//! sampler. Nothing here does I/O or touches a device; everything is plain data
//! and deterministic given its inputs, so it is tested exhaustively on CPU (the one
//! exception: [`cluster_auth`] draws random nonces and tokens).

pub mod api;
pub mod block_hash;
pub mod block_manager;
pub mod cluster_auth;
pub mod kv_transfer;
pub mod params;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod structured;
