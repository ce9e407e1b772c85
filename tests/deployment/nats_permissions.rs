//! One NATS identity per role on a real nats-server: `kvrouter creds` (the real binary)
//! writes the seeds and the users file, nats-server includes it, and a fleet does its job
//! with one identity each, while no identity can say or read what is not its own.
//!
//! Refusals are proven two ways: the server's own "Permissions Violation" error to the
//! offender (async-nats reports it), and, for publishes, by order rather than by waiting:
//! NATS delivers one connection's messages in order, so when a permitted message published
//! after a forged one arrives, the forged one would have arrived first had the server let it
//! through.

use crate::common;

use bytes::Bytes;
use common::*;
use kvrouter_bus::{Bus, NatsOptions, Subscription};
use kvrouter_protocol::{
    encode, Deregistration, EngineKind, KvEvent, KvEventBatch, KvEventData, ModelSubjects,
    Registration, Subjects, SyncBatch, Tier, WorkerKey, WorkerRole, WorkerSubject,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

/// Identities written by `kvrouter creds` into a temporary directory, for the example fleet
/// of deploy/nats/least-privilege.conf: replicas a and b, frontend-0, bridges 10 and 11,
/// peer-0, and an endpoint picker, epp-0.
pub struct Creds {
    pub dir: tempfile::TempDir,
}

impl Creds {
    pub fn generate() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = kvrouter()
            .args(["creds", "--out"])
            .arg(dir.path())
            .args([
                "--replica-ids",
                "a,b",
                "--worker-ids",
                "10,11",
                "--peers",
                "1",
                "--epps",
                "1",
            ])
            .output()
            .expect("kvrouter runs");
        assert!(
            out.status.success(),
            "kvrouter creds: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    /// The seed file of `who` (`replica-a`, `frontend-0`, `bridge-10`, ...).
    pub fn seed(&self, who: &str) -> PathBuf {
        self.dir.path().join("seeds").join(format!("{who}.nk"))
    }

    pub fn seed_arg(&self, who: &str) -> String {
        self.seed(who).to_str().unwrap().to_string()
    }

    pub fn public_key(&self, who: &str) -> String {
        let seed = std::fs::read_to_string(self.seed(who)).unwrap();
        nkeys::KeyPair::from_seed(seed.trim()).unwrap().public_key()
    }
}

/// A nats-server and its monitoring port: a client's flush only writes its subscriptions
/// out, so a party asks the server (`/connz`) whether they are in place before anyone
/// publishes to them.
struct Server {
    nats: NatsServer,
    monitor: u16,
}

impl std::ops::Deref for Server {
    type Target = NatsServer;
    fn deref(&self) -> &NatsServer {
        &self.nats
    }
}

impl Server {
    /// Waits (5 s) until one connection holds every subject of `subjects`.
    fn await_subscribed(&self, subjects: &[String]) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let (status, body) = http_get(self.monitor, "/connz?subs=1");
            if status == 200 {
                let connz: serde_json::Value = serde_json::from_str(&body).unwrap();
                let holds_all = connz["connections"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| {
                        let held = c["subscriptions_list"].as_array();
                        subjects
                            .iter()
                            .all(|s| held.is_some_and(|h| h.iter().any(|x| x.as_str() == Some(s))))
                    });
                if holds_all {
                    return;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the server did not hold {subjects:?} within 5 s: {body}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// nats-server with a configuration that only includes the generated users file.
fn server(creds: &Creds) -> Server {
    let conf = creds.dir.path().join("nats.conf");
    std::fs::write(&conf, "include \"nats-users.conf\"\n").unwrap();
    let check = std::process::Command::new("nats-server")
        .args(["-t", "-c"])
        .arg(&conf)
        .output()
        .expect("nats-server on PATH (scripts/test.sh installs it)");
    assert!(
        check.status.success(),
        "nats-server refuses the generated users: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let monitor = free_port();
    let nats =
        NatsServer::start_with_args(&["-c", conf.to_str().unwrap(), "-m", &monitor.to_string()]);
    Server { nats, monitor }
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

fn sync_batch(replica_id: &str) -> SyncBatch {
    SyncBatch {
        replica_id: replica_id.into(),
        model: E2E_MODEL.into(),
        changes: Vec::new(),
        instance_id: Uuid::new_v4(),
        seq: 1,
    }
}

/// A party on the bus with one identity, through kvrouter's bus (as the processes are).
struct Party<'s> {
    rt: tokio::runtime::Runtime,
    bus: Bus,
    server: &'s Server,
}

impl<'s> Party<'s> {
    fn connect(nats: &'s Server, creds: &Creds, who: &str) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut opts = NatsOptions::new(nats.url());
        opts.nkey_file = Some(creds.seed(who));
        let bus = rt
            .block_on(Bus::connect(&opts))
            .unwrap_or_else(|e| panic!("{who} connects: {e}"));
        Self {
            rt,
            bus,
            server: nats,
        }
    }

    /// One subscription per subject, all in place on the server when it returns.
    fn subscribe_all(
        &self,
        subjects: impl IntoIterator<Item = String>,
    ) -> BTreeMap<String, Subscription> {
        let subs = self.rt.block_on(async {
            let mut subs = BTreeMap::new();
            for subject in subjects {
                let sub = self.bus.subscribe(&subject).await.unwrap();
                subs.insert(subject, sub);
            }
            self.bus.flush().await.unwrap();
            subs
        });
        self.server
            .await_subscribed(&subs.keys().cloned().collect::<Vec<_>>());
        subs
    }

    /// A queue subscription in `group`, in place on the server when it returns.
    fn queue_subscribe(&self, subject: &str, group: &str) -> Subscription {
        let sub = self.rt.block_on(async {
            let sub = self.bus.queue_subscribe(subject, group).await.unwrap();
            self.bus.flush().await.unwrap();
            sub
        });
        self.server.await_subscribed(&[subject.to_string()]);
        sub
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

/// A party speaking NATS with async-nats directly (no kvrouter code between), collecting the
/// server's errors to it.
struct Raw {
    rt: tokio::runtime::Runtime,
    client: async_nats::Client,
    errors: Arc<Mutex<Vec<String>>>,
    /// Subscriptions kept open (a dropped one unsubscribes).
    subs: Vec<async_nats::Subscriber>,
}

impl Raw {
    fn connect(nats: &NatsServer, creds: &Creds, who: &str) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let seed = std::fs::read_to_string(creds.seed(who)).unwrap();
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let client = rt
            .block_on(
                async_nats::ConnectOptions::with_nkey(seed.trim().to_string())
                    .custom_inbox_prefix(format!("_INBOX.{}", creds.public_key(who)))
                    .event_callback(move |event| {
                        let seen = seen.clone();
                        async move {
                            if let async_nats::Event::ServerError(e) = event {
                                seen.lock().unwrap().push(e.to_string());
                            }
                        }
                    })
                    .connect(nats.url()),
            )
            .unwrap_or_else(|e| panic!("{who} connects: {e}"));
        Self {
            rt,
            client,
            errors,
            subs: Vec::new(),
        }
    }

    fn subscribe(&mut self, subject: &str, queue: Option<&str>) {
        let sub = self.rt.block_on(async {
            let sub = match queue {
                None => self.client.subscribe(subject.to_string()).await,
                Some(q) => {
                    self.client
                        .queue_subscribe(subject.to_string(), q.to_string())
                        .await
                }
            };
            self.client.flush().await.unwrap();
            sub.unwrap()
        });
        self.subs.push(sub);
    }

    fn publish(&self, subject: &str, bytes: Vec<u8>) {
        self.rt.block_on(async {
            self.client
                .publish(subject.to_string(), bytes.into())
                .await
                .unwrap();
            self.client.flush().await.unwrap();
        });
    }

    /// Waits (up to 5 s) for the server's permissions violation naming `what` (`Publish to
    /// "S"` or `Subscription to "S"`).
    fn refused(&self, what: &str) -> bool {
        let want = format!("Permissions Violation for {what}");
        wait_until(Duration::from_secs(5), || {
            self.errors
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.contains(&want))
        })
    }

    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
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
fn a_fleet_routes_syncs_and_generates_with_one_identity_each() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let (admin_a, admin_b) = (free_port(), free_port());
    let replicas: Vec<Proc> = [("a", admin_a), ("b", admin_b)]
        .into_iter()
        .map(|(id, admin)| {
            let seed = creds.seed_arg(&format!("replica-{id}"));
            serve(
                &nats,
                id,
                admin,
                &["--replica-sync", "--nats-nkey-file", &seed],
            )
        })
        .collect();
    let mut workers = Vec::new();
    for id in ["10", "11"] {
        let seed = creds.seed_arg(&format!("bridge-{id}"));
        workers.push(mocker_with(
            &nats,
            &format!("worker-{id}"),
            &[
                "--model",
                E2E_MODEL,
                "--workers",
                "1",
                "--worker-id-start",
                id,
                "--block-size",
                "16",
                "--speedup",
                "100",
                "--nats-nkey-file",
                &seed,
            ],
        ));
    }
    for admin in [admin_a, admin_b] {
        assert!(ready(admin), "a replica never became ready");
        assert!(
            wait_until(Duration::from_secs(10), || {
                metric_sum(admin, "kvrouter_workers") == 2.0
                    && metric_sum(admin, "kvrouter_replica_sync_peers") == 1.0
            }),
            "both workers registered on their own subjects and the peer's sync batches \
             arrive on its own: {}",
            metrics(admin)
        );
    }
    let frontend = creds.seed_arg("frontend-0");
    let tokens = e2e_tokens(7, 4)
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    // A booked route: whichever replica makes it, the other learns of it by replica sync.
    let out = kvrouter()
        .args(["route", "--nats", &nats.url(), "--model", E2E_MODEL])
        .args(["--tokens", &tokens, "--request-id", "booked"])
        .args(["--nats-nkey-file", &frontend])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "route with the frontend's identity: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for admin in [admin_a, admin_b] {
        assert!(
            wait_until(Duration::from_secs(10), || metric_sum(
                admin,
                "kvrouter_worker_active_requests"
            ) == 1.0),
            "both replicas count the booked request: {}",
            metrics(admin)
        );
    }
    let generate = || {
        let out = kvrouter()
            .args(["generate", "--nats", &nats.url(), "--model", E2E_MODEL])
            .args(["--tokens", &tokens, "--max-tokens", "2"])
            .args(["--nats-nkey-file", &frontend])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "generate with the frontend's identity: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let first = generate();
    assert_eq!(first["output_tokens"], 2, "{first}");
    // The worker's KV events (on its own subject) reached the replicas' indexes: a lookup of
    // the same prompt (which books nothing, so it cannot move the cache as another generate
    // would while the events are on their way) goes to the same worker, its 4 blocks cached.
    let lookup = || {
        let out = kvrouter()
            .args(["route", "--nats", &nats.url(), "--model", E2E_MODEL])
            .args(["--tokens", &tokens, "--no-update-states"])
            .args(["--nats-nkey-file", &frontend])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "lookup with the frontend's identity: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    assert!(
        wait_until(Duration::from_secs(10), || {
            let again = lookup();
            again["worker_id"] == first["worker_id"] && again["overlap_blocks"] == 4
        }),
        "the index never learned the first request's blocks"
    );
    for admin in [admin_a, admin_b] {
        assert_eq!(
            metric_sum(admin, "kvrouter_misattributed_messages_total"),
            0.0,
            "{}",
            metrics(admin)
        );
    }
    drop(workers);
    drop(replicas);
}

#[test]
fn a_frontend_reads_only_its_own_replies_and_cannot_answer_routes_or_sync() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let s = Subjects::new("kvrouter").unwrap();
    let replica_a = creds.public_key("replica-a");
    let mut frontend = Raw::connect(&nats, &creds, "frontend-0");
    for (subject, queue) in [
        ("_INBOX.>".to_string(), None),
        (format!("_INBOX.{replica_a}.>"), None),
        (s.route(), None),
        (
            s.route(),
            Some(kvrouter_protocol::subjects::ROUTER_QUEUE_GROUP),
        ),
        (s.sync_all(), None),
        (s.free("a"), None),
    ] {
        frontend.subscribe(&subject, queue);
        assert!(
            frontend.refused(&format!("Subscription to \"{subject}\"")),
            "the frontend may subscribe {subject} {queue:?}: {:?}",
            frontend.errors()
        );
    }
    // Its own inbox is its to read.
    let own = format!("_INBOX.{}.x", creds.public_key("frontend-0"));
    frontend.subscribe(&own, None);
    // Publishing a sync batch, as a replica or on the shared legacy subject, is refused too.
    let observer = Party::connect(&nats, &creds, "replica-b");
    let mut subs = observer.subscribe_all([s.sync_all(), s.legacy_sync(), s.abandon()]);
    for subject in [s.sync_of("a"), s.legacy_sync()] {
        frontend.publish(&subject, encode(&sync_batch("a")).unwrap());
        assert!(
            frontend.refused(&format!("Publish to \"{subject}\"")),
            "{:?}",
            frontend.errors()
        );
    }
    // What a frontend may do, published last: an abandon.
    let abandon = kvrouter_protocol::Abandon {
        model: E2E_MODEL.into(),
        request_id: "x".into(),
        call_id: 1,
        kept_by: None,
        lease: kvrouter_protocol::Lease::NONE,
    };
    frontend.publish(&s.abandon(), encode(&abandon).unwrap());
    let abandons = subs.get_mut(&s.abandon()).unwrap();
    assert_eq!(
        observer.subjects_until(abandons, &s.abandon()),
        vec![s.abandon()]
    );
    observer.assert_quiet(&mut subs, "a frontend");
    assert!(
        !frontend.errors().iter().any(|e| e.contains(&own)),
        "its own inbox: {:?}",
        frontend.errors()
    );
}

/// An endpoint picker reads the workers' registrations and calls the roll (its directory of
/// endpoints), and can neither read their events nor answer routes.
#[test]
fn an_endpoint_picker_follows_registrations_and_nothing_else() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let s = Subjects::new("kvrouter").unwrap();
    let m = e2e_model_subjects();
    let epp = Party::connect(&nats, &creds, "epp-0");
    let mut regs = epp.subscribe_all([m.every_worker(WorkerSubject::Register)]);
    let bridge = Party::connect(&nats, &creds, "bridge-10");
    let mut roll = bridge.subscribe_all([m.who_is_there()]);
    epp.publish(
        &m.who_is_there(),
        encode(&kvrouter_protocol::WhoIsThere {
            replica_id: "epp".into(),
        })
        .unwrap(),
    );
    let calls = roll.get_mut(&m.who_is_there()).unwrap();
    assert_eq!(
        bridge.subjects_until(calls, &m.who_is_there()),
        vec![m.who_is_there()]
    );
    bridge.publish(&m.register(10), encode(&fresh_registration(10)).unwrap());
    let heard = regs
        .get_mut(&m.every_worker(WorkerSubject::Register))
        .unwrap();
    assert_eq!(
        epp.subjects_until(heard, &m.register(10)),
        vec![m.register(10)]
    );
    let mut raw = Raw::connect(&nats, &creds, "epp-0");
    for (subject, queue) in [
        (m.kv_events(10), None),
        (m.load(10), None),
        (
            s.route(),
            Some(kvrouter_protocol::subjects::ROUTER_QUEUE_GROUP),
        ),
        ("_INBOX.>".to_string(), None),
    ] {
        raw.subscribe(&subject, queue);
        assert!(
            raw.refused(&format!("Subscription to \"{subject}\"")),
            "the picker may subscribe {subject}: {:?}",
            raw.errors()
        );
    }
}

#[test]
fn a_replica_syncs_only_as_itself() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let s = Subjects::new("kvrouter").unwrap();
    let observer = Party::connect(&nats, &creds, "replica-b");
    let mut subs = observer.subscribe_all([s.sync_all(), s.legacy_sync()]);
    let mut a = Raw::connect(&nats, &creds, "replica-a");
    // As b, on b's subject and on the shared one.
    for subject in [s.sync_of("b"), s.legacy_sync()] {
        a.publish(&subject, encode(&sync_batch("b")).unwrap());
        assert!(a.refused(&format!("Publish to \"{subject}\"")), "{subject}");
    }
    // Nor may it read b's lease updates or replies.
    for subject in [
        s.free("b"),
        format!("_INBOX.{}.>", creds.public_key("replica-b")),
    ] {
        a.subscribe(&subject, None);
        assert!(
            a.refused(&format!("Subscription to \"{subject}\"")),
            "{subject}"
        );
    }
    // Then as itself: allowed, and alone on the observer's subscription.
    let own = s.sync_of("a");
    a.publish(&own, encode(&sync_batch("a")).unwrap());
    let sync = subs.get_mut(&s.sync_all()).unwrap();
    assert_eq!(observer.subjects_until(sync, &own), vec![own.clone()]);
    observer.assert_quiet(&mut subs, "replica a");
}

#[test]
fn a_worker_cannot_speak_for_another_worker_nor_for_the_router() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let s = e2e_model_subjects();
    let router = Subjects::new("kvrouter").unwrap();
    let observer = Party::connect(&nats, &creds, "replica-a");
    let mut subs = observer.subscribe_all(
        worker_subjects(&s)
            .into_iter()
            .chain([router.sync_all(), router.legacy_sync()]),
    );
    let w10 = Party::connect(&nats, &creds, "bridge-10");
    // As worker 11, on worker 11's subjects and on the model-wide ones.
    w10.publish(&s.register(11), encode(&fresh_registration(11)).unwrap());
    w10.publish(&s.kv_events(11), encode(&events(11)).unwrap());
    for legacy in [WorkerSubject::Register, WorkerSubject::KvEvents] {
        w10.publish(&s.legacy(legacy).unwrap(), encode(&events(11)).unwrap());
    }
    // As a replica: a forged sync batch would add load to every peer's view.
    for subject in [router.sync_of("a"), router.legacy_sync()] {
        w10.publish(&subject, encode(&sync_batch("a")).unwrap());
    }
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
    // Nor may it serve another worker's state or generate subjects.
    let mut raw = Raw::connect(&nats, &creds, "bridge-10");
    for subject in [s.state(11), s.generate(11)] {
        raw.subscribe(&subject, None);
        assert!(
            raw.refused(&format!("Subscription to \"{subject}\"")),
            "{subject}"
        );
    }
}

#[test]
fn a_frontend_cannot_publish_kv_events_or_registrations() {
    let creds = Creds::generate();
    let nats = server(&creds);
    let s = e2e_model_subjects();
    let observer = Party::connect(&nats, &creds, "replica-a");
    let route = Subjects::new("kvrouter").unwrap().route();
    let mut subs = observer.subscribe_all(worker_subjects(&s));
    // A replica answers routes only in the replicas' queue group.
    let group = kvrouter_protocol::subjects::ROUTER_QUEUE_GROUP;
    subs.insert(route.clone(), observer.queue_subscribe(&route, group));
    let frontend = Party::connect(&nats, &creds, "frontend-0");
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
