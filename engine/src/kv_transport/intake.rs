//! A decode worker's KV listener loop: accepts hand-offs and receives each on its own task,
//! with bounded work whatever connects.
//!
//! At most [`IntakeLimits::max_connections`] connections are served at once: the loop takes a
//! permit before it accepts, so further connections wait in the kernel's backlog instead of
//! costing a task, buffers or a file descriptor here. A connection must send its handshake
//! within [`IntakeLimits::hello_deadline`] (an honest sender writes it as soon as it
//! connects), so idle connections give their permit back quickly; every later read has the
//! hand-off's deadline. Memory per connection is bounded by the handshake limit
//! ([`super::tcp::MAX_HELLO`]) until the handshake is checked against a reservation, and by
//! that reservation's size after.

use super::handoff::{ImportError, Received, receive_import};
use super::tcp::TcpKvListener;
use crate::EngineHandle;
use crate::kv_connector::Links;
use baton_core::api::RequestId;
use baton_core::cluster_auth::ReservationToken;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How much a KV listener serves at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntakeLimits {
    /// Connections served at once (handshake and transfer); more wait to be accepted.
    pub max_connections: usize,
    /// Longest wait for a new connection's handshake.
    pub hello_deadline: Duration,
}

impl Default for IntakeLimits {
    /// 128 connections: far more hand-offs than a decode worker has in flight at once (each
    /// is one prompt being prefilled for it), few enough that their buffers stay small.
    /// 5 s for the handshake: a sender writes it right after connecting.
    fn default() -> Self {
        Self { max_connections: 128, hello_deadline: Duration::from_secs(5) }
    }
}

/// Serves a KV listener for one engine; see the module docs.
pub struct ImportIntake {
    engine: EngineHandle,
    links: Arc<Links>,
    deadline: Duration,
    limits: IntakeLimits,
    active: AtomicUsize,
    peak: AtomicUsize,
}

/// Counts a connection as served until dropped.
struct Active<'a>(&'a ImportIntake);

impl<'a> Active<'a> {
    fn new(intake: &'a ImportIntake) -> Self {
        let now = intake.active.fetch_add(1, Ordering::SeqCst) + 1;
        intake.peak.fetch_max(now, Ordering::SeqCst);
        Self(intake)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ImportIntake {
    /// An intake storing into `engine` (NCCL links filed in `links`), each hand-off's reads
    /// bounded by `deadline`.
    pub fn new(engine: EngineHandle, links: Arc<Links>, deadline: Duration, limits: IntakeLimits) -> Arc<Self> {
        Arc::new(Self { engine, links, deadline, limits, active: AtomicUsize::new(0), peak: AtomicUsize::new(0) })
    }

    /// Connections being served now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Most connections served at once so far (never above `max_connections`).
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Accepts hand-offs on `listener` forever (the listener's secret, if any, is proved
    /// first), each received on its own task; `admit` resolves a (reservation token, sender)
    /// to the engine request waiting for that KV (see [`receive_import`]) and `on_result`
    /// hears how each connection ended.
    pub async fn serve<A, R>(self: Arc<Self>, listener: TcpKvListener, admit: A, on_result: R)
    where
        A: Fn(&ReservationToken, &str) -> Result<RequestId, String> + Send + Sync + 'static,
        R: Fn(Result<Received, ImportError>) + Send + Sync + 'static,
    {
        let permits = Arc::new(tokio::sync::Semaphore::new(self.limits.max_connections.max(1)));
        let (admit, on_result) = (Arc::new(admit), Arc::new(on_result));
        loop {
            // The semaphore is never closed.
            let Ok(permit) = permits.clone().acquire_owned().await else { return };
            let pending = match listener.accept().await {
                Ok(p) => p.with_hello_deadline(self.limits.hello_deadline),
                Err(e) => {
                    // E.g. out of file descriptors: back off rather than spin.
                    tracing::warn!(error = %e, "KV listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (intake, admit, on_result) = (self.clone(), admit.clone(), on_result.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let _active = Active::new(&intake);
                let admit = |token: &ReservationToken, sender: &str| admit(token, sender);
                let result = receive_import(pending, &intake.engine, &intake.links, intake.deadline, admit).await;
                on_result(result);
            });
        }
    }
}
