//! CPU reference of `kernels/cuda/prompt_logprobs.cu`: the raw log-softmax value and rank of
//! one token of a row of logits, and the row's top entries. The engine's definition is
//! `baton_core::sampling::prompt_logprob`; this crate does not see the engine's types, so the
//! reference returns the kernel's own answer type.
//!
//! Invariants: values are sanitised as read (NaN → -inf, +inf → `f32::MAX`); the top list is
//! ordered by value descending, ties by lower id; an all `-inf` row has `-inf` logprobs.

use super::{KernelError, check};
use crate::cuda::RowLogprob;

fn sanitize(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) }
}

/// The logprob and rank of `target` under `row` and the row's `k` best entries.
pub fn prompt_logprob(row: &[f32], target: u32, k: usize) -> Result<RowLogprob, KernelError> {
    check("prompt_logprob", (target as usize) < row.len(), || format!("target {target} outside {}", row.len()))?;
    let row: Vec<f32> = row.iter().copied().map(sanitize).collect();
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = if max == f32::NEG_INFINITY {
        0.0
    } else {
        row.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32
    };
    let logprob = |x: f32| if max == f32::NEG_INFINITY { f32::NEG_INFINITY } else { (x - max) - log_sum };
    let raw = row[target as usize];
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let top = order.iter().take(k).map(|&id| (id, logprob(row[id as usize]))).collect();
    let above = row.iter().filter(|&&x| x > raw).count();
    Ok(RowLogprob { logprob: logprob(raw), rank: above as u32 + 1, top })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_the_target_and_orders_the_top_by_value_then_id() {
        let row = [1.0, 3.0, f32::NAN, 3.0, 0.5];
        let r = prompt_logprob(&row, 4, 3).expect("in range");
        let sum: f64 = [1.0f64, 3.0, 3.0, 0.5].iter().map(|x| (x - 3.0).exp()).sum();
        assert!((r.logprob as f64 - (0.5 - 3.0 - sum.ln())).abs() < 1e-6);
        assert_eq!(r.rank, 4);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 0]);
        assert!(prompt_logprob(&row, 5, 1).is_err());
        let dead = prompt_logprob(&[f32::NEG_INFINITY; 3], 1, 2).expect("in range");
        assert_eq!((dead.logprob, dead.rank, dead.top[0].0), (f32::NEG_INFINITY, 1, 0));
    }
}
