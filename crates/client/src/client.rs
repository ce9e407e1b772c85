//! [`KvRouterClient`]: the router endpoints as async methods.

use crate::booking::Booking;
use crate::error::ClientError;
use bytes::Bytes;
use kvrouter_bus::{Bus, BusError};
use kvrouter_protocol::{
    decode, encode, max_prompt_tokens_for, Abandon, ErrorKind, Lease, OutputBlock, OverlapRequest,
    OverlapScoresReply, PotentialLoad, Reply, RequestUpdate, RouteDecision, RouteRequest, Subjects,
    Wire,
};
use std::time::Duration;
use tracing::Instrument;

/// How long a router endpoint may take to answer, unless configured otherwise.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a generate stream may stay silent, unless configured otherwise.
pub const DEFAULT_GENERATE_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How many more times a request any replica may answer is sent, unless configured otherwise.
pub const DEFAULT_RETRIES: u32 = 2;
/// Wait before asking again when no replica was there, times the retries so far.
const NO_ROUTER_BACKOFF: Duration = Duration::from_millis(100);
/// How long [`KvRouterClient::free_until_delivered`] keeps trying.
pub const FREE_RETRY_FOR: Duration = Duration::from_secs(15);
/// Wait between its attempts.
const FREE_RETRY_EVERY: Duration = Duration::from_millis(250);

/// A fresh route call id (random, never 0).
pub fn new_call_id() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0.max(1)
}

/// A fresh request id (a uuid v4), for callers that have none.
pub fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A route request for `tokens` that tracks the request as active load (`update_states`),
/// with a fresh request id and no filters.
pub fn route_request(model: impl Into<String>, tokens: Vec<u32>) -> RouteRequest {
    RouteRequest::new(model, tokens).booked(new_request_id())
}

/// A client of the kvrouter replicas of one namespace. Cheap to clone; share one per process.
#[derive(Clone, Debug)]
pub struct KvRouterClient {
    pub(crate) bus: Bus,
    pub(crate) subjects: Subjects,
    pub(crate) timeout: Duration,
    pub(crate) generate_idle_timeout: Duration,
    pub(crate) retries: u32,
}

impl KvRouterClient {
    /// A client for the replicas serving `namespace` on `bus`.
    pub fn new(bus: Bus, namespace: &str) -> Result<Self, ClientError> {
        Ok(Self {
            bus,
            subjects: Subjects::new(namespace)?,
            timeout: DEFAULT_REQUEST_TIMEOUT,
            generate_idle_timeout: DEFAULT_GENERATE_IDLE_TIMEOUT,
            retries: DEFAULT_RETRIES,
        })
    }

    /// Sets how many more times a request any replica may answer (route, overlap lookups)
    /// is sent when none answers in time, none is there, or the one that got it is
    /// unavailable (default 2): a replica killed or paused with the request costs one
    /// timeout, not the request.
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// Sets how long each router endpoint call may take (default 2 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how long a generate stream may stay silent between events (default 30 s).
    pub fn with_generate_idle_timeout(mut self, timeout: Duration) -> Self {
        self.generate_idle_timeout = timeout;
        self
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn namespace(&self) -> &str {
        self.subjects.namespace()
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Asks a replica which worker rank should serve the request. An empty `request_id` is
    /// replaced by a fresh one (set one yourself when `update_states` is on: `mark_prefill`
    /// and `free` need it), as is a `call_id` of 0 and, with `update_states`, a missing
    /// lease (the decision carries the lease: report through [`Booking::new`]).
    ///
    /// With `update_states`, when an attempt may have been booked by a replica that did not
    /// answer in time (a timeout, a lost connection), every replica but the one that
    /// answered is told to drop its booking ([`Abandon`]): otherwise that load would stay
    /// until the replica's request-timeout sweep.
    pub async fn route(&self, req: &RouteRequest) -> Result<RouteDecision, ClientError> {
        let mut req = std::borrow::Cow::Borrowed(req);
        if req.request_id.is_empty() {
            req.to_mut().request_id = new_request_id();
        }
        if req.call_id == 0 {
            req.to_mut().call_id = new_call_id();
        }
        if req.update_states && req.lease.is_none() {
            req.to_mut().lease = Lease::random();
        }
        let span = tracing::debug_span!(
            "route",
            model = %req.model,
            request_id = %req.request_id,
            tokens = req.tokens.len(),
            update_states = req.update_states,
        );
        let subject = self.subjects.route();
        let (result, unsure) = self
            .call_any_counted(&subject, &*req, req.tokens.len())
            .instrument(span.clone())
            .await;
        if unsure && req.update_states {
            let kept_by = result
                .as_ref()
                .ok()
                .map(|d: &RouteDecision| d.replica_id.clone());
            self.abandon(&req.model, &req.request_id, req.call_id, req.lease, kept_by)
                .instrument(span)
                .await;
        }
        result
    }

    /// Tells every replica but `kept_by` to drop its booking of the route call `call_id` of
    /// `request_id`, made under `lease` (best effort: a lost one leaves the booking to the
    /// request-timeout sweep).
    pub(crate) async fn abandon(
        &self,
        model: &str,
        request_id: &str,
        call_id: u64,
        lease: Lease,
        kept_by: Option<String>,
    ) {
        let abandon = Abandon {
            model: model.to_string(),
            request_id: request_id.to_string(),
            call_id,
            kept_by,
            lease,
        };
        tracing::debug!(kept_by = ?abandon.kept_by, "a retried route may be booked elsewhere: abandoning it there");
        let sent = match encode(&abandon) {
            Ok(bytes) => self
                .bus
                .publish(&self.subjects.abandon(), Bytes::from(bytes))
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, request_id, "could not abandon a retried route's other bookings: they stay until the replicas' request-timeout sweep");
        }
    }

    /// How many leading blocks of the tokens each worker rank holds.
    pub async fn overlap_scores(
        &self,
        req: &OverlapRequest,
    ) -> Result<OverlapScoresReply, ClientError> {
        let span =
            tracing::debug_span!("overlap_scores", model = %req.model, tokens = req.tokens.len());
        let subject = self.subjects.overlap_scores();
        self.call_any(&subject, req, req.tokens.len())
            .instrument(span)
            .await
    }

    /// What each worker rank's load would be if the tokens went there.
    pub async fn potential_loads(
        &self,
        req: &OverlapRequest,
    ) -> Result<Vec<PotentialLoad>, ClientError> {
        let span =
            tracing::debug_span!("potential_loads", model = %req.model, tokens = req.tokens.len());
        let subject = self.subjects.potential_loads();
        self.call_any(&subject, req, req.tokens.len())
            .instrument(span)
            .await
    }

    /// Tells the replica that made the decision that the request's prefill is done.
    pub async fn mark_prefill(&self, booking: &Booking) -> Result<(), ClientError> {
        let span = booking_span("mark_prefill", booking);
        let subject = self.subjects.mark_prefill(&booking.replica_id);
        let update = RequestUpdate {
            model: booking.model.clone(),
            request_id: booking.request_id.clone(),
            lease: booking.lease,
        };
        self.call(&subject, &update, 0).instrument(span).await
    }

    /// Tells the replica that made the decision that the request generated another block of
    /// output (one per `RouteDecision::block_size` tokens): its decode load grows with it.
    /// `decay_fraction`: the share of its output load still to count (0 to 1), the caller's
    /// estimate of how much of its decode is still ahead (`None`: all of it).
    pub async fn add_output_block(
        &self,
        booking: &Booking,
        decay_fraction: Option<f64>,
    ) -> Result<(), ClientError> {
        let span = booking_span("add_output_block", booking);
        let subject = self.subjects.add_output_block(&booking.replica_id);
        let block = OutputBlock {
            model: booking.model.clone(),
            request_id: booking.request_id.clone(),
            decay_fraction,
            lease: booking.lease,
        };
        self.call(&subject, &block, 0).instrument(span).await
    }

    /// Tells the replica that made the decision that the request is finished.
    pub async fn free(&self, booking: &Booking) -> Result<(), ClientError> {
        let span = booking_span("free", booking);
        let subject = self.subjects.free(&booking.replica_id);
        let update = RequestUpdate {
            model: booking.model.clone(),
            request_id: booking.request_id.clone(),
            lease: booking.lease,
        };
        self.call(&subject, &update, 0).instrument(span).await
    }

    /// [`Self::free`], tried again for up to [`FREE_RETRY_FOR`] while the failure may pass:
    /// the bus disconnected (a NATS restart), the replica not answering (paused) or not
    /// subscribed yet (re-subscribing after a reconnect). A `free` that never arrives holds
    /// the request's load on every synced replica until the request-timeout sweep (300 s by
    /// default); a late one costs nothing. An `UnknownRequest` answer after a failed attempt
    /// counts as delivered (an earlier attempt landed, or the replica dropped the request
    /// itself). Run it in the background when the caller should not wait.
    pub async fn free_until_delivered(&self, booking: &Booking) -> Result<(), ClientError> {
        self.free_retrying(booking, false).await
    }

    /// [`Self::free_until_delivered`]; `failed`: an earlier attempt failed already (it may
    /// have landed).
    async fn free_retrying(&self, booking: &Booking, mut failed: bool) -> Result<(), ClientError> {
        let (replica_id, request_id) = (&booking.replica_id, &booking.request_id);
        let deadline = tokio::time::Instant::now() + FREE_RETRY_FOR;
        loop {
            let result = self.free(booking).await;
            let transient = result.as_ref().is_err_and(may_pass);
            match result {
                Err(ClientError::Router(e)) if failed && e.kind == ErrorKind::UnknownRequest => {
                    return Ok(())
                }
                Err(e) if transient && tokio::time::Instant::now() < deadline => {
                    if !failed {
                        tracing::debug!(error = %e, replica_id, request_id, "free failed; trying again");
                    }
                    failed = true;
                    tokio::time::sleep(FREE_RETRY_EVERY).await;
                }
                other => return other,
            }
        }
    }

    /// [`Self::free`] once; when that fails in a way that may pass, it goes on trying in the
    /// background ([`Self::free_until_delivered`]) and the first failure is returned.
    pub(crate) async fn free_now_or_later(&self, booking: &Booking) -> Result<(), ClientError> {
        let result = self.free(booking).await;
        if let Err(e) = &result {
            if may_pass(e) {
                let (client, booking) = (self.clone(), booking.clone());
                tokio::spawn(async move {
                    // The first attempt may have landed: `unknown_request` then means done.
                    let retried = client.free_retrying(&booking, true).await;
                    if let Err(e) = retried {
                        tracing::warn!(error = %e, replica_id = %booking.replica_id, request_id = %booking.request_id, "free never reached the replica: its request-timeout sweep frees the load");
                    }
                });
            }
        }
        result
    }

    /// [`Self::call`] on an endpoint any replica answers (a queue group): when the replica
    /// that got the request never answers (killed, paused, partitioned), no replica is there
    /// (a restart), or the one that got it is unavailable (draining, just woken from a
    /// stall), the request goes out again, up to `retries` more times; another replica takes
    /// it. Nothing is sent while the bus is disconnected: NATS would hold the request and
    /// deliver it after the reconnect, long after this caller gave up on it.
    pub(crate) async fn call_any<Req: Wire, T: Wire>(
        &self,
        subject: &str,
        req: &Req,
        tokens: usize,
    ) -> Result<T, ClientError> {
        self.call_any_counted(subject, req, tokens).await.0
    }

    /// [`Self::call_any`], and whether an attempt may have reached a replica that did not
    /// answer (it timed out, or the connection failed under it).
    pub(crate) async fn call_any_counted<Req: Wire, T: Wire>(
        &self,
        subject: &str,
        req: &Req,
        tokens: usize,
    ) -> (Result<T, ClientError>, bool) {
        let mut retried = 0;
        let mut unsure = false;
        loop {
            if !self.connected().await {
                let stalled = ClientError::Bus(BusError::Stalled {
                    what: format!("request on '{subject}' (not connected to NATS)"),
                    after: self.timeout,
                });
                return (Err(stalled), unsure);
            }
            let result = self.call(subject, req, tokens).await;
            unsure |= matches!(
                result,
                Err(ClientError::Timeout { .. } | ClientError::Bus(_))
            );
            let again = match &result {
                Err(ClientError::Timeout { .. }) => Some(Duration::ZERO),
                // Nobody there: give a restarting replica a moment.
                Err(ClientError::NoRouter { .. }) => Some(NO_ROUTER_BACKOFF * (retried + 1)),
                Err(ClientError::Router(e)) if e.kind == ErrorKind::Unavailable => {
                    Some(Duration::ZERO)
                }
                _ => None,
            };
            match again {
                Some(wait) if retried < self.retries => {
                    retried += 1;
                    if let Err(e) = &result {
                        tracing::debug!(error = %e, retried, "no replica answered; asking again");
                    }
                    tokio::time::sleep(wait).await;
                }
                _ => return (result, unsure),
            }
        }
    }

    /// Waits, at most the request timeout, until the bus is connected.
    async fn connected(&self) -> bool {
        let deadline = tokio::time::Instant::now() + self.timeout;
        while !self.bus.is_connected() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Encodes `req`, checks it fits one bus message, sends it and decodes the `Reply<T>`.
    pub(crate) async fn call<Req: Wire, T: Wire>(
        &self,
        subject: &str,
        req: &Req,
        tokens: usize,
    ) -> Result<T, ClientError> {
        let payload = encode_checked(req, tokens, self.bus.max_payload())?;
        let msg = self
            .bus
            .request(subject, payload, self.timeout)
            .await
            .map_err(|e| self.router_error(subject, e))?;
        let reply: Reply<T> = decode(&msg.payload).map_err(|source| ClientError::Decode {
            subject: subject.to_string(),
            source,
        })?;
        let result = reply.into_result().map_err(ClientError::Router);
        if let Err(e) = &result {
            tracing::debug!(error = %e, "router error reply");
        }
        result
    }

    /// Maps a bus failure on a router endpoint to the client's error.
    fn router_error(&self, subject: &str, e: BusError) -> ClientError {
        match e {
            BusError::NoResponders { .. } => ClientError::NoRouter {
                namespace: self.namespace().to_string(),
                subject: subject.to_string(),
            },
            BusError::Timeout { after, .. } => ClientError::Timeout {
                subject: subject.to_string(),
                after,
            },
            other => ClientError::Bus(other),
        }
    }
}

/// Whether a failed call may succeed if sent again a little later (the bus back, the
/// replica woken or re-subscribed), as opposed to an answer.
fn may_pass(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Timeout { .. } | ClientError::NoRouter { .. } | ClientError::Bus(_)
    )
}

/// Encodes a request carrying `tokens` prompt tokens and refuses it, naming the limit, when
/// the prompt is longer than the protocol allows on a bus of `max_payload` bytes
/// ([`max_prompt_tokens_for`]: what replicas accept) or the message would not fit.
pub(crate) fn encode_checked<T: Wire>(
    value: &T,
    tokens: usize,
    max_payload: usize,
) -> Result<Bytes, ClientError> {
    let bytes = encode(value).map_err(ClientError::Encode)?;
    let max_tokens = max_prompt_tokens_for(max_payload);
    if (tokens > 0 && tokens > max_tokens) || bytes.len() > max_payload {
        return Err(ClientError::PromptTooLarge {
            tokens,
            bytes: bytes.len(),
            max_payload,
            max_tokens,
        });
    }
    Ok(Bytes::from(bytes))
}

/// The span of a report on a booking (never with its lease).
fn booking_span(name: &'static str, b: &Booking) -> tracing::Span {
    tracing::debug_span!("booking", op = name, replica_id = %b.replica_id, model = %b.model, request_id = %b.request_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_requests_name_the_limit() {
        let max_payload = (64 << 10) + 4000;
        assert_eq!(max_prompt_tokens_for(max_payload), 1000);
        let at_max = route_request("m", vec![7; 1000]);
        assert!(encode_checked(&at_max, 1000, max_payload).is_ok());
        let over = route_request("m", vec![7; 1001]);
        match encode_checked(&over, 1001, max_payload) {
            Err(ClientError::PromptTooLarge {
                tokens,
                max_payload: max,
                max_tokens,
                ..
            }) => assert_eq!((tokens, max, max_tokens), (1001, max_payload, 1000)),
            other => panic!("expected PromptTooLarge, got {other:?}"),
        }
        // A message that cannot fit is refused whatever its prompt.
        let update = RequestUpdate {
            model: "m".repeat(5000),
            request_id: "r".into(),
            lease: kvrouter_protocol::Lease::NONE,
        };
        assert!(matches!(
            encode_checked(&update, 0, 4096),
            Err(ClientError::PromptTooLarge { .. })
        ));
        assert!(encode_checked(&update, 0, 1 << 20).is_ok());
    }

    /// A route attempt that timed out may have been booked by the replica that got it: once
    /// another replica answers, the client abandons the call everywhere else, naming the
    /// replica it kept; every attempt of the call carries the same call id.
    #[tokio::test]
    async fn a_retried_route_is_abandoned_everywhere_but_where_it_was_answered() {
        let bus = Bus::local();
        let client = KvRouterClient::new(bus.clone(), "ns")
            .unwrap()
            .with_timeout(Duration::from_millis(100));
        let mut routes = bus.subscribe(&client.subjects.route()).await.unwrap();
        let mut abandons = bus.subscribe(&client.subjects.abandon()).await.unwrap();
        let replica = {
            let bus = bus.clone();
            tokio::spawn(async move {
                let mut calls = Vec::new();
                // The first attempt is never answered (a paused replica); the second is.
                while let Some(msg) = routes.next().await {
                    let req: RouteRequest = decode(&msg.payload).unwrap();
                    calls.push(req.call_id);
                    if calls.len() == 2 {
                        let decision = Reply::Ok(RouteDecision {
                            worker_id: 1,
                            dp_rank: 0,
                            overlap_blocks: 0,
                            replica_id: "r2".into(),
                            base_url: String::new(),
                            tier_overlap_blocks: Default::default(),
                            block_size: 16,
                            lease: kvrouter_protocol::Lease::NONE,
                            fallbacks: Vec::new(),
                        });
                        let reply = Bytes::from(encode(&decision).unwrap());
                        bus.publish(&msg.reply.unwrap(), reply).await.unwrap();
                        return calls;
                    }
                }
                calls
            })
        };
        let d = client
            .route(&route_request("m", vec![1; 32]))
            .await
            .unwrap();
        assert_eq!(d.replica_id, "r2");
        let calls = replica.await.unwrap();
        assert_eq!(calls.len(), 2);
        assert!(calls[0] != 0 && calls[0] == calls[1], "{calls:?}");
        let msg = tokio::time::timeout(Duration::from_secs(2), abandons.next())
            .await
            .expect("an abandon is published")
            .unwrap();
        let abandon: Abandon = decode(&msg.payload).unwrap();
        assert_eq!(abandon.kept_by.as_deref(), Some("r2"));
        assert_eq!((abandon.call_id, abandon.model.as_str()), (calls[0], "m"));

        // A call answered at once, or one that books nothing, abandons nothing.
        let mut routes = bus.subscribe(&client.subjects.route()).await.unwrap();
        let answering = {
            let bus = bus.clone();
            tokio::spawn(async move {
                while let Some(msg) = routes.next().await {
                    let reply: Reply<RouteDecision> = Reply::Err(
                        kvrouter_protocol::ErrorReply::new(ErrorKind::NoWorkers, "none"),
                    );
                    let reply = Bytes::from(encode(&reply).unwrap());
                    bus.publish(&msg.reply.unwrap(), reply).await.unwrap();
                }
            })
        };
        assert!(client
            .route(&route_request("m", vec![1; 32]))
            .await
            .is_err());
        let none = tokio::time::timeout(Duration::from_millis(300), abandons.next()).await;
        assert!(none.is_err(), "nothing to abandon: {none:?}");
        answering.abort();
    }
}
