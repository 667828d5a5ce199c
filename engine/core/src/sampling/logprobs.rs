//! Log-probabilities of the raw model output (vLLM's `raw_logprobs` mode): the
//! log-softmax of the logits before any bias, penalty, temperature or truncation.
//!
//! The row is summarised once, before processing scribbles on it, as its maximum,
//! the log of its shifted exponential sum, and its `k` best entries. The sampled
//! token's logprob is then `raw[token] - max - ln(sum)`.
//!
//! Invariants: the row is sanitised first (no NaN, no +inf); the top list is
//! ordered by logprob descending, ties by lower token id; a row whose entries are
//! all `-inf` has logprob `-inf` everywhere.

use crate::api::PromptLogprob;

/// What is needed to turn any raw logit of one row into its log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct LogSoftmax {
    /// Largest raw logit (`-inf` when every entry is `-inf`).
    max: f32,
    /// `ln(sum_i exp(raw_i - max))`, accumulated in f64 (terms below 1e-38 count as 0).
    log_sum: f32,
}

impl LogSoftmax {
    /// Summarises a sanitised row (no NaN, no +inf).
    pub fn of(row: &[f32]) -> Self {
        let max = super::row_ops::max_value(row);
        if max == f32::NEG_INFINITY {
            return Self { max, log_sum: 0.0 };
        }
        let sum = super::row_ops::sum_exp_shifted(row, max);
        Self { max, log_sum: sum.ln() as f32 }
    }

    /// The log-probability of a raw logit of the summarised row.
    pub fn logprob(&self, raw: f32) -> f32 {
        if self.max == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        // Shifting first keeps a clamped `f32::MAX` maximum from overflowing.
        (raw - self.max) - self.log_sum
    }
}

/// The log-probability and vocabulary rank of `token` under a raw row of logits, with the
/// row's `k` most likely entries (prompt logprobs: no bias, penalty or temperature, as vLLM
/// computes them). The row is sanitised in place first; a token outside the row gets `-inf`
/// and the rank after every entry.
pub fn prompt_logprob(row: &mut [f32], token: u32, k: usize) -> PromptLogprob {
    for x in row.iter_mut() {
        *x = super::sanitize(*x);
    }
    let softmax = LogSoftmax::of(row);
    let raw = row.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let above = row.iter().filter(|&&x| x > raw).count();
    PromptLogprob {
        token_id: token,
        logprob: softmax.logprob(raw),
        rank: u32::try_from(above + 1).unwrap_or(u32::MAX),
        top: top_entries(row, k).into_iter().map(|(id, x)| (id, softmax.logprob(x))).collect(),
    }
}

/// The `k` largest entries of `row` as `(token_id, value)`, largest first, ties by lower id.
/// `k` larger than the row returns the whole row in that order.
pub fn top_entries(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    // A bounded insertion list: k is at most a few dozen, and after the first few
    // thousand entries almost every candidate fails the single comparison with the
    // current worst, so this is one cheap pass over the row.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (id, &x) in row.iter().enumerate() {
        if best.len() == k && best.last().is_some_and(|&(_, worst)| x <= worst) {
            // Equal values rank by lower id, and every id in `best` is lower.
            continue;
        }
        let at = best.partition_point(|&(_, v)| v >= x);
        best.insert(at, (id as u32, x));
        best.truncate(k);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_entries_orders_by_value_then_id() {
        let row = [1.0, 3.0, 3.0, -2.0, 5.0, 3.0];
        assert_eq!(top_entries(&row, 3), vec![(4, 5.0), (1, 3.0), (2, 3.0)]);
        assert_eq!(top_entries(&row, 0), vec![]);
        assert_eq!(top_entries(&row, 10).len(), 6);
        assert_eq!(top_entries(&row, 10)[5], (3, -2.0));
    }

    #[test]
    fn prompt_logprob_is_the_log_softmax_of_the_raw_row() {
        let mut row = vec![1.0, 2.0, f32::NAN, 0.5];
        let lp = prompt_logprob(&mut row, 3, 2);
        assert_eq!(lp.rank, 3, "1.0 and 2.0 are more likely than 0.5");
        let sum: f64 = [1.0f64, 2.0, 0.5].iter().map(|x| x.exp()).sum();
        let want = |x: f64| (x - sum.ln()) as f32;
        assert!((lp.logprob - want(0.5)).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
        assert!((lp.top[0].1 - want(2.0)).abs() < 1e-6);
        assert_eq!(prompt_logprob(&mut row, 9, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(prompt_logprob(&mut row, 0, 0).rank, 2);
    }

    #[test]
    fn all_neg_inf_row_has_neg_inf_logprobs() {
        let row = [f32::NEG_INFINITY; 4];
        let ls = LogSoftmax::of(&row);
        assert_eq!(ls.logprob(row[2]), f32::NEG_INFINITY);
    }

    #[test]
    fn clamped_maximum_does_not_overflow() {
        let row = [f32::MAX, 0.0, f32::MAX];
        let ls = LogSoftmax::of(&row);
        assert!((ls.logprob(f32::MAX) - (-(2f32.ln()))).abs() < 1e-6);
        assert!(ls.logprob(0.0) < -1e38);
    }
}
