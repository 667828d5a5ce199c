//! The engine's health at the process edge (`serve` and `worker`): changes are logged, and a
//! fatal engine error ends the process with [`ENGINE_FATAL_EXIT_CODE`] so its supervisor
//! restarts it on a fresh device context. A panicked or stalled engine does not end the
//! process: `/health` answers 503 and a worker's heartbeat says unhealthy (the router stops
//! sending it work), and the operator or a liveness probe decides what to do.

use baton_engine::{EngineHandle, EngineHealth};
use std::time::Duration;

/// Exit status after a fatal engine error (`EX_SOFTWARE`), distinct from a crash's.
pub const ENGINE_FATAL_EXIT_CODE: i32 = 70;

/// How often the health is read; the fatal exit and the log lines lag by at most this.
const POLL: Duration = Duration::from_millis(200);

/// Watches `engine` until the process ends.
pub async fn watch(engine: EngineHandle) {
    let mut last = EngineHealth::Healthy;
    let mut tick = tokio::time::interval(POLL);
    loop {
        tick.tick().await;
        let now = engine.health();
        if let EngineHealth::Fatal(reason) = &now {
            tracing::error!(
                %reason,
                exit_code = ENGINE_FATAL_EXIT_CODE,
                "FATAL: the engine lost its device; exiting so the supervisor restarts this process"
            );
            std::process::exit(ENGINE_FATAL_EXIT_CODE);
        }
        if std::mem::discriminant(&now) != std::mem::discriminant(&last) {
            match &now {
                EngineHealth::Healthy => tracing::info!("the engine is healthy again"),
                EngineHealth::Stopped => tracing::info!("the engine stopped"),
                other => tracing::error!(health = %other, "the engine is unhealthy; /health answers 503"),
            }
        }
        last = now;
    }
}
