//! Leaving the bus in bounded time, whatever the bus does (NATS may be down).

use crate::info::WorkerInfo;
use kvrouter_bus::Bus;
use kvrouter_protocol::{Deregistration, ModelSubjects, WorkerId};
use std::time::Duration;
use tokio::time::Instant;

/// Publishes each worker's `Deregistration` and flushes, all within `budget`. On failure,
/// says what was left undone (the routers then drop those workers when their lease ends).
pub async fn deregister_within(
    bus: &Bus,
    subjects: &ModelSubjects,
    workers: &[&WorkerInfo],
    budget: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + budget;
    let mut queued: Vec<WorkerId> = Vec::new();
    let mut unsent = Vec::new();
    let mut why = None;
    let mut undone = Vec::new();
    for w in workers {
        let msg = Deregistration {
            worker_id: w.worker_id,
            instance_id: w.instance_id(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let sent = match kvrouter_protocol::encode(&msg) {
            Ok(b) => bus
                .publish_within(
                    &subjects.deregister(w.worker_id),
                    bytes::Bytes::from(b),
                    left,
                )
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match sent {
            Ok(()) => queued.push(w.worker_id),
            Err(e) => {
                unsent.push(w.worker_id);
                why.get_or_insert(e);
            }
        }
    }
    if !unsent.is_empty() {
        let why = why.unwrap_or_default();
        tracing::warn!(workers = ?unsent, error = %why, "cannot deregister");
        undone.push(format!("workers {unsent:?} not deregistered ({why})"));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    match bus.flush_within(left).await {
        Ok(()) => {
            for worker_id in &queued {
                tracing::info!(worker_id, "worker deregistered");
            }
        }
        Err(e) if !queued.is_empty() => {
            tracing::warn!(
                workers = ?queued,
                error = %e,
                "deregistrations may not have reached NATS; the routers drop these \
                 workers when their lease runs out"
            );
            undone.push(format!(
                "deregistration of workers {queued:?} not confirmed ({e})"
            ));
        }
        Err(_) => {}
    }
    if undone.is_empty() {
        Ok(())
    } else {
        Err(undone.join("; "))
    }
}
