//! deploy/kubernetes (a kustomize base and an example overlay) and the Dockerfile.
//!
//! The manifests are rendered offline with `kubectl kustomize`, validated against Kubernetes'
//! own schemas with the PyPI package kubernetes-validate (strict: unknown fields fail), and
//! checked for what a schema cannot see: probes on the port the settings open, grace periods
//! above the drain timeouts, `KVROUTER_*` variables that are real flags of the subcommand that
//! reads them, the bridge subscribed where vLLM publishes, one fleet's settings agreeing, the
//! overlay's namespace on every object, non-root containers, alert rules on exported metrics.
//! The kvrouter containers are also started from their rendered settings (on loopback, with a
//! real nats-server) to see their probes answer. scripts/setup.sh installs kubectl (when none
//! is on PATH), kubernetes-validate (with PyYAML) and nats-server; a missing tool fails a test.

use crate::common;
use crate::k8s_locked::{
    mount_of, shell_script, NatsLayout, FRONTEND_SECRET, REPLICAS_SECRET, SEED_KEY, USERS_KEY,
    USERS_SAMPLE, USERS_SECRET,
};

use common::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub(crate) const BASE: &str = "deploy/kubernetes/base";
pub(crate) const OVERLAY: &str = "deploy/kubernetes/overlays/example";

/// The oldest Kubernetes the manifests claim (the frontend's preStop `sleep` action is on by
/// default from 1.30); `None` is the newest kubernetes-validate knows.
const K8S_VERSIONS: [Option<&str>; 2] = [Some("1.30.0"), None];

/// The pod name the downward API gives in `Manifests::env` (a StatefulSet's first pod).
pub(crate) const POD_NAME: &str = "kvrouter-serve-0";

pub(crate) const SETUP: &str = "run `. scripts/setup.sh` first (scripts/test.sh does)";

// ---------------------------------------------------------------------------------------------
// Tools

/// Runs a tool to completion; a tool that cannot be started fails the test with a hint.
pub(crate) fn run_tool(program: &str, args: &[&str], stdin: Option<&str>, what: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(program)
        .args(args)
        .current_dir(repo_file(""))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program} ({what}): {e}; {SETUP}"));
    {
        let mut input = child.stdin.take().expect("stdin piped");
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).expect("write stdin");
        }
    }
    child.wait_with_output().expect("wait for the tool")
}

pub(crate) fn stdout_of(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

/// Every document of a YAML stream as JSON (PyYAML, which kubernetes-validate brings).
pub(crate) fn yaml_docs(yaml: &str) -> Vec<Value> {
    let script = "import sys, json, yaml\n\
                  print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d is not None]))";
    let out = run_tool("python3", &["-c", script], Some(yaml), "PyYAML");
    let text = stdout_of(
        &out,
        "python3 with PyYAML (kubernetes-validate installs it)",
    );
    match serde_json::from_str(&text).expect("JSON from PyYAML") {
        Value::Array(docs) => docs,
        other => panic!("not a list of documents: {other}"),
    }
}

pub(crate) fn yaml_doc(yaml: &str) -> Value {
    let mut docs = yaml_docs(yaml);
    assert_eq!(docs.len(), 1, "one YAML document expected");
    docs.remove(0)
}

// ---------------------------------------------------------------------------------------------
// Rendered manifests

pub(crate) struct Manifests {
    pub(crate) dir: &'static str,
    pub(crate) yaml: String,
    pub(crate) docs: Vec<Value>,
}

pub(crate) fn render(dir: &'static str) -> Manifests {
    let out = run_tool("kubectl", &["kustomize", dir], None, "kubectl kustomize");
    let yaml = stdout_of(&out, &format!("kubectl kustomize {dir}"));
    let docs = yaml_docs(&yaml);
    assert!(!docs.is_empty(), "{dir} renders nothing");
    Manifests { dir, yaml, docs }
}

/// The base, then every overlay under deploy/kubernetes/overlays (by name), rendered once.
pub(crate) fn every() -> &'static [Manifests] {
    static M: OnceLock<Vec<Manifests>> = OnceLock::new();
    M.get_or_init(|| {
        let parent = Path::new(OVERLAY).parent().unwrap();
        let mut dirs: Vec<String> = std::fs::read_dir(repo_file(parent.to_str().unwrap()))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("kustomization.yaml").is_file())
            .map(|p| {
                let name = p.file_name().unwrap().to_str().unwrap().to_string();
                format!("{}/{name}", parent.display())
            })
            .collect();
        dirs.sort();
        assert!(
            dirs.iter().any(|d| d == OVERLAY),
            "{OVERLAY} is gone: {dirs:?}"
        );
        std::iter::once(BASE)
            .chain(dirs.into_iter().map(|d| &*Box::leak(d.into_boxed_str())))
            .map(render)
            .collect()
    })
}

pub(crate) fn base() -> &'static Manifests {
    &every()[0]
}

/// The example overlay (its own namespace, merged settings, another model).
pub(crate) fn overlay() -> &'static Manifests {
    every().iter().find(|m| m.dir == OVERLAY).unwrap()
}

pub(crate) fn text<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {ptr} in {}", short(v)))
}

pub(crate) fn int(v: &Value, ptr: &str) -> i64 {
    v.pointer(ptr)
        .and_then(Value::as_i64)
        .unwrap_or_else(|| panic!("no integer at {ptr} in {}", short(v)))
}

pub(crate) fn list<'a>(v: &'a Value, ptr: &str) -> &'a [Value] {
    v.pointer(ptr)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// An object's kind and name, for messages.
pub(crate) fn short(v: &Value) -> String {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("?");
    let name = v
        .pointer("/metadata/name")
        .or_else(|| v.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("?");
    format!("{kind}/{name}")
}

impl Manifests {
    pub(crate) fn of_kind<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
        let kind = kind.to_string();
        self.docs.iter().filter(move |d| d["kind"] == kind.as_str())
    }

    pub(crate) fn get(&self, kind: &str, name: &str) -> &Value {
        self.of_kind(kind)
            .find(|d| d["metadata"]["name"] == name)
            .unwrap_or_else(|| {
                let names: Vec<_> = self.of_kind(kind).map(short).collect();
                panic!("{}: no {kind} {name} among {names:?}", self.dir)
            })
    }

    /// A ConfigMap of the base's configMapGenerator, by its name before the content hash.
    pub(crate) fn config_map(&self, name: &str) -> &Value {
        let hashed = |n: &str| {
            n.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|h| h.len() == 10 && h.bytes().all(|b| b.is_ascii_alphanumeric()))
        };
        let mut found = self
            .of_kind("ConfigMap")
            .filter(|d| d["metadata"]["name"] == name || hashed(text(d, "/metadata/name")));
        let cm = found
            .next()
            .unwrap_or_else(|| panic!("{}: no ConfigMap {name}", self.dir));
        assert!(
            found.next().is_none(),
            "{}: two ConfigMaps {name}",
            self.dir
        );
        cm
    }

    pub(crate) fn data(&self, cm: &str) -> BTreeMap<String, String> {
        let cm = self.config_map(cm);
        cm["data"]
            .as_object()
            .unwrap_or_else(|| panic!("{} has no data", short(cm)))
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().expect("string data").to_string()))
            .collect()
    }

    /// Deployments and StatefulSets.
    pub(crate) fn workloads(&self) -> impl Iterator<Item = &Value> {
        self.docs
            .iter()
            .filter(|d| d["kind"] == "Deployment" || d["kind"] == "StatefulSet")
    }

    pub(crate) fn workload(&self, name: &str) -> &Value {
        self.workloads()
            .find(|w| w["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{}: no workload {name}", self.dir))
    }

    /// Every container of a workload's kvrouter image with its subcommand (`serve` ...).
    pub(crate) fn kvrouter_containers(&self) -> Vec<(&Value, &Value, String)> {
        let mut out = Vec::new();
        for w in self.workloads() {
            for c in all_containers(w) {
                if image_name(text(c, "/image")) == "kvrouter" {
                    let sub = list(c, "/args")
                        .first()
                        .and_then(Value::as_str)
                        .unwrap_or_else(|| panic!("{}: kvrouter without a subcommand", short(c)))
                        .to_string();
                    out.push((w, c, sub));
                }
            }
        }
        out
    }

    /// The one kvrouter container running `sub`, with its workload.
    pub(crate) fn kvrouter(&self, sub: &str) -> (&Value, &Value) {
        let found: Vec<_> = self
            .kvrouter_containers()
            .into_iter()
            .filter(|(_, _, s)| s == sub)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{}: one `kvrouter {sub}` container",
            self.dir
        );
        (found[0].0, found[0].1)
    }

    /// The environment a container starts with, as the kubelet builds it: its envFrom
    /// ConfigMaps, then its env (ConfigMap keys resolved, downward-API fields as placeholders:
    /// the pod name `POD_NAME`, index 0, IP 10.1.2.3; `$(VAR)` expanded); optional Secret
    /// references are left out.
    pub(crate) fn env(&self, c: &Value) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for src in list(c, "/envFrom") {
            let name = src
                .pointer("/configMapRef/name")
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("{}: envFrom other than a ConfigMap: {src}", short(c)));
            let cm = self.get("ConfigMap", name);
            for (k, v) in cm["data"].as_object().expect("ConfigMap data") {
                env.insert(k.clone(), v.as_str().expect("string data").to_string());
            }
        }
        for e in list(c, "/env") {
            let name = text(e, "/name").to_string();
            let value = if let Some(v) = e.get("value").and_then(Value::as_str) {
                expand(v, &env)
            } else if let Some(r) = e.pointer("/valueFrom/configMapKeyRef") {
                let cm = self.get("ConfigMap", text(r, "/name"));
                text(cm, &format!("/data/{}", text(r, "/key"))).to_string()
            } else if let Some(f) = e.pointer("/valueFrom/fieldRef/fieldPath") {
                match f.as_str() {
                    // StatefulSet pods: the first one's name and index.
                    Some("metadata.name") => POD_NAME.to_string(),
                    Some("metadata.labels['apps.kubernetes.io/pod-index']") => "0".to_string(),
                    Some("status.podIP") => "10.1.2.3".to_string(),
                    other => panic!("{}: unexpected fieldRef {other:?}", short(c)),
                }
            } else if let Some(s) = e.pointer("/valueFrom/secretKeyRef") {
                assert_eq!(s["optional"], true, "{}: a required Secret {s}", short(c));
                continue;
            } else {
                panic!("{}: env {name} of an unknown source", short(c));
            };
            env.insert(name, value);
        }
        env
    }
}

/// `$(VAR)` references replaced by defined variables, as the kubelet expands env and args.
pub(crate) fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) if env.contains_key(&after[..j]) => {
                out.push_str(&env[&after[..j]]);
                rest = &after[j + 1..];
            }
            _ => {
                out.push_str("$(");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

pub(crate) fn pod_spec(w: &Value) -> &Value {
    w.pointer("/spec/template/spec")
        .unwrap_or_else(|| panic!("{} has no pod template", short(w)))
}

pub(crate) fn pod_labels(w: &Value) -> &Value {
    &w["spec"]["template"]["metadata"]["labels"]
}

pub(crate) fn all_containers(w: &Value) -> impl Iterator<Item = &Value> {
    let spec = pod_spec(w);
    list(spec, "/initContainers")
        .iter()
        .chain(list(spec, "/containers"))
}

pub(crate) fn container<'a>(w: &'a Value, name: &str) -> &'a Value {
    all_containers(w)
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{}: no container {name}", short(w)))
}

/// `registry.example.com/kvrouter:0.1.0` → `kvrouter`.
pub(crate) fn image_name(image: &str) -> &str {
    let path = image.split('@').next().unwrap_or(image);
    let last = path.rsplit('/').next().unwrap_or(path);
    last.split(':').next().unwrap_or(last)
}

/// `nats:2.11-alpine` → `2.11-alpine`.
pub(crate) fn image_tag(image: &str) -> &str {
    let last = image.rsplit('/').next().unwrap_or(image);
    last.split_once(':').map(|(_, t)| t).unwrap_or("latest")
}

/// The port of `HOST:PORT` or `scheme://HOST:PORT[/path]`.
pub(crate) fn host_port(addr: &str) -> (String, u16) {
    let rest = addr.split_once("://").map(|(_, r)| r).unwrap_or(addr);
    let rest = rest.split('/').next().unwrap_or(rest);
    let (host, port) = rest
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("no port in {addr:?}"));
    (
        host.to_string(),
        port.parse()
            .unwrap_or_else(|_| panic!("bad port in {addr:?}")),
    )
}

/// A container port by name or number.
pub(crate) fn container_port(c: &Value, port: &Value) -> u16 {
    if let Some(n) = port.as_u64() {
        return n as u16;
    }
    let name = port.as_str().expect("a port name or number");
    let p = list(c, "/ports")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("{}: no port named {name}", short(c)));
    int(p, "/containerPort") as u16
}

/// (path, port) of an httpGet probe.
fn http_probe(c: &Value, probe: &str) -> (String, u16) {
    let get = c
        .get(probe)
        .and_then(|p| p.get("httpGet"))
        .unwrap_or_else(|| panic!("{}: no {probe} httpGet", short(c)));
    (
        text(get, "/path").to_string(),
        container_port(c, &get["port"]),
    )
}

/// Whether a label selector (matchLabels, or a Service's plain map) picks these labels.
pub(crate) fn selects(selector: &Value, labels: &Value) -> bool {
    let sel = selector.as_object().expect("a selector map");
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The env twins (`[env: KVROUTER_...]`) of a subcommand's flags, from the built binary.
fn env_twins(sub: &str) -> BTreeSet<String> {
    let out = run(&[sub, "--help"]);
    let help = stdout_of(&out, &format!("kvrouter {sub} --help"));
    let twins: BTreeSet<String> = help
        .split("[env: ")
        .skip(1)
        .map(|s| {
            s.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect();
    assert!(twins.contains("KVROUTER_NATS"), "{sub}: {twins:?}");
    twins
}

/// The flags `kvrouter SUB` requires (from its usage line), as their env twins (each read
/// from the flag's own help entry: a twin need not be the flag's name in capitals).
fn required_twins(sub: &str) -> Vec<String> {
    let out = run(&[sub, "--help"]);
    let help = stdout_of(&out, &format!("kvrouter {sub} --help"));
    let usage = help
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .expect("a usage line");
    usage
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|flag| {
            let entry = help
                .split(&format!("\n      {flag} "))
                .nth(1)
                .unwrap_or_else(|| panic!("kvrouter {sub} --help has no entry for {flag}"));
            let twin = entry
                .split("[env: ")
                .nth(1)
                .unwrap_or_else(|| panic!("kvrouter {sub}: {flag} has no env twin"));
            twin.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

pub(crate) fn drain_secs(env: &BTreeMap<String, String>, who: &str) -> i64 {
    env.get("KVROUTER_DRAIN_TIMEOUT_SECS")
        .unwrap_or_else(|| {
            panic!("{who}: set KVROUTER_DRAIN_TIMEOUT_SECS (the grace period depends on it)")
        })
        .parse()
        .expect("a number of seconds")
}

/// Readiness on /readyz and liveness on /healthz at the port KVROUTER_ADMIN_ADDR opens, and a
/// grace period above KVROUTER_DRAIN_TIMEOUT_SECS.
fn admin_probes_and_grace(w: &Value, c: &Value, env: &BTreeMap<String, String>, who: &str) {
    let (_, admin) = host_port(&env["KVROUTER_ADMIN_ADDR"]);
    assert_eq!(
        http_probe(c, "readinessProbe"),
        ("/readyz".into(), admin),
        "{who}"
    );
    assert_eq!(
        http_probe(c, "livenessProbe"),
        ("/healthz".into(), admin),
        "{who}"
    );
    let grace = int(w, "/spec/template/spec/terminationGracePeriodSeconds");
    let drain = drain_secs(env, who);
    assert!(
        grace > drain,
        "{who}: grace {grace} s must exceed the drain timeout {drain} s"
    );
}

// ---------------------------------------------------------------------------------------------
// Schemas

#[test]
fn base_and_overlay_validate_against_the_kubernetes_schemas() {
    for m in every() {
        // Kubernetes' own kinds; the custom resources (overlays/gateway's InferencePool and
        // HTTPRoute), which kubernetes-validate does not know, are validated against the CRD
        // schemas in deploy/kubernetes/schemas by k8s_gateway.rs.
        let standard: Vec<&Value> = m
            .docs
            .iter()
            .filter(|d| !crate::k8s_gateway::custom(d))
            .collect();
        let stream: String = standard.iter().map(|d| format!("---\n{d}\n")).collect();
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, stream.as_bytes()).unwrap();
        let path = file.path().to_str().unwrap().to_string();
        for version in K8S_VERSIONS {
            let mut args = vec!["-m", "kubernetes_validate", "--strict"];
            if let Some(v) = version {
                args.extend(["--kubernetes-version", v]);
            }
            args.push(&path);
            let out = run_tool("python3", &args, None, "kubernetes-validate");
            let report = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success()
                    && !report.lines().any(|l| l.starts_with("ERROR")
                        || l.starts_with("WARN")
                        || l.starts_with("FATAL")),
                "{} against Kubernetes {} ({SETUP}): {report}",
                m.dir,
                version.unwrap_or("(newest)")
            );
            let passed = report.matches(" passed for resource ").count();
            assert_eq!(
                passed,
                standard.len(),
                "{}: every object validated: {report}",
                m.dir
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Router replicas, frontends, bridges

#[test]
fn serve_replicas_probe_the_admin_port_drain_in_time_and_keep_a_budget() {
    for m in every() {
        let (w, c) = m.kvrouter("serve");
        let who = format!("{}: {}", m.dir, short(w));
        // Stable pod names: the pod name is the replica id, which names its NATS user.
        assert_eq!(w["kind"], "StatefulSet", "{who}");
        assert_eq!(int(w, "/spec/replicas"), 3, "{who}: three replicas");
        let replica_id = list(c, "/env")
            .iter()
            .find(|e| e["name"] == "KVROUTER_REPLICA_ID")
            .unwrap_or_else(|| panic!("{who}: no KVROUTER_REPLICA_ID"));
        assert_eq!(
            replica_id.pointer("/valueFrom/fieldRef/fieldPath"),
            Some(&Value::from("metadata.name")),
            "{who}: the replica id is the pod name"
        );
        let svc = m.get("Service", text(w, "/spec/serviceName"));
        assert!(selects(&svc["spec"]["selector"], pod_labels(w)), "{who}");
        let env = m.env(c);
        admin_probes_and_grace(w, c, &env, &who);
        assert!(
            c["lifecycle"].is_null(),
            "{who}: a preStop would eat the grace period"
        );
        // Rolling updates replace one pod at a time, each once its successor is ready (a
        // StatefulSet cannot surge: the name is taken until the old pod is gone).
        assert_eq!(
            w["spec"]["updateStrategy"]["type"], "RollingUpdate",
            "{who}"
        );
        let rolling = &w["spec"]["updateStrategy"]["rollingUpdate"];
        assert!(
            rolling["maxUnavailable"].is_null() || rolling["maxUnavailable"] == 1,
            "{who}: {rolling}"
        );
        assert!(
            rolling["partition"].is_null(),
            "{who}: a partition leaves pods behind"
        );

        // One PodDisruptionBudget, for these pods only, that lets a node drain one at a time.
        let labels = pod_labels(w);
        let pdbs: Vec<_> = m
            .of_kind("PodDisruptionBudget")
            .filter(|p| selects(&p["spec"]["selector"]["matchLabels"], labels))
            .collect();
        assert_eq!(pdbs.len(), 1, "{who}: one PDB selects the replicas");
        let pdb = pdbs[0];
        for other in m.workloads().filter(|o| o != &w) {
            assert!(
                !selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels(other)),
                "{who}: its PDB also selects {}",
                short(other)
            );
        }
        if let Some(max) = pdb["spec"]["maxUnavailable"].as_i64() {
            assert!(max >= 1, "{who}: maxUnavailable {max} blocks every drain");
        } else {
            let min = int(pdb, "/spec/minAvailable");
            assert!(min < 3, "{who}: minAvailable {min} blocks every drain");
        }

        // Spread over nodes, preferably.
        let terms = list(
            pod_spec(w),
            "/affinity/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution",
        );
        assert!(
            terms.iter().any(
                |t| t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
                    && selects(
                        &t["podAffinityTerm"]["labelSelector"]["matchLabels"],
                        labels
                    )
            ),
            "{who}: preferred anti-affinity on the hostname for its own pods"
        );
    }
}

#[test]
fn frontends_and_bridges_probe_the_ports_their_settings_open() {
    for m in every() {
        let (w, c) = m.kvrouter("frontend");
        let who = format!("{}: {}", m.dir, short(w));
        let env = m.env(c);
        let (_, listen) = host_port(&env["KVROUTER_LISTEN"]);
        assert_eq!(
            http_probe(c, "readinessProbe"),
            ("/readyz".into(), listen),
            "{who}"
        );
        assert_eq!(
            http_probe(c, "livenessProbe"),
            ("/health".into(), listen),
            "{who}"
        );
        let sleep = c
            .pointer("/lifecycle/preStop/sleep/seconds")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let grace = int(w, "/spec/template/spec/terminationGracePeriodSeconds");
        let drain = drain_secs(&env, &who);
        assert!(
            grace > sleep + drain,
            "{who}: grace {grace} s <= preStop {sleep} s + drain {drain} s"
        );
        let svc = m.get("Service", "kvrouter-frontend");
        assert!(selects(&svc["spec"]["selector"], pod_labels(w)), "{who}");

        let (w, c) = m.kvrouter("bridge");
        let who = format!("{}: {}", m.dir, short(w));
        let env = m.env(c);
        admin_probes_and_grace(w, c, &env, &who);
    }
}

#[test]
fn every_kvrouter_variable_is_a_flag_of_the_subcommand_that_reads_it() {
    let mut twins = BTreeMap::new();
    for m in every() {
        let mut read_by_kvrouter = BTreeSet::new();
        for (w, c, sub) in m.kvrouter_containers() {
            let who = format!("{}: {} container {}", m.dir, short(w), c["name"]);
            let known = twins.entry(sub.clone()).or_insert_with(|| env_twins(&sub));
            let env = m.env(c);
            for key in env.keys().filter(|k| k.starts_with("KVROUTER_")) {
                assert!(
                    known.contains(key),
                    "{who}: {key} is no flag of `kvrouter {sub}` (see `kvrouter {sub} --help`)"
                );
            }
            for key in required_twins(&sub) {
                assert!(
                    env.contains_key(&key),
                    "{who}: `kvrouter {sub}` requires {key}"
                );
            }
            for src in list(c, "/envFrom") {
                read_by_kvrouter.insert(text(src, "/configMapRef/name").to_string());
            }
        }
        // A ConfigMap of KVROUTER_ settings that no kvrouter container reads is a mistake.
        for cm in m.of_kind("ConfigMap") {
            let data = cm["data"].as_object().expect("data");
            if data.keys().any(|k| k.starts_with("KVROUTER_")) {
                assert!(
                    read_by_kvrouter.contains(text(cm, "/metadata/name")),
                    "{}: {} is read by no kvrouter container",
                    m.dir,
                    short(cm)
                );
            }
        }
    }
}

#[test]
fn the_bridge_subscribes_where_vllm_publishes() {
    for m in every() {
        let (w, bridge) = m.kvrouter("bridge");
        let who = format!("{}: {}", m.dir, short(w));
        let env = m.env(bridge);
        let engine = all_containers(w)
            .find(|c| image_name(text(c, "/image")) == "vllm-openai")
            .unwrap_or_else(|| panic!("{who}: no vLLM container beside the bridge"));
        assert_eq!(env["KVROUTER_ENGINE"], "vllm", "{who}");
        let engine_env = m.env(engine);
        let args: Vec<String> = list(engine, "/args")
            .iter()
            .map(|a| expand(a.as_str().expect("string args"), &engine_env))
            .collect();
        let flag = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .map(|i| args[i + 1].clone())
                .unwrap_or_else(|| panic!("{who}: vLLM is started without {name}: {args:?}"))
        };
        assert_eq!(list(engine, "/command"), ["vllm", "serve"], "{who}");
        assert_eq!(
            args[0], env["KVROUTER_MODEL"],
            "{who}: vLLM serves the bridge's model"
        );
        assert_eq!(flag("--block-size"), env["KVROUTER_BLOCK_SIZE"], "{who}");

        let config: Value = serde_json::from_str(&flag("--kv-events-config"))
            .unwrap_or_else(|e| panic!("{who}: --kv-events-config is not JSON: {e}"));
        assert_eq!(config["enable_kv_cache_events"], true, "{who}: {config}");
        assert_eq!(config["publisher"], "zmq", "{who}: {config}");
        let topic = env.get("KVROUTER_TOPIC").map(String::as_str).unwrap_or("");
        assert_eq!(
            config["topic"].as_str().unwrap_or(""),
            topic,
            "{who}: {config}"
        );
        let (endpoint, replay_endpoint) = (
            text(&config, "/endpoint"),
            text(&config, "/replay_endpoint"),
        );
        let dp: u16 = env
            .get("KVROUTER_DP_SIZE")
            .map_or(1, |d| d.parse().expect("a dp size"));
        if endpoint.starts_with("ipc://") {
            // Socket files, which vLLM binds: the bridge connects to the same files, in a
            // volume both containers mount at the same place. vLLM refuses ipc:// past
            // data-parallel rank 0.
            assert!(replay_endpoint.starts_with("ipc://"), "{who}: {config}");
            assert_eq!(env["KVROUTER_ZMQ_ENDPOINT"], endpoint, "{who}");
            assert_eq!(env["KVROUTER_REPLAY_ENDPOINT"], replay_endpoint, "{who}");
            assert_ne!(
                env.get("KVROUTER_ZMQ_BIND").map(String::as_str),
                Some("true"),
                "{who}: vLLM binds socket files; the bridge must connect"
            );
            assert_eq!(dp, 1, "{who}: ipc:// serves data-parallel rank 0 only");
            for path in [endpoint, replay_endpoint] {
                let dir = std::path::Path::new(&path["ipc://".len()..])
                    .parent()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                let mounted = |c: &Value| {
                    list(c, "/volumeMounts")
                        .iter()
                        .find(|v| text(v, "/mountPath") == dir)
                        .map(|v| text(v, "/name").to_string())
                };
                let (a, b) = (mounted(engine), mounted(bridge));
                assert!(
                    a.is_some() && a == b,
                    "{who}: {dir} is not one volume mounted in both vLLM ({a:?}) and the bridge ({b:?})"
                );
            }
        } else {
            let (bind, events) = host_port(endpoint);
            let (replay_bind, replay) = host_port(replay_endpoint);
            // Both on loopback only (the events carry prompts' token ids). The replay socket
            // is always bound by vLLM. vLLM binds its publisher only for an endpoint with a
            // wildcard (`*`, `::`) and connects to any other: to the bridge, which must bind
            // it. (No NetworkPolicy admits either port either: k8s_locked.rs checks that.)
            assert_eq!(
                replay_bind, "127.0.0.1",
                "{who}: vLLM's replay socket: {config}"
            );
            assert_eq!(
                bind, "127.0.0.1",
                "{who}: vLLM's publisher must connect over loopback: {config}"
            );
            assert_eq!(
                env.get("KVROUTER_ZMQ_BIND").map(String::as_str),
                Some("true"),
                "{who}: vLLM's publisher connects, so the bridge must bind"
            );
            let (host, port) = host_port(&env["KVROUTER_ZMQ_ENDPOINT"]);
            assert!(env["KVROUTER_ZMQ_ENDPOINT"].starts_with("tcp://"), "{who}");
            assert_eq!(
                host, "127.0.0.1",
                "{who}: the bridge reads its own pod's engine"
            );
            assert_eq!(
                port, events,
                "{who}: bridge subscribes to {port}, vLLM publishes on {events}"
            );
            let (host, port) = host_port(&env["KVROUTER_REPLAY_ENDPOINT"]);
            assert_eq!(
                (host.as_str(), port),
                ("127.0.0.1", replay),
                "{who}: replay endpoint"
            );
            // Rank r publishes on events + r and replays on replay + r: no overlap.
            assert!(
                replay >= events + dp || events >= replay + dp,
                "{who}: ports collide"
            );
        }

        // Frontends reach the engine at its pod IP on vLLM's port.
        let vllm_port: u16 = flag("--port").parse().expect("a port");
        let (host, port) = host_port(&env["KVROUTER_BASE_URL"]);
        assert_eq!(
            host, "10.1.2.3",
            "{who}: the base URL is the pod IP (status.podIP)"
        );
        assert_eq!(port, vllm_port, "{who}: base URL port");
        // The bridge reads vLLM's health and metrics over loopback, not through the pod IP
        // (which NetworkPolicies govern).
        for (key, path) in [
            ("KVROUTER_HEALTH_URL", "/health"),
            ("KVROUTER_METRICS_URL", "/metrics"),
        ] {
            assert_eq!(
                env.get(key).map(String::as_str),
                Some(format!("http://127.0.0.1:{vllm_port}{path}").as_str()),
                "{who}: {key}"
            );
        }
        let (path, probe_port) = http_probe(engine, "readinessProbe");
        assert_eq!((path.as_str(), probe_port), ("/health", vllm_port), "{who}");
    }
}

#[test]
fn replicas_frontends_and_bridges_share_one_fleet() {
    for m in every() {
        let serve = m.env(m.kvrouter("serve").1);
        let (fw, fc) = m.kvrouter("frontend");
        let frontend = m.env(fc);
        let bridge = m.env(m.kvrouter("bridge").1);
        let dir = m.dir;
        for key in ["KVROUTER_NAMESPACE", "KVROUTER_NATS"] {
            assert_eq!(serve.get(key), frontend.get(key), "{dir}: {key}");
            assert_eq!(serve.get(key), bridge.get(key), "{dir}: {key}");
        }
        // The NATS URL names the client Service of the NATS StatefulSet.
        let (host, port) = host_port(&serve["KVROUTER_NATS"]);
        let svc = m.get("Service", &host);
        assert!(
            list(svc, "/spec/ports").iter().any(|p| p["port"] == port),
            "{dir}: Service {host} has no port {port}"
        );
        assert!(
            selects(&svc["spec"]["selector"], pod_labels(m.workload("nats"))),
            "{dir}"
        );

        // The replicas serve the models the frontends route and the bridges register.
        let models: Vec<&str> = serve["KVROUTER_MODEL"].split(',').collect();
        let front: Vec<(&str, &str)> = frontend["KVROUTER_MODEL_DIRS"]
            .split(',')
            .map(|p| p.split_once('=').expect("NAME=DIR"))
            .collect();
        let front_names: Vec<&str> = front.iter().map(|(n, _)| *n).collect();
        assert_eq!(models, front_names, "{dir}: frontend models");
        assert!(
            models.contains(&bridge["KVROUTER_MODEL"].as_str()),
            "{dir}: bridge model"
        );
        let block = format!(
            "{}={}",
            bridge["KVROUTER_MODEL"], bridge["KVROUTER_BLOCK_SIZE"]
        );
        assert!(
            serve["KVROUTER_MODEL_BLOCK_SIZE"]
                .split(',')
                .any(|b| b == block),
            "{dir}: the replicas expect another block size than the engines' {block}"
        );
        for model in &models {
            let out = run(&[
                "subjects",
                "--namespace",
                &serve["KVROUTER_NAMESPACE"],
                "--model",
                model,
            ]);
            stdout_of(&out, &format!("{dir}: kvrouter subjects for {model}"));
        }

        // Each model directory lies on a volume the init container fills.
        let init = container(fw, "fetch-tokenizer");
        for (name, model_dir) in &front {
            let mount = list(fc, "/volumeMounts")
                .iter()
                .find(|v| model_dir.starts_with(&format!("{}/", text(v, "/mountPath"))))
                .unwrap_or_else(|| panic!("{dir}: {model_dir} ({name}) is on no volume"));
            assert!(
                list(init, "/volumeMounts")
                    .iter()
                    .any(|v| v["name"] == mount["name"]
                        && v["mountPath"] == mount["mountPath"]
                        && v["readOnly"] != true),
                "{dir}: the init container does not fill {model_dir}"
            );
        }
        assert_eq!(
            m.env(init)["KVROUTER_MODEL_DIRS"],
            frontend["KVROUTER_MODEL_DIRS"],
            "{dir}"
        );
    }
}

#[test]
fn the_overlay_moves_everything_into_its_namespace_and_merges_its_settings() {
    let kustomization = yaml_doc(
        &std::fs::read_to_string(repo_file(&format!("{OVERLAY}/kustomization.yaml"))).unwrap(),
    );
    let ns = text(&kustomization, "/namespace");
    let (b, o) = (base(), overlay());
    for d in &b.docs {
        assert!(
            d["metadata"]["namespace"].is_null(),
            "the base pins a namespace: {}",
            short(d)
        );
    }
    assert!(
        o.of_kind("Namespace").any(|d| d["metadata"]["name"] == ns),
        "the overlay creates its namespace"
    );
    for d in &o.docs {
        if d["kind"] != "Namespace" {
            assert_eq!(d["metadata"]["namespace"], ns, "{}", short(d));
        }
    }
    // Its images, replica counts and settings win; the base's other settings stay.
    for image in list(&kustomization, "/images") {
        let name = text(image, "/name");
        let mut want = format!(
            "{}:{}",
            image["newName"].as_str().unwrap_or(name),
            text(image, "/newTag")
        );
        if let Some(digest) = image["digest"].as_str() {
            want = format!("{want}@{digest}");
        }
        for w in o.workloads() {
            for c in all_containers(w) {
                let got = text(c, "/image");
                if image_name(got) == image_name(name) {
                    assert_eq!(got, want, "{}", short(w));
                }
            }
        }
    }
    for r in list(&kustomization, "/replicas") {
        let name = text(r, "/name");
        assert_eq!(o.workload(name)["spec"]["replicas"], r["count"], "{name}");
        assert_ne!(
            b.workload(name)["spec"]["replicas"],
            r["count"],
            "{name}: unchanged"
        );
    }
    for gen in list(&kustomization, "/configMapGenerator") {
        let name = text(gen, "/name");
        assert_eq!(
            gen["behavior"], "merge",
            "{name}: replacing drops the base's settings"
        );
        let (before, after) = (b.data(name), o.data(name));
        let mut changed = BTreeSet::new();
        for literal in list(gen, "/literals") {
            let (k, v) = literal.as_str().unwrap().split_once('=').unwrap();
            assert_eq!(after.get(k).map(String::as_str), Some(v), "{name}: {k}");
            changed.insert(k);
        }
        for (k, v) in &before {
            if !changed.contains(k.as_str()) {
                assert_eq!(after.get(k), Some(v), "{name}: {k} lost in the merge");
            }
        }
    }
    // The merge changed the content, so the hashed names (and the pods) roll.
    assert_ne!(
        b.config_map("kvrouter-serve")["metadata"]["name"],
        o.config_map("kvrouter-serve")["metadata"]["name"]
    );
}

// ---------------------------------------------------------------------------------------------
// Security, labels, selectors

#[test]
fn containers_run_as_non_root_with_least_privilege() {
    // vLLM, torch and triton write caches all over the file system.
    let writable_root = ["vllm"];
    for m in every() {
        for w in m.workloads() {
            let spec = pod_spec(w);
            let who = format!("{}: {}", m.dir, short(w));
            assert_eq!(spec["automountServiceAccountToken"], false, "{who}");
            assert_eq!(
                spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{who}"
            );
            for c in all_containers(w) {
                let who = format!("{who} container {}", c["name"]);
                let sc = &c["securityContext"];
                let pod = &spec["securityContext"];
                let eff = |k: &str| if sc[k].is_null() { &pod[k] } else { &sc[k] };
                assert_eq!(eff("runAsNonRoot"), &Value::Bool(true), "{who}");
                let uid = eff("runAsUser").as_i64();
                assert!(uid.is_some_and(|u| u > 0), "{who}: runAsUser {uid:?}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{who}");
                assert!(
                    list(sc, "/capabilities/drop").iter().any(|d| d == "ALL"),
                    "{who}: drop ALL capabilities"
                );
                let writable = writable_root.contains(&c["name"].as_str().unwrap());
                assert_eq!(sc["readOnlyRootFilesystem"], !writable, "{who}");
                for kind in ["requests", "limits"] {
                    for r in ["cpu", "memory"] {
                        assert!(
                            !c["resources"][kind][r].is_null(),
                            "{who}: resources.{kind}.{r}"
                        );
                    }
                }
            }
        }
        for (w, c, sub) in m.kvrouter_containers() {
            assert_eq!(
                c["securityContext"]["readOnlyRootFilesystem"],
                true,
                "{}: kvrouter {sub}",
                short(w)
            );
        }
    }
}

#[test]
fn objects_are_labelled_and_services_and_budgets_select_their_pods() {
    for m in every() {
        for d in m.docs.iter().filter(|d| d["kind"] != "Namespace") {
            let labels = &d["metadata"]["labels"];
            assert_eq!(
                labels["app.kubernetes.io/part-of"],
                "kvrouter",
                "{}: {}: label app.kubernetes.io/part-of",
                m.dir,
                short(d)
            );
            if d["kind"] != "ConfigMap" {
                for key in ["app.kubernetes.io/name", "app.kubernetes.io/component"] {
                    assert!(
                        labels[key].is_string(),
                        "{}: {}: label {key}",
                        m.dir,
                        short(d)
                    );
                }
            }
        }
        for w in m.workloads() {
            let labels = pod_labels(w);
            for key in [
                "app.kubernetes.io/name",
                "app.kubernetes.io/component",
                "app.kubernetes.io/part-of",
            ] {
                assert!(
                    labels[key].is_string(),
                    "{}: {} pods: label {key}",
                    m.dir,
                    short(w)
                );
            }
            assert_eq!(
                &w["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
                &labels["app.kubernetes.io/component"],
                "{}: the selector names the component",
                short(w)
            );
            assert!(
                selects(&w["spec"]["selector"]["matchLabels"], labels),
                "{}",
                short(w)
            );
            let mut names = BTreeSet::new();
            for c in all_containers(w) {
                for p in list(c, "/ports") {
                    let name = text(p, "/name");
                    assert!(
                        name.len() <= 15 && names.insert(name.to_string()),
                        "{}: port {name}",
                        short(w)
                    );
                }
            }
        }
        for svc in m.of_kind("Service") {
            let chosen: Vec<_> = m
                .workloads()
                .filter(|w| selects(&svc["spec"]["selector"], pod_labels(w)))
                .collect();
            assert_eq!(
                chosen.len(),
                1,
                "{}: {} selects one workload",
                m.dir,
                short(svc)
            );
            for p in list(svc, "/spec/ports") {
                let target = &p["targetPort"];
                assert!(
                    all_containers(chosen[0]).any(|c| list(c, "/ports")
                        .iter()
                        .any(|cp| { cp["name"] == *target || cp["containerPort"] == *target })),
                    "{}: {} targets port {target} that its pods do not open",
                    m.dir,
                    short(svc)
                );
            }
        }
        for pdb in m.of_kind("PodDisruptionBudget") {
            let n = m
                .workloads()
                .filter(|w| selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels(w)))
                .count();
            assert_eq!(n, 1, "{}: {} selects one workload", m.dir, short(pdb));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// NATS

#[test]
fn nats_runs_a_three_node_cluster_of_core_nats() {
    for m in every() {
        let sts = m.get("StatefulSet", "nats");
        let dir = m.dir;
        let replicas = int(sts, "/spec/replicas");
        assert_eq!(replicas, 3, "{dir}");
        let headless = m.get("Service", text(sts, "/spec/serviceName"));
        assert_eq!(headless["spec"]["clusterIP"], "None", "{dir}: headless");
        assert_eq!(headless["spec"]["publishNotReadyAddresses"], true, "{dir}");
        let c = container(sts, "nats");
        let image = text(c, "/image");
        assert_eq!(image_name(image), "nats", "{dir}");
        let version: Vec<u32> = image_tag(image)
            .split('-')
            .next()
            .unwrap()
            .split('.')
            .map(|p| p.parse().expect("a numeric nats tag"))
            .collect();
        assert!(
            version[0] > 2 || (version[0] == 2 && version[1] >= 10),
            "{dir}: {image}"
        );

        let conf = &m.data("nats-config")["nats.conf"];
        let start = shell_script(c);
        let config_path = start
            .split_whitespace()
            .skip_while(|a| *a != "--config")
            .nth(1)
            .expect("nats-server --config FILE");
        let mount = mount_of(c, config_path);
        let vol = list(pod_spec(sts), "/volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        assert_eq!(
            vol["configMap"]["name"],
            m.config_map("nats-config")["metadata"]["name"],
            "{dir}"
        );
        assert!(config_path.ends_with("/nats.conf"), "{dir}");

        // Routes: one per pod, through the headless Service, on the cluster port.
        let cluster_port = container_port(c, &Value::from("cluster"));
        let want: BTreeSet<String> = (0..replicas)
            .map(|i| {
                format!(
                    "nats://{}-{i}.{}:{cluster_port}",
                    text(sts, "/metadata/name"),
                    text(headless, "/metadata/name")
                )
            })
            .collect();
        let routes: BTreeSet<String> = conf
            .split_whitespace()
            .filter(|w| w.starts_with("nats://"))
            .map(|w| w.trim_end_matches(',').to_string())
            .collect();
        assert_eq!(routes, want, "{dir}: cluster routes");
        let active: Vec<&str> = conf
            .lines()
            .map(|l| l.split('#').next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            active
                .iter()
                .any(|l| l.starts_with("listen:") && l.ends_with(&format!(":{cluster_port}"))),
            "{dir}: cluster listen port"
        );
        // Monitoring on loopback only, the probes asking it from inside the pod.
        let monitor = active
            .iter()
            .find_map(|l| l.strip_prefix("http:"))
            .expect("a monitoring port")
            .trim();
        assert!(
            monitor.starts_with("127.0.0.1:"),
            "{dir}: monitoring listens on {monitor}, not loopback"
        );
        for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
            let cmd: Vec<&str> = list(c, &format!("/{probe}/exec/command"))
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            assert!(
                cmd.contains(&format!("http://{monitor}/healthz").as_str()),
                "{dir}: {probe} {cmd:?} does not ask {monitor}/healthz"
            );
        }
        assert!(
            list(c, "/ports").iter().all(|p| {
                let port = int(p, "/containerPort").to_string();
                !monitor.ends_with(&format!(":{port}"))
            }),
            "{dir}: the monitoring port is declared as a container port"
        );
        // JetStream only if kvrouter uses it.
        let uses_jetstream = rust_sources()
            .iter()
            .any(|(_, s)| s.contains("jetstream::"));
        let enabled = active.iter().any(|l| l.starts_with("jetstream"));
        assert_eq!(enabled, uses_jetstream, "{dir}: JetStream in nats.conf");
        // Lame duck on shutdown uses the pid file the server writes.
        let pid_file = active
            .iter()
            .find_map(|l| l.strip_prefix("pid_file:"))
            .expect("pid_file")
            .trim();
        let pre_stop: Vec<&str> = list(c, "/lifecycle/preStop/exec/command")
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(
            pre_stop.contains(&format!("ldm={pid_file}").as_str()),
            "{dir}: {pre_stop:?}"
        );

        // nats-server itself accepts the file, laid out as the pod mounts it (with an
        // authorization file of the shape `kvrouter creds` writes).
        let layout = NatsLayout::new(m, Some(USERS_SAMPLE));
        let out = Command::new("nats-server")
            .args(["-t", "-c"])
            .arg(&layout.config)
            .env("SERVER_NAME", "nats-0")
            .output()
            .unwrap_or_else(|e| panic!("nats-server: {e}; {SETUP}"));
        assert!(
            out.status.success(),
            "{dir}: nats-server refuses nats.conf: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Prometheus

/// Every .rs file under crates/*/src, with its text.
fn rust_sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path, text));
            }
        }
    }
    let mut out = Vec::new();
    for krate in std::fs::read_dir(repo_file("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            walk(&src, &mut out);
        }
    }
    out
}

/// The metric names kvrouter registers: `Registry::with_prefix("P")` and each
/// `register("NAME", ...)` / `reg!("NAME", ...)` in the same file make `P_NAME`.
fn registered_metrics() -> BTreeSet<String> {
    let literal_after = |s: &str| -> Option<String> {
        let s = s.trim_start().strip_prefix('"')?;
        Some(s[..s.find('"')?].to_string())
    };
    let mut names = BTreeSet::new();
    for (path, src) in rust_sources() {
        let prefixes: Vec<String> = src
            .split("Registry::with_prefix(")
            .skip(1)
            .filter_map(literal_after)
            .collect();
        if prefixes.is_empty() {
            continue;
        }
        assert_eq!(
            prefixes.len(),
            1,
            "{}: teach this test two registries",
            path.display()
        );
        for call in ["register(", "reg!("] {
            for rest in src.split(call).skip(1) {
                if let Some(name) = literal_after(rest) {
                    names.insert(format!("{}_{name}", prefixes[0]));
                }
            }
        }
    }
    for known in [
        "kvrouter_routes",
        "kvrouter_bridge_engine_healthy",
        "kvrouter_frontend_requests",
    ] {
        assert!(
            names.contains(known),
            "the source scan missed {known}: {names:?}"
        );
    }
    names
}

/// Whether a series name is exported: a registered name, or one with the suffix the text
/// format gives counters and histograms.
fn exported(series: &str, registered: &BTreeSet<String>) -> bool {
    registered.contains(series)
        || ["_total", "_bucket", "_sum", "_count"].iter().any(|s| {
            series
                .strip_suffix(s)
                .is_some_and(|n| registered.contains(n))
        })
}

/// The `kvrouter_*` series a PromQL expression names, each with whether kvrouter exports it
/// (the alert rules and the dashboard are read alike).
fn kvrouter_series<'a>(
    expr: &'a str,
    registered: &'a BTreeSet<String>,
) -> impl Iterator<Item = (&'a str, bool)> + 'a {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|token| token.starts_with("kvrouter_"))
        .map(move |token| (token, exported(token, registered)))
}

#[test]
fn prometheus_scrapes_every_kvrouter_pod_and_alerts_on_exported_metrics() {
    let m = base();
    let data = m.data("kvrouter-prometheus");
    let cm = m.config_map("kvrouter-prometheus");
    assert_eq!(
        cm["metadata"]["name"], "kvrouter-prometheus",
        "a stable name to mount"
    );
    let config = yaml_doc(&data["prometheus.yml"]);
    let rule_files = list(&config, "/rule_files");
    assert!(!rule_files.is_empty(), "prometheus.yml loads no rules");
    for f in rule_files {
        let file = f.as_str().unwrap().rsplit('/').next().unwrap();
        assert!(
            data.contains_key(file),
            "rule file {file} is not in the ConfigMap"
        );
    }

    // The job keeps pods that are part of kvrouter, annotated, on the named ports.
    let job = list(&config, "/scrape_configs")
        .iter()
        .find(|j| j["job_name"] == "kvrouter")
        .expect("a kvrouter job");
    assert_eq!(job["kubernetes_sd_configs"][0]["role"], "pod");
    let keep = |label: &str| -> Vec<String> {
        let r = list(job, "/relabel_configs")
            .iter()
            .find(|r| r["action"] == "keep" && r["source_labels"][0] == label)
            .unwrap_or_else(|| panic!("no keep on {label}"));
        text(r, "/regex").split('|').map(str::to_string).collect()
    };
    assert_eq!(
        keep("__meta_kubernetes_pod_annotation_prometheus_io_scrape"),
        ["true"]
    );
    assert_eq!(
        keep("__meta_kubernetes_pod_label_app_kubernetes_io_part_of"),
        ["kvrouter"]
    );
    let ports = keep("__meta_kubernetes_pod_container_port_name");
    for mm in every() {
        for (w, c, sub) in mm.kvrouter_containers() {
            // The port each serves /metrics on: the admin address, or the frontend's listener.
            let env = mm.env(c);
            let addr = env
                .get("KVROUTER_ADMIN_ADDR")
                .or_else(|| env.get("KVROUTER_LISTEN"))
                .unwrap();
            let (_, port) = host_port(addr);
            let named = list(c, "/ports")
                .iter()
                .find(|p| p["containerPort"] == port)
                .unwrap_or_else(|| panic!("{}: {sub} does not open {port}", short(w)));
            assert!(
                ports.contains(&text(named, "/name").to_string()),
                "{}: {sub}'s metrics port {named} is not scraped ({ports:?})",
                short(w)
            );
            let meta = &w["spec"]["template"]["metadata"];
            assert_eq!(
                meta["annotations"]["prometheus.io/scrape"],
                "true",
                "{}",
                short(w)
            );
            assert_eq!(
                meta["labels"]["app.kubernetes.io/part-of"],
                "kvrouter",
                "{}",
                short(w)
            );
        }
    }

    // Alert rules: well formed, and every kvrouter series they use is one kvrouter exports.
    let rules = yaml_doc(&data["prometheus-rules.yaml"]);
    let registered = registered_metrics();
    let mut alerts = BTreeSet::new();
    let mut used = BTreeSet::new();
    for group in list(&rules, "/groups") {
        for rule in list(group, "/rules") {
            let name = text(rule, "/alert");
            assert!(alerts.insert(name.to_string()), "alert {name} twice");
            assert!(rule["labels"]["severity"].is_string(), "{name}: severity");
            assert!(
                rule["annotations"]["summary"].is_string(),
                "{name}: summary"
            );
            for (series, exported) in kvrouter_series(text(rule, "/expr"), &registered) {
                assert!(
                    exported,
                    "alert {name} uses {series}, which kvrouter does not export"
                );
                used.insert(series.to_string());
            }
        }
    }
    // The rules docs/operations.md quotes are the file's.
    let docs = std::fs::read_to_string(repo_file("docs/operations.md")).unwrap();
    let section = docs
        .split("### Alert rules")
        .nth(1)
        .expect("docs/operations.md has an Alert rules section");
    let quoted = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a YAML example in the Alert rules section");
    let all_rules: Vec<&Value> = list(&rules, "/groups")
        .iter()
        .flat_map(|g| list(g, "/rules"))
        .collect();
    let mut quoted_alerts = 0;
    for group in list(&yaml_doc(quoted), "/groups") {
        for rule in list(group, "/rules") {
            let name = text(rule, "/alert");
            let shipped = all_rules
                .iter()
                .find(|r| r["alert"] == name)
                .unwrap_or_else(|| panic!("docs quote alert {name}, which the rules lack"));
            assert_eq!(
                *shipped, rule,
                "docs/operations.md quotes {name} differently"
            );
            assert!(
                docs.contains(&format!("`{name}`")),
                "the table lacks {name}"
            );
            quoted_alerts += 1;
        }
    }
    assert!(quoted_alerts > 0);
    for name in &alerts {
        assert!(
            section.contains(&format!("`{name}`")),
            "docs/operations.md's Alert rules table lacks {name}"
        );
    }
    for needed in [
        "kvrouter_bus_connected",
        "kvrouter_workers",
        "kvrouter_route_errors_total",
        "kvrouter_route_decision_seconds_bucket",
        "kvrouter_kv_event_gaps_total",
        "kvrouter_state_recovery_failures_total",
    ] {
        assert!(used.contains(needed), "no alert on {needed}");
    }
}

// ---------------------------------------------------------------------------------------------
// Grafana

/// What the dashboard must chart, by row topic: every series of a topic in some panel.
const DASHBOARD_TOPICS: [(&str, &[&str]); 7] = [
    (
        "routes and errors",
        &["kvrouter_routes_total", "kvrouter_route_errors_total"],
    ),
    (
        "overhead by phase (replica and doors)",
        &[
            "kvrouter_route_decision_seconds_bucket",
            "kvrouter_route_phase_seconds_bucket",
            "kvrouter_frontend_phase_seconds_bucket",
            "kvrouter_epp_phase_seconds_bucket",
        ],
    ),
    (
        "hit rates by tier",
        &[
            "kvrouter_route_tier_hits_total",
            "kvrouter_route_tier_hit_blocks_total",
        ],
    ),
    (
        "predicted against reported cache hits",
        &[
            "kvrouter_frontend_cache_predicted_tokens_total",
            "kvrouter_frontend_cache_reported_tokens_total",
            "kvrouter_frontend_cache_mispredictions_total",
            "kvrouter_epp_cache_predicted_tokens_total",
            "kvrouter_epp_cache_reported_tokens_total",
            "kvrouter_epp_cache_mispredictions_total",
        ],
    ),
    (
        "per-worker load",
        &[
            "kvrouter_worker_active_blocks",
            "kvrouter_worker_reported_active_blocks",
            "kvrouter_worker_prefill_tokens",
        ],
    ),
    (
        "event freshness and index",
        &[
            "kvrouter_bridge_seconds_since_last_batch",
            "kvrouter_kv_event_gaps_total",
            "kvrouter_index_blocks",
        ],
    ),
    (
        "the bus",
        &[
            "kvrouter_bus_connected",
            "kvrouter_bus_disconnects_total",
            "kvrouter_undecodable_messages_total",
            "kvrouter_misattributed_messages_total",
            "kvrouter_replica_sync_peers",
        ],
    ),
];

/// Whether a Grafana datasource reference names the dashboard's `datasource` variable.
fn names_datasource_variable(ds: &Value) -> bool {
    ds["uid"] == "${datasource}" || ds["uid"] == "$datasource" || *ds == "${datasource}"
}

/// The argument text of every `histogram_quantile(...)` in a PromQL expression.
fn histogram_quantile_args(expr: &str) -> Vec<&str> {
    let mut args = Vec::new();
    for (at, _) in expr.match_indices("histogram_quantile(") {
        let start = at + "histogram_quantile(".len();
        let mut depth = 1;
        let end = expr[start..]
            .char_indices()
            .find_map(|(i, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                (depth == 0).then_some(start + i)
            })
            .unwrap_or_else(|| panic!("unbalanced histogram_quantile in {expr}"));
        args.push(&expr[start..end]);
    }
    args
}

/// The label lists of every `by (...)` in a PromQL expression.
fn by_clauses(expr: &str) -> Vec<Vec<&str>> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    expr.match_indices("by")
        .filter(|&(at, _)| {
            !expr[..at].ends_with(word) && expr[at + 2..].trim_start().starts_with('(')
        })
        .map(|(at, _)| {
            let rest = expr[at + 2..].trim_start().strip_prefix('(').unwrap();
            let labels = &rest[..rest.find(')').expect("a closed by clause")];
            labels.split(',').map(str::trim).collect()
        })
        .collect()
}

#[test]
fn the_grafana_dashboard_charts_every_topic_on_exported_metrics() {
    let m = base();
    let name = "kvrouter-grafana-dashboard";
    let cm = m.config_map(name);
    assert_eq!(cm["metadata"]["name"], name, "a stable name (no hash)");
    assert_eq!(
        cm["metadata"]["labels"]["grafana_dashboard"], "1",
        "{name}: Grafana's dashboard sidecar loads ConfigMaps labelled grafana_dashboard=\"1\""
    );
    let data = m.data(name);
    let raw = data
        .get("grafana-dashboard.json")
        .unwrap_or_else(|| panic!("{name} has no grafana-dashboard.json: {:?}", data.keys()));
    // `kubectl apply` keeps the whole object in an annotation of at most 256 KiB.
    assert!(
        raw.len() < 200 * 1024,
        "the dashboard is {} bytes: too big for `kubectl apply`",
        raw.len()
    );
    let dash: Value = serde_json::from_str(raw)
        .unwrap_or_else(|e| panic!("grafana-dashboard.json is not JSON: {e}"));
    assert!(!text(&dash, "/title").is_empty());
    assert!(
        !text(&dash, "/uid").is_empty(),
        "a uid, so links survive a re-import"
    );
    assert!(int(&dash, "/schemaVersion") >= 36, "schemaVersion");
    let registered = registered_metrics();
    let mut unexported = Vec::new();

    // Variables: the Prometheus datasource to pick, and the models (from an exported series).
    let vars = list(&dash, "/templating/list");
    let var = |n: &str| {
        vars.iter()
            .find(|v| v["name"] == n)
            .unwrap_or_else(|| panic!("no ${n} variable in the dashboard"))
    };
    let ds = var("datasource");
    assert_eq!(ds["type"], "datasource", "$datasource");
    assert_eq!(ds["query"], "prometheus", "$datasource");
    let model = var("model");
    assert!(
        names_datasource_variable(&model["datasource"]),
        "$model queries another datasource: {}",
        model["datasource"]
    );
    let model_query = model["query"]["query"]
        .as_str()
        .or(model["query"].as_str())
        .expect("$model's query");
    assert!(
        model_query.contains("kvrouter_routes_total"),
        "{model_query}"
    );
    for (series, ok) in kvrouter_series(model_query, &registered) {
        if !ok {
            unexported.push(format!("variable $model: {series}"));
        }
    }

    // Panels, with those inside collapsed rows.
    let mut panels = Vec::new();
    for p in list(&dash, "/panels") {
        panels.push(p);
        panels.extend(list(p, "/panels"));
    }
    assert!(
        panels.iter().any(|p| p["type"] == "row"),
        "no rows in the dashboard"
    );
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    let mut used = BTreeSet::new();
    let mut charts = 0;
    for p in &panels {
        let title = text(p, "/title");
        assert!(!title.is_empty(), "a panel without a title: {p}");
        assert!(titles.insert(title), "two panels titled {title:?}");
        assert!(ids.insert(int(p, "/id")), "{title}: id {} twice", p["id"]);
        let (x, w, h) = (
            int(p, "/gridPos/x"),
            int(p, "/gridPos/w"),
            int(p, "/gridPos/h"),
        );
        assert!(x >= 0 && w > 0 && h > 0 && x + w <= 24, "{title}: gridPos");
        if p["type"] == "row" {
            continue;
        }
        charts += 1;
        assert!(
            text(p, "/description").len() > 40,
            "{title}: a description saying what to look for"
        );
        assert!(
            names_datasource_variable(&p["datasource"]),
            "{title}: datasource {} is not $datasource",
            p["datasource"]
        );
        assert!(
            !text(p, "/fieldConfig/defaults/unit").is_empty(),
            "{title}: a unit"
        );
        let targets = list(p, "/targets");
        assert!(!targets.is_empty(), "{title}: no queries");
        let mut ref_ids = BTreeSet::new();
        for t in targets {
            assert!(
                ref_ids.insert(text(t, "/refId")),
                "{title}: refId {} twice",
                t["refId"]
            );
            if !t["datasource"].is_null() {
                assert!(
                    names_datasource_variable(&t["datasource"]),
                    "{title}: a query on datasource {}",
                    t["datasource"]
                );
            }
            assert!(
                !text(t, "/legendFormat").is_empty(),
                "{title}: a query without a legendFormat"
            );
            let expr = text(t, "/expr");
            let mut named = 0;
            for (series, ok) in kvrouter_series(expr, &registered) {
                named += 1;
                used.insert(series);
                if !ok {
                    unexported.push(format!("{title}: {series}"));
                }
            }
            assert!(named > 0, "{title}: {expr} charts no kvrouter series");
            // A quantile of a classic histogram needs its buckets, summed keeping `le`.
            for arg in histogram_quantile_args(expr) {
                let series: Vec<_> = kvrouter_series(arg, &registered).collect();
                assert!(
                    !series.is_empty() && series.iter().all(|(s, _)| s.ends_with("_bucket")),
                    "{title}: histogram_quantile over {series:?}, not _bucket series: {expr}"
                );
                assert!(
                    arg.contains("rate("),
                    "{title}: buckets without rate: {expr}"
                );
                let bys = by_clauses(arg);
                assert!(
                    !bys.is_empty() && bys.iter().all(|labels| labels.contains(&"le")),
                    "{title}: histogram_quantile without `le` in its `by`: {expr}"
                );
            }
        }
    }
    assert!(
        (20..=40).contains(&charts),
        "{charts} panels: keep the dashboard readable"
    );
    assert!(
        unexported.is_empty(),
        "the dashboard charts series kvrouter does not export:\n  {}",
        unexported.join("\n  ")
    );
    for (topic, needed) in DASHBOARD_TOPICS {
        let missing: Vec<_> = needed.iter().filter(|s| !used.contains(*s)).collect();
        assert!(
            missing.is_empty(),
            "the dashboard does not cover {topic}: no panel charts {missing:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The kvrouter containers, started from their rendered settings

/// `kvrouter` with exactly the container's `KVROUTER_*` environment plus `overrides`.
pub(crate) fn kvrouter_with_env(
    env: &BTreeMap<String, String>,
    overrides: &[(&str, String)],
) -> std::process::Command {
    let mut cmd = kvrouter();
    for (k, _) in
        std::env::vars().filter(|(k, _)| k.starts_with("KVROUTER_") && k != "KVROUTER_LOG")
    {
        cmd.env_remove(k);
    }
    for (k, v) in env.iter().filter(|(k, _)| k.starts_with("KVROUTER_")) {
        cmd.env(k, v);
    }
    for (k, v) in overrides {
        cmd.env(k, v);
    }
    cmd
}

pub(crate) fn args_of(c: &Value) -> Vec<String> {
    list(c, "/args")
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// SIGTERM: the process exits with status 0 within the pod's grace period.
fn stops_within_grace(p: Proc, w: &Value) {
    let grace = int(w, "/spec/template/spec/terminationGracePeriodSeconds") as u64;
    let started = Instant::now();
    let name = p.name.clone();
    let status = p
        .terminate(Duration::from_secs(grace))
        .unwrap_or_else(|| panic!("{name}: still running {grace} s after SIGTERM"));
    assert!(status.success(), "{name}: exit {status} on SIGTERM");
    assert!(started.elapsed() < Duration::from_secs(grace), "{name}");
}

/// Polls a probe path until it answers 200.
pub(crate) fn probe_ok(port: u16, path: &str, who: &str) {
    assert!(
        wait_until(Duration::from_secs(30), || http_get(port, path).0 == 200),
        "{who} never answered 200 on {path}: {:?}",
        http_get(port, path)
    );
}

/// The frontend's model directories, fetched by the init container's script into `volume`
/// (standing in for the pod's volume) from a stand-in Hub that serves a model directory made
/// as the Hub ships one. Returns KVROUTER_MODEL_DIRS with the directories moved there.
fn fetch_tokenizers(m: &Manifests, volume: &Path, scratch: &Path) -> String {
    let (w, c) = m.kvrouter("frontend");
    let init = container(w, "fetch-tokenizer");
    let script = text(init, "/args/0");
    assert_eq!(list(init, "/command"), ["sh", "-ec"]);
    let out = run_tool("sh", &["-n", "-c", script], None, "sh");
    stdout_of(&out, "sh -n on the fetch-tokenizer script");
    let python: String = script
        .lines()
        .skip_while(|l| !l.contains("<<'PY'"))
        .skip(1)
        .take_while(|l| *l != "PY")
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(python.contains("snapshot_download"), "{script}");

    let made = scratch.join("made");
    let out = run_tool(
        "python3",
        &[
            "tests/engines/make_model_dir.py",
            "build",
            made.to_str().unwrap(),
        ],
        None,
        "make_model_dir.py (tokenizers)",
    );
    stdout_of(&out, "make_model_dir.py build");
    let stub = scratch.join("stub/huggingface_hub");
    std::fs::create_dir_all(&stub).unwrap();
    std::fs::write(
        stub.join("__init__.py"),
        "import fnmatch, os, shutil\n\
         def snapshot_download(repo_id, local_dir, allow_patterns=None, revision=None, **kw):\n\
         \x20   assert revision and len(revision) == 40, f'{repo_id} fetched at {revision!r}'\n\
         \x20   src = os.environ['STUB_MODEL_DIR']\n\
         \x20   os.makedirs(local_dir, exist_ok=True)\n\
         \x20   for f in os.listdir(src):\n\
         \x20       p = os.path.join(src, f)\n\
         \x20       if os.path.isfile(p) and any(fnmatch.fnmatch(f, a) for a in allow_patterns):\n\
         \x20           shutil.copy(p, local_dir)\n\
         \x20   return local_dir\n",
    )
    .unwrap();

    let env = m.env(init);
    let first_dir = env["KVROUTER_MODEL_DIRS"]
        .split(',')
        .next()
        .and_then(|spec| spec.split_once('='))
        .expect("NAME=DIR")
        .1;
    let mount = list(c, "/volumeMounts")
        .iter()
        .map(|v| text(v, "/mountPath"))
        .find(|p| first_dir.starts_with(&format!("{p}/")))
        .expect("the models volume");
    let models = env["KVROUTER_MODEL_DIRS"]
        .replace(&format!("={mount}/"), &format!("={}/", volume.display()));
    let out = Command::new("python3")
        .args(["-c", &python])
        .env("KVROUTER_MODEL_DIRS", &models)
        .env("MODEL_REVISIONS", &env["MODEL_REVISIONS"])
        .env("STUB_MODEL_DIR", &made)
        .env("PYTHONPATH", scratch.join("stub"))
        .output()
        .expect("python3 runs");
    stdout_of(&out, "the fetch-tokenizer script");
    for spec in models.split(',') {
        let (_, dir) = spec.split_once('=').unwrap();
        assert!(
            Path::new(dir).join("tokenizer.json").is_file(),
            "nothing fetched into {dir}"
        );
    }
    models
}

/// The port of the `ip:port` at `pointer` in a start line (processes given port 0 say which
/// one they bound).
pub(crate) fn port_in(line: &serde_json::Value, pointer: &str) -> u16 {
    text(line, pointer)
        .parse::<std::net::SocketAddr>()
        .unwrap_or_else(|e| panic!("{pointer} in {line} is no address: {e}"))
        .port()
}

/// The base's replica, bridge and frontend started from their rendered settings (addresses
/// moved to loopback), each with its own `kvrouter creds` identity on NATS started from the
/// rendered configuration, with an emulated vLLM engine as vllm.yaml starts it: every probe
/// path answers, a completion goes through the frontend, the replica and the engine, and
/// each process exits within its pod's grace period on SIGTERM.
#[test]
fn a_fleet_runs_from_the_rendered_settings() {
    let m = base();
    let (sw, sc) = m.kvrouter("serve");
    let (bw, bc) = m.kvrouter("bridge");
    let (fw, fc) = m.kvrouter("frontend");

    // The credentials as the operator makes them (docs/operations.md, "Kubernetes"): the
    // replica's id is its pod name, the bridge's worker id its pod index. NATS starts as its
    // pod does, with the users file from the Secret; each process gets its own seed from its
    // Secret, where KVROUTER_NATS_NKEY_FILE is moved to.
    let replica_id = m.env(sc)["KVROUTER_REPLICA_ID"].clone();
    let worker_id = m.env(bc)["KVROUTER_WORKER_ID"].clone();
    let creds = tempfile::tempdir().unwrap();
    let out = run(&[
        "creds",
        "--out",
        creds.path().to_str().unwrap(),
        "--namespace",
        &m.env(sc)["KVROUTER_NAMESPACE"],
        "--replica-ids",
        &replica_id,
        "--worker-ids",
        &worker_id,
    ]);
    stdout_of(&out, "kvrouter creds");
    let k8s = std::fs::read_to_string(creds.path().join("kubernetes.yaml")).unwrap();
    let secret = |name: &str, key: &str| -> String {
        let doc = yaml_docs(&k8s)
            .into_iter()
            .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("kvrouter creds wrote no Secret {name}"));
        text(
            &doc,
            &format!("/stringData/{}", key.replace('~', "~0").replace('/', "~1")),
        )
        .to_string()
    };
    let layout = NatsLayout::new(m, Some(&secret(USERS_SECRET, USERS_KEY)));
    let (_nats, nats_port) = layout.start();
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let seed_file = |name: &str, content: String| -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = creds.path().join(format!("{name}.seed"));
        std::fs::write(&path, content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        path.to_str().unwrap().to_string()
    };
    let serve_seed = seed_file(
        "serve",
        secret(REPLICAS_SECRET, &format!("replica-{replica_id}.nk")),
    );
    let bridge_seed = seed_file(
        "bridge",
        secret(&format!("kvrouter-nats-bridge-{worker_id}"), SEED_KEY),
    );
    let frontend_seed = seed_file("frontend", secret(FRONTEND_SECRET, SEED_KEY));

    // The replica.
    let (admin, api) = (free_port(), free_port());
    let mut cmd = kvrouter_with_env(
        &m.env(sc),
        &[
            ("KVROUTER_NATS", nats_url.clone()),
            ("KVROUTER_NATS_NKEY_FILE", serve_seed),
            ("KVROUTER_ADMIN_ADDR", format!("127.0.0.1:{admin}")),
            ("KVROUTER_HTTP_ADDR", format!("127.0.0.1:{api}")),
        ],
    );
    cmd.args(args_of(sc));
    let serve = spawn_proc("kvrouter serve", cmd);
    probe_ok(admin, &http_probe(sc, "readinessProbe").0, "the replica");
    probe_ok(admin, &http_probe(sc, "livenessProbe").0, "the replica");
    assert!(metrics(admin).contains("kvrouter_bus_connected 1"));
    assert_eq!(
        http_get(api, "/v1/workers").0,
        200,
        "the JSON API on the api port"
    );

    // The engine, with the model, block size and ranks the bridge's settings give vLLM.
    let env = m.env(bc);
    let ports = free_ports(5);
    let (zmq, http) = (ports, ports + 4);
    let dp = env
        .get("KVROUTER_DP_SIZE")
        .cloned()
        .unwrap_or_else(|| "1".into());
    let mut engine = kvrouter_proc(
        "engine",
        &[
            "mocker",
            "--emulate",
            "vllm",
            "--zmq-port",
            &zmq.to_string(),
            "--http-port",
            &http.to_string(),
            "--model",
            &env["KVROUTER_MODEL"],
            "--block-size",
            &env["KVROUTER_BLOCK_SIZE"],
            "--dp-size",
            &dp,
            "--capacity-blocks",
            "4096",
            "--speedup",
            "20",
        ],
    );
    let at = engine.first_json();
    let mut cmd = kvrouter_with_env(
        &env,
        &[
            ("KVROUTER_NATS", nats_url.clone()),
            ("KVROUTER_NATS_NKEY_FILE", bridge_seed),
            ("KVROUTER_ADMIN_ADDR", "127.0.0.1:0".to_string()),
            ("KVROUTER_BASE_URL", text(&at, "/base_url").to_string()),
            (
                "KVROUTER_ZMQ_ENDPOINT",
                text(&at, "/zmq_endpoint").to_string(),
            ),
            (
                "KVROUTER_REPLAY_ENDPOINT",
                text(&at, "/replay_endpoint").to_string(),
            ),
            // The mocker's publisher binds (as vLLM's would on a wildcard endpoint).
            ("KVROUTER_ZMQ_BIND", "false".to_string()),
            (
                "KVROUTER_HEALTH_URL",
                format!("{}/health", text(&at, "/base_url")),
            ),
            (
                "KVROUTER_METRICS_URL",
                format!("{}/metrics", text(&at, "/base_url")),
            ),
        ],
    );
    cmd.args(args_of(bc));
    let mut bridge = spawn_proc("kvrouter bridge", cmd);
    let bridge_admin = port_in(&bridge.first_json(), "/admin");
    probe_ok(
        bridge_admin,
        &http_probe(bc, "readinessProbe").0,
        "the bridge",
    );
    probe_ok(
        bridge_admin,
        &http_probe(bc, "livenessProbe").0,
        "the bridge",
    );
    assert!(
        wait_until(Duration::from_secs(20), || metric_sum(
            admin,
            "kvrouter_workers"
        ) >= 1.0),
        "the replica never saw the bridge's worker (namespace or model disagree?)"
    );

    // The frontend, on the tokenizer its init container fetched.
    let scratch = tempfile::tempdir().unwrap();
    let volume = tempfile::tempdir().unwrap();
    let models = fetch_tokenizers(m, volume.path(), scratch.path());
    let mut cmd = kvrouter_with_env(
        &m.env(fc),
        &[
            ("KVROUTER_NATS", nats_url.clone()),
            ("KVROUTER_NATS_NKEY_FILE", frontend_seed),
            ("KVROUTER_LISTEN", "127.0.0.1:0".to_string()),
            ("KVROUTER_MODEL_DIRS", models),
        ],
    );
    cmd.args(args_of(fc));
    let mut frontend = spawn_proc("kvrouter frontend", cmd);
    let listen = port_in(&frontend.first_json(), "/listen");
    probe_ok(listen, &http_probe(fc, "readinessProbe").0, "the frontend");
    probe_ok(listen, &http_probe(fc, "livenessProbe").0, "the frontend");
    let body = serde_json::json!({
        "model": env["KVROUTER_MODEL"],
        "prompt": "The manifests render, validate and run. ".repeat(8),
        "max_tokens": 4,
    });
    let (status, answer) = http_post(listen, "/v1/completions", &[], &body.to_string());
    assert_eq!(status, 200, "a completion through the frontend: {answer}");

    stops_within_grace(frontend, fw);
    stops_within_grace(bridge, bw);
    stops_within_grace(serve, sw);
    drop(engine);
}

// ---------------------------------------------------------------------------------------------
// Dockerfile

struct Stage {
    image: String,
    name: Option<String>,
    /// (instruction, arguments), continuation lines joined.
    steps: Vec<(String, String)>,
}

fn dockerfile() -> (BTreeMap<String, String>, Vec<Stage>) {
    let text = std::fs::read_to_string(repo_file("Dockerfile")).expect("a Dockerfile");
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && current.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(t);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    let mut stages: Vec<Stage> = Vec::new();
    for l in logical.iter().filter(|l| !l.is_empty()) {
        let (op, rest) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
        let op = op.to_ascii_uppercase();
        let rest = rest.trim().to_string();
        if op == "FROM" {
            let words: Vec<&str> = rest.split_whitespace().collect();
            let mut image = words[0].to_string();
            for (k, v) in &args {
                image = image.replace(&format!("${{{k}}}"), v);
            }
            let name = (words.len() == 3 && words[1].eq_ignore_ascii_case("as"))
                .then(|| words[2].to_string());
            stages.push(Stage {
                image,
                name,
                steps: Vec::new(),
            });
        } else if let Some(stage) = stages.last_mut() {
            stage.steps.push((op, rest));
        } else if op == "ARG" {
            if let Some((k, v)) = rest.split_once('=') {
                args.insert(k.to_string(), v.to_string());
            }
        }
    }
    (args, stages)
}

/// `name = "..."` of the root package's `[[bin]]`.
fn bin_name() -> String {
    let toml = std::fs::read_to_string(repo_file("Cargo.toml")).unwrap();
    let bin = toml
        .split("[[bin]]")
        .nth(1)
        .expect("a [[bin]] in Cargo.toml");
    let line = bin
        .lines()
        .find(|l| l.trim_start().starts_with("name"))
        .expect("its name");
    line.split('"').nth(1).unwrap().to_string()
}

fn version_of(s: &str) -> (u32, u32) {
    let mut parts = s.split('.').map(|p| p.parse::<u32>().expect("a version"));
    (parts.next().unwrap(), parts.next().unwrap_or(0))
}

#[test]
fn the_dockerfile_builds_kvrouter_into_a_non_root_image() {
    let (args, stages) = dockerfile();
    assert!(stages.len() >= 2, "a builder and a runtime stage");
    let builder = &stages[0];
    let runtime = stages.last().unwrap();
    let builder_name = builder.name.as_deref().expect("the builder stage is named");
    assert!(
        builder.image.starts_with("rust:"),
        "builder image {}",
        builder.image
    );

    // The toolchain is at least the workspace's rust-version.
    let toml = std::fs::read_to_string(repo_file("Cargo.toml")).unwrap();
    let msrv = toml
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("rust-version")
        .trim_matches('"');
    let tag = image_tag(&builder.image);
    let rust = tag.split('-').next().unwrap();
    assert!(
        version_of(rust) >= version_of(msrv),
        "rust {rust} < rust-version {msrv} ({args:?})"
    );

    // It builds the binary that exists, in release mode, from the lock file.
    let bin = bin_name();
    let build = builder
        .steps
        .iter()
        .find(|(op, a)| op == "RUN" && a.contains("cargo build"))
        .map(|(_, a)| a.as_str())
        .expect("a cargo build");
    let words: Vec<&str> = build.split_whitespace().collect();
    for want in ["--release", "--locked"] {
        assert!(words.contains(&want), "the build lacks {want}: {build}");
    }
    assert!(
        words.windows(2).any(|w| w == ["--bin", bin.as_str()]),
        "the build does not name --bin {bin}: {build}"
    );
    assert!(build.contains(&format!("target/release/{bin}")), "{build}");

    // The runtime copies it from the builder, runs it as a non-root user, and opens the ports
    // the manifests use.
    assert_ne!(runtime.image, builder.image);
    let step = |op: &str| -> Vec<&str> {
        runtime
            .steps
            .iter()
            .filter(|(o, _)| o == op)
            .map(|(_, a)| a.as_str())
            .collect()
    };
    assert!(
        step("COPY")
            .iter()
            .any(|a| a.contains(&format!("--from={builder_name}"))),
        "the runtime copies from {builder_name}"
    );
    let user = *step("USER").last().expect("a USER in the final stage");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid != "root" && uid != "0" && !uid.is_empty(),
        "USER {user}"
    );
    assert!(
        uid.parse::<u32>().is_ok(),
        "USER {user}: numeric, so runAsNonRoot can check it"
    );
    let entry: Vec<String> =
        serde_json::from_str(step("ENTRYPOINT").last().expect("an ENTRYPOINT"))
            .expect("ENTRYPOINT in exec form");
    assert!(
        entry[0] == bin || entry[0].ends_with(&format!("/{bin}")),
        "{entry:?}"
    );
    let exposed: BTreeSet<u16> = step("EXPOSE")
        .iter()
        .flat_map(|a| a.split_whitespace())
        .map(|p| p.split('/').next().unwrap().parse().expect("a port"))
        .collect();
    for (w, c, _) in base().kvrouter_containers() {
        for p in list(c, "/ports") {
            let port = int(p, "/containerPort") as u16;
            assert!(
                exposed.contains(&port),
                "{}: port {port} not EXPOSEd",
                short(w)
            );
        }
        // The manifests' UID is the image's.
        let uid_manifest = c["securityContext"]["runAsUser"]
            .as_i64()
            .or_else(|| pod_spec(w)["securityContext"]["runAsUser"].as_i64())
            .unwrap();
        assert_eq!(uid_manifest.to_string(), uid, "{}", short(w));
    }

    // The build context leaves out what the build does not need, and keeps what it does.
    let ignore = std::fs::read_to_string(repo_file(".dockerignore")).expect("a .dockerignore");
    let entries: BTreeSet<&str> = ignore
        .lines()
        .map(|l| l.trim().trim_end_matches('/'))
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for out in ["target", ".tools", ".git"] {
        assert!(entries.contains(out), ".dockerignore keeps {out}");
    }
    for needed in ["Cargo.toml", "Cargo.lock", "build.rs", "bin", "crates"] {
        assert!(!entries.contains(needed), ".dockerignore drops {needed}");
    }
}
