//! Shutdown of the long-running commands with NATS gone (the real binary, a real nats-server
//! killed by PID): SIGTERM ends `serve` and `mocker` within --drain-timeout-secs, and a second
//! signal during a long drain ends the process at once.

use crate::common;

use common::*;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Slack for a loaded test machine.
const SLACK: Duration = Duration::from_secs(2);

fn log_file() -> tempfile::NamedTempFile {
    tempfile::NamedTempFile::new().expect("a temp file")
}

/// `kvrouter mocker` (one worker of [`E2E_MODEL`]) with stderr in `log`; waits for its start
/// line.
fn mocker_logged(
    nats: &NatsServer,
    first_id: u64,
    log: &tempfile::NamedTempFile,
    extra: &[&str],
) -> Proc {
    let url = nats.url();
    let id = first_id.to_string();
    let mut cmd = kvrouter();
    cmd.args([
        "mocker",
        "--nats",
        &url,
        "--model",
        E2E_MODEL,
        "--block-size",
        "16",
    ])
    .args([
        "--capacity-blocks",
        "512",
        "--speedup",
        "100",
        "--worker-id-start",
        &id,
    ])
    .args(extra)
    .stderr(Stdio::from(log.reopen().expect("reopen the log")));
    let mut p = spawn_proc("mocker", cmd);
    let line = p.first_line();
    assert!(line.contains("worker_ids"), "mocker start line: {line:?}");
    p
}

/// Waits for every process to exit, up to `timeout` in all: each one's status and how long
/// after `since` it exited (`None` if it did not).
fn exits(
    procs: &mut [&mut Proc],
    since: Instant,
    timeout: Duration,
) -> Vec<Option<(ExitStatus, Duration)>> {
    let mut out = vec![None; procs.len()];
    while since.elapsed() < timeout && out.iter().any(Option::is_none) {
        for (p, o) in procs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    *o = Some((status, since.elapsed()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    out
}

#[test]
fn sigterm_with_nats_down_ends_serve_and_mocker_within_the_drain_timeout() {
    let drain = Duration::from_secs(3);
    let drain_arg = drain.as_secs().to_string();
    let nats = NatsServer::start();
    let mocker_log = log_file();
    let mut mocker = mocker_logged(&nats, 1, &mocker_log, &["--drain-timeout-secs", &drain_arg]);
    let admin = free_port();
    let mut serve = serve(&nats, "r1", admin, &["--drain-timeout-secs", &drain_arg]);
    assert!(ready(admin), "the replica never became ready");

    drop(nats); // killed by PID: both clients are now reconnecting for ever
    std::thread::sleep(Duration::from_millis(500));
    assert!(serve.running() && mocker.running());

    let since = Instant::now();
    serve.signal(libc::SIGTERM);
    mocker.signal(libc::SIGTERM);
    let bound = drain + SLACK;
    let done = exits(&mut [&mut serve, &mut mocker], since, bound);
    eprintln!(
        "NATS down, SIGTERM -> exit: serve {:?}, mocker {:?}",
        done[0], done[1]
    );
    let (serve_status, _) = done[0].expect("serve exits within the drain timeout");
    let (mocker_status, _) = done[1].expect("mocker exits within the drain timeout");
    // The replica drained (nothing in flight); only its final flush was cut short.
    assert!(serve_status.success(), "serve: {serve_status:?}");
    // The mocker's deregistrations never reached NATS: it says so and fails.
    assert_eq!(mocker_status.code(), Some(1), "mocker: {mocker_status:?}");
    let log = std::fs::read_to_string(mocker_log.path()).unwrap();
    assert!(
        log.contains("error: mocker shutdown did not complete cleanly")
            && log.contains("deregistration of workers [1] not confirmed"),
        "{log}"
    );
}

#[test]
fn a_second_signal_during_a_long_drain_exits_at_once() {
    let nats = NatsServer::start();
    let _mocker = mocker(&nats, 1, 1, 1, E2E_BLOCK);
    let admin = free_port();
    // One routed request makes the only worker busy (its prefill is never marked done), so a
    // second one waits in the queue: in flight, it holds the drain for up to 60 s.
    let mut serve = serve(
        &nats,
        "r1",
        admin,
        &[
            "--drain-timeout-secs",
            "60",
            "--busy-prefill-tokens",
            "1",
            "--max-queue-wait-ms",
            "60000",
        ],
    );
    assert!(ready(admin), "the replica never became ready");
    let url = nats.url();
    let route = |seed: u32, timeout_ms: &str| {
        let tokens: Vec<String> = e2e_tokens(seed, 2).iter().map(u32::to_string).collect();
        let mut cmd = kvrouter();
        cmd.args([
            "route",
            "--nats",
            &url,
            "--model",
            E2E_MODEL,
            "--timeout-ms",
            timeout_ms,
        ])
        .args(["--tokens", &tokens.join(",")]);
        cmd
    };
    let first = route(1, "5000").output().expect("route runs");
    assert!(first.status.success(), "{first:?}");
    let _queued = spawn_proc("queued route", route(2, "60000"));
    let queued = r#"kvrouter_queued_requests{model="Qwen/Qwen3-0.6B"} 1"#;
    assert!(
        wait_until(Duration::from_secs(10), || metrics(admin).contains(queued)),
        "the second route never queued: {}",
        metrics(admin)
    );

    drop(nats);
    std::thread::sleep(Duration::from_millis(500));
    serve.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        serve.running(),
        "the first signal starts a drain that waits for the queued request"
    );
    let since = Instant::now();
    serve.signal(libc::SIGINT);
    let status = serve
        .wait_exit(Duration::from_secs(2))
        .expect("the second signal ends serve at once");
    eprintln!(
        "second signal (SIGINT) -> exit in {:?}: {status:?}",
        since.elapsed()
    );
    assert!(
        since.elapsed() < Duration::from_millis(1500),
        "{:?}",
        since.elapsed()
    );
    assert_eq!(status.code(), Some(130), "{status:?}");
}
