//! An in-process stand-in for a two-rank NCCL communicator, so the link state machine
//! ([`super::LinkConnector`], [`super::Link`]) runs on the CPU in tests: [`pair`] gives the
//! sending end (rank 0), the receiving end (rank 1) and a [`FakeControl`] that delays,
//! holds or kills the wire.
//!
//! It keeps NCCL's contract: groups are matched in enqueue order and must agree in size (a
//! mismatch is a desync, reported as an error); a send completes only once the peer's
//! matching receive consumed it; an operation on a dead or aborted peer never completes (it
//! does not fail), so only a deadline notices; an operation on an end that was itself
//! aborted fails. Data moves as host bytes through [`super::KvAccess`] (read when the send is
//! enqueued, written when the receive lands during a poll).

use super::link::{LinkComm, LinkError};
use super::{KvAccess, run_blocks};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One send group on the wire.
struct Group {
    layer: usize,
    blocks: usize,
    k: Vec<u8>,
    v: Vec<u8>,
    at: Instant,
}

#[derive(Default)]
struct Wire {
    queue: VecDeque<Group>,
    /// Groups the receiver consumed (the sender's completed sends).
    consumed: u64,
    /// Data becomes visible this long after its send.
    delay: Duration,
    /// Nothing is delivered while held.
    held: bool,
    /// A peer died (or aborted): nothing moves any more.
    dead: bool,
}

type SharedWire = Arc<Mutex<Wire>>;

fn lock(w: &SharedWire) -> Result<std::sync::MutexGuard<'_, Wire>, LinkError> {
    w.lock().map_err(|_| LinkError("the fake wire's lock is poisoned".into()))
}

/// A receive enqueued on the receiving end: layer, runs, into the cache (or scratch).
type PendingRecv = (usize, Vec<(usize, usize)>, bool);

/// One end of a fake communicator.
pub struct FakeComm {
    wire: SharedWire,
    /// Receiving end: receives enqueued, not landed yet.
    pending: VecDeque<PendingRecv>,
    received: u64,
    aborted: bool,
}

/// Test controls over a fake wire.
#[derive(Clone)]
pub struct FakeControl {
    wire: SharedWire,
}

/// A connected pair: (sender, receiver, control).
pub fn pair() -> (FakeComm, FakeComm, FakeControl) {
    let wire: SharedWire = Arc::default();
    let end = || FakeComm { wire: wire.clone(), pending: VecDeque::new(), received: 0, aborted: false };
    (end(), end(), FakeControl { wire: wire.clone() })
}

impl FakeControl {
    /// Data becomes visible to the receiver `d` after it was sent.
    pub fn set_delay(&self, d: Duration) {
        if let Ok(mut w) = self.wire.lock() {
            w.delay = d;
        }
    }

    /// Stops (true) or resumes (false) delivery.
    pub fn hold(&self, held: bool) {
        if let Ok(mut w) = self.wire.lock() {
            w.held = held;
        }
    }

    /// A peer dies: nothing in flight or later ever completes.
    pub fn kill(&self) {
        if let Ok(mut w) = self.wire.lock() {
            w.dead = true;
        }
    }

    /// Send groups on the wire, not consumed yet.
    pub fn in_flight(&self) -> usize {
        self.wire.lock().map_or(0, |w| w.queue.len())
    }
}

impl FakeComm {
    fn live(&self) -> Result<(), LinkError> {
        if self.aborted { Err(LinkError("the communicator was aborted".into())) } else { Ok(()) }
    }
}

fn blocks_of(runs: &[(usize, usize)]) -> Result<Vec<u32>, LinkError> {
    run_blocks(runs).ok_or_else(|| LinkError("runs beyond the largest block id".into()))
}

impl LinkComm for FakeComm {
    fn send(&mut self, kv: &mut dyn KvAccess, layer: usize, runs: &[(usize, usize)]) -> Result<(), LinkError> {
        self.live()?;
        let blocks = blocks_of(runs)?;
        let (k, v) = kv.read_kv_blocks(layer, &blocks).map_err(|e| LinkError(e.to_string()))?;
        lock(&self.wire)?.queue.push_back(Group { layer, blocks: blocks.len(), k, v, at: Instant::now() });
        Ok(())
    }

    fn recv(
        &mut self,
        _kv: &mut dyn KvAccess,
        layer: usize,
        runs: &[(usize, usize)],
        into_cache: bool,
    ) -> Result<(), LinkError> {
        self.live()?;
        self.pending.push_back((layer, runs.to_vec(), into_cache));
        Ok(())
    }

    fn sends_done(&mut self, _kv: &mut dyn KvAccess) -> Result<u64, LinkError> {
        self.live()?;
        Ok(lock(&self.wire)?.consumed)
    }

    fn recvs_done(&mut self, kv: &mut dyn KvAccess) -> Result<u64, LinkError> {
        self.live()?;
        let now = Instant::now();
        while let Some((layer, runs, into_cache)) = self.pending.front() {
            let group = {
                let mut w = lock(&self.wire)?;
                let ready = !w.dead && !w.held && w.queue.front().is_some_and(|g| now >= g.at + w.delay);
                if !ready {
                    break;
                }
                w.consumed += 1;
                w.queue.pop_front()
            };
            let Some(group) = group else { break };
            let blocks = blocks_of(runs)?;
            if group.blocks != blocks.len() || group.layer != *layer {
                return Err(LinkError(format!(
                    "desync: a receive of layer {layer} ({} blocks) met a send of layer {} ({} blocks)",
                    blocks.len(),
                    group.layer,
                    group.blocks
                )));
            }
            if *into_cache {
                kv.write_kv_blocks(*layer, &blocks, &group.k, &group.v).map_err(|e| LinkError(e.to_string()))?;
            }
            self.pending.pop_front();
            self.received += 1;
        }
        Ok(self.received)
    }

    fn fence_sends(&mut self, _kv: &mut dyn KvAccess) -> Result<(), LinkError> {
        // The bytes were read when the sends were enqueued.
        self.live()
    }

    fn abort(&mut self) {
        self.aborted = true;
        // The peer's communicator is now useless: nothing it has in flight completes.
        if let Ok(mut w) = self.wire.lock() {
            w.dead = true;
        }
    }
}
