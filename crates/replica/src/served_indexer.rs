//! The served indexer (`--serve-indexer`): the replica answers other replicas'
//! find_matches queries from its own index, and (in approximate mode) records the route
//! decisions every replica publishes.
//!
//! Per model, two tasks:
//! - queries (`NS.model.MODEL.indexer.find_matches`, queue group `kvrouter-indexers`): the
//!   task subscribes only once the model is ready (discovery window over and every known rank
//!   synced, as `/readyz`), so a serving indexer that is still fetching worker state never
//!   steals a query; if the model falls out of sync later (a rank joins and is fetched), it
//!   answers `Unavailable` until synced again, and the asker routes on load alone.
//! - records (`NS.model.MODEL.indexer.record`, no queue group, approximate mode only): every
//!   serving indexer records every published decision, so they all hold the same index and
//!   losing one costs no routing quality.

use crate::metrics::{Metrics, ModelLabels};
use crate::state::{ModelShared, ModelStatus};
use bytes::Bytes;
use kvrouter_bus::{Bus, Subscription};
use kvrouter_indexer::ShardedIndex;
use kvrouter_protocol::{
    decode, encode, ErrorKind, ErrorReply, IndexerQuery, IndexerRecord, LocalBlockHash,
    OverlapScoresReply, Reply, WorkerKey,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How often a serving indexer that is not ready yet checks again before subscribing.
const READY_POLL: Duration = Duration::from_millis(20);
/// Wait before retrying a failed subscription.
const SUBSCRIBE_RETRY: Duration = Duration::from_secs(1);

/// Whether a model's index may answer: the first roll call had its window and every known
/// rank is synced (the per-model part of `/readyz`).
pub fn model_ready(status: &ModelStatus) -> Result<(), String> {
    if !status.discovered.load(Ordering::Relaxed) {
        return Err("discovering workers".into());
    }
    let unsynced = status.unsynced.load(Ordering::Relaxed);
    if unsynced > 0 {
        return Err(format!(
            "{unsynced} of {} worker ranks still syncing",
            status.ranks.load(Ordering::Relaxed)
        ));
    }
    Ok(())
}

/// Plain core: the answer to one query, given readiness, this index's block size and its
/// lookup.
pub fn answer(
    query: &IndexerQuery,
    ready: Result<(), String>,
    block_size: Option<u32>,
    find: impl FnOnce(&[LocalBlockHash]) -> Vec<(WorkerKey, u32)>,
) -> Result<OverlapScoresReply, ErrorReply> {
    ready.map_err(|why| {
        ErrorReply::new(
            ErrorKind::Unavailable,
            format!("this serving indexer is not synced: {why}"),
        )
    })?;
    let block_size = block_size
        .ok_or_else(|| ErrorReply::new(ErrorKind::NoWorkers, "no worker has registered yet"))?;
    if query.block_size != block_size {
        return Err(ErrorReply::new(
            ErrorKind::InvalidRequest,
            format!(
                "block size {} asked, this index uses {block_size}",
                query.block_size
            ),
        ));
    }
    Ok(OverlapScoresReply {
        block_size,
        scores: find(&query.local_hashes),
    })
}

fn encode_reply(result: Result<OverlapScoresReply, ErrorReply>) -> Bytes {
    let reply: Reply<OverlapScoresReply> = result.into();
    match encode(&reply) {
        Ok(b) => Bytes::from(b),
        Err(e) => {
            let err: Reply<OverlapScoresReply> =
                Reply::Err(ErrorReply::new(ErrorKind::Internal, e.to_string()));
            Bytes::from(encode(&err).unwrap_or_default())
        }
    }
}

/// Answers one model's find_matches queries once it is ready (see the module docs).
pub fn spawn_queries(model: Arc<ModelShared>, bus: Bus, metrics: Arc<Metrics>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let labels = Metrics::model(&model.name);
        let subject = model.subjects.indexer_find_matches();
        let group = kvrouter_protocol::subjects::INDEXER_QUEUE_GROUP;
        while model_ready(&model.status).is_err() {
            tokio::time::sleep(READY_POLL).await;
        }
        let mut sub = loop {
            match bus.queue_subscribe(&subject, group).await {
                Ok(s) => break s,
                Err(e) => {
                    tracing::error!(model = %model.name, %subject, error = %e, "cannot serve the index; retrying");
                    tokio::time::sleep(SUBSCRIBE_RETRY).await;
                }
            }
        };
        let _ = bus.flush().await;
        tracing::info!(model = %model.name, %subject, "serving the index");
        while let Some(msg) = sub.next().await {
            let Some(reply_to) = msg.reply else {
                continue;
            };
            let result = match decode::<IndexerQuery>(&msg.payload) {
                Ok(q) => answer(
                    &q,
                    model_ready(&model.status),
                    model.status.block_size(),
                    |local| model.index.find_matches(local).scores,
                ),
                Err(e) => Err(ErrorReply::new(
                    ErrorKind::Malformed,
                    format!("cannot decode the query: {e}"),
                )),
            };
            let counter = if result.is_ok() {
                &metrics.served_indexer_queries
            } else {
                &metrics.served_indexer_refusals
            };
            counter.get_or_create(&labels).inc();
            if let Err(e) = bus.publish(&reply_to, encode_reply(result)).await {
                tracing::debug!(error = %e, "cannot answer an index query (the asker may have gone)");
            }
        }
    })
}

/// Records the route decisions published for one model in its (approximate) index.
pub fn spawn_records(
    model: String,
    mut sub: Subscription,
    index: Arc<ShardedIndex>,
    metrics: Arc<Metrics>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let labels: ModelLabels = Metrics::model(&model);
        while let Some(msg) = sub.next().await {
            let result = match decode::<IndexerRecord>(&msg.payload) {
                Ok(r) => index
                    .record_routing_decision(r.key, r.local_hashes, r.sequence_hashes)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(format!("undecodable record: {e}")),
            };
            match result {
                Ok(()) => metrics.served_indexer_records.get_or_create(&labels).inc(),
                Err(e) => {
                    tracing::debug!(%model, error = %e, "published route decision not recorded");
                    metrics.approx_record_failures.get_or_create(&labels).inc()
                }
            };
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(block_size: u32) -> IndexerQuery {
        IndexerQuery {
            block_size,
            local_hashes: [1, 2, 3].map(LocalBlockHash).to_vec(),
        }
    }

    fn find(local: &[LocalBlockHash]) -> Vec<(WorkerKey, u32)> {
        vec![(WorkerKey::new(4, 1), local.len() as u32)]
    }

    #[test]
    fn a_synced_index_answers() {
        let r = answer(&query(16), Ok(()), Some(16), find).unwrap();
        assert_eq!(r.block_size, 16);
        assert_eq!(r.scores, vec![(WorkerKey::new(4, 1), 3)]);
    }

    #[test]
    fn an_unsynced_index_refuses_so_the_asker_falls_back() {
        let e = answer(&query(16), Err("1 of 2 syncing".into()), Some(16), find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert!(e.message.contains("1 of 2 syncing"));
    }

    #[test]
    fn another_block_size_or_none_yet_is_refused() {
        let e = answer(&query(32), Ok(()), Some(16), find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        let e = answer(&query(16), Ok(()), None, find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NoWorkers);
    }

    #[test]
    fn readiness_follows_discovery_and_sync() {
        let st = ModelStatus::default();
        assert!(model_ready(&st).is_err());
        st.discovered.store(true, Ordering::Relaxed);
        assert!(model_ready(&st).is_ok());
        st.ranks.store(2, Ordering::Relaxed);
        st.unsynced.store(1, Ordering::Relaxed);
        assert_eq!(
            model_ready(&st).unwrap_err(),
            "1 of 2 worker ranks still syncing"
        );
    }
}
