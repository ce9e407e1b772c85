//! The engine's answer on its way to the client: read as server-sent events, the first
//! token marks the prefill, chunks are reshaped and streamed on (or gathered into one
//! answer), and the route is freed when the answer ends, fails, times out or the client
//! leaves (dropping the relay).

use crate::frontend::InFlight;
use crate::metrics::{FrontendMetrics, ModelLabel};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvrouter_client::RouteLease;
use kvrouter_openai::door_metrics::{reported_cached_tokens, CachePrediction, CacheVerdict};
use kvrouter_openai::sse::{self, SseEvent, SseParser};
use kvrouter_openai::{read_chunk, ApiError, Chunk, ChunkShaper, DoorClock, DoorPhase, Gathered};
use kvrouter_otlp::Span;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// What reading the engine gave next.
enum Step {
    Event(SseEvent),
    /// The engine closed the stream.
    End,
    Failed(String),
    TimedOut,
}

pub struct Relay {
    body: Incoming,
    parser: SseParser,
    pending: VecDeque<SseEvent>,
    body_done: bool,
    lease: Option<RouteLease>,
    frontend: Arc<crate::Frontend>,
    labels: ModelLabel,
    started: Instant,
    last_output: Option<Instant>,
    deadline: tokio::time::Instant,
    _in_flight: InFlight,
    /// The request's phases, observed at the engine's first bytes.
    clock: Option<DoorClock>,
    /// The router's prediction, held against the engine's report when the answer ends.
    prediction: Option<CachePrediction>,
    reported_cached: Option<u64>,
    /// The engine call's span, then the request's: both end with the answer (in this
    /// order, the child first).
    engine_span: Option<Span>,
    request_span: Option<Span>,
}

impl Relay {
    pub fn new(
        body: Incoming,
        lease: RouteLease,
        frontend: Arc<crate::Frontend>,
        model: &str,
        started: Instant,
        in_flight: InFlight,
    ) -> Self {
        let deadline = tokio::time::Instant::from_std(started + frontend.config.request_timeout);
        Self {
            body,
            parser: SseParser::new(),
            pending: VecDeque::new(),
            body_done: false,
            lease: Some(lease),
            frontend,
            labels: FrontendMetrics::model(model),
            started,
            last_output: None,
            deadline,
            _in_flight: in_flight,
            clock: None,
            prediction: None,
            reported_cached: None,
            engine_span: None,
            request_span: None,
        }
    }

    /// Ends the request's and the engine call's spans with the answer.
    pub fn traced(mut self, request: Span, engine: Span) -> Self {
        self.request_span = Some(request);
        self.engine_span = Some(engine);
        self
    }

    /// The answer failed: both spans say why.
    fn failed(&mut self, why: &str) {
        for s in [&mut self.engine_span, &mut self.request_span]
            .into_iter()
            .flatten()
        {
            s.fail(why.to_string());
        }
    }

    /// Times the engine's first bytes on `clock` and checks its cache report against
    /// `prediction`.
    pub fn timed(mut self, clock: DoorClock, prediction: CachePrediction) -> Self {
        self.clock = Some(clock);
        self.prediction = Some(prediction);
        self
    }

    /// The engine's first answer bytes: the request's phases are complete.
    fn first_bytes(&mut self) {
        if let Some(mut clock) = self.clock.take() {
            clock.lap(DoorPhase::EngineFirstByte);
            self.frontend
                .metrics
                .record_phases(&self.labels.model, &clock);
        }
    }

    /// A chunk of the answer: its usage may carry the engine's cached-token count (the
    /// last one with usage wins).
    fn saw_chunk(&mut self, chunk: &Value) {
        if let Some(n) = reported_cached_tokens(chunk) {
            self.reported_cached = Some(n);
        }
    }

    /// The answer ended whole: the engine's report against the prediction.
    fn check_cache(&mut self) {
        let Some(p) = self.prediction.take() else {
            return;
        };
        if let Some(s) = &mut self.request_span {
            s.set("kvrouter.cached_tokens.predicted", p.tokens);
            if let Some(n) = self.reported_cached {
                s.set("kvrouter.cached_tokens.reported", n);
            }
        }
        let verdict =
            self.frontend
                .metrics
                .cache
                .observe(&self.labels.model, &p, self.reported_cached);
        if let Some(v) = verdict.filter(|v| *v != CacheVerdict::Close) {
            tracing::debug!(worker_id = p.worker_id, predicted = p.tokens, reported = ?self.reported_cached, verdict = ?v, "the engine's cached tokens differ from the router's prediction by more than a block");
        }
    }

    async fn step(&mut self) -> Step {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Step::Event(ev);
            }
            if self.body_done {
                return Step::End;
            }
            match tokio::time::timeout_at(self.deadline, self.body.frame()).await {
                Err(_) => return Step::TimedOut,
                Ok(None) => {
                    self.body_done = true;
                    match self.parser.finish() {
                        Ok(ev) => self.pending.extend(ev),
                        Err(e) => return Step::Failed(format!("bad event stream: {e}")),
                    }
                }
                Ok(Some(Err(e))) => {
                    return Step::Failed(format!("the engine connection broke: {e}"))
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.first_bytes();
                        match self.parser.feed(&data) {
                            Ok(evs) => self.pending.extend(evs),
                            Err(e) => return Step::Failed(format!("bad event stream: {e}")),
                        }
                    }
                }
            }
        }
    }

    /// A chunk with generated output (one token in vLLM's and SGLang's streams): the first
    /// ends the prefill; every block's worth is reported to the router.
    fn saw_output(&mut self) {
        let now = Instant::now();
        if let Some(l) = &mut self.lease {
            l.saw_output_tokens(1);
        }
        let m = &self.frontend.metrics;
        match self.last_output.replace(now) {
            None => {
                if let Some(l) = &mut self.lease {
                    l.mark_prefill();
                }
                m.ttft
                    .get_or_create(&self.labels)
                    .observe((now - self.started).as_secs_f64());
            }
            Some(prev) => m
                .inter_token
                .get_or_create(&self.labels)
                .observe((now - prev).as_secs_f64()),
        }
    }

    fn finish(&mut self) {
        if let Some(l) = self.lease.take() {
            l.free();
        }
    }

    /// The next bytes for a streaming client, or `None` after `[DONE]`.
    async fn next_sse(&mut self, shaper: &mut ChunkShaper) -> Option<Bytes> {
        self.lease.as_ref()?;
        loop {
            let failure = match self.step().await {
                Step::Event(SseEvent::Done) => {
                    self.check_cache();
                    self.finish();
                    return Some(Bytes::from_static(sse::DONE));
                }
                Step::Event(SseEvent::Data(d)) => match read_chunk(&d) {
                    Ok(Chunk::Answer { value, has_output }) => {
                        if has_output {
                            self.saw_output();
                        }
                        self.saw_chunk(&value);
                        match shaper.shape(value) {
                            Some(v) => return Some(sse::event(&v.to_string())),
                            None => continue,
                        }
                    }
                    Ok(Chunk::Error(e)) => engine_error_message(&e),
                    Err(e) => e,
                },
                Step::End => "the engine closed the stream before [DONE]".to_string(),
                Step::Failed(e) => e,
                Step::TimedOut => format!(
                    "the answer took longer than {:?} (--request-timeout-secs)",
                    self.frontend.config.request_timeout
                ),
            };
            self.failed(&failure);
            self.finish();
            let err = json!({"error": {"message": failure, "type": "upstream_error", "code": 502}});
            let mut b = BytesMut::new();
            b.extend_from_slice(&sse::event(&err.to_string()));
            b.extend_from_slice(sse::DONE);
            return Some(b.freeze());
        }
    }

    /// The stream as the client's response body.
    pub fn into_sse_body(
        self,
        chat: bool,
        include_usage: bool,
        hide_cache_details: bool,
    ) -> impl futures_util::Stream<Item = Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>
    {
        let shaper = ChunkShaper::new(chat, include_usage).hiding_cache_details(hide_cache_details);
        futures_util::stream::unfold((self, shaper), |(mut relay, mut shaper)| async move {
            let bytes = relay.next_sse(&mut shaper).await?;
            Some((Ok(hyper::body::Frame::data(bytes)), (relay, shaper)))
        })
    }

    /// The whole answer, for a client that did not ask to stream.
    pub async fn gather(mut self, chat: bool, hide_cache_details: bool) -> Result<Value, ApiError> {
        let mut gathered = Gathered::hiding_cache_details(hide_cache_details);
        loop {
            let failure = match self.step().await {
                Step::Event(SseEvent::Done) | Step::End => break,
                Step::Event(SseEvent::Data(d)) => match read_chunk(&d) {
                    Ok(Chunk::Answer { value, has_output }) => {
                        if has_output {
                            self.saw_output();
                        }
                        self.saw_chunk(&value);
                        gathered.add(&value);
                        continue;
                    }
                    Ok(Chunk::Error(e)) => ApiError::upstream(engine_error_message(&e)),
                    Err(e) => ApiError::upstream(e),
                },
                Step::Failed(e) => ApiError::upstream(e),
                Step::TimedOut => ApiError::timeout(format!(
                    "the answer took longer than {:?} (--request-timeout-secs)",
                    self.frontend.config.request_timeout
                )),
            };
            self.failed(&failure.message);
            self.finish();
            return Err(failure);
        }
        self.check_cache();
        self.finish();
        Ok(gathered.finish(chat))
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // A client that left: the lease's own drop frees the route; the engine sees its
        // connection closed and stops generating.
        self.frontend
            .metrics
            .duration
            .get_or_create(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

fn engine_error_message(e: &Value) -> String {
    let m = e
        .get("message")
        .and_then(Value::as_str)
        .map_or_else(|| e.to_string(), str::to_string);
    format!("the engine failed mid-answer: {m}")
}
