//! Scheduling the next decode step before the current one's tokens are known, so the
//! engine can launch it while the device still runs the current one (vLLM's async
//! scheduling, SGLang's overlap scheduler).
//!
//! A continuation of a pure decode step feeds every sequence the token its current step
//! is sampling, as a placeholder ([`PENDING_TOKEN`]) the backend replaces with the real id
//! on the device. It is plain data like any [`SchedulerOutput`], and [`Scheduler::update`]
//! applies it unchanged once the step before it was applied: by then each sequence's
//! computed count equals the continuation's `start_pos` and its token is known.
//!
//! Invariants:
//! - only offered when nothing else could run instead: every running request is in the
//!   step, no waiting request could be admitted (a seat and blocks for its first chunk) or
//!   preempt, and each continued sequence gets its next block without preemption (otherwise
//!   `None`, and the engine schedules normally once the step is applied);
//! - a sequence whose pending token surely ends it (its length cap) is left out; one that
//!   ends on a stop token is found out only when the step is applied, and its row in the
//!   continuation is discarded then (the KV it writes lands past every computed token of a
//!   request that no longer exists, in a block no other request shares).

use super::{ScheduledSeq, Scheduler, SchedulerOutput, SchedulingPolicy};
use crate::request::RequestStatus;

/// The token id a continuation feeds where the previous step's sample goes; never a valid id,
/// so a backend that did not substitute it refuses the step instead of computing garbage.
pub const PENDING_TOKEN: u32 = u32::MAX;

impl Scheduler {
    /// The decode step after `prev`, which was scheduled but not yet applied with
    /// [`Scheduler::update`], or `None` when it cannot be planned now (see the module docs).
    /// Each returned sequence feeds [`PENDING_TOKEN`] at `prev`'s end position. Its blocks
    /// are allocated here; the caller must apply `prev` before the continuation.
    pub fn continue_decode(&mut self, prev: &SchedulerOutput) -> Option<SchedulerOutput> {
        if !prev.preempted.is_empty() || prev.seqs.is_empty() || self.running.len() != prev.seqs.len() {
            return None;
        }
        if self.admission_pending() {
            return None;
        }
        let max_model_len = self.config.max_model_len;
        let mut ids = Vec::with_capacity(prev.seqs.len());
        for seq in &prev.seqs {
            let req = self.requests.get(&seq.id)?;
            let decode_row = seq.sample
                && seq.token_ids.len() == 1
                && req.status() == RequestStatus::Running
                && req.num_computed_tokens() == seq.start_pos
                && req.num_tokens() == seq.end_pos();
            if !decode_row {
                return None;
            }
            // After `prev`'s token the request holds num_tokens + 1 tokens and one more output.
            let ends_by_length =
                req.num_output_tokens() + 1 >= req.max_tokens() || req.num_tokens() + 1 >= max_model_len;
            if !ends_by_length {
                ids.push(seq.id);
            }
        }
        if ids.is_empty() {
            return None;
        }
        let mut out = SchedulerOutput::default();
        for id in ids {
            let start_pos = self.requests.get(&id)?.num_tokens();
            self.blocks.allocate(id, &[], start_pos + 1).ok()?;
            out.seqs.push(ScheduledSeq {
                id,
                token_ids: vec![PENDING_TOKEN],
                start_pos,
                block_table: self.blocks.block_table(id)?.to_vec(),
                sample: true,
            });
        }
        out.num_batched_tokens = out.seqs.len();
        Some(out)
    }

    /// Whether a normal [`Scheduler::schedule`] could admit a waiting request now: a free seat
    /// and free blocks for the front request's first chunk (cached prefix blocks not counted),
    /// or under the priority policy a running request it would preempt. Free blocks only shrink
    /// between finishes, and every finish makes the engine schedule normally, so a request this
    /// misjudges as not fitting waits at most until the next finish, when the real rule runs.
    fn admission_pending(&self) -> bool {
        let Some(front) = self.waiting.front().and_then(|id| self.requests.get(id)) else {
            return false;
        };
        if self.running.len() < self.config.max_num_seqs {
            // The budget `schedule` would have left after one decode token per running request.
            let budget = self.config.max_num_batched_tokens.saturating_sub(self.running.len());
            let remaining = front.num_tokens() - front.num_computed_tokens();
            if self
                .chunk_len(remaining, budget)
                .is_some_and(|n| self.blocks.num_free_blocks() >= n.div_ceil(self.config.block_size))
            {
                return true;
            }
        }
        self.config.policy == SchedulingPolicy::Priority && self.priority_victim(front.priority()).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{EngineRequest, FinishReason, RequestId};
    use crate::params::SamplingParams;
    use crate::scheduler::SchedulerConfig;
    use std::collections::BTreeMap;

    const EOS: u32 = 7;

    fn cfg(num_blocks: usize, max_num_seqs: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens: 64,
            max_model_len: 128,
            ..SchedulerConfig::default()
        }
    }

    /// The token "sampled" for request `id` at position `pos`: fixed by both, so a planned-ahead
    /// run and a step-by-step run must produce the same text. EOS comes up now and then.
    fn token(id: RequestId, pos: usize) -> u32 {
        let mut z = (id.0 << 20 ^ pos as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z ^= z >> 29;
        (z % 23) as u32 + 5
    }

    fn requests(s: &mut Scheduler, n: u64) {
        for i in 0..n {
            let prompt: Vec<u32> = (0..(3 + i as usize * 5 % 11)).map(|p| token(RequestId(100 + i), p)).collect();
            let max_tokens = 4 + (i as usize * 7) % 19;
            let params = SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() };
            s.add_request(RequestId(i), EngineRequest::new(prompt, params), &[EOS]).expect("admitted");
        }
    }

    type Texts = BTreeMap<u64, (Vec<u32>, Option<FinishReason>)>;

    /// Applies `out` with every sampling row's scripted token; records the updates.
    fn apply(s: &mut Scheduler, out: &SchedulerOutput, texts: &mut Texts) {
        let sampled: Vec<_> = out.seqs.iter().filter(|q| q.sample).map(|q| (q.id, token(q.id, q.end_pos()))).collect();
        for u in s.update(out, &sampled) {
            let t = texts.entry(u.id.0).or_default();
            t.0.push(u.new_token);
            t.1 = u.finish_reason;
        }
        s.check_invariants().expect("invariants hold after each step");
    }

    fn run_step_by_step(mut s: Scheduler) -> Texts {
        let mut texts = Texts::new();
        while s.has_unfinished() {
            let out = s.schedule();
            assert!(!out.is_empty(), "the pool is large enough for every request");
            apply(&mut s, &out, &mut texts);
        }
        texts
    }

    /// The engine's pipelined order: plan the continuation of the step in flight, then apply
    /// that step, then the continuation becomes the step in flight.
    fn run_planned_ahead(mut s: Scheduler) -> (Texts, usize) {
        let (mut texts, mut continued) = (Texts::new(), 0);
        let mut in_flight: Option<SchedulerOutput> = None;
        while s.has_unfinished() || in_flight.is_some() {
            match in_flight.take() {
                Some(prev) => {
                    let next = s.continue_decode(&prev);
                    apply(&mut s, &prev, &mut texts);
                    if let Some(next) = next {
                        assert!(next.seqs.iter().all(|q| q.token_ids == [PENDING_TOKEN] && q.sample));
                        continued += 1;
                        in_flight = Some(next);
                    }
                }
                None => {
                    let out = s.schedule();
                    assert!(!out.is_empty());
                    in_flight = Some(out);
                }
            }
        }
        (texts, continued)
    }

    #[test]
    fn planning_ahead_produces_the_step_by_step_texts() {
        for (blocks, seats) in [(256, 4), (256, 16), (40, 16)] {
            let mut a = Scheduler::new(cfg(blocks, seats)).expect("config");
            requests(&mut a, 12);
            let b = a.clone();
            let want = run_step_by_step(a);
            let (got, continued) = run_planned_ahead(b);
            assert_eq!(got, want, "{blocks} blocks, {seats} seats");
            assert_eq!(want.len(), 12);
            assert!(want.values().any(|t| t.1 == Some(FinishReason::Stop)), "some text ends on EOS");
            assert!(want.values().any(|t| t.1 == Some(FinishReason::Length)), "some text ends on its cap");
            assert!(continued > 10, "{blocks} blocks, {seats} seats: only {continued} steps planned ahead");
        }
    }

    #[test]
    fn no_continuation_while_something_else_could_run() {
        let mut s = Scheduler::new(cfg(64, 2)).expect("config");
        requests(&mut s, 3);
        let prefill = s.schedule();
        assert!(s.continue_decode(&prefill).is_none(), "a prompt step is not a decode step");
        let mut texts = Texts::new();
        apply(&mut s, &prefill, &mut texts);
        let decode = s.schedule();
        assert_eq!(decode.seqs.len(), 2, "two seats");
        assert!(s.continue_decode(&decode).is_some(), "the third request cannot get a seat");
        apply(&mut s, &decode, &mut texts);
        s.abort(RequestId(0));
        let decode = s.schedule();
        assert!(s.continue_decode(&decode).is_none(), "a seat is free for the waiting request");
    }

    #[test]
    fn a_full_pool_or_an_abort_in_between_is_safe() {
        // 4 blocks of 4: a 9-token prompt takes 3, a 3-token prompt the last one.
        let mut s = Scheduler::new(cfg(4, 2)).expect("config");
        let params = SamplingParams { max_tokens: Some(4), ignore_eos: true, ..SamplingParams::greedy() };
        for (id, len) in [(1, 9), (2, 3)] {
            s.add_request(RequestId(id), EngineRequest::new(vec![9; len], params.clone()), &[EOS]).expect("fits");
        }
        let mut texts = Texts::new();
        let out = s.schedule();
        apply(&mut s, &out, &mut texts);
        let out = s.schedule();
        assert_eq!(out.seqs.iter().map(|q| q.start_pos).collect::<Vec<_>>(), [9, 3]);
        assert!(s.continue_decode(&out).is_none(), "request 2's position 4 needs a fifth block");
        assert!(s.abort(RequestId(2)));
        let out = {
            apply(&mut s, &out, &mut texts);
            s.schedule()
        };
        let next = s.continue_decode(&out).expect("request 1's position 11 fits its third block");
        assert_eq!((next.seqs[0].start_pos, next.seqs[0].block_table.len()), (11, 3));
        // Aborted while its continuation is in flight: applying both changes nothing more.
        assert!(s.abort(RequestId(1)));
        apply(&mut s, &out, &mut texts);
        apply(&mut s, &next, &mut texts);
        assert_eq!(s.block_manager().num_free_blocks(), 4);
        assert_eq!(texts[&1].0.len(), 2, "the prefill's token and the first decode's; the aborted steps add none");
    }

    #[test]
    fn a_waiting_request_that_cannot_get_blocks_does_not_stop_planning_ahead() {
        // 6 blocks of 4, 4 seats: two 9-token prompts take 3 blocks each; a third waits with a
        // free seat but no blocks, so nothing could admit it and the decode may run ahead.
        let mut s = Scheduler::new(cfg(6, 4)).expect("config");
        let params = SamplingParams { max_tokens: Some(3), ignore_eos: true, ..SamplingParams::greedy() };
        for id in 1..=3 {
            let prompt = (0..9).map(|p| token(RequestId(id), p)).collect();
            s.add_request(RequestId(id), EngineRequest::new(prompt, params.clone()), &[EOS]).expect("fits");
        }
        let mut texts = Texts::new();
        let out = s.schedule();
        assert_eq!(out.seqs.len(), 2, "the third prompt finds no blocks");
        apply(&mut s, &out, &mut texts);
        let prev = s.schedule();
        assert!(!s.admission_pending(), "a free seat but no blocks for the waiting prompt");
        assert!(s.clone().continue_decode(&prev).is_some(), "the waiting request could not be admitted anyway");
        // Once blocks are free, it could be: a normal step admits it at once.
        assert!(s.abort(RequestId(1)));
        assert!(s.admission_pending(), "a seat and blocks are free for the waiting request");
        apply(&mut s, &prev, &mut texts);
        let out = s.schedule();
        assert_eq!(out.seqs.iter().map(|q| q.token_ids.len()).collect::<Vec<_>>(), [1, 9], "admitted at once");
    }
}
