//! How the servers stop: waiting for a termination signal, and the stop flag their graceful
//! shutdown waits on. Shared by `serve`, `router` and `worker`.

use tokio::sync::watch;

/// Resolves when `stop` flips to true or its sender is gone: the graceful-shutdown future of
/// a server.
pub async fn shutdown_signal(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
pub async fn wait_for_termination() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
