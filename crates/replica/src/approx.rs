//! Approximate mode (`--no-kv-events`): the replica hears no KV events, so every route
//! decision that updates state feeds the model's index instead: the request's blocks are
//! assumed cached on the chosen worker key until they expire (see
//! [`kvrouter_indexer::ApproxTracker`]).
//!
//! Recording never delays the route answer: it is handed to a task of its own, and a failure
//! is logged at debug and counted in `kvrouter_approx_record_failures_total`.

use crate::metrics::{Metrics, ModelLabels};
use crate::remote_indexer::DecisionPublisher;
use kvrouter_indexer::ShardedIndex;
use kvrouter_protocol::{LocalBlockHash, SequenceHash, WorkerKey};
use std::sync::Arc;

/// Records one model's route decisions in its (approximate-mode) index.
#[derive(Clone)]
pub struct DecisionRecorder {
    index: Arc<ShardedIndex>,
    metrics: Arc<Metrics>,
    labels: ModelLabels,
    /// With a served or remote indexer: decisions go to every serving indexer instead.
    publisher: Option<DecisionPublisher>,
}

impl DecisionRecorder {
    pub fn new(model: &str, index: Arc<ShardedIndex>, metrics: Arc<Metrics>) -> Self {
        Self {
            index,
            metrics,
            labels: Metrics::model(model),
            publisher: None,
        }
    }

    /// Publishes decisions to every serving indexer (`--serve-indexer` or
    /// `--use-remote-indexer`) instead of recording them in this replica's index.
    pub fn publishing(mut self, publisher: DecisionPublisher) -> Self {
        self.publisher = Some(publisher);
        self
    }

    /// Records that a request with these blocks was routed to `key`, without waiting for the
    /// index to acknowledge it.
    pub fn record(&self, key: WorkerKey, local: Vec<LocalBlockHash>, sequence: Vec<SequenceHash>) {
        if local.is_empty() {
            return; // no full block: nothing to assume cached
        }
        let this = self.clone();
        tokio::spawn(async move {
            let result = match &this.publisher {
                Some(p) => p.publish(key, local, sequence).await,
                None => this
                    .index
                    .record_routing_decision(key, local, sequence)
                    .await
                    .map_err(|e| e.to_string()),
            };
            match result {
                Ok(()) => {
                    this.metrics
                        .approx_records
                        .get_or_create(&this.labels)
                        .inc();
                }
                Err(e) => {
                    tracing::debug!(
                        model = %this.labels.model,
                        worker = key.worker_id,
                        dp_rank = key.dp_rank,
                        error = %e,
                        "route decision not recorded in the index"
                    );
                    this.metrics
                        .approx_record_failures
                        .get_or_create(&this.labels)
                        .inc();
                }
            }
        });
    }
}
