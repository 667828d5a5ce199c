//! The CUDA backend's sampler on the device ([`DeviceSampler`]): a step's row plans turned into
//! the sampling kernels' terms, launched behind the step's logits and collected as the
//! sampler's results (bit-exact weights, `baton_core::sampling`'s pipeline; see sampling.cu).

use super::CudaBackend;
use crate::backend::{BackendError, DeviceSampler};
use baton_core::api::TokenLogprob;
use baton_core::sampling::{RowPlan, Sampled, TokenOp, TokenOpKind};
use baton_kernels::cuda::{
    DeviceMask, DeviceOp, DeviceOpKind, DeviceRow, DeviceSample, SAMPLE_MAX_TOP, SAMPLE_MAX_VOCAB,
};

/// Logit row `logit_row` sampled with `plan` (whose ops, converted by [`device_ops`], are
/// `ops`), in the kernel crate's terms. Public for the GPU tests.
pub fn device_row<'a>(logit_row: usize, plan: &'a RowPlan, ops: &'a [DeviceOp]) -> DeviceRow<'a> {
    DeviceRow {
        logit_row,
        ops,
        greedy: plan.greedy,
        temperature: plan.temperature,
        top_k: plan.top_k,
        top_p: plan.top_p,
        min_p: plan.min_p,
        logprobs: plan.logprobs,
        u: plan.u,
        allowed: plan.allowed.as_ref().map(|m| DeviceMask { words: m.words(), len: m.len() }),
    }
}

/// The kernel's answer as the sampler's result (logprobs only when the plan asked).
pub fn sampled(pick: DeviceSample, plan: &RowPlan) -> Sampled {
    with_logprobs(pick, plan.logprobs)
}

fn with_logprobs(pick: DeviceSample, logprobs: Option<usize>) -> Sampled {
    Sampled {
        token_id: pick.token,
        logprobs: logprobs.map(|_| TokenLogprob { token_id: pick.token, logprob: pick.logprob, top: pick.top }),
    }
}

/// A plan's ops in the kernel crate's terms.
pub fn device_ops(ops: &[TokenOp]) -> Vec<DeviceOp> {
    ops.iter()
        .map(|op| {
            let (kind, value) = match op.kind {
                TokenOpKind::Bias(b) => (DeviceOpKind::Bias, b),
                TokenOpKind::Mask => (DeviceOpKind::Mask, 0.0),
                TokenOpKind::Repetition(r) => (DeviceOpKind::Repetition, r),
                TokenOpKind::Subtract(s) => (DeviceOpKind::Subtract, s),
            };
            DeviceOp { id: op.id, kind, value }
        })
        .collect()
}

impl DeviceSampler for CudaBackend {
    fn can_sample_on_device(&self, vocab: usize, plan: &RowPlan) -> bool {
        (1..=SAMPLE_MAX_VOCAB).contains(&vocab) && plan.logprobs.is_none_or(|k| k <= SAMPLE_MAX_TOP)
    }

    fn launch_device_sample(&mut self, rows: &[(usize, &RowPlan)]) -> Result<(), BackendError> {
        let (have, vocab) = self.logit_shape;
        let ops: Vec<Vec<DeviceOp>> = rows.iter().map(|(_, plan)| device_ops(&plan.ops)).collect();
        let dev_rows: Vec<DeviceRow<'_>> =
            rows.iter().zip(&ops).map(|(&(logit_row, plan), ops)| device_row(logit_row, plan, ops)).collect();
        self.sample_logprobs.clear();
        self.dev.sample_rows_launch(&mut self.logits, have, vocab, &dev_rows, &mut self.sample_bufs)?;
        self.sample_logprobs.extend(rows.iter().map(|(_, plan)| plan.logprobs));
        Ok(())
    }

    fn collect_device_sample(&mut self) -> Result<Vec<Sampled>, BackendError> {
        let picks = self.dev.sample_rows_collect(&mut self.sample_bufs)?;
        Ok(picks.into_iter().zip(self.sample_logprobs.drain(..)).map(|(p, lp)| with_logprobs(p, lp)).collect())
    }
}
