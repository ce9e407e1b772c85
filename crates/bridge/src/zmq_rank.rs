//! One data-parallel rank's ZMQ stream: subscribe to the engine's publisher, read the
//! three-frame messages, follow the sequence numbers, fill gaps from the replay endpoint,
//! and hand decoded batches to the mirror task in order.

use crate::engine_event::{decode_batch, EngineBatch};
use crate::metrics::{BridgeMetrics, RankLabel, ReasonLabel};
use crate::mirror_task::MirrorCmd;
use crate::sequence::{catch_up_run, replay_covers, Rejoined, SeqStep, SeqTracker};
use bytes::Bytes;
use kvrouter_protocol::DpRank;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Reconnect backoff, doubling up to the cap.
const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(8);
/// The replay end marker: sequence number -1.
const END_SEQ: [u8; 8] = [0xff; 8];
/// A malformed-input warning of one kind is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// What a catch-up replay did.
enum CatchUp {
    /// Nothing to apply (no replay endpoint, nothing buffered, or it failed).
    Nothing,
    /// Batches up to this sequence number were applied.
    Applied(u64),
    MirrorGone,
}

/// Whether each rank's publisher is connected (for `/readyz`).
#[derive(Default)]
pub struct RankConnected(pub AtomicBool);

pub struct RankStream {
    pub rank: DpRank,
    pub endpoint: String,
    /// Bind `endpoint` and let the engine's publisher connect, instead of connecting.
    pub bind: bool,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub replay_timeout: Duration,
    pub mirror: mpsc::Sender<MirrorCmd>,
    pub metrics: Arc<BridgeMetrics>,
    pub connected: Arc<RankConnected>,
    /// Bumped when the engine comes back after its health check failed: connect afresh
    /// (a new engine process publishes on a new socket).
    pub reconnect: watch::Receiver<u64>,
}

/// At most one warning per kind per minute, with how many were suppressed.
#[derive(Default)]
struct LogLimiter {
    last: HashMap<&'static str, (Instant, u64)>,
}

impl LogLimiter {
    /// `Some(suppressed since the last one)` if this one may be logged.
    fn allow(&mut self, kind: &'static str) -> Option<u64> {
        let now = Instant::now();
        match self.last.get_mut(kind) {
            Some((at, n)) if now.duration_since(*at) < LOG_EVERY => {
                *n += 1;
                None
            }
            Some((at, n)) => {
                let s = *n;
                *at = now;
                *n = 0;
                Some(s)
            }
            None => {
                self.last.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

impl RankStream {
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut seq = SeqTracker::default();
        let mut logs = LogLimiter::default();
        let mut backoff = BACKOFF_START;
        let label = RankLabel { dp_rank: self.rank };
        // What the engine published before this point is unknown: at the bridge's start
        // (the engine may have run, and cached, long before), and after the engine came
        // back (its sequence numbers may start again anywhere below or above the last).
        let mut from_start = true;
        // A bound socket outlives the engine's comings and goings (its publisher reconnects
        // to it); unbinding would only open a window where its batches go nowhere.
        let mut held: Option<(SubSocket, futures_channel::mpsc::Receiver<SocketEvent>)> = None;
        // Publishers connected to a bound socket.
        let mut peers = 0usize;
        loop {
            let reuse = held.is_some();
            let (mut socket, mut monitor) = held.take().unwrap_or_else(|| {
                peers = 0;
                let mut socket = SubSocket::new();
                let monitor = socket.monitor();
                (socket, monitor)
            });
            let connected = if reuse {
                Ok(Ok(()))
            } else {
                let connect = async {
                    if self.bind {
                        socket.bind(&self.endpoint).await?;
                    } else {
                        socket.connect(&self.endpoint).await?;
                    }
                    socket.subscribe(&self.topic).await
                };
                tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                // The engine is back while this socket was still trying the old one's port:
                // connect afresh at once rather than after the connect's own backoff.
                _ = self.reconnect.changed() => {
                    seq.reset();
                    from_start = true;
                    backoff = BACKOFF_START;
                    continue;
                }
                r = tokio::time::timeout(BACKOFF_MAX, connect) => r,
                }
            };
            match connected {
                Ok(Ok(())) => {
                    backoff = BACKOFF_START;
                    // The engine came back while this socket was connecting: the same as
                    // being told so while connected.
                    if self.reconnect.has_changed().unwrap_or(false) {
                        seq.reset();
                        from_start = true;
                    }
                    self.reconnect.borrow_and_update();
                    if !self.bind {
                        self.set_connected(true);
                        tracing::info!(dp_rank = self.rank, endpoint = %self.endpoint, "connected to the engine's KV event publisher");
                    } else if !reuse {
                        self.set_connected(false);
                        tracing::info!(dp_rank = self.rank, endpoint = %self.endpoint, "listening for the engine's KV event publisher to connect");
                    }
                }
                other => {
                    self.set_connected(false);
                    if logs.allow("connect").is_some() {
                        let why = match other {
                            Ok(Err(e)) => e.to_string(),
                            _ => "timed out".into(),
                        };
                        let what = if self.bind {
                            "cannot bind the endpoint the engine's KV event publisher connects to; retrying"
                        } else {
                            "cannot connect to the engine's KV event publisher; retrying"
                        };
                        tracing::warn!(dp_rank = self.rank, endpoint = %self.endpoint, error = %why, "{what}");
                    }
                    tokio::select! {
                        _ = shutdown.wait_for(|s| *s) => return,
                        _ = self.reconnect.changed() => {
                            seq.reset();
                            from_start = true;
                            backoff = BACKOFF_START;
                            continue;
                        }
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            }
            // Whatever the engine published while nobody listened, from its replay buffer,
            // before the live stream: without it a bridge started (or reconnected) beside a
            // running engine would not know what the engine already caches, and nothing
            // would tell it until those blocks were evicted.
            let from = match (from_start, seq.last()) {
                (false, Some(last)) => match self.rejoin(&seq, last).await {
                    Rejoined::Restarted => {
                        if self
                            .send(MirrorCmd::Restarted { rank: self.rank })
                            .await
                            .is_err()
                        {
                            return;
                        }
                        seq.reset();
                        from_start = true;
                        0
                    }
                    Rejoined::Same | Rejoined::Unknown => last + 1,
                },
                _ => 0,
            };
            // Live batches the catch-up already applied (they were queued meanwhile).
            let mut applied: Option<(u64, u64)> = None;
            // Keep the bound socket for the next round (only a reconnect signal ends a round
            // with the socket still sound).
            let mut keep = false;
            match self.catch_up(&mut seq, from, &mut logs).await {
                CatchUp::MirrorGone => return,
                CatchUp::Nothing => {}
                CatchUp::Applied(last) => {
                    from_start = false;
                    applied = Some((from, last));
                }
            }
            // Until the publisher goes away: then a fresh socket (a restarted engine is a
            // new peer; the socket's own reconnection is not relied on).
            loop {
                let msg = tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return,
                    _ = self.reconnect.changed() => {
                        seq.reset();
                        from_start = true;
                        keep = self.bind;
                        break;
                    }
                    ev = futures_next(&mut monitor) => match ev {
                        None => break,
                        Some(SocketEvent::Disconnected(_)) if !self.bind => break,
                        Some(SocketEvent::Accepted(..)) => {
                            peers += 1;
                            self.set_connected(true);
                            tracing::info!(dp_rank = self.rank, endpoint = %self.endpoint, peers, "the engine's KV event publisher connected");
                            continue;
                        }
                        // A bound socket stays: the publisher (or a restarted engine's) comes
                        // back to it; the sequence numbers tell what it missed meanwhile.
                        Some(SocketEvent::Disconnected(_)) => {
                            peers = peers.saturating_sub(1);
                            if peers == 0 {
                                self.set_connected(false);
                                tracing::info!(dp_rank = self.rank, endpoint = %self.endpoint, "the engine's KV event publisher went away; waiting for it to connect again");
                            }
                            continue;
                        }
                        _ => continue,
                    },
                    m = socket.recv() => m,
                };
                let msg = match msg {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::debug!(dp_rank = self.rank, error = %e, "ZMQ receive failed");
                        break;
                    }
                };
                self.metrics.batches.get_or_create(&label).inc();
                let Some((s, payload)) = self.frames(msg, &mut logs) else {
                    continue;
                };
                if let Some((first, last)) = applied {
                    if (first..=last).contains(&s) {
                        continue;
                    }
                    applied = None;
                }
                let from_start = std::mem::take(&mut from_start);
                if !self
                    .on_message(&mut seq, s, payload, from_start, &mut logs)
                    .await
                {
                    return;
                }
            }
            if keep {
                held = Some((socket, monitor));
                continue;
            }
            self.set_connected(false);
            tracing::info!(dp_rank = self.rank, endpoint = %self.endpoint, "the engine's KV event publisher went away; connecting again");
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(BACKOFF_START) => {}
            }
        }
    }

    /// Who publishes behind a connection made again after batches were applied: a restarted
    /// engine's new publisher counts from 0 again, and its first batches may have gone out
    /// while the bridge reconnected, so the numbers alone cannot tell (asks the replay
    /// endpoint from the last batch applied; `Unknown` without one).
    async fn rejoin(&self, seq: &SeqTracker, last: u64) -> Rejoined {
        let Some(endpoint) = self.replay_endpoint.as_deref() else {
            return Rejoined::Unknown;
        };
        match tokio::time::timeout(self.replay_timeout, replay_from(endpoint, last)).await {
            Ok(Ok(got)) => {
                let r = seq.rejoined(got.iter().map(|(s, p)| (*s, &p[..])));
                if r == Rejoined::Restarted {
                    tracing::info!(
                        dp_rank = self.rank,
                        last,
                        "the engine's KV event publisher no longer holds the last batch seen \
                         as it was: a new process (the engine restarted)"
                    );
                }
                r
            }
            _ => Rejoined::Unknown,
        }
    }

    /// Applies every batch the replay endpoint holds from `from` on (the run of consecutive
    /// ones), and has the stream go on after the last. Batches the endpoint no longer holds
    /// are lost: the rank is cleared first when it held anything of this engine (`from` > 0),
    /// and the rest still applies (the mirror refuses blocks whose parents it lacks, so it
    /// holds part of the engine's cache, never more).
    async fn catch_up(&self, seq: &mut SeqTracker, from: u64, logs: &mut LogLimiter) -> CatchUp {
        let Some(endpoint) = self.replay_endpoint.as_deref() else {
            return CatchUp::Nothing;
        };
        let got = match tokio::time::timeout(self.replay_timeout, replay_from(endpoint, from)).await
        {
            Ok(Ok(got)) => got,
            Ok(Err(e)) => {
                tracing::warn!(dp_rank = self.rank, endpoint, error = %e, "catch-up replay failed");
                return CatchUp::Nothing;
            }
            Err(_) => {
                tracing::warn!(dp_rank = self.rank, endpoint, "catch-up replay timed out");
                return CatchUp::Nothing;
            }
        };
        let Some((first, last)) = catch_up_run(from, got.iter().map(|(s, _)| *s)) else {
            return CatchUp::Nothing;
        };
        let label = RankLabel { dp_rank: self.rank };
        if first > from {
            self.metrics.gaps.get_or_create(&label).inc();
            tracing::warn!(
                dp_rank = self.rank,
                from,
                first,
                "the engine's replay buffer no longer holds every batch since the last one \
                 seen (or since it started): the router lacks what those batches cached until \
                 the engine caches it again"
            );
            if from > 0
                && self
                    .send(MirrorCmd::Lost { rank: self.rank })
                    .await
                    .is_err()
            {
                return CatchUp::MirrorGone;
            }
        }
        let n = last - first + 1;
        seq.caught_up_to(last);
        for (s, payload) in got.into_iter().filter(|(s, _)| (first..=last).contains(s)) {
            seq.applied(s, &payload);
            if !self.apply(payload, logs).await {
                return CatchUp::MirrorGone;
            }
        }
        self.metrics.caught_up.get_or_create(&label).inc_by(n);
        tracing::info!(
            dp_rank = self.rank,
            first,
            last,
            "caught up on the engine's KV event batches from its replay buffer"
        );
        CatchUp::Applied(last)
    }

    fn set_connected(&self, up: bool) {
        self.connected.0.store(up, Ordering::Relaxed);
        self.metrics
            .zmq_connected
            .get_or_create(&RankLabel { dp_rank: self.rank })
            .set(i64::from(up));
    }

    fn malformed(&self, kind: &'static str, why: &str, logs: &mut LogLimiter) {
        self.metrics
            .malformed
            .get_or_create(&ReasonLabel { reason: kind })
            .inc();
        if let Some(suppressed) = logs.allow(kind) {
            tracing::warn!(dp_rank = self.rank, kind, suppressed, "{why}");
        }
    }

    /// A batch's bad events are skipped (the mirror counts them, in `events_skipped`) and
    /// the good ones around them still apply; a warning at most once a minute.
    fn bad_events(&self, batch: &EngineBatch, logs: &mut LogLimiter) {
        let bad = batch.bad_events();
        if bad == 0 {
            return;
        }
        if let Some(suppressed) = logs.allow("event") {
            let first = batch.first_error().map(ToString::to_string);
            tracing::warn!(
                dp_rank = self.rank,
                bad,
                suppressed,
                first = first.as_deref().unwrap_or(""),
                "engine KV events that cannot be used were skipped; the rest of their batch applies"
            );
        }
    }

    /// `[topic, seq (8 bytes big-endian), payload]`.
    fn frames(&self, msg: ZmqMessage, logs: &mut LogLimiter) -> Option<(u64, Bytes)> {
        let frames = msg.into_vec();
        if frames.len() != 3 {
            let why = format!(
                "a KV event message has {} frames, not 3; skipped",
                frames.len()
            );
            self.malformed("frames", &why, logs);
            return None;
        }
        let Ok(seq) = <[u8; 8]>::try_from(&frames[1][..]) else {
            let why = format!(
                "a sequence number has {} bytes, not 8; skipped",
                frames[1].len()
            );
            self.malformed("sequence", &why, logs);
            return None;
        };
        Some((u64::from_be_bytes(seq), frames[2].clone()))
    }

    /// Returns false once the mirror task is gone.
    async fn on_message(
        &self,
        seq: &mut SeqTracker,
        s: u64,
        payload: Bytes,
        from_start: bool,
        logs: &mut LogLimiter,
    ) -> bool {
        let missing = match seq.observe(s) {
            SeqStep::First if from_start => (s > 0).then_some((0, s)),
            SeqStep::First | SeqStep::Next => None,
            // The new process's first batches went out while the bridge was reconnecting:
            // they are missing as surely as a gap's.
            SeqStep::Restart => {
                if self
                    .send(MirrorCmd::Restarted { rank: self.rank })
                    .await
                    .is_err()
                {
                    return false;
                }
                (s > 0).then_some((0, s))
            }
            SeqStep::Gap { from, to } => Some((from, to)),
        };
        if let Some((from, to)) = missing {
            let label = RankLabel { dp_rank: self.rank };
            self.metrics.gaps.get_or_create(&label).inc();
            match self.replay(from, to).await {
                Some(batches) => {
                    self.metrics.gaps_replayed.get_or_create(&label).inc();
                    tracing::info!(
                        dp_rank = self.rank,
                        from,
                        to,
                        "lost KV event batches replayed"
                    );
                    for payload in batches {
                        if !self.apply(payload, logs).await {
                            return false;
                        }
                    }
                }
                None => {
                    tracing::warn!(
                        dp_rank = self.rank,
                        missing = to - from,
                        replay = self.replay_endpoint.is_some(),
                        "KV event batches lost for good (no replay endpoint, or it no longer \
                             holds them): clearing the rank; the router loses its cache affinity \
                             until the engine caches again"
                    );
                    if self
                        .send(MirrorCmd::Lost { rank: self.rank })
                        .await
                        .is_err()
                    {
                        return false;
                    }
                }
            }
        }
        seq.applied(s, &payload);
        self.apply(payload, logs).await
    }

    /// Decodes one payload and hands it over; an undecodable one loses the rank's state as
    /// surely as a lost batch does, so it clears the rank.
    async fn apply(&self, payload: Bytes, logs: &mut LogLimiter) -> bool {
        let cmd = match decode_batch(&payload) {
            Ok(batch) => {
                self.bad_events(&batch, logs);
                MirrorCmd::Batch {
                    rank: self.rank,
                    events: batch.events,
                    more_bad: batch.more_bad,
                }
            }
            Err(e) => {
                self.malformed("payload", &format!("{e}; clearing the rank"), logs);
                MirrorCmd::Lost { rank: self.rank }
            }
        };
        self.send(cmd).await.is_ok()
    }

    async fn send(&self, cmd: MirrorCmd) -> Result<(), ()> {
        self.mirror.send(cmd).await.map_err(|_| ())
    }

    /// The batches `from .. to` from the replay endpoint, in order; `None` if they cannot all
    /// be had.
    async fn replay(&self, from: u64, to: u64) -> Option<Vec<Bytes>> {
        let endpoint = self.replay_endpoint.as_deref()?;
        let got = tokio::time::timeout(self.replay_timeout, replay_from(endpoint, from))
            .await
            .ok()
            .and_then(|r| {
                r.map_err(
                    |e| tracing::warn!(dp_rank = self.rank, endpoint, error = %e, "replay failed"),
                )
                .ok()
            })?;
        if !replay_covers(from, to, got.iter().map(|(s, _)| *s)) {
            return None;
        }
        Some(
            got.into_iter()
                .filter(|(s, _)| (from..to).contains(s))
                .map(|(_, p)| p)
                .collect(),
        )
    }
}

async fn futures_next(
    monitor: &mut futures_channel::mpsc::Receiver<SocketEvent>,
) -> Option<SocketEvent> {
    use futures_util::StreamExt;
    monitor.next().await
}

/// Asks a replay endpoint (a ROUTER) for every batch from `from` on: a DEALER sends
/// `["", from]`; the answers are `["", seq, payload]` (or with the topic first, vLLM 0.26+)
/// until `seq` is -1.
async fn replay_from(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, zeromq::ZmqError> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await?;
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(req).await?;
    let mut out = Vec::new();
    loop {
        let mut frames = dealer.recv().await?.into_vec();
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        // [seq, payload] or [topic, seq, payload]
        let (seq, payload) = match frames.len() {
            2 => (&frames[0], &frames[1]),
            3 => (&frames[1], &frames[2]),
            _ => continue,
        };
        if seq[..] == END_SEQ {
            return Ok(out);
        }
        if let Ok(s) = <[u8; 8]>::try_from(&seq[..]) {
            out.push((u64::from_be_bytes(s), payload.clone()));
        }
    }
}
