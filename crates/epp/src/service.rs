//! The ext_proc gRPC service: one task per stream (one HTTP exchange through the gateway)
//! feeding Envoy's messages to an [`Exchange`] and carrying out its effects with the
//! [`Picker`] and the booking it holds. The service glue is what tonic's code generator
//! writes for a bidirectional method, written here for the one method.

use crate::exchange::{Effect, Exchange};
use crate::ext_proc::processing_response::Response as Answer;
use crate::ext_proc::{ProcessingRequest, ProcessingResponse, PROCESS_PATH, SERVICE_NAME};
use crate::metrics::EppMetrics;
use crate::picker::{Booking, Picker};
use kvrouter_openai::{ApiError, DoorClock, DoorPhase};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch, Semaphore};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status, Streaming};

type Answers = Pin<Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// Answers in flight to Envoy per stream: Envoy waits for each before the next step, so a
/// few suffice.
const ANSWERS_QUEUED: usize = 8;

/// What one exchange, and all of them together, may take.
#[derive(Clone, Copy, Debug)]
pub struct ExchangeLimits {
    /// The largest request body taken (413 past it).
    pub max_body_bytes: usize,
    /// Exchanges open at once, over every gateway connection; past them, 429.
    pub max_inflight: usize,
    /// From the stream's start to the request's last body byte: a client dripping its
    /// request (or a gateway stalling) is answered 408 and frees its place.
    pub read_timeout: Duration,
    /// Request body bytes held at once over every exchange (each holds its body until the
    /// pick); a chunk past it is shed (429).
    pub max_buffered_bytes: usize,
}

/// The endpoint picker's ext_proc service.
#[derive(Clone)]
pub struct ExtProcService {
    picker: Arc<Picker>,
    metrics: Arc<EppMetrics>,
    limits: ExchangeLimits,
    permits: Arc<Semaphore>,
    /// One permit per request body byte held.
    buffered: Arc<Semaphore>,
    /// Set at shutdown, once the drain's patience is spent: open exchanges end and free
    /// their bookings.
    ending: watch::Sender<bool>,
}

impl ExtProcService {
    pub fn new(picker: Arc<Picker>, metrics: Arc<EppMetrics>, limits: ExchangeLimits) -> Self {
        Self {
            picker,
            metrics,
            limits,
            permits: Arc::new(Semaphore::new(limits.max_inflight)),
            buffered: Arc::new(Semaphore::new(
                limits.max_buffered_bytes.min(Semaphore::MAX_PERMITS),
            )),
            ending: watch::channel(false).0,
        }
    }

    /// Ends every open exchange (each frees its booking before its task ends).
    pub fn end_all(&self) {
        let _ = self.ending.send(true);
    }

    /// Exchanges open now.
    pub fn in_flight(&self) -> usize {
        self.limits.max_inflight - self.permits.available_permits()
    }

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(ANSWERS_QUEUED);
        let (picker, limits) = (self.picker.clone(), self.limits);
        let buffered = self.buffered.clone();
        let metrics = self.metrics.clone();
        let ending = self.ending.subscribe();
        let permit = self.permits.clone().try_acquire_owned().ok();
        tokio::spawn(async move {
            let full = permit.is_none();
            // Held to the exchange's end.
            let _permit = permit;
            metrics.open.inc();
            let budget = Budget {
                full,
                buffered,
                held: None,
                gauge: metrics.buffered_bytes.clone(),
            };
            exchange(picker, &metrics, limits, inbound, tx, budget, ending).await;
            metrics.open.dec();
        });
        let answers =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|a| (a, rx)) },
            );
        Ok(Response::new(Box::pin(answers)))
    }
}

/// One stream, to its end. The booking (if one was made) ends when the answer does, when
/// the exchange fails, or when the stream breaks (the client or the gateway went away):
/// dropping the lease frees it.
async fn exchange(
    picker: Arc<Picker>,
    metrics: &EppMetrics,
    limits: ExchangeLimits,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    mut budget: Budget,
    mut ending: watch::Receiver<bool>,
) {
    let mut x = Exchange::new(limits.max_body_bytes);
    let mut booking: Option<Booking> = None;
    // The request's phases until the answer's first bytes.
    let mut clock: Option<DoorClock> = None;
    let route_id = kvrouter_client::new_request_id();
    let read_by = tokio::time::Instant::now() + limits.read_timeout;
    loop {
        let next = tokio::select! {
            m = inbound.message() => Some(m),
            _ = tokio::time::sleep_until(read_by), if x.reading_request() => None,
            _ = ending.wait_for(|e| *e) => {
                let _ = tx.try_send(Err(Status::unavailable("the endpoint picker is shutting down")));
                break;
            }
        };
        let Some(next) = next else {
            let mut e = ApiError::timeout(format!(
                "the request was not read whole within {:?} (--request-read-timeout-secs)",
                limits.read_timeout
            ));
            e.status = 408;
            for effect in x.refused(&e) {
                if let Effect::Send(answer) = effect {
                    metrics.refused(408);
                    let _ = tx.send(Ok(answer)).await;
                }
            }
            tracing::debug!(route_id, "request read timed out");
            continue;
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(route_id, error = %status, "ext_proc stream broken");
                break;
            }
        };
        let over_budget = !budget.take(&msg);
        let mut effects = match x.on_message(msg) {
            // No room: the first message is answered with a 429.
            Ok(_) if budget.full && !x.is_done() => x.refused(&ApiError::shed(format!(
                "the endpoint picker has {} exchanges open already (--max-inflight)",
                limits.max_inflight
            ))),
            Ok(_) if over_budget && !x.is_done() => x.refused(&ApiError::shed(format!(
                "the endpoint picker holds {} bytes of request bodies already (--max-buffered-bytes)",
                limits.max_buffered_bytes
            ))),
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(route_id, error = %e, "ext_proc stream refused");
                let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
                break;
            }
        };
        if !x.reading_request() {
            // Routed (its body is on its way to the engine) or answered: nothing held.
            budget.release();
        }
        while !effects.is_empty() {
            let mut next = Vec::new();
            for effect in effects {
                match effect {
                    Effect::Send(answer) => {
                        if let Some(Answer::ImmediateResponse(i)) = &answer.response {
                            let status = i.status.as_ref().map_or(0, |s| s.code);
                            metrics.refused(u16::try_from(status).unwrap_or(0));
                        }
                        if tx.send(Ok(answer)).await.is_err() {
                            return; // Envoy is gone; the lease drops and frees
                        }
                    }
                    Effect::Route(ask) => {
                        let t = std::time::Instant::now();
                        let mut c =
                            DoorClock::started_at(metrics.phase_switch.is_on().then_some(t));
                        let picked = picker.pick(ask, &route_id, &mut c).await;
                        metrics.pick_seconds.observe(t.elapsed().as_secs_f64());
                        match picked {
                            Ok((pick, b)) => {
                                metrics.picked();
                                clock = Some(c);
                                tracing::debug!(route_id, endpoint = ?pick.endpoints, "picked");
                                booking = Some(b);
                                next.extend(x.picked_route(pick));
                            }
                            Err(e) => {
                                tracing::debug!(route_id, status = e.status, error = %e.message, "refused");
                                next.extend(x.refused(&e));
                            }
                        }
                    }
                    Effect::PrefillDone => {
                        if let Some(b) = booking.as_mut() {
                            b.lease.mark_prefill();
                            if let Some(mut c) = clock.take() {
                                c.lap(DoorPhase::EngineFirstByte);
                                metrics.record_phases(b.model(), &c);
                            }
                        }
                    }
                    Effect::ServedBy(endpoint) => {
                        tracing::info!(route_id, endpoint, picked = ?x.picked(), "the gateway served the request elsewhere than picked");
                        metrics.served_elsewhere.inc();
                        if let Some(b) = booking.take() {
                            booking = picker.rebook(&endpoint, b).await;
                        }
                    }
                    Effect::Answered(reported) => {
                        if let Some(b) = booking.as_ref() {
                            let p = b.prediction();
                            let verdict = metrics.cache.observe(b.model(), &p, reported);
                            tracing::debug!(
                                route_id,
                                worker_id = p.worker_id,
                                predicted = p.tokens,
                                ?reported,
                                ?verdict,
                                "answered"
                            );
                        }
                    }
                    Effect::Finish => {
                        if let Some(b) = booking.take() {
                            b.lease.free();
                        }
                    }
                }
            }
            effects = next;
        }
    }
    // The stream ended before the answer did: the booking ends now, before the task does.
    if x.broken().contains(&Effect::Finish) {
        if let Some(b) = booking.take() {
            b.lease.free_now().await;
        }
    }
}

/// What one exchange holds of the service's shared limits.
struct Budget {
    /// It found no room among --max-inflight.
    full: bool,
    buffered: Arc<Semaphore>,
    /// Permits for the body bytes it holds.
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The bytes held over every exchange, as /metrics shows them.
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.release();
    }
}

impl Budget {
    /// Takes a request body chunk's bytes from the shared budget; false when there is no
    /// room for them.
    fn take(&mut self, m: &ProcessingRequest) -> bool {
        use crate::ext_proc::processing_request::Request as Part;
        let Some(Part::RequestBody(b)) = &m.request else {
            return true;
        };
        let Ok(n) = u32::try_from(b.body.len()) else {
            return false;
        };
        if n == 0 {
            return true;
        }
        match self.buffered.clone().try_acquire_many_owned(n) {
            Ok(p) => {
                self.gauge.inc_by(i64::from(n));
                match &mut self.held {
                    Some(held) => held.merge(p),
                    None => self.held = Some(p),
                }
                true
            }
            Err(_) => false,
        }
    }

    fn release(&mut self) {
        if let Some(held) = self.held.take() {
            self.gauge
                .dec_by(i64::try_from(held.num_permits()).unwrap_or(i64::MAX));
        }
    }
}

/// The tonic server side of `ExternalProcessor/Process`.
#[derive(Clone)]
pub struct ExtProcServer(pub ExtProcService);

impl tonic::server::NamedService for ExtProcServer {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> Service<http::Request<B>> for ExtProcServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS_PATH {
            return Box::pin(async {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(
                    tonic::Status::GRPC_STATUS,
                    (tonic::Code::Unimplemented as i32).into(),
                );
                headers.insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                Ok(response)
            });
        }
        struct Process(ExtProcService);
        impl tonic::server::StreamingService<ProcessingRequest> for Process {
            type Response = ProcessingResponse;
            type ResponseStream = Answers;
            type Future = BoxFuture<Response<Answers>, Status>;
            fn call(&mut self, request: Request<Streaming<ProcessingRequest>>) -> Self::Future {
                let svc = self.0.clone();
                Box::pin(async move { svc.process(request).await })
            }
        }
        let svc = self.0.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.streaming(Process(svc), req).await)
        })
    }
}
