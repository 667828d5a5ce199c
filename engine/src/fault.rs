//! Deliberate failures of one model step, for the liveness and recovery tests (the hidden
//! `--chaos-engine-fault` flag of the `baton` binary; never set when serving).
//!
//! [`FaultInjection`] names what happens and at which forward pass (counting every forward
//! the engine runs, from 1); [`FaultyModel`] wraps the real model and does it there, once.
//! Every other call goes to the real model unchanged.

use crate::backend::{BackendError, BatchLayout};
use crate::engine_loop::StepModel;
use baton_core::sampling::{Sampled, SamplingContext};
use std::time::Duration;

/// What the faulty step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// It panics.
    Panic,
    /// It blocks this long, then runs (a hung device that comes back).
    Stall(Duration),
    /// It fails with a recoverable backend error.
    Error,
    /// It fails with a fatal device error (the device's context is lost).
    Fatal,
}

/// One injected fault: `kind` at the `at_forward`-th forward pass (from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultInjection {
    /// What happens.
    pub kind: FaultKind,
    /// Which forward pass it happens at.
    pub at_forward: u64,
}

/// A fault spec that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fault '{0}': expected panic@N, stall=MS@N, error@N or fatal@N (N counts forward passes from 1)")]
pub struct ParseFaultError(pub String);

impl std::str::FromStr for FaultInjection {
    type Err = ParseFaultError;

    /// `panic@3`, `stall=2000@1` (milliseconds), `error@2`, `fatal@1`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseFaultError(s.to_owned());
        let (what, at) = s.trim().split_once('@').ok_or_else(bad)?;
        let at_forward: u64 = at.parse().ok().filter(|&n| n > 0).ok_or_else(bad)?;
        let kind = match what {
            "panic" => FaultKind::Panic,
            "error" => FaultKind::Error,
            "fatal" => FaultKind::Fatal,
            other => {
                let ms = other.strip_prefix("stall=").and_then(|ms| ms.parse().ok()).ok_or_else(bad)?;
                FaultKind::Stall(Duration::from_millis(ms))
            }
        };
        Ok(Self { kind, at_forward })
    }
}

/// The real model with one fault injected.
pub(crate) struct FaultyModel {
    inner: Box<dyn StepModel>,
    fault: FaultInjection,
    forwards: u64,
}

impl FaultyModel {
    pub fn new(inner: Box<dyn StepModel>, fault: FaultInjection) -> Self {
        Self { inner, fault, forwards: 0 }
    }
}

impl StepModel for FaultyModel {
    fn forward(
        &mut self,
        batch: &BatchLayout,
        after_layer: Option<&mut crate::runner::AfterLayer<'_>>,
    ) -> Result<(), BackendError> {
        self.forwards += 1;
        if self.forwards == self.fault.at_forward {
            tracing::warn!(fault = ?self.fault, "injecting a fault into this forward pass");
            match self.fault.kind {
                FaultKind::Panic => panic!("injected fault: the model step panics"),
                FaultKind::Stall(d) => std::thread::sleep(d),
                FaultKind::Error => return Err(BackendError::Device("injected fault: a recoverable error".into())),
                FaultKind::Fatal => return Err(BackendError::DeviceLost("injected fault: the device is lost".into())),
            }
        }
        self.inner.forward(batch, after_layer)
    }

    fn take_prompt_logprobs(&mut self) -> Vec<baton_core::api::PromptLogprob> {
        self.inner.take_prompt_logprobs()
    }

    fn sample_launch(&mut self, rows: &[(usize, SamplingContext<'_>)]) -> Result<(), BackendError> {
        self.inner.sample_launch(rows)
    }

    fn sample_collect(&mut self) -> Result<Vec<Sampled>, BackendError> {
        self.inner.sample_collect()
    }

    fn kv_access(&mut self) -> &mut dyn crate::kv_connector::KvAccess {
        self.inner.kv_access()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fault_specs() {
        let f = |s: &str| s.parse::<FaultInjection>();
        assert_eq!(f("panic@3"), Ok(FaultInjection { kind: FaultKind::Panic, at_forward: 3 }));
        assert_eq!(
            f("stall=2500@1"),
            Ok(FaultInjection { kind: FaultKind::Stall(Duration::from_millis(2500)), at_forward: 1 })
        );
        assert_eq!(f("error@2"), Ok(FaultInjection { kind: FaultKind::Error, at_forward: 2 }));
        assert_eq!(f("fatal@1"), Ok(FaultInjection { kind: FaultKind::Fatal, at_forward: 1 }));
        for bad in ["panic", "panic@0", "panic@x", "stall@1", "stall=x@1", "boom@1", ""] {
            assert!(f(bad).is_err(), "{bad}");
        }
    }
}
