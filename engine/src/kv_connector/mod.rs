//! The KV connector: the one seam between the engine (scheduler and model) and the ways KV
//! moves between workers, in the spirit of vLLM v1's `KVConnectorBase_V1`.
//!
//! A [`KvConnector`] has two sides, both driven from the engine thread:
//! - the **scheduler side** learns of each reservation ([`KvConnector::reserve`]: blocks
//!   waiting for a prompt's KV), takes the transport's events for it ([`KvEvent`]: layers,
//!   notices, the trailer) and answers with [`KvOutcome`]s: *complete* (the hand-off is whole:
//!   the request becomes runnable with its first token) or *recompute* (the hand-off failed:
//!   the prompt is computed here). [`KvConnector::poll`] runs every engine iteration, for
//!   completions and deadlines; [`KvConnector::cancel`] gives a reservation up.
//! - the **worker side** runs around the forward: [`KvConnector::begin_step`] with the exports
//!   whose prompts complete in the step, [`KvConnector::after_layer`] as soon as each layer's
//!   KV is written (the sending side stages or enqueues that layer; the receiving side does
//!   nothing), and [`KvConnector::fence`] after the forward (compute waits for what it
//!   depends on; nothing ever waits for ever).
//!
//! The engine loop has one KV command and forwards every event here; neither it, the model
//! nor the backend trait names a transport. [`TcpConnector`] stages layers through the host
//! (the TCP transport carries the bytes); [`LinkConnector`] moves them over a [`Link`]
//! (NCCL between GPUs, or the CPU fake in [`fake`]); [`RelayConnector`], the engine's,
//! routes each hand-off to the one it uses.
//!
//! The connector lives here rather than in `kv_transport` because it is the engine's side of
//! the seam (it touches the cache, through [`KvAccess`]); `kv_transport` is the network's
//! side (wire format, handshakes, admission, link setup) and never touches the cache.

pub mod fake;
pub mod link;
mod link_connector;
mod tcp;

pub use link::{GateState, HandoffGate, Link, LinkComm, LinkError, Links, PendingRecv, RecvOrder};
pub use link_connector::LinkConnector;
pub use tcp::TcpConnector;

use crate::backend::{Backend, BackendError, KvDeviceAccess};
use crate::kv_cache_dtype::KvCoding;
use crate::kv_transport::LayerFrame;
use crate::relay::{ExportEvent, Reservation, TransferTrailer};
use baton_core::api::RequestId;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// How long a link operation, a held trailer or a gap in a link's notices may wait by
/// default before the link is failed.
pub const DEFAULT_TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

/// The paged KV cache as a connector sees it: host copies of blocks (every backend) and, on
/// a GPU backend, the device itself.
pub trait KvAccess {
    /// Layer `layer`'s K and V of `blocks`, in order, as host bytes.
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError>;
    /// Writes bytes [`KvAccess::read_kv_blocks`] produced on a cache of the same layout.
    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError>;
    /// The device side of the cache, on backends that have one.
    fn device(&mut self) -> Option<&mut dyn KvDeviceAccess>;
    /// How layer `layer`'s FP8 codes are written (scales and key shift), `None` when the
    /// cache is not FP8.
    fn kv_coding(&self, layer: usize) -> Option<KvCoding>;
    /// Stores codes another cache of the same layout wrote as `sender` says (`None`: not
    /// FP8, the bytes are stored as they are). Codes written otherwise than this layer's are
    /// requantized into this layer's coding ([`write_in_own_coding`]); the engine's model
    /// overrides this so that a layer still waiting for its calibration adopts the sender's
    /// scales, and a cache no step has written adopts its key shift, instead
    /// (`crate::runner::ModelRunner`).
    fn import_kv_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        k: &[u8],
        v: &[u8],
        sender: Option<&KvCoding>,
    ) -> Result<(), BackendError> {
        write_in_own_coding(self, layer, blocks, (k, v), sender)
    }
}

/// [`KvAccess::import_kv_blocks`]'s default: the codes requantized from `sender`'s coding into
/// layer `layer`'s own where they differ (values by their scales; keys by their scales and
/// shifts, [`baton_kernels::cpu::requantize_keys_e4m3`]), else stored as they are.
pub fn write_in_own_coding<A: KvAccess + ?Sized>(
    kv: &mut A,
    layer: usize,
    blocks: &[u32],
    (k, v): (&[u8], &[u8]),
    sender: Option<&KvCoding>,
) -> Result<(), BackendError> {
    match (sender, kv.kv_coding(layer)) {
        (Some(sent), Some(own)) if *sent != own => {
            let (mut k, mut v) = (k.to_vec(), v.to_vec());
            let stride = sent.k_shift.len().max(own.k_shift.len());
            if stride == 0 {
                baton_kernels::cpu::requantize_e4m3(&mut k, sent.scale.k, own.scale.k);
            } else {
                let (from, to) = ((sent.scale.k, &sent.k_shift[..]), (own.scale.k, &own.k_shift[..]));
                baton_kernels::cpu::requantize_keys_e4m3(&mut k, stride, from, to)?;
            }
            baton_kernels::cpu::requantize_e4m3(&mut v, sent.scale.v, own.scale.v);
            kv.write_kv_blocks(layer, blocks, &k, &v)
        }
        _ => kv.write_kv_blocks(layer, blocks, k, v),
    }
}

impl<B: Backend> KvAccess for B {
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError> {
        host_kv(self)?.read_kv_blocks(layer, blocks)
    }

    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        host_kv(self)?.write_kv_blocks(layer, blocks, k, v)
    }

    fn device(&mut self) -> Option<&mut dyn KvDeviceAccess> {
        Backend::kv_device(self)
    }

    fn kv_coding(&self, layer: usize) -> Option<KvCoding> {
        let scale = Backend::kv_scales(self).get(layer).copied()?;
        Some(KvCoding { scale, k_shift: Backend::kv_k_shift(self, layer) })
    }
}

/// The backend's host copies of KV blocks; a backend without them cannot hand KV over TCP.
fn host_kv<B: Backend>(b: &mut B) -> Result<&mut dyn crate::backend::KvIo, BackendError> {
    let name = b.device_name();
    b.kv_io().ok_or_else(|| BackendError::Device(format!("{name} cannot copy KV blocks to or from the host")))
}

/// How an export's KV leaves the prefill engine.
#[derive(Debug, Clone, Default)]
pub enum ExportVia {
    /// Layer bytes staged to the host, for the TCP transport.
    #[default]
    Host,
    /// Over `link`, once `gate` says the receiver accepted the hand-off.
    Link {
        /// The link to the decode worker.
        link: Arc<Link>,
        /// Opened by the transport when the receiver accepts the handshake.
        gate: HandoffGate,
    },
}

/// One export whose prompt completes in the coming step.
#[derive(Debug, Clone)]
pub struct StepExport {
    /// The export request.
    pub id: RequestId,
    /// The sender's blocks, in plan order.
    pub blocks: Vec<u32>,
    /// The plan's runs on the sender's side, `(first block, count)`.
    pub runs: Vec<(usize, usize)>,
    /// Where its layers (or layer notices) go.
    pub tx: UnboundedSender<ExportEvent>,
    /// How.
    pub via: ExportVia,
}

/// Answers whether a completed hand-off's request took its first token (the receiver then
/// acknowledges the sender), or why not.
pub type DoneReply = tokio::sync::oneshot::Sender<Result<(), String>>;

/// What the transport tells the connector about a hand-off into this engine.
pub enum KvEvent {
    /// A received layer's bytes for `blocks` of request `id` (TCP).
    Layer {
        /// The request.
        id: RequestId,
        /// Its reserved blocks, in plan order.
        blocks: Vec<u32>,
        /// The layer.
        frame: LayerFrame,
    },
    /// Layer `layer` of `id` was sent on `link` as send group `seq`: enqueue its receive into
    /// the receiver-side `runs`, in the link's send order.
    LinkLayer {
        /// The request.
        id: RequestId,
        /// Layer index.
        layer: usize,
        /// The send group's number on the link.
        seq: u64,
        /// Receiver-side runs `(first block, count)`.
        runs: Vec<(usize, usize)>,
        /// The link.
        link: Arc<Link>,
    },
    /// The sender's trailer: every layer was sent. Completes the request once all of its own
    /// layers are in (`reply`, when given, hears the outcome).
    Done {
        /// The request.
        id: RequestId,
        /// The first token.
        trailer: TransferTrailer,
        /// Told whether the request took its first token.
        reply: Option<DoneReply>,
    },
    /// A new stream on this engine's device for a new link's transfers (an error on a
    /// backend without a device).
    TransferStream {
        /// The answer.
        reply: tokio::sync::oneshot::Sender<Result<Arc<cudarc::driver::CudaStream>, String>>,
    },
}

/// What the engine does after a connector call.
#[derive(Debug)]
pub enum KvOutcome {
    /// Decode side: the hand-off of `id` is whole; it joins the batch with `trailer`'s first
    /// token (after the engine checked the trailer against the request), and `reply` hears
    /// how that went.
    Complete {
        /// The request.
        id: RequestId,
        /// The first token.
        trailer: TransferTrailer,
        /// To answer.
        reply: Option<DoneReply>,
    },
    /// Decode side: the hand-off of `id` failed (or was given up and nothing more can land in
    /// its blocks): it recomputes its prompt here.
    Recompute {
        /// The request.
        id: RequestId,
        /// Why.
        reason: String,
    },
    /// Prefill side: the export `id` cannot hand its KV off; the request fails.
    ExportFailed {
        /// The request.
        id: RequestId,
        /// Why.
        reason: String,
    },
    /// The device failed for good (the engine stops).
    Fatal(BackendError),
}

/// The engine's seam to KV hand-offs; see the module docs.
pub trait KvConnector: Send {
    /// Scheduler side: `id` reserved `reservation` and waits for its KV.
    fn reserve(&mut self, id: RequestId, reservation: Arc<Reservation>);
    /// Scheduler side: an event from the transport.
    fn on_event(&mut self, event: KvEvent, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>);
    /// Scheduler side: completions and deadlines, every engine iteration.
    fn poll(&mut self, kv: &mut dyn KvAccess, now: Instant, out: &mut Vec<KvOutcome>);
    /// Scheduler side: `id` stops waiting for its KV and recomputes. A
    /// [`KvOutcome::Recompute`] follows once nothing more can land in its blocks (at once,
    /// unless receives into them are in flight).
    fn cancel(&mut self, id: RequestId, out: &mut Vec<KvOutcome>);
    /// Scheduler side: `id` is gone (aborted, completed, recomputing): data for it from now on
    /// is dropped (or, on a link, received into scratch).
    fn forget(&mut self, id: RequestId);
    /// Whether anything is in flight that [`KvConnector::poll`] must look at (the engine then
    /// does not sleep until the next command).
    fn busy(&self) -> bool;
    /// Worker side: the exports whose prompts complete in the coming step.
    fn begin_step(&mut self, exports: Vec<StepExport>);
    /// Worker side: layer `layer`'s KV is written for the step's tokens.
    fn after_layer(&mut self, layer: usize, kv: &mut dyn KvAccess) -> Result<(), BackendError>;
    /// Worker side: after the step's forward. Exports that could not hand off are reported.
    fn fence(&mut self, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>);
}

/// The engine's connector: TCP hand-offs to [`TcpConnector`], link hand-offs to
/// [`LinkConnector`].
pub struct RelayConnector {
    tcp: TcpConnector,
    link: LinkConnector,
}

impl RelayConnector {
    /// For a cache of `layout`; link operations time out after `timeout`.
    pub fn new(layout: baton_core::kv_transfer::KvLayout, timeout: Duration) -> Self {
        Self { tcp: TcpConnector::new(layout), link: LinkConnector::new(layout, timeout) }
    }
}

impl KvConnector for RelayConnector {
    fn reserve(&mut self, id: RequestId, reservation: Arc<Reservation>) {
        self.tcp.reserve(id, reservation.clone());
        self.link.reserve(id, reservation);
    }

    fn on_event(&mut self, event: KvEvent, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>) {
        match event {
            e @ KvEvent::Layer { .. } => self.tcp.on_event(e, kv, out),
            KvEvent::Done { id, trailer, reply } if !self.link.has_incoming(id) => {
                self.tcp.on_event(KvEvent::Done { id, trailer, reply }, kv, out)
            }
            e => self.link.on_event(e, kv, out),
        }
    }

    fn poll(&mut self, kv: &mut dyn KvAccess, now: Instant, out: &mut Vec<KvOutcome>) {
        self.link.poll(kv, now, out);
    }

    fn cancel(&mut self, id: RequestId, out: &mut Vec<KvOutcome>) {
        self.tcp.forget(id);
        self.link.cancel(id, out);
    }

    fn forget(&mut self, id: RequestId) {
        self.tcp.forget(id);
        self.link.forget(id);
    }

    fn busy(&self) -> bool {
        self.link.busy()
    }

    fn begin_step(&mut self, exports: Vec<StepExport>) {
        let (host, link): (Vec<StepExport>, Vec<StepExport>) =
            exports.into_iter().partition(|e| matches!(e.via, ExportVia::Host));
        self.tcp.begin_step(host);
        self.link.begin_step(link);
    }

    fn after_layer(&mut self, layer: usize, kv: &mut dyn KvAccess) -> Result<(), BackendError> {
        self.tcp.after_layer(layer, kv)?;
        self.link.after_layer(layer, kv)
    }

    fn fence(&mut self, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>) {
        self.tcp.fence(kv, out);
        self.link.fence(kv, out);
    }
}

/// Expands runs `(first block, count)` into block ids; `None` past the largest block id.
pub(crate) fn run_blocks(runs: &[(usize, usize)]) -> Option<Vec<u32>> {
    let mut blocks = Vec::new();
    for &(s, n) in runs {
        let end = u32::try_from(s.checked_add(n)?).ok()?;
        blocks.extend(u32::try_from(s).ok()?..end);
    }
    Some(blocks)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_consecutive_blocks_and_expand_back() {
        assert_eq!(block_runs(&[3, 4, 5, 9, 10, 2]), vec![(3, 3), (9, 2), (2, 1)]);
        assert!(block_runs(&[]).is_empty());
        assert_eq!(run_blocks(&[(3, 3), (9, 2), (2, 1)]), Some(vec![3, 4, 5, 9, 10, 2]));
        assert_eq!(run_blocks(&[(usize::MAX, 2)]), None);
    }
}
