//! Who may call a replica's HTTP doors (docs/operations.md, "Who may call the HTTP doors"),
//! end to end: the real binary over a real nats-server and a mocker fleet, `curl` as the
//! caller, bearer tokens with scopes, and HTTPS with client certificates made by `openssl`.

use crate::common;

use common::curl::{curl_as, Answer, Caller};
use common::{
    e2e_tokens as tokens, free_port, metric_sum as sum, ready, serve, wait_until, NatsServer,
    E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use kvrouter_testkit::TestCerts;
use serde_json::{json, Value};
use std::time::Duration;

const ROUTE_ONLY: &str = "route-only-token-0123456789abcdef";
const ROUTE_LEASE: &str = "route-lease-token-0123456789abcdef";
const DEBUG: &str = "debug-token-0123456789abcdef";
const REFUSED: &str = "kvrouter_http_auth_refused_total";
const ACTIVE: &str = "kvrouter_worker_active_requests";

fn call(who: &Caller, method: &str, port: u16, path: &str, body: Option<&Value>) -> Answer {
    let body = body.map(|b| b.to_string().into_bytes());
    curl_as(who, method, port, path, body.as_deref())
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn bearer(token: &str) -> Caller<'_> {
    Caller::bearer(token)
}

fn routed_prompt(seed: u32) -> Value {
    json!({ "model": MODEL, "tokens": tokens(seed, 2) })
}

/// A free of the request a route answer names, with its lease.
fn free_body(answer: &Value) -> Value {
    json!({ "model": MODEL, "lease": answer["lease"] })
}

fn rank_page() -> String {
    format!(
        "/debug/rank?model={}&worker=100&dp_rank=0",
        MODEL.replace('/', "%2F")
    )
}

#[test]
fn bearer_tokens_open_only_the_doors_their_scopes_name() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 1, 1, BLOCK);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        format!(
            "# peer routers\n{ROUTE_ONLY} route\n{ROUTE_LEASE} route,lease\n{DEBUG} debug # on-call\n"
        ),
    )
    .unwrap();
    let (admin, api) = (free_port(), free_port());
    let api_addr = format!("127.0.0.1:{api}");
    let _a = serve(
        &nats,
        "a",
        admin,
        &[
            "--http-addr",
            &api_addr,
            "--http-tokens-file",
            file.to_str().unwrap(),
        ],
    );
    // The probes and the metrics stay open (kubelet, Prometheus).
    assert!(ready(admin), "the replica turns ready");
    let anyone = Caller::default();
    assert_eq!(call(&anyone, "GET", api, "/healthz", None).status, 200);
    assert_eq!(call(&anyone, "GET", admin, "/metrics", None).status, 200);

    // No token, a wrong one: 401 with the challenge, nothing routed.
    let none = call(&anyone, "POST", api, "/v1/route", Some(&routed_prompt(1)));
    assert_eq!(
        none.error(),
        (401, "unauthenticated".into()),
        "{}",
        none.body
    );
    assert!(
        none.headers.contains("www-authenticate: bearer"),
        "{}",
        none.headers
    );
    let wrong = call(&bearer(&DEBUG[1..]), "GET", api, "/v1/workers", None);
    assert_eq!(wrong.error(), (401, "unauthenticated".into()));
    assert!(
        wrong.headers.contains("error=\"invalid_token\""),
        "{}",
        wrong.headers
    );
    assert_eq!(sum(admin, ACTIVE), 0.0);

    // A route-only token routes and lists workers; it may not end the request or read the
    // index.
    let route_only = bearer(ROUTE_ONLY);
    let r = call(
        &route_only,
        "POST",
        api,
        "/v1/route",
        Some(&routed_prompt(1)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let routed = r.json();
    let id = routed["request_id"].as_str().expect("an id").to_string();
    assert_eq!(
        call(&route_only, "GET", api, "/v1/workers", None).status,
        200
    );
    let free = format!("/v1/requests/{id}/free");
    let f = call(&route_only, "POST", api, &free, Some(&free_body(&routed)));
    assert_eq!(f.error(), (403, "forbidden".into()), "{}", f.body);
    assert!(f.headers.contains("scope=\"lease\""), "{}", f.headers);
    let d = call(&route_only, "GET", admin, &rank_page(), None);
    assert_eq!(d.error(), (403, "forbidden".into()));
    assert!(wait_until(Duration::from_secs(3), || sum(admin, ACTIVE) == 1.0));

    // The debug token reads the index and nothing else.
    let debug = bearer(DEBUG);
    let page = call(&debug, "GET", admin, &rank_page(), None);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.json()["blocks"].is_array(), "{}", page.body);
    let p = call(&debug, "POST", api, "/v1/route", Some(&routed_prompt(2)));
    assert_eq!(p.error(), (403, "forbidden".into()));
    assert_eq!(call(&anyone, "GET", admin, &rank_page(), None).status, 401);

    // The lease scope ends the request.
    let f = call(
        &bearer(ROUTE_LEASE),
        "POST",
        api,
        &free,
        Some(&free_body(&routed)),
    );
    assert_eq!(f.status, 200, "{}", f.body);
    assert!(wait_until(Duration::from_secs(3), || sum(admin, ACTIVE) == 0.0));

    // Every refusal counted, by reason, on the listener that refused it.
    let metrics = common::metrics(admin);
    let reason = |r: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(REFUSED) && l.contains(&format!("reason=\"{r}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(
        (
            reason("missing"),
            reason("invalid_token"),
            reason("insufficient_scope")
        ),
        (2.0, 1.0, 3.0),
        "{metrics}"
    );
}

#[test]
fn bad_credentials_stop_the_start_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let empty = write("empty", "# nobody yet\n\n");
    let short = write("short", "abc route\n");
    let scope = write("scope", &format!("{ROUTE_ONLY} route,admin\n"));
    // Refused before any connection: no nats-server needed.
    let base = ["serve", "--nats", "nats://127.0.0.1:1", "--model", MODEL];
    // (flags, environment, what stderr says)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 9] = [
        (&["--http-tokens-file", &empty], &[], "holds no token"),
        (
            &["--http-tokens-file", &short],
            &[],
            "line 1: a token is 3 bytes; at least 16",
        ),
        (
            &["--http-tokens-file", &scope],
            &[],
            "line 1: unknown scope \"admin\"",
        ),
        (
            &["--http-token", ""],
            &[],
            "--http-token (KVROUTER_HTTP_TOKEN): a token is empty",
        ),
        (
            &[],
            &[("KVROUTER_HTTP_TOKEN", "")],
            "KVROUTER_HTTP_TOKEN): a token is empty",
        ),
        (
            &[],
            &[
                ("KVROUTER_HTTP_TOKEN", "0123456789abcdef"),
                ("KVROUTER_HTTP_TOKEN_SCOPES", "root"),
            ],
            "unknown scope \"root\"",
        ),
        (
            &[],
            &[("KVROUTER_HTTP_TOKENS_FILE", "")],
            "a value is required for '--http-tokens-file",
        ),
        (
            &["--http-auth-metrics"],
            &[],
            "--http-auth-metrics needs credentials",
        ),
        (
            &["--http-tls-client-scopes", "route"],
            &[],
            "needs --http-tls-client-ca",
        ),
    ];
    for (args, env, want) in cases {
        let mut cmd = common::kvrouter();
        cmd.args(base).args(args).envs(env.iter().copied());
        let out = cmd.output().expect("kvrouter runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} starts");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(
            !stderr.contains(ROUTE_ONLY),
            "a token is never printed: {stderr}"
        );
    }
}

#[test]
fn without_tokens_the_replica_warns_that_its_doors_are_open() {
    let nats = NatsServer::start();
    let admin = free_port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = common::kvrouter();
    let addr = format!("127.0.0.1:{admin}");
    cmd.args([
        "serve",
        "--nats",
        &nats.url(),
        "--model",
        MODEL,
        "--admin-addr",
        &addr,
    ])
    .stderr(std::process::Stdio::from(log.reopen().unwrap()));
    let p = common::spawn_proc("serve", cmd);
    assert!(wait_until(Duration::from_secs(20), || {
        common::http_get(admin, "/healthz").0 == 200
    }));
    // The doors are open as before.
    let anyone = Caller::default();
    assert_eq!(call(&anyone, "GET", admin, "/v1/workers", None).status, 200);
    assert_eq!(call(&anyone, "GET", admin, &rank_page(), None).status, 200);
    p.kill();
    let text = std::fs::read_to_string(log.path()).unwrap();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("unauthenticated"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning: {text}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains(&addr),
        "{text}"
    );
}

#[test]
fn mtls_refuses_clients_without_a_certificate_and_certificates_stand_for_their_scopes() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 1, 1, BLOCK);
    let dir = tempfile::tempdir().unwrap();
    let certs = TestCerts::generate(dir.path()).unwrap();
    let admin = free_port();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (cert, key, ca) = (
        path(&certs.server_cert),
        path(&certs.server_key),
        path(&certs.ca),
    );
    let mut cmd = common::kvrouter();
    let addr = format!("127.0.0.1:{admin}");
    cmd.args([
        "serve",
        "--nats",
        &nats.url(),
        "--model",
        MODEL,
        "--replica-id",
        "a",
    ])
    .args([
        "--admin-addr",
        &addr,
        "--http-tls-client-scopes",
        "route,lease",
    ])
    .env("KVROUTER_HTTP_TLS_CERT", &cert)
    .env("KVROUTER_HTTP_TLS_KEY", &key)
    .env("KVROUTER_HTTP_TLS_CLIENT_CA", &ca)
    .env("KVROUTER_HTTP_TOKEN", DEBUG)
    .env("KVROUTER_HTTP_TOKEN_SCOPES", "debug,metrics");
    let _a = common::spawn_proc("a", cmd);

    let peer = Caller {
        tls: Some(&certs),
        client_cert: Some((&certs.client_cert, &certs.client_key)),
        ..Caller::default()
    };
    assert!(
        wait_until(Duration::from_secs(20), || {
            curl_as(&peer, "GET", admin, "/readyz", None).is_ok_and(|g| g.status == 200)
        }),
        "the replica turns ready, over HTTPS"
    );

    // Without a certificate, with one from another CA, or in plain HTTP: no answer at all.
    let no_cert = Caller {
        tls: Some(&certs),
        ..Caller::default()
    };
    let stranger = Caller {
        tls: Some(&certs),
        client_cert: Some((&certs.stranger_cert, &certs.stranger_key)),
        ..Caller::default()
    };
    for (who, name) in [
        (&no_cert, "no certificate"),
        (&stranger, "another CA's"),
        (&Caller::default(), "plain HTTP"),
    ] {
        let got = curl_as(who, "GET", admin, "/healthz", None);
        assert!(got.is_err(), "{name}: {got:?}");
    }

    // The peer's certificate stands for route and lease.
    let r = call(&peer, "POST", admin, "/v1/route", Some(&routed_prompt(1)));
    assert_eq!(r.status, 200, "{}", r.body);
    let routed = r.json();
    let id = routed["request_id"].as_str().expect("an id").to_string();
    let f = call(
        &peer,
        "POST",
        admin,
        &format!("/v1/requests/{id}/free"),
        Some(&free_body(&routed)),
    );
    assert_eq!(f.status, 200, "{}", f.body);
    assert_eq!(
        call(&peer, "GET", admin, &rank_page(), None).error(),
        (403, "forbidden".into())
    );
    // The on-call's token (on a certified connection) reads the index; the peer's
    // certificate does not lend it route.
    let oncall = Caller {
        token: Some(DEBUG),
        ..peer
    };
    assert_eq!(call(&oncall, "GET", admin, &rank_page(), None).status, 200);
    let p = call(&oncall, "POST", admin, "/v1/route", Some(&routed_prompt(2)));
    assert_eq!(p.error(), (403, "forbidden".into()));

    let metrics = call(&oncall, "GET", admin, "/metrics", None).body;
    let failed =
        kvrouter_testkit::metric_sum_in(&metrics, "kvrouter_http_tls_handshakes_failed_total");
    assert!(failed >= 3.0, "{metrics}");
}
