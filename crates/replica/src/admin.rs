//! Admin HTTP (`/healthz`, `/readyz`, `/metrics`, `/debug/rank`, and the JSON API under
//! `/v1/`): what a replica shows on the shared admin endpoint. With `--http-tokens-file` or
//! `--http-token`, the API and `/debug/rank` (it shows cached block hashes) need a bearer
//! token with the right scope; the admin endpoint checks it (`HttpLimits::auth`).

use crate::http_api;
use crate::state::ReplicaShared;
use kvrouter_admin::{query_param, AdminView, ApiPage, ApiRequest, DebugPage, Scope};
use kvrouter_protocol::{KvEventData, WorkerKey};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinHandle;

impl AdminView for ReplicaShared {
    fn readiness(&self) -> (bool, String) {
        ReplicaShared::readiness(self)
    }

    fn metrics(&self) -> String {
        self.refresh_gauges();
        let listeners = self.http_stats.lock().clone();
        kvrouter_admin::append_http_stats(self.metrics.render(), "kvrouter", &listeners)
    }

    /// The JSON API for peer routers (see [`http_api`]).
    fn api(self: Arc<Self>, req: ApiRequest) -> Option<ApiPage> {
        http_api::handle(self, req)
    }

    /// Route phases are timed unless switched off here (to measure what the timing costs).
    fn phase_switch(&self) -> Option<&kvrouter_admin::phase_timing::PhaseSwitch> {
        Some(&self.metrics.phase_switch)
    }

    /// `route` for routing and the worker list, `lease` for acting on routed requests.
    fn api_scope(&self, path: &str) -> Option<Scope> {
        http_api::scope(path)
    }

    /// A route body with the longest prompt accepted fits.
    fn max_body_bytes(&self) -> usize {
        http_api::max_body_bytes(self.max_prompt_tokens)
    }

    /// `/debug/rank?model=M&worker=W&dp_rank=R`: what this replica's index holds for one
    /// rank, as `{"last_event_id", "blocks": [[engine_hash, parent_engine_hash, local_hash,
    /// tier]]}` (blocks a removed ancestor cut off from the root match nothing and are left
    /// out).
    fn debug(self: Arc<Self>, path: String, query: String) -> Option<DebugPage> {
        if path != "rank" {
            return None;
        }
        Some(Box::pin(async move {
            let bad = |why: &str| (400, serde_json::json!({ "error": why }).to_string());
            let Some(model) = query_param(&query, "model").map(|m| m.replace("%2F", "/")) else {
                return bad("model= is required");
            };
            let (Some(worker), Some(rank)) = (
                query_param(&query, "worker").and_then(|w| w.parse().ok()),
                query_param(&query, "dp_rank").and_then(|r| r.parse().ok()),
            ) else {
                return bad("worker= and dp_rank= are required (numbers)");
            };
            let Some(m) = self.models.get(&model) else {
                return (
                    404,
                    serde_json::json!({ "error": "unknown model" }).to_string(),
                );
            };
            let dump = m
                .sharded
                .dump(WorkerKey::new(worker, rank))
                .await
                .ok()
                .flatten();
            let (last, events) = dump.map_or((None, Vec::new()), |d| (d.last_event_id, d.events));
            let mut blocks = Vec::new();
            for e in events {
                if let KvEventData::Stored {
                    parent,
                    blocks: stored,
                } = e.data
                {
                    let mut p = parent.map(|p| p.0);
                    for b in stored {
                        blocks.push(serde_json::json!([
                            b.engine_hash.0,
                            p,
                            b.local_hash.0,
                            e.tier.as_str()
                        ]));
                        p = Some(b.engine_hash.0);
                    }
                }
            }
            let body = serde_json::json!({ "last_event_id": last, "blocks": blocks });
            (200, body.to_string())
        }))
    }
}

/// Binds `addr` and serves until the task is aborted; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    limits: kvrouter_admin::HttpLimits,
    shared: Arc<ReplicaShared>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let (local, stats, task) = kvrouter_admin::serve(addr, limits, shared.clone()).await?;
    shared.http_stats.lock().push((local, stats));
    Ok((local, task))
}
