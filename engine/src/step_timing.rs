//! Where the engine thread's time goes, step by step: working on the host, or waiting for
//! the device's answers. Plain counters, published by the engine thread with its stats and
//! read through `EngineHandle::step_timing` (by `bench_throughput`; not yet on /metrics).

use std::time::Duration;

/// Cumulative step counters of one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// Forward steps launched.
    pub steps: u64,
    /// Of those, steps planned while the step before them was still running
    /// ([`crate::EngineConfig::async_scheduling`]).
    pub planned_ahead: u64,
    /// Time the engine thread spent in steps other than waiting for sampled tokens:
    /// scheduling, enqueueing the forward and the sampling, applying tokens, sending outputs
    /// (for a backend that computes on the host, the forward itself).
    pub host: Duration,
    /// Time the engine thread waited for the sampled tokens of a step.
    pub wait: Duration,
    /// Grammar masks computed (one per constrained row per step; part of `host`).
    pub grammar_masks: u64,
    /// Time spent computing them (wall time of each step's batch of masks).
    pub grammar_time: Duration,
}

impl StepTiming {
    /// Mean host time per step, in milliseconds (0 before the first step).
    pub fn host_ms_per_step(&self) -> f64 {
        per_step_ms(self.host, self.steps)
    }

    /// Mean wait per step, in milliseconds (0 before the first step).
    pub fn wait_ms_per_step(&self) -> f64 {
        per_step_ms(self.wait, self.steps)
    }

    /// Counters accumulated since `earlier` (a snapshot of the same engine).
    pub fn since(&self, earlier: &StepTiming) -> StepTiming {
        StepTiming {
            steps: self.steps.saturating_sub(earlier.steps),
            planned_ahead: self.planned_ahead.saturating_sub(earlier.planned_ahead),
            host: self.host.saturating_sub(earlier.host),
            wait: self.wait.saturating_sub(earlier.wait),
            grammar_masks: self.grammar_masks.saturating_sub(earlier.grammar_masks),
            grammar_time: self.grammar_time.saturating_sub(earlier.grammar_time),
        }
    }
}

fn per_step_ms(d: Duration, steps: u64) -> f64 {
    if steps == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / steps as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_and_differences() {
        let a = StepTiming {
            steps: 4,
            planned_ahead: 1,
            host: Duration::from_millis(2),
            wait: Duration::from_millis(8),
            ..Default::default()
        };
        assert_eq!((a.host_ms_per_step(), a.wait_ms_per_step()), (0.5, 2.0));
        let b = StepTiming {
            steps: 10,
            planned_ahead: 5,
            host: Duration::from_millis(5),
            wait: Duration::from_millis(20),
            ..Default::default()
        };
        let d = b.since(&a);
        assert_eq!(
            (d.steps, d.planned_ahead, d.host, d.wait),
            (6, 4, Duration::from_millis(3), Duration::from_millis(12))
        );
        assert_eq!(StepTiming::default().host_ms_per_step(), 0.0);
    }
}
