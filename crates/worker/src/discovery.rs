//! A worker's side of discovery: registrations (at start, on every roll call, on a change),
//! heartbeats, and rank liveness.

use crate::info::WorkerInfo;
use crate::publish::publish_msg;
use crate::shutdown::stopped;
use kvrouter_bus::{Bus, Subscription};
use kvrouter_protocol::{DpRank, ModelSubjects};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Publishes a worker's registration and a heartbeat (its live ranks) at once.
pub async fn announce(bus: &Bus, subjects: &ModelSubjects, info: &WorkerInfo) {
    publish_msg(
        bus,
        &subjects.register(info.worker_id),
        &info.registration(),
    )
    .await;
    publish_msg(bus, &subjects.heartbeat(info.worker_id), &info.heartbeat()).await;
}

/// Takes rank `index` of a worker in or out of service and, if that changed it, announces it
/// at once.
pub async fn set_rank_live(
    bus: &Bus,
    subjects: &ModelSubjects,
    info: &WorkerInfo,
    index: usize,
    live: bool,
) {
    if info.set_live(index, live) {
        let dp_rank = info.dp_start_rank + index as DpRank;
        tracing::info!(
            worker_id = info.worker_id,
            dp_rank,
            live,
            "rank liveness changed"
        );
        announce(bus, subjects, info).await;
    }
}

/// Heartbeats for every worker, and registrations at once on every `WhoIsThere` (`who` is
/// the subscription to the model's roll-call subject).
pub async fn discovery_task(
    bus: Bus,
    subjects: ModelSubjects,
    workers: Vec<Arc<WorkerInfo>>,
    mut who: Subscription,
    heartbeat_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + heartbeat_interval,
        heartbeat_interval,
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => break,
            msg = who.next() => {
                let Some(msg) = msg else { break };
                // Any payload counts as a roll call; a malformed one is only logged.
                if let Err(e) = kvrouter_protocol::decode::<kvrouter_protocol::WhoIsThere>(&msg.payload) {
                    tracing::debug!(error = %e, "malformed WhoIsThere; answering anyway");
                }
                for w in &workers {
                    publish_msg(&bus, &subjects.register(w.worker_id), &w.registration()).await;
                }
            }
            _ = tick.tick() => {
                for w in &workers {
                    publish_msg(&bus, &subjects.heartbeat(w.worker_id), &w.heartbeat()).await;
                }
            }
        }
    }
}
