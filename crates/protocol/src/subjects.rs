//! Bus subjects: where each message of [`crate::messages`] travels.
//!
//! Everything lives under a namespace so fleets can share one NATS. Router endpoints are per
//! namespace (the model is in the payload, so an unknown model gets an error reply); worker
//! subjects are per model, the model name mapped to one subject token by [`model_token`].

use std::fmt::Write;
use thiserror::Error;

/// Queue group of the router endpoints: each request goes to one replica.
pub const ROUTER_QUEUE_GROUP: &str = "kvrouter-replicas";

/// Queue group of the serving indexers' find_matches: each query goes to one of them.
pub const INDEXER_QUEUE_GROUP: &str = "kvrouter-indexers";

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SubjectError {
    #[error("invalid namespace {0:?}: use letters, digits, '-' and '_', optionally in dot-separated parts")]
    Namespace(String),
    #[error("model name is empty")]
    EmptyModel,
}

/// Maps a model name to a valid NATS subject token, one-to-one: ASCII letters, digits, `-`
/// and `_` stay; every other byte (including `~`) becomes `~XX` (upper-case hex).
/// `Qwen/Qwen3-0.6B` → `Qwen~2FQwen3-0~2E6B`.
pub fn model_token(model: &str) -> Result<String, SubjectError> {
    if model.is_empty() {
        return Err(SubjectError::EmptyModel);
    }
    let mut out = String::with_capacity(model.len() + 8);
    for b in model.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            let _ = write!(out, "~{b:02X}");
        }
    }
    Ok(out)
}

fn valid_namespace(ns: &str) -> bool {
    !ns.is_empty()
        && ns.split('.').all(|t| {
            !t.is_empty()
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The namespace-wide subjects (router endpoints).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    ns: String,
}

impl Subjects {
    pub fn new(namespace: &str) -> Result<Self, SubjectError> {
        if !valid_namespace(namespace) {
            return Err(SubjectError::Namespace(namespace.to_string()));
        }
        Ok(Self {
            ns: namespace.to_string(),
        })
    }

    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// `RouteRequest` → `Reply<RouteDecision>` (queue group).
    pub fn route(&self) -> String {
        format!("{}.router.route", self.ns)
    }

    /// `DisaggRouteRequest` → `Reply<DisaggDecision>` (queue group).
    pub fn route_disagg(&self) -> String {
        format!("{}.router.route_disagg", self.ns)
    }

    /// `OverlapRequest` → `Reply<OverlapScoresReply>` (queue group).
    pub fn overlap_scores(&self) -> String {
        format!("{}.router.overlap_scores", self.ns)
    }

    /// `OverlapRequest` → `Reply<Vec<PotentialLoad>>` (queue group).
    pub fn potential_loads(&self) -> String {
        format!("{}.router.potential_loads", self.ns)
    }

    /// `RequestUpdate` → `Reply<()>`, to the replica that made the decision.
    pub fn mark_prefill(&self, replica_id: &str) -> String {
        format!("{}.router.replica.{replica_id}.mark_prefill", self.ns)
    }

    /// `RequestUpdate` → `Reply<()>`, to the replica that made the decision.
    pub fn free(&self, replica_id: &str) -> String {
        format!("{}.router.replica.{replica_id}.free", self.ns)
    }

    /// `SyncBatch`, published by every replica with `--replica-sync` to all the others.
    pub fn sync(&self) -> String {
        format!("{}.router.sync", self.ns)
    }

    /// `SyncStateRequest` → stream of `SyncBatch` (queue group of synced replicas).
    pub fn sync_state(&self) -> String {
        format!("{}.router.sync_state", self.ns)
    }

    pub fn model(&self, model: &str) -> Result<ModelSubjects, SubjectError> {
        Ok(ModelSubjects {
            prefix: format!("{}.model.{}", self.ns, model_token(model)?),
        })
    }
}

/// The subjects of one model's worker fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSubjects {
    prefix: String,
}

impl ModelSubjects {
    /// `Registration`, published by workers on start and after a `WhoIsThere`.
    pub fn register(&self) -> String {
        format!("{}.discovery.register", self.prefix)
    }

    /// `Heartbeat`, published by workers periodically.
    pub fn heartbeat(&self) -> String {
        format!("{}.discovery.heartbeat", self.prefix)
    }

    /// `Deregistration`, published by workers on shutdown.
    pub fn deregister(&self) -> String {
        format!("{}.discovery.deregister", self.prefix)
    }

    /// `WhoIsThere`, published by replicas; every worker answers with a `Registration`.
    pub fn who_is_there(&self) -> String {
        format!("{}.discovery.who_is_there", self.prefix)
    }

    /// `KvEventBatch`, published by workers.
    pub fn kv_events(&self) -> String {
        format!("{}.kv_events", self.prefix)
    }

    /// `LoadReport`, published by workers.
    pub fn load(&self) -> String {
        format!("{}.load", self.prefix)
    }

    /// `TransferReport`, published by each tensor-parallel rank of prefill and decode
    /// workers when KV transfers finish.
    pub fn kv_transfer(&self) -> String {
        format!("{}.kv_transfer", self.prefix)
    }

    /// `GenerateRequest` → stream of `GenerateEvent`, served by one worker.
    pub fn generate(&self, worker_id: u64) -> String {
        format!("{}.worker.{worker_id}.generate", self.prefix)
    }

    /// `StateQuery` → stream of `Reply<StateChunk>`, served by one worker.
    pub fn state(&self, worker_id: u64) -> String {
        format!("{}.worker.{worker_id}.state", self.prefix)
    }

    /// `IndexerQuery` → `Reply<OverlapScoresReply>`, answered by one serving indexer (queue
    /// group [`INDEXER_QUEUE_GROUP`]).
    pub fn indexer_find_matches(&self) -> String {
        format!("{}.indexer.find_matches", self.prefix)
    }

    /// `IndexerRecord`, published to every serving indexer (no queue group).
    pub fn indexer_record(&self) -> String {
        format!("{}.indexer.record", self.prefix)
    }

    /// `IndexerAnnouncement`, published by a serving indexer once it is synced and answering
    /// (no queue group): remote replicas ask it from their next lookup, whatever their
    /// breaker's cooldown.
    pub fn indexer_announce(&self) -> String {
        format!("{}.indexer.announce", self.prefix)
    }

    /// `IndexerDumpRequest` → stream of `Reply<IndexerDumpChunk>`: a serving indexer starting in
    /// approximate mode asks a peer (queue group [`INDEXER_QUEUE_GROUP`]) for its entries.
    pub fn indexer_dump(&self) -> String {
        format!("{}.indexer.dump", self.prefix)
    }

    /// Test hook: `u64` number of KV event batches the worker should drop (not publish).
    pub fn drop_events(&self, worker_id: u64) -> String {
        format!("{}.worker.{worker_id}.drop_events", self.prefix)
    }

    /// Test hook: a [`crate::RankLiveness`] takes one rank of the worker down or back up.
    pub fn rank_live(&self, worker_id: u64) -> String {
        format!("{}.worker.{worker_id}.rank_live", self.prefix)
    }
}

/// Every subject a fleet of `model` uses, as `(name, subject)`; `*` stands for a worker id or
/// a replica id.
pub fn fleet_subjects(
    namespace: &str,
    model: &str,
) -> Result<Vec<(&'static str, String)>, SubjectError> {
    let s = Subjects::new(namespace)?;
    let m = s.model(model)?;
    Ok(vec![
        ("route", s.route()),
        ("route_disagg", s.route_disagg()),
        ("overlap_scores", s.overlap_scores()),
        ("potential_loads", s.potential_loads()),
        ("mark_prefill", s.mark_prefill("*")),
        ("free", s.free("*")),
        ("sync", s.sync()),
        ("sync_state", s.sync_state()),
        ("register", m.register()),
        ("heartbeat", m.heartbeat()),
        ("deregister", m.deregister()),
        ("who_is_there", m.who_is_there()),
        ("kv_events", m.kv_events()),
        ("load", m.load()),
        ("kv_transfer", m.kv_transfer()),
        ("indexer_find_matches", m.indexer_find_matches()),
        ("indexer_record", m.indexer_record()),
        ("indexer_dump", m.indexer_dump()),
        ("indexer_announce", m.indexer_announce()),
        ("generate", m.generate_wildcard()),
        ("state", m.state_wildcard()),
    ])
}

impl ModelSubjects {
    fn generate_wildcard(&self) -> String {
        format!("{}.worker.*.generate", self.prefix)
    }

    fn state_wildcard(&self) -> String {
        format!("{}.worker.*.state", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn model_tokens_are_valid_and_distinct() {
        let models = [
            "Qwen/Qwen3-0.6B",
            "Qwen~2FQwen3-0~2E6B",
            "qwen/qwen3-0.6b",
            "a.b",
            "a_b",
            "a b",
            "a*b",
            "a>b",
            "模型",
        ];
        let tokens: HashSet<String> = models.iter().map(|m| model_token(m).unwrap()).collect();
        assert_eq!(tokens.len(), models.len());
        for t in &tokens {
            assert!(t
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'~'));
        }
        assert_eq!(
            model_token("Qwen/Qwen3-0.6B").unwrap(),
            "Qwen~2FQwen3-0~2E6B"
        );
        assert_eq!(model_token(""), Err(SubjectError::EmptyModel));
    }

    #[test]
    fn namespaces_are_checked() {
        assert!(Subjects::new("kvrouter").is_ok());
        assert!(Subjects::new("team-a.prod").is_ok());
        for bad in ["", "a..b", "a b", "a.*", ">", ".a"] {
            assert!(Subjects::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fleet_subjects_are_namespaced_and_unique() {
        let list = fleet_subjects("ns1", "Qwen/Qwen3-0.6B").unwrap();
        let names: HashSet<_> = list.iter().map(|(n, _)| *n).collect();
        let subjects: HashSet<_> = list.iter().map(|(_, s)| s.clone()).collect();
        assert_eq!(names.len(), list.len());
        assert_eq!(subjects.len(), list.len());
        assert!(list.iter().all(|(_, s)| s.starts_with("ns1.")));
        assert!(list.iter().any(|(n, _)| n.contains("route")));
    }
}
