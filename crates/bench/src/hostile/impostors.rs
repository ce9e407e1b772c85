//! The adversaries that act as someone they are not, each with valid credentials of its
//! own: a tenant ending bookings it does not hold, a bridge speaking for another worker, a
//! frontend answering routes and publishing sync batches, readers of others' replies.
//!
//! What each did that took effect is a breach, seen where it would show: a lease operation
//! answered ok; a forged message delivered on a subject its sender may not publish (an
//! observer with a replica's identity, which reads those subjects, compares payloads); a
//! message received on a subscription the sender may not hold; the running worker's
//! registration changed. Refusals are what nats-server sent back (`-ERR Permissions
//! Violation`) and what the fleet counted (the runner reads its counters around the phase).

use super::plan::{AttackFigures, NATS_REFUSED};
use super::targets::{bearer, head, send_read_n, InFlight, Targets};
use bytes::Bytes;
use kvrouter_client::{Booking, KvRouterClient};
use kvrouter_protocol::subjects::ROUTER_QUEUE_GROUP;
use kvrouter_protocol::{
    encode, Abandon, Deregistration, EngineKind, Heartbeat, KvEvent, KvEventBatch, KvEventData,
    Lease, LoadReport, ModelSubjects, RankLoad, Registration, Subjects, SyncBatch, Tier, WorkerKey,
    WorkerRole, WorkerSubject,
};
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{sleep, Instant};
use uuid::Uuid;

/// The most breaches described in the report.
const EXAMPLES: usize = 5;

/// What an impostor did and what came of it.
#[derive(Default)]
struct Ledger {
    ops: u64,
    outcomes: BTreeMap<String, u64>,
    breaches: u64,
    examples: Vec<String>,
}

impl Ledger {
    fn count(&mut self, outcome: impl Into<String>) {
        *self.outcomes.entry(outcome.into()).or_insert(0) += 1;
    }

    fn breach(&mut self, what: String) {
        self.breaches += 1;
        if self.examples.len() < EXAMPLES && !self.examples.contains(&what) {
            self.examples.push(what);
        }
    }

    /// The figures, with the refusals nats-server sent to `parties`.
    fn figures(mut self, parties: &[&Impostor]) -> AttackFigures {
        let refused: u64 = parties
            .iter()
            .map(|p| p.refused.load(Ordering::Relaxed))
            .sum();
        if refused > 0 {
            self.outcomes.insert(NATS_REFUSED.to_string(), refused);
        }
        AttackFigures {
            ops: self.ops,
            outcomes: self.outcomes,
            breaches: self.breaches,
            breach_examples: self.examples,
            ..AttackFigures::default()
        }
    }
}

/// A NATS connection under one generated identity (async-nats itself, as an attacker would
/// use it), counting the permission violations nats-server reports to it.
struct Impostor {
    client: async_nats::Client,
    refused: Arc<AtomicU64>,
}

impl Impostor {
    async fn connect(t: &Targets, who: &str) -> Result<Self, String> {
        let (seed, public) = t.creds.keys(who)?;
        let refused = Arc::new(AtomicU64::new(0));
        let seen = refused.clone();
        let client = async_nats::ConnectOptions::with_nkey(seed)
            .custom_inbox_prefix(format!("_INBOX.{public}"))
            .name(format!("hostile {who}"))
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let async_nats::Event::ServerError(e) = event {
                        if e.to_string()
                            .to_ascii_lowercase()
                            .contains("permissions violation")
                        {
                            seen.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
            .connect(t.nats_url.as_str())
            .await
            .map_err(|e| format!("{who} cannot connect: {e}"))?;
        Ok(Self { client, refused })
    }

    async fn publish(&self, subject: &str, payload: Bytes) {
        // A denied publish is no error on the client: the server drops it and says so.
        let _ = self.client.publish(subject.to_string(), payload).await;
    }

    /// Subscribes (in `queue` if given), flushed: a refusal is on its way when it returns.
    async fn subscribe(
        &self,
        subject: &str,
        queue: Option<&str>,
    ) -> Option<async_nats::Subscriber> {
        let sub = match queue {
            Some(q) => {
                self.client
                    .queue_subscribe(subject.to_string(), q.to_string())
                    .await
            }
            None => self.client.subscribe(subject.to_string()).await,
        }
        .ok();
        let _ = self.client.flush().await;
        sub
    }
}

/// Counts each message on `subs` (after `wait` for stragglers) as a breach.
async fn read_leaks(subs: Vec<(String, async_nats::Subscriber)>, wait: Duration, l: &mut Ledger) {
    use futures_util::{FutureExt, StreamExt};
    sleep(wait).await;
    for (subject, mut sub) in subs {
        while let Some(Some(msg)) = sub.next().now_or_never() {
            l.breach(format!(
                "read a message on {} through a subscription to {subject}",
                msg.subject
            ));
        }
        let _ = sub.unsubscribe().await;
    }
}

/// A startup failure of the attack itself, as its only outcome.
fn unable(what: String) -> AttackFigures {
    AttackFigures {
        outcomes: BTreeMap::from([(format!("could not attack: {what}"), 1)]),
        ..AttackFigures::default()
    }
}

/// An observer with a replica's identity, subscribed to the subjects forged messages would
/// arrive on: it may read them all.
struct Observer {
    party: Impostor,
    subs: Vec<async_nats::Subscriber>,
}

impl Observer {
    async fn watch(t: &Targets, subjects: &[String]) -> Result<Self, String> {
        let who = format!(
            "replica-{}",
            t.replica_ids.last().map_or("", String::as_str)
        );
        let party = Impostor::connect(t, &who).await?;
        let mut subs = Vec::new();
        for s in subjects {
            subs.push(
                party
                    .subscribe(s, None)
                    .await
                    .ok_or_else(|| format!("observer cannot subscribe to {s}"))?,
            );
        }
        // A refusal comes as an event, shortly after the flush.
        sleep(Duration::from_millis(50)).await;
        if party.refused.load(Ordering::Relaxed) > 0 {
            return Err(format!("{who} may not read {subjects:?}"));
        }
        Ok(Self { party, subs })
    }

    /// Counts every delivered message whose (subject, payload) is one of `forged` as a
    /// breach; waits `wait` for the last of them.
    async fn breaches(self, forged: &HashSet<(String, Bytes)>, wait: Duration, l: &mut Ledger) {
        use futures_util::StreamExt;
        let _ = self.party.client.flush().await;
        let mut all = futures_util::stream::select_all(self.subs);
        let end = Instant::now() + wait;
        while let Ok(Some(msg)) = tokio::time::timeout_at(end, all.next()).await {
            if forged.contains(&(msg.subject.to_string(), msg.payload.clone())) {
                l.breach(format!("a forged message was delivered on {}", msg.subject));
            }
        }
    }
}

fn subjects_of(t: &Targets) -> Option<(Subjects, ModelSubjects)> {
    let s = Subjects::new(&t.namespace).ok()?;
    let m = s.model(&t.model).ok()?;
    Some((s, m))
}

/// A lease operation the thief tries on a booking it does not hold.
#[derive(Clone, Copy)]
enum Theft {
    /// Over the JSON API (`prefill_done`, `output_block`, `free`), with a guessed lease,
    /// without one, or without any credentials.
    Http(&'static str, Lease, bool),
    /// Over the bus, with a peer router's credentials and a guessed lease.
    BusFree,
    BusMark,
    BusOutput,
    BusAbandon,
}

/// Another tenant of the JSON API (and a peer router on the bus) that knows the honest
/// clients' request ids and tries to end, mark and extend them.
pub async fn lease_theft(t: &Targets, deadline: Instant, seed: u64) -> AttackFigures {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut opts = kvrouter_bus::NatsOptions::new(t.nats_url.clone());
    opts.nkey_file = Some(t.creds.seed("peer-0"));
    let client = match kvrouter_bus::Bus::connect(&opts).await {
        Ok(bus) => match KvRouterClient::new(bus, &t.namespace) {
            Ok(c) => c.with_timeout(Duration::from_secs(2)),
            Err(e) => return unable(e.to_string()),
        },
        Err(e) => return unable(format!("peer-0 cannot connect: {e}")),
    };
    let Some((subjects, _)) = subjects_of(t) else {
        return unable("bad namespace or model".into());
    };
    let mut l = Ledger::default();
    let mut k = 0usize;
    while Instant::now() < deadline {
        let target = {
            let held = t.inflight.lock();
            (!held.is_empty()).then(|| held[rng.usize(0..held.len())].clone())
        };
        let Some(InFlight {
            request_id,
            replica_id,
        }) = target
        else {
            sleep(Duration::from_millis(2)).await;
            continue;
        };
        let guess = Lease::random();
        let theft = match k % 9 {
            0 => Theft::Http("free", guess, true),
            1 => Theft::Http("free", Lease::NONE, true),
            2 => Theft::Http("prefill_done", guess, true),
            3 => Theft::Http("output_block", guess, true),
            4 => Theft::Http("free", guess, false),
            5 => Theft::BusFree,
            6 => Theft::BusMark,
            7 => Theft::BusOutput,
            _ => Theft::BusAbandon,
        };
        k += 1;
        l.ops += 1;
        let booking = Booking {
            replica_id: replica_id.clone(),
            model: t.model.clone(),
            request_id: request_id.clone(),
            lease: guess,
        };
        let bus = |r: Result<(), kvrouter_client::ClientError>, what: &str, l: &mut Ledger| match r
        {
            Ok(()) => l.breach(format!("{what} of {request_id} over the bus answered ok")),
            Err(e) => l.count(format!("bus {}", e.kind_label())),
        };
        match theft {
            Theft::Http(op, lease, authenticated) => {
                let mut body = serde_json::json!({"model": t.model, "replica_id": replica_id});
                if lease != Lease::NONE {
                    body["lease"] = lease.to_hex().into();
                }
                let body = body.to_string();
                let auth = if authenticated {
                    t.tenant_auth(t.replica)
                } else {
                    String::new()
                };
                let path = format!("/v1/requests/{request_id}/{op}");
                let h = head("POST", &path, &auth, body.len());
                match send_read_n(t.replica, &h, body.as_bytes(), 1, Duration::from_secs(5), 0)
                    .await
                {
                    Ok((200, _)) => l.breach(format!("{op} of {request_id} answered 200")),
                    Ok((status, _)) => l.count(format!("http {status}")),
                    Err(e) => l.count(e),
                }
            }
            Theft::BusFree => bus(client.free(&booking).await, "free", &mut l),
            Theft::BusMark => bus(client.mark_prefill(&booking).await, "mark_prefill", &mut l),
            Theft::BusOutput => bus(
                client.add_output_block(&booking, None).await,
                "add_output_block",
                &mut l,
            ),
            Theft::BusAbandon => {
                let abandon = Abandon {
                    model: t.model.clone(),
                    request_id: request_id.clone(),
                    call_id: rng.u64(..),
                    kept_by: None,
                    lease: guess,
                };
                if let Ok(bytes) = encode(&abandon) {
                    let _ = client
                        .bus()
                        .publish(&subjects.abandon(), Bytes::from(bytes))
                        .await;
                    l.count("abandon published");
                }
            }
        }
    }
    l.figures(&[])
}

/// What a bridge publishes, every kind, claiming to be `worker` (instance `instance`).
fn forged_worker_messages(
    t: &Targets,
    worker: u64,
    instance: Uuid,
) -> Vec<(WorkerSubject, Vec<u8>)> {
    let registration = Registration {
        worker_id: worker,
        instance_id: instance,
        model: t.model.clone(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        dp_size: 2,
        dp_start_rank: 0,
        live_ranks: vec![0, 1],
        tp_size: 1,
        capacity_blocks: 4096,
        heartbeat_interval_ms: 200,
        engine: EngineKind::Vllm,
        // Where the prompts would go had the forgery worked.
        base_url: "http://127.0.0.1:9".into(),
    };
    let cleared = KvEventBatch {
        worker_id: worker,
        instance_id: instance,
        events: (0..2)
            .map(|rank| KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(worker, rank),
                event_id: u64::MAX / 2,
                data: KvEventData::Cleared,
            })
            .collect(),
    };
    let load = LoadReport {
        worker_id: worker,
        instance_id: instance,
        ranks: (0..2)
            .map(|dp_rank| RankLoad {
                dp_rank,
                active_blocks: 4096,
                waiting_requests: 1000,
            })
            .collect(),
    };
    let heartbeat = Heartbeat {
        worker_id: worker,
        instance_id: instance,
        live_ranks: Vec::new(),
    };
    let bye = Deregistration {
        worker_id: worker,
        instance_id: instance,
    };
    [
        (WorkerSubject::Register, encode(&registration)),
        (WorkerSubject::KvEvents, encode(&cleared)),
        (WorkerSubject::Load, encode(&load)),
        (WorkerSubject::Heartbeat, encode(&heartbeat)),
        (WorkerSubject::Deregister, encode(&bye)),
    ]
    .into_iter()
    .filter_map(|(w, bytes)| Some((w, bytes.ok()?)))
    .collect()
}

/// A valid bridge identity of a worker that does not run, speaking for the running one:
/// on the running worker's subjects and the model-wide legacy ones (nats-server refuses),
/// and on its own subjects with the running worker's id inside (the replicas refuse:
/// misattributed). It also tries to serve the running worker's state and generate
/// requests. Afterwards the running worker must still be registered as itself.
pub async fn forged_worker(t: &Targets, deadline: Instant) -> AttackFigures {
    let Some((_, m)) = subjects_of(t) else {
        return unable("bad namespace or model".into());
    };
    let (victim, own) = (t.worker_id, t.spare_worker);
    let mut watched: Vec<String> = WorkerSubject::PUBLISHED
        .into_iter()
        .map(|w| m.worker(victim, w))
        .collect();
    watched.extend(
        WorkerSubject::PUBLISHED
            .into_iter()
            .filter_map(|w| m.legacy(w)),
    );
    let observer = match Observer::watch(t, &watched).await {
        Ok(o) => o,
        Err(e) => return unable(e),
    };
    let forger = match Impostor::connect(t, &format!("bridge-{own}")).await {
        Ok(f) => f,
        Err(e) => return unable(e),
    };
    let mut l = Ledger::default();
    let mut forbidden = HashSet::new();
    let mut served = Vec::new();
    for subject in [m.state(victim), m.generate(victim)] {
        l.ops += 1;
        if let Some(sub) = forger.subscribe(&subject, None).await {
            served.push((subject, sub));
        }
    }
    while Instant::now() < deadline {
        // A new instance each round: every forged payload is unique.
        let messages = forged_worker_messages(t, victim, Uuid::new_v4());
        for (what, bytes) in messages {
            let bytes = Bytes::from(bytes);
            let mut on = vec![(m.worker(victim, what), true), (m.worker(own, what), false)];
            on.extend(m.legacy(what).map(|s| (s, true)));
            for (subject, refused_by_server) in on {
                l.ops += 1;
                if refused_by_server {
                    forbidden.insert((subject.clone(), bytes.clone()));
                }
                forger.publish(&subject, bytes.clone()).await;
            }
        }
        let _ = forger.client.flush().await;
        sleep(Duration::from_millis(50)).await;
    }
    let _ = forger.client.flush().await;
    observer
        .breaches(&forbidden, Duration::from_millis(500), &mut l)
        .await;
    read_leaks(served, Duration::from_millis(100), &mut l).await;
    victim_intact(t, victim, own, &mut l).await;
    l.figures(&[&forger])
}

/// The running worker still registered as itself (its base URL, its ranks live) and the
/// forger's id not at all, on every replica.
async fn victim_intact(t: &Targets, victim: u64, forger: u64, l: &mut Ledger) {
    for &port in &t.replica_ports {
        let auth = bearer(&t.creds.tenant_token);
        let h = head("GET", "/v1/workers", &auth, 0);
        let answer = send_read_n(port, &h, b"", 0, Duration::from_secs(5), 1 << 20).await;
        let Ok((200, text)) = answer else {
            l.count(format!("GET /v1/workers: {answer:?}"));
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let ranks: Vec<&serde_json::Value> = v["models"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|m| m["workers"].as_array().into_iter().flatten())
            .collect();
        let of = |w: u64| ranks.iter().filter(move |r| r["worker_id"] == w);
        let victim_ok = of(victim).count() == 2
            && of(victim).all(|r| r["base_url"] == t.engine_url.as_str() && r["live"] == true);
        if !victim_ok {
            l.breach(format!(
                "worker {victim} on the replica at port {port} is no longer itself: {:?}",
                of(victim).collect::<Vec<_>>()
            ));
        }
        if of(forger).next().is_some() {
            l.breach(format!(
                "worker {forger} (never started) is registered on the replica at port {port}"
            ));
        }
    }
}

/// A frontend's credentials used to answer route and lease requests (in the replicas'
/// queue group, and outside it), to read sync, and to publish sync batches as each replica
/// (a huge sequence number and a new instance: had one landed, the peers would drop that
/// replica's requests and take its genuine batches for stale).
pub async fn frontend_impostor(t: &Targets, deadline: Instant) -> AttackFigures {
    let Some((s, _)) = subjects_of(t) else {
        return unable("bad namespace or model".into());
    };
    let watched = vec![s.sync_all(), s.legacy_sync()];
    let observer = match Observer::watch(t, &watched).await {
        Ok(o) => o,
        Err(e) => return unable(e),
    };
    let imp = match Impostor::connect(t, "frontend-0").await {
        Ok(f) => f,
        Err(e) => return unable(e),
    };
    let mut listens: Vec<(String, Option<&str>)> = vec![
        (s.route(), Some(ROUTER_QUEUE_GROUP)),
        (s.route_disagg(), Some(ROUTER_QUEUE_GROUP)),
        (s.route(), None),
        (s.sync_all(), None),
    ];
    for r in &t.replica_ids {
        listens.push((format!("{}.router.replica.{r}.>", t.namespace), None));
    }
    let mut l = Ledger::default();
    let mut forbidden = HashSet::new();
    let mut seq = u64::MAX / 2;
    while Instant::now() < deadline {
        let mut subs = Vec::new();
        for (subject, queue) in &listens {
            l.ops += 1;
            if let Some(sub) = imp.subscribe(subject, *queue).await {
                subs.push((subject.clone(), sub));
            }
        }
        for r in &t.replica_ids {
            seq += 1;
            let batch = SyncBatch {
                replica_id: r.clone(),
                model: t.model.clone(),
                changes: Vec::new(),
                instance_id: Uuid::new_v4(),
                seq,
            };
            let Ok(bytes) = encode(&batch) else { continue };
            let bytes = Bytes::from(bytes);
            for subject in [s.sync_of(r), s.legacy_sync()] {
                l.ops += 1;
                forbidden.insert((subject.clone(), bytes.clone()));
                imp.publish(&subject, bytes.clone()).await;
            }
        }
        let _ = imp.client.flush().await;
        // Route requests flow all the time: a subscription let through would catch some.
        read_leaks(subs, Duration::from_millis(100), &mut l).await;
    }
    observer
        .breaches(&forbidden, Duration::from_millis(500), &mut l)
        .await;
    l.figures(&[&imp])
}

/// Frontend, peer and bridge identities subscribing to every reply (`_INBOX.>`), to the
/// replicas' and the honest frontend's replies, and to everything (`>`).
pub async fn reply_reader(t: &Targets, deadline: Instant) -> AttackFigures {
    let mut readers = Vec::new();
    for who in [
        "frontend-0".to_string(),
        "peer-0".to_string(),
        format!("bridge-{}", t.spare_worker),
    ] {
        match Impostor::connect(t, &who).await {
            Ok(p) => readers.push((who, p)),
            Err(e) => return unable(e),
        }
    }
    let mut others = Vec::new();
    for who in t
        .replica_ids
        .iter()
        .map(|r| format!("replica-{r}"))
        .chain(["frontend-0".to_string()])
    {
        match t.creds.keys(&who) {
            Ok((_, public)) => others.push((who, format!("_INBOX.{public}.>"))),
            Err(e) => return unable(e),
        }
    }
    let mut l = Ledger::default();
    while Instant::now() < deadline {
        for (who, reader) in &readers {
            let mut subjects = vec!["_INBOX.>".to_string(), ">".to_string()];
            subjects.extend(
                others
                    .iter()
                    .filter(|(owner, _)| owner != who)
                    .map(|(_, s)| s.clone()),
            );
            let mut subs = Vec::new();
            for subject in subjects {
                l.ops += 1;
                if let Some(sub) = reader.subscribe(&subject, None).await {
                    subs.push((format!("{subject} as {who}"), sub));
                }
            }
            read_leaks(subs, Duration::from_millis(50), &mut l).await;
        }
    }
    let parties: Vec<&Impostor> = readers.iter().map(|(_, p)| p).collect();
    l.figures(&parties)
}
