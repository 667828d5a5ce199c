//! The link connector: hand-offs whose data moves over a [`Link`] (NCCL between GPUs, the
//! fake on the CPU) while the TCP control connection carries only notices.
//!
//! Sending side (prefill): an export's layer groups are enqueued on the link only once its
//! [`HandoffGate`] is open (the receiver accepted the handshake and so will match every send
//! of the hand-off); layers computed before that are staged and sent at the gate's opening,
//! at the latest in [`KvConnector::fence`], which waits for the gate (bounded by the timeout)
//! while the step's blocks are still intact. A gate that closes instead (refused, failed,
//! abandoned) means nothing of that hand-off is ever sent, so the link stays in step. Each
//! group's number on the link goes to the receiver in the layer notice.
//!
//! Receiving side (decode): notices are put back in send order ([`RecvOrder`]) and each due
//! receive is enqueued, into the request's own reserved blocks, or into scratch when the
//! request no longer waits (the send must still be matched). A request is complete only when
//! every one of its own layers has been received *and has landed* (the link reports receive
//! groups done in order): a trailer that arrives earlier waits. Its blocks are never handed
//! back for recompute while a receive into them is in flight.
//!
//! Faults: anything that puts the link out of step or leaves it stuck fails the link (the
//! communicator is aborted) and every request with KV on it recomputes; the registry then
//! stops handing the link out and the next hand-off to that peer makes a new one:
//! - a notice seen twice or too far ahead, or a gap in the notices that does not fill within
//!   the timeout (a notice was lost: e.g. the sender's transfer task was dropped);
//! - a trailer whose layers do not all arrive within the timeout;
//! - an operation (send or receive) not complete within the timeout: a dead or stuck peer.
//!   The link itself carries the deadline, so a watchdog off the engine thread
//!   ([`super::Links::enforce_deadlines`]) fails it too when the engine thread is the one
//!   stuck behind it.

use super::link::{GateState, HandoffGate, Link, PendingRecv, RecvOrder};
use super::{DoneReply, ExportVia, KvAccess, KvConnector, KvEvent, KvOutcome, StepExport, run_blocks};
use crate::backend::BackendError;
use crate::kv_transport::LayerFrame;
use crate::relay::{ExportEvent, Reservation, TransferTrailer};
use baton_core::api::RequestId;
use baton_core::kv_transfer::KvLayout;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One link as this engine uses it.
struct LinkState {
    link: Arc<Link>,
    /// Receiving side: notices put back in send order.
    order: RecvOrder<PendingRecv>,
    /// Receive groups enqueued (the next one's number; equal to the next due send number).
    recvs: u64,
    /// Receive groups landed, at the last poll.
    recvs_done: u64,
    /// Send groups completed, at the last poll.
    sends_done: u64,
    /// Since when a notice has been waiting for a lower number.
    gap_since: Option<Instant>,
}

impl LinkState {
    fn new(link: Arc<Link>) -> Self {
        Self { link, order: RecvOrder::default(), recvs: 0, recvs_done: 0, sends_done: 0, gap_since: None }
    }

    fn outstanding(&self) -> bool {
        self.recvs_done < self.recvs || self.sends_done < self.link.sends_enqueued() || self.order.waiting() > 0
    }
}

/// A reservation being filled over a link.
struct Incoming {
    link: u64,
    /// Which layers have been received (enqueued into the cache).
    got: Vec<bool>,
    /// The number of the last receive group enqueued for it.
    last: Option<u64>,
    /// The trailer, held until every layer has landed, and since when.
    done: Option<(TransferTrailer, Option<DoneReply>, Instant)>,
    /// Given up (or failed): recompute once nothing more can land in its blocks.
    cancelled: Option<String>,
}

/// An export of the current step.
struct Outgoing {
    export: StepExport,
    link: Arc<Link>,
    gate: HandoffGate,
    /// Layers computed before the gate opened, to send when it does.
    staged: Vec<usize>,
    failed: Option<String>,
}

/// See the module docs.
pub struct LinkConnector {
    layout: KvLayout,
    timeout: Duration,
    reservations: HashMap<RequestId, Arc<Reservation>>,
    links: HashMap<u64, LinkState>,
    incoming: HashMap<RequestId, Incoming>,
    step: Vec<Outgoing>,
}

impl LinkConnector {
    /// For a cache of `layout`; a link operation, a held trailer or a gap in the notices
    /// may wait `timeout` before the link fails.
    pub fn new(layout: KvLayout, timeout: Duration) -> Self {
        Self {
            layout,
            timeout,
            reservations: HashMap::new(),
            links: HashMap::new(),
            incoming: HashMap::new(),
            step: Vec::new(),
        }
    }

    /// Whether `id`'s KV is arriving over a link (its trailer is then this connector's).
    pub fn has_incoming(&self, id: RequestId) -> bool {
        self.incoming.contains_key(&id)
    }

    /// Links this engine holds state for (usable ones; failed ones are dropped at the next poll).
    pub fn links_in_use(&self) -> usize {
        self.links.values().filter(|s| !s.link.is_failed()).count()
    }

    /// Where a due receive lands: `Ok(true)` the request's own blocks, `Ok(false)` scratch
    /// (the request no longer waits), `Err` scratch and the request fails (a notice that does
    /// not fit its reservation).
    fn target(&self, r: &PendingRecv) -> Result<bool, String> {
        let Some(res) = self.reservations.get(&r.request) else { return Ok(false) };
        if self.incoming.get(&r.request).is_some_and(|i| i.cancelled.is_some()) {
            return Ok(false);
        }
        if r.layer >= self.layout.num_layers {
            return Err(format!("layer {} is not in the layout", r.layer));
        }
        let blocks = run_blocks(&r.runs).ok_or("runs beyond the largest block id")?;
        let own: std::collections::HashSet<u32> = res.block_table.iter().copied().collect();
        if !blocks.iter().all(|b| own.contains(b)) {
            return Err(format!("the transfer targets blocks {blocks:?} outside the reservation"));
        }
        if self.incoming.get(&r.request).is_some_and(|i| i.got.get(r.layer).copied().unwrap_or(false)) {
            return Err(format!("layer {} arrived twice", r.layer));
        }
        Ok(true)
    }

    /// Fails link `id`: aborts it, and every request with KV on it recomputes.
    fn fail_link(&mut self, id: u64, reason: &str, out: &mut Vec<KvOutcome>) {
        if let Some(state) = self.links.remove(&id) {
            state.link.fail(reason);
        }
        let on_it: Vec<RequestId> = self.incoming.iter().filter(|(_, i)| i.link == id).map(|(r, _)| *r).collect();
        for r in on_it {
            if let Some(inc) = self.incoming.remove(&r) {
                if let Some((_, Some(reply), _)) = inc.done {
                    let _ = reply.send(Err(format!("the KV link failed: {reason}")));
                }
                self.reservations.remove(&r);
                out.push(KvOutcome::Recompute { id: r, reason: format!("the KV link failed: {reason}") });
            }
        }
    }

    /// Files one layer notice and enqueues every receive now due on its link.
    fn on_notice(
        &mut self,
        n: PendingRecv,
        seq: u64,
        link: Arc<Link>,
        kv: &mut dyn KvAccess,
        out: &mut Vec<KvOutcome>,
    ) {
        let key = link.id();
        if link.is_failed() {
            let reason = link.failure().unwrap_or_default();
            return self.fail_link(key, &reason, out);
        }
        let now = Instant::now();
        if self.reservations.contains_key(&n.request) {
            let num_layers = self.layout.num_layers;
            let inc = self.incoming.entry(n.request).or_insert_with(|| Incoming {
                link: key,
                got: vec![false; num_layers],
                last: None,
                done: None,
                cancelled: None,
            });
            if inc.link != key {
                // One hand-off on two links: this one's notices still need their receives.
                inc.cancelled.get_or_insert_with(|| "a hand-off's layers arrived on two links".into());
            }
        }
        let state = self.links.entry(key).or_insert_with(|| LinkState::new(link.clone()));
        let due = match state.order.push(seq, n) {
            Ok(due) => due,
            Err(e) => return self.fail_link(key, &e.0, out),
        };
        for r in due {
            let into_cache = match self.target(&r) {
                Ok(into) => into,
                Err(reason) => {
                    if let Some(inc) = self.incoming.get_mut(&r.request) {
                        inc.cancelled.get_or_insert(format!("cannot receive a KV layer over the link: {reason}"));
                    }
                    false
                }
            };
            if let Err(e) = link.with_comm(|c| c.recv(kv, r.layer, &r.runs, into_cache)) {
                return self.fail_link(key, &e.0, out);
            }
            link.arm_deadline(now + self.timeout);
            let Some(state) = self.links.get_mut(&key) else { return };
            let group = state.recvs;
            state.recvs += 1;
            if let Some(inc) = self.incoming.get_mut(&r.request).filter(|i| i.link == key) {
                inc.last = Some(group);
                if into_cache && let Some(g) = inc.got.get_mut(r.layer) {
                    *g = true;
                }
            }
        }
        if let Some(state) = self.links.get_mut(&key) {
            if state.order.waiting() > 0 {
                state.gap_since.get_or_insert(now);
            } else {
                state.gap_since = None;
            }
        }
    }

    /// Polls every link's progress and deadlines.
    fn poll_links(&mut self, kv: &mut dyn KvAccess, now: Instant, out: &mut Vec<KvOutcome>) {
        let keys: Vec<u64> = self.links.keys().copied().collect();
        for key in keys {
            let Some(state) = self.links.get_mut(&key) else { continue };
            let link = state.link.clone();
            if let Some(reason) = link.failure() {
                self.fail_link(key, &reason, out);
                continue;
            }
            let progress = link.with_comm(|c| Ok((c.recvs_done(kv)?, c.sends_done(kv)?)));
            let (recvs_done, sends_done) = match progress {
                Ok(p) => p,
                Err(e) => {
                    self.fail_link(key, &e.0, out);
                    continue;
                }
            };
            state.recvs_done = recvs_done;
            state.sends_done = sends_done;
            if recvs_done >= state.recvs && sends_done >= link.sends_enqueued() {
                link.disarm_deadline();
            } else if link.enforce_deadline(now) {
                let reason = link.failure().unwrap_or_default();
                self.fail_link(key, &reason, out);
                continue;
            }
            if state.gap_since.is_some_and(|t| now >= t + self.timeout) {
                let reason = format!("layer notice {} never came (a notice was lost)", state.order.next_due());
                self.fail_link(key, &reason, out);
            }
        }
    }

    /// Completes every request whose layers all landed, and hands back cancelled ones whose
    /// blocks nothing more can write.
    fn settle(&mut self, now: Instant, out: &mut Vec<KvOutcome>) {
        let mut late_links = Vec::new();
        let ids: Vec<RequestId> = self.incoming.keys().copied().collect();
        for id in ids {
            let Some(inc) = self.incoming.get(&id) else { continue };
            let landed = match self.links.get(&inc.link) {
                Some(s) => inc.last.is_none_or(|l| s.recvs_done > l),
                // The link is gone (failed): nothing more can land.
                None => true,
            };
            if inc.cancelled.is_some() {
                if landed && let Some(inc) = self.incoming.remove(&id) {
                    if let Some((_, Some(reply), _)) = inc.done {
                        let _ = reply.send(Err("the hand-off was given up".into()));
                    }
                    self.reservations.remove(&id);
                    let reason = inc.cancelled.unwrap_or_default();
                    out.push(KvOutcome::Recompute { id, reason });
                }
                continue;
            }
            let Some((_, _, since)) = &inc.done else { continue };
            if landed && inc.got.iter().all(|&g| g) {
                if let Some(Incoming { done: Some((trailer, reply, _)), .. }) = self.incoming.remove(&id) {
                    self.reservations.remove(&id);
                    out.push(KvOutcome::Complete { id, trailer, reply });
                }
            } else if now >= *since + self.timeout {
                late_links.push((inc.link, id));
            }
        }
        for (link, id) in late_links {
            let reason = format!("request {id}'s layers did not all arrive within {:?} of its trailer", self.timeout);
            self.fail_link(link, &reason, out);
        }
    }

    /// Enqueues layer `layer` of `o` on its link and sends the notice.
    fn send(o: &mut Outgoing, layer: usize, kv: &mut dyn KvAccess, deadline: Instant) {
        match o.link.send_numbered(kv, layer, &o.export.runs) {
            Ok(seq) => {
                o.link.arm_deadline(deadline);
                let _ = o.export.tx.send(ExportEvent::Layer(LayerFrame {
                    layer,
                    k: Vec::new(),
                    v: Vec::new(),
                    seq,
                    coding: None,
                }));
            }
            Err(e) => o.failed = Some(e.to_string()),
        }
    }

    fn flush(o: &mut Outgoing, kv: &mut dyn KvAccess, deadline: Instant) {
        for layer in std::mem::take(&mut o.staged) {
            if o.failed.is_none() {
                Self::send(o, layer, kv, deadline);
            }
        }
    }
}

impl KvConnector for LinkConnector {
    fn reserve(&mut self, id: RequestId, reservation: Arc<Reservation>) {
        self.reservations.insert(id, reservation);
    }

    fn on_event(&mut self, event: KvEvent, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>) {
        match event {
            KvEvent::LinkLayer { id, layer, seq, runs, link } => {
                self.on_notice(PendingRecv { request: id, layer, runs }, seq, link, kv, out);
                self.settle(Instant::now(), out);
            }
            KvEvent::Done { id, trailer, reply } => match self.incoming.get_mut(&id) {
                Some(inc) if inc.done.is_none() => {
                    inc.done = Some((trailer, reply, Instant::now()));
                    self.settle(Instant::now(), out);
                }
                _ => {
                    if let Some(reply) = reply {
                        let _ = reply.send(Err(format!("request {id} is not receiving KV over a link here")));
                    }
                }
            },
            KvEvent::Layer { id, .. } => {
                if self.reservations.contains_key(&id) {
                    out.push(KvOutcome::Recompute { id, reason: "a host-staged layer on a link hand-off".into() });
                    self.cancel(id, out);
                }
            }
            KvEvent::TransferStream { reply } => {
                let stream = match kv.device() {
                    Some(d) => d.new_transfer_stream().map_err(|e| e.to_string()),
                    None => Err("this engine's backend has no device for a link".to_owned()),
                };
                let _ = reply.send(stream);
            }
        }
    }

    fn poll(&mut self, kv: &mut dyn KvAccess, now: Instant, out: &mut Vec<KvOutcome>) {
        if self.links.is_empty() && self.incoming.is_empty() {
            return;
        }
        self.poll_links(kv, now, out);
        self.settle(now, out);
    }

    fn cancel(&mut self, id: RequestId, out: &mut Vec<KvOutcome>) {
        self.reservations.remove(&id);
        match self.incoming.get_mut(&id) {
            Some(inc) => {
                // Receives into its blocks may be in flight: recompute once they landed.
                inc.cancelled.get_or_insert_with(|| "the hand-off was given up".into());
                self.settle(Instant::now(), out);
            }
            None => out.push(KvOutcome::Recompute { id, reason: "the hand-off was given up".into() }),
        }
    }

    fn forget(&mut self, id: RequestId) {
        self.reservations.remove(&id);
        if let Some(Incoming { done: Some((_, Some(reply), _)), .. }) = self.incoming.remove(&id) {
            let _ = reply.send(Err(format!("request {id} ended")));
        }
    }

    fn busy(&self) -> bool {
        !self.incoming.is_empty() || self.links.values().any(LinkState::outstanding)
    }

    fn begin_step(&mut self, exports: Vec<StepExport>) {
        self.step.clear();
        for export in exports {
            let ExportVia::Link { link, gate } = export.via.clone() else { continue };
            self.links.entry(link.id()).or_insert_with(|| LinkState::new(link.clone()));
            self.step.push(Outgoing { export, link, gate, staged: Vec::new(), failed: None });
        }
    }

    fn after_layer(&mut self, layer: usize, kv: &mut dyn KvAccess) -> Result<(), BackendError> {
        let deadline = Instant::now() + self.timeout;
        for o in self.step.iter_mut().filter(|o| o.failed.is_none()) {
            match o.gate.state() {
                GateState::Accepted => {
                    Self::flush(o, kv, deadline);
                    if o.failed.is_none() {
                        Self::send(o, layer, kv, deadline);
                    }
                }
                GateState::Pending => o.staged.push(layer),
                GateState::Closed => o.failed = Some("the receiver did not accept the hand-off".into()),
            }
        }
        Ok(())
    }

    fn fence(&mut self, kv: &mut dyn KvAccess, out: &mut Vec<KvOutcome>) {
        let deadline = Instant::now() + self.timeout;
        for mut o in std::mem::take(&mut self.step) {
            if o.failed.is_none() && !o.staged.is_empty() {
                // The blocks are intact until the step's tokens are applied: wait (bounded)
                // for the receiver's answer, then send what was staged or nothing.
                match o.gate.wait(self.timeout) {
                    GateState::Accepted => Self::flush(&mut o, kv, deadline),
                    _ => o.failed = Some("the receiver did not accept the hand-off in time".into()),
                }
            }
            if o.failed.is_none()
                && let Err(e) = o.link.with_comm(|c| c.fence_sends(kv))
            {
                o.failed = Some(e.to_string());
            }
            if let Some(reason) = o.failed {
                out.push(KvOutcome::ExportFailed { id: o.export.id, reason });
            }
        }
    }
}
