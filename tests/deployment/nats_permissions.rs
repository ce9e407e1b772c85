//! The shipped least-privilege NATS configuration (deploy/nats/least-privilege.conf) on a real
//! nats-server: a fleet does its job with it, and no party can say what is not its to say.
//!
//! Absence is proven by order, not by waiting: NATS delivers one connection's messages in
//! order, so when a permitted message published after a forged one arrives, the forged one
//! would have arrived first had the server let it through.

use crate::common;

use bytes::Bytes;
use common::*;
use kvrouter_bus::{Bus, NatsOptions, Subscription};
use kvrouter_protocol::{
    encode, Deregistration, EngineKind, KvEvent, KvEventBatch, KvEventData, ModelSubjects,
    Registration, Subjects, SyncBatch, Tier, WorkerKey, WorkerRole, WorkerSubject,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use uuid::Uuid;

const REPLICA: (&str, &str) = ("kvrouter-replica", "replica-pw");
const FRONTEND: (&str, &str) = ("kvrouter-frontend", "frontend-pw");
const WORKER_10: (&str, &str) = ("worker-10", "worker-10-pw");
const WORKER_11: (&str, &str) = ("worker-11", "worker-11-pw");

/// nats-server started from the shipped file, its passwords defined ahead of it (the file
/// reads them from variables it does not define).
fn server() -> NatsServer {
    static N: AtomicU32 = AtomicU32::new(0);
    let shipped = std::fs::read_to_string(repo_file("deploy/nats/least-privilege.conf"))
        .expect("deploy/nats/least-privilege.conf");
    let mut conf = String::new();
    for (var, (_, password)) in [
        ("KVROUTER_REPLICA_PASSWORD", REPLICA),
        ("KVROUTER_FRONTEND_PASSWORD", FRONTEND),
        ("KVROUTER_WORKER_10_PASSWORD", WORKER_10),
        ("KVROUTER_WORKER_11_PASSWORD", WORKER_11),
    ] {
        conf += &format!("{var}: \"{password}\"\n");
    }
    conf += &shipped;
    let path = std::env::temp_dir().join(format!(
        "kvrouter-least-privilege-{}-{}.conf",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, conf).unwrap();
    let check = std::process::Command::new("nats-server")
        .args(["-t", "-c"])
        .arg(&path)
        .output()
        .expect("nats-server on PATH (scripts/test.sh installs it)");
    assert!(
        check.status.success(),
        "nats-server refuses the shipped configuration: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    NatsServer::start_with_args(&["-c", path.to_str().unwrap()])
}

fn url(nats: &NatsServer, (user, password): (&str, &str)) -> String {
    format!("nats://{user}:{password}@127.0.0.1:{}", nats.port)
}

fn e2e_model_subjects() -> ModelSubjects {
    Subjects::new("kvrouter").unwrap().model(E2E_MODEL).unwrap()
}

fn fresh_registration(worker_id: u64) -> Registration {
    Registration {
        worker_id,
        instance_id: Uuid::new_v4(),
        model: E2E_MODEL.into(),
        role: WorkerRole::Aggregated,
        block_size: E2E_BLOCK as u32,
        dp_size: 1,
        dp_start_rank: 0,
        live_ranks: vec![0],
        tp_size: 1,
        capacity_blocks: 1024,
        heartbeat_interval_ms: 200,
        engine: EngineKind::Mocker,
        base_url: String::new(),
    }
}

/// A claim that `worker_id`'s rank 0 cleared its cache.
fn events(worker_id: u64) -> KvEventBatch {
    KvEventBatch {
        worker_id,
        instance_id: Uuid::new_v4(),
        events: vec![KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(worker_id, 0),
            event_id: 0,
            data: KvEventData::Cleared,
        }],
    }
}

struct Party {
    rt: tokio::runtime::Runtime,
    bus: Bus,
}

impl Party {
    fn connect(nats: &NatsServer, creds: (&str, &str)) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let bus = rt
            .block_on(Bus::connect(&NatsOptions::new(url(nats, creds))))
            .unwrap_or_else(|e| panic!("{} connects: {e}", creds.0));
        Self { rt, bus }
    }

    /// One subscription per subject, all in place on the server when it returns.
    fn subscribe_all(
        &self,
        subjects: impl IntoIterator<Item = String>,
    ) -> BTreeMap<String, Subscription> {
        self.rt.block_on(async {
            let mut subs = BTreeMap::new();
            for subject in subjects {
                let sub = self.bus.subscribe(&subject).await.unwrap();
                subs.insert(subject, sub);
            }
            self.bus.flush().await.unwrap();
            subs
        })
    }

    /// No subscription holds a message. Called once a message published after the forged
    /// ones has arrived on this connection: had the server passed any of them, it would be
    /// here already.
    fn assert_quiet(&self, subs: &mut BTreeMap<String, Subscription>, who: &str) {
        for (subject, sub) in subs.iter_mut() {
            let stray = self.rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(50), sub.next()).await
            });
            assert!(
                !matches!(stray, Ok(Some(_))),
                "{subject} got a message {who} may not send"
            );
        }
    }

    fn publish(&self, subject: &str, bytes: Vec<u8>) {
        self.rt.block_on(async {
            // A denied publish is not an error on the client: the server drops it.
            let _ = self.bus.publish(subject, Bytes::from(bytes)).await;
            self.bus.flush().await.unwrap();
        })
    }

    /// The subjects of the next messages `sub` gets, until one on `until`.
    fn subjects_until(&self, sub: &mut Subscription, until: &str) -> Vec<String> {
        self.rt.block_on(async {
            let mut seen = Vec::new();
            loop {
                let msg = tokio::time::timeout(Duration::from_secs(5), sub.next())
                    .await
                    .unwrap_or_else(|_| panic!("no message on {until} within 5 s: {seen:?}"))
                    .expect("subscription open");
                seen.push(msg.subject.clone());
                if msg.subject == until {
                    return seen;
                }
            }
        })
    }
}

/// Every subject a worker may publish on, its own and the model-wide legacy ones.
fn worker_subjects(s: &ModelSubjects) -> Vec<String> {
    WorkerSubject::PUBLISHED
        .into_iter()
        .flat_map(|w| [Some(s.every_worker(w)), s.legacy(w)])
        .flatten()
        .collect()
}

#[test]
fn a_fleet_routes_and_generates_with_least_privilege_credentials() {
    let nats = server();
    let admin = free_port();
    let (user, password) = REPLICA;
    let replica = serve(
        &nats,
        "r1",
        admin,
        &["--nats-user", user, "--nats-password", password],
    );
    let mut workers = Vec::new();
    for (id, (user, password)) in [(10u64, WORKER_10), (11, WORKER_11)] {
        let id = id.to_string();
        workers.push(mocker_with(
            &nats,
            user,
            &[
                "--model",
                E2E_MODEL,
                "--workers",
                "1",
                "--worker-id-start",
                &id,
                "--block-size",
                "16",
                "--speedup",
                "100",
                "--nats-user",
                user,
                "--nats-password",
                password,
            ],
        ));
    }
    assert!(ready(admin), "the replica never became ready");
    assert!(
        wait_until(Duration::from_secs(10), || metric_sum(
            admin,
            "kvrouter_workers"
        ) == 2.0),
        "both workers registered on their own subjects: {}",
        metrics(admin)
    );
    let tokens = e2e_tokens(7, 4)
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let frontend = url(&nats, FRONTEND);
    let generate = || {
        let out = kvrouter()
            .args(["generate", "--nats", &frontend, "--model", E2E_MODEL])
            .args(["--tokens", &tokens, "--max-tokens", "2"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "generate with the frontend's credentials: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let first = generate();
    assert_eq!(first["output_tokens"], 2, "{first}");
    // The worker's KV events (on its own subject) reached the replica's index: the same
    // prompt is routed to the same worker, its 4 blocks cached.
    assert!(
        wait_until(Duration::from_secs(10), || {
            let again = generate();
            again["worker_id"] == first["worker_id"] && again["overlap_blocks"] == 4
        }),
        "the index never learned the first request's blocks"
    );
    assert_eq!(
        metric_sum(admin, "kvrouter_misattributed_messages_total"),
        0.0
    );
    drop(workers);
    drop(replica);
}

#[test]
fn a_worker_cannot_speak_for_another_worker_nor_for_the_router() {
    let nats = server();
    let s = e2e_model_subjects();
    let observer = Party::connect(&nats, REPLICA);
    let sync = Subjects::new("kvrouter").unwrap().sync();
    let mut subs = observer.subscribe_all(worker_subjects(&s).into_iter().chain([sync.clone()]));
    let w10 = Party::connect(&nats, WORKER_10);
    // As worker 11, on worker 11's subjects and on the model-wide ones.
    w10.publish(&s.register(11), encode(&fresh_registration(11)).unwrap());
    w10.publish(&s.kv_events(11), encode(&events(11)).unwrap());
    for legacy in [WorkerSubject::Register, WorkerSubject::KvEvents] {
        w10.publish(&s.legacy(legacy).unwrap(), encode(&events(11)).unwrap());
    }
    // As a replica: a forged sync batch would add load to every peer's view.
    let forged_sync = SyncBatch {
        replica_id: "forged".into(),
        model: E2E_MODEL.into(),
        changes: Vec::new(),
        instance_id: uuid::Uuid::nil(),
        seq: 0,
    };
    w10.publish(&sync, encode(&forged_sync).unwrap());
    // Then as itself: allowed, and it arrives on every subscription it was published to.
    let own = s.deregister(10);
    let bye = Deregistration {
        worker_id: 10,
        instance_id: Uuid::new_v4(),
    };
    w10.publish(&own, encode(&bye).unwrap());
    w10.publish(&s.register(10), encode(&fresh_registration(10)).unwrap());
    w10.publish(&s.kv_events(10), encode(&events(10)).unwrap());
    // Each arrives alone on its subscription: the forged ones, published first, never came.
    for (what, own) in [
        (WorkerSubject::Deregister, own),
        (WorkerSubject::Register, s.register(10)),
        (WorkerSubject::KvEvents, s.kv_events(10)),
    ] {
        let sub = subs.get_mut(&s.every_worker(what)).unwrap();
        assert_eq!(observer.subjects_until(sub, &own), vec![own.clone()]);
    }
    observer.assert_quiet(&mut subs, "worker 10");
}

#[test]
fn a_frontend_cannot_publish_kv_events_or_registrations() {
    let nats = server();
    let s = e2e_model_subjects();
    let observer = Party::connect(&nats, REPLICA);
    let route = Subjects::new("kvrouter").unwrap().route();
    let mut subs = observer.subscribe_all(worker_subjects(&s).into_iter().chain([route.clone()]));
    let frontend = Party::connect(&nats, FRONTEND);
    frontend.publish(&s.kv_events(10), encode(&events(10)).unwrap());
    frontend.publish(
        &s.legacy(WorkerSubject::KvEvents).unwrap(),
        encode(&events(10)).unwrap(),
    );
    frontend.publish(&s.register(10), encode(&fresh_registration(10)).unwrap());
    frontend.publish(&s.load(10), Vec::new());
    // What a frontend may do, published last: a route request.
    frontend.publish(&route, encode(&plain_route(&e2e_tokens(1, 2))).unwrap());
    let routes = subs.get_mut(&route).unwrap();
    assert_eq!(observer.subjects_until(routes, &route), vec![route.clone()]);
    observer.assert_quiet(&mut subs, "a frontend");
}
