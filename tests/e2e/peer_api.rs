//! The JSON API for peer routers (docs/protocol.md, "JSON API for peer routers"), end to
//! end: the real binary over a real nats-server, a mocker fleet, and `curl` as the client
//! of every endpoint and error.

use crate::common;

use common::curl::{curl, Answer};
use common::{
    e2e_tokens as tokens, free_port, metric_sum as sum, ready, serve, wait_until, NatsServer,
    E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use serde_json::{json, Value};
use std::time::Duration;

fn post(port: u16, path: &str, body: &Value) -> Answer {
    curl("POST", port, path, Some(body.to_string().as_bytes()))
}

fn route(port: u16, body: Value) -> Answer {
    post(port, "/v1/route", &body)
}

/// A route body for [`MODEL`] with these tokens and extra fields.
fn route_body(tokens: &[u32], extra: Value) -> Value {
    let mut b = json!({ "model": MODEL, "tokens": tokens });
    if let (Some(b), Some(extra)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(extra.clone());
    }
    b
}

const ACTIVE: &str = "kvrouter_worker_active_requests";

/// `kvrouter generate` of `tokens`: the mocker runs it and stores its blocks.
fn generate(nats: &NatsServer, tokens: &[u32]) {
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = common::run(&[
        "generate",
        "--nats",
        &nats.url(),
        "--model",
        MODEL,
        "--tokens",
        &list.join(","),
        "--max-tokens",
        "2",
    ]);
    assert!(out.status.success(), "generate: {out:?}");
}

/// `free` of request `id`, presenting `lease` (the route answer's).
fn free(port: u16, id: &str, replica: Option<&str>, lease: &Value) -> Answer {
    let mut body = json!({ "model": MODEL, "lease": lease });
    if let Some(r) = replica {
        body["replica_id"] = json!(r);
    }
    post(port, &format!("/v1/requests/{id}/free"), &body)
}

const LEASE_REFUSED: &str = "kvrouter_replica_lease_refused_total";

#[test]
fn peer_api_routes_reports_workers_and_refuses_bad_requests_with_their_status() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 2, BLOCK);
    let (admin, api) = (free_port(), free_port());
    let api_addr = format!("127.0.0.1:{api}");
    let _a = serve(
        &nats,
        "a",
        admin,
        &["--http-addr", &api_addr, "--max-prompt-tokens", "256"],
    );
    assert!(ready(admin), "the replica turns ready");

    // A route: every field, a fresh request id, state counted until freed.
    let prompt = tokens(1, 4);
    let r = route(api, route_body(&prompt, json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.contains("content-type: application/json"));
    let d = r.json();
    for field in [
        "worker_id",
        "dp_rank",
        "overlap_blocks",
        "base_url",
        "request_id",
        "replica_id",
        "block_size",
        "lease",
    ] {
        assert!(d.get(field).is_some(), "{field} in {d}");
    }
    let lease = d["lease"].clone();
    assert_eq!(lease.as_str().map(str::len), Some(32), "{d}");
    assert_eq!(d["replica_id"], "a");
    assert_eq!(d["block_size"], BLOCK);
    assert_eq!(d["overlap_blocks"], 0);
    let id = d["request_id"].as_str().expect("a request id").to_string();
    assert!(!id.is_empty());
    assert!(wait_until(Duration::from_secs(3), || sum(admin, ACTIVE) == 1.0));
    // The admin listener serves the API too.
    let w = curl(
        "GET",
        admin,
        &format!("/v1/workers?model={}", MODEL.replace('/', "%2F")),
        None,
    );
    assert_eq!(w.status, 200, "{}", w.body);
    let held = d.clone();
    let w = w.json();
    assert_eq!(w["models"][0]["model"], MODEL);
    assert_eq!(w["models"][0]["block_size"], BLOCK);
    let ranks = w["models"][0]["workers"]
        .as_array()
        .expect("workers")
        .clone();
    assert_eq!(ranks.len(), 4, "2 workers x 2 ranks: {ranks:?}");
    let holder = ranks
        .iter()
        .find(|r| r["worker_id"] == held["worker_id"] && r["dp_rank"] == held["dp_rank"])
        .expect("the chosen rank is listed");
    assert_eq!(holder["active_requests"], 1);
    assert_eq!(holder["prefill_tokens"], prompt.len());
    for r in &ranks {
        assert_eq!(
            (r["live"].as_bool(), r["role"].as_str()),
            (Some(true), Some("aggregated"))
        );
        assert_eq!(
            (r["engine"].as_str(), r["base_url"].as_str()),
            (Some("mocker"), Some(""))
        );
        assert!(
            r["cached_blocks"].is_u64() && r["capacity_blocks"] == 512,
            "{r}"
        );
    }

    // Without the route's lease, or with another, nothing is done: the same answer as an
    // unknown request (a caller without the lease learns nothing), counted.
    let path = format!("/v1/requests/{id}/prefill_done");
    let forged = json!("0123456789abcdef0123456789abcdef");
    for (body, endpoint) in [
        (json!({ "model": MODEL }), "prefill_done"),
        (json!({ "model": MODEL, "lease": forged }), "free"),
        (json!({ "model": MODEL, "lease": forged }), "output_block"),
    ] {
        let p = post(api, &format!("/v1/requests/{id}/{endpoint}"), &body);
        assert_eq!(p.error(), (404, "unknown_request".into()), "{}", p.body);
        assert!(p.message().contains("under this lease"), "{}", p.message());
    }
    let not_hex = post(
        api,
        &path,
        &json!({ "model": MODEL, "lease": "not-a-lease" }),
    );
    assert_eq!(not_hex.error(), (400, "invalid_request".into()));
    assert!(wait_until(Duration::from_secs(3), || sum(
        admin,
        LEASE_REFUSED
    ) == 3.0));
    assert_eq!(sum(admin, ACTIVE), 1.0, "the request is still held");
    assert!(
        sum(admin, "kvrouter_worker_prefill_tokens") > 0.0,
        "its prefill still counts"
    );

    // prefill_done, then free, on this replica with the lease; a second free is unknown.
    let p = post(api, &path, &json!({ "model": MODEL, "lease": lease }));
    assert_eq!((p.status, p.body.as_str()), (200, r#"{"ok":true}"#));
    let f = free(api, &id, Some("a"), &lease);
    assert_eq!(f.status, 200, "{}", f.body);
    assert!(wait_until(Duration::from_secs(3), || sum(admin, ACTIVE) == 0.0));
    assert_eq!(
        free(api, &id, None, &lease).error(),
        (404, "unknown_request".into())
    );
    assert_eq!(
        free(api, "never-routed", None, &lease).error(),
        (404, "unknown_request".into())
    );
    let gone = free(api, &id, Some("nobody"), &lease);
    assert_eq!(gone.error(), (404, "unknown_request".into()));
    assert!(
        gone.message().contains("not on the bus"),
        "{}",
        gone.message()
    );

    // Once the fleet has cached a prompt, its route gains the overlap and the index counts
    // the blocks.
    let cached = tokens(2, 4);
    generate(&nats, &cached);
    assert!(
        wait_until(Duration::from_secs(5), || {
            route(api, route_body(&cached, json!({ "update_states": false }))).json()
                ["overlap_blocks"]
                == 4
        }),
        "the repeated prompt is seen with its overlap"
    );
    let plain = route(api, route_body(&cached, json!({ "update_states": false }))).json();
    assert_eq!(plain["request_id"], Value::Null, "no state, no id made up");
    let w = curl("GET", api, "/v1/workers", None).json();
    let total: u64 = (w["models"][0]["workers"].as_array().unwrap().iter())
        .map(|r| r["cached_blocks"].as_u64().unwrap_or(0))
        .sum();
    assert!(total >= 4, "cached blocks counted: {w}");

    // Pins, exclusions and overrides.
    let no_state = |extra: Value| {
        let mut e = extra;
        e["update_states"] = json!(false);
        route(api, route_body(&cached, e))
    };
    let p = no_state(json!({ "pin": "101:1" })).json();
    assert_eq!(
        (p["worker_id"].as_u64(), p["dp_rank"].as_u64()),
        (Some(101), Some(1)),
        "{p}"
    );
    let p = no_state(json!({ "pin": "101" })).json();
    assert_eq!(p["worker_id"], 101, "{p}");
    let holder = plain["worker_id"].as_u64().unwrap();
    let other = if holder == 100 { 101 } else { 100 };
    let x = no_state(json!({ "excluded_workers": [holder] })).json();
    assert_eq!(
        (x["worker_id"].as_u64(), x["overlap_blocks"].as_u64()),
        (Some(other), Some(0))
    );
    let x = no_state(json!({ "allowed_workers": [other] })).json();
    assert_eq!(x["worker_id"].as_u64(), Some(other));
    let o = no_state(json!({ "kvrouter": { "overlap_credit": 2.0, "temperature": 0 } }));
    assert_eq!(o.status, 200, "{}", o.body);
    let o = no_state(json!({ "cache_salt": "s1", "request_id": "salted" })).json();
    assert_eq!(
        (o["overlap_blocks"].as_u64(), o["request_id"].as_str()),
        (Some(0), Some("salted"))
    );

    // Refusals, each with its kind and status.
    let bad = no_state(json!({ "kvrouter": { "temperature": -1 } }));
    assert_eq!(bad.error(), (400, "invalid_request".into()));
    assert!(
        bad.message().contains("kvrouter.temperature"),
        "{}",
        bad.message()
    );
    let bad = no_state(json!({ "bogus": 1 }));
    assert_eq!(bad.error(), (400, "invalid_request".into()));
    assert!(
        bad.message().contains("unknown field `bogus`"),
        "{}",
        bad.message()
    );
    let raw = |body: &[u8]| curl("POST", api, "/v1/route", Some(body));
    assert_eq!(raw(b"{\"model\":").error(), (400, "malformed".into()));
    assert_eq!(raw(b"[1,2]").error(), (400, "malformed".into()));
    assert_eq!(raw(b"{\"model\":\"\xff\",\"tokens\":[1]}").status, 400);
    let missing = route(api, json!({ "tokens": [1, 2] }));
    assert_eq!(missing.error(), (400, "invalid_request".into()));
    assert!(
        missing.message().contains("missing field `model`"),
        "{}",
        missing.message()
    );
    for tokens in [
        json!([-1]),
        json!([4294967296u64]),
        json!(["1"]),
        json!([1e30]),
    ] {
        let b = route(api, json!({ "model": MODEL, "tokens": tokens }));
        assert_eq!(b.error(), (400, "invalid_request".into()), "{tokens}");
    }
    let unknown = route(api, json!({ "model": "nope", "tokens": [1] }));
    assert_eq!(unknown.error(), (404, "unknown_model".into()));
    assert_eq!(
        route(api, route_body(&[], json!({}))).error(),
        (400, "empty_prompt".into())
    );
    let long = route(api, route_body(&tokens(3, 17), json!({}))); // 272 > 256
    assert_eq!(long.error(), (400, "prompt_too_long".into()));
    assert_eq!(
        no_state(json!({ "pin": "7:x" })).error(),
        (400, "invalid_request".into())
    );
    assert_eq!(
        no_state(json!({ "pin": "999" })).error(),
        (400, "unknown_worker".into())
    );
    assert_eq!(
        no_state(json!({ "pin": "100:9" })).error(),
        (400, "invalid_rank".into())
    );
    assert_eq!(
        no_state(json!({ "allowed_workers": [999] })).error(),
        (409, "no_allowed_workers".into())
    );
    // A caller may choose its lease.
    let mine = json!("00000000000000000000000000c0ffee");
    let twice = route(
        api,
        route_body(&cached, json!({ "request_id": "dup", "lease": mine })),
    );
    assert_eq!(twice.status, 200, "{}", twice.body);
    assert_eq!(twice.json()["lease"], mine);
    assert_eq!(
        route(api, route_body(&cached, json!({ "request_id": "dup" }))).error(),
        (409, "duplicate_request".into())
    );
    assert_eq!(free(api, "dup", None, &mine).status, 200);
    // The body limit: 256 tokens x 11 bytes + 64 KiB.
    let limit = 256 * 11 + 64 * 1024;
    let huge = format!(
        "{{\"model\":\"{MODEL}\",\"tokens\":[{}1]}}",
        "1,".repeat(limit / 2)
    );
    let big = raw(huge.as_bytes());
    assert_eq!(big.error(), (413, "invalid_request".into()));
    assert!(
        big.message().contains(&format!("over {limit} bytes")),
        "{}",
        big.message()
    );
    // Updates need a model; paths and methods that are no endpoint.
    let u = post(api, "/v1/requests/x/free", &json!({}));
    assert_eq!(u.error(), (400, "invalid_request".into()));
    assert!(
        u.message().contains("missing field `model`"),
        "{}",
        u.message()
    );
    let u = post(
        api,
        "/v1/requests/x/free",
        &json!({ "model": MODEL, "replica_id": "a.b" }),
    );
    assert_eq!(u.error(), (400, "invalid_request".into()));
    assert_eq!(
        curl("GET", api, "/v1/route", None).error(),
        (405, "invalid_request".into())
    );
    assert_eq!(curl("POST", api, "/v1/nothing", Some(b"{}")).status, 404);
    assert_eq!(
        curl("GET", api, "/v1/workers?model=nope", None).error(),
        (404, "unknown_model".into())
    );
    // The separate listener shows the admin pages too.
    assert_eq!(curl("GET", api, "/healthz", None).status, 200);
    assert_eq!(sum(admin, ACTIVE), 0.0, "every routed request was freed");
}

#[test]
fn peer_api_forwards_updates_sheds_load_and_expires_leases() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 2, BLOCK);
    let (pa, pb) = (free_port(), free_port());
    let _a = serve(&nats, "a", pa, &[]);
    // b: a rank with any prefill in flight is busy, nothing waits, leases of 1 s.
    let _b = serve(
        &nats,
        "b",
        pb,
        &[
            "--busy-prefill-tokens",
            "1",
            "--max-queued-requests",
            "0",
            "--request-timeout-secs",
            "1",
        ],
    );
    assert!(ready(pa) && ready(pb), "replicas turn ready");

    // Routed on a, reported done through b (a Service may pick either): b forwards to a.
    let r = route(
        pa,
        route_body(
            &tokens(1, 2),
            json!({ "request_id": "fwd", "expected_output_tokens": BLOCK, "priority_jump": 1.5 }),
        ),
    )
    .json();
    assert_eq!(r["replica_id"], "a");
    let lease = r["lease"].clone();
    assert!(wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 1.0));
    // The expected output is one block of decode load; two generated blocks reported
    // through b (forwarded to a) make it two.
    let blocks = |port| sum(port, "kvrouter_worker_active_blocks");
    assert!(wait_until(Duration::from_secs(3), || blocks(pa) == 3.0));
    for _ in 0..2 {
        let o = post(
            pb,
            "/v1/requests/fwd/output_block",
            &json!({ "model": MODEL, "replica_id": "a", "lease": lease }),
        );
        assert_eq!((o.status, o.body.as_str()), (200, r#"{"ok":true}"#));
    }
    assert!(
        wait_until(Duration::from_secs(3), || blocks(pa) == 4.0),
        "a counts the output: {}",
        blocks(pa)
    );
    let bad = post(
        pa,
        "/v1/requests/fwd/output_block",
        &json!({ "model": MODEL, "decay_fraction": 2 }),
    );
    assert_eq!(bad.error(), (400, "invalid_request".into()), "{}", bad.body);
    let misplaced = post(
        pa,
        "/v1/requests/fwd/free",
        &json!({ "model": MODEL, "decay_fraction": 0.5 }),
    );
    assert_eq!(misplaced.error(), (400, "invalid_request".into()));
    let path = "/v1/requests/fwd/prefill_done";
    // Forwarded without the lease: a refuses it, and b answers what a answered.
    let p = post(pb, path, &json!({ "model": MODEL, "replica_id": "a" }));
    assert_eq!(p.error(), (404, "unknown_request".into()), "{}", p.body);
    assert!(wait_until(Duration::from_secs(3), || sum(
        pa,
        LEASE_REFUSED
    ) == 1.0));
    let p = post(
        pb,
        path,
        &json!({ "model": MODEL, "replica_id": "a", "lease": lease }),
    );
    assert_eq!(p.status, 200, "{}", p.body);
    assert!(wait_until(Duration::from_secs(3), || sum(
        pa,
        "kvrouter_worker_prefill_tokens"
    ) == 0.0));
    let f = free(pb, "fwd", Some("a"), &lease);
    assert_eq!(f.status, 200, "{}", f.body);
    assert!(
        wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 0.0),
        "a's request is freed: {}",
        sum(pa, ACTIVE)
    );
    // a answers the forwarded free of an id it does not know.
    let again = free(pb, "fwd", Some("a"), &lease);
    assert_eq!(again.error(), (404, "unknown_request".into()));
    assert!(again.message().contains("replica a"), "{}", again.message());

    // Overload: every rank of worker 100 holds a prefill, so a pinned request has nowhere
    // to go and no queue to wait in.
    for rank in 0..2 {
        let pin = format!("100:{rank}");
        let ok = route(pb, route_body(&tokens(10 + rank, 1), json!({ "pin": pin })));
        assert_eq!(ok.status, 200, "{}", ok.body);
    }
    let shed = route(pb, route_body(&tokens(20, 1), json!({ "pin": "100" })));
    assert_eq!(shed.error(), (503, "overloaded".into()), "{}", shed.body);
    assert!(shed.headers.contains("retry-after: 1"), "{}", shed.headers);

    // Never freed: the lease (1 s, swept every 0.5 s) gives the load back.
    // (The workers view asks the scheduler; the metric follows every 0.5 s.)
    let active = || -> u64 {
        let w = curl("GET", pb, "/v1/workers", None).json();
        (w["models"][0]["workers"].as_array().unwrap().iter())
            .map(|r| r["active_requests"].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(active(), 2);
    assert!(
        wait_until(Duration::from_secs(4), || active() == 0
            && sum(pb, ACTIVE) == 0.0),
        "leases expire: {} active",
        sum(pb, ACTIVE)
    );
    let after = route(
        pb,
        route_body(
            &tokens(21, 1),
            json!({ "pin": "100", "update_states": false }),
        ),
    );
    assert_eq!(after.status, 200, "{}", after.body);
}

/// Hostile sizes through the real JSON API (issue 26): an oversize request id, a 200,000-entry
/// `allowed_workers` and a 500 KB model name each get a clear 400 naming the field and the
/// limit; numeric hints are clamped, not refused; routes for ever new unknown model names
/// leave `/metrics` the size it was.
#[test]
fn peer_api_refuses_oversize_inputs_and_keeps_metrics_bounded() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 1, BLOCK);
    let admin = free_port();
    let _a = serve(&nats, "a", admin, &[]);
    assert!(ready(admin), "the replica turns ready");
    let prompt = tokens(1, 2);
    let refused = |a: Answer, field: &str, limit: &str| {
        assert_eq!(
            a.error(),
            (400, "invalid_request".into()),
            "{field}: {}",
            a.body
        );
        let m = a.message();
        assert!(m.contains(field) && m.contains(limit), "{field}: {m}");
        assert!(m.len() < 300, "the input is not echoed: {} bytes", m.len());
    };
    // One refusal of each kind first, so their series exist.
    let unknown = |i: usize, pin: bool| {
        let mut body = json!({
            "model": format!("{i:06}-{}", "u".repeat(200)),
            "tokens": prompt,
        });
        if pin {
            body["pin"] = json!("not-a-pin");
        }
        route(admin, body)
    };
    assert_eq!(unknown(0, false).error(), (404, "unknown_model".into()));
    assert_eq!(unknown(0, true).error(), (400, "invalid_request".into()));
    // Hints past what makes sense are clamped: the route goes through.
    let hinted = route(
        admin,
        route_body(
            &prompt,
            json!({ "update_states": false, "priority_jump": 1e308,
                    "expected_output_tokens": 4294967295u64 }),
        ),
    );
    assert_eq!(hinted.status, 200, "{}", hinted.body);
    refused(
        route(
            admin,
            route_body(&prompt, json!({ "request_id": "i".repeat(257) })),
        ),
        "request_id",
        "256",
    );

    let id = "i".repeat(900 * 1024);
    refused(
        route(admin, route_body(&prompt, json!({ "request_id": id }))),
        "request_id",
        "256",
    );
    let many: Vec<u64> = (0..200_000).map(|i| 100 + i % 2).collect();
    refused(
        route(
            admin,
            route_body(&prompt, json!({ "allowed_workers": many })),
        ),
        "allowed_workers",
        "4096",
    );
    let model = "m".repeat(500 * 1024);
    for extra in [json!({}), json!({ "pin": "nope" })] {
        let mut body = json!({ "model": model, "tokens": prompt });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        refused(route(admin, body), "model", "256");
    }
    let long_id = "r".repeat(300);
    refused(
        post(
            admin,
            &format!("/v1/requests/{long_id}/free"),
            &json!({ "model": MODEL }),
        ),
        "request_id",
        "256",
    );
    // Ever new model names, with and without a bad pin: no new series. (Other series
    // appear as workers report their load, so the error series are compared.)
    let errors = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("kvrouter_route_errors_total{"))
            .map(|l| l.rsplit_once(' ').unwrap().0.to_string())
            .collect()
    };
    let before = errors(&common::metrics(admin));
    for i in 1..=20 {
        assert_eq!(unknown(i, false).error(), (404, "unknown_model".into()));
        assert_eq!(unknown(i, true).error(), (400, "invalid_request".into()));
    }
    let text = common::metrics(admin);
    assert_eq!(errors(&text), before, "no new error series");
    let mut models: Vec<&str> = text
        .split("model=\"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(m, _)| m))
        .collect();
    models.sort_unstable();
    models.dedup();
    assert_eq!(models, ["", MODEL, "_other"], "the only model labels");
    assert!(text.len() < 64 * 1024, "/metrics is {} bytes", text.len());
    assert!(
        !text.contains("uuuuuuuu") && !text.contains("mmmmmmmm"),
        "no name is a label"
    );
    assert!(
        text.contains(r#"kvrouter_route_errors_total{model="_other",kind="unknown_model"} 21"#),
        "{text}"
    );
}
