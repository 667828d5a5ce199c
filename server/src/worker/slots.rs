//! The worker's cap on open Worker-service streams (`--max-inflight`): each `Generate`,
//! `Decode` or `Prefill` stream holds one slot while it is open; past the cap a new call is
//! refused at once (`RESOURCE_EXHAUSTED`) instead of queueing without bound.
//!
//! Invariant: a [`StreamSlot`] gives its slot back when dropped, whichever path its stream
//! ended by, so [`StreamSlots::open`] returns to zero once every stream is gone.

use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// One open stream's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct StreamSlot {
    // Held, never read: its drop is what frees the slot.
    _permit: OwnedSemaphorePermit,
}

/// The worker's stream slots.
#[derive(Debug)]
pub struct StreamSlots {
    free: Arc<Semaphore>,
    max: usize,
}

/// No slot is free.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{max} streams are open on this worker, its limit (--max-inflight)")]
pub struct AllSlotsTaken {
    /// The cap.
    pub max: usize,
}

impl StreamSlots {
    /// `max` slots, all free (a semaphore holds at most `Semaphore::MAX_PERMITS`).
    pub fn new(max: usize) -> Self {
        let max = max.min(Semaphore::MAX_PERMITS);
        Self { free: Arc::new(Semaphore::new(max)), max }
    }

    /// Takes a slot, or says that none is free.
    pub fn try_take(&self) -> Result<StreamSlot, AllSlotsTaken> {
        match self.free.clone().try_acquire_owned() {
            Ok(permit) => Ok(StreamSlot { _permit: permit }),
            // The semaphore is never closed; a closed one would have nothing to give either.
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => Err(AllSlotsTaken { max: self.max }),
        }
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        self.max - self.free.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_and_come_back_when_dropped() {
        let slots = StreamSlots::new(2);
        let a = slots.try_take().expect("first");
        let b = slots.try_take().expect("second");
        assert_eq!(slots.open(), 2);
        let err = slots.try_take().expect_err("over the cap");
        assert_eq!(err, AllSlotsTaken { max: 2 });
        assert!(err.to_string().contains("--max-inflight"), "{err}");
        drop(a);
        assert_eq!(slots.open(), 1);
        let c = slots.try_take().expect("a freed slot");
        drop((b, c));
        assert_eq!(slots.open(), 0);
        assert!(StreamSlots::new(0).try_take().is_err(), "a cap of zero admits nothing");
    }
}
