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
//!
//! Nothing a peer sends is trusted: a decode engine publishes each [`Reservation`] so the
//! transport can check a handshake against it before allocating anything, and a
//! [`TransferTrailer`] is checked ([`TransferTrailer::check`]) before its token joins a batch.

use crate::kv_transport::LayerFrame;
use baton_core::api::TokenLogprob;
use baton_core::kv_transfer::TransferPlan;
use baton_core::params::MAX_TOP_LOGPROBS;
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

impl TransferTrailer {
    /// Checks a peer's trailer before its token joins a batch: the first token (and every
    /// token of its logprobs) inside a vocabulary of `vocab_size`, and logprobs exactly when
    /// the request asked for them (`want_logprobs`), for the sampled token, with at most the
    /// requested number of alternatives and no NaN. The reason otherwise.
    pub fn check(&self, vocab_size: usize, want_logprobs: Option<usize>) -> Result<(), String> {
        let in_vocab = |t: u32| (t as usize) < vocab_size;
        if !in_vocab(self.first_token) {
            return Err(format!("the first token {} is outside the vocabulary (size {vocab_size})", self.first_token));
        }
        match (&self.logprobs, want_logprobs) {
            (None, None) => Ok(()),
            (Some(_), None) => Err("the trailer carries logprobs the request did not ask for".into()),
            (None, Some(_)) => Err("the trailer lacks the logprobs the request asked for".into()),
            (Some(lp), Some(k)) => {
                if lp.token_id != self.first_token {
                    return Err(format!(
                        "the trailer's logprobs are for token {}, not the first token {}",
                        lp.token_id, self.first_token
                    ));
                }
                if lp.top.len() > k.min(MAX_TOP_LOGPROBS) {
                    return Err(format!("the trailer has {} top logprobs, the request asked for {k}", lp.top.len()));
                }
                if lp.logprob.is_nan() || lp.top.iter().any(|&(t, l)| !in_vocab(t) || l.is_nan()) {
                    return Err("the trailer's logprobs hold a NaN or a token outside the vocabulary".into());
                }
                Ok(())
            }
        }
    }
}

/// What a decode engine reserved for a request whose KV comes from another worker: the
/// facts a hand-off is checked against before anything is allocated for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The reserved blocks, in logical order (they cover the whole prompt).
    pub block_table: Vec<u32>,
    /// Prompt length in tokens.
    pub num_prompt_tokens: usize,
    /// The request's `logprobs` (how many alternatives the first token carries).
    pub logprobs: Option<usize>,
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

    #[test]
    fn trailers_are_checked_against_the_vocabulary_and_the_request() {
        let lp = |token_id, top: Vec<(u32, f32)>| Some(TokenLogprob { token_id, logprob: -0.5, top });
        let t = |first_token, logprobs| TransferTrailer { first_token, logprobs };
        let ok = [
            (t(5, None), None),
            (t(99, None), None),
            (t(5, lp(5, vec![(5, -0.5), (7, -1.0)])), Some(2)),
            (t(5, lp(5, vec![])), Some(0)),
        ];
        for (trailer, want) in ok {
            assert_eq!(trailer.check(100, want), Ok(()), "{trailer:?}");
        }
        let bad = [
            (t(100, None), None, "outside the vocabulary"),
            (t(105, None), None, "outside the vocabulary"),
            (t(u32::MAX, None), None, "outside the vocabulary"),
            (t(5, lp(5, vec![])), None, "did not ask"),
            (t(5, None), Some(1), "lacks"),
            (t(5, lp(6, vec![])), Some(1), "not the first token"),
            (t(5, lp(5, vec![(5, -0.5), (7, -1.0)])), Some(1), "asked for 1"),
            (t(5, lp(5, vec![(5, -0.5); 30])), Some(30), "asked for 30"),
            (t(5, lp(5, vec![(500, -0.5)])), Some(1), "outside the vocabulary"),
            (t(5, lp(5, vec![(5, f32::NAN)])), Some(1), "NaN"),
        ];
        for (trailer, want, why) in bad {
            let err = trailer.check(100, want).expect_err(why);
            assert!(err.contains(why), "{trailer:?}: {err}");
        }
    }
}
