//! The process-driving runner: starts the fleet, runs traffic, executes the [`Schedule`],
//! and checks every replica against the truth at each checkpoint and at the end.

use super::compare::{index_prefixes, truth_prefixes, FleetDiff, Prefixes};
use super::config::ChaosConfig;
use super::fleet::{
    http_get, kill, restart_nats, start_nats, BridgeProc, Engine, FleetError, Mocker, Replica,
};
use super::report::{ChaosReport, FaultResult};
use super::schedule::{FaultKind, FleetShape, Schedule, Step};
use super::traffic::{EngineTarget, Traffic, TrafficConfig};
use bytes::Bytes;
use kvrouter_bus::{Bus, NatsOptions};
use kvrouter_client::KvRouterClient;
use kvrouter_protocol::{
    decode, encode, fleet_subjects, ModelSubjects, Reply, StateChunk, StateQuery, Subjects,
    WorkerKey, FORMAT_VERSION,
};
use kvrouter_testkit::{free_port, free_ports, metric_sum_in, NatsServer, Proc};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Replica metrics that count active sequences; 0 on every replica when nothing is in flight.
pub const ACTIVE_REQUESTS: &str = "kvrouter_worker_active_requests";
pub const ACTIVE_BLOCKS: &str = "kvrouter_worker_active_blocks";

#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("bad chaos configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Bus(String),
}

struct Run {
    cfg: ChaosConfig,
    nats: NatsServer,
    replicas: Vec<Replica>,
    mockers: Vec<Mocker>,
    engines: Vec<Engine>,
    bridges: Vec<BridgeProc>,
    bus: Bus,
    subjects: ModelSubjects,
}

/// Runs the whole chaos bench; the report says whether the fleet diverged.
pub async fn run_chaos(cfg: ChaosConfig) -> Result<ChaosReport, ChaosError> {
    if cfg.replicas < 2 || cfg.mockers == 0 || cfg.workers_per_mocker == 0 || cfg.dp_size == 0 {
        return Err(ChaosError::Config(
            "need at least 2 replicas, 1 mocker, 1 worker and 1 rank".into(),
        ));
    }
    if cfg.engines.iter().any(|e| !(1..=64).contains(&e.dp_size)) {
        return Err(ChaosError::Config(
            "an emulated engine needs 1..=64 ranks".into(),
        ));
    }
    if !(0.0..=1.0).contains(&cfg.engine_share) {
        return Err(ChaosError::Config(
            "the engines' share of requests is 0..=1".into(),
        ));
    }
    if let Some(d) = &cfg.log_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| ChaosError::Config(format!("log dir {}: {e}", d.display())))?;
    }
    let wall = Instant::now();
    let log_dir = cfg.log_dir.clone();
    let nats = start_nats(log_dir.as_deref())?;
    let url = nats.url();
    let s = |x: &str| x.to_string();
    let mut mockers = Vec::new();
    for j in 0..cfg.mockers {
        let first_id = 1000 + 100 * j as u64;
        let mut m = Mocker {
            name: format!("mocker{j}"),
            first_id,
            workers: cfg.workers_per_mocker,
            args: vec![
                s("mocker"),
                s("--nats"),
                url.clone(),
                s("--namespace"),
                cfg.namespace.clone(),
                s("--model"),
                cfg.model.clone(),
                s("--workers"),
                cfg.workers_per_mocker.to_string(),
                s("--dp-size"),
                cfg.dp_size.to_string(),
                s("--block-size"),
                cfg.block_size.to_string(),
                s("--capacity-blocks"),
                cfg.capacity_blocks.to_string(),
                s("--speedup"),
                cfg.speedup.to_string(),
                s("--worker-id-start"),
                first_id.to_string(),
                s("--heartbeat-ms"),
                s("200"),
            ],
            proc: None,
        };
        m.start(&cfg.exe, log_dir.as_deref()).await?;
        mockers.push(m);
    }
    let mut engines = Vec::new();
    let mut bridges = Vec::new();
    for (k, spec) in cfg.engines.iter().enumerate() {
        let dp = spec.dp_size as u16;
        let (zmq, http) = (free_ports(2 * dp), free_port());
        let name = format!("{}{k}", spec.kind);
        let mut e = Engine {
            name: name.clone(),
            kind: spec.kind,
            zmq_port: zmq,
            http_port: http,
            dp_size: spec.dp_size,
            args: vec![
                s("mocker"),
                s("--emulate"),
                s(spec.kind),
                s("--zmq-port"),
                zmq.to_string(),
                s("--http-port"),
                http.to_string(),
                s("--zmq-wire"),
                s(spec.wire),
                s("--model"),
                cfg.model.clone(),
                s("--dp-size"),
                spec.dp_size.to_string(),
                s("--block-size"),
                cfg.block_size.to_string(),
                s("--capacity-blocks"),
                cfg.capacity_blocks.to_string(),
                s("--speedup"),
                cfg.speedup.to_string(),
            ],
            proc: None,
        };
        e.start(&cfg.exe, log_dir.as_deref()).await?;
        let admin = free_port();
        let mut b = BridgeProc {
            name: format!("bridge-{name}"),
            engine: k,
            admin_port: admin,
            worker_id: None,
            args: vec![
                s("bridge"),
                s("--nats"),
                url.clone(),
                s("--namespace"),
                cfg.namespace.clone(),
                s("--engine"),
                s(spec.kind),
                s("--model"),
                cfg.model.clone(),
                s("--block-size"),
                cfg.block_size.to_string(),
                s("--zmq-endpoint"),
                format!("tcp://127.0.0.1:{zmq}"),
                s("--replay-endpoint"),
                format!("tcp://127.0.0.1:{}", zmq + dp),
                s("--dp-size"),
                spec.dp_size.to_string(),
                s("--capacity-blocks"),
                cfg.capacity_blocks.to_string(),
                s("--base-url"),
                e.base_url(),
                s("--admin-addr"),
                format!("127.0.0.1:{admin}"),
                s("--heartbeat-ms"),
                s("200"),
            ],
            proc: None,
        };
        b.start(&cfg.exe, log_dir.as_deref()).await?;
        engines.push(e);
        bridges.push(b);
    }
    let mut replicas = Vec::new();
    for i in 0..cfg.replicas {
        let id = format!("r{i}");
        let port = free_port();
        let indexes = i + 1 < cfg.replicas;
        let mut args = vec![
            s("serve"),
            s("--nats"),
            url.clone(),
            s("--namespace"),
            cfg.namespace.clone(),
            s("--model"),
            cfg.model.clone(),
            s("--replica-id"),
            id.clone(),
            s("--admin-addr"),
            format!("127.0.0.1:{port}"),
            s("--replica-sync"),
            s("--request-timeout-secs"),
            cfg.request_timeout_secs.to_string(),
            s("--seed"),
            (cfg.seed + i as u64).to_string(),
        ];
        args.push(s(if indexes {
            "--serve-indexer"
        } else {
            "--use-remote-indexer"
        }));
        let mut r = Replica {
            id,
            admin_port: port,
            indexes,
            args,
            proc: None,
            paused: false,
        };
        r.start(&cfg.exe, log_dir.as_deref())?;
        replicas.push(r);
    }
    for r in &replicas {
        if !r.ready(Duration::from_secs(60)).await {
            return Err(FleetError::Startup(format!("replica {} never became ready", r.id)).into());
        }
    }
    for b in &bridges {
        if !b.ready(Duration::from_secs(30)).await {
            return Err(FleetError::Startup(format!("{} never became ready", b.name)).into());
        }
    }
    let bus = Bus::connect(&NatsOptions {
        name: Some("kvrouter-bench-chaos".into()),
        ..NatsOptions::new(url.clone())
    })
    .await
    .map_err(|e| ChaosError::Bus(e.to_string()))?;
    let subjects = Subjects::new(&cfg.namespace)
        .and_then(|s| s.model(&cfg.model))
        .map_err(|e| ChaosError::Config(e.to_string()))?;
    let client = KvRouterClient::new(bus.clone(), &cfg.namespace)
        .map_err(|e| ChaosError::Config(e.to_string()))?
        .with_timeout(Duration::from_secs(2))
        .with_generate_idle_timeout(Duration::from_secs(5));
    let mocker_workers: Vec<u64> = mockers.iter().flat_map(|m| m.worker_ids()).collect();
    let engine_targets: Vec<EngineTarget> = bridges
        .iter()
        .filter_map(|b| {
            Some(EngineTarget {
                worker_id: b.worker_id?,
                sglang: engines[b.engine].kind == "sglang",
            })
        })
        .collect();
    let mut run = Run {
        cfg: cfg.clone(),
        nats,
        replicas,
        mockers,
        engines,
        bridges,
        bus,
        subjects,
    };
    let traffic = Traffic::new(
        client,
        TrafficConfig {
            model: cfg.model.clone(),
            block_size: cfg.block_size,
            concurrency: cfg.concurrency,
            prefix_pool: 12,
            prefix_blocks: 4,
            max_suffix_blocks: 4,
            max_tokens: 8,
            max_retries: cfg.max_retries,
            think: Duration::from_millis(20),
            seed: cfg.seed,
            mocker_workers: mocker_workers.clone(),
            engines: engine_targets,
            engine_share: cfg.engine_share,
            engine_timeout: Duration::from_secs(5),
        },
    );

    // The fleet agrees with itself before anything happens.
    let startup = run
        .checkpoint(&traffic, Instant::now(), usize::MAX, None, "startup".into())
        .await;

    let shape = FleetShape {
        replicas: cfg.replicas,
        mockers: cfg.mockers,
        worker_ids: mocker_workers,
        engines: run.engines.len(),
    };
    let schedule = Schedule::generate(cfg.seed, cfg.duration, &shape, &cfg.timing);
    let kinds = schedule.kinds();
    let tasks = traffic.spawn();
    let start = tokio::time::Instant::now();
    let mut shift = Duration::ZERO;
    let mut fault_end: Vec<Option<Instant>> = vec![None; schedule.faults];
    let mut targets: Vec<String> = vec![String::new(); schedule.faults];
    let mut notes: Vec<Vec<String>> = vec![Vec::new(); schedule.faults];
    let mut results = Vec::new();
    for step in &schedule.steps {
        tokio::time::sleep_until(start + step.at + shift).await;
        let f = step.fault;
        tracing::info!(fault = f, kind = step.kind.as_str(), step = ?step.step, "chaos step");
        match &step.step {
            Step::Checkpoint => {
                let t0 = Instant::now();
                let since = fault_end[f].unwrap_or(t0);
                let r = run
                    .checkpoint(
                        &traffic,
                        since,
                        f,
                        Some(kinds[f]),
                        std::mem::take(&mut targets[f]),
                    )
                    .await;
                let mut r = r;
                r.notes.append(&mut notes[f]);
                results.push(r);
                shift += t0.elapsed();
            }
            other => {
                let undo = matches!(
                    other,
                    Step::RestartReplica(_)
                        | Step::ResumeReplica(_)
                        | Step::StartNats
                        | Step::RestartMocker(_)
                        | Step::RestartBridge(_)
                        | Step::RestartEngine(_)
                );
                if undo {
                    fault_end[f] = Some(Instant::now());
                }
                let t0 = Instant::now();
                let (target, note) = run.apply(other, &traffic).await;
                if !undo {
                    targets[f] = target;
                    fault_end[f] = Some(Instant::now());
                }
                if let Some(n) = note {
                    notes[f].push(n);
                }
                // Time spent acting (a restart's wait for readiness) does not eat the gaps.
                shift += t0.elapsed();
            }
        }
    }
    tokio::time::sleep_until(start + cfg.duration + shift).await;
    traffic.stop();
    let drained = traffic.drained(Duration::from_secs(30)).await;
    for t in tasks {
        t.abort();
    }
    let stopped = Instant::now();
    tokio::time::sleep(cfg.quiet).await;
    let mut fin = run
        .checkpoint(&traffic, stopped, usize::MAX, None, "end".into())
        .await;
    if !drained {
        fin.notes
            .push("requests still in flight 30 s after traffic stopped".into());
    }
    let figures = traffic.figures();
    drop(traffic);
    let report = ChaosReport::new(
        &cfg,
        wall.elapsed(),
        figures,
        startup,
        results,
        fin,
        run.replicas.iter().map(|r| r.id.clone()).collect(),
        shape.worker_ids.len() as u32 * cfg.dp_size
            + cfg.engines.iter().map(|e| e.dp_size).sum::<u32>(),
    );
    run.shutdown().await;
    Ok(report)
}

/// A kill step: SIGKILL `name`'s process (if running).
fn kill_step(proc: &mut Option<Proc>, name: &str) -> (String, Option<String>) {
    kill(proc);
    (name.to_string(), None)
}

/// A restart step's outcome: the start's own note, or why it failed.
fn restarted(name: &str, started: Result<Option<String>, FleetError>) -> (String, Option<String>) {
    let note = started.unwrap_or_else(|e| Some(format!("restart of {name} failed: {e}")));
    (name.to_string(), note)
}

impl Run {
    /// Performs one fault step; returns a description of its target and a note when
    /// something did not go as planned.
    async fn apply(&mut self, step: &Step, traffic: &Arc<Traffic>) -> (String, Option<String>) {
        let (exe, log) = (self.cfg.exe.clone(), self.cfg.log_dir.clone());
        match step {
            Step::KillReplica(i) => {
                let r = &mut self.replicas[*i];
                kill_step(&mut r.proc, &r.id)
            }
            Step::RestartReplica(i) => {
                let r = &mut self.replicas[*i];
                if let Err(e) = r.start(&exe, log.as_deref()) {
                    return (
                        r.id.clone(),
                        Some(format!("restart of {} failed: {e}", r.id)),
                    );
                }
                let ready = r.ready(Duration::from_secs(30)).await;
                (
                    r.id.clone(),
                    (!ready).then(|| format!("{} not ready 30 s after its restart", r.id)),
                )
            }
            Step::PauseReplica(i) => {
                let r = &mut self.replicas[*i];
                if let Some(p) = &mut r.proc {
                    p.pause();
                }
                r.paused = true;
                (r.id.clone(), None)
            }
            Step::ResumeReplica(i) => {
                let r = &mut self.replicas[*i];
                if let Some(p) = &mut r.proc {
                    p.resume();
                }
                r.paused = false;
                (r.id.clone(), None)
            }
            Step::StopNats => {
                self.nats.stop();
                ("nats-server".into(), None)
            }
            Step::StartNats => {
                let note = restart_nats(&mut self.nats)
                    .err()
                    .map(|e| format!("nats-server restart failed: {e}"));
                ("nats-server".into(), note)
            }
            Step::KillMocker(j) => {
                let m = &mut self.mockers[*j];
                kill_step(&mut m.proc, &m.name)
            }
            Step::RestartMocker(j) => {
                let m = &mut self.mockers[*j];
                let started = m.start(&exe, log.as_deref()).await.map(|()| None);
                restarted(&m.name, started)
            }
            Step::KillBridge(k) => {
                let b = &mut self.bridges[*k];
                kill_step(&mut b.proc, &b.name)
            }
            Step::RestartBridge(k) => {
                let b = &mut self.bridges[*k];
                let started = b.start(&exe, log.as_deref()).await;
                restarted(&b.name, started)
            }
            Step::KillEngine(k) => {
                let e = &mut self.engines[*k];
                kill_step(&mut e.proc, &e.name)
            }
            Step::RestartEngine(k) => {
                let e = &mut self.engines[*k];
                let started = e.start(&exe, log.as_deref()).await.map(|()| None);
                restarted(&e.name, started)
            }
            Step::DropEvents { worker_id, batches } => {
                let target = format!("worker {worker_id} ({batches} batches)");
                let payload = match encode(batches) {
                    Ok(p) => Bytes::from(p),
                    Err(e) => return (target, Some(format!("encode: {e}"))),
                };
                let subject = self.subjects.drop_events(*worker_id);
                let answer = self
                    .bus
                    .request(&subject, payload, Duration::from_secs(2))
                    .await;
                let note = match answer {
                    Ok(m) => match decode::<Reply<()>>(&m.payload) {
                        Ok(Reply::Ok(())) => None,
                        Ok(Reply::Err(e)) => Some(format!("drop_events refused: {}", e.message)),
                        Err(e) => Some(format!("drop_events answer: {e}")),
                    },
                    Err(e) => Some(format!("drop_events not delivered: {e}")),
                };
                // A gap is only seen at the rank's next event: send every rank new prompts
                // until the dropped batches are behind it.
                traffic
                    .poke_worker(*worker_id, 0..self.cfg.dp_size, batches.saturating_add(2))
                    .await;
                (target, note)
            }
            Step::Garbage { messages } => {
                let n = self.garbage(*messages).await;
                (format!("{n} messages"), None)
            }
            Step::Checkpoint => (String::new(), None),
        }
    }

    /// Publishes garbage on every subject of the fleet (wildcards filled with real ids);
    /// returns how many messages were sent.
    async fn garbage(&self, per_subject: u32) -> usize {
        let mut rng = fastrand::Rng::with_seed(self.cfg.seed ^ per_subject as u64 ^ 0x6a7b);
        let Ok(subjects) = fleet_subjects(&self.cfg.namespace, &self.cfg.model) else {
            return 0;
        };
        let workers: Vec<u64> = self
            .mockers
            .iter()
            .flat_map(|m| m.worker_ids())
            .chain(self.bridges.iter().filter_map(|b| b.worker_id))
            .collect();
        let mut sent = 0;
        for (name, subject) in subjects {
            for k in 0..per_subject {
                let fill = if matches!(name, "mark_prefill" | "free") {
                    self.replicas[rng.usize(0..self.replicas.len())].id.clone()
                } else {
                    workers[rng.usize(0..workers.len())].to_string()
                };
                let subject = subject.replace('*', &fill);
                let len = rng.usize(0..96);
                let mut payload: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                // Half of them carry a valid format version, to reach the decoders.
                if k % 2 == 0 && !payload.is_empty() {
                    payload[0] = FORMAT_VERSION;
                }
                let payload = Bytes::from(payload);
                let res = if k % 3 == 1 {
                    let inbox = self.bus.new_inbox();
                    self.bus.publish_with_reply(&subject, &inbox, payload).await
                } else {
                    self.bus.publish(&subject, payload).await
                };
                sent += usize::from(res.is_ok());
            }
        }
        sent
    }

    /// Pauses traffic, waits for in-flight requests, and polls until every replica agrees
    /// with the truth (convergence, timed from `since`); then compares once more after
    /// `stability` (divergence after convergence). Traffic resumes after.
    async fn checkpoint(
        &self,
        traffic: &Arc<Traffic>,
        since: Instant,
        index: usize,
        kind: Option<FaultKind>,
        target: String,
    ) -> FaultResult {
        traffic.pause();
        let mut notes = Vec::new();
        if !traffic.drained(Duration::from_secs(20)).await {
            notes.push("requests still in flight after 20 s".into());
        }
        let deadline = Instant::now() + self.cfg.converge_timeout;
        let mut converged = None;
        let mut last;
        let mut initial = None;
        loop {
            last = self.compare().await;
            initial.get_or_insert_with(|| last.describe());
            if last.is_zero() {
                converged = Some(since.elapsed());
                break;
            }
            if Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (divergence_after, detail) = match converged {
            Some(_) => {
                tokio::time::sleep(self.cfg.stability).await;
                let again = self.compare().await;
                (again.total(), again.describe())
            }
            None => (0, last.describe()),
        };
        let (prefixes_checked, engine_prefixes_checked) =
            (last.prefixes_checked, last.engine_prefixes_checked);
        traffic.resume();
        FaultResult {
            index: (index != usize::MAX).then_some(index),
            kind: kind.map(|k| k.as_str().to_string()),
            target,
            converged: converged.is_some(),
            convergence_ms: converged.map(|d| d.as_secs_f64() * 1e3),
            divergence_after_convergence: divergence_after,
            unconverged_divergence: if converged.is_some() { 0 } else { last.total() },
            detail,
            notes,
            prefixes_checked,
            engine_prefixes_checked,
            initial_detail: initial.unwrap_or_default(),
        }
    }

    /// Every replica against the truth: the index of every rank (replicas that keep one)
    /// against the worker's state (a mocker worker's state answer; an emulated engine's own
    /// cache, not its bridge's copy of it), and every replica's active sequences against none.
    async fn compare(&self) -> FleetDiff {
        let mut diff = FleetDiff::default();
        let mut truths: BTreeMap<WorkerKey, Prefixes> = BTreeMap::new();
        for m in &self.mockers {
            for w in m.worker_ids() {
                for r in 0..self.cfg.dp_size {
                    let key = WorkerKey::new(w, r);
                    match self.worker_state(key).await {
                        Ok(t) => {
                            truths.insert(key, t);
                        }
                        Err(e) => diff.unreachable.push(format!("worker {w} rank {r}: {e}")),
                    }
                }
            }
        }
        for b in &self.bridges {
            let (Some(w), e) = (b.worker_id, &self.engines[b.engine]) else {
                continue;
            };
            for r in 0..e.dp_size {
                let key = WorkerKey::new(w, r);
                let (status, body) = e.cache(r).await;
                match (status, index_prefixes(&body, key)) {
                    (200, Some(t)) => {
                        truths.insert(key, t);
                    }
                    _ => diff.unreachable.push(format!(
                        "{} (worker {w}) rank {r} cache: {status} {body}",
                        e.name
                    )),
                }
            }
        }
        let engine_workers: Vec<u64> = self.bridges.iter().filter_map(|b| b.worker_id).collect();
        let model = self.cfg.model.replace('/', "%2F");
        for rep in &self.replicas {
            if rep.indexes {
                for (key, truth) in &truths {
                    let path = format!(
                        "/debug/rank?model={model}&worker={}&dp_rank={}",
                        key.worker_id, key.dp_rank
                    );
                    let (status, body) = http_get(rep.admin_port, &path).await;
                    match (status, index_prefixes(&body, *key)) {
                        (200, Some(index)) => {
                            diff.prefixes_checked += truth.len();
                            if engine_workers.contains(&key.worker_id) {
                                diff.engine_prefixes_checked += truth.len();
                            }
                            diff.add_rank(&rep.id, *key, truth, &index)
                        }
                        _ => diff
                            .unreachable
                            .push(format!("{} /debug/rank {key}: {status} {body}", rep.id)),
                    }
                }
            }
            let (status, page) = http_get(rep.admin_port, "/metrics").await;
            if status != 200 {
                diff.unreachable
                    .push(format!("{} /metrics: status {status}", rep.id));
                continue;
            }
            diff.add_active(
                &rep.id,
                metric_sum_in(&page, ACTIVE_REQUESTS).max(0.0) as u64,
                metric_sum_in(&page, ACTIVE_BLOCKS).max(0.0) as u64,
            );
        }
        diff
    }

    /// What a worker rank really caches: its state answer.
    async fn worker_state(&self, key: WorkerKey) -> Result<Prefixes, String> {
        let query = encode(&StateQuery {
            dp_rank: key.dp_rank,
        })
        .map_err(|e| e.to_string())?;
        let mut stream = self
            .bus
            .request_stream(
                &self.subjects.state(key.worker_id),
                Bytes::from(query),
                Duration::from_secs(2),
            )
            .await
            .map_err(|e| e.to_string())?;
        let mut events = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            let chunk: StateChunk = decode::<Reply<StateChunk>>(&chunk)
                .map_err(|e| e.to_string())?
                .into_result()
                .map_err(|e| e.message.clone())?;
            events.extend(chunk.events);
        }
        Ok(truth_prefixes(&events))
    }

    /// Stops the children, then lets this process's connection close before nats-server
    /// goes (so it does not log a lost connection).
    async fn shutdown(self) {
        let Run {
            mut nats,
            mut replicas,
            mut mockers,
            mut engines,
            mut bridges,
            bus,
            ..
        } = self;
        for b in &mut bridges {
            kill(&mut b.proc);
        }
        for e in &mut engines {
            kill(&mut e.proc);
        }
        for r in &mut replicas {
            kill(&mut r.proc);
        }
        for m in &mut mockers {
            kill(&mut m.proc);
        }
        let _ = bus.flush_within(Duration::from_millis(500)).await;
        drop(bus);
        tokio::time::sleep(Duration::from_millis(200)).await;
        nats.stop();
    }
}
