//! What the endpoint picker decides for a whole request: who may ask (API keys and
//! grants), what it asks (the OpenAI request as the frontend understands it: model, LoRA,
//! prompt tokens, limits), where it goes (a route through the replicas, booked under a
//! lease), and what the engine gets (its rank as it takes one).

use crate::directory::{endpoint_of, SharedDirectory};
use crate::exchange::{Pick, RouteAsk};
use kvrouter_client::{KvRouterClient, LeaseCounts, RouteLease};
use kvrouter_openai::{parse, Access, ApiError, Endpoint, Models, RankConvention};
use kvrouter_protocol::ErrorKind;
use std::sync::Arc;

pub struct Picker {
    pub models: Models,
    /// Workers by gateway endpoint, for the gateway's subset hint.
    pub directory: SharedDirectory,
    pub access: Access,
    pub router: KvRouterClient,
    pub ranks: RankConvention,
    pub leases: Arc<LeaseCounts>,
}

impl Picker {
    /// Decides for `ask` under `route_id` (the booking's request id): the pick and the
    /// booking it holds, or the error the client gets.
    pub async fn pick(
        &self,
        ask: RouteAsk,
        route_id: &str,
    ) -> Result<(Pick, RouteLease), ApiError> {
        let grants = self
            .access
            .check(ask.authorization.as_deref().map(str::as_bytes))
            .map_err(|_| ApiError::unauthorized())?;
        let endpoint = match ask
            .path
            .as_deref()
            .map(|p| p.split('?').next().unwrap_or(p))
        {
            Some("/v1/chat/completions") => Endpoint::Chat,
            Some("/v1/completions") => Endpoint::Completions,
            other => {
                return Err(ApiError::not_found(format!(
                    "the endpoint picker routes /v1/chat/completions and /v1/completions, not {}",
                    other.unwrap_or("a request without a path")
                )))
            }
        };
        let req = parse(endpoint, &ask.body, grants)?;
        let understood = self.models.understand(&req).await?;
        let mut route = understood.route_request(&req, route_id)?;
        if let Some(subset) = &ask.subset {
            // Only workers at the endpoints the gateway allows (and the caller's own
            // allowed workers among them).
            let mut allowed = self.directory.read().workers_at(subset);
            if let Some(own) = &route.allowed_workers {
                allowed.retain(|w| own.contains(w));
            }
            if allowed.is_empty() {
                return Err(no_eligible(&format!(
                    "no worker of {} at the gateway's endpoints {subset:?}",
                    understood.model.name()
                )));
            }
            route.allowed_workers = Some(allowed);
        }
        let decision = self.router.route(&route).await.map_err(|e| {
            if ask.subset.is_some() && e.kind() == ErrorKind::NoAllowedWorkers {
                no_eligible(&e.to_string())
            } else {
                ApiError::from_route(e.kind(), e.to_string())
            }
        })?;
        let lease = RouteLease::new(
            self.router.clone(),
            understood.model.name().to_string(),
            route_id.to_string(),
            decision,
            self.leases.clone(),
        );
        let d = &lease.decision;
        let Some(endpoint) = endpoint_of(&d.base_url) else {
            return Err(ApiError::internal(format!(
                "worker {} registered the base URL {:?}, which names no host:port",
                d.worker_id, d.base_url
            )));
        };
        let headers = vec![
            ("x-data-parallel-rank".to_string(), d.dp_rank.to_string()),
            ("x-request-id".to_string(), route_id.to_string()),
        ];
        let body = match self.ranks {
            RankConvention::Vllm => ask.body,
            RankConvention::Sglang => {
                let mut v: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&ask.body)
                        .map_err(|e| ApiError::invalid(None, e.to_string()))?;
                v.insert("data_parallel_rank".into(), d.dp_rank.into());
                serde_json::to_vec(&v)
                    .map_err(|e| ApiError::internal(e.to_string()))?
                    .into()
            }
        };
        Ok((
            Pick {
                endpoints: vec![endpoint],
                headers,
                body,
            },
            lease,
        ))
    }
}

/// 503: nothing the request may go to.
fn no_eligible(why: &str) -> ApiError {
    let mut e = ApiError::overloaded(format!("no eligible endpoint: {why}"));
    e.retry_after = None;
    e
}
