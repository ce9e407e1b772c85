//! What every door measures of a request besides its outcome: where its time goes
//! ([`DoorPhase`]) and whether the engine found the cached prefix the router predicted
//! ([`CachePrediction`], [`CacheMetrics`]). Each door registers these under its own prefix.

use kvrouter_admin::phase_timing::{Phase, PhaseClock};
use kvrouter_protocol::RouteDecision;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use serde_json::Value;

/// A request's phases in a door, in order.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DoorPhase {
    /// The body read and parsed (and the caller's key checked).
    Parse,
    /// The chat template rendered (chat requests only).
    Template,
    /// The prompt tokenized (for chat, the rendered text), blocking-pool wait included.
    Tokenize,
    /// The round trip to the router replicas, each attempt's.
    Route,
    /// The engine request written until the engine's first answer bytes.
    EngineFirstByte,
}

impl Phase for DoorPhase {
    const ALL: &'static [Self] = &[
        Self::Parse,
        Self::Template,
        Self::Tokenize,
        Self::Route,
        Self::EngineFirstByte,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Parse => "parse",
            Self::Template => "template",
            Self::Tokenize => "tokenize",
            Self::Route => "route",
            Self::EngineFirstByte => "engine_first_byte",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

pub type DoorClock = PhaseClock<DoorPhase>;

/// The cached prefix the router predicted for one routed request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachePrediction {
    pub worker_id: u64,
    /// Leading prompt tokens cached in any tier of the chosen rank.
    pub tokens: u64,
    pub block_size: u32,
}

/// How an engine's report compares with the prediction.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CacheVerdict {
    /// Within a block of each other.
    Close,
    /// The router predicted more cached tokens than the engine found.
    Over,
    /// The engine found more than the router predicted.
    Under,
}

impl CacheVerdict {
    fn as_str(self) -> &'static str {
        match self {
            Self::Close => "close",
            Self::Over => "over",
            Self::Under => "under",
        }
    }
}

impl CachePrediction {
    /// What `decision` predicts for a prompt of `prompt_tokens`: its overlap in every tier
    /// (an engine counts blocks it loads from a lower tier or a shared store as cached too),
    /// never more than the prompt.
    pub fn of(decision: &RouteDecision, prompt_tokens: usize) -> Self {
        let blocks = u64::from(
            decision
                .tier_overlap_blocks
                .total()
                .max(decision.overlap_blocks),
        );
        Self {
            worker_id: decision.worker_id,
            tokens: (blocks * u64::from(decision.block_size)).min(prompt_tokens as u64),
            block_size: decision.block_size,
        }
    }

    /// Off by more than a block either way, or close. Engines recompute a prompt's last
    /// token even when all of it is cached, so a whole hit reports up to a block less.
    pub fn verdict(&self, reported: u64) -> CacheVerdict {
        let block = u64::from(self.block_size.max(1));
        if self.tokens > reported + block {
            CacheVerdict::Over
        } else if reported > self.tokens + block {
            CacheVerdict::Under
        } else {
            CacheVerdict::Close
        }
    }
}

/// The engine's count of cached prompt tokens in an OpenAI answer or stream chunk
/// (`usage.prompt_tokens_details.cached_tokens`, as vLLM with
/// `--enable-prompt-tokens-details` and SGLang with `--enable-cache-report` send it).
pub fn reported_cached_tokens(answer: &Value) -> Option<u64> {
    answer
        .get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

/// The most of a whole (not streamed) answer held to read its usage: past it, the count is
/// not read (an answer that long is not worth holding for a metric).
pub const MAX_SCANNED_ANSWER_BYTES: usize = 1 << 20;

/// The most of one streamed event held to read its usage: usage chunks are a few hundred
/// bytes, and the bytes pass on to the client whatever the scan makes of them.
pub const MAX_SCANNED_EVENT_BYTES: usize = 64 << 10;

/// Reads the engine's cached-token count from an answer's bytes as they pass on (the
/// endpoint picker sees the answer only as bytes): server-sent events, each event that
/// mentions `cached_tokens` parsed; or one JSON answer, held up to
/// [`MAX_SCANNED_ANSWER_BYTES`] and parsed at its end.
#[derive(Debug, Default)]
pub struct CachedTokensScan {
    mode: ScanMode,
    reported: Option<u64>,
}

#[derive(Debug, Default)]
enum ScanMode {
    #[default]
    Unknown,
    Events(crate::sse::SseParser),
    Whole(Vec<u8>),
    GaveUp,
}

const MENTION: &[u8] = b"cached_tokens";

fn mentions(text: &[u8]) -> bool {
    text.windows(MENTION.len()).any(|w| w == MENTION)
}

impl CachedTokensScan {
    pub fn feed(&mut self, bytes: &[u8]) {
        if let ScanMode::Unknown = self.mode {
            match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
                None => return,
                Some(b'{') => self.mode = ScanMode::Whole(Vec::new()),
                Some(_) => {
                    let parser =
                        crate::sse::SseParser::with_max_event_bytes(MAX_SCANNED_EVENT_BYTES);
                    self.mode = ScanMode::Events(parser);
                }
            }
        }
        match &mut self.mode {
            ScanMode::Events(parser) => match parser.feed(bytes) {
                Ok(events) => {
                    for e in events {
                        if let crate::sse::SseEvent::Data(d) = e {
                            if mentions(d.as_bytes()) {
                                let v: Option<Value> = serde_json::from_str(&d).ok();
                                if let Some(n) = v.as_ref().and_then(reported_cached_tokens) {
                                    self.reported = Some(n);
                                }
                            }
                        }
                    }
                }
                Err(_) => self.mode = ScanMode::GaveUp,
            },
            ScanMode::Whole(held) if held.len() + bytes.len() <= MAX_SCANNED_ANSWER_BYTES => {
                held.extend_from_slice(bytes);
            }
            ScanMode::Whole(_) => self.mode = ScanMode::GaveUp,
            ScanMode::Unknown | ScanMode::GaveUp => {}
        }
    }

    /// The count the answer reported, once it has ended.
    pub fn finish(self) -> Option<u64> {
        match self.mode {
            ScanMode::Whole(held) if mentions(&held) => serde_json::from_slice::<Value>(&held)
                .ok()
                .as_ref()
                .and_then(reported_cached_tokens),
            _ => self.reported,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MispredictionLabels {
    pub worker: String,
    /// `over` or `under`.
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

fn error_histogram() -> Histogram {
    // Reported minus predicted tokens, both ways.
    let up = [16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];
    let down = up.iter().rev().map(|b| -b);
    Histogram::new(down.chain([-1.0, 0.0]).chain(up))
}

/// Predicted against reported cache hits, per worker. A door registers each family under
/// its prefix (`cache_predicted_tokens`, `cache_reported_tokens`,
/// `cache_prediction_error_tokens`, `cache_mispredictions`, `cache_reports_missing`).
pub struct CacheMetrics {
    pub predicted_tokens: Family<WorkerLabel, Counter>,
    pub reported_tokens: Family<WorkerLabel, Counter>,
    pub error_tokens: Family<WorkerLabel, Histogram, fn() -> Histogram>,
    pub mispredictions: Family<MispredictionLabels, Counter>,
    /// Answers that carried no cached-token count: the engine does not report it (see
    /// [`reported_cached_tokens`]) or the answer failed first.
    pub reports_missing: Family<ModelLabel, Counter>,
}

impl Default for CacheMetrics {
    fn default() -> Self {
        Self {
            predicted_tokens: Family::default(),
            reported_tokens: Family::default(),
            error_tokens: Family::new_with_constructor(error_histogram as fn() -> Histogram),
            mispredictions: Family::default(),
            reports_missing: Family::default(),
        }
    }
}

impl CacheMetrics {
    /// Counts one answer of `model`: the prediction against the engine's report, or a
    /// missing report. The verdict, for logs.
    pub fn observe(
        &self,
        model: &str,
        predicted: &CachePrediction,
        reported: Option<u64>,
    ) -> Option<CacheVerdict> {
        let Some(reported) = reported else {
            let label = ModelLabel {
                model: model.to_string(),
            };
            self.reports_missing.get_or_create(&label).inc();
            return None;
        };
        let worker = WorkerLabel {
            worker: predicted.worker_id.to_string(),
        };
        self.predicted_tokens
            .get_or_create(&worker)
            .inc_by(predicted.tokens);
        self.reported_tokens.get_or_create(&worker).inc_by(reported);
        self.error_tokens
            .get_or_create(&worker)
            .observe(reported as f64 - predicted.tokens as f64);
        let verdict = predicted.verdict(reported);
        if verdict != CacheVerdict::Close {
            self.mispredictions
                .get_or_create(&MispredictionLabels {
                    worker: worker.worker,
                    direction: verdict.as_str(),
                })
                .inc();
        }
        Some(verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::TierBlocks;
    use proptest::prelude::*;
    use serde_json::json;

    fn decision(device: u32, host: u32, block_size: u32) -> RouteDecision {
        RouteDecision {
            worker_id: 7,
            overlap_blocks: device,
            tier_overlap_blocks: TierBlocks {
                device,
                host,
                ..TierBlocks::default()
            },
            block_size,
            dp_rank: 0,
            replica_id: String::new(),
            base_url: String::new(),
            lease: kvrouter_protocol::Lease::NONE,
            fallbacks: Vec::new(),
        }
    }

    #[test]
    fn a_prediction_counts_every_tier_within_the_prompt() {
        let p = CachePrediction::of(&decision(3, 2, 16), 1000);
        assert_eq!((p.worker_id, p.tokens), (7, 80));
        assert_eq!(CachePrediction::of(&decision(3, 2, 16), 70).tokens, 70);
        assert_eq!(CachePrediction::of(&decision(0, 0, 16), 70).tokens, 0);
    }

    proptest! {
        /// The verdict is what "off by more than a block" says, against a direct reading.
        #[test]
        fn verdicts_match_the_rule(predicted in 0u64..5000, reported in 0u64..5000, bs in 1u32..128) {
            let p = CachePrediction { worker_id: 1, tokens: predicted, block_size: bs };
            let diff = reported as i64 - predicted as i64;
            let want = if diff < -(bs as i64) {
                CacheVerdict::Over
            } else if diff > bs as i64 {
                CacheVerdict::Under
            } else {
                CacheVerdict::Close
            };
            prop_assert_eq!(p.verdict(reported), want);
        }
    }

    #[test]
    fn cached_tokens_are_read_where_engines_put_them() {
        let with =
            json!({"usage": {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": 48}}});
        assert_eq!(reported_cached_tokens(&with), Some(48));
        for without in [
            json!({"usage": {"prompt_tokens": 64}}),
            json!({"usage": {"prompt_tokens": 64, "prompt_tokens_details": null}}),
            json!({"usage": null}),
            json!({"choices": []}),
            json!({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}),
        ] {
            assert_eq!(reported_cached_tokens(&without), None, "{without}");
        }
    }

    fn scan(chunks: &[&str]) -> Option<u64> {
        let mut s = CachedTokensScan::default();
        for c in chunks {
            s.feed(c.as_bytes());
        }
        s.finish()
    }

    #[test]
    fn the_scan_reads_streams_split_anywhere_and_whole_answers() {
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let stream = format!(
            "data: {{\"choices\":[{{\"text\":\" a\"}}]}}\n\ndata: {usage}\n\ndata: [DONE]\n\n"
        );
        for cut in 0..stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(scan(&[a, b]), Some(32), "cut at {cut}");
        }
        assert_eq!(
            scan(&[" \n", usage]),
            Some(32),
            "a whole answer, after whitespace"
        );
        let (a, b) = usage.split_at(20);
        assert_eq!(scan(&[a, b]), Some(32));
        let without = r#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}"#;
        assert_eq!(scan(&[without]), None);
        assert_eq!(
            scan(&["data: {\"choices\":[]}\n\n", "data: [DONE]\n\n"]),
            None
        );
        assert_eq!(scan(&[]), None);
        assert_eq!(scan(&["data: not json cached_tokens\n\n"]), None);
    }

    #[test]
    fn the_scan_holds_a_whole_answer_only_up_to_its_bound() {
        let mut s = CachedTokensScan::default();
        s.feed(b"{\"pad\":\"");
        let pad = vec![b'x'; MAX_SCANNED_ANSWER_BYTES];
        s.feed(&pad);
        s.feed(br#"","usage":{"prompt_tokens_details":{"cached_tokens":5}}}"#);
        assert!(
            matches!(s.mode, ScanMode::GaveUp),
            "nothing held past the bound"
        );
        assert_eq!(s.finish(), None);
        // A stream's event without its end is held up to its own, smaller bound.
        let mut s = CachedTokensScan::default();
        s.feed(b"data: {\"pad\":\"");
        s.feed(&vec![b'x'; MAX_SCANNED_EVENT_BYTES]);
        assert!(
            matches!(s.mode, ScanMode::GaveUp),
            "an endless event dropped"
        );
        s.feed(b"\"}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n");
        assert_eq!(s.finish(), None, "nothing read after giving up");
    }

    #[test]
    fn answers_are_counted_per_worker_and_missing_reports_per_model() {
        let m = CacheMetrics::default();
        let p = CachePrediction {
            worker_id: 3,
            tokens: 64,
            block_size: 16,
        };
        assert_eq!(m.observe("llama", &p, Some(60)), Some(CacheVerdict::Close));
        assert_eq!(m.observe("llama", &p, Some(0)), Some(CacheVerdict::Over));
        assert_eq!(m.observe("llama", &p, Some(128)), Some(CacheVerdict::Under));
        assert_eq!(m.observe("llama", &p, None), None);
        let w = WorkerLabel { worker: "3".into() };
        assert_eq!(m.predicted_tokens.get_or_create(&w).get(), 192);
        assert_eq!(m.reported_tokens.get_or_create(&w).get(), 188);
        let over = MispredictionLabels {
            worker: "3".into(),
            direction: "over",
        };
        assert_eq!(m.mispredictions.get_or_create(&over).get(), 1);
        let missing = ModelLabel {
            model: "llama".into(),
        };
        assert_eq!(m.reports_missing.get_or_create(&missing).get(), 1);
    }
}
