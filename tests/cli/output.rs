//! What the binary prints on stderr (the real binary, a real nats-server): client commands
//! show warnings only unless -v or KVROUTER_LOG asks for more, serve logs kvrouter's own info
//! lines without dependency chatter, no ANSI escapes outside a terminal, and each cause of an
//! error once.

use crate::common;

use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const ESC: &str = "\x1b[";

/// `kvrouter ARGS` with the log settings of an operator's shell: none (the test helper sets
/// KVROUTER_LOG=warn for every other test).
fn bare(args: &[&str]) -> Command {
    let mut c = kvrouter();
    c.env_remove("KVROUTER_LOG")
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .env_remove("KVROUTER_VERBOSE")
        .args(args);
    c
}

fn stderr_of(mut c: Command) -> (bool, String, String) {
    let out = c.output().expect("kvrouter runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn client_commands_are_quiet_and_serve_logs_carry_no_escapes() {
    let nats = NatsServer::start();
    let _mocker = mocker(&nats, 1, 1, 1, E2E_BLOCK);
    let admin = free_port();
    let serve_log = tempfile::NamedTempFile::new().unwrap();
    let addr = format!("127.0.0.1:{admin}");
    let url = nats.url();
    let mut cmd = bare(&[
        "serve",
        "--nats",
        &url,
        "--model",
        E2E_MODEL,
        "--admin-addr",
        &addr,
    ]);
    cmd.stderr(Stdio::from(serve_log.reopen().unwrap()));
    let serve = spawn_proc("serve", cmd);
    assert!(ready(admin), "the replica never became ready");

    let tokens: Vec<String> = e2e_tokens(1, 2).iter().map(u32::to_string).collect();
    let tokens = tokens.join(",");
    let route = [
        "route", "--nats", &url, "--model", E2E_MODEL, "--tokens", &tokens,
    ];
    let (ok, stdout, stderr) = stderr_of(bare(&route));
    assert!(ok && stdout.contains("worker_id"), "{stdout}\n{stderr}");
    assert!(
        !stderr.contains("INFO"),
        "route is quiet by default: {stderr}"
    );
    assert!(!stderr.contains(ESC), "no escapes in a pipe: {stderr:?}");

    // -v raises it (global: before or after the subcommand), KVROUTER_LOG overrides it.
    let mut verbose = bare(&["-v"]);
    verbose.args(route);
    let (ok, _, stderr) = stderr_of(verbose);
    assert!(ok && stderr.contains("INFO"), "{stderr}");
    assert!(
        !stderr.contains("DEBUG") && !stderr.contains(ESC),
        "{stderr:?}"
    );
    let mut vvv = bare(&route);
    vvv.arg("-vvv");
    let (ok, _, stderr) = stderr_of(vvv);
    assert!(ok && stderr.contains(" DEBUG "), "{stderr}");
    let mut env = bare(&route);
    env.arg("-vvv").env("KVROUTER_LOG", "error");
    let (ok, _, stderr) = stderr_of(env);
    assert!(
        ok && stderr.is_empty(),
        "KVROUTER_LOG wins over -vvv: {stderr}"
    );

    // serve, logging to a file: its own info lines, plain text, no async_nats chatter.
    serve.kill();
    let log = std::fs::read_to_string(serve_log.path()).unwrap();
    assert!(log.contains(" INFO kvrouter"), "{log}");
    assert!(!log.contains(ESC), "no escapes in a file: {log:?}");
    assert!(
        !log.lines().any(|l| l.contains("INFO async_nats")),
        "no dependency info lines: {log}"
    );
}

#[test]
fn an_error_prints_each_cause_once() {
    let nats = NatsServer::start();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let url = nats.url();
    let mut cmd = bare(&[
        "serve",
        "--nats",
        &url,
        "--model",
        E2E_MODEL,
        "--admin-addr",
        &addr,
    ]);
    cmd.stdin(Stdio::null()).stderr(Stdio::piped());
    let mut p = spawn_proc("serve", cmd);
    let status = p
        .wait_exit(Duration::from_secs(20))
        .expect("serve fails at start");
    assert_eq!(status.code(), Some(1));
    let mut stderr = String::new();
    std::io::Read::read_to_string(p.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(line.contains(&addr), "{line}");
    assert_eq!(line.matches("os error 98").count(), 1, "{line}");
    assert_eq!(line.matches("Address already in use").count(), 1, "{line}");
}
