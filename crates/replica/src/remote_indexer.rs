//! The remote indexer client (`--use-remote-indexer`): the replica keeps no KV index of its
//! own and asks a serving indexer (`--serve-indexer`, see the served_indexer module) for the
//! overlaps of each request, on the model's `indexer.find_matches` subject (a queue group, so
//! any serving indexer may answer).
//!
//! Routing never fails for want of an index: when no serving indexer answers within the
//! timeout (no responders, timeout, an error reply, a reply for another block size), the
//! request is routed on load alone (every overlap zero) and counted in
//! `kvrouter_remote_indexer_fallbacks_total`. An outage is logged once, a warning when it
//! starts and an info line when a serving indexer answers again ([`Outage`]); overlap-aware
//! routing then resumes by itself, as every request asks again. A refusal for being out of
//! sync (`Unavailable`: that serving indexer is fetching a rank's state) is fast, so a lookup
//! asks up to three times within the timeout before it falls back: with several serving
//! indexers, the queue group likely picks a synced one.
//!
//! A hung serving indexer (it takes queries and never answers) would cost every route the
//! whole timeout, so lookups go through a circuit breaker ([`crate::breaker`]): after a few
//! timeouts in a row (fast failures such as "no responders" or a refusal cost nothing and do
//! not count), routes skip the lookup (counted in `kvrouter_remote_indexer_skipped_total`
//! as well as in the fallbacks) until a probe is answered again.
//!
//! In approximate mode (`--no-kv-events`) with a served or remote indexer, route decisions are
//! published on the model's `indexer.record` subject instead of being recorded locally
//! ([`DecisionPublisher`]); every serving indexer subscribes without a queue group, so all of
//! them record every decision and stay equal.

use crate::breaker::{Admit, Breaker, BreakerConfig, Transition};
use crate::clock::now;
use crate::metrics::{Metrics, ModelLabels};
use bytes::Bytes;
use kvrouter_bus::{Bus, BusError};
use kvrouter_indexer::OverlapScores;
use kvrouter_protocol::{
    decode, encode, ErrorKind, IndexerQuery, IndexerRecord, LocalBlockHash, OverlapScoresReply,
    Reply, SequenceHash, WorkerKey,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What changed in the outage state after a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutageChange {
    /// The first failure after a success (or since start): log a warning.
    Started,
    /// The first answer after failures: log how long it lasted and what it cost.
    Ended { lasted: Duration, fallbacks: u64 },
}

/// Plain core: tracks whether the serving indexers are unreachable, so an outage is reported
/// once when it starts and once when it ends, however many requests fall back in between.
#[derive(Debug, Default)]
pub struct Outage {
    since: Option<Instant>,
    fallbacks: u64,
}

impl Outage {
    #[cfg(test)]
    pub fn is_down(&self) -> bool {
        self.since.is_some()
    }

    /// A query got no usable answer.
    pub fn failed(&mut self, now: Instant) -> Option<OutageChange> {
        self.fallbacks += 1;
        if self.since.is_some() {
            return None;
        }
        self.since = Some(now);
        Some(OutageChange::Started)
    }

    /// A query was answered.
    pub fn answered(&mut self, now: Instant) -> Option<OutageChange> {
        let since = self.since.take()?;
        let fallbacks = std::mem::take(&mut self.fallbacks);
        Some(OutageChange::Ended {
            lasted: now.saturating_duration_since(since),
            fallbacks,
        })
    }
}

/// Asks serving indexers for one model's overlaps.
pub struct RemoteIndexer {
    bus: Bus,
    model: String,
    subject: String,
    timeout: Duration,
    metrics: Arc<Metrics>,
    labels: ModelLabels,
    /// Mirrors `outage.is_down()`, so an answer in normal operation takes no lock.
    down: AtomicBool,
    outage: Mutex<Outage>,
    /// Held for a few field updates per lookup, never across the query.
    breaker: Mutex<Breaker>,
}

impl RemoteIndexer {
    pub fn new(
        bus: Bus,
        model: &str,
        subject: String,
        timeout: Duration,
        breaker: BreakerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            bus,
            model: model.to_string(),
            subject,
            timeout,
            metrics,
            labels: Metrics::model(model),
            down: AtomicBool::new(false),
            outage: Mutex::new(Outage::default()),
            breaker: Mutex::new(Breaker::new(breaker)),
        }
    }

    /// Whether the breaker skips lookups (open, or half-open with its probe out).
    pub fn breaker_open(&self) -> bool {
        self.breaker.lock().is_open()
    }

    /// A serving indexer announced that it is synced and answering: ask it from the next
    /// lookup on, whatever the breaker's cooldown (a new serving replica is used at once).
    pub fn on_announcement(&self, replica_id: &str) {
        self.metrics
            .indexer_announcements
            .get_or_create(&self.labels)
            .inc();
        let change = self.breaker.lock().close_now(now());
        tracing::info!(model = %self.model, serving_replica = %replica_id, breaker_was_open = change.is_some(), "a serving indexer announced itself synced");
        if let Some(change) = change {
            self.log_breaker(change);
        }
    }

    /// Whether the last query found no serving indexer.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// The overlap of each worker rank holding a leading block of `local`, from a serving
    /// indexer; empty (route on load alone) when none answers. Never fails.
    pub async fn find_matches(&self, block_size: u32, local: &[LocalBlockHash]) -> OverlapScores {
        if local.is_empty() {
            return OverlapScores::default(); // no full block: nothing can overlap
        }
        let admitted = self.breaker.lock().admit(now());
        let ticket = match admitted {
            Admit::Ask(t) => t,
            Admit::Skip => {
                self.metrics
                    .remote_indexer_skipped
                    .get_or_create(&self.labels)
                    .inc();
                self.fell_back("the breaker is open after repeated failures");
                return OverlapScores::default();
            }
        };
        let result = self.query(block_size, local).await;
        // Only a timeout costs routes time; a fast failure (nobody subscribed, a refusal)
        // shows nobody is hung, so it counts for the breaker as an answer.
        let change = match &result {
            Err(Failure { slow: true, .. }) => self.breaker.lock().failed(ticket, now()),
            _ => self.breaker.lock().succeeded(ticket, now()),
        };
        if let Some(change) = change {
            self.log_breaker(change);
        }
        match result {
            Ok(scores) => {
                self.metrics
                    .remote_indexer_queries
                    .get_or_create(&self.labels)
                    .inc();
                if self.down.load(Ordering::Relaxed) {
                    let change = self.outage.lock().answered(now());
                    self.down.store(false, Ordering::Relaxed);
                    if let Some(OutageChange::Ended { lasted, fallbacks }) = change {
                        tracing::info!(
                            model = %self.model,
                            lasted_ms = lasted.as_millis() as u64,
                            fallbacks,
                            "a serving indexer answers again: overlap-aware routing resumed"
                        );
                    }
                }
                scores
            }
            Err(failure) => {
                self.fell_back(&failure.reason);
                OverlapScores::default()
            }
        }
    }

    /// Counts a route on load alone and reports the outage once.
    fn fell_back(&self, reason: &str) {
        self.metrics
            .remote_indexer_fallbacks
            .get_or_create(&self.labels)
            .inc();
        let change = self.outage.lock().failed(now());
        self.down.store(true, Ordering::Relaxed);
        if change == Some(OutageChange::Started) {
            tracing::warn!(
                model = %self.model,
                subject = %self.subject,
                %reason,
                "no serving indexer answered: routing on load alone (overlap 0) until one does"
            );
        } else {
            tracing::debug!(model = %self.model, %reason, "remote indexer fallback");
        }
    }

    fn log_breaker(&self, change: Transition) {
        let gauge = self
            .metrics
            .remote_indexer_breaker_open
            .get_or_create(&self.labels);
        match change {
            Transition::Opened { failures, cooldown } => {
                gauge.set(1);
                tracing::warn!(
                    model = %self.model,
                    failures,
                    cooldown_ms = cooldown.as_millis() as u64,
                    "serving indexers failed {failures} times in a row: breaker open, routes skip the remote lookup (overlap 0) until a probe is answered"
                );
            }
            Transition::Reopened { cooldown } => {
                tracing::debug!(
                    model = %self.model,
                    cooldown_ms = cooldown.as_millis() as u64,
                    "breaker probe failed: open again"
                );
            }
            Transition::Closed { open_for, skipped } => {
                gauge.set(0);
                tracing::info!(
                    model = %self.model,
                    open_ms = open_for.as_millis() as u64,
                    skipped,
                    "breaker probe answered: breaker closed, remote lookups resume"
                );
            }
        }
    }

    /// Asks a serving indexer; a refusal for being out of sync (one of several serving
    /// indexers catching up on a rank) is fast, so it asks again, up to [`ASKS`] times in
    /// all within the timeout: the queue group may pick a synced one.
    async fn query(
        &self,
        block_size: u32,
        local: &[LocalBlockHash],
    ) -> Result<OverlapScores, Failure> {
        let payload = Bytes::from(
            encode(&IndexerQuery {
                block_size,
                local_hashes: local.to_vec(),
            })
            .map_err(|e| Failure::fast(e.to_string()))?,
        );
        let deadline = now() + self.timeout;
        let mut asks = 1;
        loop {
            let left = deadline.saturating_duration_since(now());
            match self.ask(block_size, payload.clone(), left).await {
                Err(f) if f.unsynced && asks < ASKS && now() < deadline => asks += 1,
                result => return result,
            }
        }
    }

    async fn ask(
        &self,
        block_size: u32,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<OverlapScores, Failure> {
        let msg = self
            .bus
            .request(&self.subject, payload, timeout)
            .await
            .map_err(|e| Failure {
                slow: matches!(e, BusError::Timeout { .. }),
                unsynced: false,
                reason: e.to_string(),
            })?;
        let reply: Reply<OverlapScoresReply> =
            decode(&msg.payload).map_err(|e| Failure::fast(format!("undecodable answer: {e}")))?;
        let reply = reply.into_result().map_err(|e| Failure {
            slow: false,
            unsynced: e.kind == ErrorKind::Unavailable,
            reason: format!("the serving indexer refused: {}: {}", e.kind, e.message),
        })?;
        if reply.block_size != block_size {
            return Err(Failure::fast(format!(
                "the serving indexer uses block size {}, this replica {block_size}",
                reply.block_size
            )));
        }
        Ok(OverlapScores {
            scores: reply.scores,
            tiers: reply.tier_overlap_blocks,
            shared_blocks: reply.shared_blocks,
        })
    }
}

/// How many times one lookup may ask while serving indexers refuse as out of sync.
const ASKS: u32 = 3;

/// Why a remote lookup gave no overlaps.
struct Failure {
    /// It waited out the timeout (what the breaker guards against).
    slow: bool,
    /// The serving indexer is not synced yet (another one may be).
    unsynced: bool,
    reason: String,
}

impl Failure {
    fn fast(reason: String) -> Self {
        Self {
            slow: false,
            unsynced: false,
            reason,
        }
    }
}

/// Publishes route decisions to every serving indexer of a model (approximate mode).
#[derive(Clone)]
pub struct DecisionPublisher {
    bus: Bus,
    subject: String,
}

impl DecisionPublisher {
    pub fn new(bus: Bus, subject: String) -> Self {
        Self { bus, subject }
    }

    pub async fn publish(
        &self,
        key: WorkerKey,
        local_hashes: Vec<LocalBlockHash>,
        sequence_hashes: Vec<SequenceHash>,
    ) -> Result<(), String> {
        if local_hashes.len() != sequence_hashes.len() {
            return Err(format!(
                "{} local hashes against {} sequence hashes",
                local_hashes.len(),
                sequence_hashes.len()
            ));
        }
        let payload = encode(&IndexerRecord {
            key,
            local_hashes,
            sequence_hashes,
        })
        .map_err(|e| e.to_string())?;
        self.bus
            .publish(&self.subject, Bytes::from(payload))
            .await
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::TierBlocks;
    use std::sync::atomic::AtomicU64;

    fn lh(v: &[u64]) -> Vec<LocalBlockHash> {
        v.iter().map(|&h| LocalBlockHash(h)).collect()
    }

    fn sh(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|&h| SequenceHash(h)).collect()
    }

    #[test]
    fn an_outage_is_reported_once_when_it_starts_and_once_when_it_ends() {
        let t0 = Instant::now();
        let mut o = Outage::default();
        assert_eq!(o.answered(t0), None, "no outage yet");
        assert_eq!(o.failed(t0), Some(OutageChange::Started));
        assert!(o.is_down());
        for _ in 0..5 {
            assert_eq!(o.failed(t0 + Duration::from_millis(10)), None);
        }
        assert_eq!(
            o.answered(t0 + Duration::from_millis(300)),
            Some(OutageChange::Ended {
                lasted: Duration::from_millis(300),
                fallbacks: 6
            })
        );
        assert!(!o.is_down());
        assert_eq!(o.answered(t0 + Duration::from_secs(1)), None);
        // A second outage starts afresh.
        assert_eq!(
            o.failed(t0 + Duration::from_secs(2)),
            Some(OutageChange::Started)
        );
        assert_eq!(
            o.answered(t0 + Duration::from_secs(3)),
            Some(OutageChange::Ended {
                lasted: Duration::from_secs(1),
                fallbacks: 1
            })
        );
    }

    fn remote(bus: &Bus, timeout: Duration) -> (RemoteIndexer, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        (
            RemoteIndexer::new(
                bus.clone(),
                "m",
                "ns.model.m.indexer.find_matches".into(),
                timeout,
                BreakerConfig::new(3, Duration::from_secs(1), timeout),
                metrics.clone(),
            ),
            metrics,
        )
    }

    #[tokio::test]
    async fn no_responders_and_silence_fall_back_to_no_overlap() {
        let bus = Bus::local();
        let (r, metrics) = remote(&bus, Duration::from_millis(30));
        assert!(r.find_matches(16, &lh(&[1, 2, 3])).await.is_empty());
        assert!(r.is_down());
        // A responder that never answers: a timeout, also a fallback.
        let _silent = bus
            .queue_subscribe("ns.model.m.indexer.find_matches", "g")
            .await
            .unwrap();
        assert!(r.find_matches(16, &lh(&[1, 2, 3])).await.is_empty());
        // No blocks: nothing asked, nothing counted.
        assert!(r.find_matches(16, &[]).await.is_empty());
        let text = metrics.render();
        assert!(
            text.contains(r#"kvrouter_remote_indexer_fallbacks_total{model="m"} 2"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn answers_are_used_and_end_an_outage() {
        let bus = Bus::local();
        let (r, metrics) = remote(&bus, Duration::from_secs(1));
        assert!(r.find_matches(16, &lh(&[1, 2])).await.is_empty());
        assert!(r.is_down());
        let sub = bus
            .queue_subscribe("ns.model.m.indexer.find_matches", "g")
            .await
            .unwrap();
        answering_indexer(&bus, sub);
        let found = r.find_matches(16, &lh(&[1, 2])).await;
        assert_eq!(found.scores, vec![(WorkerKey::new(7, 0), 2)]);
        // The lower tiers come through.
        assert_eq!(found.tiers.len(), 1);
        assert_eq!(found.tier_blocks(WorkerKey::new(9, 0)).shared, 1);
        assert!(!r.is_down());
        let text = metrics.render();
        assert!(text.contains(r#"kvrouter_remote_indexer_queries_total{model="m"} 1"#));
        assert!(text.contains(r#"kvrouter_remote_indexer_fallbacks_total{model="m"} 1"#));
    }

    /// A queue-group member on the find_matches subject that takes queries and never
    /// answers; counts them.
    async fn hung_indexer(
        bus: &Bus,
    ) -> (
        Arc<std::sync::atomic::AtomicUsize>,
        tokio::task::JoinHandle<()>,
    ) {
        let mut sub = bus
            .queue_subscribe("ns.model.m.indexer.find_matches", "g")
            .await
            .unwrap();
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n = asked.clone();
        let task = tokio::spawn(async move {
            while sub.next().await.is_some() {
                n.fetch_add(1, Ordering::SeqCst);
            }
        });
        (asked, task)
    }

    fn answering_indexer(bus: &Bus, mut sub: kvrouter_bus::Subscription) {
        let bus = bus.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let q: IndexerQuery = decode(&msg.payload).unwrap();
                let reply: Reply<OverlapScoresReply> = Reply::Ok(OverlapScoresReply {
                    shared_blocks: 1,
                    tier_overlap_blocks: vec![(WorkerKey::new(8, 0), TierBlocks::on_device(0))],
                    block_size: q.block_size,
                    scores: vec![(WorkerKey::new(7, 0), q.local_hashes.len() as u32)],
                });
                let _ = bus
                    .publish(&msg.reply.unwrap(), Bytes::from(encode(&reply).unwrap()))
                    .await;
            }
        });
    }

    /// A serving indexer that refuses every query as not synced yet; counts them.
    fn unsynced_indexer(bus: &Bus, mut sub: kvrouter_bus::Subscription) -> Arc<AtomicU64> {
        let (bus, asked) = (bus.clone(), Arc::new(AtomicU64::new(0)));
        let count = asked.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                count.fetch_add(1, Ordering::Relaxed);
                let reply: Reply<OverlapScoresReply> = Reply::Err(
                    kvrouter_protocol::ErrorReply::new(ErrorKind::Unavailable, "rank 3 not synced"),
                );
                let _ = bus
                    .publish(&msg.reply.unwrap(), Bytes::from(encode(&reply).unwrap()))
                    .await;
            }
        });
        asked
    }

    #[tokio::test]
    async fn an_unsynced_serving_indexer_is_asked_again_so_a_synced_one_can_answer() {
        let bus = Bus::local();
        let (r, metrics) = remote(&bus, Duration::from_secs(1));
        let subject = "ns.model.m.indexer.find_matches";
        let refusals = unsynced_indexer(&bus, bus.queue_subscribe(subject, "g").await.unwrap());
        // Alone, it is asked ASKS times, then the route falls back.
        assert!(r.find_matches(16, &lh(&[1, 2])).await.is_empty());
        assert_eq!(refusals.load(Ordering::Relaxed), u64::from(ASKS));
        assert_eq!(
            series(&metrics, "kvrouter_remote_indexer_fallbacks_total"),
            1
        );
        // Next to a synced one, a lookup falls back only when every ask lands on the unsynced
        // one (about 1 in 2^ASKS; 1 in 2 without asking again).
        answering_indexer(&bus, bus.queue_subscribe(subject, "g").await.unwrap());
        let mut answered = 0;
        for _ in 0..40 {
            answered += usize::from(!r.find_matches(16, &lh(&[1, 2])).await.is_empty());
        }
        assert!(answered >= 30, "{answered} of 40 lookups answered");
        assert_eq!(
            series(&metrics, "kvrouter_remote_indexer_fallbacks_total"),
            1 + 40 - answered as u64
        );
    }

    fn series(metrics: &Metrics, name: &str) -> u64 {
        let text = metrics.render();
        let prefix = format!("{name}{{model=\"m\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_serving_indexer_opens_the_breaker_and_an_answer_closes_it() {
        let bus = Bus::local();
        let (r, metrics) = remote(&bus, Duration::from_millis(50));
        let (asked, hung) = hung_indexer(&bus).await;
        // Three timeouts open the breaker; the other routes do not ask (nor wait).
        for _ in 0..20 {
            assert!(r.find_matches(16, &lh(&[1, 2])).await.is_empty());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 3);
        assert!(r.breaker_open());
        assert_eq!(
            series(&metrics, "kvrouter_remote_indexer_fallbacks_total"),
            20
        );
        assert_eq!(
            series(&metrics, "kvrouter_remote_indexer_skipped_total"),
            17
        );
        assert_eq!(series(&metrics, "kvrouter_remote_indexer_breaker_open"), 1);

        // After the cooldown one probe asks; still hung, so it is open again (for 2 s).
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..10 {
            assert!(r.find_matches(16, &lh(&[1, 2])).await.is_empty());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 4, "one probe");
        assert!(r.breaker_open());

        // The hung indexer goes, an answering one comes: the next probe closes the breaker.
        hung.abort();
        let _ = hung.await;
        let sub = bus
            .queue_subscribe("ns.model.m.indexer.find_matches", "g")
            .await
            .unwrap();
        answering_indexer(&bus, sub);
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(
            r.find_matches(16, &lh(&[1, 2])).await.is_empty(),
            "still open"
        );
        tokio::time::advance(Duration::from_millis(1600)).await;
        assert_eq!(
            r.find_matches(16, &lh(&[1, 2])).await.scores,
            vec![(WorkerKey::new(7, 0), 2)]
        );
        assert!(!r.breaker_open() && !r.is_down());
        assert_eq!(series(&metrics, "kvrouter_remote_indexer_breaker_open"), 0);
        assert_eq!(series(&metrics, "kvrouter_remote_indexer_queries_total"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_can_be_turned_off() {
        let bus = Bus::local();
        let metrics = Arc::new(Metrics::new());
        let r = RemoteIndexer::new(
            bus.clone(),
            "m",
            "ns.model.m.indexer.find_matches".into(),
            Duration::from_millis(50),
            BreakerConfig::new(0, Duration::from_secs(1), Duration::from_millis(50)),
            metrics.clone(),
        );
        let (asked, _hung) = hung_indexer(&bus).await;
        for _ in 0..10 {
            assert!(r.find_matches(16, &lh(&[1])).await.is_empty());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 10);
        assert!(!r.breaker_open());
        assert_eq!(series(&metrics, "kvrouter_remote_indexer_skipped_total"), 0);
    }

    #[tokio::test]
    async fn decisions_with_unpaired_hashes_are_not_published() {
        let p = DecisionPublisher::new(Bus::local(), "ns.model.m.indexer.record".into());
        assert!(p
            .publish(WorkerKey::new(1, 0), lh(&[1, 2]), sh(&[1]))
            .await
            .is_err());
        assert!(p
            .publish(WorkerKey::new(1, 0), lh(&[1, 2]), sh(&[1, 9]))
            .await
            .is_ok());
    }
}
