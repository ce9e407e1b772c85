//! The route gate: a replica joins the router queue group only once it can route well.
//!
//! NATS queue groups know nothing of Kubernetes readiness: a replica that subscribed to
//! `route` at start would take its share of routes while it still knew no worker, and
//! answer them `no_workers` (or route them on a half-fetched index). So the queue-group
//! endpoints (route, overlap_scores, potential_loads, route_disagg) are subscribed by a
//! gatekeeper once every model is routable (discovery window over, every known rank synced,
//! any approximate index loaded), or after a bound with a warning, so that one stuck rank
//! cannot keep the replica out of service. `/readyz` turns ready only then.

use crate::state::ReplicaShared;
use kvrouter_bus::Subscription;
use kvrouter_protocol::subjects::ROUTER_QUEUE_GROUP;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Queue-group subscriptions to make when the gate opens.
#[derive(Default)]
pub struct RouteGate {
    pending: Vec<(String, oneshot::Sender<Subscription>)>,
}

impl RouteGate {
    /// A subscription to `subject` in the router queue group, handed over when the gate
    /// opens (the sender is dropped if subscribing fails).
    pub fn subscribe_later(&mut self, subject: String) -> oneshot::Receiver<Subscription> {
        let (tx, rx) = oneshot::channel();
        self.pending.push((subject, tx));
        rx
    }

    /// Opens the gate once every model is routable, or after `bound`.
    pub fn spawn(self, shared: Arc<ReplicaShared>, bound: Duration) -> JoinHandle<()> {
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + bound;
            loop {
                let waiting = shared.models_waiting();
                if waiting.is_empty() {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(
                        waiting = %waiting.join("; "),
                        bound_ms = bound.as_millis() as u64,
                        "taking routes before every model is ready (routes to ranks not yet synced see no overlap there)"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            for (subject, tx) in self.pending {
                match shared
                    .bus
                    .queue_subscribe(&subject, ROUTER_QUEUE_GROUP)
                    .await
                {
                    Ok(sub) => {
                        let _ = tx.send(sub);
                    }
                    Err(e) => {
                        tracing::error!(%subject, error = %e, "cannot subscribe a route endpoint")
                    }
                }
            }
            if let Err(e) = shared.bus.flush().await {
                tracing::warn!(error = %e, "cannot flush the route subscriptions");
            }
            shared.routes_open.store(true, Ordering::Relaxed);
            tracing::info!("taking routes");
        })
    }
}
