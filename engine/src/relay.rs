//! The engine's side of a prefill → decode hand-off (the relay the project is named after).
//!
//! A **prefill** engine runs an *export* request: it computes the prompt like any other
//! request, and during the step that completes the prompt it emits the transfer plan, then
//! each layer's K/V for the prompt's blocks as soon as that layer has written them, then the
//! first sampled token ([`ExportEvent`]). The request then leaves the prefill engine (its
//! full blocks stay in the prefix cache). A **decode** engine *reserves* blocks for a prompt
//! before anything is computed, receives layers into exactly those blocks, and joins the
//! request to its running batch when the first token arrives; on failure it recomputes the
//! prompt locally.
//!
//! Everything here is plain data: moving bytes between workers is the transport's job
//! ([`crate::kv_transport`]), routing is the router's.

use crate::kv_transport::LayerFrame;
use baton_core::api::TokenLogprob;
use baton_core::kv_transfer::TransferPlan;
use serde::{Deserialize, Serialize};

/// What a prefill engine emits for one export request, in this order: one `Started`, one
/// `Plan`, one `Layer` per layer (layer order), one `Done`. A channel that closes before
/// `Done` means the request failed or was aborted on the prefill side.
#[derive(Debug, Clone, PartialEq)]
pub enum ExportEvent {
    /// The scheduler took the request for the first time: its prompt is being computed (the
    /// time before this was spent queued behind other requests).
    Started,
    /// Which blocks move (sender's and receiver's physical blocks, merged into runs).
    Plan(TransferPlan),
    /// One layer's K and V of the planned blocks, in plan order.
    Layer(LayerFrame),
    /// The first token, sampled after the last layer.
    Done(TransferTrailer),
}

/// Sent after the last layer: the token the prefill worker sampled from the prompt, so the
/// decode worker continues from exactly the sequence the client sees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferTrailer {
    /// The first output token.
    pub first_token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprob>,
}

/// What the model does with one export's blocks after each layer: copy them to the host
/// (for the TCP transport), or enqueue NCCL sends over `link`.
#[derive(Debug, Clone)]
pub struct ExportSpec {
    /// The sender's blocks, in plan order.
    pub blocks: Vec<u32>,
    /// The plan's runs on the sender's side, `(first block, count)`, for NCCL.
    pub runs: Vec<(usize, usize)>,
    /// The NCCL link when the data goes GPU to GPU.
    pub link: Option<std::sync::Arc<crate::kv_transport::nccl::NcclLink>>,
}

/// Expands a plan's runs into the sender's and the receiver's block lists (same order).
pub fn plan_blocks(plan: &TransferPlan) -> (Vec<u32>, Vec<u32>) {
    let mut src = Vec::with_capacity(plan.num_blocks());
    let mut dst = Vec::with_capacity(plan.num_blocks());
    for r in &plan.runs {
        src.extend((0..r.len as u32).map(|i| r.src_start + i));
        dst.extend((0..r.len as u32).map(|i| r.dst_start + i));
    }
    (src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::kv_transfer::{KvDtype, KvLayout, plan_transfer};

    #[test]
    fn plan_blocks_follow_the_runs_in_logical_order() {
        let layout = KvLayout { num_layers: 2, block_size: 4, num_kv_heads: 1, head_dim: 8, dtype: KvDtype::F32 };
        let plan = plan_transfer(&layout, &[7, 8, 3], &[0, 1, 2], 10, 0).expect("plan");
        let (src, dst) = plan_blocks(&plan);
        assert_eq!(src, vec![7, 8, 3]);
        assert_eq!(dst, vec![0, 1, 2]);
    }
}
