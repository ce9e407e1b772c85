//! A bridge's configuration, validated once before anything starts.

use crate::endpoints::{default_worker_id, rank_endpoint, EndpointError, HttpUrl, MAX_WORKER_ID};
use kvrouter_protocol::{DpRank, EngineKind, WorkerId, WorkerRole};
use std::net::SocketAddr;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub namespace: String,
    pub engine: EngineKind,
    pub model: String,
    pub block_size: u32,
    /// The engine's publisher endpoint for its rank 0, e.g. `tcp://10.0.0.5:5557`.
    pub zmq_endpoint: String,
    /// Bind `zmq_endpoint` (one port per rank) and have the engine's publisher connect to
    /// it, instead of connecting to a publisher the engine binds: the engine then needs no
    /// listening socket for its events (vLLM binds only `*`, `::`, `ipc://` endpoints).
    pub zmq_bind: bool,
    /// The engine's replay endpoint for its rank 0; without it lost batches clear the rank.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    pub tp_size: u32,
    pub role: WorkerRole,
    pub capacity_blocks: u64,
    /// Host-memory blocks per rank the engine offloads to (bounds the mirror's host copy;
    /// `None`: whatever the engine reports).
    pub host_capacity_blocks: Option<u64>,
    /// Disk blocks per rank, likewise.
    pub disk_capacity_blocks: Option<u64>,
    pub base_url: String,
    /// Default: the base URL's `/metrics`.
    pub metrics_url: Option<String>,
    /// Default: the base URL's `/health`.
    pub health_url: Option<String>,
    /// Default: [`default_worker_id`].
    pub worker_id: Option<WorkerId>,
    pub admin_addr: Option<SocketAddr>,
    /// Bounds on the admin listener's clients (`--http-*`).
    pub http_limits: kvrouter_admin::HttpLimits,
    pub heartbeat_interval: Duration,
    pub health_interval: Duration,
    pub metrics_interval: Duration,
    /// How long a health check or scrape may take.
    pub http_timeout: Duration,
    /// How long a replay may take before the missing batches count as lost.
    pub replay_timeout: Duration,
    pub event_batch_interval: Duration,
    /// A rank whose engine runs requests this long without one batch is reported silent.
    pub events_silent_after: Duration,
}

impl BridgeConfig {
    /// Defaults for everything but what identifies the engine.
    pub fn new(
        engine: EngineKind,
        model: impl Into<String>,
        zmq_endpoint: impl Into<String>,
        base_url: impl Into<String>,
    ) -> Self {
        Self {
            namespace: "kvrouter".into(),
            engine,
            model: model.into(),
            block_size: 16,
            zmq_endpoint: zmq_endpoint.into(),
            zmq_bind: false,
            replay_endpoint: None,
            topic: String::new(),
            dp_size: 1,
            dp_start_rank: 0,
            tp_size: 1,
            role: WorkerRole::Aggregated,
            capacity_blocks: 0,
            host_capacity_blocks: None,
            disk_capacity_blocks: None,
            base_url: base_url.into(),
            metrics_url: None,
            health_url: None,
            worker_id: None,
            admin_addr: None,
            http_limits: kvrouter_admin::HttpLimits::default(),
            heartbeat_interval: Duration::from_secs(1),
            health_interval: Duration::from_millis(250),
            metrics_interval: Duration::from_millis(200),
            http_timeout: Duration::from_secs(1),
            replay_timeout: Duration::from_secs(2),
            event_batch_interval: Duration::from_millis(2),
            events_silent_after: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Error)]
pub enum BridgeError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("--model must not be empty")]
    NoModel,
    #[error("--block-size must be at least 1")]
    ZeroBlockSize,
    #[error("--dp-size must be 1..=4096 (it is {0})")]
    DpSize(u32),
    #[error("--tp-size must be 1..=4096 (it is {0})")]
    TpSize(u32),
    #[error("--capacity-blocks must be 1..=2^36 blocks per rank (it is {0})")]
    Capacity(u64),
    #[error("--worker-id must be at most 2^53 - 1 (it is {0})")]
    WorkerId(u64),
    #[error("{what} must be above zero")]
    ZeroInterval { what: &'static str },
    #[error("the heartbeat interval must be 1..=60000 ms")]
    Heartbeat,
    #[error(
        "--zmq-bind with the ipc:// endpoint {0:?}: vLLM and SGLang bind every ipc:// \
         publisher endpoint themselves, so the bridge connects to it; drop --zmq-bind"
    )]
    IpcBind(String),
    #[error(transparent)]
    Subject(#[from] kvrouter_protocol::SubjectError),
    #[error(transparent)]
    Bus(#[from] kvrouter_bus::BusError),
    #[error("cannot serve the admin endpoint on {addr}: {source}")]
    Admin {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A validated configuration with everything derived from it.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub config: BridgeConfig,
    pub worker_id: WorkerId,
    /// Per rank, in order from `dp_start_rank`: publisher and replay endpoints.
    pub ranks: Vec<(DpRank, String, Option<String>)>,
    pub health_url: HttpUrl,
    pub metrics_url: HttpUrl,
}

impl BridgeConfig {
    pub fn resolve(self) -> Result<Resolved, BridgeError> {
        if self.model.is_empty() {
            return Err(BridgeError::NoModel);
        }
        if self.block_size == 0 {
            return Err(BridgeError::ZeroBlockSize);
        }
        if !(1..=4096).contains(&self.dp_size) {
            return Err(BridgeError::DpSize(self.dp_size));
        }
        if !(1..=4096).contains(&self.tp_size) {
            return Err(BridgeError::TpSize(self.tp_size));
        }
        if !(1..=1u64 << 36).contains(&self.capacity_blocks) {
            return Err(BridgeError::Capacity(self.capacity_blocks));
        }
        let hb = self.heartbeat_interval.as_millis();
        if !(1..=60_000).contains(&hb) {
            return Err(BridgeError::Heartbeat);
        }
        for (what, d) in [
            ("--health-interval-ms", self.health_interval),
            ("--metrics-interval-ms", self.metrics_interval),
            ("--http-timeout-ms", self.http_timeout),
            ("--replay-timeout-ms", self.replay_timeout),
            ("--events-silent-secs", self.events_silent_after),
        ] {
            if d.is_zero() {
                return Err(BridgeError::ZeroInterval { what });
            }
        }
        if self.zmq_bind && self.zmq_endpoint.starts_with("ipc://") {
            return Err(BridgeError::IpcBind(self.zmq_endpoint));
        }
        kvrouter_protocol::Subjects::new(&self.namespace)?.model(&self.model)?;
        let base = HttpUrl::parse(&self.base_url)?;
        let health_url = match &self.health_url {
            Some(u) => HttpUrl::parse(u)?,
            None => base.with_path("/health"),
        };
        let metrics_url = match &self.metrics_url {
            Some(u) => HttpUrl::parse(u)?,
            None => base.with_path("/metrics"),
        };
        let worker_id = match self.worker_id {
            Some(id) if id > MAX_WORKER_ID => return Err(BridgeError::WorkerId(id)),
            Some(id) => id,
            None => default_worker_id(&self.model, &self.base_url, self.dp_start_rank),
        };
        let mut ranks = Vec::with_capacity(self.dp_size as usize);
        for i in 0..self.dp_size {
            let rank = self
                .dp_start_rank
                .checked_add(i)
                .ok_or(BridgeError::DpSize(self.dp_size))?;
            let publisher = rank_endpoint(&self.zmq_endpoint, rank)?;
            let replay = self
                .replay_endpoint
                .as_deref()
                .map(|e| rank_endpoint(e, rank))
                .transpose()?;
            ranks.push((rank, publisher, replay));
        }
        Ok(Resolved {
            worker_id,
            ranks,
            health_url,
            metrics_url,
            config: self,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> BridgeConfig {
        let mut c = BridgeConfig::new(
            EngineKind::Vllm,
            "m",
            "tcp://10.0.0.5:5557",
            "http://10.0.0.5:8000",
        );
        c.capacity_blocks = 1000;
        c
    }

    #[test]
    fn resolves_ports_urls_and_the_default_worker_id() {
        let mut c = base();
        c.dp_size = 2;
        c.dp_start_rank = 4;
        c.replay_endpoint = Some("tcp://10.0.0.5:5600".into());
        let r = c.resolve().unwrap();
        assert_eq!(
            r.ranks,
            vec![
                (
                    4,
                    "tcp://10.0.0.5:5561".to_string(),
                    Some("tcp://10.0.0.5:5604".to_string())
                ),
                (
                    5,
                    "tcp://10.0.0.5:5562".to_string(),
                    Some("tcp://10.0.0.5:5605".to_string())
                ),
            ]
        );
        assert_eq!(r.health_url.path, "/health");
        assert_eq!(r.metrics_url.path, "/metrics");
        assert_eq!(
            r.worker_id,
            crate::endpoints::default_worker_id("m", "http://10.0.0.5:8000", 4)
        );
    }

    /// A change that makes a configuration unusable.
    type Spoil = fn(&mut BridgeConfig);

    #[test]
    fn refuses_what_cannot_work() {
        let cases: Vec<(&str, Spoil)> = vec![
            ("no model", (|c| c.model.clear())),
            ("block size 0", (|c| c.block_size = 0)),
            ("dp 0", (|c| c.dp_size = 0)),
            ("dp too large", (|c| c.dp_size = 5000)),
            ("capacity 0", (|c| c.capacity_blocks = 0)),
            ("capacity absurd", (|c| c.capacity_blocks = 1 << 40)),
            ("worker id > 2^53", (|c| c.worker_id = Some(1 << 60))),
            ("no heartbeat", (|c| c.heartbeat_interval = Duration::ZERO)),
            ("zero interval", (|c| c.health_interval = Duration::ZERO)),
            ("bind address", (|c| c.zmq_endpoint = "tcp://*:5557".into())),
            (
                "ipc past rank 0",
                (|c| {
                    c.zmq_endpoint = "ipc:///tmp/kv".into();
                    c.dp_size = 2;
                }),
            ),
            (
                "ipc at rank 1",
                (|c| {
                    c.zmq_endpoint = "ipc:///tmp/kv".into();
                    c.dp_start_rank = 1;
                }),
            ),
            (
                "ipc bound by the bridge",
                (|c| {
                    c.zmq_endpoint = "ipc:///tmp/kv".into();
                    c.zmq_bind = true;
                }),
            ),
            (
                "ipc replay past rank 0",
                (|c| {
                    c.replay_endpoint = Some("ipc:///tmp/replay".into());
                    c.dp_size = 2;
                }),
            ),
            ("https", (|c| c.base_url = "https://e:8000".into())),
            (
                "port overflow",
                (|c| {
                    c.zmq_endpoint = "tcp://h:65535".into();
                    c.dp_size = 2;
                }),
            ),
            ("bad namespace", (|c| c.namespace = "a b".into())),
        ];
        for (what, f) in cases {
            let mut c = base();
            f(&mut c);
            assert!(c.resolve().is_err(), "{what} was accepted");
        }
        assert!(base().resolve().is_ok());
    }

    #[test]
    fn an_engine_in_the_pod_may_publish_on_socket_files() {
        let mut c = base();
        c.zmq_endpoint = "ipc:///run/kv/events".into();
        c.replay_endpoint = Some("ipc:///run/kv/replay".into());
        let r = c.resolve().unwrap();
        assert_eq!(
            r.ranks,
            vec![(
                0,
                "ipc:///run/kv/events".to_string(),
                Some("ipc:///run/kv/replay".to_string())
            )]
        );
    }
}
