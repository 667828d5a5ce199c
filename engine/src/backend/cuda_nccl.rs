//! NCCL sends and receives straight from and into the CUDA backend's paged KV cache, one
//! group per layer, one send (receive) per contiguous block run of K and of V. Everything is
//! enqueued on the link's transfer stream; cudarc's event tracking orders it against the
//! compute stream's writes and reads of the same layer (see `kv_transport::nccl`).

use super::CudaBackend;
use crate::kv_transport::nccl::{NcclError, NcclLink, NcclOps};
use cudarc::driver::CudaStream;
use cudarc::nccl::result::{group_end, group_start};
use std::sync::Arc;

impl CudaBackend {
    fn layer_block_len(&self, layer: usize, runs: &[(usize, usize)]) -> Result<usize, NcclError> {
        if layer >= self.kv.len() {
            return Err(NcclError(format!("layer {layer} has no KV cache")));
        }
        let last: Vec<u32> = runs.iter().filter(|r| r.1 > 0).map(|&(s, n)| (s + n - 1) as u32).collect();
        self.kv_block_len(&last).map_err(|e| NcclError(e.to_string()))
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> NcclError {
    NcclError(format!("{what} failed: {e:?}"))
}

/// Runs `f` (which enqueues sends or receives) inside one NCCL group, and closes the group
/// whatever `f` returned, so the communicator stays usable after a failure.
fn grouped(f: impl FnOnce() -> Result<(), NcclError>) -> Result<(), NcclError> {
    group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
    let result = f();
    group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
    result
}

impl NcclOps for CudaBackend {
    fn fence(&mut self, link: &NcclLink) -> Result<(), NcclError> {
        let compute = self.dev.stream().clone();
        link.with(|comm, _| compute.join(&comm.stream()).map_err(|e| nccl_err("fencing compute on the transfer", e)))
    }

    fn new_transfer_stream(&self) -> Result<Arc<CudaStream>, NcclError> {
        self.dev.stream().context().new_stream().map_err(|e| nccl_err("creating a transfer stream", e))
    }

    fn send_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<u64, NcclError> {
        let bl = self.layer_block_len(layer, runs)?;
        let compute = self.dev.stream().clone();
        let (kc, vc) = &self.kv[layer];
        link.send_numbered(|comm, peer| {
            // Send what the compute stream has written so far (this layer's KV included).
            comm.stream().join(&compute).map_err(|e| nccl_err("ordering the send after compute", e))?;
            grouped(|| {
                runs.iter().try_for_each(|&(start, len)| {
                    let r = start * bl..(start + len) * bl;
                    comm.send(&kc.slice(r.clone()), peer)
                        .and_then(|_| comm.send(&vc.slice(r), peer))
                        .map_err(|e| nccl_err("ncclSend", e))
                })
            })
        })
    }

    fn recv_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), NcclError> {
        let bl = self.layer_block_len(layer, runs)?;
        let compute = self.dev.stream().clone();
        let (kc, vc) = &mut self.kv[layer];
        link.with(|comm, peer| {
            comm.stream().join(&compute).map_err(|e| nccl_err("ordering the receive after compute", e))?;
            grouped(|| {
                runs.iter().try_for_each(|&(start, len)| {
                    let r = start * bl..(start + len) * bl;
                    comm.recv(&mut kc.slice_mut(r.clone()), peer)
                        .and_then(|_| comm.recv(&mut vc.slice_mut(r), peer))
                        .map(|_| ())
                        .map_err(|e| nccl_err("ncclRecv", e))
                })
            })
        })
    }

    fn discard_layer(&mut self, layer: usize, runs: &[(usize, usize)], link: &NcclLink) -> Result<(), NcclError> {
        let bl = self.layer_block_len(layer, runs)?;
        link.with(|comm, peer| {
            let total: usize = runs.iter().map(|r| r.1 * bl).sum();
            // On the transfer stream, so it is freed only after the receives into it ran.
            let mut scratch = comm
                .stream()
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
            })
        })
    }
}
