//! One simulated worker's bus endpoints (`generate`, `state`, `drop_events`, `rank_live`).
//! Its shared state is in [`crate::mock_info`], its KV event / load publisher is the worker
//! crate's, its ranks run in [`crate::rank_task`].

use crate::engine::{OutputKind, Request, SubmitError};
use crate::mock_info::MockInfo;
use crate::rank_task::{RankCmd, RankOut};
use kvrouter_bus::{Bus, Message, Subscription};
use kvrouter_protocol::{
    decode, max_blocks_per_batch, reply_version, DpRank, ErrorKind, ErrorReply, GenerateEvent,
    GenerateRequest, ModelSubjects, RankLiveness, Reply, StateChunk, StateQuery, TierBlocks,
    WorkerKey,
};
use kvrouter_worker::{publish_as, send_error_stream, send_state, set_rank_live, stopped, PubMsg};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// Generated tokens travel in batches of at most this many inter-token latencies...
pub(crate) const TOKEN_BATCH: usize = 16;
/// ...and wait at most this long (wall) in a batch.
pub(crate) const TOKEN_BATCH_WAIT: Duration = Duration::from_millis(20);

/// The subscriptions of one worker's endpoints.
pub(crate) struct EndpointSubs {
    pub generate: Subscription,
    pub state: Subscription,
    pub drop_events: Subscription,
    pub rank_live: Subscription,
}

/// Serves one worker's `generate`, `state`, `drop_events` and `rank_live` subjects.
pub(crate) struct Endpoints {
    pub bus: Bus,
    pub info: Arc<MockInfo>,
    pub ranks: Vec<mpsc::UnboundedSender<RankCmd>>,
    pub publisher: mpsc::UnboundedSender<PubMsg>,
    pub subjects: ModelSubjects,
}

impl Endpoints {
    pub(crate) async fn run(self, mut subs: EndpointSubs, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break,
                msg = subs.generate.next() => match msg {
                    Some(msg) => self.on_generate(msg, &shutdown),
                    None => break,
                },
                msg = subs.state.next() => match msg {
                    Some(msg) => self.on_state(msg),
                    None => break,
                },
                msg = subs.drop_events.next() => match msg {
                    Some(msg) => self.on_drop_events(msg),
                    None => break,
                },
                msg = subs.rank_live.next() => match msg {
                    Some(msg) => self.on_rank_live(msg).await,
                    None => break,
                },
            }
        }
    }

    fn rank_error(&self, rank: DpRank) -> ErrorReply {
        let info = &self.info;
        let range = info.dp_start_rank..info.dp_start_rank.saturating_add(info.dp_size);
        let message = if info.rank_index(rank).is_some() {
            format!(
                "rank {rank} of worker {} is not live (live ranks {:?})",
                info.worker_id,
                info.live_ranks()
            )
        } else {
            format!(
                "worker {} has no rank {rank} (ranks {}..{})",
                info.worker_id, range.start, range.end
            )
        };
        ErrorReply::new(ErrorKind::InvalidRank, message)
    }

    fn on_generate(&self, msg: Message, shutdown: &watch::Receiver<bool>) {
        let version = reply_version(&msg.payload);
        let Some(reply) = msg.reply else {
            tracing::debug!(
                worker_id = self.info.worker_id,
                "generate without a reply subject; ignored"
            );
            return;
        };
        let bus = self.bus.clone();
        let req: GenerateRequest = match decode(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                let err =
                    ErrorReply::new(ErrorKind::Malformed, format!("bad GenerateRequest: {e}"));
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    GenerateEvent::Error(err),
                    version,
                ));
                return;
            }
        };
        let Some(index) = self.info.live_rank_index(req.dp_rank) else {
            let err = self.rank_error(req.dp_rank);
            tokio::spawn(send_error_stream(
                bus,
                reply,
                GenerateEvent::Error(err),
                version,
            ));
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = crate::disagg::hook(
            &self.bus,
            &self.subjects.kv_transfer(self.info.worker_id),
            &self.info,
            req.dp_rank,
            &req.request_id,
            rx,
        );
        let request = Request {
            request_id: req.request_id,
            tokens: req.tokens,
            max_tokens: crate::disagg::max_tokens_for(self.info.role, req.max_tokens),
        };
        if crate::disagg::kv_transferred(self.info.role) {
            // The rank gets the request once every tp rank has received its KV.
            let receive = crate::disagg::Receive {
                bus: self.bus.clone(),
                subject: self.subjects.kv_transfer(self.info.worker_id),
                info: self.info.clone(),
                dp_rank: req.dp_rank,
                request,
                rank: self.ranks[index].clone(),
                out: tx,
            };
            tokio::spawn(receive.run(shutdown.clone()));
        } else {
            let sent = self.ranks[index].send(RankCmd::Submit {
                request,
                transferred: None,
                out: tx,
            });
            if sent.is_err() {
                let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    GenerateEvent::Error(err),
                    version,
                ));
                return;
            }
        }
        tokio::spawn(stream_generate(bus, reply, rx, version));
    }

    fn on_state(&self, msg: Message) {
        let version = reply_version(&msg.payload);
        let Some(reply) = msg.reply else {
            tracing::debug!(
                worker_id = self.info.worker_id,
                "state query without a reply subject; ignored"
            );
            return;
        };
        let bus = self.bus.clone();
        let query: StateQuery = match decode(&msg.payload) {
            Ok(q) => q,
            Err(e) => {
                let err = ErrorReply::new(ErrorKind::Malformed, format!("bad StateQuery: {e}"));
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    Reply::<StateChunk>::Err(err),
                    version,
                ));
                return;
            }
        };
        let Some(index) = self.info.live_rank_index(query.dp_rank) else {
            let err = self.rank_error(query.dp_rank);
            tokio::spawn(send_error_stream(
                bus,
                reply,
                Reply::<StateChunk>::Err(err),
                version,
            ));
            return;
        };
        let max_blocks = max_blocks_per_batch(bus.max_payload());
        let (tx, rx) = oneshot::channel();
        let sent = self.ranks[index].send(RankCmd::Snapshot {
            max_blocks,
            reply: tx,
        });
        if sent.is_err() {
            let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
            tokio::spawn(send_error_stream(
                bus,
                reply,
                Reply::<StateChunk>::Err(err),
                version,
            ));
            return;
        }
        let key = WorkerKey::new(self.info.worker_id, query.dp_rank);
        let instance_id = self.info.instance_id();
        tokio::spawn(async move {
            let Ok(snapshot) = rx.await else {
                let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
                send_error_stream(bus, reply, Reply::<StateChunk>::Err(err), version).await;
                return;
            };
            send_state(&bus, &reply, key, instance_id, snapshot, version).await;
        });
    }

    fn on_drop_events(&self, msg: Message) {
        let result = match decode::<u64>(&msg.payload) {
            Ok(n) => {
                tracing::info!(
                    worker_id = self.info.worker_id,
                    n,
                    "will drop the next KV event batches"
                );
                let _ = self.publisher.send(PubMsg::DropBatches(n));
                Reply::Ok(())
            }
            Err(e) => Reply::Err(ErrorReply::new(
                ErrorKind::Malformed,
                format!("drop_events expects a u64: {e}"),
            )),
        };
        if let Some(reply) = msg.reply {
            let bus = self.bus.clone();
            let version = reply_version(&msg.payload);
            tokio::spawn(async move { publish_as(&bus, &reply, &result, version).await });
        }
    }

    async fn on_rank_live(&self, msg: Message) {
        let result = match decode::<RankLiveness>(&msg.payload) {
            Ok(RankLiveness { dp_rank, live }) => match self.info.rank_index(dp_rank) {
                Some(index) => {
                    set_rank_live(&self.bus, &self.subjects, &self.info.worker, index, live).await;
                    Reply::Ok(())
                }
                None => Reply::Err(self.rank_error(dp_rank)),
            },
            Err(e) => Reply::Err(ErrorReply::new(
                ErrorKind::Malformed,
                format!("rank_live expects a RankLiveness: {e}"),
            )),
        };
        if let Some(reply) = msg.reply {
            publish_as(&self.bus, &reply, &result, reply_version(&msg.payload)).await;
        }
    }
}

fn submit_error(e: &SubmitError) -> ErrorReply {
    let kind = match e {
        SubmitError::EmptyPrompt => ErrorKind::EmptyPrompt,
        SubmitError::TooLong { .. } | SubmitError::PromptExceedsBatch { .. } => {
            ErrorKind::PromptTooLong
        }
        SubmitError::DuplicateRequestId(_) => ErrorKind::DuplicateRequest,
    };
    ErrorReply::new(kind, e.to_string())
}

fn micros_u64(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn micros_u32(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Streams one request's progress to its reply subject: `PrefillDone` at once, `Tokens` in
/// batches, `Done`, then the end of the stream.
async fn stream_generate(
    bus: Bus,
    reply: String,
    mut rx: mpsc::UnboundedReceiver<RankOut>,
    version: u8,
) {
    let mut itl: Vec<u32> = Vec::new();
    let mut flush_at: Option<Instant> = None;
    loop {
        let out = tokio::select! {
            biased;
            out = rx.recv() => out,
            _ = tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)), if flush_at.is_some() => {
                flush_at = None;
                let itl_us = std::mem::take(&mut itl);
                if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                    return;
                }
                continue;
            }
        };
        let event = match out {
            None => GenerateEvent::Error(ErrorReply::new(
                ErrorKind::Unavailable,
                "the worker stopped before the request finished",
            )),
            Some(RankOut::Rejected(e)) => GenerateEvent::Error(submit_error(&e)),
            Some(RankOut::Failed(e)) => GenerateEvent::Error(e),
            Some(RankOut::Output(OutputKind::PrefillDone {
                cached_blocks,
                host_blocks,
                disk_blocks,
                prompt_blocks,
                ttft,
            })) => {
                let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
                GenerateEvent::PrefillDone {
                    ttft_us: micros_u64(ttft),
                    cached_blocks: n(cached_blocks),
                    prompt_blocks: n(prompt_blocks),
                    tier_cached_blocks: TierBlocks {
                        device: n(cached_blocks - host_blocks - disk_blocks),
                        host: n(host_blocks),
                        disk: n(disk_blocks),
                        shared: 0,
                    },
                }
            }
            Some(RankOut::Output(OutputKind::Token { itl: d, .. })) => {
                itl.push(micros_u32(d));
                if itl.len() >= TOKEN_BATCH {
                    flush_at = None;
                    let itl_us = std::mem::take(&mut itl);
                    if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                        return;
                    }
                } else {
                    flush_at.get_or_insert_with(|| Instant::now() + TOKEN_BATCH_WAIT);
                }
                continue;
            }
            Some(RankOut::Output(OutputKind::Finished {
                output_tokens,
                latency,
            })) => GenerateEvent::Done {
                output_tokens,
                e2e_us: micros_u64(latency),
            },
        };
        let last = !matches!(event, GenerateEvent::PrefillDone { .. });
        if last && !itl.is_empty() {
            let itl_us = std::mem::take(&mut itl);
            if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                return;
            }
        }
        if !publish_as(&bus, &reply, &event, version).await {
            return;
        }
        if last {
            let _ = bus.end_stream(&reply).await;
            return;
        }
    }
}
