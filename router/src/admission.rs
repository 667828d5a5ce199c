//! Admission control: how much engine work the frontend accepts at once.
//!
//! Two limits, both checked before anything is tokenized or submitted:
//! - **per request**: prompts × `n` engine sequences (a completions request with 5,000
//!   prompts and `n = 128` is refused as a 400, not turned into 640,000 tasks);
//! - **in flight**: engine sequences admitted and not yet finished, across every client and
//!   both edges (HTTP and gRPC). Over it a request is refused at once (429 with
//!   `Retry-After`, or `RESOURCE_EXHAUSTED`) instead of queueing without bound.
//!
//! Invariants: a [`Permit`] holds exactly the sequences it counts and gives them back when
//! dropped, so the in-flight count is the number of live permits' sequences and returns to
//! zero once every request has finished or gone away, whichever path it took. Admission is
//! all or nothing: a request gets permits for all of its sequences or for none.

use crate::error::FrontendError;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Default router-wide cap on engine sequences in flight (`--max-inflight`).
pub const DEFAULT_MAX_INFLIGHT: usize = 4096;

/// Default cap on prompts × `n` of one request: half the default in-flight cap, so one
/// request can never take the whole router, and 16 × vLLM's largest `n` (128).
pub const DEFAULT_MAX_SEQUENCES_PER_REQUEST: usize = 2048;

/// The two limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Engine sequences in flight across all requests.
    pub max_inflight: usize,
    /// Engine sequences (prompts × `n`) of one request.
    pub max_sequences_per_request: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self { max_inflight: DEFAULT_MAX_INFLIGHT, max_sequences_per_request: DEFAULT_MAX_SEQUENCES_PER_REQUEST }
    }
}

/// The shared in-flight counter.
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    inflight: AtomicUsize,
}

impl Admission {
    /// A gate with nothing in flight.
    pub fn new(limits: AdmissionLimits) -> Arc<Self> {
        Arc::new(Self { limits, inflight: AtomicUsize::new(0) })
    }

    /// The limits it enforces.
    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// Engine sequences admitted and not finished.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Admits a request of `prompts` prompts with `n` choices each, or says why not: a 400
    /// naming `prompt` (several prompts) or `n` when the request alone is over the
    /// per-request cap, [`FrontendError::Busy`] when it does not fit beside the work in flight.
    pub fn admit(self: &Arc<Self>, prompts: usize, n: usize) -> Result<Permit, FrontendError> {
        let sequences = self.check_size(prompts, n)?;
        self.try_acquire(sequences)
    }

    /// The per-request cap of [`Admission::admit`] alone (nothing is acquired): the request's
    /// sequences (`prompts` × `n`), or a 400 naming `prompt` (several prompts) or `n`.
    pub fn check_size(&self, prompts: usize, n: usize) -> Result<usize, FrontendError> {
        let sequences = prompts.saturating_mul(n);
        let max = self.limits.max_sequences_per_request;
        if sequences > max {
            let param = if prompts > 1 { "prompt" } else { "n" };
            return Err(FrontendError::invalid(
                param,
                format!(
                    "this request asks for {prompts} prompt(s) × n = {n}, {sequences} sequences in all; at most {max} are accepted per request: send fewer prompts or a smaller n"
                ),
            ));
        }
        Ok(sequences)
    }

    /// Takes `count` sequences of the in-flight budget, all or nothing.
    pub fn try_acquire(self: &Arc<Self>, count: usize) -> Result<Permit, FrontendError> {
        let max = self.limits.max_inflight;
        let update = self.inflight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
            now.checked_add(count).filter(|&after| after <= max)
        });
        match update {
            Ok(_) => Ok(Permit { gate: self.clone(), count }),
            Err(now) => Err(FrontendError::Busy(format!(
                "{now} sequences are in flight and this request needs {count} more (the limit is {max})"
            ))),
        }
    }
}

/// Sequences of the in-flight budget held by one request (or one of its choices).
#[derive(Debug)]
pub struct Permit {
    gate: Arc<Admission>,
    count: usize,
}

impl Permit {
    /// Sequences it holds.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Moves `count` of its sequences (at most all) into a new permit.
    pub fn split(&mut self, count: usize) -> Permit {
        let count = count.min(self.count);
        self.count -= count;
        Permit { gate: self.gate.clone(), count }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.count > 0 {
            self.gate.inflight.fetch_sub(self.count, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(max_inflight: usize, per_request: usize) -> Arc<Admission> {
        Admission::new(AdmissionLimits { max_inflight, max_sequences_per_request: per_request })
    }

    #[test]
    fn permits_count_in_flight_sequences_until_dropped() {
        let g = gate(10, 8);
        let mut a = g.admit(2, 3).expect("6 fit");
        assert_eq!((g.inflight(), a.count()), (6, 6));
        let one = a.split(1);
        assert_eq!((a.count(), one.count(), g.inflight()), (5, 1, 6));
        // 6 + 5 > 10: refused whole, nothing taken.
        let err = g.admit(1, 5).expect_err("over the in-flight cap");
        assert!(matches!(&err, FrontendError::Busy(m) if m.contains("10")), "{err:?}");
        assert!(err.is_refusal());
        assert_eq!(g.inflight(), 6);
        drop(one);
        assert_eq!(g.inflight(), 5);
        drop(a);
        assert_eq!(g.inflight(), 0);
        let all = g.try_acquire(10).expect("exactly the cap");
        assert!(g.try_acquire(1).is_err());
        drop(all);
        assert_eq!(g.inflight(), 0);
    }

    #[test]
    fn oversized_requests_are_client_errors_naming_the_field() {
        let g = gate(100_000, 2048);
        let err = g.admit(5000, 128).expect_err("640,000 sequences");
        assert_eq!(err.param(), Some("prompt"));
        assert!(err.is_client_error());
        assert!(err.to_string().contains("640000") && err.to_string().contains("2048"), "{err}");
        let err = g.admit(1, 4096).expect_err("n alone");
        assert_eq!(err.param(), Some("n"));
        assert_eq!(g.inflight(), 0, "a refused request holds nothing");
        assert!(g.admit(16, 128).is_ok(), "exactly the per-request cap");
        // Overflowing products are refused, not wrapped.
        assert!(g.admit(usize::MAX, 2).is_err());
    }
}
