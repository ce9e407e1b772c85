//! The fleet's shutdown signal, as every task waits for it.

use tokio::sync::watch;

/// Resolves once the fleet is shutting down (or the fleet handle is gone).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
