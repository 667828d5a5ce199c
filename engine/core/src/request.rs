//! One sequence request as the scheduler tracks it.
//!
//! A request's tokens are `prompt ++ output` in one vector; `num_computed_tokens`
//! says how many of them already have KV in the cache, and catches up to the
//! token count step by step. There is no separate prefill or decode phase:
//! a prompt chunk, a decode row, a prefix-cache hit and KV received from another
//! worker all just move `num_computed_tokens` forward.
//!
//! Invariants kept here:
//! - `num_computed_tokens <= num_tokens()`.
//! - `block_hashes()` holds the chained hash of every *full* block of the tokens,
//!   so it always has `num_tokens() / block_size` entries.
//! - Tokens are only ever appended; the prompt never changes.

use crate::api::{EngineRequest, FinishReason, RequestId};
use crate::block_hash::{BlockHash, hash_block, hash_full_blocks};
use crate::params::SamplingParams;
use std::time::Instant;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued, holds no KV blocks (new, or waiting for the request it shares a prefix with).
    Waiting,
    /// Admitted through the disaggregation seam; holds blocks that another worker is filling.
    WaitingForKv,
    /// In the running batch; holds KV blocks.
    Running,
    /// Evicted from the running batch (its blocks were freed); waits to recompute.
    Preempted,
    /// Done; holds nothing.
    Finished(FinishReason),
}

/// A single-sequence request inside the scheduler.
#[derive(Debug, Clone)]
pub struct Request {
    id: RequestId,
    token_ids: Vec<u32>,
    num_prompt_tokens: usize,
    params: SamplingParams,
    eos_token_ids: Vec<u32>,
    priority: i32,
    arrival: Instant,
    arrival_seq: u64,
    max_tokens: usize,
    share_prefix_with: Option<RequestId>,
    block_size: usize,
    block_hashes: Vec<BlockHash>,
    pub(crate) num_computed_tokens: usize,
    pub(crate) num_cached_tokens: usize,
    pub(crate) status: RequestStatus,
    pub(crate) num_preemptions: u32,
    /// Whether `num_cached_tokens` was already reported; hits after a preemption don't count again.
    pub(crate) first_admission_done: bool,
}

impl Request {
    /// Builds a waiting request. `max_tokens` is the resolved output cap (never zero);
    /// `arrival_seq` orders requests that arrived at the same `Instant`.
    pub(crate) fn new(
        id: RequestId,
        req: EngineRequest,
        eos_token_ids: &[u32],
        arrival_seq: u64,
        max_tokens: usize,
        block_size: usize,
    ) -> Self {
        let block_hashes = hash_full_blocks(&req.prompt_token_ids, block_size);
        Self {
            id,
            num_prompt_tokens: req.prompt_token_ids.len(),
            token_ids: req.prompt_token_ids,
            params: req.params,
            eos_token_ids: eos_token_ids.to_vec(),
            priority: req.priority,
            arrival: req.arrival,
            arrival_seq,
            max_tokens,
            share_prefix_with: req.share_prefix_with,
            block_size,
            block_hashes,
            num_computed_tokens: 0,
            num_cached_tokens: 0,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            first_admission_done: false,
        }
    }

    /// The engine id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The prompt tokens.
    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.token_ids[..self.num_prompt_tokens]
    }

    /// Tokens generated so far.
    pub fn output_token_ids(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens..]
    }

    /// Prompt followed by output.
    pub fn all_token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// Length of prompt plus output.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Length of the prompt.
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Number of generated tokens.
    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Sampling parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// EOS ids that end this request unless `ignore_eos`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Lower runs first under the priority policy.
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// When the frontend received the request.
    pub fn arrival(&self) -> Instant {
        self.arrival
    }

    /// Admission order in this scheduler; breaks ties between equal priorities (FCFS).
    pub fn arrival_seq(&self) -> u64 {
        self.arrival_seq
    }

    /// Resolved output cap: `max_tokens`, or what the context (and KV pool) leaves when unset.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The request whose prompt this one waits for, if any.
    pub fn share_prefix_with(&self) -> Option<RequestId> {
        self.share_prefix_with
    }

    /// Tokens whose KV is in the cache (computed here, hit in the prefix cache, or received).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    /// Prompt tokens served from the prefix cache or received from another worker on first admission.
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens
    }

    /// Current lifecycle state.
    pub fn status(&self) -> RequestStatus {
        self.status
    }

    /// True once finished (stopped, length-capped or aborted).
    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// How many times this request was preempted.
    pub fn num_preemptions(&self) -> u32 {
        self.num_preemptions
    }

    /// Chained hashes of every full block of `all_token_ids()`.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.block_hashes
    }

    /// Tokens not yet computed (the next chunk comes from here).
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    /// True once every prompt token has KV.
    pub fn prompt_computed(&self) -> bool {
        self.num_computed_tokens >= self.num_prompt_tokens
    }

    /// True while the request asked for prompt logprobs and has not delivered them yet
    /// (they come with the first output token), so every prompt position needs its logits.
    pub fn needs_prompt_logits(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.num_output_tokens() == 0
    }

    /// Appends a generated token and hashes the block it completes, if any.
    pub(crate) fn append_output(&mut self, token: u32) {
        self.token_ids.push(token);
        let len = self.token_ids.len();
        if len.is_multiple_of(self.block_size) {
            let parent = self.block_hashes.last().copied();
            self.block_hashes.push(hash_block(parent, &self.token_ids[len - self.block_size..]));
        }
    }

    /// Whether the last generated token ends the request, and why.
    ///
    /// A stop token (EOS unless `ignore_eos`, or any of `stop_token_ids`) at output index
    /// `i` only counts once `i >= min_tokens`, i.e. after `min_tokens` other outputs, which
    /// matches a sampler that suppresses stop tokens while fewer than `min_tokens` exist.
    /// A stop token wins over the length cap when both apply, so the client learns which
    /// token ended the text.
    pub fn check_stop(&self, max_model_len: usize) -> Option<(FinishReason, Option<u32>)> {
        let num_out = self.num_output_tokens();
        let &last = self.output_token_ids().last()?;
        if num_out > self.params.min_tokens {
            let is_eos = !self.params.ignore_eos && self.eos_token_ids.contains(&last);
            if is_eos || self.params.stop_token_ids.contains(&last) {
                return Some((FinishReason::Stop, Some(last)));
            }
        }
        if num_out >= self.max_tokens || self.num_tokens() >= max_model_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: Vec<u32>, params: SamplingParams, max_tokens: usize) -> Request {
        Request::new(RequestId(1), EngineRequest::new(prompt, params), &[2], 0, max_tokens, 4)
    }

    #[test]
    fn tokens_split_into_prompt_and_output_and_hashes_track_full_blocks() {
        let mut r = req(vec![5, 6, 7, 8, 9, 10], SamplingParams::default(), 10);
        assert_eq!(r.block_hashes().len(), 1);
        r.append_output(11);
        assert_eq!(r.block_hashes().len(), 1);
        r.append_output(12);
        assert_eq!(r.prompt_token_ids(), &[5, 6, 7, 8, 9, 10]);
        assert_eq!(r.output_token_ids(), &[11, 12]);
        assert_eq!(r.block_hashes(), hash_full_blocks(r.all_token_ids(), 4).as_slice());
        assert_eq!(r.block_hashes().len(), 2);
    }

    #[test]
    fn eos_and_stop_tokens_respect_min_tokens_and_ignore_eos() {
        let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![9], ..Default::default() };
        let mut r = req(vec![1], p, 10);
        r.append_output(2);
        assert_eq!(r.check_stop(100), None, "EOS before min_tokens outputs must not stop");
        r.append_output(9);
        assert_eq!(r.check_stop(100), None, "stop token at index 1 < min_tokens");
        r.append_output(9);
        assert_eq!(r.check_stop(100), Some((FinishReason::Stop, Some(9))));

        let p = SamplingParams { ignore_eos: true, ..Default::default() };
        let mut r = req(vec![1], p, 10);
        r.append_output(2);
        assert_eq!(r.check_stop(100), None);
    }

    #[test]
    fn length_caps_from_max_tokens_and_model_len() {
        let mut r = req(vec![1, 1, 1], SamplingParams::default(), 2);
        r.append_output(7);
        assert_eq!(r.check_stop(100), None);
        r.append_output(7);
        assert_eq!(r.check_stop(100), Some((FinishReason::Length, None)));
        let mut r = req(vec![1, 1, 1], SamplingParams::default(), 50);
        r.append_output(7);
        assert_eq!(r.check_stop(4), Some((FinishReason::Length, None)));
        // A stop token on the last allowed position reports Stop, not Length.
        let mut r = req(vec![1], SamplingParams::default(), 1);
        r.append_output(2);
        assert_eq!(r.check_stop(100), Some((FinishReason::Stop, Some(2))));
    }
}
