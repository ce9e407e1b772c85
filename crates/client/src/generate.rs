//! [`KvRouterClient::generate`]: what a frontend does with one request, end to end.

use crate::booking::Booking;
use crate::client::{encode_checked, new_request_id, KvRouterClient};
use crate::error::{ClientError, WorkerFailure};
use kvrouter_bus::BusError;
use kvrouter_protocol::{
    decode, GenerateEvent, GenerateRequest, Pin, RouteDecision, RouteRequest, TierBlocks, WorkerId,
};
use std::time::Instant;
use tracing::Instrument;

/// One request to run: routed, then generated on the chosen worker rank.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    pub model: String,
    pub tokens: Vec<u32>,
    /// `None` (or empty): a fresh uuid v4.
    pub request_id: Option<String>,
    pub max_tokens: u32,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    /// Seconds the request counts as having waited already if the replica must queue it.
    pub priority_jump: f64,
    /// Output tokens expected (counted as decode load from the start).
    pub expected_output_tokens: Option<u32>,
}

impl GenerateParams {
    /// The request id to use: the caller's, or a fresh uuid v4 when none (or empty).
    pub fn request_id_or_new(&self) -> String {
        self.request_id
            .clone()
            .filter(|id| !id.is_empty())
            .unwrap_or_else(new_request_id)
    }

    pub fn new(model: impl Into<String>, tokens: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            model: model.into(),
            tokens,
            request_id: None,
            max_tokens,
            lora: None,
            allowed_workers: None,
            pin: None,
            priority_jump: 0.0,
            expected_output_tokens: None,
        }
    }
}

/// What happened to a generate request. Engine times (`ttft_us`, `itl_us`, `e2e_us`) are what
/// the worker reported; `*_wall_us` are measured by this client.
#[derive(Clone, Debug)]
pub struct GenerateOutcome {
    pub request_id: String,
    pub decision: RouteDecision,
    pub ttft_us: u64,
    /// Leading prompt blocks the engine reused (any tier), and by tier.
    pub cached_blocks: u32,
    pub tier_cached_blocks: TierBlocks,
    pub prompt_blocks: u32,
    pub output_tokens: u32,
    pub itl_us: Vec<u32>,
    pub e2e_us: u64,
    /// Wall time of the route call.
    pub route_wall_us: u64,
    /// Wall time from the start of the call to `Done` (routing included).
    pub e2e_wall_us: u64,
    /// `mark_prefill` / `free` calls that failed (the generation itself succeeded; the
    /// replica's load accounting for this request may be off until its own cleanup).
    pub bookkeeping_errors: Vec<ClientError>,
}

impl GenerateOutcome {
    /// Mean inter-token latency in µs, `None` without inter-token latencies.
    pub fn mean_itl_us(&self) -> Option<f64> {
        if self.itl_us.is_empty() {
            return None;
        }
        let sum: u64 = self.itl_us.iter().map(|&v| u64::from(v)).sum();
        Some(sum as f64 / self.itl_us.len() as f64)
    }
}

/// What the worker stream delivered.
#[derive(Default)]
struct Progress {
    ttft_us: u64,
    cached_blocks: u32,
    tier_cached_blocks: TierBlocks,
    prompt_blocks: u32,
    output_tokens: u32,
    itl_us: Vec<u32>,
    e2e_us: u64,
    prefill_marked: bool,
    /// Output blocks reported to the replica (`add_output_block`).
    output_blocks: u32,
}

impl KvRouterClient {
    /// Routes the request (`update_states` on), runs it on the chosen worker rank, calls
    /// `mark_prefill` on the deciding replica when the prefill is done and `free` when the
    /// request ends, whether it succeeded or not.
    pub async fn generate(&self, params: &GenerateParams) -> Result<GenerateOutcome, ClientError> {
        let request_id = params.request_id_or_new();
        let span = tracing::info_span!(
            "generate",
            model = %params.model,
            request_id = %request_id,
            tokens = params.tokens.len(),
            max_tokens = params.max_tokens,
        );
        self.generate_inner(params, request_id)
            .instrument(span)
            .await
    }

    async fn generate_inner(
        &self,
        params: &GenerateParams,
        request_id: String,
    ) -> Result<GenerateOutcome, ClientError> {
        let t0 = Instant::now();
        // Checked before routing, so a bad model name never leaves active load behind.
        let model_subjects = self.subjects.model(&params.model)?;
        let route = RouteRequest::new(params.model.clone(), params.tokens.clone())
            .booked(request_id.clone())
            .with_lora(params.lora.clone())
            .with_allowed_workers(params.allowed_workers.clone())
            .with_pin(params.pin)
            .with_priority_jump(params.priority_jump)
            .with_expected_output_tokens(params.expected_output_tokens);
        let decision = self.route(&route).await?;
        let route_wall_us = micros(t0);
        tracing::debug!(
            worker_id = decision.worker_id,
            dp_rank = decision.dp_rank,
            overlap_blocks = decision.overlap_blocks,
            replica_id = %decision.replica_id,
            "routed"
        );
        let subject = model_subjects.generate(decision.worker_id);
        let mut bookkeeping_errors = Vec::new();
        let ran = self
            .run_on_worker(
                &subject,
                params,
                &request_id,
                &decision,
                &mut bookkeeping_errors,
            )
            .await;
        // Whatever happened on the worker, the replica must stop counting the request.
        let booking = Booking::new(&decision, &params.model, &request_id);
        if let Err(e) = self.free_now_or_later(&booking).await {
            tracing::warn!(error = %e, replica_id = %decision.replica_id, "free failed");
            bookkeeping_errors.push(e);
        }
        let progress = ran.map_err(|failure| ClientError::Worker {
            request_id: request_id.clone(),
            worker_id: decision.worker_id,
            dp_rank: decision.dp_rank,
            failure,
        })?;
        Ok(GenerateOutcome {
            request_id,
            decision,
            ttft_us: progress.ttft_us,
            cached_blocks: progress.cached_blocks,
            tier_cached_blocks: progress.tier_cached_blocks,
            prompt_blocks: progress.prompt_blocks,
            output_tokens: progress.output_tokens,
            itl_us: progress.itl_us,
            e2e_us: progress.e2e_us,
            route_wall_us,
            e2e_wall_us: micros(t0),
            bookkeeping_errors,
        })
    }

    async fn run_on_worker(
        &self,
        subject: &str,
        params: &GenerateParams,
        request_id: &str,
        decision: &RouteDecision,
        bookkeeping_errors: &mut Vec<ClientError>,
    ) -> Result<Progress, WorkerFailure> {
        let booking = Booking::new(decision, &params.model, request_id);
        let req = GenerateRequest {
            request_id: request_id.to_string(),
            tokens: params.tokens.clone(),
            max_tokens: params.max_tokens,
            dp_rank: decision.dp_rank,
        };
        let payload = match encode_checked(&req, req.tokens.len(), self.bus.max_payload()) {
            Ok(p) => p,
            // The route request (bigger than this one) fitted, so this is unexpected.
            Err(e) => return Err(WorkerFailure::Bus(BusError::Other(e.to_string()))),
        };
        let mut stream = self
            .bus
            .request_stream(subject, payload, self.generate_idle_timeout)
            .await
            .map_err(|e| worker_bus_failure(subject, e))?;
        let mut progress = Progress::default();
        loop {
            let bytes = match stream.next().await {
                None => return Err(WorkerFailure::StreamEnded),
                Some(Err(e)) => return Err(worker_bus_failure(subject, e)),
                Some(Ok(bytes)) => bytes,
            };
            match decode::<GenerateEvent>(&bytes).map_err(WorkerFailure::Decode)? {
                GenerateEvent::PrefillDone {
                    ttft_us,
                    cached_blocks,
                    prompt_blocks,
                    tier_cached_blocks,
                } => {
                    progress.ttft_us = ttft_us;
                    progress.cached_blocks = cached_blocks;
                    progress.tier_cached_blocks = tier_cached_blocks;
                    progress.prompt_blocks = prompt_blocks;
                    if !progress.prefill_marked {
                        progress.prefill_marked = true;
                        if let Err(e) = self.mark_prefill(&booking).await {
                            tracing::warn!(error = %e, replica_id = %decision.replica_id, "mark_prefill failed");
                            bookkeeping_errors.push(e);
                        }
                    }
                }
                GenerateEvent::Tokens { itl_us } => {
                    progress.itl_us.extend(itl_us);
                    // One inter-token latency per token after the first.
                    let generated = progress.itl_us.len() as u32 + 1;
                    while decision.block_size > 0
                        && generated >= (progress.output_blocks + 1) * decision.block_size
                    {
                        progress.output_blocks += 1;
                        if let Err(e) = self.add_output_block(&booking, None).await {
                            tracing::debug!(error = %e, replica_id = %decision.replica_id, "add_output_block failed");
                            bookkeeping_errors.push(e);
                            break;
                        }
                    }
                }
                GenerateEvent::Done {
                    output_tokens,
                    e2e_us,
                } => {
                    progress.output_tokens = output_tokens;
                    progress.e2e_us = e2e_us;
                    return Ok(progress);
                }
                GenerateEvent::Error(e) => return Err(WorkerFailure::Error(e)),
            }
        }
    }
}

fn worker_bus_failure(subject: &str, e: BusError) -> WorkerFailure {
    match e {
        BusError::NoResponders { .. } => WorkerFailure::NoResponders(subject.to_string()),
        BusError::Timeout { after, .. } => WorkerFailure::Timeout(after),
        other => WorkerFailure::Bus(other),
    }
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}
