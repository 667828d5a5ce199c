//! The sampler's counter-based random source: one uniform number per
//! `(seed, position)`, with no state carried between calls.
//!
//! Being a pure function of its key is the whole point: a sequence's draws do
//! not depend on which other sequences share its batch, on the order rows are
//! processed, or on whether the sequence was preempted and recomputed. A GPU
//! kernel computes the same value with a handful of 64-bit integer operations.
//! [`random_bits`] documents the exact formula.

/// SplitMix64's state increment (the 64-bit golden ratio).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The 64 random bits for `(seed, position)`: output number `position` (0-based) of
/// a SplitMix64 stream whose state starts at `seed`; [`uniform`] scales the top 53:
///
/// ```text
/// z = seed + (position + 1) * 0x9E3779B97F4A7C15            (wrapping u64)
/// z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9                  (wrapping)
/// z = (z ^ (z >> 27)) * 0x94D049BB133111EB                  (wrapping)
/// z =  z ^ (z >> 31)
/// uniform = (z >> 11) * 2^-53                               (exact in f64, in [0, 1))
/// ```
pub fn random_bits(seed: u64, position: u64) -> u64 {
    let mut z = seed.wrapping_add(position.wrapping_add(1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in `[0, 1)` for `(seed, position)`, with 53 random bits.
pub fn uniform(seed: u64, position: u64) -> f64 {
    // 2^-53: every value (z >> 11) * 2^-53 is exactly representable and below 1.
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    (random_bits(seed, position) >> 11) as f64 * SCALE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain sequential SplitMix64, written independently of the counter form.
    struct SplitMix64(u64);

    impl SplitMix64 {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(GAMMA);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    #[test]
    fn counter_form_equals_the_sequential_stream() {
        for seed in [0u64, 1, 42, 0xdead_beef_cafe_f00d, u64::MAX] {
            let mut stream = SplitMix64(seed);
            for position in 0..1000u64 {
                assert_eq!(random_bits(seed, position), stream.next(), "seed {seed} position {position}");
            }
        }
    }

    #[test]
    fn known_splitmix64_vector() {
        // The first outputs of SplitMix64 seeded with 1234567, as published with the
        // reference C implementation (Vigna, prng.di.unimi.it).
        assert_eq!(random_bits(1_234_567, 0), 6_457_827_717_110_365_317);
        assert_eq!(random_bits(1_234_567, 1), 3_203_168_211_198_807_973);
    }

    #[test]
    fn uniform_is_in_range_and_roughly_uniform() {
        let n = 200_000u64;
        let mut buckets = [0u32; 10];
        let mut sum = 0.0;
        for position in 0..n {
            let u = uniform(7, position);
            assert!((0.0..1.0).contains(&u), "{u}");
            buckets[(u * 10.0) as usize] += 1;
            sum += u;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        // Chi-square with 9 degrees of freedom; 27.9 is the 0.001 critical value.
        let expected = n as f64 / 10.0;
        let chi2: f64 = buckets.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum();
        assert!(chi2 < 27.9, "chi2 {chi2}, buckets {buckets:?}");
    }
}
