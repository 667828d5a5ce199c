//! The host-staged connector, for the TCP transport: the sending side copies each layer's
//! K and V of an export's blocks to the host as soon as the layer is written and hands the
//! bytes to the export's channel; the receiving side writes each arriving layer into the
//! request's own reserved blocks. Layers of one hand-off arrive in order on one connection,
//! and the engine applies its commands in order, so the trailer completes the request at
//! once: every layer before it is already stored.
//!
//! Bytes from a peer never reach the backend unchecked: a layer must be a layer of the
//! layout, sized for its blocks, aimed at the request's own reservation. Anything else fails
//! that hand-off (the request recomputes) and nothing else.

use super::{KvAccess, KvConnector, KvEvent, KvOutcome, StepExport};
use crate::backend::BackendError;
use crate::kv_transport::LayerFrame;
use crate::relay::{ExportEvent, Reservation};
use baton_core::api::RequestId;
use baton_core::kv_transfer::KvLayout;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// See the module docs.
pub struct TcpConnector {
    layout: KvLayout,
    reservations: HashMap<RequestId, Arc<Reservation>>,
    step: Vec<StepExport>,
}

impl TcpConnector {
    /// For a cache of `layout`.
    pub fn new(layout: KvLayout) -> Self {
        Self { layout, reservations: HashMap::new(), step: Vec::new() }
    }

    /// Checks a received layer against the layout and `id`'s reservation: `Ok(false)` when `id`
    /// no longer waits (the frame is dropped: its blocks may belong to someone else now).
    fn check(&self, id: RequestId, blocks: &[u32], frame: &LayerFrame) -> Result<bool, String> {
        let Some(res) = self.reservations.get(&id) else { return Ok(false) };
        let want = blocks.len().checked_mul(self.layout.bytes_per_block());
        if frame.layer >= self.layout.num_layers {
            return Err(format!("layer {} is not in the layout ({} layers)", frame.layer, self.layout.num_layers));
        }
        if want != Some(frame.k.len()) || want != Some(frame.v.len()) {
            return Err(format!("{}+{} bytes for {} blocks", frame.k.len(), frame.v.len(), blocks.len()));
        }
        // Called per layer with every block of a prompt: a set keeps it linear.
        let own: std::collections::HashSet<u32> = res.block_table.iter().copied().collect();
        if !blocks.iter().all(|b| own.contains(b)) {
            return Err(format!(
                "the transfer targets blocks {blocks:?} outside the reservation {:?}",
                res.block_table
            ));
        }
        Ok(true)
    }
}

impl KvConnector for TcpConnector {
    fn reserve(&mut self, id: RequestId, reservation: Arc<Reservation>) {
        self.reservations.insert(id, reservation);
    }

    fn on_event(&mut self, event: KvEvent, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>) {
        match event {
            KvEvent::Layer { id, blocks, frame } => match self.check(id, &blocks, &frame) {
                Ok(false) => {}
                Ok(true) => {
                    match kv.import_kv_blocks(frame.layer, &blocks, &frame.k, &frame.v, frame.coding.as_ref()) {
                        Ok(()) => {}
                        Err(e) if e.is_fatal() => out.push(KvOutcome::Fatal(e)),
                        Err(e) => {
                            self.reservations.remove(&id);
                            out.push(KvOutcome::Recompute { id, reason: e.to_string() });
                        }
                    }
                }
                Err(reason) => {
                    self.reservations.remove(&id);
                    out.push(KvOutcome::Recompute {
                        id,
                        reason: format!("cannot store a received KV layer: {reason}"),
                    });
                }
            },
            KvEvent::Done { id, trailer, reply } => {
                if self.reservations.remove(&id).is_some() {
                    out.push(KvOutcome::Complete { id, trailer, reply });
                } else if let Some(reply) = reply {
                    let _ = reply.send(Err(format!("request {id} no longer waits for its KV")));
                }
            }
            KvEvent::LinkLayer { id, .. } => {
                self.reservations.remove(&id);
                out.push(KvOutcome::Recompute { id, reason: "a link notice on the host-staged path".into() });
            }
            KvEvent::TransferStream { reply } => {
                let _ = reply.send(Err("the host-staged connector has no device streams".into()));
            }
        }
    }

    fn poll(&mut self, _kv: &mut dyn KvAccess, _now: Instant, _out: &mut Vec<KvOutcome>) {}

    fn cancel(&mut self, id: RequestId, out: &mut Vec<KvOutcome>) {
        self.reservations.remove(&id);
        out.push(KvOutcome::Recompute { id, reason: "the hand-off was given up".into() });
    }

    fn forget(&mut self, id: RequestId) {
        self.reservations.remove(&id);
    }

    fn busy(&self) -> bool {
        false
    }

    fn begin_step(&mut self, exports: Vec<StepExport>) {
        self.step = exports;
    }

    fn after_layer(&mut self, layer: usize, kv: &mut dyn KvAccess) -> Result<(), BackendError> {
        for e in &self.step {
            let (k, v) = kv.read_kv_blocks(layer, &e.blocks)?;
            // How the codes were written: calibrated scales once this layer's calibration ran
            // (it runs before the layer's KV write, so before this hook), and the key shift.
            let coding = kv.kv_coding(layer);
            let _ = e.tx.send(ExportEvent::Layer(LayerFrame { layer, k, v, seq: 0, coding }));
        }
        Ok(())
    }

    fn fence(&mut self, _kv: &mut dyn KvAccess, _out: &mut Vec<KvOutcome>) {
        // The bytes were copied to the host during the step: nothing is still reading the blocks.
        self.step.clear();
    }
}
