//! The request arrival process.
//!
//! Gaps between arrivals are drawn from a gamma distribution with shape
//! `burstiness` and scale `1 / (rate · burstiness)`, as `vllm bench serve`
//! does: the mean gap is always `1 / rate`, and the coefficient of variation is
//! `1 / sqrt(burstiness)` (1 for a Poisson process). An infinite rate puts
//! every arrival at time zero. The schedule depends only on its inputs, so a
//! fixed seed reproduces it exactly.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};

use crate::config::Rate;
use crate::error::LoadtestError;

/// An endless iterator of arrival offsets in seconds from the start of the run,
/// non-decreasing, the first one being the first gap after zero.
#[derive(Debug, Clone)]
pub struct ArrivalSchedule {
    gaps: Option<Gamma<f64>>,
    rng: StdRng,
    now_s: f64,
}

impl ArrivalSchedule {
    /// A schedule for `rate` requests per second with the given burstiness.
    pub fn new(rate: Rate, burstiness: f64, seed: u64) -> Result<Self, LoadtestError> {
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(LoadtestError::Config("--burstiness must be a positive number".into()));
        }
        let gaps = if rate.is_infinite() {
            None
        } else {
            let scale = 1.0 / (rate.value() * burstiness);
            Some(
                Gamma::new(burstiness, scale)
                    .map_err(|e| LoadtestError::Config(format!("arrival distribution: {e}")))?,
            )
        };
        Ok(Self {
            gaps,
            // A different stream from the prompts' RNG so that changing the
            // rate does not change the prompts.
            rng: StdRng::seed_from_u64(seed ^ 0xA5A5_5A5A_0F0F_F0F0),
            now_s: 0.0,
        })
    }
}

impl Iterator for ArrivalSchedule {
    type Item = f64;

    fn next(&mut self) -> Option<f64> {
        if let Some(gaps) = &self.gaps {
            self.now_s += gaps.sample(&mut self.rng);
        }
        Some(self.now_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(rate: f64, burstiness: f64, seed: u64, n: usize) -> Vec<f64> {
        let rate = Rate::per_second(rate).expect("positive rate");
        let times: Vec<f64> = ArrivalSchedule::new(rate, burstiness, seed).expect("valid schedule").take(n).collect();
        let mut prev = 0.0;
        times
            .into_iter()
            .map(|t| {
                let g = t - prev;
                prev = t;
                g
            })
            .collect()
    }

    fn mean_and_cv(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt() / mean)
    }

    /// For n gamma gaps with CV c (shape 1/c², excess kurtosis 6c²), the sample
    /// mean has relative standard error c/√n and the sample standard deviation
    /// about ½·√((2 + 6c²)/n). Both are bounded at 6 standard errors.
    #[test]
    fn mean_rate_and_cv_match_request() {
        let n = 20_000;
        for (rate, burstiness) in [(10.0, 1.0), (50.0, 0.25), (4.0, 4.0)] {
            let (mean, cv) = mean_and_cv(&gaps(rate, burstiness, 7, n));
            let want_cv = 1.0 / f64::sqrt(burstiness);
            let mean_tol = 6.0 * want_cv / (n as f64).sqrt();
            assert!(
                (mean * rate - 1.0).abs() < mean_tol,
                "rate {rate} b {burstiness}: mean gap {mean}, want {}",
                1.0 / rate
            );
            let cv_tol = want_cv * (mean_tol + 3.0 * ((2.0 + 6.0 * want_cv * want_cv) / n as f64).sqrt());
            assert!((cv - want_cv).abs() < cv_tol, "rate {rate} b {burstiness}: cv {cv}, want {want_cv} ± {cv_tol}");
        }
    }

    #[test]
    fn same_seed_same_schedule_other_seed_differs() {
        assert_eq!(gaps(5.0, 1.0, 1, 100), gaps(5.0, 1.0, 1, 100));
        assert_ne!(gaps(5.0, 1.0, 1, 100), gaps(5.0, 1.0, 2, 100));
    }

    #[test]
    fn infinite_rate_sends_everything_at_zero() {
        let times: Vec<f64> = ArrivalSchedule::new(Rate::INFINITE, 1.0, 0).expect("valid schedule").take(5).collect();
        assert_eq!(times, vec![0.0; 5]);
    }

    #[test]
    fn bad_burstiness_is_rejected() {
        assert!(ArrivalSchedule::new(Rate::INFINITE, 0.0, 0).is_err());
        assert!(ArrivalSchedule::new(Rate::INFINITE, f64::NAN, 0).is_err());
    }
}
