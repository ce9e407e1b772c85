//! The process-driving runner: makes the fleet's credentials and starts it locked, runs the
//! honest traffic through every phase, the attack of each phase on a thread of its own,
//! samples every process's memory, reads the fleet's refusal counters around each phase, and
//! stops the fleet with SIGTERM at the end.

use super::attacks;
use super::credentials::{CredentialsError, FleetCredentials};
use super::impostors;
use super::plan::{
    phases, Attack, AttackFigures, HonestFigures, HostileReport, PhaseReport, ProcReport,
    Thresholds,
};
use super::targets::{bearer, head, send_read_n, InFlight, Targets};
use crate::chaos::fleet::{
    http_get, spawn_with_line, start_nats_with, BridgeProc, Engine, FleetError, Replica,
};
use kvrouter_testkit::{free_port, free_ports, Proc};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a hostile run does.
#[derive(Clone, Debug)]
pub struct HostileConfig {
    /// The `kvrouter` binary.
    pub exe: PathBuf,
    /// The frontend's model directory (tokenizer.json and its config).
    pub model_dir: PathBuf,
    /// The served model's name.
    pub model: String,
    pub phase: Duration,
    /// Pause between phases (not measured): a phase's leftovers drain.
    pub settle: Duration,
    pub seed: u64,
    pub log_dir: Option<PathBuf>,
    pub attacks: Vec<Attack>,
    /// Slow connections per HTTP listener in the slowloris phase.
    pub slow_connections: usize,
    /// Honest clients: completions through the frontend, routes on a replica's JSON API,
    /// each one request at a time with a short pause between.
    pub completion_clients: usize,
    pub route_clients: usize,
    /// After each phase, how long to wait for the fleet to serve a completion and a route
    /// again before the next phase starts anyway.
    pub recovery_timeout: Duration,
    /// Every process's --drain-timeout-secs.
    pub drain_timeout: Duration,
    pub thresholds: Thresholds,
    /// A process whose resident set passes this many MiB is SIGKILLed (and counts as dead):
    /// a runaway must not take the machine with it.
    pub kill_rss_mib: f64,
    /// The control run: nats-server without the users file, so anyone may say and read
    /// anything on the bus (every process still presents its seed). The bus attacks must
    /// then take effect: it shows the bench would see it.
    pub open_bus: bool,
}

impl HostileConfig {
    pub fn new(exe: PathBuf, model_dir: PathBuf, phase: Duration, seed: u64) -> Self {
        Self {
            exe,
            model_dir,
            model: "hostile-model".into(),
            phase,
            settle: Duration::from_secs(1),
            recovery_timeout: Duration::from_secs(30),
            seed,
            log_dir: None,
            attacks: Attack::ALL.to_vec(),
            slow_connections: 1100,
            completion_clients: 2,
            route_clients: 1,
            drain_timeout: Duration::from_secs(5),
            thresholds: Thresholds {
                min_success: 0.99,
                max_rss_mib: 2048.0,
            },
            kill_rss_mib: 4096.0,
            open_bus: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostileError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("{0}")]
    Startup(String),
}

/// One process of the fleet.
struct Member {
    name: String,
    /// None for nats-server (its own type, sampled by PID, stopped last).
    proc: Option<Proc>,
    pid: u32,
    drain: Option<f64>,
    died_in: Option<String>,
    peak_sampled_kib: u64,
    /// Killed by the sampler at this resident set (KiB).
    killed_at_kib: Option<u64>,
}

/// A field of /proc/PID/status in KiB (`VmRSS`, `VmHWM`); None when the process is gone.
fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// User + system CPU seconds of the calling thread.
fn thread_cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_THREAD is Linux's.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Raises this process's open-file limit to its hard limit (children inherit it): a
/// thousand connections per listener need that many descriptors on both ends.
fn raise_nofile() {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The honest traffic's samples, per phase and kind: (ok, latency ms, failure).
type Samples = Vec<(bool, f64, String)>;

struct Honest {
    /// The phase requests count in (usize::MAX: between phases, not counted).
    phase: AtomicUsize,
    stop: AtomicBool,
    completions: Mutex<Vec<Samples>>,
    routes: Mutex<Vec<Samples>>,
}

const NO_PHASE: usize = usize::MAX;

/// Prompts share a few prefixes, so the engine caches and the router finds them.
fn honest_prompt(rng: &mut fastrand::Rng) -> String {
    const WORDS: [&str; 8] = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    ];
    let p = rng.usize(0..WORDS.len());
    let mut s: String = (0..24)
        .map(|i| WORDS[(p + i * 3) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ");
    for _ in 0..4 {
        s.push(' ');
        s.push_str(WORDS[rng.usize(0..WORDS.len())]);
    }
    s
}

fn honest_tokens(rng: &mut fastrand::Rng) -> Vec<u32> {
    let p = rng.u32(0..8);
    let mut t: Vec<u32> = (0..64).map(|i| p * 1000 + i).collect();
    t.extend((0..16).map(|_| rng.u32(0..50_000)));
    t
}

/// One honest call with these credentials: (ok, ms, failure), and the answer's body.
async fn honest_call(
    port: u16,
    path: &str,
    auth: &str,
    body: String,
) -> ((bool, f64, String), String) {
    let t0 = Instant::now();
    let h = head("POST", path, auth, body.len());
    let r = send_read_n(
        port,
        &h,
        body.as_bytes(),
        1,
        Duration::from_secs(10),
        64 << 10,
    )
    .await;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    match r {
        Ok((200, answer)) => ((true, ms, String::new()), answer),
        Ok((s, answer)) => (
            (false, ms, format!("{s} {}", error_message(&answer))),
            answer,
        ),
        Err(e) => ((false, ms, e.to_string()), String::new()),
    }
}

/// One honest booking through a replica's JSON API, held as a real caller holds it: the
/// route (its latency is the sample's), a pause, `prefill_done`, a pause, `free`, each with
/// the route's lease. Ok only if all three are; the attackers know the id meanwhile.
async fn honest_booking(
    t: &Targets,
    auth: &str,
    request_id: String,
    rng: &mut fastrand::Rng,
) -> (bool, f64, String) {
    let body = serde_json::json!({
        "model": t.model, "tokens": honest_tokens(rng), "request_id": request_id,
    });
    let (route, answer) = honest_call(t.replica, "/v1/route", auth, body.to_string()).await;
    if !route.0 {
        return route;
    }
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap_or_default();
    let (Some(lease), Some(replica_id)) = (v["lease"].as_str(), v["replica_id"].as_str()) else {
        return (
            false,
            route.1,
            format!("route answer without lease: {answer}"),
        );
    };
    let held = InFlight {
        request_id: request_id.clone(),
        replica_id: replica_id.to_string(),
    };
    t.inflight.lock().push(held);
    let mut failed = None;
    for op in ["prefill_done", "free"] {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let body = serde_json::json!({"model": t.model, "replica_id": replica_id, "lease": lease});
        let path = format!("/v1/requests/{request_id}/{op}");
        let (r, _) = honest_call(t.replica, &path, auth, body.to_string()).await;
        if !r.0 {
            // The status only: the message names the request, and failures are grouped.
            let status = r.2.split(' ').next().unwrap_or_default();
            failed = Some(format!("{op} answered {status}"));
            break;
        }
    }
    t.inflight.lock().retain(|h| h.request_id != request_id);
    match failed {
        None => route,
        Some(why) => (false, route.1, why),
    }
}

/// An error answer's message (`{"error": {"message"}}`), else its start; at most 80 chars.
fn error_message(answer: &str) -> String {
    let m = serde_json::from_str::<serde_json::Value>(answer)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| answer.to_string());
    m.chars().take(80).collect()
}

fn completion_body(model: &str, rng: &mut fastrand::Rng) -> String {
    serde_json::json!({"model": model, "prompt": honest_prompt(rng), "max_tokens": 4}).to_string()
}

/// A route that books nothing (the readiness probe's).
fn route_body(model: &str, rng: &mut fastrand::Rng) -> String {
    serde_json::json!({"model": model, "tokens": honest_tokens(rng), "update_states": false})
        .to_string()
}

/// Spawns the honest clients; each records into the phase its request started in (one
/// started between phases is not counted).
fn spawn_honest(
    honest: &Arc<Honest>,
    cfg: &HostileConfig,
    t: &Targets,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let clients = (0..cfg.completion_clients)
        .map(|c| (true, c))
        .chain((0..cfg.route_clients).map(|c| (false, c)));
    for (completion, c) in clients {
        let (honest, t) = (honest.clone(), t.clone());
        let key = bearer(&t.creds.honest_key);
        let token = bearer(&t.creds.honest_token);
        let mut rng =
            fastrand::Rng::with_seed(cfg.seed.wrapping_add(2 * c as u64 + u64::from(completion)));
        let seed = cfg.seed;
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !honest.stop.load(Ordering::Relaxed) {
                let phase = honest.phase.load(Ordering::Relaxed);
                let s = if completion {
                    let body = completion_body(&t.model, &mut rng);
                    honest_call(t.frontend, "/v1/completions", &key, body)
                        .await
                        .0
                } else {
                    n += 1;
                    let id = format!("honest-{seed}-{c}-{n}");
                    honest_booking(&t, &token, id, &mut rng).await
                };
                if phase != NO_PHASE {
                    let samples = if completion {
                        &honest.completions
                    } else {
                        &honest.routes
                    };
                    samples.lock()[phase].push(s);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    tasks
}

/// Runs `attack` on a thread of its own (one current-thread runtime), for `secs`; its CPU
/// time is that thread's.
async fn attack_thread(
    attack: Attack,
    t: Targets,
    phase: Duration,
    seed: u64,
    slow: usize,
) -> AttackFigures {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let cpu0 = thread_cpu_secs();
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        let mut fig = rt.block_on(async {
            let deadline = tokio::time::Instant::now() + phase;
            match attack {
                Attack::LeaseTheft => impostors::lease_theft(&t, deadline, seed).await,
                Attack::ForgedWorker => impostors::forged_worker(&t, deadline).await,
                Attack::FrontendImpostor => impostors::frontend_impostor(&t, deadline).await,
                Attack::ReplyReader => impostors::reply_reader(&t, deadline).await,
                door => attacks::run(door, t, deadline, seed, slow).await,
            }
        });
        drop(rt);
        fig.cpu_secs = thread_cpu_secs() - cpu0;
        fig.unit = attack.unit().to_string();
        fig.rate = fig.ops as f64 / phase.as_secs_f64();
        let _ = tx.send(fig);
    });
    rx.await.unwrap_or_default()
}

/// Waits until a call answers 200 (the fleet serves), up to `within`.
async fn serves(port: u16, path: &str, auth: &str, body: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if honest_call(port, path, auth, body.to_string()).await.0 .0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// The fleet's refusal counters, each summed over its labels and the processes at `ports`
/// (their `/metrics`): `kvrouter_replica_lease_refused_total` as `lease_refused`, and so on.
async fn refusal_counters(ports: &[u16]) -> BTreeMap<String, u64> {
    const COUNTERS: [(&str, &str); 4] = [
        ("kvrouter_replica_lease_refused_total", "lease_refused"),
        ("kvrouter_misattributed_messages_total", "misattributed"),
        ("kvrouter_http_auth_refused_total", "http_auth_refused"),
        (
            "kvrouter_frontend_auth_refused_total",
            "frontend_auth_refused",
        ),
    ];
    let mut sums = BTreeMap::new();
    for &port in ports {
        let (status, text) = http_get(port, "/metrics").await;
        if status != 200 {
            continue;
        }
        for (name, short) in COUNTERS {
            *sums.entry(short.to_string()).or_insert(0) +=
                kvrouter_testkit::metric_sum_in(&text, name) as u64;
        }
    }
    sums
}

/// Runs the whole hostile bench. Needs a multi-thread runtime.
pub async fn run_hostile(cfg: HostileConfig) -> Result<HostileReport, HostileError> {
    if let Some(d) = &cfg.log_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| HostileError::Startup(format!("log dir {}: {e}", d.display())))?;
    }
    raise_nofile();
    let wall = Instant::now();
    let log = cfg.log_dir.clone();
    let log = log.as_deref();
    let exe = &cfg.exe;
    let s = |x: &str| x.to_string();
    let drain = format!("{}", cfg.drain_timeout.as_secs_f64());
    let ns = format!("hostile{}", cfg.seed);
    let replica_ids: Vec<String> = (0..2).map(|i| format!("r{i}")).collect();
    // The engine's worker, and a spare identity no process uses: the forger's.
    let (worker_id, spare_worker) = (7u64, 8u64);
    let creds = Arc::new(FleetCredentials::generate(
        exe,
        &ns,
        &replica_ids,
        &[worker_id, spare_worker],
    )?);
    let seed_of = |who: &str| creds.seed(who).display().to_string();
    let conf = creds.nats_conf().display().to_string();
    let nats_args: &[&str] = if cfg.open_bus { &[] } else { &["-c", &conf] };
    let nats = start_nats_with(log, nats_args)?;
    let url = nats.url();

    let dp = 2u16;
    let (zmq, http) = (free_ports(2 * dp), free_port());
    let mut engine = Engine {
        name: "engine".into(),
        kind: "vllm",
        zmq_port: zmq,
        http_port: http,
        dp_size: u32::from(dp),
        args: vec![
            s("mocker"),
            s("--emulate"),
            s("vllm"),
            s("--zmq-port"),
            zmq.to_string(),
            s("--http-port"),
            http.to_string(),
            s("--model"),
            cfg.model.clone(),
            s("--dp-size"),
            dp.to_string(),
            s("--block-size"),
            s("16"),
            s("--capacity-blocks"),
            s("4096"),
            s("--speedup"),
            s("20"),
            s("--drain-timeout-secs"),
            drain.clone(),
        ],
        proc: None,
    };
    engine.start(exe, log).await?;
    let bridge_admin = free_port();
    let mut bridge = BridgeProc {
        name: "bridge".into(),
        engine: 0,
        admin_port: bridge_admin,
        worker_id: None,
        args: vec![
            s("bridge"),
            s("--nats"),
            url.clone(),
            s("--nats-nkey-file"),
            seed_of(&format!("bridge-{worker_id}")),
            s("--worker-id"),
            worker_id.to_string(),
            s("--namespace"),
            ns.clone(),
            s("--engine"),
            s("vllm"),
            s("--model"),
            cfg.model.clone(),
            s("--block-size"),
            s("16"),
            s("--zmq-endpoint"),
            format!("tcp://127.0.0.1:{zmq}"),
            s("--replay-endpoint"),
            format!("tcp://127.0.0.1:{}", zmq + dp),
            s("--dp-size"),
            dp.to_string(),
            s("--capacity-blocks"),
            s("4096"),
            s("--base-url"),
            engine.base_url(),
            s("--admin-addr"),
            format!("127.0.0.1:{bridge_admin}"),
            s("--heartbeat-ms"),
            s("200"),
            s("--drain-timeout-secs"),
            drain.clone(),
        ],
        proc: None,
    };
    bridge.start(exe, log).await?;
    let mut replicas = Vec::new();
    for (i, id) in (0u64..).zip(&replica_ids) {
        let port = free_port();
        let mut r = Replica {
            id: format!("replica{i}"),
            admin_port: port,
            indexes: true,
            args: vec![
                s("serve"),
                s("--nats"),
                url.clone(),
                s("--nats-nkey-file"),
                seed_of(&format!("replica-{id}")),
                s("--http-tokens-file"),
                creds.tokens_file().display().to_string(),
                s("--namespace"),
                ns.clone(),
                s("--model"),
                cfg.model.clone(),
                s("--replica-id"),
                id.clone(),
                s("--admin-addr"),
                format!("127.0.0.1:{port}"),
                s("--replica-sync"),
                s("--seed"),
                (cfg.seed + i).to_string(),
                s("--drain-timeout-secs"),
                drain.clone(),
            ],
            proc: None,
            paused: false,
        };
        r.start(exe, log)?;
        replicas.push(r);
    }
    for r in &replicas {
        if !r.ready(Duration::from_secs(60)).await {
            return Err(HostileError::Startup(format!(
                "{} never became ready",
                r.id
            )));
        }
    }
    if !bridge.ready(Duration::from_secs(30)).await {
        return Err(HostileError::Startup(
            "the bridge never became ready".into(),
        ));
    }
    let frontend_args = vec![
        s("frontend"),
        s("--nats"),
        url.clone(),
        s("--nats-nkey-file"),
        seed_of("frontend-0"),
        s("--api-keys-file"),
        creds.api_keys_file().display().to_string(),
        s("--namespace"),
        ns.clone(),
        s("--listen"),
        s("127.0.0.1:0"),
        s("--model"),
        format!("{}={}", cfg.model, cfg.model_dir.display()),
        s("--drain-timeout-secs"),
        drain.clone(),
    ];
    let (frontend, line) = spawn_with_line("frontend", exe, &frontend_args, log, "listen").await?;
    let frontend_port: u16 = serde_json::from_str::<serde_json::Value>(line.trim())
        .ok()
        .and_then(|v| v["listen"].as_str()?.rsplit(':').next()?.parse().ok())
        .ok_or_else(|| HostileError::Startup(format!("frontend start line {line:?}")))?;

    let targets = Targets {
        frontend: frontend_port,
        replica: replicas[0].admin_port,
        bridge: bridge_admin,
        engine: http,
        model: cfg.model.clone(),
        worker_id: bridge.worker_id.unwrap_or(worker_id),
        engine_url: engine.base_url(),
        spare_worker,
        nats_url: url.clone(),
        namespace: ns.clone(),
        replica_ids: replica_ids.clone(),
        replica_ports: replicas.iter().map(|r| r.admin_port).collect(),
        creds: creds.clone(),
        inflight: Arc::new(Mutex::new(Vec::new())),
    };
    let (key, token) = (bearer(&creds.honest_key), bearer(&creds.honest_token));
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    if !serves(
        frontend_port,
        "/v1/completions",
        &key,
        &completion_body(&cfg.model, &mut rng),
        Duration::from_secs(30),
    )
    .await
        || !serves(
            targets.replica,
            "/v1/route",
            &token,
            &route_body(&cfg.model, &mut rng),
            Duration::from_secs(30),
        )
        .await
    {
        return Err(HostileError::Startup(
            "the fleet did not serve a completion and a route within 30 s".into(),
        ));
    }

    // Every process, for memory, deaths and the final SIGTERM.
    let d = Some(cfg.drain_timeout.as_secs_f64());
    let mut members = vec![Member {
        name: "nats-server".into(),
        proc: None,
        pid: nats.pid(),
        drain: None,
        died_in: None,
        peak_sampled_kib: 0,
        killed_at_kib: None,
    }];
    let mut add = |name: &str, p: Option<Proc>| {
        if let Some(p) = p {
            members.push(Member {
                name: name.into(),
                pid: p.pid(),
                proc: Some(p),
                drain: d,
                died_in: None,
                peak_sampled_kib: 0,
                killed_at_kib: None,
            });
        }
    };
    for r in &mut replicas {
        add(&r.id, r.proc.take());
    }
    add("frontend", Some(frontend));
    add("bridge", bridge.proc.take());
    add("engine", engine.proc.take());
    let members = Arc::new(Mutex::new(members));

    let plan = phases(&cfg.attacks);
    let names: Vec<String> = plan
        .iter()
        .map(|p| p.map_or("clean", Attack::as_str).to_string())
        .collect();
    let phase_rss: Arc<Mutex<Vec<BTreeMap<String, f64>>>> =
        Arc::new(Mutex::new(vec![BTreeMap::new(); plan.len()]));
    let honest = Arc::new(Honest {
        phase: AtomicUsize::new(NO_PHASE),
        stop: AtomicBool::new(false),
        completions: Mutex::new(vec![Vec::new(); plan.len()]),
        routes: Mutex::new(vec![Vec::new(); plan.len()]),
    });

    // The sampler: every 200 ms, each process's VmRSS, and whether it still runs.
    let sampler = {
        let (members, phase_rss, honest, names) = (
            members.clone(),
            phase_rss.clone(),
            honest.clone(),
            names.clone(),
        );
        let kill_mib = cfg.kill_rss_mib;
        tokio::spawn(async move {
            let mut last = 0;
            loop {
                let p = honest.phase.load(Ordering::Relaxed);
                if p != NO_PHASE {
                    last = p;
                }
                {
                    let mut ms = members.lock();
                    let mut rss = phase_rss.lock();
                    for m in ms.iter_mut() {
                        if m.died_in.is_some() {
                            continue;
                        }
                        let alive = match &mut m.proc {
                            Some(p) => p.running(),
                            None => status_kib(m.pid, "VmRSS").is_some(),
                        };
                        if !alive {
                            m.died_in = Some(names[last].clone());
                            continue;
                        }
                        if let Some(kib) = status_kib(m.pid, "VmRSS") {
                            m.peak_sampled_kib = m.peak_sampled_kib.max(kib);
                            if mib(kib) > kill_mib {
                                if let Some(p) = &mut m.proc {
                                    p.signal(libc::SIGKILL);
                                    m.killed_at_kib = Some(kib);
                                    m.died_in = Some(names[last].clone());
                                }
                            }
                            if p != NO_PHASE {
                                let e = rss[p].entry(m.name.clone()).or_insert(0.0);
                                *e = e.max(mib(kib));
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let mut counter_ports = targets.replica_ports.clone();
    counter_ports.push(targets.frontend);
    let clients = spawn_honest(&honest, &cfg, &targets);
    let mut reports = Vec::new();
    for (i, phase) in plan.iter().enumerate() {
        tracing::info!(phase = %names[i], "hostile phase");
        let counted = refusal_counters(&counter_ports).await;
        let t0 = Instant::now();
        honest.phase.store(i, Ordering::Relaxed);
        let attack = match phase {
            None => {
                tokio::time::sleep(cfg.phase).await;
                None
            }
            Some(a) => Some(
                attack_thread(
                    *a,
                    targets.clone(),
                    cfg.phase,
                    cfg.seed + i as u64,
                    cfg.slow_connections,
                )
                .await,
            ),
        };
        let remaining = cfg.phase.saturating_sub(t0.elapsed());
        tokio::time::sleep(remaining).await;
        honest.phase.store(NO_PHASE, Ordering::Relaxed);
        let secs = t0.elapsed().as_secs_f64();
        // The next phase starts once the fleet serves again (a completion and a route), so
        // its figures are its own attack's.
        let back = Instant::now();
        tokio::time::sleep(cfg.settle).await;
        let recovered = serves(
            targets.frontend,
            "/v1/completions",
            &key,
            &completion_body(&cfg.model, &mut rng),
            cfg.recovery_timeout,
        )
        .await
            && serves(
                targets.replica,
                "/v1/route",
                &token,
                &route_body(&cfg.model, &mut rng),
                cfg.recovery_timeout,
            )
            .await;
        let after = refusal_counters(&counter_ports).await;
        let refusals = after
            .into_iter()
            .map(|(k, v)| {
                let grew = v.saturating_sub(counted.get(&k).copied().unwrap_or(0));
                (k, grew)
            })
            .filter(|(_, grew)| *grew > 0)
            .collect();
        let recovery_secs = recovered.then(|| back.elapsed().as_secs_f64());
        let died = members
            .lock()
            .iter()
            .filter(|m| m.died_in.as_deref() == Some(names[i].as_str()))
            .map(|m| m.name.clone())
            .collect();
        reports.push(PhaseReport {
            phase: names[i].clone(),
            secs,
            attack,
            completions: HonestFigures::default(),
            routes: HonestFigures::default(),
            peak_rss_mib: phase_rss.lock()[i].clone(),
            died,
            refusals,
            recovery_secs,
        });
    }
    honest.stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = tokio::time::timeout(Duration::from_secs(15), c).await;
    }
    // A request counts in the phase it started in, however late it ended.
    for (i, r) in reports.iter_mut().enumerate() {
        r.completions = HonestFigures::new(&honest.completions.lock()[i]);
        r.routes = HonestFigures::new(&honest.routes.lock()[i]);
    }
    sampler.abort();

    // The end: each process's peak, then SIGTERM to all at once and the time each takes.
    let mut ms = std::mem::take(&mut *members.lock());
    let mut peaks: Vec<f64> = ms
        .iter()
        .map(|m| {
            mib(status_kib(m.pid, "VmHWM")
                .unwrap_or(0)
                .max(m.peak_sampled_kib))
        })
        .collect();
    let sent = Instant::now();
    for m in &mut ms {
        if let Some(p) = &mut m.proc {
            p.signal(libc::SIGTERM);
        }
    }
    let wait = cfg.drain_timeout + Duration::from_secs(5);
    let mut exits: Vec<Option<(f64, Option<i32>)>> = vec![None; ms.len()];
    tokio::task::block_in_place(|| {
        while sent.elapsed() < wait {
            let mut pending = false;
            for (k, m) in ms.iter_mut().enumerate() {
                let Some(p) = &mut m.proc else { continue };
                if exits[k].is_some() || m.died_in.is_some() {
                    continue;
                }
                match p.wait_exit(Duration::ZERO) {
                    Some(st) => exits[k] = Some((sent.elapsed().as_secs_f64(), st.code())),
                    None => pending = true,
                }
            }
            if !pending {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    drop(nats);
    let processes = ms
        .iter()
        .zip(exits)
        .zip(peaks.drain(..))
        .map(|((m, exit), peak)| ProcReport {
            name: m.name.clone(),
            peak_rss_mib: peak,
            died_in: m.died_in.clone(),
            killed_at_mib: m.killed_at_kib.map(mib),
            drain_timeout_secs: m.drain,
            exit_secs: exit.map(|e| e.0),
            exit_code: exit.and_then(|e| e.1),
            exited_in_time: match (exit, m.drain) {
                (Some((secs, _)), Some(d)) => secs <= d,
                _ => m.drain.is_none(),
            },
        })
        .collect();
    let mut report = HostileReport {
        seed: cfg.seed,
        phase_secs: cfg.phase.as_secs_f64(),
        slow_connections: cfg.slow_connections,
        thresholds: cfg.thresholds.clone(),
        phases: reports,
        processes,
        wall_secs: wall.elapsed().as_secs_f64(),
        failures: Vec::new(),
    };
    report.evaluate();
    Ok(report)
}
