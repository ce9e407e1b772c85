//! deploy/kubernetes/overlays/gateway: the base behind a Gateway API implementation with the
//! Inference Extension, kvrouter's endpoint picker (`kvrouter epp`) choosing the engine pod.
//!
//! The overlay is rendered offline with `kubectl kustomize`; its Kubernetes objects are
//! validated with kubernetes-validate (strict) as the base's are, and its custom resources
//! (InferencePool, HTTPRoute) against the CRD schemas kept in deploy/kubernetes/schemas with
//! python3's `jsonschema`, strictly (a field the schema does not name fails). Then what no
//! schema sees: the pool selects the engine pods on the port their bridges register, names the
//! picker's Service on the port the picker listens on, the route sends the completion paths to
//! the pool, the picker's probes, grace period, identity, tokenizer, TLS and NetworkPolicies;
//! and the picker started from its rendered settings answers the kubelet's gRPC probes as they
//! are written, serves ext_proc over TLS and stops within its grace period.
//!
//! The base's tests (k8s_manifests.rs, k8s_locked.rs) iterate over every overlay, this one
//! included: kubernetes-validate of every object, `KVROUTER_*` variables that are flags of the
//! subcommand, non-root containers, labels, Services and budgets selecting one workload.

use crate::common::*;
use crate::k8s_locked::{
    admitted, NatsLayout, Source, REPLICAS_SECRET, SEED_KEY, USERS_KEY, USERS_SECRET,
};
use crate::k8s_manifests::{
    all_containers, args_of, container, container_port, drain_secs, every, host_port, image_name,
    kvrouter_with_env, list, pod_labels, pod_spec, port_in, probe_ok, run_tool, selects, short,
    stdout_of, text, yaml_doc, yaml_docs, Manifests,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const GATEWAY: &str = "deploy/kubernetes/overlays/gateway";
const SCHEMAS: &str = "deploy/kubernetes/schemas";
const POOL_GROUP: &str = "inference.networking.k8s.io";
const ROUTE_GROUP: &str = "gateway.networking.k8s.io";
/// The Secret `kvrouter creds --epps 1` writes for the picker's identity epp-0.
const EPP_SECRET: &str = "kvrouter-nats-epp-0";

/// The gateway overlay, rendered once with the base and the other overlays (so the base's
/// tests, which iterate over `every()`, check it too).
fn gateway() -> &'static Manifests {
    every()
        .iter()
        .find(|m| m.dir == GATEWAY)
        .unwrap_or_else(|| panic!("{GATEWAY} is not among the overlays the manifest tests render"))
}

/// The one object of a custom kind.
fn custom_object<'a>(m: &'a Manifests, kind: &str) -> &'a Value {
    let found: Vec<&Value> = m.of_kind(kind).collect();
    assert_eq!(found.len(), 1, "{}: one {kind}", m.dir);
    found[0]
}

fn inference_pool(m: &Manifests) -> &Value {
    custom_object(m, "InferencePool")
}

fn http_route(m: &Manifests) -> &Value {
    custom_object(m, "HTTPRoute")
}

/// The picker's workload and container.
fn epp(m: &Manifests) -> (&Value, &Value) {
    m.kvrouter("epp")
}

/// Whether an object is one of the custom resources (not Kubernetes' own kinds).
pub(crate) fn custom(d: &Value) -> bool {
    let api = d["apiVersion"].as_str().unwrap_or("");
    api.starts_with(&format!("{POOL_GROUP}/")) || api.starts_with(&format!("{ROUTE_GROUP}/"))
}

/// A CRD file of deploy/kubernetes/schemas: the `openAPIV3Schema` of its version `version`.
fn crd_schema(file: &str, version: &str) -> Value {
    let crd = yaml_doc(&std::fs::read_to_string(repo_file(&format!("{SCHEMAS}/{file}"))).unwrap());
    assert_eq!(crd["kind"], "CustomResourceDefinition", "{file}");
    list(&crd, "/spec/versions")
        .iter()
        .find(|v| v["name"] == version)
        .and_then(|v| v.pointer("/schema/openAPIV3Schema"))
        .unwrap_or_else(|| panic!("{file} has no {version} openAPIV3Schema"))
        .clone()
}

/// The schema of a custom object's kind and version, with the CRD's group checked.
fn schema_for(d: &Value) -> Value {
    let (file, group) = match text(d, "/kind") {
        "InferencePool" => (
            "inference.networking.k8s.io_inferencepools.yaml",
            POOL_GROUP,
        ),
        "HTTPRoute" => ("gateway.networking.k8s.io_httproutes.yaml", ROUTE_GROUP),
        other => panic!("no schema kept for {other}"),
    };
    let (g, version) = text(d, "/apiVersion").split_once('/').unwrap();
    assert_eq!(g, group, "{}", short(d));
    crd_schema(file, version)
}

/// Validates `object` against `schema` with python3's `jsonschema` (Draft 4, the dialect
/// OpenAPI v3 schemas are drawn from), then walks it: a field that the schema does not name (no
/// `properties` entry, no `additionalProperties` schema) is an error, as the API server's
/// strict field validation refuses it. `metadata` is checked as ObjectMeta. Returns the errors.
fn schema_errors(schema: &Value, object: &Value) -> Vec<String> {
    const SCRIPT: &str = r#"
import json, sys
import jsonschema
d = json.load(sys.stdin)
schema, obj = d["schema"], d["object"]
jsonschema.Draft4Validator.check_schema(schema)
errors = ["/" + "/".join(map(str, e.absolute_path)) + ": " + e.message
          for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]
META = {"name", "namespace", "labels", "annotations"}
def walk(s, v, path):
    at = "/" + "/".join(map(str, path))
    if path == ["metadata"]:
        for k, x in v.items():
            if k not in META:
                errors.append(f"{at}/{k}: not an ObjectMeta field this check knows")
            elif k in ("labels", "annotations") and not all(isinstance(y, str) for y in x.values()):
                errors.append(f"{at}/{k}: values must be strings")
        return
    if isinstance(v, dict):
        if s.get("x-kubernetes-preserve-unknown-fields"):
            return
        props = s.get("properties") or {}
        extra = s.get("additionalProperties")
        for k, x in v.items():
            if k in props:
                walk(props[k], x, path + [k])
            elif isinstance(extra, dict):
                walk(extra, x, path + [k])
            else:
                errors.append(f"{at}/{k}: unknown field (the schema names {sorted(props)})")
    elif isinstance(v, list) and isinstance(s.get("items"), dict):
        for i, x in enumerate(v):
            walk(s["items"], x, path + [i])
walk(schema, obj, [])
print(json.dumps(errors))
"#;
    let input = json!({ "schema": schema, "object": object }).to_string();
    let out = run_tool(
        "python3",
        &["-c", SCRIPT],
        Some(&input),
        "python3 jsonschema",
    );
    let text = stdout_of(
        &out,
        "python3 with jsonschema (kubernetes-validate installs it)",
    );
    serde_json::from_str(&text).expect("a JSON list of errors")
}

/// A copy of `v` with `value` set at the JSON pointer `ptr` (its parent must exist).
fn with(v: &Value, ptr: &str, value: Value) -> Value {
    let mut v = v.clone();
    let (parent, key) = ptr.rsplit_once('/').unwrap();
    match v.pointer_mut(parent).expect("the parent exists") {
        Value::Object(o) => {
            o.insert(key.to_string(), value);
        }
        Value::Array(a) => a[key.parse::<usize>().unwrap()] = value,
        other => panic!("{parent} is {other}"),
    }
    v
}

/// The picker's settings as its container starts with them.
fn epp_env(m: &Manifests) -> BTreeMap<String, String> {
    m.env(epp(m).1)
}

/// The port a Service port's targetPort resolves to in `c` (by name or number).
fn target_of(c: &Value, svc_port: &Value) -> u16 {
    container_port(c, &svc_port["targetPort"])
}

// ---------------------------------------------------------------------------------------------
// Schemas

#[test]
fn gateway_overlay_validates_against_the_kubernetes_and_the_crd_schemas() {
    let m = gateway();
    // Kubernetes' own kinds are validated with kubernetes-validate, strict, by
    // k8s_manifests' base_and_overlay_validate_against_the_kubernetes_schemas, which renders
    // every overlay, this one included.
    // The custom resources: one InferencePool and one HTTPRoute, nothing else, each valid
    // against its CRD's schema with no field the schema does not name.
    let kinds: Vec<&str> = m
        .docs
        .iter()
        .filter(|d| custom(d))
        .map(|d| text(d, "/kind"))
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    for d in [inference_pool(m), http_route(m)] {
        assert_eq!(
            text(d, "/apiVersion").rsplit('/').next(),
            Some("v1"),
            "{}",
            short(d)
        );
        let errors = schema_errors(&schema_for(d), d);
        assert!(errors.is_empty(), "{}: {errors:#?}", short(d));
    }
}

/// The check above is not vacuous: an unknown field, a pre-v1 field name and a value out of
/// range each fail it.
#[test]
fn the_crd_check_refuses_unknown_fields_and_bad_values() {
    let m = gateway();
    let (p, r) = (inference_pool(m), http_route(m));
    let cases = [
        (
            "a field HTTPRoute does not have",
            with(r, "/spec/rules/0/bogus", json!(1)),
            r,
        ),
        (
            "the pre-v1 endpoint picker field",
            with(p, "/spec/endpointPickerRef/portNumber", json!(9002)),
            p,
        ),
        (
            "the pre-v1 pool port field",
            with(p, "/spec/targetPortNumber", json!(8000)),
            p,
        ),
        (
            "a port out of range",
            with(p, "/spec/targetPorts/0", json!({ "number": 70000 })),
            p,
        ),
        (
            "an unknown failure mode",
            with(
                p,
                "/spec/endpointPickerRef/failureMode",
                json!("FailSometimes"),
            ),
            p,
        ),
        (
            "a path match type that does not exist",
            with(r, "/spec/rules/0/matches/0/path/type", json!("Glob")),
            r,
        ),
        (
            "an unknown metadata field",
            with(r, "/metadata/owner", json!("me")),
            r,
        ),
    ];
    for (what, bad, good) in cases {
        let errors = schema_errors(&schema_for(good), &bad);
        assert!(!errors.is_empty(), "{what} passed the schema check");
    }
}

// ---------------------------------------------------------------------------------------------
// The pool, the picker and the route

#[test]
fn the_pool_selects_exactly_the_vllm_engine_pods() {
    let m = gateway();
    let p = inference_pool(m);
    let selector = &p["spec"]["selector"]["matchLabels"];
    let chosen: Vec<&Value> = m
        .workloads()
        .filter(|w| selects(selector, pod_labels(w)))
        .collect();
    assert_eq!(
        chosen.len(),
        1,
        "the pool selects {:?}",
        chosen.iter().map(|w| short(w)).collect::<Vec<_>>()
    );
    let w = chosen[0];
    assert!(
        all_containers(w).any(|c| image_name(text(c, "/image")) == "vllm-openai"),
        "the pool selects {}, which runs no vLLM",
        short(w)
    );
    // Those pods are the ones whose bridges register the engines.
    let (bw, _) = m.kvrouter("bridge");
    assert_eq!(w, bw, "the pool's pods are not the bridges' pods");
}

#[test]
fn the_pool_targets_the_port_of_the_base_url_the_bridge_registers() {
    let m = gateway();
    let p = inference_pool(m);
    let ports: Vec<i64> = list(p, "/spec/targetPorts")
        .iter()
        .map(|t| t["number"].as_i64().unwrap())
        .collect();
    let (w, bridge) = m.kvrouter("bridge");
    let env = m.env(bridge);
    // The picker maps the gateway's `ip:port` endpoints to workers by the `ip:port` of the
    // base URL each bridge registers: the pod IP, and the pool's target port.
    let (host, port) = host_port(&env["KVROUTER_BASE_URL"]);
    assert_eq!(
        host, "10.1.2.3",
        "the base URL is not the pod IP (status.podIP)"
    );
    assert_eq!(
        ports,
        [i64::from(port)],
        "the pool targets {ports:?}, the bridges register port {port}"
    );
    // And vLLM listens there.
    let engine = all_containers(w)
        .find(|c| image_name(text(c, "/image")) == "vllm-openai")
        .unwrap();
    assert!(
        list(engine, "/ports")
            .iter()
            .any(|cp| cp["containerPort"] == i64::from(port)),
        "vLLM declares no port {port}"
    );
}

#[test]
fn the_endpoint_picker_ref_names_the_picker_service_on_its_ext_proc_port() {
    let m = gateway();
    let r = &inference_pool(m)["spec"]["endpointPickerRef"];
    assert!(
        r["group"].as_str().unwrap_or("").is_empty(),
        "the core group (a Service): {r}"
    );
    assert_eq!(r["kind"].as_str().unwrap_or("Service"), "Service", "{r}");
    // Fail closed: the picker checks keys and limits and books the load; a gateway failing
    // open would send unchecked, unbooked requests to engines of its own choosing.
    assert_eq!(r["failureMode"], "FailClose", "{r}");
    let svc = m.get("Service", text(r, "/name"));
    let (w, c) = epp(m);
    let picked: Vec<&Value> = m
        .workloads()
        .filter(|o| selects(&svc["spec"]["selector"], pod_labels(o)))
        .collect();
    assert_eq!(picked, [w], "{} selects the pickers alone", short(svc));
    let env = epp_env(m);
    let number = r.pointer("/port/number").and_then(Value::as_i64);
    let port = list(svc, "/spec/ports")
        .iter()
        .find(|p| p["port"].as_i64() == number)
        .unwrap_or_else(|| panic!("{} has no port {number:?}", short(svc)));
    let (_, listen) = host_port(&env["KVROUTER_EPP_LISTEN"]);
    assert_eq!(
        target_of(c, port),
        listen,
        "the gateway's ext_proc port targets another port than KVROUTER_EPP_LISTEN"
    );
    // The Service's other ports: the gRPC health service and the admin port, where the
    // settings open them.
    let (_, health) = host_port(&env["KVROUTER_EPP_HEALTH_LISTEN"]);
    let (_, admin) = host_port(&env["KVROUTER_ADMIN_ADDR"]);
    let targets: BTreeSet<u16> = list(svc, "/spec/ports")
        .iter()
        .map(|p| target_of(c, p))
        .collect();
    assert_eq!(
        targets,
        BTreeSet::from([listen, health, admin]),
        "{}",
        short(svc)
    );
    let numbers: BTreeSet<i64> = list(svc, "/spec/ports")
        .iter()
        .map(|p| p["port"].as_i64().unwrap())
        .collect();
    assert_eq!(
        numbers,
        BTreeSet::from([9002, 9003, 9090]),
        "the Inference Extension's conventional ports"
    );
}

#[test]
fn the_route_sends_the_completion_paths_of_a_gateway_to_the_pool() {
    let m = gateway();
    let r = http_route(m);
    let p = inference_pool(m);
    let parents = list(r, "/spec/parentRefs");
    assert!(!parents.is_empty(), "no parentRefs");
    for parent in parents {
        assert_eq!(
            parent["group"].as_str().unwrap_or(ROUTE_GROUP),
            ROUTE_GROUP,
            "{parent}"
        );
        assert_eq!(
            parent["kind"].as_str().unwrap_or("Gateway"),
            "Gateway",
            "{parent}"
        );
        assert!(parent["name"].is_string(), "{parent}");
    }
    let mut paths = BTreeSet::new();
    for rule in list(r, "/spec/rules") {
        let backends = list(rule, "/backendRefs");
        assert_eq!(backends.len(), 1, "{rule}");
        let b = &backends[0];
        assert_eq!(b["group"], POOL_GROUP, "{b}");
        assert_eq!(b["kind"], "InferencePool", "{b}");
        assert_eq!(
            b["name"], p["metadata"]["name"],
            "the route's pool is not the overlay's"
        );
        assert!(
            b["namespace"].is_null() || b["namespace"] == p["metadata"]["namespace"],
            "{b}"
        );
        for mm in list(rule, "/matches") {
            assert_eq!(mm["path"]["type"], "Exact", "{mm}");
            paths.insert(text(mm, "/path/value").to_string());
        }
    }
    assert_eq!(
        paths,
        BTreeSet::from([
            "/v1/chat/completions".to_string(),
            "/v1/completions".to_string()
        ]),
        "the OpenAI paths the picker understands"
    );
}

#[test]
fn the_picker_probes_the_ports_it_opens_and_outlives_its_drain() {
    let m = gateway();
    let (w, c) = epp(m);
    let env = epp_env(m);
    let (_, health) = host_port(&env["KVROUTER_EPP_HEALTH_LISTEN"]);
    let declared: BTreeSet<u16> = list(c, "/ports")
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap() as u16)
        .collect();
    for key in [
        "KVROUTER_EPP_LISTEN",
        "KVROUTER_EPP_HEALTH_LISTEN",
        "KVROUTER_ADMIN_ADDR",
    ] {
        let (_, port) = host_port(&env[key]);
        assert!(
            declared.contains(&port),
            "{key} opens {port}, not declared: {declared:?}"
        );
    }
    for (probe, service) in [
        ("readinessProbe", "readiness"),
        ("livenessProbe", "liveness"),
    ] {
        let grpc = c
            .pointer(&format!("/{probe}/grpc"))
            .unwrap_or_else(|| panic!("{probe}: not a gRPC probe"));
        assert_eq!(
            grpc["port"].as_u64(),
            Some(u64::from(health)),
            "{probe} asks another port than KVROUTER_EPP_HEALTH_LISTEN"
        );
        assert_eq!(grpc["service"], service, "{probe}");
    }
    let sleep = c
        .pointer("/lifecycle/preStop/sleep/seconds")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let grace = w
        .pointer("/spec/template/spec/terminationGracePeriodSeconds")
        .and_then(Value::as_i64)
        .expect("a grace period");
    let drain = drain_secs(&env, "the picker");
    assert!(
        grace > sleep + drain,
        "grace {grace} s <= preStop {sleep} s + drain {drain} s"
    );
}

#[test]
fn the_picker_settings_are_flags_of_kvrouter_epp_and_serve_ext_proc_over_tls() {
    let m = gateway();
    let (w, c) = epp(m);
    let env = epp_env(m);
    let out = run(&["epp", "--help"]);
    let help = stdout_of(&out, "kvrouter epp --help");
    let twins: BTreeSet<String> = help
        .split("[env: ")
        .skip(1)
        .map(|s| {
            s.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect();
    for key in env.keys().filter(|k| k.starts_with("KVROUTER_")) {
        assert!(twins.contains(key), "{key} is no flag of `kvrouter epp`");
    }
    // TLS on ext_proc, never plaintext, from files of a Secret mounted read-only.
    assert!(
        !matches!(
            env.get("KVROUTER_EPP_PLAINTEXT").map(String::as_str),
            Some("true" | "1")
        ),
        "ext_proc in plaintext"
    );
    for key in ["KVROUTER_EPP_TLS_CERT", "KVROUTER_EPP_TLS_KEY"] {
        let path = env
            .get(key)
            .unwrap_or_else(|| panic!("{key} unset: ext_proc without TLS"));
        let mount = list(c, "/volumeMounts")
            .iter()
            .filter(|v| path.starts_with(&format!("{}/", text(v, "/mountPath"))))
            .max_by_key(|v| text(v, "/mountPath").len())
            .unwrap_or_else(|| panic!("{key}: {path} is on no volume"));
        assert_eq!(mount["readOnly"], true, "{key}");
        let vol = list(pod_spec(w), "/volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let file = &path[text(mount, "/mountPath").len() + 1..];
        assert!(
            list(vol, "/secret/items").iter().any(|i| i["path"] == file),
            "{key}: {file} is no item of the Secret volume {vol}"
        );
        assert!(
            vol["secret"]["optional"] != true,
            "{key}: an optional Secret"
        );
    }
}

#[test]
fn the_picker_holds_its_own_nats_identity_epp_0() {
    let m = gateway();
    let (w, c) = epp(m);
    let env = epp_env(m);
    // The Secret and key `kvrouter creds --epps 1` writes.
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "creds",
        "--out",
        dir.path().to_str().unwrap(),
        "--replica-ids",
        "kvrouter-serve-0",
        "--worker-ids",
        "0",
        "--epps",
        "1",
    ]);
    stdout_of(&out, "kvrouter creds --epps 1");
    let k8s = std::fs::read_to_string(dir.path().join("kubernetes.yaml")).unwrap();
    let written = yaml_docs(&k8s)
        .into_iter()
        .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == EPP_SECRET)
        .unwrap_or_else(|| panic!("kvrouter creds --epps 1 writes no Secret {EPP_SECRET}"));
    assert!(written["stringData"][SEED_KEY].is_string(), "{written}");

    let path = &env["KVROUTER_NATS_NKEY_FILE"];
    let mount = list(c, "/volumeMounts")
        .iter()
        .find(|v| path.starts_with(&format!("{}/", text(v, "/mountPath"))))
        .unwrap_or_else(|| panic!("{path} is on no volume"));
    assert_eq!(mount["readOnly"], true);
    let vol = list(pod_spec(w), "/volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(vol["secret"]["secretName"], EPP_SECRET, "{vol}");
    let items = list(vol, "/secret/items");
    assert_eq!(items.len(), 1, "its own seed alone: {items:?}");
    assert_eq!(items[0]["key"], SEED_KEY);
    assert!(
        path.ends_with(&format!("/{}", text(&items[0], "/path"))),
        "{path}"
    );
    // No other identity's seed anywhere in the pod.
    for v in list(pod_spec(w), "/volumes") {
        if let Some(s) = v.pointer("/secret/secretName").and_then(Value::as_str) {
            assert!(
                !s.starts_with("kvrouter-nats-") || s == EPP_SECRET,
                "the picker's pod mounts {s}"
            );
        }
        assert!(v.get("projected").is_none(), "{v}");
    }
    // On the fleet's bus: the replicas' NATS and namespace.
    let serve = m.env(m.kvrouter("serve").1);
    for key in ["KVROUTER_NATS", "KVROUTER_NAMESPACE"] {
        assert_eq!(env.get(key), serve.get(key), "{key}");
    }
}

#[test]
fn the_picker_fetches_the_tokenizers_as_the_frontend_does_for_the_fleets_models() {
    let m = gateway();
    let (w, c) = epp(m);
    let (fw, _) = m.kvrouter("frontend");
    let (init, front_init) = (
        container(w, "fetch-tokenizer"),
        container(fw, "fetch-tokenizer"),
    );
    for key in [
        "image",
        "command",
        "args",
        "securityContext",
        "volumeMounts",
    ] {
        assert_eq!(
            init[key], front_init[key],
            "fetch-tokenizer's {key} differs from the frontend's"
        );
    }
    let env = m.env(init);
    assert_eq!(
        env["KVROUTER_MODEL_DIRS"],
        epp_env(m)["KVROUTER_MODEL_DIRS"]
    );
    // The models the replicas serve, each fetched at the commit the engines serve.
    let serve = m.env(m.kvrouter("serve").1);
    let bridge = m.env(m.kvrouter("bridge").1);
    let revisions: BTreeMap<&str, &str> = env["MODEL_REVISIONS"]
        .split(',')
        .map(|s| s.split_once('=').expect("NAME=COMMIT"))
        .collect();
    let models: Vec<&str> = env["KVROUTER_MODEL_DIRS"]
        .split(',')
        .map(|s| s.split_once('=').expect("NAME=DIR").0)
        .collect();
    assert_eq!(
        models,
        serve["KVROUTER_MODEL"].split(',').collect::<Vec<_>>()
    );
    assert_eq!(
        revisions.get(bridge["KVROUTER_MODEL"].as_str()).copied(),
        Some(bridge["MODEL_REVISION"].as_str()),
        "the tokenizer's commit is not the engines'"
    );
    // Each directory is on a volume the init container fills and the picker reads.
    for spec in env["KVROUTER_MODEL_DIRS"].split(',') {
        let dir = spec.split_once('=').unwrap().1;
        let on = |c: &Value| {
            list(c, "/volumeMounts")
                .iter()
                .find(|v| dir.starts_with(&format!("{}/", text(v, "/mountPath"))))
                .cloned()
        };
        let (filled, read) = (on(init).expect("fetched"), on(c).expect("read"));
        assert_eq!(filled["name"], read["name"], "{dir}");
        assert!(
            filled["readOnly"] != true && read["readOnly"] == true,
            "{dir}"
        );
    }
}

#[test]
fn the_picker_keeps_two_pods_through_rollouts_and_drains() {
    let m = gateway();
    let (w, _) = epp(m);
    assert!(
        w["spec"]["replicas"].as_i64().unwrap_or(1) >= 2,
        "a single picker (FailClose)"
    );
    assert_eq!(w["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let pdbs: Vec<&Value> = m
        .of_kind("PodDisruptionBudget")
        .filter(|p| selects(&p["spec"]["selector"]["matchLabels"], pod_labels(w)))
        .collect();
    assert_eq!(pdbs.len(), 1, "one PodDisruptionBudget for the pickers");
    assert_eq!(pdbs[0]["spec"]["maxUnavailable"], 1);
    // What the base's containers_run_as_non_root_with_least_privilege asks of every
    // container (it runs on this overlay too), for the picker's pod in particular.
    let spec = pod_spec(w);
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(
        spec["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert!(spec["securityContext"]["runAsUser"].as_i64().unwrap_or(0) > 0);
    for c in all_containers(w) {
        let sc = &c["securityContext"];
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
        assert!(
            list(sc, "/capabilities/drop").iter().any(|d| d == "ALL"),
            "{}",
            c["name"]
        );
        for r in ["requests", "limits"] {
            assert!(
                c["resources"][r]["cpu"].is_string() && c["resources"][r]["memory"].is_string()
            );
        }
    }
}

#[test]
fn the_overlay_pins_the_base_images() {
    let read = |dir: &str| {
        yaml_doc(&std::fs::read_to_string(repo_file(&format!("{dir}/kustomization.yaml"))).unwrap())
    };
    let (base, overlay) = (read("deploy/kubernetes/base"), read(GATEWAY));
    let pins = |k: &Value| -> BTreeMap<String, Value> {
        list(k, "/images")
            .iter()
            .map(|i| (text(i, "/name").to_string(), i.clone()))
            .collect()
    };
    let (b, o) = (pins(&base), pins(&overlay));
    assert!(!o.is_empty());
    for (name, pin) in &o {
        assert_eq!(
            Some(pin),
            b.get(name),
            "the overlay pins {name} otherwise than the base"
        );
    }
    // Every image of the picker's pod is one the overlay pins (its `images:` reach only its
    // own objects, the base's only the base's).
    let (w, _) = epp(gateway());
    for c in all_containers(w) {
        assert!(
            o.contains_key(image_name(text(c, "/image"))),
            "{}",
            c["name"]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// NetworkPolicies, evaluated as the API defines them

fn named_port(w: &Value, name: &str) -> u16 {
    let c = all_containers(w)
        .find(|c| list(c, "/ports").iter().any(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("{}: no port {name}", short(w)));
    container_port(c, &json!(name))
}

#[test]
fn network_policies_admit_the_gateway_to_the_picker_and_engines_and_the_picker_to_nats() {
    let m = gateway();
    let (epp_w, _) = epp(m);
    let nats = m.workload("nats");
    let serve = m.workload("kvrouter-serve");
    let frontend = m.workload("kvrouter-frontend");
    let (engine, _) = m.kvrouter("bridge");
    let pod = |w: &Value| Source {
        what: short(w),
        namespace: None,
        labels: pod_labels(w).clone(),
    };
    // The gateway's proxy as network-policies.yaml expects it: in a namespace labelled for it,
    // with the label its implementation puts on the Gateway's proxies.
    let gateway_labels = json!({"gateway.networking.k8s.io/gateway-name": "inference-gateway"});
    let gateway_ns = json!({
        "kubernetes.io/metadata.name": "gateway-system",
        "kvrouter.io/inference-gateway": "true",
    });
    let gw = Source {
        what: "the gateway's proxy".into(),
        namespace: Some(gateway_ns.clone()),
        labels: gateway_labels.clone(),
    };
    let prom_policy = m.get("NetworkPolicy", "kvrouter-prometheus");
    let prom_peer = &prom_policy["spec"]["ingress"][0]["from"][0];
    let prom = Source {
        what: "Prometheus".into(),
        namespace: Some(prom_peer["namespaceSelector"]["matchLabels"].clone()),
        labels: prom_peer["podSelector"]["matchLabels"].clone(),
    };
    let strangers = [
        Source {
            what: "a stranger pod".into(),
            namespace: None,
            labels: json!({"app": "stranger"}),
        },
        Source {
            what: "a pod calling itself the gateway in an unlabelled namespace".into(),
            namespace: Some(json!({"kubernetes.io/metadata.name": "elsewhere"})),
            labels: gateway_labels.clone(),
        },
        Source {
            what: "another pod of the gateway's namespace".into(),
            namespace: Some(gateway_ns),
            labels: json!({"app": "other"}),
        },
    ];
    let mut all = vec![
        pod(epp_w),
        pod(nats),
        pod(serve),
        pod(frontend),
        pod(engine),
        gw,
        prom,
    ];
    all.extend(strangers);

    let env = epp_env(m);
    let (_, health) = host_port(&env["KVROUTER_EPP_HEALTH_LISTEN"]);
    let (_, ext_proc) = host_port(&env["KVROUTER_EPP_LISTEN"]);
    let (_, admin) = host_port(&env["KVROUTER_ADMIN_ADDR"]);
    let table: Vec<(&Value, u16, &str, Vec<String>)> = vec![
        (
            epp_w,
            ext_proc,
            "the picker's ext_proc",
            vec!["the gateway's proxy".into()],
        ),
        (
            epp_w,
            admin,
            "the picker's admin port",
            vec!["Prometheus".into()],
        ),
        // The kubelet's probes come from the node, which NetworkPolicies always admit.
        (epp_w, health, "the picker's gRPC health", vec![]),
        (
            nats,
            named_port(nats, "client"),
            "NATS clients",
            vec![short(epp_w), short(serve), short(frontend), short(engine)],
        ),
        (
            engine,
            named_port(engine, "http"),
            "vLLM's OpenAI port",
            vec![
                short(frontend),
                "Prometheus".into(),
                "the gateway's proxy".into(),
            ],
        ),
    ];
    for (w, port, what, allowed) in &table {
        for src in &all {
            let want = allowed.contains(&src.what);
            assert_eq!(
                admitted(m, w, *port, src),
                want,
                "{what} ({} port {port}) from {}: {}",
                short(w),
                src.what,
                if want {
                    "refused, but needed"
                } else {
                    "admitted"
                }
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The picker, started from its rendered settings

/// One gRPC health `Check` over cleartext HTTP/2, as the kubelet's gRPC probe asks it: the
/// serving status (1 SERVING, 2 NOT_SERVING), or why there is none (an unknown service name is
/// answered with trailers alone).
fn grpc_health_check(port: u16, service: &str) -> Result<u64, String> {
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }
    // HPACK: literal header fields without indexing, new names, no Huffman coding.
    fn header(block: &mut Vec<u8>, name: &str, value: &str) {
        assert!(name.len() < 127 && value.len() < 127);
        block.push(0);
        block.push(name.len() as u8);
        block.extend(name.as_bytes());
        block.push(value.len() as u8);
        block.extend(value.as_bytes());
    }
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut block = Vec::new();
    for (k, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        header(&mut block, k, v);
    }
    // HealthCheckRequest { service = 1 }.
    let mut msg = Vec::new();
    if !service.is_empty() {
        msg.push(0x0a);
        msg.push(service.len() as u8);
        msg.extend(service.as_bytes());
    }
    let mut data = vec![0];
    data.extend((msg.len() as u32).to_be_bytes());
    data.extend(msg);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out.extend(frame(0x1, 0x4, 1, &block));
    out.extend(frame(0x0, 0x1, 1, &data));
    s.write_all(&out).map_err(|e| e.to_string())?;

    let mut answer = Vec::new();
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head)
            .map_err(|e| format!("reading a frame: {e}"))?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).map_err(|e| e.to_string())?;
        match kind {
            0x4 if flags & 0x1 == 0 => s
                .write_all(&frame(0x4, 0x1, 0, &[]))
                .map_err(|e| e.to_string())?,
            0x6 if flags & 0x1 == 0 => s
                .write_all(&frame(0x6, 0x1, 0, &payload))
                .map_err(|e| e.to_string())?,
            0x0 if stream == 1 => answer.extend(&payload),
            0x3 | 0x7 => return Err(format!("stream reset or connection closed (frame {kind})")),
            _ => {}
        }
        if stream == 1 && (kind == 0x0 || kind == 0x1) && flags & 0x1 != 0 {
            break;
        }
    }
    if answer.len() < 5 {
        return Err(format!(
            "no answer for service {service:?} (trailers alone: not found?)"
        ));
    }
    // HealthCheckResponse { status = 1 (varint) }; an absent field is 0, UNKNOWN.
    let body = &answer[5..];
    match body {
        [0x08, status, ..] => Ok(u64::from(*status)),
        [] => Ok(0),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// `kvrouter epp` as its pod starts it (settings from its ConfigMap and env, its own epp-0
/// seed, ext_proc over TLS from the files its Secret would hold, the tokenizer its init
/// container fetches), beside a replica on NATS as their pods start them, all on loopback:
/// it answers the kubelet's gRPC probes exactly as the manifests ask (ports moved, service
/// names as written), serves ext_proc over TLS with h2, its admin port answers, and it stops
/// within its grace period on SIGTERM.
#[test]
fn the_picker_starts_from_its_rendered_settings_and_answers_its_probes() {
    let m = gateway();
    let (_, sc) = m.kvrouter("serve");
    let (ew, ec) = epp(m);
    let serve_env = m.env(sc);
    let replica_id = serve_env["KVROUTER_REPLICA_ID"].clone();
    let creds = tempfile::tempdir().unwrap();
    let out = run(&[
        "creds",
        "--out",
        creds.path().to_str().unwrap(),
        "--namespace",
        &serve_env["KVROUTER_NAMESPACE"],
        "--replica-ids",
        &replica_id,
        "--worker-ids",
        "0",
        "--epps",
        "1",
    ]);
    stdout_of(&out, "kvrouter creds");
    let k8s = std::fs::read_to_string(creds.path().join("kubernetes.yaml")).unwrap();
    let docs = yaml_docs(&k8s);
    let secret = |name: &str, key: &str| -> String {
        let doc = docs
            .iter()
            .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("kvrouter creds wrote no Secret {name}"));
        doc["stringData"][key]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no {key}"))
            .to_string()
    };
    let seed_file = |name: &str, content: String| -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = creds.path().join(format!("{name}.seed"));
        std::fs::write(&path, content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        path.to_str().unwrap().to_string()
    };
    let layout = NatsLayout::new(m, Some(&secret(USERS_SECRET, USERS_KEY)));
    let (_nats, nats_port) = layout.start();
    let nats_url = format!("nats://127.0.0.1:{nats_port}");

    // The replica the picker routes through (its readiness asks it).
    let serve_admin = free_port();
    let mut cmd = kvrouter_with_env(
        &serve_env,
        &[
            ("KVROUTER_NATS", nats_url.clone()),
            (
                "KVROUTER_NATS_NKEY_FILE",
                seed_file(
                    "serve",
                    secret(REPLICAS_SECRET, &format!("replica-{replica_id}.nk")),
                ),
            ),
            ("KVROUTER_ADMIN_ADDR", format!("127.0.0.1:{serve_admin}")),
            ("KVROUTER_HTTP_ADDR", format!("127.0.0.1:{}", free_port())),
        ],
    );
    cmd.args(args_of(sc));
    let _serve = spawn_proc("kvrouter serve", cmd);
    probe_ok(serve_admin, "/readyz", "the replica");

    // The picker: the tokenizer as fetch-tokenizer leaves it (the same script as the
    // frontend's, which k8s_manifests.rs runs), the Secret's certificate and key.
    let env = epp_env(m);
    let model_dir = model_dir();
    let models: Vec<String> = env["KVROUTER_MODEL_DIRS"]
        .split(',')
        .map(|s| {
            format!(
                "{}={}",
                s.split_once('=').unwrap().0,
                model_dir.path().display()
            )
        })
        .collect();
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = kvrouter_testkit::TestCerts::generate(certs_dir.path())
        .expect("openssl makes certificates");
    let mut cmd = kvrouter_with_env(
        &env,
        &[
            ("KVROUTER_NATS", nats_url),
            (
                "KVROUTER_NATS_NKEY_FILE",
                seed_file("epp", secret(EPP_SECRET, SEED_KEY)),
            ),
            ("KVROUTER_MODEL_DIRS", models.join(",")),
            ("KVROUTER_EPP_LISTEN", "127.0.0.1:0".into()),
            ("KVROUTER_EPP_HEALTH_LISTEN", "127.0.0.1:0".into()),
            ("KVROUTER_ADMIN_ADDR", "127.0.0.1:0".into()),
            (
                "KVROUTER_EPP_TLS_CERT",
                certs.server_cert.display().to_string(),
            ),
            (
                "KVROUTER_EPP_TLS_KEY",
                certs.server_key.display().to_string(),
            ),
        ],
    );
    cmd.args(args_of(ec));
    let mut picker = spawn_proc("kvrouter epp", cmd);
    let line = picker.first_json();
    let (listen, health, admin) = (
        port_in(&line, "/listen"),
        port_in(&line, "/health"),
        port_in(&line, "/admin"),
    );

    // The kubelet's probes, as written.
    for probe in ["livenessProbe", "readinessProbe"] {
        let service = text(ec, &format!("/{probe}/grpc/service")).to_string();
        assert!(
            wait_until(Duration::from_secs(30), || grpc_health_check(
                health, &service
            ) == Ok(1)),
            "{probe}: the gRPC health service {service:?} never served: {:?}",
            grpc_health_check(health, &service)
        );
    }
    assert!(
        grpc_health_check(health, "no-such-service") != Ok(1),
        "this test's health client answers SERVING to anything"
    );
    probe_ok(admin, "/healthz", "the picker's admin port");
    probe_ok(admin, "/readyz", "the picker's admin port");

    // ext_proc over TLS, h2 by ALPN, with the certificate the Secret holds.
    let out = run_tool(
        "openssl",
        &[
            "s_client",
            "-connect",
            &format!("127.0.0.1:{listen}"),
            "-servername",
            "localhost",
            "-alpn",
            "h2",
            "-CAfile",
            certs.ca.to_str().unwrap(),
            "-verify_return_error",
        ],
        None,
        "openssl s_client",
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        said.contains("ALPN protocol: h2") && said.contains("Verify return code: 0 (ok)"),
        "ext_proc is not TLS with h2: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // SIGTERM: it drains and exits 0 within the pod's grace period.
    let grace = ew
        .pointer("/spec/template/spec/terminationGracePeriodSeconds")
        .and_then(Value::as_u64)
        .unwrap();
    let status = picker
        .terminate(Duration::from_secs(grace))
        .unwrap_or_else(|| panic!("the picker still runs {grace} s after SIGTERM"));
    assert!(status.success(), "the picker exits {status} on SIGTERM");
}
