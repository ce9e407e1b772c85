//! Admin HTTP (`/healthz`, `/readyz`, `/metrics`): what a replica shows on the shared admin
//! endpoint.

use crate::state::ReplicaShared;
use kvrouter_admin::AdminView;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinHandle;

impl AdminView for ReplicaShared {
    fn readiness(&self) -> (bool, String) {
        ReplicaShared::readiness(self)
    }

    fn metrics(&self) -> String {
        self.refresh_gauges();
        self.metrics.render()
    }
}

/// Binds `addr` and serves until the task is aborted; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    shared: Arc<ReplicaShared>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    kvrouter_admin::serve(addr, shared).await
}
