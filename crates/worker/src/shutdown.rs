//! The shutdown signal, as every task of a worker waits for it.

use tokio::sync::watch;

/// Resolves once the worker is shutting down (or its shutdown sender is gone).
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
