//! The processes of a chaos run: nats-server, `kvrouter serve` replicas, `kvrouter mocker`
//! fleets, emulated engines (`kvrouter mocker --emulate`) and their `kvrouter bridge`s, each
//! a child process driven by PID (kill, stop, continue, restart).

use kvrouter_testkit::{NatsError, NatsServer, Proc};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Why the fleet could not be driven.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Startup(String),
}

/// nats-server on a free loopback port, its log in `log_dir` if given. Blocks this worker
/// thread while it starts (the chaos runtime has others).
pub fn start_nats(log_dir: Option<&Path>) -> Result<NatsServer, FleetError> {
    start_nats_with(log_dir, &[])
}

/// [`start_nats`] with more arguments (`-c FILE`).
pub fn start_nats_with(log_dir: Option<&Path>, args: &[&str]) -> Result<NatsServer, FleetError> {
    let log = log_dir.map(|d| d.join("nats-server.log"));
    Ok(tokio::task::block_in_place(|| {
        NatsServer::try_start(args, log.as_deref())
    })?)
}

/// nats-server again on its port (a fault step), blocking this worker thread meanwhile.
pub fn restart_nats(nats: &mut NatsServer) -> Result<(), FleetError> {
    Ok(tokio::task::block_in_place(|| nats.restart())?)
}

fn stderr_to(log_dir: Option<&Path>, name: &str) -> Stdio {
    match log_dir.and_then(|d| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join(format!("{name}.log")))
            .ok()
    }) {
        Some(f) => Stdio::from(f),
        None => Stdio::null(),
    }
}

/// Spawns `exe args` (logs at warn, stderr to the log directory) as a [`Proc`].
fn spawn(
    name: &str,
    exe: &Path,
    args: &[String],
    log_dir: Option<&Path>,
) -> Result<Proc, FleetError> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("KVROUTER_LOG", "warn")
        .stderr(stderr_to(log_dir, name));
    Proc::spawn(name, cmd).map_err(|source| FleetError::Spawn {
        what: name.to_string(),
        source,
    })
}

/// SIGKILLs the process in `proc`, if any, and reaps it.
pub fn kill(proc: &mut Option<Proc>) {
    if let Some(p) = proc.take() {
        p.kill();
    }
}

/// A `kvrouter serve` replica: its arguments, so it starts again the same.
pub struct Replica {
    pub id: String,
    pub admin_port: u16,
    /// Keeps an index of its own (not `--use-remote-indexer`).
    pub indexes: bool,
    pub args: Vec<String>,
    pub proc: Option<Proc>,
    pub paused: bool,
}

impl Replica {
    pub fn start(&mut self, exe: &Path, log_dir: Option<&Path>) -> Result<(), FleetError> {
        self.proc = Some(spawn(&self.id, exe, &self.args, log_dir)?);
        self.paused = false;
        Ok(())
    }

    /// Waits until `/readyz` answers 200.
    pub async fn ready(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if http_get(self.admin_port, "/readyz").await.0 == 200 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

/// A `kvrouter mocker` process of several workers.
pub struct Mocker {
    pub name: String,
    pub first_id: u64,
    pub workers: u32,
    pub args: Vec<String>,
    pub proc: Option<Proc>,
}

impl Mocker {
    pub fn worker_ids(&self) -> impl Iterator<Item = u64> {
        self.first_id..self.first_id + u64::from(self.workers)
    }

    /// Starts it and waits for its start line.
    pub async fn start(&mut self, exe: &Path, log_dir: Option<&Path>) -> Result<(), FleetError> {
        let (p, _) = spawn_with_line(&self.name, exe, &self.args, log_dir, "worker_ids").await?;
        self.proc = Some(p);
        Ok(())
    }
}

/// Spawns `exe args` and waits (30 s at most) for its first stdout line, which must contain
/// `marker`; returns the process (its stdout kept open) and the line.
pub async fn spawn_with_line(
    name: &str,
    exe: &Path,
    args: &[String],
    log_dir: Option<&Path>,
    marker: &'static str,
) -> Result<(Proc, String), FleetError> {
    let mut p = spawn(name, exe, args, log_dir)?;
    let line = tokio::task::block_in_place(|| p.first_line_within(Duration::from_secs(30)))
        .ok_or_else(|| FleetError::Startup(format!("{name} printed no start line in 30 s")))?;
    if !line.contains(marker) {
        return Err(FleetError::Startup(format!(
            "{name} did not start: {line:?}"
        )));
    }
    Ok((p, line))
}

/// An emulated engine: `kvrouter mocker --emulate vllm|sglang` with one worker, on fixed
/// ports (so it restarts where its bridge looks for it).
pub struct Engine {
    pub name: String,
    /// `vllm` or `sglang`.
    pub kind: &'static str,
    /// Rank 0's KV event publisher; ranks publish on `zmq_port + r`, replay on
    /// `zmq_port + dp_size + r`.
    pub zmq_port: u16,
    pub http_port: u16,
    pub dp_size: u32,
    pub args: Vec<String>,
    pub proc: Option<Proc>,
}

impl Engine {
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// Starts it and waits for its start line; a port still held (by the previous process's
    /// connections, or taken meanwhile) is tried again for a few seconds.
    pub async fn start(&mut self, exe: &Path, log_dir: Option<&Path>) -> Result<(), FleetError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match spawn_with_line(&self.name, exe, &self.args, log_dir, "base_url").await {
                Ok((p, _)) => {
                    self.proc = Some(p);
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// `/kvrouter/test/cache?dp_rank=R`: what the engine really caches on a rank, in the
    /// shape of a replica's `/debug/rank`.
    pub async fn cache(&self, rank: u32) -> (u16, String) {
        http_get(
            self.http_port,
            &format!("/kvrouter/test/cache?dp_rank={rank}"),
        )
        .await
    }
}

/// A `kvrouter bridge` beside an [`Engine`]: one worker (the engine's ranks) on the bus.
pub struct BridgeProc {
    pub name: String,
    /// Which engine of the fleet it speaks for.
    pub engine: usize,
    pub admin_port: u16,
    /// Its worker id, from its first start line (the same at every start: it derives from
    /// the model, the engine's address and first rank).
    pub worker_id: Option<u64>,
    pub args: Vec<String>,
    pub proc: Option<Proc>,
}

impl BridgeProc {
    /// Starts it and waits for its start line; returns a note when its worker id changed.
    pub async fn start(
        &mut self,
        exe: &Path,
        log_dir: Option<&Path>,
    ) -> Result<Option<String>, FleetError> {
        let (p, line) = spawn_with_line(&self.name, exe, &self.args, log_dir, "worker_id").await?;
        self.proc = Some(p);
        let id = serde_json::from_str::<serde_json::Value>(line.trim())
            .ok()
            .and_then(|v| v["worker_id"].as_u64())
            .ok_or_else(|| {
                FleetError::Startup(format!("{}: no worker_id in {line:?}", self.name))
            })?;
        let note = match self.worker_id.replace(id) {
            Some(old) if old != id => {
                Some(format!("{} came back as worker {id}, not {old}", self.name))
            }
            _ => None,
        };
        Ok(note)
    }

    /// Waits until its `/readyz` answers 200 (connected to the bus and the engine, which is
    /// healthy).
    pub async fn ready(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if http_get(self.admin_port, "/readyz").await.0 == 200 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

/// `GET path` on a loopback port: (status, body); (0, "") when nothing answers.
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || kvrouter_testkit::http_get(port, &path))
        .await
        .unwrap_or_default()
}
