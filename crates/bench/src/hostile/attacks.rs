//! The adversaries at the doors: slow and half-open connections, oversized and nested
//! bodies, label and worker-list floods, huge request ids, poisoned engine frames.

use super::plan::{Attack, AttackFigures};
use super::targets::{head, send, Targets};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{sleep, timeout, timeout_at, Instant};

/// Counts outcomes from many tasks.
#[derive(Default)]
struct Tally {
    ops: AtomicU64,
    outcomes: Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn count(&self, outcome: &str) {
        *self.outcomes.lock().entry(outcome.to_string()).or_insert(0) += 1;
    }

    fn result(&self, r: Result<u16, &'static str>) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(status) => self.count(&status.to_string()),
            Err(e) => self.count(e),
        }
    }
}

/// One request an attack sends: where, its head, a body repeated.
struct Shot {
    port: u16,
    head: String,
    body: Arc<Vec<u8>>,
    repeat: usize,
}

impl Shot {
    /// A POST with the tenant's credentials for `port` and the `extra` header lines.
    fn post(t: &Targets, port: u16, path: &str, extra: &str, body: Arc<Vec<u8>>) -> Self {
        let extra = format!("{}{extra}", t.tenant_auth(port));
        Self {
            port,
            head: head("POST", path, &extra, body.len()),
            body,
            repeat: 1,
        }
    }

    /// `mib` MiB of spaces (the length is all that matters: it is over the limit).
    fn oversized(t: &Targets, port: u16, path: &str, mib: usize, chunk: &Arc<Vec<u8>>) -> Self {
        Self {
            port,
            head: head("POST", path, &t.tenant_auth(port), mib * chunk.len()),
            body: chunk.clone(),
            repeat: mib,
        }
    }
}

fn random_text(rng: &mut fastrand::Rng, n: usize) -> String {
    (0..n).map(|_| rng.alphanumeric()).collect()
}

/// Runs `attack` against `targets` until `deadline` on the current runtime. Returns the
/// figures without the rate and CPU time (the caller's).
pub async fn run(
    attack: Attack,
    t: Targets,
    deadline: Instant,
    seed: u64,
    slow_connections: usize,
) -> AttackFigures {
    match attack {
        Attack::Slowloris => slowloris(&t, deadline, seed, slow_connections).await,
        Attack::PoisonFrames => poison(&t, deadline).await,
        _ => flood(attack, t, deadline, seed).await,
    }
}

/// Per listener, `n` connections kept open: some send a partial head and trickle a header
/// line a second, some send nothing (half-open), a third (where the listener takes a body)
/// send a whole head with a large Content-Length and one body byte. A connection the server
/// cuts is opened again.
async fn slowloris(t: &Targets, deadline: Instant, seed: u64, n: usize) -> AttackFigures {
    // Per listener: a path that takes a body, and a Content-Length under its body limit
    // (over it, the server answers at once). The bridge's admin listener takes no body.
    let listeners = [
        ("frontend", t.frontend, "/v1/completions", Some(10_000_000)),
        ("replica", t.replica, "/v1/route", Some(1_000_000)),
        ("bridge", t.bridge, "/metrics", None),
        ("engine", t.engine, "/v1/completions", Some(10_000_000)),
    ];
    let tally = Arc::new(Tally::default());
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut tasks = Vec::new();
    let mut gauges = Vec::new();
    for (name, port, path, length) in listeners {
        let auth: Arc<str> = t.tenant_auth(port).into();
        let open = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        gauges.push((name, open.clone()));
        for i in 0..n {
            let stagger = Duration::from_millis(rng.u64(0..1000));
            let (tally, open, auth) = (tally.clone(), open.clone(), auth.clone());
            tasks.push(tokio::spawn(async move {
                sleep(stagger).await;
                let slow = match length {
                    Some(len) if i % 3 == 2 => Slow::Body(len),
                    _ if i % 2 == 0 => Slow::Head,
                    _ => Slow::Silent,
                };
                slow_conn(port, slow, path, &auth, deadline, &tally, &open).await;
            }));
        }
    }
    for task in tasks {
        let _ = task.await;
    }
    let outcomes = tally.outcomes.lock().clone();
    AttackFigures {
        ops: tally.ops.load(Ordering::Relaxed),
        outcomes,
        peak_open: gauges
            .into_iter()
            .map(|(name, g)| (name.to_string(), g.1.load(Ordering::Relaxed)))
            .collect(),
        ..AttackFigures::default()
    }
}

/// What a slow connection sends.
#[derive(Clone, Copy)]
enum Slow {
    /// A partial head, then a header line a second.
    Head,
    /// Nothing (half-open).
    Silent,
    /// A whole head with this Content-Length, then one body byte.
    Body(usize),
}

/// One slow connection, opened again whenever the server cuts it, until `deadline`.
async fn slow_conn(
    port: u16,
    kind: Slow,
    path: &str,
    auth: &str,
    deadline: Instant,
    tally: &Tally,
    open: &(AtomicU64, AtomicU64),
) {
    while Instant::now() < deadline {
        let Ok(Ok(mut s)) = timeout(
            Duration::from_secs(2),
            TcpStream::connect(("127.0.0.1", port)),
        )
        .await
        else {
            tally.count("refused");
            sleep(Duration::from_millis(200)).await;
            continue;
        };
        tally.ops.fetch_add(1, Ordering::Relaxed);
        let now = open.0.fetch_add(1, Ordering::Relaxed) + 1;
        open.1.fetch_max(now, Ordering::Relaxed);
        let mut buf = [0u8; 1024];
        let cut = timeout_at(deadline, async {
            match kind {
                Slow::Head => {
                    let partial = format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
                    if s.write_all(partial.as_bytes()).await.is_err() {
                        return;
                    }
                    loop {
                        tokio::select! {
                            r = s.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { return },
                            _ = sleep(Duration::from_secs(1)) => {
                                if s.write_all(b"X-Slow: 1\r\n").await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                }
                Slow::Silent => {}
                Slow::Body(len) => {
                    let h = head("POST", path, auth, len);
                    if s.write_all(h.as_bytes()).await.is_err() || s.write_all(b"[").await.is_err()
                    {
                        return;
                    }
                }
            }
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    return;
                }
            }
        })
        .await
        .is_ok();
        open.0.fetch_sub(1, Ordering::Relaxed);
        tally.count(if cut { "cut" } else { "held" });
    }
}

/// A malformed msgpack frame (`92 00 dd ff ff ff ff c0`: an array claiming 2^32 - 1
/// elements) live on rank 0 every second; and at the start one on rank 1 that is dropped
/// live (the engine's drop hook) so it waits in the replay buffer for the bridge to ask for.
async fn poison(t: &Targets, deadline: Instant) -> AttackFigures {
    const FRAME: &str = "92 00 dd ff ff ff ff c0";
    let tally = Tally::default();
    let hook = |path: &str, body: String| {
        let h = head("POST", path, "", body.len());
        let port = t.engine;
        async move { send(port, &h, body.as_bytes(), 1, Duration::from_secs(5)).await }
    };
    let dropped = hook(
        "/kvrouter/test/drop",
        r#"{"dp_rank":1,"count":1}"#.to_string(),
    )
    .await;
    tally.count(&format!(
        "drop hook {}",
        dropped.map_or_else(String::from, |s| s.to_string())
    ));
    tally.result(
        hook(
            "/kvrouter/test/raw_frame",
            format!(r#"{{"dp_rank":1,"hex":"{FRAME}"}}"#),
        )
        .await,
    );
    while Instant::now() < deadline {
        tally.result(
            hook(
                "/kvrouter/test/raw_frame",
                format!(r#"{{"dp_rank":0,"hex":"{FRAME}"}}"#),
            )
            .await,
        );
        sleep(Duration::from_secs(1)).await;
    }
    let outcomes = tally.outcomes.lock().clone();
    AttackFigures {
        ops: tally.ops.load(Ordering::Relaxed),
        outcomes,
        ..AttackFigures::default()
    }
}

/// The request attacks: a few clients, each sending one request after another.
async fn flood(attack: Attack, t: Targets, deadline: Instant, seed: u64) -> AttackFigures {
    const CLIENTS: usize = 4;
    let m = &t.model;
    let mib = Arc::new(vec![b' '; 1 << 20]);
    let nested = Arc::new(vec![b'['; 1_000_000]);
    let junk = |bytes: usize, prefix: String| {
        let mut b = prefix.into_bytes();
        b.extend_from_slice(br#","junk":["#);
        while b.len() < bytes {
            b.extend_from_slice(b"0,");
        }
        b.extend_from_slice(b"0]}");
        Arc::new(b)
    };
    let statics: Vec<Shot> = match attack {
        Attack::Bodies => vec![
            Shot::oversized(&t, t.frontend, "/v1/completions", 40, &mib),
            Shot::post(&t, t.frontend, "/v1/completions", "", nested.clone()),
            Shot::post(
                &t,
                t.frontend,
                "/v1/completions",
                "",
                junk(
                    8 << 20,
                    format!(r#"{{"model":"{m}","prompt":"hi","max_tokens":1"#),
                ),
            ),
            Shot::oversized(&t, t.replica, "/v1/route", 2, &mib),
            Shot::post(&t, t.replica, "/v1/route", "", nested.clone()),
            Shot::post(
                &t,
                t.replica,
                "/v1/route",
                "",
                junk(
                    1 << 20,
                    format!(r#"{{"model":"{m}","tokens":[1,2,3],"update_states":false"#),
                ),
            ),
            Shot::oversized(&t, t.engine, "/v1/completions", 17, &mib),
            Shot::post(&t, t.engine, "/v1/completions", "", nested),
        ],
        Attack::AllowedWorkers => {
            let mut ids: Vec<u64> = (1..200_000).collect();
            ids.push(t.worker_id);
            let list = serde_json::to_string(&ids).unwrap_or_default();
            vec![
                Shot::post(
                    &t,
                    t.frontend,
                    "/v1/completions",
                    "",
                    Arc::new(
                        format!(
                            r#"{{"model":"{m}","prompt":"hello there","max_tokens":1,"kvrouter":{{"allowed_workers":{list}}}}}"#
                        )
                        .into_bytes(),
                    ),
                ),
                Shot::post(
                    &t,
                    t.replica,
                    "/v1/route",
                    "",
                    Arc::new(
                        format!(
                            r#"{{"model":"{m}","tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"update_states":false,"allowed_workers":{list}}}"#
                        )
                        .into_bytes(),
                    ),
                ),
            ]
        }
        _ => Vec::new(),
    };
    let statics = Arc::new(statics);
    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (statics, tally, t) = (statics.clone(), tally.clone(), t.clone());
        let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(c as u64));
        tasks.push(tokio::spawn(async move {
            let mut k = c;
            while Instant::now() < deadline {
                let fresh;
                let shot = if statics.is_empty() {
                    fresh = dynamic(attack, &t, k, &mut rng);
                    &fresh
                } else {
                    &statics[k % statics.len()]
                };
                k += 1;
                let r = timeout_at(
                    deadline,
                    send(
                        shot.port,
                        &shot.head,
                        &shot.body,
                        shot.repeat,
                        Duration::from_secs(30),
                    ),
                )
                .await;
                match r {
                    Ok(r) => tally.result(r),
                    Err(_) => {
                        tally.ops.fetch_add(1, Ordering::Relaxed);
                        tally.count("unanswered at the phase's end");
                        return;
                    }
                }
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let outcomes = tally.outcomes.lock().clone();
    AttackFigures {
        ops: tally.ops.load(Ordering::Relaxed),
        outcomes,
        ..AttackFigures::default()
    }
}

/// The attacks whose every request is new: random 500 KB model names, 1 MiB request ids.
fn dynamic(attack: Attack, t: &Targets, k: usize, rng: &mut fastrand::Rng) -> Shot {
    let m = &t.model;
    match (attack, k % 3) {
        (Attack::Labels, 0 | 2) => {
            let name = random_text(rng, 500_000);
            Shot::post(
                t,
                t.frontend,
                "/v1/completions",
                "",
                Arc::new(
                    format!(r#"{{"model":"{name}","prompt":"hi","max_tokens":1}}"#).into_bytes(),
                ),
            )
        }
        (Attack::Labels, _) => {
            let name = random_text(rng, 500_000);
            Shot::post(
                t,
                t.replica,
                "/v1/route",
                "",
                Arc::new(
                    format!(r#"{{"model":"{name}","tokens":[1,2,3],"update_states":false}}"#)
                        .into_bytes(),
                ),
            )
        }
        (_, 0) => {
            let id = random_text(rng, 1 << 20);
            Shot::post(
                t,
                t.frontend,
                "/v1/completions",
                &format!("x-request-id: {id}\r\n"),
                Arc::new(format!(r#"{{"model":"{m}","prompt":"hi","max_tokens":1}}"#).into_bytes()),
            )
        }
        (_, 1) => {
            let id = random_text(rng, 1 << 20);
            Shot::post(
                t,
                t.replica,
                "/v1/route",
                "",
                Arc::new(
                    format!(
                        r#"{{"model":"{m}","tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"request_id":"{id}","update_states":true}}"#
                    )
                    .into_bytes(),
                ),
            )
        }
        _ => {
            let id = random_text(rng, 1 << 20);
            Shot::post(
                t,
                t.replica,
                &format!("/v1/requests/{id}/free"),
                "",
                Arc::new(b"{}".to_vec()),
            )
        }
    }
}
