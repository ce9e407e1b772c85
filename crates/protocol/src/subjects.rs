//! Bus subjects: where each message of [`crate::messages`] travels.
//!
//! Everything lives under a namespace so fleets can share one NATS. Router endpoints are per
//! namespace (the model is in the payload, so an unknown model gets an error reply); worker
//! subjects are per model, the model name mapped to one subject token by [`model_token`].

use std::fmt::Write;
use thiserror::Error;

/// Queue group of the router endpoints: each request goes to one replica.
pub const ROUTER_QUEUE_GROUP: &str = "kvrouter-replicas";

/// Queue group of the replicas answering catch-ups on [`Subjects::sync_state`] (those
/// already caught up).
pub const SYNC_QUEUE_GROUP: &str = "kvrouter-sync";

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

    /// `OutputBlock` → `Reply<()>`, to the replica that made the decision.
    pub fn add_output_block(&self, replica_id: &str) -> String {
        format!("{}.router.replica.{replica_id}.add_output_block", self.ns)
    }

    /// `SyncStateRequest` → stream of `SyncBatch`: that replica's own active sequences (a
    /// peer that missed one of its sync batches asks it).
    pub fn sync_own(&self, replica_id: &str) -> String {
        format!("{}.router.replica.{replica_id}.sync_state", self.ns)
    }

    /// `Abandon`, published by a caller whose route call may have been booked by a replica
    /// that did not answer in time; every replica subscribes (no queue group).
    pub fn abandon(&self) -> String {
        format!("{}.router.abandon", self.ns)
    }

    /// `SyncBatch`es of replica `replica_id` (`--replica-sync`), to all the others: only that
    /// replica's credentials may publish here, so a batch's origin is known.
    pub fn sync_of(&self, replica_id: &str) -> String {
        format!("{}.router.sync.{replica_id}", self.ns)
    }

    /// Every replica's [`Subjects::sync_of`]: what synced replicas subscribe to.
    pub fn sync_all(&self) -> String {
        format!("{}.router.sync.*", self.ns)
    }

    /// The subject every replica of the previous release published its `SyncBatch`es on,
    /// one for all (no permission can tell them apart). Read for one release, for rolling
    /// upgrades; nobody publishes here any more.
    pub fn legacy_sync(&self) -> String {
        format!("{}.router.sync", self.ns)
    }

    /// Where a sync batch came from, by its subject: `Some(Some(id))` on replica `id`'s own
    /// subject, `Some(None)` on the shared legacy one, `None` for any other subject.
    pub fn sync_sender<'a>(&self, subject: &'a str) -> Option<Option<&'a str>> {
        let rest = subject
            .strip_prefix(&self.ns)?
            .strip_prefix(".router.sync")?;
        match rest.strip_prefix('.') {
            None if rest.is_empty() => Some(None),
            Some(id) if !id.is_empty() && !id.contains('.') => Some(Some(id)),
            _ => None,
        }
    }

    /// `SyncStateRequest` → stream of `SyncBatch` (queue group [`SYNC_QUEUE_GROUP`]).
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

/// A subject of one worker, `<model>.worker.<worker id>.<token>`: whatever a worker says
/// travels on its own subjects, so NATS permissions can confine a worker's credentials to
/// them (`<model>.worker.<id>.>`), and a replica drops a message whose payload names another
/// worker than its subject ([`ModelSubjects::worker_of`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum WorkerSubject {
    /// `Registration`, published on start and after a `WhoIsThere`.
    Register,
    /// `Heartbeat`, published periodically.
    Heartbeat,
    /// `Deregistration`, published on shutdown.
    Deregister,
    /// `KvEventBatch`.
    KvEvents,
    /// `LoadReport`.
    Load,
    /// `EventMarks`, published about once a second.
    EventMarks,
    /// `TransferReport`, published by each tensor-parallel rank of prefill and decode
    /// workers when KV transfers finish.
    KvTransfer,
    /// `GenerateRequest` → stream of `GenerateEvent`, served by the worker.
    Generate,
    /// `StateQuery` → stream of `Reply<StateChunk>`, served by the worker.
    State,
    /// Test hook (see [`ModelSubjects::drop_events`]).
    DropEvents,
    /// Test hook (see [`ModelSubjects::rank_live`]).
    RankLive,
}

impl WorkerSubject {
    /// What a worker publishes (the rest it serves or obeys).
    pub const PUBLISHED: [WorkerSubject; 7] = [
        Self::Register,
        Self::Heartbeat,
        Self::Deregister,
        Self::KvEvents,
        Self::Load,
        Self::EventMarks,
        Self::KvTransfer,
    ];

    /// The subject's last token.
    pub fn token(self) -> &'static str {
        match self {
            Self::Register => "register",
            Self::Heartbeat => "heartbeat",
            Self::Deregister => "deregister",
            Self::KvEvents => "kv_events",
            Self::Load => "load",
            Self::EventMarks => "event_marks",
            Self::KvTransfer => "kv_transfer",
            Self::Generate => "generate",
            Self::State => "state",
            Self::DropEvents => "drop_events",
            Self::RankLive => "rank_live",
        }
    }
}

impl ModelSubjects {
    /// `what` of worker `worker_id`: `<model>.worker.<worker_id>.<token>`.
    pub fn worker(&self, worker_id: u64, what: WorkerSubject) -> String {
        format!("{}.worker.{worker_id}.{}", self.prefix, what.token())
    }

    /// `what` of every worker (`*` for the worker id): what replicas subscribe to.
    pub fn every_worker(&self, what: WorkerSubject) -> String {
        format!("{}.worker.*.{}", self.prefix, what.token())
    }

    /// The worker a per-worker subject belongs to; `None` for any other subject (the
    /// model-wide subjects of [`ModelSubjects::legacy`] among them).
    pub fn worker_of(&self, subject: &str) -> Option<u64> {
        let rest = subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".worker.")?;
        let (id, _) = rest.split_once('.')?;
        // Canonical decimal only: "010" or "+10" is not worker 10's subject.
        id.parse::<u64>().ok().filter(|n| n.to_string() == id)
    }

    /// The model-wide subject workers of the previous release published `what` on, shared
    /// by every worker (no permission can tell them apart). Replicas still accept them for
    /// one release, so a fleet upgrades replicas first, then workers; `None` for subjects
    /// that were always per worker.
    pub fn legacy(&self, what: WorkerSubject) -> Option<String> {
        let tail = match what {
            WorkerSubject::Register => "discovery.register",
            WorkerSubject::Heartbeat => "discovery.heartbeat",
            WorkerSubject::Deregister => "discovery.deregister",
            WorkerSubject::KvEvents => "kv_events",
            WorkerSubject::Load => "load",
            WorkerSubject::KvTransfer => "kv_transfer",
            _ => return None,
        };
        Some(format!("{}.{tail}", self.prefix))
    }

    /// `Registration` of worker `worker_id`, published on start and after a `WhoIsThere`.
    pub fn register(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::Register)
    }

    /// `Heartbeat` of worker `worker_id`, published periodically.
    pub fn heartbeat(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::Heartbeat)
    }

    /// `Deregistration` of worker `worker_id`, published on shutdown.
    pub fn deregister(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::Deregister)
    }

    /// `WhoIsThere`, published by replicas; every worker answers with a `Registration`.
    pub fn who_is_there(&self) -> String {
        format!("{}.discovery.who_is_there", self.prefix)
    }

    /// `KvEventBatch` of worker `worker_id`.
    pub fn kv_events(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::KvEvents)
    }

    /// `LoadReport` of worker `worker_id`.
    pub fn load(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::Load)
    }

    /// `EventMarks` of worker `worker_id`.
    pub fn event_marks(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::EventMarks)
    }

    /// `TransferReport` of worker `worker_id` (each of its tensor-parallel ranks).
    pub fn kv_transfer(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::KvTransfer)
    }

    /// `GenerateRequest` → stream of `GenerateEvent`, served by one worker.
    pub fn generate(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::Generate)
    }

    /// `StateQuery` → stream of `Reply<StateChunk>`, served by one worker.
    pub fn state(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::State)
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
        self.worker(worker_id, WorkerSubject::DropEvents)
    }

    /// Test hook: a [`crate::RankLiveness`] takes one rank of the worker down or back up.
    pub fn rank_live(&self, worker_id: u64) -> String {
        self.worker(worker_id, WorkerSubject::RankLive)
    }
}

/// Every subject a fleet of `model` uses, as `(name, subject)`; `*` stands for a worker id or
/// a replica id. The `legacy_*` ones are the shared subjects replicas still read from
/// replicas and workers of the previous release.
pub fn fleet_subjects(
    namespace: &str,
    model: &str,
) -> Result<Vec<(&'static str, String)>, SubjectError> {
    use WorkerSubject as W;
    let s = Subjects::new(namespace)?;
    let m = s.model(model)?;
    let mut out = vec![
        ("route", s.route()),
        ("route_disagg", s.route_disagg()),
        ("overlap_scores", s.overlap_scores()),
        ("potential_loads", s.potential_loads()),
        ("mark_prefill", s.mark_prefill("*")),
        ("free", s.free("*")),
        ("add_output_block", s.add_output_block("*")),
        ("abandon", s.abandon()),
        ("sync", s.sync_of("*")),
        ("sync_state", s.sync_state()),
        ("sync_own", s.sync_own("*")),
        ("who_is_there", m.who_is_there()),
        ("indexer_find_matches", m.indexer_find_matches()),
        ("indexer_record", m.indexer_record()),
        ("indexer_dump", m.indexer_dump()),
        ("indexer_announce", m.indexer_announce()),
    ];
    for what in W::PUBLISHED.into_iter().chain([W::Generate, W::State]) {
        out.push((what.token(), m.every_worker(what)));
    }
    out.push(("legacy_sync", s.legacy_sync()));
    for (name, what) in [
        ("legacy_register", W::Register),
        ("legacy_heartbeat", W::Heartbeat),
        ("legacy_deregister", W::Deregister),
        ("legacy_kv_events", W::KvEvents),
        ("legacy_load", W::Load),
        ("legacy_kv_transfer", W::KvTransfer),
    ] {
        out.extend(m.legacy(what).map(|l| (name, l)));
    }
    Ok(out)
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

    #[test]
    fn each_replica_syncs_on_its_own_subject() {
        let s = Subjects::new("ns.a").unwrap();
        assert_eq!(s.sync_of("r1"), "ns.a.router.sync.r1");
        assert_eq!(s.sync_all(), "ns.a.router.sync.*");
        assert_eq!(s.legacy_sync(), "ns.a.router.sync");
        assert_eq!(s.sync_sender(&s.sync_of("r1")), Some(Some("r1")));
        assert_eq!(s.sync_sender(&s.legacy_sync()), Some(None));
        for other in [
            "ns.a.router.sync_state",
            "ns.a.router.sync.",
            "ns.a.router.sync.r1.x",
            "ns.b.router.sync.r1",
            "ns.a.router.replica.r1.sync_state",
            "ns.a.router.syncr1",
        ] {
            assert_eq!(s.sync_sender(other), None, "{other}");
        }
    }

    #[test]
    fn what_a_worker_says_travels_on_its_own_subjects() {
        let m = Subjects::new("ns").unwrap().model("a.b").unwrap();
        for what in WorkerSubject::PUBLISHED {
            let own = m.worker(42, what);
            assert!(own.starts_with("ns.model.a~2Eb.worker.42."), "{own}");
            assert_eq!(m.worker_of(&own), Some(42));
            // Marks are new: they never had a model-wide subject.
            let Some(legacy) = m.legacy(what) else {
                assert_eq!(what, WorkerSubject::EventMarks);
                continue;
            };
            assert_eq!(m.worker_of(&legacy), None, "{legacy}");
            assert_ne!(legacy, own);
        }
        assert_eq!(m.register(7), "ns.model.a~2Eb.worker.7.register");
        assert_eq!(
            m.every_worker(WorkerSubject::Load),
            "ns.model.a~2Eb.worker.*.load"
        );
        assert_eq!(m.legacy(WorkerSubject::Generate), None);
        for bad in [
            "ns.model.a~2Eb.worker.010.load",
            "ns.model.a~2Eb.worker.+10.load",
            "ns.model.a~2Eb.worker.x.load",
            "ns.model.a~2Eb.worker.10",
            "ns.model.other.worker.10.load",
            "ns.model.a~2Eb.kv_events",
        ] {
            assert_eq!(m.worker_of(bad), None, "{bad}");
        }
        let other = Subjects::new("ns").unwrap().model("a.bc").unwrap();
        assert_eq!(m.worker_of(&other.load(1)), None);
    }
}
