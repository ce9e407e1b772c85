//! The JSON API for peer routers, on the admin listener (or `--http-addr`): `POST
//! /v1/route`, `POST /v1/requests/{id}/prefill_done`, `.../free` and `.../output_block`
//! (forwarded over the bus to the replica that routed the request), `GET /v1/workers`. Routes take the same
//! path as the bus endpoint ([`endpoints::route`]), with no bus hop. See docs/protocol.md,
//! "JSON API for peer routers".

mod errors;
mod json;

use crate::endpoints::{self, Endpoint};
use crate::route_phases::{RouteClock, RoutePhase};
use crate::scheduler_actor::SchedulerMsg;
use crate::state::{ModelShared, ReplicaShared};
use bytes::Bytes;
use errors::ApiError;
use json::{RouteAnswer, RouteBody, UpdateBody, WorkersAnswer};
use kvrouter_admin::{
    percent_decode, query_param, ApiPage, ApiRequest, ApiResponse, Method, Scope,
};
use kvrouter_bus::BusError;
use kvrouter_protocol::limits::{check_len, check_model, MAX_REPLICA_ID_BYTES};
use kvrouter_protocol::{
    check_tracked_request_id, decode, encode, ErrorKind, Lease, OutputBlock, Reply, RequestUpdate,
    TraceContext,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long a forwarded `prefill_done`, `free` or `output_block` waits for the replica that routed it.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest request body: a route body with the longest prompt accepted (a token is at
/// most 11 bytes of JSON, `4294967295,`) and 64 KiB for the rest.
pub fn max_body_bytes(max_prompt_tokens: usize) -> usize {
    max_prompt_tokens
        .saturating_mul(11)
        .saturating_add(64 * 1024)
}

/// What a path under `/v1/` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Route,
    /// `mark_prefill`, `free` or `output_block`, with the request id as it appears in the
    /// path.
    Update(Endpoint, String),
    Workers,
}

impl Call {
    /// `None` for a path that is no endpoint (404).
    fn of(path: &str) -> Option<Self> {
        match path {
            "/v1/route" => Some(Self::Route),
            "/v1/workers" => Some(Self::Workers),
            _ => {
                let rest = path.strip_prefix("/v1/requests/")?;
                let (id, action) = rest.rsplit_once('/')?;
                let endpoint = match action {
                    "prefill_done" => Endpoint::MarkPrefill,
                    "free" => Endpoint::Free,
                    "output_block" => Endpoint::OutputBlock,
                    _ => return None,
                };
                Some(Self::Update(endpoint, id.to_string()))
            }
        }
    }

    fn method(&self) -> Method {
        match self {
            Self::Workers => Method::GET,
            _ => Method::POST,
        }
    }

    /// What a caller's credentials must allow (docs/operations.md, "Who may call the HTTP
    /// doors"): routing and reading the fleet, or acting on routed requests.
    fn scope(&self) -> Scope {
        match self {
            Self::Route | Self::Workers => Scope::Route,
            Self::Update(..) => Scope::Lease,
        }
    }
}

/// The scope an API path needs; `None` for a path that is no endpoint. Checked by the
/// admin endpoint before the body is read.
pub fn scope(path: &str) -> Option<Scope> {
    Call::of(path).map(|c| c.scope())
}

/// The answer to one API request; `None` for a path that is no endpoint.
pub fn handle(shared: Arc<ReplicaShared>, req: ApiRequest) -> Option<ApiPage> {
    let call = Call::of(&req.path)?;
    Some(Box::pin(async move {
        let method = call.method();
        if req.method != method && !(method == Method::GET && req.method == Method::HEAD) {
            return ApiError::invalid(format!("{} takes {method} only", req.path))
                .with_status(405)
                .response()
                .with_header("allow", method.as_str());
        }
        let result = match call {
            Call::Route => route(&shared, &req.body, req.traceparent.as_deref()).await,
            Call::Update(endpoint, id) => update(&shared, endpoint, &id, &req.body).await,
            Call::Workers => workers(&shared, &req.query).await,
        };
        match result {
            Ok(body) => ApiResponse::json(200, body),
            Err(e) => e.response(),
        }
    }))
}

/// Counts a refusal found here (the route path counts its own) and passes it on.
fn refused(shared: &ReplicaShared, model: &str, e: ApiError) -> ApiError {
    shared.metrics.error(model, e.kind);
    tracing::debug!(model, kind = %e.kind, message = %e.message, "HTTP API request refused");
    e
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, ApiError> {
    serde_json::to_string(v).map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
}

/// A route by JSON; a valid `traceparent` header makes it a span of the caller's trace.
async fn route(
    shared: &ReplicaShared,
    body: &[u8],
    traceparent: Option<&str>,
) -> Result<String, ApiError> {
    // Counted from here, so a shutdown waits for this answer.
    let _inflight = shared.inflight.enter();
    let mut clock: RouteClock = shared.metrics.phase_switch.clock();
    let body: RouteBody = json::parse(body).map_err(|e| refused(shared, "", e))?;
    if let Err(e) = check_model(&body.model) {
        return Err(refused(shared, "", ApiError::invalid(e.to_string())));
    }
    let model = body.model.clone();
    if shared.draining.load(Ordering::Relaxed) {
        return Err(refused(
            shared,
            &model,
            ApiError::new(
                ErrorKind::Unavailable,
                "the replica is shutting down; retry on another replica",
            ),
        ));
    }
    let req = body
        .into_request(|| uuid::Uuid::new_v4().simple().to_string())
        .map_err(|e| refused(shared, &model, e))?
        .with_trace(traceparent.and_then(|t| TraceContext::parse(t).ok()));
    let request_id = req.request_id.clone();
    clock.lap(RoutePhase::Decode);
    let started = Instant::now();
    let result = endpoints::route(shared, shared.max_prompt_tokens, req, &mut clock).await;
    endpoints::observe_route(shared, &result, started);
    let (model, decision) = result?;
    clock.skip();
    let answer = to_json(&RouteAnswer::new(decision, &request_id));
    clock.lap(RoutePhase::Encode);
    endpoints::record_phases(shared, &model, &clock);
    answer
}

async fn update(
    shared: &ReplicaShared,
    endpoint: Endpoint,
    raw_id: &str,
    body: &[u8],
) -> Result<String, ApiError> {
    let request_id = percent_decode(raw_id)
        .filter(|id| !id.is_empty())
        .ok_or_else(|| {
            refused(
                shared,
                "",
                ApiError::invalid(format!(
                    "request id {raw_id:?} in the path is empty or not UTF-8 once percent-decoded"
                )),
            )
        })?;
    if let Err(e) = check_tracked_request_id(&request_id) {
        return Err(refused(shared, "", ApiError::invalid(e.to_string())));
    }
    let body: UpdateBody = json::parse(body).map_err(|e| refused(shared, "", e))?;
    if let Err(e) = check_model(&body.model) {
        return Err(refused(shared, "", ApiError::invalid(e.to_string())));
    }
    let model = body.model.clone();
    if body.decay_fraction.is_some() && endpoint != Endpoint::OutputBlock {
        return Err(refused(
            shared,
            &model,
            ApiError::invalid("decay_fraction belongs to output_block only"),
        ));
    }
    let lease = match body.lease.as_deref() {
        Some(hex) => json::parse_lease(hex).map_err(|e| refused(shared, &model, e))?,
        None => Lease::NONE,
    };
    let other = body.replica_id.filter(|other| *other != shared.replica_id);
    let internal = |e: String| ApiError::new(ErrorKind::Internal, e);
    if endpoint == Endpoint::OutputBlock {
        let block = OutputBlock {
            model: body.model,
            request_id,
            decay_fraction: body.decay_fraction,
            lease,
        };
        match other {
            Some(other) => {
                let payload = encode(&block).map_err(|e| internal(e.to_string()))?;
                forward(shared, endpoint, &other, payload)
                    .await
                    .map_err(|e| refused(shared, &model, e))?;
            }
            None => endpoints::output_block(shared, block).await?,
        }
    } else {
        let update = RequestUpdate {
            model: body.model,
            request_id,
            lease,
        };
        match other {
            Some(other) => {
                let payload = encode(&update).map_err(|e| internal(e.to_string()))?;
                forward(shared, endpoint, &other, payload)
                    .await
                    .map_err(|e| refused(shared, &model, e))?;
            }
            None => endpoints::update(shared, endpoint, update).await?,
        }
    }
    Ok(r#"{"ok":true}"#.into())
}

/// Sends an update to the replica that routed the request, over the bus.
async fn forward(
    shared: &ReplicaShared,
    endpoint: Endpoint,
    replica_id: &str,
    payload: Vec<u8>,
) -> Result<(), ApiError> {
    if let Err(e) = check_len("replica_id", replica_id, MAX_REPLICA_ID_BYTES) {
        return Err(ApiError::invalid(e.to_string()));
    }
    if !crate::config::valid_replica_id(replica_id) {
        return Err(ApiError::invalid(format!(
            "invalid replica_id {replica_id:?}: a replica id is letters, digits, '-' and '_'"
        )));
    }
    let subject = match endpoint {
        Endpoint::MarkPrefill => shared.subjects.mark_prefill(replica_id),
        Endpoint::OutputBlock => shared.subjects.add_output_block(replica_id),
        _ => shared.subjects.free(replica_id),
    };
    let internal = |e: String| ApiError::new(ErrorKind::Internal, e);
    let answer = shared
        .bus
        .request(&subject, Bytes::from(payload), FORWARD_TIMEOUT)
        .await;
    let msg = match answer {
        Ok(msg) => msg,
        Err(BusError::NoResponders { .. }) => {
            return Err(ApiError::new(
                ErrorKind::UnknownRequest,
                format!(
                    "replica {replica_id:?} is not on the bus (stopped, or never was): the requests it routed went with it"
                ),
            ))
        }
        Err(BusError::Timeout { after, .. }) => {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                format!("replica {replica_id:?} did not answer within {after:?}"),
            )
            .with_status(504))
        }
        Err(e) => {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                format!("cannot reach replica {replica_id:?}: {e}"),
            ))
        }
    };
    match decode::<Reply<()>>(&msg.payload) {
        Ok(reply) => reply.into_result().map_err(ApiError::from),
        Err(e) => Err(internal(format!(
            "replica {replica_id:?} answered something undecodable: {e}"
        ))),
    }
}

async fn workers(shared: &ReplicaShared, query: &str) -> Result<String, ApiError> {
    let mut models: Vec<&Arc<ModelShared>> = match query_param(query, "model") {
        Some(raw) => {
            let name = percent_decode(raw).unwrap_or_default();
            if let Err(e) = check_model(&name) {
                return Err(refused(shared, "", ApiError::invalid(e.to_string())));
            }
            vec![endpoints::model(shared, &name).map_err(|e| refused(shared, &name, e.into()))?]
        }
        None => shared.models.values().collect(),
    };
    models.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    let mut answer = WorkersAnswer { models: Vec::new() };
    for m in models {
        let (tx, rx) = oneshot::channel();
        let stopped = || ApiError::from(endpoints::unavailable(shared, &m.name));
        m.scheduler
            .send_message(SchedulerMsg::Loads(tx))
            .map_err(|_| stopped())?;
        let loads = rx.await.map_err(|_| stopped())?;
        let keeps_index = m.remote_index.is_none();
        let now = std::time::Instant::now();
        let workers = {
            let silence = m.silence.lock();
            json::worker_ranks(
                &m.status.layouts.all(),
                &loads,
                |key| keeps_index.then(|| m.index.held_blocks(key)),
                |key| silence.quiet(key, now),
            )
        };
        answer.models.push(json::ModelWorkers {
            model: m.name.clone(),
            block_size: m.status.block_size(),
            workers,
        });
    }
    to_json(&answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_endpoint() {
        assert_eq!(Call::of("/v1/route"), Some(Call::Route));
        assert_eq!(Call::of("/v1/workers"), Some(Call::Workers));
        assert_eq!(
            Call::of("/v1/requests/abc/free"),
            Some(Call::Update(Endpoint::Free, "abc".into()))
        );
        assert_eq!(
            Call::of("/v1/requests/a%2Fb/prefill_done"),
            Some(Call::Update(Endpoint::MarkPrefill, "a%2Fb".into()))
        );
        // An id with a slash in it: the action is the last segment.
        assert_eq!(
            Call::of("/v1/requests/a/b/free"),
            Some(Call::Update(Endpoint::Free, "a/b".into()))
        );
        assert_eq!(
            Call::of("/v1/requests//free"),
            Some(Call::Update(Endpoint::Free, String::new()))
        );
        for none in [
            "/v1/",
            "/v1/routes",
            "/v1/requests/x",
            "/v1/requests/x/done",
            "/v1/route/",
        ] {
            assert_eq!(Call::of(none), None, "{none}");
        }
        assert_eq!(Call::Workers.method(), Method::GET);
        assert_eq!(Call::Route.method(), Method::POST);
    }

    #[test]
    fn each_endpoint_needs_its_scope() {
        assert_eq!(scope("/v1/route"), Some(Scope::Route));
        assert_eq!(scope("/v1/workers"), Some(Scope::Route));
        for action in ["prefill_done", "free", "output_block"] {
            assert_eq!(
                scope(&format!("/v1/requests/r-1/{action}")),
                Some(Scope::Lease)
            );
        }
        assert_eq!(scope("/v1/requests/r-1/done"), None);
    }

    #[test]
    fn the_body_limit_fits_the_longest_prompt() {
        assert_eq!(max_body_bytes(0), 65_536);
        assert_eq!(max_body_bytes(131_072), 131_072 * 11 + 65_536);
        assert_eq!(max_body_bytes(usize::MAX), usize::MAX);
        let longest = format!(
            r#"{{"model":"m","tokens":[{}]}}"#,
            vec![u32::MAX.to_string(); 1000].join(",")
        );
        assert!(longest.len() <= max_body_bytes(1000));
    }
}
