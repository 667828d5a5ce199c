//! CPU-heavy text work (tokenizing, chat templating, detokenizing whole prompts) off the
//! async runtime.
//!
//! Tokenizing an 8 MiB prompt takes seconds. Run on a runtime thread, a few of those stall
//! every stream, heartbeat and health check sharing the thread. [`Offload`] runs such work on
//! tokio's blocking pool instead, at most `max_concurrent` jobs at once; further callers wait
//! (asynchronously) for a slot.
//!
//! Invariants: a slot is held by the blocking job itself, not by the future awaiting it, so a
//! client that goes away mid-job does not free its slot before the CPU is actually free; the
//! number of CPU-heavy jobs running never exceeds the bound. The queue is bounded too
//! ([`MAX_QUEUED_PER_SLOT`] per slot): past it a job is refused at once as
//! [`FrontendError::Busy`] (429) rather than piling up requests and their bodies in memory.

use crate::error::FrontendError;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Semaphore;

/// Jobs that may wait for a slot, per slot.
pub const MAX_QUEUED_PER_SLOT: usize = 64;

/// A bounded gateway to the blocking pool.
#[derive(Debug, Clone)]
pub struct Offload {
    slots: Arc<Semaphore>,
    max_concurrent: usize,
    queued: Arc<AtomicUsize>,
    max_queued: usize,
}

/// Counts a job waiting for a slot while it exists.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Offload {
    /// At most `max_concurrent` (at least 1) jobs at once, and [`MAX_QUEUED_PER_SLOT`] per
    /// slot waiting.
    pub fn new(max_concurrent: usize) -> Self {
        let max_concurrent = max_concurrent.max(1);
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            queued: Arc::default(),
            max_queued: max_concurrent * MAX_QUEUED_PER_SLOT,
        }
    }

    /// Half the machine's cores (at least one): the rest stay free for the runtime, the
    /// engine threads of a co-located worker, and everything else.
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self::new(cores / 2)
    }

    /// The bound.
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent
    }

    /// Slots free right now.
    pub fn available(&self) -> usize {
        self.slots.available_permits()
    }

    /// Runs `job` on the blocking pool once a slot is free and returns its result; refuses it
    /// ([`FrontendError::Busy`]) when the queue is full.
    pub async fn run<T, F>(&self, job: F) -> Result<T, FrontendError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let queued = self.queued.fetch_add(1, Ordering::SeqCst);
        let waiting = Queued(&self.queued);
        if queued >= self.max_queued {
            return Err(FrontendError::Busy(format!(
                "{queued} prompts are waiting to be tokenized (the limit is {})",
                self.max_queued
            )));
        }
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| FrontendError::Internal("the text worker pool is closed".into()))?;
        drop(waiting);
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            job()
        })
        .await
        .map_err(|e| FrontendError::Internal(format!("a text job failed: {e}")))
    }
}

impl Default for Offload {
    fn default() -> Self {
        Self::for_this_machine()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test(flavor = "current_thread")]
    async fn jobs_run_off_the_runtime_and_never_exceed_the_bound() {
        let pool = Offload::new(2);
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let runtime_thread = std::thread::current().id();
        let jobs = (0..6).map(|i| {
            let (pool, running, peak) = (pool.clone(), running.clone(), peak.clone());
            async move {
                pool.run(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(30));
                    running.fetch_sub(1, Ordering::SeqCst);
                    (i, std::thread::current().id())
                })
                .await
            }
        });
        // A ticker on the (single) runtime thread keeps running while the jobs block.
        let ticks = Arc::new(AtomicUsize::new(0));
        let ticker = {
            let ticks = ticks.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    ticks.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let results = futures::future::join_all(jobs).await;
        ticker.abort();
        for (i, r) in results.into_iter().enumerate() {
            let (j, thread) = r.expect("job ran");
            assert_eq!(i, j);
            assert_ne!(thread, runtime_thread, "job {i} ran on the runtime thread");
        }
        assert_eq!(peak.load(Ordering::SeqCst), 2, "at most 2 at once");
        // 6 jobs × 30 ms, 2 at a time: ~90 ms, during which the runtime ticked freely.
        assert!(ticks.load(Ordering::SeqCst) >= 5, "the runtime stalled: {} ticks", ticks.load(Ordering::SeqCst));
        assert_eq!(pool.available(), 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_queue_refuses_at_once() {
        let pool = Offload::new(1);
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let busy = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(move || wait.recv().is_ok()).await })
        };
        // Let the first job take the slot, then fill the queue behind it.
        while pool.available() > 0 {
            tokio::task::yield_now().await;
        }
        let queued: Vec<_> = (0..MAX_QUEUED_PER_SLOT)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.run(|| true).await })
            })
            .collect();
        while pool.queued.load(Ordering::SeqCst) < MAX_QUEUED_PER_SLOT {
            tokio::task::yield_now().await;
        }
        let refused = pool.run(|| true).await.expect_err("the queue is full");
        assert!(refused.is_refusal(), "{refused:?}");
        release.send(()).expect("release");
        assert!(busy.await.expect("join").expect("ran"));
        for q in queued {
            assert!(q.await.expect("join").expect("ran"));
        }
        assert_eq!(pool.queued.load(Ordering::SeqCst), 0);
        assert!(pool.run(|| true).await.expect("room again"));
    }
}
