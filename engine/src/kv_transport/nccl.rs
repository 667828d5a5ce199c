//! NCCL links: the [`LinkComm`] of a GPU-to-GPU KV link between a prefill worker (rank 0)
//! and a decode worker (rank 1). The link's state machine (ordering, gates, deadlines,
//! faults) is the connector's ([`crate::kv_connector`]); this is only the communicator.
//!
//! One link per P–D pair, created on first contact and reused: the prefill side draws a
//! unique id and sends it over the TCP control connection; both sides then join the two-rank
//! communicator on their own device and a dedicated *transfer stream*, so sends and
//! receives never queue behind (or block) the engine's compute stream. Data moves straight
//! between the paged caches ([`crate::backend::KvDeviceAccess`]), one grouped send/recv per
//! layer and contiguous block run, with no staging.
//!
//! Ordering: the transfer stream waits for the compute stream before each layer's sends (so
//! they read finished KV) and receives; cudarc's event tracking on the cache orders compute's
//! later use of those blocks after them; after the sending step the compute stream waits for
//! the sends ([`LinkComm::fence_sends`]). Completion is observed without blocking: an event
//! is recorded after every group and queried ([`LinkComm::sends_done`],
//! [`LinkComm::recvs_done`]), so a receiving request becomes runnable only once its data has
//! landed. A dead peer leaves a group incomplete for ever: the connector's deadline then
//! aborts the communicator ([`LinkComm::abort`], `ncclCommAbort`, through cudarc's `Drop` for
//! `Comm`), which makes the pending kernels return.

use crate::backend::BackendError;
use crate::kv_connector::{KvAccess, LinkComm, LinkError};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::result::{group_end, group_start};
use cudarc::nccl::safe::{Comm, Id};
use std::collections::VecDeque;
use std::sync::Arc;

/// The 128-byte NCCL unique id, as it travels in the TCP handshake.
pub type NcclId = Vec<u8>;

/// Draws a fresh unique id (prefill side). Needs libnccl.
pub fn new_id() -> Result<NcclId, LinkError> {
    let id = Id::new().map_err(|e| LinkError(format!("ncclGetUniqueId failed: {e:?}")))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> LinkError {
    LinkError(format!("{what} failed: {e:?}"))
}

fn backend_err(e: BackendError) -> LinkError {
    LinkError(e.to_string())
}

/// Runs `f` (which enqueues sends or receives) inside one NCCL group, and closes the group
/// whatever `f` returned.
fn grouped(f: impl FnOnce() -> Result<(), LinkError>) -> Result<(), LinkError> {
    group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
    let result = f();
    group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
    result
}

/// One side of a two-rank NCCL communicator with its transfer stream.
pub struct CudaComm {
    /// `None` once aborted.
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    peer: i32,
    /// Events after each send (receive) group not yet seen complete, and how many were.
    sends: VecDeque<CudaEvent>,
    sends_done: u64,
    recvs: VecDeque<CudaEvent>,
    recvs_done: u64,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; the `Link` that owns a `CudaComm` serializes every call under its mutex. The
// stream and events it holds are themselves Send.
unsafe impl Send for CudaComm {}

impl CudaComm {
    /// Joins the communicator `id` as `rank` (0: prefill, 1: decode) on `stream` (a transfer
    /// stream of this worker's device). Blocks until the peer joins too, so call it off the
    /// async runtime.
    pub fn join(stream: Arc<CudaStream>, id: &[u8], rank: usize) -> Result<Self, LinkError> {
        if id.len() != 128 || rank > 1 {
            return Err(LinkError(format!("bad link setup: {}-byte id, rank {rank}", id.len())));
        }
        stream.context().bind_to_thread().map_err(|e| nccl_err("binding the CUDA context", e))?;
        let mut raw = [0 as core::ffi::c_char; 128];
        for (r, b) in raw.iter_mut().zip(id) {
            *r = *b as core::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), rank, 2, Id::uninit(raw))
            .map_err(|e| nccl_err(&format!("ncclCommInitRank (rank {rank})"), e))?;
        let peer = 1 - rank as i32;
        // NCCL connects point-to-point channels lazily, inside the first grouped send/recv, and
        // that call blocks until the peer makes the matching call. Do it here, on the joining
        // threads, so the engine threads' later sends and receives only ever enqueue.
        let mut probe = stream.alloc_zeros::<u8>(1).map_err(|e| nccl_err("the probe buffer", e))?;
        if rank == 0 {
            comm.send(&probe, peer).map_err(|e| nccl_err("warm-up ncclSend", e))?;
        } else {
            comm.recv(&mut probe, peer).map_err(|e| nccl_err("warm-up ncclRecv", e))?;
        }
        stream.synchronize().map_err(|e| nccl_err("warm-up sync", e))?;
        Ok(Self {
            comm: Some(comm),
            stream,
            peer,
            sends: VecDeque::new(),
            sends_done: 0,
            recvs: VecDeque::new(),
            recvs_done: 0,
        })
    }

    fn comm(&self) -> Result<&Comm, LinkError> {
        self.comm.as_ref().ok_or_else(|| LinkError("the communicator was aborted".into()))
    }

    /// An event after everything enqueued on the transfer stream so far.
    fn mark(&self) -> Result<CudaEvent, LinkError> {
        self.stream.record_event(None).map_err(|e| nccl_err("recording a transfer event", e))
    }

    fn device(kv: &mut dyn KvAccess) -> Result<&mut dyn crate::backend::KvDeviceAccess, LinkError> {
        kv.device().ok_or_else(|| LinkError("an NCCL link needs a device backend".into()))
    }

    /// Pops the leading complete events of `q`, counting them into `done`.
    fn drain(q: &mut VecDeque<CudaEvent>, done: &mut u64) -> Result<u64, LinkError> {
        while let Some(e) = q.front() {
            if !e.try_is_complete().map_err(|e| nccl_err("querying a transfer event", e))? {
                break;
            }
            q.pop_front();
            *done += 1;
        }
        Ok(*done)
    }
}

impl LinkComm for CudaComm {
    fn send(&mut self, kv: &mut dyn KvAccess, layer: usize, runs: &[(usize, usize)]) -> Result<(), LinkError> {
        let dev = Self::device(kv)?;
        let compute = dev.compute_stream();
        let cache = dev.layer_cache(layer, runs).map_err(backend_err)?;
        let (comm, peer, bl) = (self.comm()?, self.peer, cache.block_len);
        // Send what the compute stream has written so far (this layer's KV included).
        self.stream.join(&compute).map_err(|e| nccl_err("ordering the send after compute", e))?;
        grouped(|| {
            runs.iter().try_for_each(|&(start, len)| {
                let r = start * bl..(start + len) * bl;
                comm.send(&cache.k.slice(r.clone()), peer)
                    .and_then(|_| comm.send(&cache.v.slice(r), peer))
                    .map_err(|e| nccl_err("ncclSend", e))
            })
        })?;
        let e = self.mark()?;
        self.sends.push_back(e);
        Ok(())
    }

    fn recv(
        &mut self,
        kv: &mut dyn KvAccess,
        layer: usize,
        runs: &[(usize, usize)],
        into_cache: bool,
    ) -> Result<(), LinkError> {
        let dev = Self::device(kv)?;
        let compute = dev.compute_stream();
        let cache = dev.layer_cache(layer, runs).map_err(backend_err)?;
        let (comm, peer, bl) = (self.comm()?, self.peer, cache.block_len);
        self.stream.join(&compute).map_err(|e| nccl_err("ordering the receive after compute", e))?;
        if into_cache {
            grouped(|| {
                runs.iter().try_for_each(|&(start, len)| {
                    let r = start * bl..(start + len) * bl;
                    comm.recv(&mut cache.k.slice_mut(r.clone()), peer)
                        .and_then(|_| comm.recv(&mut cache.v.slice_mut(r), peer))
                        .map(|_| ())
                        .map_err(|e| nccl_err("ncclRecv", e))
                })
            })?;
        } else {
            let total: usize = runs.iter().map(|r| r.1 * bl).sum();
            // On the transfer stream, so it is freed only after the receives into it ran.
            let mut scratch = self
                .stream
                .alloc_zeros::<baton_kernels::cuda::bf16>(total.max(1))
                .map_err(|e| nccl_err("allocating scratch for a discarded layer", e))?;
            let mut at = 0;
            grouped(|| {
                runs.iter().try_for_each(|&(_, len)| {
                    let r = at..at + len * bl;
                    at += len * bl;
                    // K and V of a run land on the same scratch: only the byte counts matter.
                    comm.recv(&mut scratch.slice_mut(r.clone()), peer)
                        .and_then(|_| comm.recv(&mut scratch.slice_mut(r), peer))
                        .map(|_| ())
                        .map_err(|e| nccl_err("ncclRecv", e))
                })
            })?;
        }
        let e = self.mark()?;
        self.recvs.push_back(e);
        Ok(())
    }

    fn sends_done(&mut self, _kv: &mut dyn KvAccess) -> Result<u64, LinkError> {
        Self::drain(&mut self.sends, &mut self.sends_done)
    }

    fn recvs_done(&mut self, _kv: &mut dyn KvAccess) -> Result<u64, LinkError> {
        Self::drain(&mut self.recvs, &mut self.recvs_done)
    }

    fn fence_sends(&mut self, kv: &mut dyn KvAccess) -> Result<(), LinkError> {
        let compute = Self::device(kv)?.compute_stream();
        compute.join(&self.stream).map_err(|e| nccl_err("fencing compute on the transfer", e))
    }

    fn abort(&mut self) {
        if let Some(comm) = self.comm.take() {
            // cudarc's `Drop for Comm` calls ncclCommAbort and panics if that fails: the
            // communicator is gone either way, and a panic must not take the caller with it.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(comm))).is_err() {
                tracing::error!("ncclCommAbort failed");
            }
        }
        // The aborted kernels return; wait for the stream so nothing it ran still writes.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(error = %e, "syncing an aborted link's transfer stream");
        }
    }
}
