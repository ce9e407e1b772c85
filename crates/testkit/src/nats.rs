//! A real nats-server on a loopback port, stopped by PID, restartable on the same port.

use crate::{free_port, Proc};
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Why nats-server could not be had.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error(
        "nats-server is not on PATH: tests and the chaos bench run a real one (source \
         scripts/setup.sh, which installs it into .tools/)"
    )]
    NotInstalled,
    #[error("cannot start nats-server: {0}")]
    Spawn(std::io::Error),
    #[error("nats-server did not answer on 127.0.0.1:{port} within {secs} s")]
    NoAnswer { port: u16, secs: u64 },
}

/// A nats-server on a loopback port, killed by PID when dropped.
pub struct NatsServer {
    pub port: u16,
    args: Vec<String>,
    log: Option<PathBuf>,
    proc: Option<Proc>,
}

impl NatsServer {
    /// A nats-server on a free loopback port; panics if it cannot start (tests).
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Like [`NatsServer::start`], with extra nats-server arguments (`["--auth", "s3cret"]`).
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::try_start(args, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A nats-server on the given port (to restart one where a stopped one ran); panics if
    /// it does not come up.
    pub fn start_on_port(port: u16, args: &[&str]) -> Self {
        let mut s = Self::new(port, args, None);
        s.launch().unwrap_or_else(|e| panic!("{e}"));
        s
    }

    /// A nats-server on a free port (another if that one is taken meanwhile), its log
    /// appended to `log` if given.
    pub fn try_start(args: &[&str], log: Option<&Path>) -> Result<Self, NatsError> {
        let mut last = None;
        for _ in 0..5 {
            let mut s = Self::new(free_port(), args, log);
            match s.launch() {
                Ok(()) => return Ok(s),
                Err(NatsError::NotInstalled) => return Err(NatsError::NotInstalled),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("five tries"))
    }

    fn new(port: u16, args: &[&str], log: Option<&Path>) -> Self {
        Self {
            port,
            args: args.iter().map(|a| a.to_string()).collect(),
            log: log.map(Path::to_path_buf),
            proc: None,
        }
    }

    /// Starts nats-server on its port and waits (5 s) until it, not some other process,
    /// answers there.
    fn launch(&mut self) -> Result<(), NatsError> {
        let mut cmd = Command::new("nats-server");
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(&self.args)
            .stderr(self.log_sink());
        let mut p = Proc::spawn("nats-server", cmd).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => NatsError::NotInstalled,
            _ => NatsError::Spawn(e),
        })?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && p.running() {
            if info_line(self.port).is_some_and(|l| l.starts_with("INFO")) && p.running() {
                self.proc = Some(p);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(NatsError::NoAnswer {
            port: self.port,
            secs: 5,
        })
    }

    fn log_sink(&self) -> Stdio {
        let file = self.log.as_ref().and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        });
        file.map_or_else(Stdio::null, Stdio::from)
    }

    /// Kills it (SIGKILL): clients see the connection drop as in a crash.
    pub fn stop(&mut self) {
        if let Some(p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts it again on the same port, with the same arguments, trying for up to 15 s
    /// (the old process's port may take a moment to free).
    pub fn restart(&mut self) -> Result<(), NatsError> {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match self.launch() {
                Ok(()) => return Ok(()),
                Err(NatsError::NotInstalled) => return Err(NatsError::NotInstalled),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's INFO line, as a client sees it on connect.
    pub fn info(&self) -> String {
        info_line(self.port).expect("the INFO line")
    }

    /// Its PID (panics when stopped).
    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("nats-server running").pid()
    }

    /// Whether its process is running.
    pub fn running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::running)
    }
}

fn info_line(port: u16) -> Option<String> {
    let stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::NatsServer;

    #[test]
    fn a_real_nats_server_starts_is_recent_enough_and_stops_by_pid() {
        let mut server = NatsServer::start();
        let info = server.info();
        assert!(info.starts_with("INFO "), "{info}");
        let json: serde_json::Value =
            serde_json::from_str(info.trim_start_matches("INFO ").trim()).unwrap();
        let version = json["version"].as_str().unwrap();
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap(), parts.next().unwrap());
        assert!(
            major > 2 || (major == 2 && minor >= 10),
            "nats-server {version} is older than 2.10"
        );
        let pid = server.pid();
        server.restart().expect("starts again on its port");
        assert_ne!(server.pid(), pid);
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert!(server.info().starts_with("INFO "));
        let pid = server.pid();
        drop(server);
        // killed by PID and reaped
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    }
}
