//! Links: a two-rank communicator between one prefill worker (rank 0, the sender) and one
//! decode worker (rank 1, the receiver), shared by every hand-off between the two, and the
//! registry of a worker's links.
//!
//! The communicator is behind [`LinkComm`], so the same state machine runs over NCCL on
//! GPUs (`kv_transport::nccl::CudaComm`) and over an in-process fake on the CPU
//! ([`super::fake`]). Its contract is NCCL's: sends and receives are matched in the order
//! they were enqueued, each send must meet a receive of the same size, and an operation on a
//! dead peer never completes (it does not fail). So every hand-off on a link must keep the
//! link in step, and anything that can break the step (a lost notice, a notice out of
//! sequence, an operation past its deadline, a dead peer) breaks the link instead:
//! [`Link::fail`] aborts the communicator at once (which makes its pending operations
//! return), the registry stops handing it out, and the next hand-off to that peer makes a
//! new one. A link is never repaired.
//!
//! Invariants: a failed link stays failed; [`Links::get`] never returns a failed link; the
//! send numbers of a link are consecutive from 0 in the order the sends were enqueued.

use super::KvAccess;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A failure of a link (or of its setup).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV link: {0}")]
pub struct LinkError(pub String);

/// A two-rank communicator, as the connector drives it. Every method only enqueues or
/// queries: none waits for the peer. Called from one thread at a time (the [`Link`] locks).
pub trait LinkComm: Send {
    /// Enqueues sending layer `layer`'s K and V of each run `(first block, count)` of this
    /// side's cache, read through `kv`, as one group.
    fn send(&mut self, kv: &mut dyn KvAccess, layer: usize, runs: &[(usize, usize)]) -> Result<(), LinkError>;
    /// Enqueues receiving one group: layer `layer`'s K and V into each run of this side's
    /// cache, or into scratch that is then dropped when `into_cache` is false (a send whose
    /// request is gone must still be matched).
    fn recv(
        &mut self,
        kv: &mut dyn KvAccess,
        layer: usize,
        runs: &[(usize, usize)],
        into_cache: bool,
    ) -> Result<(), LinkError>;
    /// How many send groups (from the first) have completed: their blocks may be reused.
    fn sends_done(&mut self, kv: &mut dyn KvAccess) -> Result<u64, LinkError>;
    /// How many receive groups (from the first) have landed in the cache.
    fn recvs_done(&mut self, kv: &mut dyn KvAccess) -> Result<u64, LinkError>;
    /// Makes this side's compute wait for the sends enqueued so far (before the blocks they
    /// read can be overwritten). Never blocks the calling thread.
    fn fence_sends(&mut self, kv: &mut dyn KvAccess) -> Result<(), LinkError>;
    /// Tears the communicator down (`ncclCommAbort`): pending operations return, and every
    /// later call fails.
    fn abort(&mut self);
}

static NEXT_LINK_ID: AtomicU64 = AtomicU64::new(1);

/// One side of a link: the communicator, its state and its deadline.
pub struct Link {
    id: u64,
    name: String,
    peer: String,
    comm: Mutex<Option<Box<dyn LinkComm>>>,
    /// Sending side: the number of the next send group.
    next_send: AtomicU64,
    /// Why the link failed (`None` while it is usable).
    failed: Mutex<Option<String>>,
    /// When the oldest operation not yet complete must be complete by.
    deadline: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("id", &self.id).field("name", &self.name).field("peer", &self.peer).finish()
    }
}

impl Link {
    /// A usable link named `name` (both sides file it under that name) to `peer` (the other
    /// worker's identity) over `comm`.
    pub fn new(name: impl Into<String>, peer: impl Into<String>, comm: Box<dyn LinkComm>) -> Self {
        Self {
            id: NEXT_LINK_ID.fetch_add(1, Ordering::Relaxed),
            name: name.into(),
            peer: peer.into(),
            comm: Mutex::new(Some(comm)),
            next_send: AtomicU64::new(0),
            failed: Mutex::new(None),
            deadline: Mutex::new(None),
        }
    }

    /// Unique in this process (a re-made link gets a new one).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The name both sides file it under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The other worker's identity.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Runs `f` on the communicator; an error once the link failed. An error from `f` fails
    /// the link (the communicator's step is then unknown).
    pub fn with_comm<T>(&self, f: impl FnOnce(&mut dyn LinkComm) -> Result<T, LinkError>) -> Result<T, LinkError> {
        let mut guard = self.comm.lock().map_err(|_| LinkError("the link's lock is poisoned".into()))?;
        let Some(comm) = guard.as_mut() else {
            return Err(LinkError(format!("link {} failed: {}", self.name, self.failure().unwrap_or_default())));
        };
        let result = f(comm.as_mut());
        if let Err(e) = &result {
            drop(guard);
            self.fail(&e.0);
        }
        result
    }

    /// Sending side: enqueues one layer group and returns its number on the link (which the
    /// receiver needs to match it), numbered under the communicator's lock.
    pub fn send_numbered(
        &self,
        kv: &mut dyn KvAccess,
        layer: usize,
        runs: &[(usize, usize)],
    ) -> Result<u64, LinkError> {
        self.with_comm(|comm| {
            comm.send(kv, layer, runs)?;
            Ok(self.next_send.fetch_add(1, Ordering::SeqCst))
        })
    }

    /// Send groups enqueued so far.
    pub fn sends_enqueued(&self) -> u64 {
        self.next_send.load(Ordering::SeqCst)
    }

    /// Breaks the link for good: aborts the communicator (off the lock's holder, if any, only
    /// once it returns: every call on the communicator only enqueues) and records `reason`.
    /// Idempotent; the first reason stays.
    pub fn fail(&self, reason: &str) {
        if let Ok(mut f) = self.failed.lock()
            && f.is_none()
        {
            tracing::warn!(link = %self.name, peer = %self.peer, reason, "KV link failed; aborting its communicator");
            *f = Some(reason.to_owned());
        }
        let comm = self.comm.lock().ok().and_then(|mut c| c.take());
        if let Some(mut comm) = comm {
            comm.abort();
        }
    }

    /// Whether the link failed.
    pub fn is_failed(&self) -> bool {
        self.failed.lock().map_or(true, |f| f.is_some())
    }

    /// Why the link failed.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }

    /// Arms the deadline for the operations now outstanding (kept if one is already armed:
    /// it is the oldest's).
    pub fn arm_deadline(&self, at: Instant) {
        if let Ok(mut d) = self.deadline.lock() {
            d.get_or_insert(at);
        }
    }

    /// Every operation enqueued so far completed: no deadline until the next one.
    pub fn disarm_deadline(&self) {
        if let Ok(mut d) = self.deadline.lock() {
            *d = None;
        }
    }

    /// Fails the link when its armed deadline has passed at `now`; true if it did.
    pub fn enforce_deadline(&self, now: Instant) -> bool {
        let passed = self.deadline.lock().ok().and_then(|d| *d).is_some_and(|d| now >= d);
        if passed && !self.is_failed() {
            self.fail("an operation on the link did not complete within its deadline (dead or stuck peer)");
        }
        passed
    }
}

/// A worker's links, by name (decode side) or by the decode worker's KV address (prefill
/// side). Failed links are pruned as they are met.
#[derive(Default)]
pub struct Links {
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// Woken on every insert, for [`Links::wait_for`].
    added: tokio::sync::Notify,
}

impl Links {
    /// The usable link filed under `key`, if any (a failed one is dropped from the registry).
    pub fn get(&self, key: &str) -> Option<Arc<Link>> {
        let mut links = self.links.lock().ok()?;
        match links.get(key) {
            Some(l) if l.is_failed() => {
                links.remove(key);
                None
            }
            other => other.cloned(),
        }
    }

    /// Files `link` under `key`, replacing (and failing) an older one.
    pub fn insert(&self, key: String, link: Arc<Link>) {
        let old = self.links.lock().ok().and_then(|mut l| l.insert(key, link));
        if let Some(old) = old {
            old.fail("replaced by a new link to the same peer");
        }
        self.added.notify_waiters();
    }

    /// The link filed under `key`, waiting up to `within` for a setup still in progress.
    pub async fn wait_for(&self, key: &str, within: Duration) -> Option<Arc<Link>> {
        let until = tokio::time::Instant::now() + within;
        loop {
            // Registered before looking, so an insert between the look and the wait is seen.
            let added = self.added.notified();
            if let Some(link) = self.get(key) {
                return Some(link);
            }
            if tokio::time::timeout_at(until, added).await.is_err() {
                return self.get(key);
            }
        }
    }

    /// Fails and forgets the link filed under `key`.
    pub fn remove(&self, key: &str, reason: &str) {
        let link = self.links.lock().ok().and_then(|mut l| l.remove(key));
        if let Some(link) = link {
            link.fail(reason);
        }
    }

    /// Fails and forgets every link to `peer` (a worker that departed); how many there were.
    pub fn evict_peer(&self, peer: &str) -> usize {
        self.evict_where(|l| l.peer() == peer, "its peer departed")
    }

    /// Fails and forgets every link `doomed` picks, with `reason`; how many there were.
    fn evict_where(&self, doomed: impl Fn(&Link) -> bool, reason: &str) -> usize {
        let mut gone = Vec::new();
        if let Ok(mut links) = self.links.lock() {
            links.retain(|_, l| {
                let keep = !doomed(l);
                if !keep {
                    gone.push(l.clone());
                }
                keep
            });
        }
        for l in &gone {
            l.fail(reason);
        }
        gone.len()
    }

    /// Fails every link whose deadline passed at `now` (the watchdog: the engine thread may be
    /// blocked behind the very operation that hangs) and prunes failed links; how many failed.
    pub fn enforce_deadlines(&self, now: Instant) -> usize {
        let all: Vec<Arc<Link>> = self.links.lock().map(|l| l.values().cloned().collect()).unwrap_or_default();
        let failed = all.iter().filter(|l| l.enforce_deadline(now)).count();
        self.count();
        failed
    }

    /// Fails and forgets every link whose peer is not in `live` (the instances and KV
    /// addresses of the workers registered now, from the router's heartbeat answer); how many
    /// there were. This is how a worker evicts the links of peers that departed while their
    /// link sat idle, which no deadline would notice.
    pub fn retain_peers(&self, live: &std::collections::HashSet<String>) -> usize {
        self.evict_where(|l| !live.contains(l.peer()), "its peer is no longer registered with the router")
    }

    /// Usable links (failed ones are pruned first).
    pub fn count(&self) -> usize {
        match self.links.lock() {
            Ok(mut links) => {
                links.retain(|_, l| !l.is_failed());
                links.len()
            }
            Err(_) => 0,
        }
    }
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
    waiting: BTreeMap<u64, T>,
}

/// How far past the next due number a notice may be. Honest gaps come from concurrent
/// hand-offs on one link (a few hundred prompts × their layers at most); a peer's number
/// beyond this would hold memory for a gap that never fills.
pub const MAX_NOTICES_AHEAD: u64 = 1 << 16;

impl<T> Default for RecvOrder<T> {
    fn default() -> Self {
        Self { next: 0, waiting: BTreeMap::new() }
    }
}

impl<T> RecvOrder<T> {
    /// Files item `seq` and returns every item now due, in order; `Err` for a number that
    /// was already released or is already waiting, or is too far ahead.
    pub fn push(&mut self, seq: u64, item: T) -> Result<Vec<T>, LinkError> {
        if seq < self.next || self.waiting.contains_key(&seq) {
            return Err(LinkError(format!("layer notice {seq} seen twice on one link")));
        }
        if seq - self.next > MAX_NOTICES_AHEAD {
            return Err(LinkError(format!("layer notice {seq} is too far past {} on one link", self.next)));
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

    /// The number due next (every lower one was released).
    pub fn next_due(&self) -> u64 {
        self.next
    }
}

/// Whether the receiver accepted a hand-off's handshake: the sending side enqueues a
/// hand-off's sends only once it did (a refused hand-off's sends would never be matched and
/// would put the link out of step). Set by the transport task, read by the engine thread.
#[derive(Clone, Default)]
pub struct HandoffGate(Arc<(Mutex<GateState>, Condvar)>);

/// See [`HandoffGate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GateState {
    /// The handshake is not answered yet.
    #[default]
    Pending,
    /// The receiver accepted: it will match every send of the hand-off.
    Accepted,
    /// Refused, failed or abandoned: nothing may be sent.
    Closed,
}

impl std::fmt::Debug for HandoffGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HandoffGate").field(&self.state()).finish()
    }
}

impl HandoffGate {
    /// A pending gate.
    pub fn new() -> Self {
        Self::default()
    }

    fn set(&self, to: GateState) -> GateState {
        let (lock, cv) = &*self.0;
        let Ok(mut s) = lock.lock() else { return GateState::Closed };
        if *s == GateState::Pending {
            *s = to;
            cv.notify_all();
        }
        *s
    }

    /// The receiver accepted; false when the gate was already closed (the engine gave up on
    /// the hand-off: nothing will be sent).
    pub fn accept(&self) -> bool {
        self.set(GateState::Accepted) == GateState::Accepted
    }

    /// Nothing may be sent (refused, failed, abandoned). No effect once accepted.
    pub fn close(&self) {
        self.set(GateState::Closed);
    }

    /// The state now.
    pub fn state(&self) -> GateState {
        self.0.0.lock().map_or(GateState::Closed, |s| *s)
    }

    /// Waits up to `within` for an answer; a gate still pending then is closed (so a late
    /// acceptance cannot start sends nobody will make).
    pub fn wait(&self, within: Duration) -> GateState {
        let (lock, cv) = &*self.0;
        let Ok(guard) = lock.lock() else { return GateState::Closed };
        let Ok((mut s, _)) = cv.wait_timeout_while(guard, within, |s| *s == GateState::Pending) else {
            return GateState::Closed;
        };
        if *s == GateState::Pending {
            *s = GateState::Closed;
        }
        *s
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
        assert_eq!((o.waiting(), o.next_due()), (0, 4));
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
    fn a_gate_opens_once_and_a_late_acceptance_of_an_abandoned_one_is_refused() {
        let g = HandoffGate::new();
        assert_eq!(g.wait(Duration::from_millis(1)), GateState::Closed, "nobody answered: closed");
        assert!(!g.accept(), "too late");
        let g = HandoffGate::new();
        let g2 = g.clone();
        let t = std::thread::spawn(move || g2.accept());
        assert_eq!(g.wait(Duration::from_secs(10)), GateState::Accepted);
        assert!(t.join().expect("join"));
        g.close();
        assert_eq!(g.state(), GateState::Accepted, "an accepted gate stays accepted");
    }

    fn link(name: &str, peer: &str) -> (Arc<Link>, super::super::fake::FakeControl) {
        let (tx, _rx, ctl) = super::super::fake::pair();
        (Arc::new(Link::new(name, peer, Box::new(tx))), ctl)
    }

    #[test]
    fn the_watchdog_aborts_a_link_past_its_deadline_and_prunes_it() {
        let links = Links::default();
        let (a, _) = link("a", "p1");
        let (b, _) = link("b", "p2");
        links.insert("a".into(), a.clone());
        links.insert("b".into(), b.clone());
        let now = Instant::now();
        a.arm_deadline(now + Duration::from_secs(1));
        b.arm_deadline(now + Duration::from_secs(60));
        assert_eq!(links.enforce_deadlines(now), 0, "nothing is late yet");
        assert_eq!(links.enforce_deadlines(now + Duration::from_secs(2)), 1);
        assert!(a.is_failed() && !b.is_failed());
        assert!(a.with_comm(|_| Ok(())).is_err(), "the communicator is gone");
        assert_eq!(links.count(), 1);
        assert!(links.get("a").is_none());
        b.disarm_deadline();
        assert_eq!(links.enforce_deadlines(now + Duration::from_secs(120)), 0, "a disarmed link is never late");
    }

    #[test]
    fn a_departed_peer_loses_its_links_and_a_replaced_link_fails() {
        let links = Links::default();
        let (a, _) = link("a", "p1");
        let (a2, _) = link("a2", "p1");
        let (b, _) = link("b", "p2");
        links.insert("a".into(), a.clone());
        links.insert("a2".into(), a2.clone());
        links.insert("b".into(), b.clone());
        assert_eq!(links.evict_peer("p1"), 2);
        assert!(a.is_failed() && a2.is_failed() && !b.is_failed());
        assert_eq!(links.count(), 1);
        let (b2, _) = link("b", "p2");
        links.insert("b".into(), b2.clone());
        assert!(b.is_failed(), "the link it replaced is aborted");
        assert_eq!(links.get("b").map(|l| l.id()), Some(b2.id()));
    }

    #[test]
    fn links_to_peers_the_router_no_longer_lists_are_evicted() {
        let links = Links::default();
        let (a, _) = link("a", "p1");
        let (b, _) = link("b", "p2");
        let (c, _) = link("c", "10.0.0.9:7000");
        for (k, l) in [("a", &a), ("b", &b), ("c", &c)] {
            links.insert(k.into(), l.clone());
        }
        let live: std::collections::HashSet<String> = ["p2".to_string(), "10.0.0.9:7000".to_string()].into();
        assert_eq!(links.retain_peers(&live), 1);
        assert!(a.is_failed() && !b.is_failed() && !c.is_failed());
        assert_eq!(links.count(), 2);
        assert!(links.get("a").is_none());
        assert_eq!(links.retain_peers(&live), 0, "nothing more to evict");
    }
}
