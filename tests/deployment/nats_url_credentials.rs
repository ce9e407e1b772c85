//! Credentials in the NATS URL (`nats://user:password@host`, `nats://token@host`,
//! percent-encoded) against a real nats-server that requires them: through the bus crate and
//! through the binary.

use crate::common;

use bytes::Bytes;
use common::*;
use kvrouter_bus::{Bus, BusError, NatsOptions};
use std::time::{Duration, Instant};

const USER: &str = "alice";
const PASS: &str = "s3cr et@:%";
/// PASS percent-encoded, as it goes into a URL.
const PASS_ENCODED: &str = "s3cr%20et%40%3A%25";

fn url_with(userinfo: &str, server: &NatsServer) -> String {
    format!("nats://{userinfo}@127.0.0.1:{}", server.port)
}

/// The message of the Connect error a refused connection gives (`r` must be one).
fn refused_connect_message(r: Result<Bus, BusError>) -> String {
    match r {
        Err(BusError::Connect(m)) => m,
        Err(other) => panic!("expected a Connect error, got {other:?}"),
        Ok(_) => panic!("expected a Connect error, but connected"),
    }
}

/// A request to an echo subscriber on `bus` gets its payload back.
async fn echo_round_trip(bus: &Bus) {
    let mut sub = bus.subscribe("creds.echo").await.unwrap();
    let responder = bus.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Some(reply) = m.reply {
                responder.publish(&reply, m.payload).await.unwrap();
            }
        }
    });
    bus.flush().await.unwrap();
    let m = bus
        .request(
            "creds.echo",
            Bytes::from_static(b"hi"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(m.payload, Bytes::from_static(b"hi"));
}

#[tokio::test]
async fn bus_user_and_password_in_the_url() {
    let server = NatsServer::start_with_args(&["--user", USER, "--pass", PASS]);
    let url = url_with(&format!("{USER}:{PASS_ENCODED}"), &server);
    let bus = Bus::connect(&NatsOptions::new(url.clone()))
        .await
        .expect("the URL's credentials are used");
    echo_round_trip(&bus).await;

    let started = Instant::now();
    let wrong = url_with(&format!("{USER}:wrong-pass"), &server);
    let msg = refused_connect_message(Bus::connect(&NatsOptions::new(wrong)).await);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(msg.to_lowercase().contains("authorization"), "{msg}");
    assert!(
        !msg.contains("wrong-pass"),
        "the password is not echoed: {msg}"
    );
    assert!(msg.contains(&format!("{USER}:***@")), "{msg}");

    let mut both = NatsOptions::new(url);
    both.user = Some(USER.into());
    both.password = Some(PASS.into());
    let msg = refused_connect_message(Bus::connect(&both).await);
    assert!(
        msg.contains("credentials in the URL and user/password"),
        "{msg}"
    );
}

#[tokio::test]
async fn bus_token_in_the_url() {
    let server = NatsServer::start_with_args(&["--auth", "t0k/en"]);
    let bus = Bus::connect(&NatsOptions::new(url_with("t0k%2Fen", &server)))
        .await
        .expect("a lone userinfo is a token");
    echo_round_trip(&bus).await;
    let msg =
        refused_connect_message(Bus::connect(&NatsOptions::new(url_with("nope", &server))).await);
    assert!(msg.to_lowercase().contains("authorization"), "{msg}");
    assert!(!msg.contains("nope"), "{msg}");
}

#[test]
fn the_binary_connects_with_url_credentials() {
    let server = NatsServer::start_with_args(&["--user", USER, "--pass", PASS]);
    let url = url_with(&format!("{USER}:{PASS_ENCODED}"), &server);
    let mut mocker = kvrouter();
    mocker
        .args([
            "mocker",
            "--nats",
            &url,
            "--model",
            E2E_MODEL,
            "--block-size",
            "16",
        ])
        .args(["--speedup", "100", "--worker-id-start", "1"]);
    let mut mocker = spawn_proc("mocker", mocker);
    let line = mocker.first_line();
    assert!(line.contains("worker_ids"), "{line:?}");
    let admin = free_port();
    let addr = format!("127.0.0.1:{admin}");
    let mut serve = kvrouter();
    serve.args([
        "serve",
        "--nats",
        &url,
        "--model",
        E2E_MODEL,
        "--admin-addr",
        &addr,
    ]);
    let _serve = spawn_proc("serve", serve);
    assert!(
        ready(admin),
        "serve connected with the URL's credentials and became ready"
    );

    let tokens: Vec<String> = e2e_tokens(1, 2).iter().map(u32::to_string).collect();
    let tokens = tokens.join(",");
    let route = |url: &str, extra: &[&str]| {
        let started = Instant::now();
        let out = kvrouter()
            .args([
                "route", "--nats", url, "--model", E2E_MODEL, "--tokens", &tokens,
            ])
            .args(extra)
            .output()
            .expect("route runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            started.elapsed(),
        )
    };
    let (code, stdout, stderr) = {
        let (c, o, e, _) = route(&url, &[]);
        (c, o, e)
    };
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("worker_id"), "{stdout}");

    let wrong = url_with(&format!("{USER}:not-it"), &server);
    let (code, _, stderr, took) = route(&wrong, &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        took < Duration::from_secs(5),
        "a wrong password fails quickly: {took:?}"
    );
    assert!(stderr.to_lowercase().contains("authorization"), "{stderr}");
    assert!(!stderr.contains("not-it"), "{stderr}");

    // Credentials both in the URL and in flags: refused, naming both, echoing neither.
    let (code, _, stderr, _) = route(&url, &["--nats-user", USER, "--nats-password", "flag-pw"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("credentials in the URL and user/password"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("flag-pw") && !stderr.contains("s3cr"),
        "{stderr}"
    );
}
