//! Whether the engine thread is alive and making progress: what `/health` and a worker's
//! heartbeat report ([`EngineHealth`]).
//!
//! The engine thread beats ([`Liveness::beat`]) at the start of every iteration of its loop
//! and says when it goes idle (blocks waiting for a command); a thread that is busy and has
//! not beaten for longer than the stall timeout is stalled (a step or a device that hangs),
//! and becomes healthy again if the step ever returns. The thread's end is recorded once, at
//! its boundary: a panic (caught there), a fatal backend error (reported by the loop before
//! it stops), or a shutdown. Readers never wait for the engine thread: progress is an atomic,
//! and the end's reason a lock taken only to write it once or read it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the engine's health is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    /// Idle, or busy and making progress.
    Healthy,
    /// One iteration of the loop (a step) has been running longer than the stall timeout.
    Stalled {
        /// How long it has been running.
        busy_for: Duration,
    },
    /// The engine thread panicked (the message); it is gone.
    Panicked(String),
    /// A fatal backend error (the device's context is lost); the engine stopped and the
    /// process should exit so its supervisor restarts it.
    Fatal(String),
    /// The engine was shut down.
    Stopped,
}

impl EngineHealth {
    /// Only [`EngineHealth::Healthy`] serves.
    pub fn is_healthy(&self) -> bool {
        matches!(self, EngineHealth::Healthy)
    }
}

impl std::fmt::Display for EngineHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineHealth::Healthy => write!(f, "healthy"),
            EngineHealth::Stalled { busy_for } => {
                write!(f, "the engine is stalled: one step has run for {:.1} s", busy_for.as_secs_f64())
            }
            EngineHealth::Panicked(m) => write!(f, "the engine thread panicked: {m}"),
            EngineHealth::Fatal(m) => write!(f, "the engine hit a fatal device error: {m}"),
            EngineHealth::Stopped => write!(f, "the engine was shut down"),
        }
    }
}

/// The engine thread's progress, shared with its handles.
#[derive(Debug)]
pub(crate) struct Liveness {
    epoch: Instant,
    /// Milliseconds from `epoch` to the last beat, plus one; 0 while idle.
    busy_since: AtomicU64,
    stall_timeout: Duration,
    ended: AtomicBool,
    end: Mutex<Option<EngineHealth>>,
}

impl Liveness {
    /// A live thread, idle, stalled after `stall_timeout` without a beat.
    pub fn new(stall_timeout: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            busy_since: AtomicU64::new(0),
            stall_timeout,
            ended: AtomicBool::new(false),
            end: Mutex::new(None),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// The thread made progress and is busy.
    pub fn beat(&self) {
        self.busy_since.store(self.now_ms() + 1, Ordering::Relaxed);
    }

    /// The thread is about to wait for a command (waiting is not a stall).
    pub fn idle(&self) {
        self.busy_since.store(0, Ordering::Relaxed);
    }

    /// Records how the thread ended; the first end recorded wins (a fatal error is followed by
    /// the loop's normal exit, which must not hide it).
    pub fn end(&self, how: EngineHealth) {
        if let Ok(mut e) = self.end.lock()
            && e.is_none()
        {
            *e = Some(how);
        }
        self.ended.store(true, Ordering::SeqCst);
    }

    /// The health now.
    pub fn health(&self) -> EngineHealth {
        if self.ended.load(Ordering::SeqCst) {
            return self
                .end
                .lock()
                .ok()
                .and_then(|e| e.clone())
                .unwrap_or_else(|| EngineHealth::Panicked("unknown".into()));
        }
        let since = self.busy_since.load(Ordering::Relaxed);
        if since == 0 {
            return EngineHealth::Healthy;
        }
        let busy_for = Duration::from_millis(self.now_ms().saturating_sub(since - 1));
        if busy_for > self.stall_timeout { EngineHealth::Stalled { busy_for } } else { EngineHealth::Healthy }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_without_beats_stalls_and_recovers_with_one() {
        let l = Liveness::new(Duration::from_millis(30));
        assert_eq!(l.health(), EngineHealth::Healthy);
        l.beat();
        assert_eq!(l.health(), EngineHealth::Healthy);
        std::thread::sleep(Duration::from_millis(60));
        assert!(matches!(l.health(), EngineHealth::Stalled { busy_for } if busy_for >= Duration::from_millis(30)));
        l.beat();
        assert_eq!(l.health(), EngineHealth::Healthy);
        std::thread::sleep(Duration::from_millis(60));
        l.idle();
        assert_eq!(l.health(), EngineHealth::Healthy, "waiting for work is not a stall");
    }

    #[test]
    fn the_first_end_wins() {
        let l = Liveness::new(Duration::from_secs(60));
        l.end(EngineHealth::Fatal("illegal address".into()));
        l.end(EngineHealth::Stopped);
        assert_eq!(l.health(), EngineHealth::Fatal("illegal address".into()));
        assert!(!l.health().is_healthy());
        assert!(l.health().to_string().contains("illegal address"));
    }
}
