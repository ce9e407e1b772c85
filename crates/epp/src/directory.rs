//! Which workers answer at a gateway endpoint: the `ip:port` of the base URL each worker's
//! bridge registers. The gateway names endpoints (its subset hint); the router names
//! workers (allowed workers). A plain map, fed by the registrations on the bus
//! ([`follow`]) and read on each request without an actor hop.

use kvrouter_bus::Bus;
use kvrouter_protocol::{
    decode, encode, Deregistration, ModelSubjects, Registration, WhoIsThere, WorkerId,
    WorkerSubject,
};
use parking_lot::RwLock;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// The `ip:port` an engine's base URL names (`http://10.0.0.5:8000` → `10.0.0.5:8000`): the
/// gateway's endpoint for it.
pub fn endpoint_of(base_url: &str) -> Option<String> {
    let rest = base_url.split_once("://").map_or(base_url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let (_, port) = authority.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    Some(authority.to_string())
}

#[derive(Default, Debug)]
pub struct Directory {
    at: HashMap<String, BTreeSet<WorkerId>>,
    of: HashMap<WorkerId, Listed>,
}

/// A worker as its registration lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    endpoint: String,
    /// Its data-parallel ranks: `dp_start_rank .. dp_start_rank + dp_size`.
    ranks: std::ops::Range<u32>,
}

/// Which worker answers at a gateway endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtEndpoint {
    None,
    One(WorkerId),
    /// Several workers registered the same `ip:port`: the gateway cannot tell them apart.
    Several(Vec<WorkerId>),
}

/// A directory shared by the task that follows registrations and the requests that read it.
pub type SharedDirectory = Arc<RwLock<Directory>>;

impl Directory {
    pub fn shared() -> SharedDirectory {
        Arc::new(RwLock::new(Self::default()))
    }

    /// A worker (re)announced itself; one without a usable base URL is at no endpoint.
    pub fn registered(&mut self, r: &Registration) {
        self.deregistered(r.worker_id);
        if let Some(endpoint) = endpoint_of(&r.base_url) {
            let set = self.at.entry(endpoint.clone()).or_default();
            set.insert(r.worker_id);
            if set.len() == 2 {
                tracing::warn!(
                    endpoint,
                    workers = ?set,
                    "several workers registered one base URL: a gateway cannot tell them apart, so the picker will not move a booking to that endpoint (give each engine its own host:port)"
                );
            }
            let start = r.dp_start_rank;
            self.of.insert(
                r.worker_id,
                Listed {
                    endpoint,
                    ranks: start..start.saturating_add(r.dp_size.max(1)),
                },
            );
        }
    }

    pub fn deregistered(&mut self, worker: WorkerId) {
        if let Some(old) = self.of.remove(&worker) {
            if let Some(set) = self.at.get_mut(&old.endpoint) {
                set.remove(&worker);
                if set.is_empty() {
                    self.at.remove(&old.endpoint);
                }
            }
        }
    }

    /// The worker at `endpoint`, if exactly one registered it.
    pub fn worker_at(&self, endpoint: &str) -> AtEndpoint {
        match self.at.get(endpoint) {
            None => AtEndpoint::None,
            Some(set) if set.len() == 1 => AtEndpoint::One(*set.first().expect("one")),
            Some(set) => AtEndpoint::Several(set.iter().copied().collect()),
        }
    }

    /// How many data-parallel ranks `worker` serves (`None`: not registered here).
    pub fn rank_count(&self, worker: WorkerId) -> Option<u32> {
        self.of.get(&worker).map(|l| l.ranks.len() as u32)
    }

    /// Whether `worker` serves data-parallel rank `rank`.
    pub fn serves_rank(&self, worker: WorkerId, rank: u32) -> bool {
        self.of
            .get(&worker)
            .is_some_and(|l| l.ranks.contains(&rank))
    }

    /// The workers at these endpoints.
    pub fn workers_at(&self, endpoints: &[String]) -> Vec<WorkerId> {
        let mut out: BTreeSet<WorkerId> = BTreeSet::new();
        for e in endpoints {
            if let Some(set) = self.at.get(e) {
                out.extend(set);
            }
        }
        out.into_iter().collect()
    }
}

/// Why the directory cannot follow the registrations.
#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error("a model name makes no bus subject: {0}")]
    Subject(#[from] kvrouter_protocol::SubjectError),
    #[error("cannot follow the workers' registrations: {0}")]
    Bus(#[from] kvrouter_bus::BusError),
}

/// A directory kept up to date with the registrations of every model of `models` on the
/// router's bus.
pub async fn follow_models<'a>(
    router: &kvrouter_client::KvRouterClient,
    models: impl IntoIterator<Item = &'a str>,
) -> Result<SharedDirectory, FollowError> {
    let dir = Directory::shared();
    for name in models {
        let subjects = router.subjects().model(name)?;
        follow(router.bus().clone(), subjects, dir.clone()).await?;
    }
    Ok(dir)
}

/// Keeps `dir` up to date with the registrations of `subjects`' model (asking every worker
/// to announce itself once at the start), until the bus closes.
pub async fn follow(
    bus: Bus,
    subjects: ModelSubjects,
    dir: SharedDirectory,
) -> Result<(), kvrouter_bus::BusError> {
    let mut registers = bus
        .subscribe(&subjects.every_worker(WorkerSubject::Register))
        .await?;
    let mut deregisters = bus
        .subscribe(&subjects.every_worker(WorkerSubject::Deregister))
        .await?;
    let ask = WhoIsThere {
        replica_id: "epp".to_string(),
    };
    if let Ok(bytes) = encode(&ask) {
        bus.publish(&subjects.who_is_there(), bytes.into()).await?;
    }
    tokio::spawn(async move {
        loop {
            tokio::select! {
                m = registers.next() => match m {
                    Some(m) => match decode::<Registration>(&m.payload) {
                        Ok(r) => dir.write().registered(&r),
                        Err(e) => tracing::debug!(error = %e, "undecodable registration"),
                    },
                    None => return,
                },
                m = deregisters.next() => match m {
                    Some(m) => {
                        if let Ok(d) = decode::<Deregistration>(&m.payload) {
                            dir.write().deregistered(d.worker_id);
                        }
                    }
                    None => return,
                },
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(worker: WorkerId, base_url: &str) -> Registration {
        Registration {
            worker_id: worker,
            instance_id: uuid::Uuid::nil(),
            model: "m".into(),
            role: kvrouter_protocol::WorkerRole::Aggregated,
            block_size: 16,
            dp_size: 1,
            dp_start_rank: 0,
            live_ranks: vec![0],
            tp_size: 1,
            capacity_blocks: 1,
            heartbeat_interval_ms: 1000,
            engine: kvrouter_protocol::EngineKind::Vllm,
            base_url: base_url.into(),
        }
    }

    #[test]
    fn workers_are_found_by_their_endpoint_and_move_with_it() {
        let mut d = Directory::default();
        d.registered(&reg(1, "http://10.0.0.1:8000"));
        d.registered(&reg(2, "http://10.0.0.2:8000"));
        d.registered(&reg(3, "http://10.0.0.2:8000"));
        d.registered(&reg(4, ""));
        let at = |e: &[&str]| d.workers_at(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(at(&["10.0.0.2:8000"]), [2, 3]);
        assert_eq!(at(&["10.0.0.1:8000", "10.0.0.9:1"]), [1]);
        assert_eq!(at(&[]), Vec::<WorkerId>::new());
        d.registered(&reg(2, "http://10.0.0.1:8000"));
        d.deregistered(3);
        let at = |e: &[&str]| d.workers_at(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(at(&["10.0.0.2:8000"]), Vec::<WorkerId>::new());
        assert_eq!(at(&["10.0.0.1:8000"]), [1, 2]);
    }

    #[test]
    fn an_endpoint_names_one_worker_or_is_ambiguous_and_ranks_are_known() {
        let mut d = Directory::default();
        let mut dp2 = reg(1, "http://10.0.0.1:8000");
        (dp2.dp_size, dp2.dp_start_rank) = (2, 4);
        d.registered(&dp2);
        d.registered(&reg(2, "http://10.0.0.2:8000"));
        d.registered(&reg(3, "http://10.0.0.2:8000"));
        assert_eq!(d.worker_at("10.0.0.1:8000"), AtEndpoint::One(1));
        assert_eq!(
            d.worker_at("10.0.0.2:8000"),
            AtEndpoint::Several(vec![2, 3])
        );
        assert_eq!(d.worker_at("10.0.0.3:8000"), AtEndpoint::None);
        assert_eq!(
            (d.rank_count(1), d.rank_count(2), d.rank_count(9)),
            (Some(2), Some(1), None)
        );
        assert!(d.serves_rank(1, 4) && d.serves_rank(1, 5));
        assert!(!d.serves_rank(1, 0) && !d.serves_rank(1, 6) && !d.serves_rank(9, 0));
        d.deregistered(3);
        assert_eq!(d.worker_at("10.0.0.2:8000"), AtEndpoint::One(2));
    }

    /// Ranks on several ports of one pod (vLLM's external load balancing), one bridge each:
    /// each rank is its own worker at its own endpoint, told no rank.
    #[test]
    fn ranks_on_several_ports_of_a_pod_are_workers_of_their_own() {
        let mut d = Directory::default();
        for (worker, port, rank) in [(10, 8000, 0), (11, 8001, 1)] {
            let mut r = reg(worker, &format!("http://10.0.0.7:{port}"));
            r.dp_start_rank = rank;
            d.registered(&r);
        }
        assert_eq!(d.worker_at("10.0.0.7:8000"), AtEndpoint::One(10));
        assert_eq!(d.worker_at("10.0.0.7:8001"), AtEndpoint::One(11));
        assert_eq!((d.rank_count(10), d.rank_count(11)), (Some(1), Some(1)));
        assert!(d.serves_rank(11, 1) && !d.serves_rank(11, 0));
        let both = ["10.0.0.7:8000".to_string(), "10.0.0.7:8001".to_string()];
        assert_eq!(d.workers_at(&both), [10, 11]);
    }

    #[test]
    fn endpoints_are_the_base_urls_host_and_port() {
        assert_eq!(
            endpoint_of("http://10.0.0.5:8000").as_deref(),
            Some("10.0.0.5:8000")
        );
        assert_eq!(
            endpoint_of("http://10.0.0.5:8000/v1").as_deref(),
            Some("10.0.0.5:8000")
        );
        assert_eq!(
            endpoint_of("http://[fd00::1]:8000").as_deref(),
            Some("[fd00::1]:8000")
        );
        assert_eq!(endpoint_of("http://engine"), None);
        assert_eq!(endpoint_of("http://engine:port"), None);
    }
}
