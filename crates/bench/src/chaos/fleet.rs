//! The processes of a chaos run: nats-server, `kvrouter serve` replicas, `kvrouter mocker`
//! fleets, emulated engines (`kvrouter mocker --emulate`) and their `kvrouter bridge`s, each
//! a child process driven by PID (kill, stop, continue, restart).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why the fleet could not be driven.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(
        "nats-server is not on PATH: the chaos bench runs a real one (install it, or source \
         scripts/setup.sh)"
    )]
    NoNatsServer,
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Startup(String),
}

/// A free loopback TCP port.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// `n` consecutive free loopback TCP ports (an emulated engine's ZMQ publishers and replay
/// endpoints); the first of them.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if base == 0 || base.checked_add(n).is_none() {
            continue;
        }
        let held: Vec<_> = (base..base + n)
            .map_while(|p| TcpListener::bind(("127.0.0.1", p)).ok())
            .collect();
        if held.len() == usize::from(n) {
            return base;
        }
    }
    0
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the PID of a child we spawned and have not reaped.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
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

/// A child process stopped by PID (SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    /// Kept open: a process writing to a closed stdout may fail.
    _stdout: Option<ChildStdout>,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command, log_dir: Option<&Path>) -> Result<Self, FleetError> {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr_to(log_dir, name))
            .spawn()
            .map_err(|source| {
                if source.kind() == std::io::ErrorKind::NotFound
                    && cmd.get_program() == "nats-server"
                {
                    return FleetError::NoNatsServer;
                }
                FleetError::Spawn {
                    what: name.to_string(),
                    source,
                }
            })?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            _stdout: None,
        })
    }

    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(&c, libc::SIGKILL);
            let _ = c.wait();
        }
        self._stdout = None;
    }

    pub fn pause(&self) {
        if let Some(c) = &self.child {
            signal(c, libc::SIGSTOP);
        }
    }

    pub fn resume(&self) {
        if let Some(c) = &self.child {
            signal(c, libc::SIGCONT);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// nats-server on one loopback port, restartable on the same port.
pub struct Nats {
    pub port: u16,
    log_dir: Option<PathBuf>,
    proc: Option<Proc>,
}

impl Nats {
    /// Starts on a free port (another if one is taken meanwhile).
    pub async fn start(log_dir: Option<&Path>) -> Result<Self, FleetError> {
        let mut last = String::new();
        for _ in 0..5 {
            let mut n = Self {
                port: free_port(),
                log_dir: log_dir.map(Path::to_path_buf),
                proc: None,
            };
            match n.start_again().await {
                Ok(()) => return Ok(n),
                Err(FleetError::NoNatsServer) => return Err(FleetError::NoNatsServer),
                Err(e) => last = e.to_string(),
            }
        }
        Err(FleetError::Startup(format!(
            "nats-server did not start: {last}"
        )))
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts nats-server on its port and waits until it answers there (a few tries: the
    /// old one's port may take a moment to free).
    pub async fn start_again(&mut self) -> Result<(), FleetError> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            let mut cmd = Command::new("nats-server");
            cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
            let mut p = Proc::spawn("nats-server", cmd, self.log_dir.as_deref())?;
            let up = Instant::now() + Duration::from_secs(5);
            while Instant::now() < up && p.running() {
                if info_line(self.port)
                    .await
                    .is_some_and(|l| l.starts_with("INFO"))
                {
                    if p.running() {
                        self.proc = Some(p);
                        return Ok(());
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            p.kill();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(FleetError::Startup(format!(
            "nats-server did not start on port {}",
            self.port
        )))
    }
}

async fn info_line(port: u16) -> Option<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.ok()?;
        Some(String::from_utf8_lossy(&buf).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), fut)
        .await
        .ok()?
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
        let mut cmd = Command::new(exe);
        cmd.args(&self.args).env("KVROUTER_LOG", "warn");
        self.proc = Some(Proc::spawn(&self.id, cmd, log_dir)?);
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
async fn spawn_with_line(
    name: &str,
    exe: &Path,
    args: &[String],
    log_dir: Option<&Path>,
    marker: &'static str,
) -> Result<(Proc, String), FleetError> {
    let mut cmd = Command::new(exe);
    cmd.args(args).env("KVROUTER_LOG", "warn");
    let mut p = Proc::spawn(name, cmd, log_dir)?;
    let stdout = p
        .child
        .as_mut()
        .and_then(|c| c.stdout.take())
        .ok_or_else(|| FleetError::Startup(format!("{name} stdout")))?;
    let read = tokio::task::spawn_blocking(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let ok = r.read_line(&mut line).is_ok() && line.contains(marker);
        (ok, line, r.into_inner())
    });
    let (ok, line, stdout) = tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .map_err(|_| FleetError::Startup(format!("{name} printed no start line in 30 s")))?
        .map_err(|e| FleetError::Startup(e.to_string()))?;
    if !ok {
        return Err(FleetError::Startup(format!(
            "{name} did not start: {line:?}"
        )));
    }
    p._stdout = Some(stdout);
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

/// `GET path` on a loopback port: (status, body); (0, "") when nothing answers in 5 s.
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await.ok()?;
        let resp = String::from_utf8_lossy(&resp).into_owned();
        let status = resp.split_whitespace().nth(1)?.parse().ok()?;
        let (head, body) = resp.split_once("\r\n\r\n")?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .ok()
        .flatten()
        .unwrap_or((0, String::new()))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(super::dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), "abcde");
    }
}
