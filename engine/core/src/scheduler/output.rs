//! What the scheduler hands the backend each step, and what it hands back to the
//! frontend after the step. Plain data: no references into scheduler state, so a
//! step can be executed on another thread or shipped to another process.

use crate::api::{FinishReason, RequestId};
use crate::block_manager::BlockId;

/// One sequence's work in a step: compute KV for `token_ids` at positions
/// `start_pos..start_pos + token_ids.len()`, and sample the next token if `sample`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub id: RequestId,
    /// The new tokens to feed (non-empty).
    pub token_ids: Vec<u32>,
    /// Position of `token_ids[0]`; equals the request's `num_computed_tokens` before the step.
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + token_ids.len()` in order.
    pub block_table: Vec<BlockId>,
    /// True when this chunk reaches the end of the known tokens, so the backend samples.
    pub sample: bool,
}

impl ScheduledSeq {
    /// Position after the last token of this chunk.
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.token_ids.len()
    }
}

/// One scheduling step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Sequences to run; running requests first, then newly admitted ones.
    pub seqs: Vec<ScheduledSeq>,
    /// Requests preempted while building this step; their KV is gone.
    pub preempted: Vec<RequestId>,
    /// Sum of `token_ids.len()` over `seqs`.
    pub num_batched_tokens: usize,
}

impl SchedulerOutput {
    /// True when there is nothing for the backend to run.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// A token produced for a request, and whether it ended the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestUpdate {
    /// The request.
    pub id: RequestId,
    /// The token sampled this step.
    pub new_token: u32,
    /// Set when this token finished the request (its blocks are already freed).
    pub finish_reason: Option<FinishReason>,
    /// The EOS or stop token id that ended it, if that is why.
    pub stop_token: Option<u32>,
    /// Prompt length.
    pub num_prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache or received from another worker.
    pub num_cached_tokens: usize,
}
