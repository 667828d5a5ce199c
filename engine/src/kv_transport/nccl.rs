//! NCCL links: GPU-to-GPU KV hand-offs between a prefill worker (rank 0) and a decode
//! worker (rank 1).
//!
//! One [`NcclLink`] per P–D pair, created on first contact and reused: the prefill side draws
//! a unique id and sends it over the TCP control connection; both sides then join the
//! two-rank communicator on their own device and a dedicated *transfer stream*, so sends and
//! receives never queue behind (or block) the engine's compute stream. Per hand-off the TCP
//! connection carries only control frames: the handshake naming the link, an empty `LAYER`
//! frame when a layer has been enqueued for sending (the decode side then enqueues the
//! matching receives), and the trailer with the first token. Data moves straight between the
//! paged caches, one grouped send/recv per layer and contiguous block run, with no staging.
//!
//! Ordering is explicit: the transfer stream waits for the compute stream before each
//! layer's sends (so they read finished KV) and receives; the compute stream waits for the
//! transfer stream after the sending step (before those blocks can be reused) and before
//! the decode side's first step over the received KV ([`NcclOps::fence`]). The sending
//! step itself never waits for the transfer, so the transfer overlaps the prefill. A peer that dies with
//! a transfer in flight leaves that link's transfer stream blocked; the link is then
//! dropped (aborting the communicator) and a new one is made on the next contact.
//!
//! Several hand-offs share one link, and NCCL matches a pair's sends and receives in the
//! order they were enqueued. The prefill side therefore numbers every layer group it sends
//! on a link (the number travels in the layer notice), and the decode side enqueues the
//! receives in that order ([`RecvOrder`]), whatever order the notices of concurrent hand-offs
//! arrive in. A receive whose request is gone still has to be enqueued (into scratch memory)
//! or every later transfer on the link would be matched against the wrong send.

use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{Comm, Id};
use std::sync::{Arc, Mutex};

/// A failure to set up or use an NCCL link.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NCCL: {0}")]
pub struct NcclError(pub String);

/// The 128-byte NCCL unique id, as it travels in the TCP handshake.
pub type NcclId = Vec<u8>;

/// Draws a fresh unique id (prefill side). Needs libnccl.
pub fn new_id() -> Result<NcclId, NcclError> {
    let id = Id::new().map_err(|e| NcclError(format!("ncclGetUniqueId failed: {e:?}")))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// One side of a two-rank communicator with its transfer stream.
pub struct NcclLink {
    comm: Mutex<LinkComm>,
    peer: i32,
    /// Receiving side: layer notices waiting for their turn.
    recv_order: Mutex<RecvOrder<PendingRecv>>,
}

/// The communicator and what is numbered under its lock.
struct LinkComm {
    comm: Comm,
    /// Sending side: the number the next layer group sent on this link gets.
    next_send: u64,
}

/// One layer's receive, waiting until every earlier send on the link has its receive.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingRecv {
    /// The request whose KV it is.
    pub request: baton_core::api::RequestId,
    /// Layer index.
    pub layer: usize,
    /// Receiver-side block runs `(first block, count)`.
    pub runs: Vec<(usize, usize)>,
}

/// Puts numbered items back in order: items `0, 1, 2, ...` come out in that order, each as
/// soon as every lower number has come out. A number seen twice or already released is
/// refused (the sender never reuses one), and so is one more than [`MAX_NOTICES_AHEAD`] past
/// the next due: numbers come from a peer, and each one held costs memory until the gap
/// before it is filled.
#[derive(Debug)]
pub struct RecvOrder<T> {
    next: u64,
    waiting: std::collections::BTreeMap<u64, T>,
}

/// How far past the next due number a notice may be. Honest gaps come from concurrent
/// hand-offs on one link (a few hundred prompts × their layers at most); a peer's number
/// beyond this would hold memory for a gap that never fills.
pub const MAX_NOTICES_AHEAD: u64 = 1 << 16;

impl<T> Default for RecvOrder<T> {
    fn default() -> Self {
        Self { next: 0, waiting: std::collections::BTreeMap::new() }
    }
}

impl<T> RecvOrder<T> {
    /// Files item `seq` and returns every item now due, in order; `Err` for a number that
    /// was already released or is already waiting.
    pub fn push(&mut self, seq: u64, item: T) -> Result<Vec<T>, NcclError> {
        if seq < self.next || self.waiting.contains_key(&seq) {
            return Err(NcclError(format!("layer notice {seq} seen twice on one link")));
        }
        if seq - self.next > MAX_NOTICES_AHEAD {
            return Err(NcclError(format!("layer notice {seq} is too far past {} on one link", self.next)));
        }
        self.waiting.insert(seq, item);
        let mut due = Vec::new();
        while let Some(item) = self.waiting.remove(&self.next) {
            due.push(item);
            self.next += 1;
        }
        Ok(due)
    }

    /// How many items wait for a lower number.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; the mutex serializes them. The stream it holds is itself Send + Sync.
unsafe impl Send for NcclLink {}
// SAFETY: as above: every use goes through the mutex.
unsafe impl Sync for NcclLink {}

impl std::fmt::Debug for NcclLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLink").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl NcclLink {
    /// Joins the communicator `id` as `rank` (0: prefill, 1: decode) on `stream`'s device.
    /// Blocks until the peer joins too, so call it off the async runtime.
    pub fn join(stream: Arc<CudaStream>, id: &[u8], rank: usize) -> Result<Self, NcclError> {
        if id.len() != 128 || rank > 1 {
            return Err(NcclError(format!("bad link setup: {}-byte id, rank {rank}", id.len())));
        }
        stream.context().bind_to_thread().map_err(|e| NcclError(format!("cannot bind the CUDA context: {e}")))?;
        let mut raw = [0 as core::ffi::c_char; 128];
        for (r, b) in raw.iter_mut().zip(id) {
            *r = *b as core::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), rank, 2, Id::uninit(raw))
            .map_err(|e| NcclError(format!("ncclCommInitRank (rank {rank}) failed: {e:?}")))?;
        let peer = 1 - rank as i32;
        // NCCL connects point-to-point channels lazily, inside the first grouped send/recv, and
        // that call blocks until the peer makes the matching call. Do it here, on the joining
        // threads, so the engine threads' later sends and receives only ever enqueue.
        let mut probe = stream.alloc_zeros::<u8>(1).map_err(|e| NcclError(format!("probe buffer: {e}")))?;
        if rank == 0 {
            comm.send(&probe, peer).map_err(|e| NcclError(format!("warm-up ncclSend failed: {e:?}")))?;
        } else {
            comm.recv(&mut probe, peer).map_err(|e| NcclError(format!("warm-up ncclRecv failed: {e:?}")))?;
        }
        stream.synchronize().map_err(|e| NcclError(format!("warm-up sync: {e}")))?;
        Ok(Self { comm: Mutex::new(LinkComm { comm, next_send: 0 }), peer, recv_order: Mutex::default() })
    }

    /// Sending side: runs `f` (which enqueues one layer group of sends) under the link's
    /// lock and returns the group's number, which the receiver needs to match it.
    pub fn send_numbered(&self, f: impl FnOnce(&Comm, i32) -> Result<(), NcclError>) -> Result<u64, NcclError> {
        let mut link = self.lock()?;
        f(&link.comm, self.peer)?;
        let seq = link.next_send;
        link.next_send += 1;
        Ok(seq)
    }

    /// Receiving side: files the notice for send group `seq` and returns every receive now
    /// due, in the order the sender enqueued the matching sends.
    pub fn order_recv(&self, seq: u64, recv: PendingRecv) -> Result<Vec<PendingRecv>, NcclError> {
        let mut order = self.recv_order.lock().map_err(|_| NcclError("the link's lock is poisoned".into()))?;
        let due = order.push(seq, recv)?;
        if order.waiting() > 0 && due.is_empty() {
            tracing::debug!(seq, waiting = order.waiting(), "layer notice ahead of an earlier one; holding it");
        }
        Ok(due)
    }

    /// Runs `f` with the communicator and the peer's rank.
    pub fn with<T>(&self, f: impl FnOnce(&Comm, i32) -> Result<T, NcclError>) -> Result<T, NcclError> {
        f(&self.lock()?.comm, self.peer)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, LinkComm>, NcclError> {
        self.comm.lock().map_err(|_| NcclError("the link's lock is poisoned".into()))
    }
}

/// The backend side of a link: what a GPU backend does with its paged cache.
pub trait NcclOps {
    /// A new stream on the backend's device, for one link's transfers.
    fn new_transfer_stream(&self) -> Result<Arc<CudaStream>, NcclError>;
    /// Enqueues sending layer `layer`'s K and V of each run `(first block, count)` to the
    /// link's peer and returns the group's number on the link (see [`NcclLink::send_numbered`]).
    /// The runs must be the plan's (contiguous on both sides), so every send meets a receive
    /// of the same size.
    fn send_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<u64, NcclError>;
    /// Enqueues receiving layer `layer`'s K and V into each run `(first block, count)`.
    fn recv_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), NcclError>;
    /// Enqueues receiving what [`NcclOps::recv_layer`] would, into scratch memory that is then
    /// dropped: for a send whose request is gone, so the link stays in step.
    fn discard_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), NcclError>;
    /// Makes the compute stream wait for everything enqueued on the link so far: after the
    /// step that sent a prompt (before its blocks can be reused) and before the first step
    /// that reads received KV.
    fn fence(&mut self, link: &NcclLink) -> Result<(), NcclError>;
}

/// Contiguous runs `(first, count)` of a block list, in order.
pub fn block_runs(blocks: &[u32]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some((start, len)) if *start + *len == b as usize => *len += 1,
            _ => runs.push((b as usize, 1)),
        }
    }
    runs
}

/// Links by peer, shared by a worker's hand-offs.
#[derive(Default)]
pub struct NcclLinks {
    links: Mutex<std::collections::HashMap<String, Arc<NcclLink>>>,
    /// Woken on every insert, for [`NcclLinks::wait_for`].
    added: tokio::sync::Notify,
}

impl NcclLinks {
    /// The link to `peer`, if one exists.
    pub fn get(&self, peer: &str) -> Option<Arc<NcclLink>> {
        self.links.lock().ok().and_then(|l| l.get(peer).cloned())
    }

    /// Remembers the link to `peer` (replacing an older one).
    pub fn insert(&self, peer: String, link: Arc<NcclLink>) {
        if let Ok(mut l) = self.links.lock() {
            l.insert(peer, link);
        }
        self.added.notify_waiters();
    }

    /// The link to `peer`, waiting up to `within` for a setup still in progress to file it.
    pub async fn wait_for(&self, peer: &str, within: std::time::Duration) -> Option<Arc<NcclLink>> {
        let until = tokio::time::Instant::now() + within;
        loop {
            // Registered before looking, so an insert between the look and the wait is seen.
            let added = self.added.notified();
            if let Some(link) = self.get(peer) {
                return Some(link);
            }
            if tokio::time::timeout_at(until, added).await.is_err() {
                return self.get(peer);
            }
        }
    }

    /// Forgets the link to `peer` (after a failure); dropping the last handle aborts it.
    pub fn remove(&self, peer: &str) {
        if let Ok(mut l) = self.links.lock() {
            l.remove(peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recv_order_releases_in_sequence() {
        let mut o = RecvOrder::default();
        assert_eq!(o.push(1, 'b').expect("1"), Vec::<char>::new());
        assert_eq!(o.push(2, 'c').expect("2"), Vec::<char>::new());
        assert_eq!(o.waiting(), 2);
        assert_eq!(o.push(0, 'a').expect("0"), vec!['a', 'b', 'c']);
        assert_eq!(o.push(3, 'd').expect("3"), vec!['d']);
        assert_eq!(o.waiting(), 0);
    }

    #[test]
    fn recv_order_refuses_a_number_twice() {
        let mut o = RecvOrder::default();
        o.push(0, 'a').expect("0");
        assert!(o.push(0, 'x').is_err(), "released numbers are refused");
        o.push(2, 'c').expect("2");
        assert!(o.push(2, 'y').is_err(), "waiting numbers are refused");
        assert_eq!(o.push(1, 'b').expect("1"), vec!['b', 'c']);
        assert!(o.push(u64::MAX, 'z').is_err(), "a number far ahead is refused");
        assert!(o.push(3 + MAX_NOTICES_AHEAD + 1, 'z').is_err());
        assert_eq!(o.push(3 + MAX_NOTICES_AHEAD, 'y').expect("in the window"), Vec::<char>::new());
        assert_eq!(o.waiting(), 1);
    }

    #[test]
    fn runs_merge_consecutive_blocks() {
        assert_eq!(block_runs(&[3, 4, 5, 9, 10, 2]), vec![(3, 3), (9, 2), (2, 1)]);
        assert!(block_runs(&[]).is_empty());
    }
}
