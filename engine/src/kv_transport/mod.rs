//! Moving KV blocks between workers.
//!
//! A hand-off is one [`Handshake`] (the sender's layout and identity, the
//! reservation it fills, the plan) followed by one frame per layer, in layer order, so the receiver can
//! start writing layer 0 into its cache while the sender still computes later
//! layers. The receiver checks layout compatibility first and refuses a
//! mismatch with a reason the sender reports verbatim. Every receive has a
//! deadline: a stalled or dead peer becomes [`TransportError::Timeout`], never
//! a hang. `tcp` is the always-available transport (host staging); the NCCL
//! transport for GPU↔GPU implements the same sequence, with the data on a link. This is the
//! network's side of a hand-off; the engine's side (what is read from and written into the
//! cache, when a request completes or recomputes, link faults) is [`crate::kv_connector`].
//!
//! Authentication: the TCP handshake is a challenge-response over the cluster secret
//! ([`KvCredentials`], see `tcp`); the reservation is named by an unguessable
//! [`ReservationToken`] bound to one prefill worker's identity, which the receiver checks.
//!
//! The receiving side treats the peer as hostile: only after the proof, a handshake is
//! checked against the receiver's reservation before anything is allocated ([`admission`]),
//! a listener serves a bounded number of connections with a short deadline for the handshake
//! ([`intake`]), and a bad peer costs its own hand-off (the request then recomputes) and
//! nothing else.

pub mod admission;
pub mod handoff;
pub mod intake;
pub mod nccl;
pub mod tcp;

use baton_core::cluster_auth::{ClusterSecret, ReservationToken};
use baton_core::kv_transfer::{BlockRun, KvLayout, LayoutMismatch};
use serde::{Deserialize, Serialize};

/// What a KV sender proves (knowledge of the cluster secret, when one is set) and claims
/// (its identity: the worker instance its reservations are bound to).
#[derive(Debug, Clone, Default)]
pub struct KvCredentials {
    /// The cluster secret; `None` sends an empty proof (accepted only by receivers
    /// without a secret).
    pub secret: Option<ClusterSecret>,
    /// Who is sending.
    pub identity: String,
}

/// Opens a hand-off: who is sending what.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handshake {
    /// The sender's cache layout; must equal the receiver's.
    pub layout: KvLayout,
    /// Who sends (its instance); the reservation must be bound to it.
    pub sender: String,
    /// The reservation on the receiving worker (issued when it reserved the blocks); `None`
    /// only for an NCCL link setup, which fills none.
    pub reservation: Option<ReservationToken>,
    /// Tokens whose KV is moved.
    pub num_tokens: usize,
    /// Block runs per layer (from `baton_core::kv_transfer::plan_transfer`).
    pub runs: Vec<BlockRun>,
    /// Bytes of K (and of V) per layer.
    pub bytes_per_layer_half: usize,
    /// Set when the data moves over NCCL (layer frames are then empty "enqueued" notices).
    #[serde(default)]
    pub nccl: Option<NcclHandshake>,
}

impl Handshake {
    /// Payload bytes of K (and of V) in each layer frame: none when NCCL carries the data.
    pub fn frame_half(&self) -> usize {
        if self.nccl.is_some() { 0 } else { self.bytes_per_layer_half }
    }

    /// Key-shift values in each layer frame: one per (KV head, dim) for an FP8 cache's bytes
    /// (all zero for none), none otherwise.
    pub fn frame_shift_values(&self) -> usize {
        let fp8 = self.layout.dtype == baton_core::kv_transfer::KvDtype::Fp8E4M3;
        if self.nccl.is_none() && fp8 { self.layout.num_kv_heads * self.layout.head_dim } else { 0 }
    }
}

/// The NCCL part of a handshake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NcclHandshake {
    /// Create the link `link` from this unique id (the sender is rank 0); no request moves.
    Setup {
        /// The name both sides file the link under.
        link: String,
        /// The 128-byte NCCL unique id.
        id: Vec<u8>,
    },
    /// Move this request's KV over the existing link `link`.
    Use {
        /// The link's name.
        link: String,
    },
}

/// One layer's KV for the planned blocks, in plan order.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerFrame {
    /// Layer index.
    pub layer: usize,
    /// Keys of the planned blocks, run after run.
    pub k: Vec<u8>,
    /// Values, same order.
    pub v: Vec<u8>,
    /// Over an NCCL link (where `k` and `v` are empty): the number of this layer's send
    /// group on the link, which orders the receives (see [`nccl`]). 0 otherwise.
    pub seq: u64,
    /// How the sender's codes were written (its layer's scales, calibrated or not, and key
    /// shift); `None` for a cache that is not FP8. The receiver stores the codes in its own
    /// coding ([`crate::kv_connector::KvAccess::import_kv_blocks`]).
    pub coding: Option<crate::kv_cache_dtype::KvCoding>,
}

/// A hand-off that failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Socket-level failure (connection refused or reset, peer died).
    #[error("KV transport I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer did not answer within the deadline.
    #[error("KV transport timed out after {0:?} waiting for {1}")]
    Timeout(std::time::Duration, &'static str),
    /// The receiver refused the layout.
    #[error(transparent)]
    Incompatible(#[from] LayoutMismatch),
    /// The peer refused the hand-off for another reason.
    #[error("the peer refused the KV hand-off: {0}")]
    Refused(String),
    /// The peer sent something that is not this protocol, or out of order.
    #[error("KV transport protocol error: {0}")]
    Protocol(String),
    /// The sender did not prove knowledge of the cluster secret.
    #[error("KV hand-off refused: the sender did not prove the cluster secret")]
    Unauthenticated,
}
