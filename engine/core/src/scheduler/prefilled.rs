//! The disaggregation seam: admitting a request whose first tokens' KV was computed
//! by another worker (a prefill worker, in the relay this project is named after).
//!
//! Life of such a request on the decode worker:
//! 1. [`Scheduler::add_prefilled_request`] reserves fresh blocks for the first `k`
//!    tokens and returns their table; the request is `WaitingForKv` and never scheduled.
//! 2. The transport writes the KV into exactly those blocks.
//! 3. [`Scheduler::complete_kv_transfer`] marks the `k` tokens computed (and caches the
//!    full blocks); the request joins the running batch and continues like any other.
//!    On failure or timeout, [`Scheduler::fail_kv_transfer`] drops the blocks and the
//!    request recomputes locally from scratch; [`Scheduler::abort`] works at any point.
//!
//! The reserved blocks are always fresh (never shared prefix blocks), so the transport
//! writes into blocks no other request can read.
//!
//! The relay's usual shape is [`Scheduler::reserve_for_transfer`]: blocks for the whole
//! prompt are reserved before the prefill worker has sampled anything, and the first token
//! arrives with the KV ([`Scheduler::complete_kv_transfer_with_token`]). Until then the
//! request's computed tokens equal its known tokens, so it could not be scheduled anyway.

use super::{RequestUpdate, Scheduler};
use crate::api::{EngineRequest, RequestId, SubmitError};
use crate::block_manager::BlockId;
use crate::params::ParamError;
use crate::request::{Request, RequestStatus};

impl Scheduler {
    /// Admits `req` with its first `num_prefilled_tokens` tokens' KV to be received.
    /// `first_token`, when the prefill worker already sampled it, becomes the first output
    /// token, so the next step here decodes it. Returns the block table to fill; it covers
    /// the `num_prefilled_tokens` positions.
    ///
    /// Errors: everything [`Scheduler::add_request`] checks (except the waiting-queue
    /// length), `InvalidPrompt` when nothing would be left to compute here (the prefilled
    /// tokens must leave at least one known token uncomputed) or when `first_token` already
    /// ends the request, and `QueueFull` when the pool has too few free blocks right now.
    pub fn add_prefilled_request(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        eos_token_ids: &[u32],
        num_prefilled_tokens: usize,
        first_token: Option<u32>,
    ) -> Result<Vec<BlockId>, SubmitError> {
        let known = req.prompt_token_ids.len() + usize::from(first_token.is_some());
        if num_prefilled_tokens == 0 || num_prefilled_tokens >= known {
            return Err(SubmitError::InvalidPrompt(format!(
                "{num_prefilled_tokens} prefilled tokens for a request with {known} known tokens; \
                 need between 1 and {} so at least one token is computed here",
                known.saturating_sub(1)
            )));
        }
        self.reserve(id, req, eos_token_ids, num_prefilled_tokens, first_token)
    }

    /// Reserves fresh blocks for the whole prompt of `req`, whose KV and first output token
    /// both come from a prefill worker; finish with
    /// [`Scheduler::complete_kv_transfer_with_token`] (or fail/abort as usual). Returns the
    /// block table to fill.
    ///
    /// Errors: everything [`Scheduler::add_request`] checks (except the waiting-queue
    /// length), and `QueueFull` when the pool has too few free blocks right now.
    pub fn reserve_for_transfer(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        eos_token_ids: &[u32],
    ) -> Result<Vec<BlockId>, SubmitError> {
        let prompt = req.prompt_token_ids.len();
        self.reserve(id, req, eos_token_ids, prompt, None)
    }

    fn reserve(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        eos_token_ids: &[u32],
        num_prefilled_tokens: usize,
        first_token: Option<u32>,
    ) -> Result<Vec<BlockId>, SubmitError> {
        if req.params.prompt_logprobs.is_some() {
            // Prompt logprobs come from the prompt's logits, which only the worker that
            // computes the prompt has; such a request runs on one worker.
            return Err(ParamError::new(
                "prompt_logprobs",
                "a request with prompt logprobs cannot take its prompt's KV from another worker",
            )
            .into());
        }
        let max_tokens = self.admission_check(id, &req)?;
        let seq = self.next_arrival_seq;
        let mut request = Request::new(id, req, eos_token_ids, seq, max_tokens, self.config.block_size);
        if let Some(t) = first_token {
            request.append_output(t);
            if request.check_stop(self.config.max_model_len).is_some() {
                return Err(SubmitError::InvalidPrompt(format!(
                    "the first token {t} already ends the request; there is nothing to decode"
                )));
            }
        }
        self.blocks
            .allocate(id, &[], num_prefilled_tokens)
            .map_err(|_| SubmitError::QueueFull { waiting: self.waiting.len() })?;
        let table = self.blocks.block_table(id).map(<[_]>::to_vec).unwrap_or_default();
        self.next_arrival_seq += 1;
        request.num_computed_tokens = num_prefilled_tokens;
        request.num_cached_tokens = num_prefilled_tokens;
        request.first_admission_done = true;
        request.status = RequestStatus::WaitingForKv;
        self.requests.insert(id, request);
        Ok(table)
    }

    /// The KV of a prefilled request has fully arrived: it joins the running batch.
    /// Returns false if `id` is not waiting for KV, or if it still waits for its first
    /// token (use [`Scheduler::complete_kv_transfer_with_token`]).
    pub fn complete_kv_transfer(&mut self, id: RequestId) -> bool {
        let bs = self.config.block_size;
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if req.status() != RequestStatus::WaitingForKv || req.num_uncomputed_tokens() == 0 {
            return false;
        }
        req.status = RequestStatus::Running;
        let full = req.num_computed_tokens() / bs;
        self.blocks.cache_full_blocks(id, req.block_hashes(), full);
        self.insert_running(id);
        true
    }

    /// The KV of a request reserved by [`Scheduler::reserve_for_transfer`] has arrived with
    /// the first token the prefill worker sampled. The token is appended as the first output
    /// and the request joins the running batch, unless the token already ends it (stop token
    /// or `max_tokens == 1`): then it finishes here, its blocks are freed, and the update says
    /// why. `None` if `id` is not waiting for KV and a token.
    pub fn complete_kv_transfer_with_token(&mut self, id: RequestId, first_token: u32) -> Option<RequestUpdate> {
        let bs = self.config.block_size;
        let max_model_len = self.config.max_model_len;
        let req = self.requests.get_mut(&id)?;
        if req.status() != RequestStatus::WaitingForKv || req.num_uncomputed_tokens() != 0 {
            return None;
        }
        req.append_output(first_token);
        let stop = req.check_stop(max_model_len);
        let update = RequestUpdate {
            id,
            new_token: first_token,
            finish_reason: stop.map(|(r, _)| r),
            stop_token: stop.and_then(|(_, t)| t),
            num_prompt_tokens: req.num_prompt_tokens(),
            num_cached_tokens: req.num_cached_tokens(),
        };
        let full = req.num_computed_tokens() / bs;
        self.blocks.cache_full_blocks(id, req.block_hashes(), full);
        match stop {
            Some((reason, _)) => {
                self.finish(id, reason);
            }
            None => {
                if let Some(req) = self.requests.get_mut(&id) {
                    req.status = RequestStatus::Running;
                }
                self.insert_running(id);
            }
        }
        Some(update)
    }

    /// The transfer for `id` failed or timed out: its blocks are released and it
    /// recomputes everything locally, ahead of new requests. Returns false if `id` is not
    /// waiting for KV.
    pub fn fail_kv_transfer(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if req.status() != RequestStatus::WaitingForKv {
            return false;
        }
        req.num_computed_tokens = 0;
        req.num_cached_tokens = 0;
        req.first_admission_done = false;
        req.status = RequestStatus::Waiting;
        self.blocks.free(id);
        self.enqueue_waiting(id, true);
        true
    }
}
