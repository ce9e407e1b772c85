//! Helpers for end-to-end tests: the real binary and a real nats-server.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn kvrouter() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrouter"));
    c.env("KVROUTER_LOG", "warn");
    c
}

pub fn run(args: &[&str]) -> Output {
    kvrouter().args(args).output().expect("kvrouter runs")
}

pub fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A nats-server on a free loopback port, stopped by PID when dropped.
pub struct NatsServer {
    child: Child,
    pub port: u16,
}

impl NatsServer {
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Like [`NatsServer::start`], with extra nats-server arguments (e.g. `["--auth", "s3cret"]`).
    pub fn start_with_args(args: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        Self::start_on_port(port, args)
    }

    /// A nats-server on the given loopback port (e.g. to restart one where a stopped one ran).
    pub fn start_on_port(port: u16, args: &[&str]) -> Self {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server on PATH (scripts/test.sh installs it)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's INFO line, as a client sees it on connect.
    pub fn info(&self) -> String {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        let mut line = String::new();
        BufReader::new(stream)
            .read_line(&mut line)
            .expect("INFO line");
        line
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}
