//! Whole-row kernels shared by the sampling steps, written so the compiler
//! vectorises them: reductions keep `LANES` independent accumulators over
//! interleaved elements and combine them in a fixed order at the end, and the
//! exponential is a branch-free polynomial instead of a libm call. Results are
//! deterministic, though sums are not bit-equal to a sequential loop.
//!
//! Invariant: inputs contain no NaN (rows are sanitised before any of this runs).

/// Independent accumulators per reduction; 8 f32 or f64 lanes fill AVX registers.
const LANES: usize = 8;

/// Tokens per block of the inverse-CDF walk (see [`inverse_cdf`]).
pub(super) const CDF_BLOCK: usize = 64;

/// `row[i] = exp((row[i] - max) / t)` for a row whose entries are all `<= max`, with
/// `t > 0`: the temperature-scaled, max-shifted weights of step 7.
pub(super) fn exp_shifted(row: &mut [f32], max: f32, t: f32) {
    for x in row.iter_mut() {
        *x = exp_nonpositive((*x - max) / t);
    }
}

/// `e^x` for `x <= 0` (including `-inf`), within a few ulp; results below `2^-126`
/// are flushed to 0, and `e^0` is exactly 1.
///
/// Cody–Waite reduction `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-7 Taylor
/// polynomial for `e^r` (truncation error below 1e-8), and `2^n` built from its bits.
pub(super) fn exp_nonpositive(x: f32) -> f32 {
    // ln 2 split so that `n * LN2_HI` is exact for |n| <= 126 (LN2_HI = 355/512).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to an integer, which then
    // sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // ln(2^-126): below it the result would be subnormal.
    const MIN_X: f32 = -87.336_55;
    let clamped = if x < MIN_X { MIN_X } else { x };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let poly = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // n is in [-126, 0], so the biased exponent n + 127 is a normal one.
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) << 23) as u32);
    if x < MIN_X { 0.0 } else { poly * scale }
}

/// The largest value of a row (`-inf` for an empty row).
pub(super) fn max_value(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a = if x > *a { x } else { *a };
        }
    }
    acc.into_iter().chain(tail.iter().copied()).fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// The first position of the row's maximum and the maximum, or `None` when the row is
/// empty or every entry is `-inf`.
pub(super) fn argmax(row: &[f32]) -> Option<(usize, f32)> {
    let max = max_value(row);
    if max == f32::NEG_INFINITY {
        return None;
    }
    // Find the block holding the first maximum with a branch-free scan, then the entry.
    let block = row.chunks(CDF_BLOCK).position(|b| b.iter().fold(false, |hit, &x| hit | (x == max)))?;
    let start = block * CDF_BLOCK;
    let offset = row.get(start..)?.iter().position(|&x| x == max)?;
    Some((start + offset, max))
}

/// The f64 sum of a row, over `LANES` interleaved partial sums.
pub(super) fn sum_f64(row: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += f64::from(x);
        }
    }
    let lanes = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    tail.iter().fold(lanes, |s, &x| s + f64::from(x))
}

/// `sum_i exp(row[i] - max)` in f64 for a row whose entries are all `<= max`: the
/// normaliser of a log-softmax, over `LANES` interleaved partial sums.
pub(super) fn sum_exp_shifted(row: &[f32], max: f32) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += f64::from(exp_nonpositive(x - max));
        }
    }
    let lanes = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    tail.iter().fold(lanes, |s, &x| s + f64::from(exp_nonpositive(x - max)))
}

/// Inverse CDF over non-negative `weights` in ascending index order: the first index
/// whose running sum exceeds `u * total`, or `None` when no weight is positive or the
/// total is not finite.
///
/// The running sum is blocked: each block of [`CDF_BLOCK`] consecutive weights is
/// summed with [`sum_f64`], `total` is the in-order sum of the block sums, and only the
/// block where the running sum crosses `u * total` is walked one weight at a time. If
/// rounding keeps that walk from crossing, the block's last positive weight is taken.
pub(super) fn inverse_cdf(weights: &[f32], u: f64) -> Option<usize> {
    let block_sums: Vec<f64> = weights.chunks(CDF_BLOCK).map(sum_f64).collect();
    let total: f64 = block_sums.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = u * total;
    let mut before = 0.0f64;
    let mut last_positive_block = None;
    for (b, &s) in block_sums.iter().enumerate() {
        if s > 0.0 {
            last_positive_block = Some(b);
            if before + s > target {
                return pick_in_block(weights, b, before, target);
            }
        }
        before += s;
    }
    // `u * total` rounded up to `total`: the last token with any weight.
    pick_in_block(weights, last_positive_block?, f64::INFINITY, 0.0)
}

/// Walks block `b` from running sum `before` to the first weight that crosses `target`,
/// or its last positive weight if none does.
fn pick_in_block(weights: &[f32], b: usize, mut before: f64, target: f64) -> Option<usize> {
    let start = b * CDF_BLOCK;
    let block = weights.get(start..)?.iter().take(CDF_BLOCK);
    let mut last_positive = None;
    for (offset, &w) in block.enumerate() {
        if w > 0.0 {
            before += f64::from(w);
            if before > target {
                return Some(start + offset);
            }
            last_positive = Some(start + offset);
        }
    }
    last_positive
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic row with a known maximum position.
    fn row(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 1000) as f32 / 100.0 - 5.0).collect()
    }

    #[test]
    fn argmax_and_sum_match_sequential_loops() {
        for n in [1usize, 7, 8, 63, 64, 65, 1000, 4097] {
            let r = row(n, n as u32 * 31);
            let mut best = 0;
            for i in 1..n {
                if r[i] > r[best] {
                    best = i;
                }
            }
            assert_eq!(argmax(&r), Some((best, r[best])), "n {n}");
            let sequential: f64 = r.iter().map(|&x| x as f64).sum();
            assert!((sum_f64(&r) - sequential).abs() < 1e-9 * (1.0 + sequential.abs()), "n {n}");
        }
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 9]), None);
    }

    #[test]
    fn polynomial_exp_is_within_a_few_ulp() {
        let mut worst = 0.0f64;
        for i in 0..=200_000u32 {
            // Covers [-87.3, 0] densely, including the exact end points.
            let x = -87.3f32 * (i as f32 / 200_000.0);
            let exact = (x as f64).exp();
            let rel = ((exp_nonpositive(x) as f64 - exact) / exact).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(-f32::MAX), 0.0);
    }

    #[test]
    fn inverse_cdf_matches_a_sequential_walk() {
        for n in [1usize, 5, 64, 130, 1000] {
            let weights: Vec<f32> = row(n, 7).iter().map(|&x| if x < 0.0 { 0.0 } else { x }).collect();
            let total: f64 = weights.iter().map(|&w| w as f64).sum();
            for k in 0..50 {
                let u = (k as f64 + 0.37) / 50.0;
                let mut cumulative = 0.0;
                let expected = weights.iter().position(|&w| {
                    cumulative += w as f64;
                    w > 0.0 && cumulative > u * total
                });
                assert_eq!(inverse_cdf(&weights, u), expected, "n {n} u {u}");
            }
        }
    }
}
