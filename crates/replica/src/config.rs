//! What `kvrouter serve` configures, validated once before anything starts.
//!
//! A model's pipeline is one [`IndexSource`] (where overlaps come from, and whether this
//! replica serves its index to others) plus an optional [`SyncConfig`]: combinations that
//! make no sense (serving an index one does not keep) cannot be written down. The CLI's flat
//! flags become a pipeline through [`IndexFlags::source`], the one place their combinations
//! are checked.

use kvrouter_bus::BusError;
use kvrouter_protocol::{SubjectError, Subjects};
use kvrouter_scheduler::SchedulerConfig;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;
use thiserror::Error;

/// Longest approximate-mode TTL accepted: deadlines are `now + ttl`, and no cache keeps a
/// block longer.
pub const MAX_ROUTER_TTL: Duration = Duration::from_secs(24 * 3600);

/// Default of [`SyncConfig::echo`]: several NATS hops on a LAN (about 0.1 ms each);
/// measured best of 1, 2 and 5 ms in the bursty replay (docs/benchmarks.md).
pub const DEFAULT_SYNC_ECHO: Duration = Duration::from_millis(1);

/// How long a route waits for a serving indexer by default (`--remote-indexer-timeout-ms`).
pub const DEFAULT_REMOTE_TIMEOUT: Duration = Duration::from_millis(50);

/// Remote lookups timing out in a row that open the circuit breaker, by default.
pub const DEFAULT_BREAKER_FAILURES: u32 = 3;
/// How long an open breaker skips remote lookups before a probe, by default.
pub const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(1);

/// How long a disaggregated request may wait for its transfer reports before it is logged
/// and counted as overdue, by default (`--transfer-timeout-secs`).
pub const DEFAULT_TRANSFER_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a model's overlaps come from.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexSource {
    /// KV events from the workers; a rank's state is fetched when it joins and after a gap.
    /// With `serve`, the index also answers other replicas (`--serve-indexer`).
    Events { serve: bool },
    /// Approximate mode (`--no-kv-events`): no events; each route decision that updates
    /// state counts as cached on its worker for `ttl`. With `serve`, every replica's
    /// published decisions are recorded and the index answers other replicas.
    Approx { ttl: Duration, serve: bool },
    /// No index here (`--use-remote-indexer`): a serving indexer answers each lookup.
    Remote(RemoteIndex),
}

/// `--use-remote-indexer`: how lookups reach a serving indexer.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteIndex {
    /// How long a route waits for an answer before routing on load alone.
    pub timeout: Duration,
    /// Consecutive failures that open the circuit breaker (0: never open it).
    pub breaker_failures: u32,
    /// How long an open breaker skips lookups before probing (doubled by each failed
    /// probe, up to four times this).
    pub breaker_cooldown: Duration,
    /// With `--no-kv-events`: publish this replica's decisions to the serving indexers.
    pub publish_decisions: bool,
}

impl Default for RemoteIndex {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_REMOTE_TIMEOUT,
            breaker_failures: DEFAULT_BREAKER_FAILURES,
            breaker_cooldown: DEFAULT_BREAKER_COOLDOWN,
            publish_decisions: false,
        }
    }
}

impl IndexSource {
    /// This replica keeps an index of its own.
    pub fn keeps_index(&self) -> bool {
        !matches!(self, Self::Remote(_))
    }

    /// This replica subscribes to KV events and fetches worker state.
    pub fn follows_events(&self) -> bool {
        matches!(self, Self::Events { .. })
    }

    /// This replica answers other replicas' lookups (`--serve-indexer`).
    pub fn serves(&self) -> bool {
        matches!(
            self,
            Self::Events { serve: true } | Self::Approx { serve: true, .. }
        )
    }

    /// Approximate mode: route decisions feed an index (here or on a serving indexer).
    pub fn approximate(&self) -> bool {
        match self {
            Self::Approx { .. } => true,
            Self::Remote(r) => r.publish_decisions,
            Self::Events { .. } => false,
        }
    }

    /// The lifetime of a recorded decision, when this replica keeps an approximate index.
    pub fn approx_ttl(&self) -> Option<Duration> {
        match self {
            Self::Approx { ttl, .. } => Some(*ttl),
            _ => None,
        }
    }

    /// The remote lookup settings, with `--use-remote-indexer`.
    pub fn remote(&self) -> Option<&RemoteIndex> {
        match self {
            Self::Remote(r) => Some(r),
            _ => None,
        }
    }

    /// A short name for logs.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Events { serve: false } => "kv events",
            Self::Events { serve: true } => "kv events, serving the index",
            Self::Approx { serve: false, .. } => "approximate",
            Self::Approx { serve: true, .. } => "approximate, serving the index",
            Self::Remote(r) if r.publish_decisions => "remote indexer, approximate",
            Self::Remote(_) => "remote indexer",
        }
    }
}

/// Replica sync (`--replica-sync`): share active-sequence changes with peer replicas and
/// apply theirs, so every replica routes on the whole fleet's load.
#[derive(Clone, Debug, PartialEq)]
pub struct SyncConfig {
    /// How long this replica's guesses of its peers' simultaneous decisions count as load
    /// (the scheduler's peer echo; zero turns it off): about the time a decision takes to
    /// reach the peers.
    pub echo: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            echo: DEFAULT_SYNC_ECHO,
        }
    }
}

/// The CLI's index flags as given, before they become an [`IndexSource`].
#[derive(Clone, Debug)]
pub struct IndexFlags {
    pub no_kv_events: bool,
    pub router_ttl: Duration,
    pub serve_indexer: bool,
    pub use_remote_indexer: bool,
    pub remote_timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

impl Default for IndexFlags {
    fn default() -> Self {
        let r = RemoteIndex::default();
        Self {
            no_kv_events: false,
            router_ttl: kvrouter_indexer::approx::DEFAULT_TTL,
            serve_indexer: false,
            use_remote_indexer: false,
            remote_timeout: r.timeout,
            breaker_failures: r.breaker_failures,
            breaker_cooldown: r.breaker_cooldown,
        }
    }
}

impl IndexFlags {
    /// The pipeline these flags describe, or why they do not describe one.
    pub fn source(&self) -> Result<IndexSource, ReplicaError> {
        if self.serve_indexer && self.use_remote_indexer {
            return Err(ReplicaError::ServeAndUseRemoteIndexer);
        }
        if self.use_remote_indexer {
            return Ok(IndexSource::Remote(RemoteIndex {
                timeout: self.remote_timeout,
                breaker_failures: self.breaker_failures,
                breaker_cooldown: self.breaker_cooldown,
                publish_decisions: self.no_kv_events,
            }));
        }
        if self.no_kv_events {
            return Ok(IndexSource::Approx {
                ttl: self.router_ttl,
                serve: self.serve_indexer,
            });
        }
        Ok(IndexSource::Events {
            serve: self.serve_indexer,
        })
    }
}

/// Everything `kvrouter serve` configures.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub namespace: String,
    /// Defaults to a fresh uuid.
    pub replica_id: Option<String>,
    pub models: Vec<String>,
    /// Block size per model, when not taken from the first worker.
    pub block_sizes: HashMap<String, u32>,
    /// A worker that sends nothing for this long is removed.
    pub worker_lease: Duration,
    /// How long a rank's state fetch may stay silent before it counts as failed.
    pub state_fetch_timeout: Duration,
    pub max_prompt_tokens: usize,
    /// Scheduling parameters (the block size is set per model).
    pub scheduler: SchedulerConfig,
    pub index_shards: usize,
    /// Time the first "who is there" gets before the replica may turn ready.
    pub discovery_window: Duration,
    /// Workers of each model to know before taking routes (`--min-initial-workers`), and
    /// how long to wait for them at most (then routes are taken anyway, with a warning).
    pub min_initial_workers: usize,
    pub min_initial_workers_timeout: Duration,
    /// How long shutdown may take in all: draining in-flight requests, then stopping.
    pub drain_timeout: Duration,
    pub admin_addr: Option<SocketAddr>,
    /// Bounds on the admin and JSON API listeners' clients (`--http-*`).
    pub http_limits: kvrouter_admin::HttpLimits,
    /// Where the JSON API for peer routers listens (`--http-addr`), when not on the admin
    /// address (which always serves it too).
    pub http_addr: Option<SocketAddr>,
    /// Where overlaps come from (every model alike).
    pub index: IndexSource,
    /// `Some` with `--replica-sync`.
    pub sync: Option<SyncConfig>,
    /// How long a disaggregated request may wait for its KV transfer reports before it is
    /// logged and counted as overdue (`--transfer-timeout-secs`).
    pub transfer_timeout: Duration,
    /// Book routes without a lease (`--allow-unleased`: a fleet upgraded from one whose
    /// callers knew none); otherwise a booked route without one is refused.
    pub allow_unleased: bool,
    /// Where route spans go (`--otlp-traces-endpoint`; none: not recorded).
    pub traces: kvrouter_otlp::TracesConfig,
    /// A rank routed to for this long without a KV event is flagged silent
    /// (`--events-silent-secs`; zero: never).
    pub events_silent_after: Duration,
    /// How long a silent rank's routed blocks count as cached on it (`--router-ttl-secs`).
    pub silent_rank_ttl: Duration,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            namespace: "kvrouter".into(),
            replica_id: None,
            models: Vec::new(),
            block_sizes: HashMap::new(),
            worker_lease: Duration::from_secs(3),
            state_fetch_timeout: Duration::from_secs(2),
            max_prompt_tokens: 131_072,
            scheduler: SchedulerConfig::default(),
            index_shards: 1,
            discovery_window: Duration::from_millis(500),
            min_initial_workers: 0,
            min_initial_workers_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(10),
            admin_addr: None,
            http_limits: kvrouter_admin::HttpLimits::default(),
            http_addr: None,
            index: IndexSource::Events { serve: false },
            sync: None,
            transfer_timeout: DEFAULT_TRANSFER_TIMEOUT,
            allow_unleased: false,
            traces: kvrouter_otlp::TracesConfig::default(),
            events_silent_after: Duration::from_secs(60),
            silent_rank_ttl: kvrouter_indexer::approx::DEFAULT_TTL,
        }
    }
}

#[derive(Debug, Error)]
pub enum ReplicaError {
    #[error("no model to serve: give at least one --model")]
    NoModels,
    #[error("model {0:?} is given twice")]
    DuplicateModel(String),
    #[error("--block-size names model {0:?}, which is not served (add --model {0})")]
    BlockSizeForUnknownModel(String),
    #[error("invalid block size 0 for model {0:?}")]
    ZeroBlockSize(String),
    #[error("--max-prompt-tokens {tokens} does not fit the bus's {max_payload}-byte message limit: use at most {fits}")]
    PromptLimitTooLarge {
        tokens: usize,
        max_payload: usize,
        fits: usize,
    },
    #[error("--router-ttl-secs must be above 0 (it is how long a routed request's blocks count as cached)")]
    ZeroRouterTtl,
    #[error("--router-ttl-secs must be at most {} (a day; engines evict long before)", MAX_ROUTER_TTL.as_secs())]
    RouterTtlTooLong,
    #[error("--transfer-timeout-secs must be above 0 (it is how long a KV transfer may take before it is reported overdue)")]
    ZeroTransferTimeout,
    #[error("--serve-indexer and --use-remote-indexer cannot be combined: a replica either serves its index or asks another replica's")]
    ServeAndUseRemoteIndexer,
    #[error("--serve-indexer with --overlap-credit 0: a serving indexer exists to share overlaps, which this replica would ignore (give --overlap-credit above 0)")]
    ServeIndexerWithoutOverlap,
    #[error("--remote-indexer-timeout-ms must be above 0 (it is how long a route waits for a serving indexer)")]
    ZeroRemoteIndexerTimeout,
    #[error("--remote-indexer-breaker-cooldown-ms must be above 0 (give --remote-indexer-breaker-failures 0 to turn the breaker off)")]
    ZeroBreakerCooldown,
    #[error("invalid replica id {0:?}: use letters, digits, '-' and '_'")]
    ReplicaId(String),
    #[error(transparent)]
    Subject(#[from] SubjectError),
    #[error("invalid scheduler settings: {0}")]
    Scheduler(String),
    #[error("cannot start the {what}: {reason}")]
    Start { what: String, reason: String },
    #[error("cannot subscribe to {subject}")]
    Subscribe {
        subject: String,
        #[source]
        source: BusError,
    },
    #[error("cannot bind the admin address {addr}")]
    Admin {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bind the HTTP API address {addr} (--http-addr)")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Letters, digits, `-` and `_` (one subject token).
pub(crate) fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl ReplicaConfig {
    /// The largest prompt allowed must fit in one bus message of `max_payload` bytes.
    pub fn check_fits(&self, max_payload: usize) -> Result<(), ReplicaError> {
        let fits = kvrouter_protocol::max_prompt_tokens_for(max_payload);
        if self.max_prompt_tokens > fits {
            return Err(ReplicaError::PromptLimitTooLarge {
                tokens: self.max_prompt_tokens,
                max_payload,
                fits,
            });
        }
        Ok(())
    }

    /// Every check that needs no bus: `kvrouter serve` runs it before connecting, so a bad
    /// flag is refused at once whether or not NATS is reachable.
    pub fn validate(&self) -> Result<(), ReplicaError> {
        let subjects = Subjects::new(&self.namespace)?;
        if self.models.is_empty() {
            return Err(ReplicaError::NoModels);
        }
        for (i, m) in self.models.iter().enumerate() {
            if self.models[..i].contains(m) {
                return Err(ReplicaError::DuplicateModel(m.clone()));
            }
            subjects.model(m)?;
        }
        for (m, &b) in &self.block_sizes {
            if !self.models.contains(m) {
                return Err(ReplicaError::BlockSizeForUnknownModel(m.clone()));
            }
            if b == 0 {
                return Err(ReplicaError::ZeroBlockSize(m.clone()));
            }
        }
        match &self.index {
            IndexSource::Approx { ttl, .. } if ttl.is_zero() => {
                return Err(ReplicaError::ZeroRouterTtl)
            }
            IndexSource::Approx { ttl, .. } if *ttl > MAX_ROUTER_TTL => {
                return Err(ReplicaError::RouterTtlTooLong)
            }
            IndexSource::Remote(r) if r.timeout.is_zero() => {
                return Err(ReplicaError::ZeroRemoteIndexerTimeout)
            }
            IndexSource::Remote(r) if r.breaker_failures > 0 && r.breaker_cooldown.is_zero() => {
                return Err(ReplicaError::ZeroBreakerCooldown)
            }
            _ => {}
        }
        if self.index.serves() && self.scheduler.overlap_credit == 0.0 {
            return Err(ReplicaError::ServeIndexerWithoutOverlap);
        }
        if self.transfer_timeout.is_zero() {
            return Err(ReplicaError::ZeroTransferTimeout);
        }
        self.scheduler
            .validate()
            .map_err(|e| ReplicaError::Scheduler(e.to_string()))?;
        if let Some(id) = &self.replica_id {
            if !valid_replica_id(id) {
                return Err(ReplicaError::ReplicaId(id.clone()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> ReplicaConfig {
        ReplicaConfig {
            models: vec!["m".into()],
            ..ReplicaConfig::default()
        }
    }

    #[test]
    fn validate_names_what_is_wrong_without_a_bus() {
        assert!(valid().validate().is_ok());
        type Change = fn(&mut ReplicaConfig);
        let cases: Vec<(Change, &str)> = vec![
            (|c| c.models.clear(), "--model"),
            (|c| c.models.push("m".into()), "given twice"),
            (|c| c.namespace = "a b".into(), "a b"),
            (|c| _ = c.block_sizes.insert("x".into(), 16), "--block-size"),
            (|c| _ = c.block_sizes.insert("m".into(), 0), "block size 0"),
            (
                |c| {
                    c.index = IndexSource::Approx {
                        ttl: MAX_ROUTER_TTL + Duration::from_secs(1),
                        serve: false,
                    }
                },
                "--router-ttl-secs",
            ),
            (|c| c.replica_id = Some("a.b".into()), "replica id"),
        ];
        for (change, words) in cases {
            let mut c = valid();
            change(&mut c);
            let e = c.validate().expect_err(words).to_string();
            assert!(e.contains(words), "{words:?} not in {e:?}");
        }
    }

    #[test]
    fn flags_become_one_pipeline_or_a_refusal() {
        let flags = |f: fn(&mut IndexFlags)| {
            let mut x = IndexFlags::default();
            f(&mut x);
            x.source()
        };
        assert_eq!(flags(|_| {}).unwrap(), IndexSource::Events { serve: false });
        assert_eq!(
            flags(|f| f.serve_indexer = true).unwrap(),
            IndexSource::Events { serve: true }
        );
        let approx = flags(|f| (f.no_kv_events, f.serve_indexer) = (true, true)).unwrap();
        assert!(approx.serves() && approx.approximate() && approx.keeps_index());
        let remote = flags(|f| (f.no_kv_events, f.use_remote_indexer) = (true, true)).unwrap();
        assert!(!remote.keeps_index() && remote.approximate() && !remote.serves());
        assert!(!remote.follows_events() && remote.approx_ttl().is_none());
        let e = flags(|f| (f.serve_indexer, f.use_remote_indexer) = (true, true)).unwrap_err();
        assert!(matches!(e, ReplicaError::ServeAndUseRemoteIndexer), "{e}");
    }
}
