//! Routing policies: which prefill worker computes a prompt, which decode worker carries it.
//!
//! Policies are pure functions of plain snapshots ([`Candidate`]), chosen by name in the
//! router config, so they are table-tested without processes. The load a policy sees is
//! the larger of what the worker last reported and what the router itself has in flight
//! there, because heartbeats are up to one interval old and a burst of requests must not all
//! land on the worker that looked idle a moment ago.
//!
//! `prefix_aware` cost (lower wins), in tokens of prefill work:
//!
//! ```text
//! cost(P) = (prompt_tokens − cached_prefix_blocks(P) × block_size)   // work left on P
//!         + load_weight × queued_prefill_tokens(P)                  // work ahead of it
//! ```
//!
//! `cached_prefix_blocks` is the number of leading block hashes of the prompt that P
//! reported as stored (and not evicted); `queued_prefill_tokens` is the uncached prompt
//! tokens the router sent to P that have not produced their first token yet. With
//! `load_weight = 1` a hit of N tokens is worth exactly N tokens of queue elsewhere, the
//! same trade Dynamo's KV router and SGLang's cache-aware router make (they weigh overlap
//! blocks against active blocks). Ties go to the worker with fewer requests in flight, then
//! round-robin order.

use std::sync::atomic::{AtomicUsize, Ordering};

/// A worker as a policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Registry id.
    pub id: u64,
    /// Requests running there (last report).
    pub running: usize,
    /// Requests waiting there (last report).
    pub waiting: usize,
    /// KV blocks in use there (last report).
    pub used_blocks: usize,
    /// KV blocks there.
    pub total_blocks: usize,
    /// Requests the router has in flight there now.
    pub inflight: usize,
    /// Uncached prompt tokens sent there for prefill that have not produced a token yet.
    pub queued_prefill_tokens: usize,
    /// Leading blocks of this request's prompt that the worker holds in its prefix cache.
    pub cached_prefix_blocks: usize,
}

impl Candidate {
    /// Requests on the worker: the report or the router's own count, whichever is larger.
    pub fn load(&self) -> usize {
        (self.running + self.waiting).max(self.inflight)
    }

    /// Free KV blocks by the last report.
    pub fn free_blocks(&self) -> usize {
        self.total_blocks.saturating_sub(self.used_blocks)
    }
}

/// What is being routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteRequest {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt plus requested output tokens (what the decode worker must hold).
    pub total_tokens: usize,
    /// KV block size of the pool.
    pub block_size: usize,
}

/// Picks the prefill worker among candidates (index into the slice).
pub trait PrefillPolicy: Send + Sync {
    /// The config name.
    fn name(&self) -> &'static str;
    /// Whether candidates need `cached_prefix_blocks` (computing it costs a hash lookup per block).
    fn uses_prefix_cache(&self) -> bool {
        false
    }
    /// The chosen candidate, `None` only when there are none.
    fn pick(&self, req: &RouteRequest, candidates: &[Candidate]) -> Option<usize>;
}

/// Unknown policy name in the config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy {0:?}: expected round_robin, least_loaded or prefix_aware")]
pub struct UnknownPolicy(pub String);

/// The policy called `name`.
pub fn policy_by_name(name: &str, load_weight: f64) -> Result<Box<dyn PrefillPolicy>, UnknownPolicy> {
    match name {
        "round_robin" => Ok(Box::new(RoundRobin::default())),
        "least_loaded" => Ok(Box::new(LeastLoaded::default())),
        "prefix_aware" => Ok(Box::new(PrefixAware { load_weight, rr: RoundRobin::default() })),
        other => Err(UnknownPolicy(other.to_owned())),
    }
}

/// Each candidate in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    fn turn(&self, n: usize) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % n.max(1)
    }
}

impl PrefillPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, _req: &RouteRequest, candidates: &[Candidate]) -> Option<usize> {
        (!candidates.is_empty()).then(|| self.turn(candidates.len()))
    }
}

/// Fewest requests (reported or in flight), ties in round-robin order.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    rr: RoundRobin,
}

impl PrefillPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn pick(&self, _req: &RouteRequest, candidates: &[Candidate]) -> Option<usize> {
        let start = self.rr.turn(candidates.len());
        argmin_from(candidates.len(), start, |i| (candidates[i].load() as f64, 0))
    }
}

/// Prefix-cache overlap weighed against queued prefill work (see the module docs).
#[derive(Debug)]
pub struct PrefixAware {
    /// Tokens of queue one cached token is worth.
    pub load_weight: f64,
    rr: RoundRobin,
}

impl PrefillPolicy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix_aware"
    }

    fn uses_prefix_cache(&self) -> bool {
        true
    }

    fn pick(&self, req: &RouteRequest, candidates: &[Candidate]) -> Option<usize> {
        let start = self.rr.turn(candidates.len());
        argmin_from(candidates.len(), start, |i| {
            let c = &candidates[i];
            let cached = (c.cached_prefix_blocks * req.block_size).min(req.prompt_tokens);
            let cost = (req.prompt_tokens - cached) as f64 + self.load_weight * c.queued_prefill_tokens as f64;
            (cost, c.load())
        })
    }
}

/// The decode worker: among those with room for the whole sequence (by their last report),
/// the least loaded, then the one with the most free blocks; when none has room, the one with
/// the most free blocks (its engine queues the request until blocks free up). Exact ties
/// rotate with `turn` (a counter the caller advances), so idle workers share the traffic.
pub fn pick_decode(req: &RouteRequest, candidates: &[Candidate], turn: usize) -> Option<usize> {
    let need = req.total_tokens.div_ceil(req.block_size.max(1));
    let n = candidates.len();
    let start = turn % n.max(1);
    if candidates.iter().all(|c| c.free_blocks() < need) {
        return argmin_from(n, start, |i| (-(candidates[i].free_blocks() as f64), candidates[i].load()));
    }
    argmin_from(n, start, |i| {
        let c = &candidates[i];
        // Workers without room rank after every worker with room; then load; then free share.
        let rank = if c.free_blocks() >= need { 0.0 } else { f64::INFINITY };
        let free_share = c.free_blocks() as f64 / (c.total_blocks as f64 + 1.0);
        (rank + c.load() as f64 - free_share, 0)
    })
}

/// Index of the smallest key, scanning from `start` round the ring so equal keys rotate.
fn argmin_from(n: usize, start: usize, key: impl Fn(usize) -> (f64, usize)) -> Option<usize> {
    let mut best: Option<(usize, (f64, usize))> = None;
    for k in 0..n {
        let i = (start + k) % n;
        let kk = key(i);
        let better = match &best {
            None => true,
            Some((_, b)) => kk.0 < b.0 || (kk.0 == b.0 && kk.1 < b.1),
        };
        if better {
            best = Some((i, kk));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u64, running: usize, inflight: usize, queued: usize, cached: usize) -> Candidate {
        Candidate {
            id,
            running,
            waiting: 0,
            used_blocks: 0,
            total_blocks: 100,
            inflight,
            queued_prefill_tokens: queued,
            cached_prefix_blocks: cached,
        }
    }

    const REQ: RouteRequest = RouteRequest { prompt_tokens: 256, total_tokens: 300, block_size: 16 };

    #[test]
    fn round_robin_cycles_and_refuses_nothing() {
        let p = policy_by_name("round_robin", 1.0).expect("known");
        let cs = vec![cand(1, 9, 9, 0, 0), cand(2, 0, 0, 0, 0), cand(3, 0, 0, 0, 0)];
        let picks: Vec<usize> = (0..6).filter_map(|_| p.pick(&REQ, &cs)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(p.pick(&REQ, &[]), None);
    }

    #[test]
    fn least_loaded_uses_the_larger_of_report_and_inflight() {
        let p = policy_by_name("least_loaded", 1.0).expect("known");
        // Worker 1 reported idle but the router just sent it 5 requests.
        let cs = vec![cand(1, 0, 5, 0, 0), cand(2, 3, 1, 0, 0), cand(3, 4, 0, 0, 0)];
        for _ in 0..4 {
            assert_eq!(p.pick(&REQ, &cs), Some(1));
        }
        // Equal loads rotate instead of piling onto the first.
        let cs = vec![cand(1, 1, 0, 0, 0), cand(2, 1, 0, 0, 0)];
        let picks: std::collections::HashSet<_> = (0..4).filter_map(|_| p.pick(&REQ, &cs)).collect();
        assert_eq!(picks.len(), 2);
    }

    #[test]
    fn prefix_aware_trades_cached_tokens_against_queued_work() {
        let p = policy_by_name("prefix_aware", 1.0).expect("known");
        // Worker 2 holds 12 of the 16 prompt blocks (192 tokens): cost 64 vs 256.
        let cs = vec![cand(1, 0, 0, 0, 0), cand(2, 0, 0, 0, 12), cand(3, 0, 0, 0, 2)];
        assert_eq!(p.pick(&REQ, &cs), Some(1));
        // ...unless it has more than 192 tokens of prefill queued ahead: 64 + 300 > 256.
        let cs = vec![cand(1, 0, 0, 0, 0), cand(2, 0, 0, 300, 12)];
        assert_eq!(p.pick(&REQ, &cs), Some(0));
        // 64 + 150 < 256: still worth waiting for.
        let cs = vec![cand(1, 0, 0, 0, 0), cand(2, 0, 0, 150, 12)];
        assert_eq!(p.pick(&REQ, &cs), Some(1));
        // A cache that claims more than the prompt never makes the cost negative.
        let cs = vec![cand(1, 0, 0, 0, 99), cand(2, 0, 0, 0, 16)];
        assert!(p.pick(&REQ, &cs).is_some());
        assert!(p.uses_prefix_cache());
    }

    #[test]
    fn decode_goes_where_the_sequence_fits_and_load_is_lowest() {
        let mut a = cand(1, 2, 0, 0, 0);
        let mut b = cand(2, 0, 0, 0, 0);
        let c = cand(3, 1, 0, 0, 0);
        // b is idle but nearly full: 300 tokens need 19 blocks.
        b.used_blocks = 90;
        for turn in 0..3 {
            assert_eq!(pick_decode(&REQ, &[a.clone(), b.clone(), c.clone()], turn), Some(2));
        }
        // Equal idle workers take turns.
        let idle = [cand(1, 0, 0, 0, 0), cand(2, 0, 0, 0, 0)];
        assert_eq!((pick_decode(&REQ, &idle, 0), pick_decode(&REQ, &idle, 1)), (Some(0), Some(1)));
        // Nobody has room: the most free blocks wins.
        a.used_blocks = 95;
        let mut c2 = c;
        c2.used_blocks = 85;
        assert_eq!(pick_decode(&REQ, &[a, b, c2], 0), Some(2));
        assert_eq!(pick_decode(&REQ, &[], 0), None);
    }

    #[test]
    fn unknown_policies_are_named_in_the_error() {
        let err = policy_by_name("fastest", 1.0).err().expect("unknown");
        assert!(err.to_string().contains("fastest") && err.to_string().contains("prefix_aware"));
    }
}
