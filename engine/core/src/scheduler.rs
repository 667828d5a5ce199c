//! The continuous-batching scheduler.
//!
//! Each step, [`Scheduler::schedule`] picks which requests run and how many of their
//! uncomputed tokens, within a token budget and a sequence cap, and grows their KV
//! block tables. The backend runs the step and hands the sampled tokens to
//! [`Scheduler::update`], which advances `num_computed_tokens`, registers newly full
//! blocks in the prefix cache, appends tokens and applies stop rules.
//!
//! There are no prefill and decode phases: a request simply has tokens whose KV is not
//! computed yet. A prompt chunk, a decode row, a recompute after preemption and the
//! tail of a request whose prefix arrived from another worker are all the same case.
//!
//! Invariants:
//! - `running` holds exactly the requests with status `Running`, sorted by the policy
//!   key (priority, then arrival), so the last one is always the preemption victim;
//! - `waiting` holds exactly the `Waiting`/`Preempted` requests, which hold no blocks;
//! - `WaitingForKv` requests hold blocks but are in neither queue;
//! - finished requests are removed at once and hold nothing.
//!
//! `schedule` and `update` alternate; `add_request` and `abort` may come in between. A
//! [`Scheduler::continue_decode`] step may be planned between a step's `schedule` and its
//! `update`; it is applied after that step.

mod config;
mod continuation;
mod output;
mod prefilled;
#[cfg(test)]
mod tests;

pub use config::{ConfigError, SchedulerConfig, SchedulingPolicy};
pub use continuation::PENDING_TOKEN;
pub use output::{RequestUpdate, ScheduledSeq, SchedulerOutput};

use crate::api::{EngineRequest, EngineStats, FinishReason, RequestId, SubmitError};
use crate::block_manager::KvBlockManager;
use crate::params::ParamError;
use crate::request::{Request, RequestStatus};
use std::collections::{HashMap, HashSet, VecDeque};

/// Decides, step by step, which requests run and which KV blocks they use.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: KvBlockManager,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_arrival_seq: u64,
    num_preemptions: u64,
}

impl Scheduler {
    /// A scheduler over an empty pool; fails if the config does not validate.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let blocks = KvBlockManager::new(config.num_blocks, config.block_size, config.enable_prefix_caching)
            .map_err(|e| ConfigError { field: "num_blocks", message: e.to_string() })?;
        Ok(Self {
            config,
            blocks,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival_seq: 0,
            num_preemptions: 0,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Starts (or stops) recording prefix-cache events (blocks stored and evicted, by hash)
    /// for a router's prefix index.
    pub fn record_cache_events(&mut self, on: bool) {
        self.blocks.record_cache_events(on);
    }

    /// Prefix-cache events since the last call, oldest first.
    pub fn take_cache_events(&mut self) -> Vec<crate::block_manager::CacheEvent> {
        self.blocks.take_cache_events()
    }

    /// The KV block pool (read-only).
    pub fn block_manager(&self) -> &KvBlockManager {
        &self.blocks
    }

    /// Queues a new request.
    ///
    /// Errors: `InvalidPrompt` (empty prompt, or with chunked prefill off a prompt longer
    /// than `max_num_batched_tokens`), `InvalidParams` (`n != 1` or `max_tokens == 0`),
    /// `ContextTooLong` (prompt + max_tokens over `max_model_len`, or over what the whole
    /// KV pool can hold, reported as the effective limit), `QueueFull`, and `Unavailable`
    /// for an id already in use (an engine bug, not a client error).
    pub fn add_request(&mut self, id: RequestId, req: EngineRequest, eos_token_ids: &[u32]) -> Result<(), SubmitError> {
        let max_tokens = self.admission_check(id, &req)?;
        if self.waiting.len() >= self.config.max_waiting {
            return Err(SubmitError::QueueFull { waiting: self.waiting.len() });
        }
        let seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        let request = Request::new(id, req, eos_token_ids, seq, max_tokens, self.config.block_size);
        self.requests.insert(id, request);
        self.enqueue_waiting(id, false);
        Ok(())
    }

    /// Validates a new request and resolves its output cap.
    fn admission_check(&self, id: RequestId, req: &EngineRequest) -> Result<usize, SubmitError> {
        if self.requests.contains_key(&id) {
            return Err(SubmitError::Unavailable(format!("request id {id} is already in use")));
        }
        let prompt = req.prompt_token_ids.len();
        if prompt == 0 {
            return Err(SubmitError::InvalidPrompt("the prompt must contain at least one token".into()));
        }
        if req.params.n != 1 {
            return Err(ParamError::new(
                "n",
                format!("engine requests take n = 1 (fan out first), got {}", req.params.n),
            )
            .into());
        }
        if req.params.max_tokens == Some(0) {
            return Err(ParamError::new("max_tokens", "max_tokens must be at least 1, got 0").into());
        }
        let too_long = |max_tokens: usize, limit: usize| SubmitError::ContextTooLong {
            prompt_tokens: prompt,
            max_tokens,
            max_model_len: limit,
        };
        let model_len = self.config.max_model_len;
        // The last sampled token is never fed back, so a sequence of L tokens needs KV for L - 1.
        let pool_len = self.config.pool_tokens().saturating_add(1);
        let max_tokens = match req.params.max_tokens {
            Some(m) if prompt + m > model_len => return Err(too_long(m, model_len)),
            Some(m) if prompt + m > pool_len => return Err(too_long(m, pool_len)),
            Some(m) => m,
            None => {
                let limit = model_len.min(pool_len);
                if prompt >= limit {
                    return Err(too_long(1, limit));
                }
                limit - prompt
            }
        };
        if !self.config.enable_chunked_prefill && prompt > self.config.max_num_batched_tokens {
            return Err(SubmitError::InvalidPrompt(format!(
                "the prompt has {prompt} tokens but at most {} fit in one step with chunked prefill disabled",
                self.config.max_num_batched_tokens
            )));
        }
        Ok(max_tokens)
    }

    /// Ordering key: the front of `running`/`waiting` runs first, the back is preempted first.
    fn key(&self, id: RequestId) -> (i32, u64) {
        match self.requests.get(&id) {
            Some(r) => match self.config.policy {
                SchedulingPolicy::Fcfs => (0, r.arrival_seq()),
                SchedulingPolicy::Priority => (r.priority(), r.arrival_seq()),
            },
            None => (i32::MAX, u64::MAX),
        }
    }

    /// Puts `id` in the waiting queue: by key under the priority policy; under FCFS at the
    /// back, or at the front when `front` (preempted requests resume before new ones).
    fn enqueue_waiting(&mut self, id: RequestId, front: bool) {
        match self.config.policy {
            SchedulingPolicy::Fcfs if front => self.waiting.push_front(id),
            SchedulingPolicy::Fcfs => self.waiting.push_back(id),
            SchedulingPolicy::Priority => {
                let key = self.key(id);
                let pos = self.waiting.partition_point(|&w| self.key(w) <= key);
                self.waiting.insert(pos, id);
            }
        }
    }

    /// Inserts `id` into `running` at its key's place.
    fn insert_running(&mut self, id: RequestId) {
        let key = self.key(id);
        let pos = self.running.partition_point(|&r| self.key(r) <= key);
        self.running.insert(pos, id);
    }

    /// How many of `remaining` uncomputed tokens to schedule with `budget` left, or `None`
    /// to skip the request this step.
    fn chunk_len(&self, remaining: usize, budget: usize) -> Option<usize> {
        if remaining == 0 || budget == 0 {
            return None;
        }
        if self.config.enable_chunked_prefill || remaining <= budget {
            return Some(remaining.min(budget));
        }
        // Chunking is off, but a recompute after preemption (prompt + output) can be longer
        // than any step; chunking it is the only way it ever runs.
        (remaining > self.config.max_num_batched_tokens).then_some(budget)
    }

    /// Builds the step's entry for `id` covering `n` tokens from its computed position.
    fn scheduled_seq(&self, id: RequestId, n: usize) -> Option<ScheduledSeq> {
        let req = self.requests.get(&id)?;
        let start = req.num_computed_tokens();
        let end = start + n;
        Some(ScheduledSeq {
            id,
            token_ids: req.all_token_ids().get(start..end)?.to_vec(),
            start_pos: start,
            block_table: self.blocks.block_table(id)?.to_vec(),
            sample: end == req.num_tokens(),
        })
    }

    /// Plans one step: running requests first (in policy order), then waiting ones, within
    /// `max_num_batched_tokens` and `max_num_seqs`. A running request that cannot get a
    /// block preempts the lowest-ranked running request (possibly itself).
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        let max_seqs = self.config.max_num_seqs;

        let mut i = 0;
        while i < self.running.len() && budget > 0 && out.seqs.len() < max_seqs {
            let id = self.running[i];
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let computed = req.num_computed_tokens();
            let Some(n) = self.chunk_len(req.num_uncomputed_tokens(), budget) else {
                i += 1;
                continue;
            };
            loop {
                if self.blocks.allocate(id, &[], computed + n).is_ok() {
                    if let Some(seq) = self.scheduled_seq(id, n) {
                        out.seqs.push(seq);
                        budget -= n;
                    }
                    i += 1;
                    break;
                }
                // `running` is sorted by key, so its last entry ranks lowest. It is never an
                // entry scheduled earlier in this loop, because those sit before index `i`.
                let Some(&victim) = self.running.last() else {
                    break;
                };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
        }

        if out.preempted.is_empty() {
            self.admit_waiting(&mut out, &mut budget);
        }
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget;
        out
    }

    /// Admits waiting requests in queue order while budget, seats and blocks last.
    fn admit_waiting(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        let max_seqs = self.config.max_num_seqs;
        let bs = self.config.block_size;
        let mut preempted_here: HashSet<RequestId> = HashSet::new();
        let mut idx = 0;
        while idx < self.waiting.len() && *budget > 0 && self.running.len() < max_seqs && out.seqs.len() < max_seqs {
            let id = self.waiting[idx];
            let Some(req) = self.requests.get(&id) else {
                self.waiting.remove(idx);
                continue;
            };
            if preempted_here.contains(&id) {
                // Everything behind a request preempted for a more urgent one ranks no higher.
                break;
            }
            if self.blocked_on_prefix(req) {
                idx += 1;
                continue;
            }
            // Cached blocks have no logits: a request that still owes its prompt logprobs
            // computes every prompt position.
            let lookup =
                req.num_computed_tokens() == 0 && self.blocks.prefix_caching_enabled() && !req.needs_prompt_logits();
            let cached =
                if lookup { self.blocks.find_cached_prefix(req.block_hashes(), req.num_tokens()) } else { Vec::new() };
            let computed = req.num_computed_tokens().max(cached.len() * bs);
            let (num_tokens, priority) = (req.num_tokens(), req.priority());
            let Some(n) = self.chunk_len(num_tokens - computed, *budget) else {
                break;
            };
            if self.blocks.allocate(id, &cached, computed + n).is_err() {
                let Some(victim) = self.priority_victim(priority) else {
                    break;
                };
                if let Some(pos) = out.seqs.iter().position(|s| s.id == victim) {
                    *budget += out.seqs.remove(pos).token_ids.len();
                }
                self.preempt(victim);
                out.preempted.push(victim);
                preempted_here.insert(victim);
                // The victim went into `waiting`; find our request's index again and retry.
                idx = self.waiting.iter().position(|&w| w == id).unwrap_or(idx);
                continue;
            }
            self.waiting.remove(idx);
            if lookup {
                self.blocks.record_prefix_lookup(num_tokens, cached.len() * bs);
            }
            if let Some(req) = self.requests.get_mut(&id) {
                req.num_computed_tokens = computed;
                if !req.first_admission_done {
                    req.num_cached_tokens = computed;
                    req.first_admission_done = true;
                }
                req.status = RequestStatus::Running;
            }
            self.insert_running(id);
            if let Some(seq) = self.scheduled_seq(id, n) {
                out.seqs.push(seq);
                *budget -= n;
            }
        }
    }

    /// Under the priority policy, the running request a waiting request of `priority` may
    /// evict: the lowest-ranked one, if its priority is strictly lower.
    fn priority_victim(&self, priority: i32) -> Option<RequestId> {
        if self.config.policy != SchedulingPolicy::Priority {
            return None;
        }
        let &last = self.running.last()?;
        (self.requests.get(&last)?.priority() > priority).then_some(last)
    }

    /// True while the request `req` shares a prefix with still has prompt tokens to compute.
    /// Without prefix caching there is nothing to share, so nothing to wait for.
    fn blocked_on_prefix(&self, req: &Request) -> bool {
        if !self.blocks.prefix_caching_enabled() {
            return false;
        }
        let Some(parent) = req.share_prefix_with().and_then(|p| self.requests.get(&p)) else {
            return false;
        };
        parent.status() == RequestStatus::WaitingForKv || !parent.prompt_computed()
    }

    /// Recompute preemption: frees all of `id`'s blocks and sends it to the waiting queue.
    fn preempt(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        self.blocks.free(id);
        if let Some(req) = self.requests.get_mut(&id) {
            req.num_computed_tokens = 0;
            req.status = RequestStatus::Preempted;
            req.num_preemptions += 1;
        }
        self.num_preemptions += 1;
        self.enqueue_waiting(id, true);
    }

    /// Applies a finished step: every scheduled chunk is now computed, and `sampled`
    /// carries the tokens sampled for seqs with `sample` set. Returns one update per
    /// appended token. Entries for requests aborted since `schedule` are ignored; a seq
    /// that should have sampled but got no token recomputes its last token next step.
    pub fn update(&mut self, output: &SchedulerOutput, sampled: &[(RequestId, u32)]) -> Vec<RequestUpdate> {
        let sampled: HashMap<RequestId, u32> = sampled.iter().copied().collect();
        let bs = self.config.block_size;
        let mut updates = Vec::new();
        for seq in &output.seqs {
            let Some(req) = self.requests.get_mut(&seq.id) else {
                continue;
            };
            let end = seq.end_pos();
            let fresh = req.status() == RequestStatus::Running
                && req.num_computed_tokens() == seq.start_pos
                && end <= req.num_tokens();
            if !fresh {
                continue;
            }
            // A row that should have sampled but got no token leaves its last token
            // uncomputed, so the next step feeds it again and samples.
            let wants_sample = seq.sample && end == req.num_tokens();
            let token = if wants_sample { sampled.get(&seq.id).copied() } else { None };
            let computed = if wants_sample && token.is_none() { end - 1 } else { end };
            req.num_computed_tokens = computed;
            self.blocks.cache_full_blocks(seq.id, req.block_hashes(), computed / bs);
            let Some(token) = token else { continue };
            req.append_output(token);
            let stop = req.check_stop(self.config.max_model_len);
            updates.push(RequestUpdate {
                id: seq.id,
                new_token: token,
                finish_reason: stop.map(|(r, _)| r),
                stop_token: stop.and_then(|(_, t)| t),
                num_prompt_tokens: req.num_prompt_tokens(),
                num_cached_tokens: req.num_cached_tokens(),
            });
            if let Some((reason, _)) = stop {
                self.finish(seq.id, reason);
            }
        }
        updates
    }

    /// Removes a request from every queue and frees its blocks.
    fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let Some(mut req) = self.requests.remove(&id) else {
            return false;
        };
        req.status = RequestStatus::Finished(reason);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.blocks.free(id);
        true
    }

    /// Aborts a request wherever it is and frees its blocks; false if unknown or finished.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.finish(id, FinishReason::Abort)
    }

    /// A live (unfinished) request, e.g. for the sampler's penalties.
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// Current load and cumulative counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            num_running: self.running.len(),
            num_waiting: self.requests.len() - self.running.len(),
            num_used_blocks: self.blocks.num_blocks() - self.blocks.num_free_blocks(),
            num_total_blocks: self.blocks.num_blocks(),
            prefix_cache_queries: self.blocks.prefix_cache_queries(),
            prefix_cache_hits: self.blocks.prefix_cache_hits(),
            num_preemptions: self.num_preemptions,
        }
    }

    /// True while some request is waiting, running or receiving KV.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests not running: queued, preempted, or waiting for KV from another worker.
    pub fn num_waiting(&self) -> usize {
        self.requests.len() - self.running.len()
    }

    /// The running batch in scheduling order.
    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }

    /// The waiting queue in admission order.
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().copied()
    }

    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Checks the invariants in the module docs and the block pool's own; for tests and
    /// debug assertions. Returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check_consistency()?;
        let bs = self.config.block_size;
        let running: HashSet<_> = self.running.iter().collect();
        let waiting: HashSet<_> = self.waiting.iter().collect();
        if running.len() != self.running.len() || waiting.len() != self.waiting.len() {
            return Err("a request is queued twice".into());
        }
        if self.running.windows(2).any(|w| self.key(w[0]) > self.key(w[1])) {
            return Err("running is not sorted by policy key".into());
        }
        for (id, r) in &self.requests {
            let table = self.blocks.block_table(*id).map_or(0, <[_]>::len);
            if r.num_computed_tokens() > r.num_tokens() {
                return Err(format!("{id} computed past its tokens"));
            }
            match r.status() {
                RequestStatus::Running | RequestStatus::WaitingForKv => {
                    if table * bs < r.num_computed_tokens() {
                        return Err(format!("{id}: {table} blocks cannot hold {} tokens", r.num_computed_tokens()));
                    }
                    if running.contains(id) != (r.status() == RequestStatus::Running) || waiting.contains(id) {
                        return Err(format!("{id} ({:?}) is in the wrong queue", r.status()));
                    }
                }
                RequestStatus::Waiting | RequestStatus::Preempted => {
                    if table != 0 || r.num_computed_tokens() != 0 || !waiting.contains(id) || running.contains(id) {
                        return Err(format!("{id} waits but holds blocks or sits in the wrong queue"));
                    }
                }
                RequestStatus::Finished(_) => {
                    return Err(format!("finished {id} is still tracked"));
                }
            }
        }
        if self.running.iter().chain(&self.waiting).any(|id| !self.requests.contains_key(id)) {
            return Err("a queue holds an unknown request".into());
        }
        Ok(())
    }
}
