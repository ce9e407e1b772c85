//! What the endpoint picker decides for a whole request: who may ask (API keys and
//! grants), what it asks (the OpenAI request as the frontend understands it: model, LoRA,
//! prompt tokens, limits), where it goes (a route through the replicas, booked under a
//! lease), and what the engine gets (its rank as it takes one).

use crate::directory::{endpoint_of, AtEndpoint, SharedDirectory};
use crate::exchange::{Pick, RouteAsk};
use kvrouter_client::{KvRouterClient, LeaseCounts, RouteLease};
use kvrouter_openai::door_metrics::CachePrediction;
use kvrouter_openai::{
    parse, Access, ApiError, DoorClock, DoorPhase, Endpoint, Models, RankConvention,
};
use kvrouter_otlp::{Span, SpanKind, Tracer};
use kvrouter_protocol::{ErrorKind, Pin, RouteRequest, TraceContext, TRACEPARENT};
use std::sync::Arc;

pub struct Picker {
    pub models: Models,
    /// Workers by gateway endpoint: the subset hint, fallbacks and the endpoint that served.
    pub directory: SharedDirectory,
    pub access: Access,
    pub router: KvRouterClient,
    pub ranks: RankConvention,
    pub leases: Arc<LeaseCounts>,
    /// Endpoints to answer after the pick, for the gateway to retry on (`--fallbacks`).
    pub fallbacks: u8,
    /// Starts pick spans (off without `--otlp-traces-endpoint`).
    pub tracer: Tracer,
}

/// A booking, and what it takes to move it to the worker that served instead.
pub struct Booking {
    pub lease: RouteLease,
    /// The route that booked it.
    route: RouteRequest,
    /// The rank the engine was told to serve on, if any (the fallbacks serve it too).
    rank: Option<u32>,
}

impl Booking {
    /// The served model's name.
    pub fn model(&self) -> &str {
        &self.route.model
    }

    /// The cached prefix the router predicted where the booking is now.
    pub fn prediction(&self) -> CachePrediction {
        CachePrediction::of(&self.lease.decision, self.route.tokens.len())
    }
}

impl Picker {
    /// Decides for `ask` under `route_id` (the booking's request id): the pick and the
    /// booking it holds, or the error the client gets. `clock` times its phases.
    ///
    /// The pick is a span of the client's trace (its `traceparent`), the parent of the
    /// replica's route span; when it records, the engine's `traceparent` names it too.
    pub async fn pick(
        &self,
        ask: RouteAsk,
        route_id: &str,
        clock: &mut DoorClock,
    ) -> Result<(Pick, Booking), ApiError> {
        let parent = (ask.traceparent.as_deref()).and_then(|t| TraceContext::parse(t).ok());
        let mut span = self
            .tracer
            .span("kvrouter.epp.pick", SpanKind::Server, parent);
        let picked = self.pick_traced(ask, route_id, clock, &mut span).await;
        if let Err(e) = &picked {
            span.fail(e.message.clone());
        }
        picked
    }

    async fn pick_traced(
        &self,
        ask: RouteAsk,
        route_id: &str,
        clock: &mut DoorClock,
        span: &mut Span,
    ) -> Result<(Pick, Booking), ApiError> {
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
        clock.lap(DoorPhase::Parse);
        let understood = self.models.understand(&req, clock).await?;
        let mut route = understood
            .route_request(&req, route_id)?
            .with_fallbacks(self.fallbacks)
            .with_trace(span.context());
        span.set("kvrouter.model", understood.model.name().to_string());
        span.set("kvrouter.prompt_tokens", route.tokens.len());
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
        let decision = self
            .router
            .route(&route)
            .await
            .map_err(|e| refusal(e.kind(), e.to_string(), ask.subset.is_some()))?;
        clock.lap(DoorPhase::Route);
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
        let (endpoints, rank) = {
            let dir = self.directory.read();
            // An engine of one rank needs no instruction (and a fallback of several ranks
            // then balances the request itself); told a rank, a fallback must serve it too.
            let rank = (dir.rank_count(d.worker_id) != Some(1)).then_some(d.dp_rank);
            let mut endpoints = vec![endpoint];
            for f in &d.fallbacks {
                let Some(e) = endpoint_of(&f.base_url) else {
                    continue;
                };
                if !endpoints.contains(&e) && rank.is_none_or(|r| dir.serves_rank(f.worker_id, r)) {
                    endpoints.push(e);
                }
            }
            (endpoints, rank)
        };
        span.set("kvrouter.replica_id", d.replica_id.clone());
        span.set("kvrouter.worker_id", d.worker_id);
        span.set("kvrouter.dp_rank", d.dp_rank);
        span.set("kvrouter.overlap_blocks.device", d.overlap_blocks);
        span.set("kvrouter.fallbacks", endpoints.len() - 1);
        let mut headers = vec![("x-request-id".to_string(), route_id.to_string())];
        // The engine's own spans nest under the pick when the picker exports (otherwise
        // the client's traceparent reaches the engine through the gateway unchanged).
        if let Some(ctx) = span.context().filter(|_| span.is_recording()) {
            headers.push((TRACEPARENT.to_string(), ctx.to_string()));
        }
        let body = match (self.ranks, rank) {
            (_, None) => ask.body,
            (RankConvention::Vllm, Some(r)) => {
                headers.push(("x-data-parallel-rank".to_string(), r.to_string()));
                ask.body
            }
            (RankConvention::Sglang, Some(r)) => {
                let mut v: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&ask.body)
                        .map_err(|e| ApiError::invalid(None, e.to_string()))?;
                v.insert("data_parallel_rank".into(), r.into());
                serde_json::to_vec(&v)
                    .map_err(|e| ApiError::internal(e.to_string()))?
                    .into()
            }
        };
        Ok((
            Pick {
                endpoints,
                headers,
                body,
            },
            Booking { lease, route, rank },
        ))
    }

    /// The gateway served the request at `served`, not where it was booked (it fell back):
    /// the booking moves to the worker there (pinned, booked afresh under a new id, the old
    /// one freed). A `served` no single worker answers at frees the booking, since its load
    /// is nowhere this picker can name.
    pub async fn rebook(&self, served: &str, booking: Booking) -> Option<Booking> {
        let worker = match self.directory.read().worker_at(served) {
            AtEndpoint::One(w) => w,
            other => {
                tracing::warn!(served, at = ?other, booked = booking.lease.decision.worker_id, "the gateway served the request at an endpoint no single worker registered: its booking ends");
                booking.lease.free();
                return None;
            }
        };
        if worker == booking.lease.decision.worker_id {
            return Some(booking);
        }
        let id = kvrouter_client::new_request_id();
        let route = booking
            .route
            .clone()
            .booked(id.clone())
            .with_fallbacks(0)
            .with_allowed_workers(None)
            .with_excluded_workers(Vec::new())
            .with_pin(Some(Pin {
                worker_id: worker,
                dp_rank: booking.rank,
            }));
        booking.lease.free();
        match self.router.route(&route).await {
            Ok(decision) => {
                tracing::info!(served, worker, "booking moved to the worker that served");
                Some(Booking {
                    lease: RouteLease::new(
                        self.router.clone(),
                        route.model.clone(),
                        id,
                        decision,
                        self.leases.clone(),
                    ),
                    route,
                    rank: booking.rank,
                })
            }
            Err(e) => {
                tracing::warn!(served, worker, error = %e, "the booking could not move to the worker that served");
                None
            }
        }
    }
}

/// What the client gets when the router refuses a route: shed (a replica's queue full or
/// waited out) is the Inference Extension's 429, no worker at all a 503, and so on as the
/// frontend answers.
fn refusal(kind: ErrorKind, message: String, subset: bool) -> ApiError {
    match kind {
        ErrorKind::NoAllowedWorkers if subset => no_eligible(&message),
        ErrorKind::Overloaded | ErrorKind::QueueTimeout => ApiError::shed(message),
        kind => ApiError::from_route(kind, message),
    }
}

/// 503: nothing the request may go to.
fn no_eligible(why: &str) -> ApiError {
    let mut e = ApiError::overloaded(format!("no eligible endpoint: {why}"));
    e.retry_after = None;
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shed_is_429_and_no_capacity_503() {
        let status = |k, subset| refusal(k, "x".into(), subset).status;
        assert_eq!(status(ErrorKind::Overloaded, false), 429);
        assert_eq!(status(ErrorKind::QueueTimeout, false), 429);
        assert_eq!(
            refusal(ErrorKind::Overloaded, "x".into(), false).retry_after,
            Some(1)
        );
        assert_eq!(status(ErrorKind::NoWorkers, false), 503);
        assert_eq!(status(ErrorKind::Unavailable, false), 503);
        assert_eq!(status(ErrorKind::NoAllowedWorkers, true), 503);
        assert_eq!(status(ErrorKind::NoAllowedWorkers, false), 400);
        assert_eq!(status(ErrorKind::UnknownModel, false), 404);
    }
}
