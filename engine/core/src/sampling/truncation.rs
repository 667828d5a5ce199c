//! Steps 7 and 8 of the pipeline for random sampling: processed logits become
//! unnormalised weights (temperature, then top-k, top-p, min-p), and one token is
//! drawn from them by inverse CDF in ascending token-id order.
//!
//! Definitions, for a row `l` of processed logits with maximum `m` at `a` (the
//! lowest such id); every step below works on the weights and keeps `a`:
//!
//! - Temperature `T`: `w_i = exp((l_i - m) / T)` in f32. Shifting by the maximum
//!   first means no weight overflows and `w_a = 1` exactly; this equals
//!   `softmax(l / T)` up to normalisation. The exponential is a polynomial one
//!   (`row_ops::exp_shifted`, within a few ulp of the true value) that flushes
//!   weights below `2^-126` (about 1e-38 of the top token's) to 0.
//! - Rank order: weight descending, then token id ascending.
//! - top_k (`0 < k < vocab`): with `t` the k-th largest weight, tokens with
//!   `w_i < t` get 0. Ties with `t` are kept, as in vLLM.
//! - top_p (`p < 1`): with `W` the sum of the weights left by top-k, a token is
//!   kept iff the mass of the tokens ranked before it is `< p * W`; the first token
//!   is always kept. This is vLLM's rule (drop the tail whose cumulative mass is
//!   `<= 1 - p`). Sums are f64, in an order of the implementation's choosing, so
//!   the rule is exact up to f64 rounding.
//! - min_p (`> 0`): tokens with `w_i < min_p` get 0; as `w_a = 1` is the largest
//!   weight this is "probability below `min_p` times the top probability".
//! - Draw: `S` = sum of the weights, `target = u * S`; the token is the first id,
//!   in ascending order, whose running sum exceeds `target` (zero weights never
//!   match). Sums are f64 and blocked by 64 ids (see `row_ops::inverse_cdf` for the
//!   exact order, which suits a block-wise GPU scan too).
//!
//! A GPU port computes the same quantities; its parallel sums round differently,
//! so it may pick a neighbour only when `u` lands within rounding of a CDF boundary.

use super::row_ops::{self, argmax};
use crate::params::SamplingParams;

/// Below this many candidates, top-p sorts the remaining range instead of partitioning it.
const TOP_P_SORTED_RANGE: usize = 256;

/// Turns a row of processed logits (no NaN, no +inf) into unnormalised sampling
/// weights in place: temperature, then top_k, top_p and min_p, with removed tokens at
/// 0. Returns the processed argmax (lowest id among ties), whose weight is 1, or
/// `None` when every logit is `-inf` (then the row is left untouched).
///
/// A temperature that is not a positive finite number gives a one-hot row at the argmax.
pub fn truncated_weights(row: &mut [f32], params: &SamplingParams) -> Option<usize> {
    let (argmax, max) = argmax(row)?;
    let t = params.temperature;
    if !(t > 0.0 && t.is_finite()) {
        row.fill(0.0);
        row[argmax] = 1.0;
        return Some(argmax);
    }
    row_ops::exp_shifted(row, max, t);
    if params.top_k > 0 && params.top_k < row.len() {
        apply_top_k(row, params.top_k);
    }
    if params.top_p < 1.0 {
        apply_top_p(row, params.top_p);
    }
    if params.min_p > 0.0 {
        // The argmax weighs exactly 1; capping keeps it even for an out-of-range min_p.
        let floor = params.min_p.min(1.0);
        for x in row.iter_mut() {
            if *x < floor {
                *x = 0.0;
            }
        }
    }
    Some(argmax)
}

/// The token drawn from unnormalised `weights` by inverse CDF at `u ∈ [0, 1)`,
/// or `None` when no weight is positive (or their sum is not finite).
pub fn draw_inverse_cdf(weights: &[f32], u: f64) -> Option<usize> {
    row_ops::inverse_cdf(weights, u)
}

/// Zeroes every weight below the k-th largest (`0 < k < row.len()`).
fn apply_top_k(row: &mut [f32], k: usize) {
    let kth = kth_largest(row, k);
    for x in row.iter_mut() {
        if *x < kth {
            *x = 0.0;
        }
    }
}

/// The k-th largest of non-negative weights (`0 < k <= row.len()`).
fn kth_largest(row: &[f32], k: usize) -> f32 {
    // The k-th largest of the block maxima is a lower bound for the k-th largest
    // weight (those k maxima are k distinct entries at least that large), so only
    // entries at or above it can matter; for the usual small k that is a few hundred.
    let block_max: Vec<f32> = row.chunks(row_ops::CDF_BLOCK).map(row_ops::max_value).collect();
    let candidates: Vec<f32> = if k <= block_max.len() {
        let bound = select_desc(&mut bits(&block_max), k);
        row.iter().copied().filter(|&w| w >= bound).collect()
    } else {
        row.to_vec()
    };
    select_desc(&mut bits(&candidates), k)
}

/// Bit patterns of non-negative floats, which order like the values and select faster.
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|w| w.to_bits()).collect()
}

/// The k-th largest of non-negative float bit patterns (`0 < k <= values.len()`).
fn select_desc(values: &mut [u32], k: usize) -> f32 {
    let (_, &mut kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    f32::from_bits(kth)
}

/// A token's place in rank order packed into one integer whose ascending order is
/// rank order: non-negative weights order like their bit patterns, and the id is
/// stored so that lower ids come first among equal weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct RankKey(u64);

impl RankKey {
    fn new(weight: f32, id: u32) -> Self {
        Self(!((u64::from(weight.to_bits()) << 32) | u64::from(u32::MAX - id)))
    }

    fn weight(self) -> f32 {
        f32::from_bits(((!self.0) >> 32) as u32)
    }

    fn id(self) -> u32 {
        u32::MAX - (!self.0) as u32
    }
}

/// Zeroes the tail outside the nucleus of mass `p` (see the module doc for the rule).
fn apply_top_p(row: &mut [f32], p: f32) {
    let total = row_ops::sum_f64(row);
    let target = f64::from(p) * total;
    // Tokens lighter than `floor` are outside the nucleus without looking further: all
    // of them together weigh under `(1 - p) * W / 2`, so the mass ranked before any of
    // them exceeds `p * W`. The argmax (weight 1 >= W / n) is never below it. Dropping
    // them up front leaves only the plausible head of a real model's distribution.
    let nonzero = row.iter().filter(|&&w| w > 0.0).count().max(1);
    let floor = ((1.0 - f64::from(p.max(0.0))) * total / (2 * nonzero) as f64) as f32;
    // Branch-free compaction: a flat row passes a third of its tokens at random, which
    // a filtering branch would mispredict constantly.
    let mut candidates = vec![RankKey(0); row.len()];
    let mut len = 0;
    for (id, &w) in row.iter().enumerate() {
        if let Some(slot) = candidates.get_mut(len) {
            *slot = RankKey::new(w, id as u32);
        }
        len += usize::from(w > 0.0 && w >= floor);
    }
    candidates.truncate(len);
    // Everything from the boundary on in rank order goes: lighter tokens, and tokens of
    // equal weight at or after its id. Without a boundary, only the pre-filtered tail.
    let (cut, cut_id) = match nucleus_boundary(&mut candidates, target) {
        Some(b) => (b.weight(), b.id() as usize),
        None => (floor, usize::MAX),
    };
    for x in row.iter_mut() {
        if *x < cut {
            *x = 0.0;
        }
    }
    for x in row.iter_mut().skip(cut_id) {
        if *x == cut {
            *x = 0.0;
        }
    }
}

/// The f64 mass of some candidates.
fn mass(candidates: &[RankKey]) -> f64 {
    candidates.iter().map(|k| f64::from(k.weight())).sum()
}

/// The first candidate in rank order whose preceding mass is `>= target`, never the
/// first candidate; `None` when the whole list is inside the nucleus.
///
/// A quickselect on mass instead of a sort: each round partitions the open range
/// around its median by rank and keeps the half that holds the boundary, so the cost
/// is linear in the candidates whatever the nucleus size; only the last small range
/// is sorted and walked.
fn nucleus_boundary(candidates: &mut [RankKey], target: f64) -> Option<RankKey> {
    let (mut lo, mut hi) = (0, candidates.len());
    // Mass of the candidates ranked before `candidates[lo]`; all of `[0, lo)` rank
    // before all of `[lo, hi)`, and the boundary is in `[lo, hi)` or absent.
    let mut before = 0.0f64;
    // A candidate already shown to be at or after the boundary, should rounding in the
    // final walk disagree with the partial sums that found it.
    let mut known = None;
    while hi - lo > TOP_P_SORTED_RANGE {
        let mid = lo + (hi - lo) / 2;
        let (left, &mut pivot, _) = candidates[lo..hi].select_nth_unstable(mid - lo);
        let left_mass = mass(left);
        if mid > 0 && before + left_mass >= target {
            known = Some(pivot);
            hi = mid + 1;
        } else {
            before += left_mass;
            lo = mid;
        }
    }
    let range = &mut candidates[lo..hi];
    range.sort_unstable();
    for (j, &key) in range.iter().enumerate() {
        if lo + j > 0 && before >= target {
            return Some(key);
        }
        before += f64::from(key.weight());
    }
    known
}
