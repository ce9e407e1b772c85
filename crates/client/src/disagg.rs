//! Disaggregated prefill and decode: [`KvRouterClient::route_disagg`] and
//! [`KvRouterClient::generate_disagg`].

use crate::booking::Booking;
use crate::client::{encode_checked, new_request_id, KvRouterClient};
use crate::error::{ClientError, WorkerFailure};
use crate::generate::GenerateParams;
use kvrouter_bus::BusError;
use kvrouter_protocol::{
    decode, prefill_request_id, DisaggDecision, DisaggRouteRequest, ErrorKind, GenerateEvent,
    GenerateRequest, Lease, RouteDecision, TierBlocks,
};
use std::time::Instant;
use tracing::Instrument;

/// What one worker stream of a disaggregated request delivered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageOutcome {
    pub ttft_us: u64,
    pub cached_blocks: u32,
    pub tier_cached_blocks: TierBlocks,
    pub prompt_blocks: u32,
    pub output_tokens: u32,
    pub itl_us: Vec<u32>,
    pub e2e_us: u64,
}

/// What happened to a disaggregated generate request.
#[derive(Clone, Debug)]
pub struct DisaggOutcome {
    pub request_id: String,
    pub decision: DisaggDecision,
    /// The prefill worker's run (prefill only, no output tokens).
    pub prefill: StageOutcome,
    /// The decode worker's run.
    pub decode: StageOutcome,
    pub route_wall_us: u64,
    pub e2e_wall_us: u64,
    /// `mark_prefill` / `free` calls that failed (the generation itself succeeded).
    pub bookkeeping_errors: Vec<ClientError>,
}

impl KvRouterClient {
    /// Asks a replica for a prefill worker rank and a decode worker rank. An empty
    /// `request_id` is replaced by a fresh one.
    pub async fn route_disagg(
        &self,
        req: &DisaggRouteRequest,
    ) -> Result<DisaggDecision, ClientError> {
        let filled;
        let req = if req.request_id.is_empty() || (req.update_states && req.lease.is_none()) {
            filled = DisaggRouteRequest {
                request_id: if req.request_id.is_empty() {
                    new_request_id()
                } else {
                    req.request_id.clone()
                },
                lease: if req.lease.is_none() {
                    Lease::random()
                } else {
                    req.lease
                },
                ..req.clone()
            };
            &filled
        } else {
            req
        };
        let span = tracing::debug_span!(
            "route_disagg",
            model = %req.model,
            request_id = %req.request_id,
            tokens = req.tokens.len(),
        );
        let subject = self.subjects.route_disagg();
        let (result, unsure) = self
            .call_any_counted(&subject, req, req.tokens.len())
            .instrument(span.clone())
            .await;
        if unsure && req.update_states {
            // No call id in a disaggregated request: bookings are freed, a late copy is left
            // to the replicas' stall watch.
            let kept_by = result
                .as_ref()
                .ok()
                .map(|d: &DisaggDecision| d.replica_id.clone());
            self.abandon(&req.model, &req.request_id, 0, req.lease, kept_by)
                .instrument(span)
                .await;
        }
        result
    }

    /// Routes the request to a prefill and a decode worker (`update_states` on), runs the
    /// prefill alone (`max_tokens` 0) on the prefill worker rank, then the decode on the
    /// decode worker rank. The prefill half (its prefill load and blocks) is released by the
    /// workers' transfer reports once every prefill tp rank sent the KV, or at the latest
    /// (`free`, an unknown request then being fine) when the request ends; the decode half
    /// is freed when the request ends. `params.pin` is not used.
    pub async fn generate_disagg(
        &self,
        params: &GenerateParams,
    ) -> Result<DisaggOutcome, ClientError> {
        let request_id = params.request_id_or_new();
        let span = tracing::info_span!(
            "generate_disagg",
            model = %params.model,
            request_id = %request_id,
            tokens = params.tokens.len(),
            max_tokens = params.max_tokens,
        );
        self.generate_disagg_inner(params, request_id)
            .instrument(span)
            .await
    }

    async fn generate_disagg_inner(
        &self,
        params: &GenerateParams,
        request_id: String,
    ) -> Result<DisaggOutcome, ClientError> {
        let t0 = Instant::now();
        let model_subjects = self.subjects.model(&params.model)?;
        let decision = self
            .route_disagg(&DisaggRouteRequest {
                model: params.model.clone(),
                request_id: request_id.clone(),
                tokens: params.tokens.clone(),
                lora: params.lora.clone(),
                allowed_workers: params.allowed_workers.clone(),
                update_states: true,
                lease: Lease::random(),
                trace: None,
            })
            .await?;
        let route_wall_us = micros(t0);
        let (pre, dec) = (&decision.prefill, &decision.decode);
        let prefill_id = prefill_request_id(&request_id);
        let mut bookkeeping = Vec::new();

        let ran = async {
            let prefill = self
                .run_stage(
                    &model_subjects.generate(pre.worker_id),
                    &request_id,
                    params,
                    0,
                    pre,
                )
                .await?;
            // No mark_prefill of the prefill half: its prefill load stays until every prefill
            // tp rank reported the KV sent (the replica then frees it).
            let decode = self
                .run_stage(
                    &model_subjects.generate(dec.worker_id),
                    &request_id,
                    params,
                    params.max_tokens,
                    dec,
                )
                .await?;
            Ok::<_, ClientError>((prefill, decode))
        }
        .await;
        // Whatever happened, the replica must stop counting both halves.
        for booking in [
            Booking::new(pre, &params.model, &prefill_id),
            Booking::new(dec, &params.model, &request_id),
        ] {
            if let Err(e) = self.free_now_or_later(&booking).await {
                if !unknown_request(&e) {
                    tracing::warn!(error = %e, request_id = %booking.request_id, "free failed");
                    bookkeeping.push(e);
                }
            }
        }
        let (prefill, decode) = ran?;
        Ok(DisaggOutcome {
            request_id,
            decision,
            prefill,
            decode,
            route_wall_us,
            e2e_wall_us: micros(t0),
            bookkeeping_errors: bookkeeping,
        })
    }

    /// Runs the request on one worker rank and collects its stream.
    async fn run_stage(
        &self,
        subject: &str,
        request_id: &str,
        params: &GenerateParams,
        max_tokens: u32,
        decision: &RouteDecision,
    ) -> Result<StageOutcome, ClientError> {
        let failed = |failure| ClientError::Worker {
            request_id: request_id.to_string(),
            worker_id: decision.worker_id,
            dp_rank: decision.dp_rank,
            failure,
        };
        let req = GenerateRequest {
            request_id: request_id.to_string(),
            tokens: params.tokens.clone(),
            max_tokens,
            dp_rank: decision.dp_rank,
        };
        let payload = encode_checked(&req, req.tokens.len(), self.bus.max_payload())?;
        let mut stream = self
            .bus
            .request_stream(subject, payload, self.generate_idle_timeout)
            .await
            .map_err(|e| failed(bus_failure(subject, e)))?;
        let mut out = StageOutcome::default();
        loop {
            let bytes = match stream.next().await {
                None => return Err(failed(WorkerFailure::StreamEnded)),
                Some(Err(e)) => return Err(failed(bus_failure(subject, e))),
                Some(Ok(b)) => b,
            };
            match decode::<GenerateEvent>(&bytes).map_err(|e| failed(WorkerFailure::Decode(e)))? {
                GenerateEvent::PrefillDone {
                    ttft_us,
                    cached_blocks,
                    prompt_blocks,
                    tier_cached_blocks,
                } => {
                    out.ttft_us = ttft_us;
                    out.cached_blocks = cached_blocks;
                    out.tier_cached_blocks = tier_cached_blocks;
                    out.prompt_blocks = prompt_blocks;
                }
                GenerateEvent::Tokens { itl_us } => out.itl_us.extend(itl_us),
                GenerateEvent::Done {
                    output_tokens,
                    e2e_us,
                } => {
                    out.output_tokens = output_tokens;
                    out.e2e_us = e2e_us;
                    return Ok(out);
                }
                GenerateEvent::Error(e) => return Err(failed(WorkerFailure::Error(e))),
            }
        }
    }
}

fn unknown_request(e: &ClientError) -> bool {
    matches!(e, ClientError::Router(r) if r.kind == ErrorKind::UnknownRequest)
}

fn bus_failure(subject: &str, e: BusError) -> WorkerFailure {
    match e {
        BusError::NoResponders { .. } => WorkerFailure::NoResponders(subject.to_string()),
        BusError::Timeout { after, .. } => WorkerFailure::Timeout(after),
        other => WorkerFailure::Bus(other),
    }
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}
