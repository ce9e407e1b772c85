//! deploy/kubernetes locked by default, checked on the rendered base and overlay: NATS admits
//! only the users `kvrouter creds` writes (and starts only with them), each process holds only
//! its own nkey seed, NetworkPolicies admit only who needs each port, and every image, package
//! and model revision is pinned.
//!
//! NetworkPolicies are evaluated here as the API defines them (ingress, pod and namespace
//! selectors, named and numbered ports), so "who may connect to whom" is asserted as a table
//! of sources and ports rather than by reading selectors.

use crate::common::*;
use crate::k8s_manifests::{
    all_containers, container, container_port, every, host_port, image_name, image_tag, list,
    pod_labels, pod_spec, short, text, Manifests, POD_NAME, SETUP,
};
use kvrouter_bus::{Bus, BusError, NatsOptions};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// An authorization file of the shape `kvrouter creds` writes (its `nats-users.conf`): an nkey
/// user (the public key of nkeys' documentation), and a password user the tests connect as.
pub(crate) const USERS_SAMPLE: &str = r#"authorization {
  users = [
    { nkey: "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4" }
    { user: "probe", password: "probe-pw" }
  ]
}
"#;

// ---------------------------------------------------------------------------------------------
// The credentials interface of `kvrouter creds` (docs/operations.md, "Kubernetes")

pub(crate) const USERS_SECRET: &str = "kvrouter-nats-users";
pub(crate) const USERS_KEY: &str = "nats-users.conf";
pub(crate) const REPLICAS_SECRET: &str = "kvrouter-nats-replicas";
pub(crate) const FRONTEND_SECRET: &str = "kvrouter-nats-frontend";
pub(crate) const SEED_KEY: &str = "seed.nk";
/// The servers' certificate for overlays/nats-tls (cert-manager's keys), made by the operator.
const TLS_SECRET: &str = "nats-tls";
/// The endpoint picker's ext_proc certificate for overlays/gateway, made by the operator.
const EPP_TLS_SECRET: &str = "kvrouter-epp-tls";

/// The Secrets `kvrouter creds` writes, by name: which keys each holds (`None`: any key of
/// the form `replica-<id>.nk`). Frontends beyond the first (`--frontends N`) are
/// `kvrouter-nats-frontend-<i>`; endpoint pickers (`--epps N`) `kvrouter-nats-epp-<i>`.
fn creds_secret_keys(name: &str) -> Option<Option<&'static str>> {
    let numbered = |prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match name {
        USERS_SECRET => Some(Some(USERS_KEY)),
        REPLICAS_SECRET => Some(None),
        FRONTEND_SECRET => Some(Some(SEED_KEY)),
        _ if numbered("kvrouter-nats-bridge-")
            || numbered("kvrouter-nats-peer-")
            || numbered("kvrouter-nats-frontend-")
            || numbered("kvrouter-nats-epp-") =>
        {
            Some(Some(SEED_KEY))
        }
        _ => None,
    }
}

/// Every Secret a pod template refers to: (container or "volume NAME", Secret, key or None
/// for the whole Secret, optional).
fn secret_refs(w: &Value) -> Vec<(String, String, Option<String>, bool)> {
    let mut out = Vec::new();
    let optional = |v: &Value| v["optional"] == true;
    for c in all_containers(w) {
        let who = format!("container {}", text(c, "/name"));
        for e in list(c, "/env") {
            if let Some(r) = e.pointer("/valueFrom/secretKeyRef") {
                out.push((
                    who.clone(),
                    text(r, "/name").into(),
                    Some(text(r, "/key").into()),
                    optional(r),
                ));
            }
        }
        for src in list(c, "/envFrom") {
            if let Some(r) = src.get("secretRef") {
                out.push((who.clone(), text(r, "/name").into(), None, optional(r)));
            }
        }
    }
    for v in list(pod_spec(w), "/volumes") {
        let who = format!("volume {}", text(v, "/name"));
        let mut secrets: Vec<(&Value, String)> = Vec::new();
        if let Some(s) = v.get("secret") {
            secrets.push((s, text(s, "/secretName").into()));
        }
        for src in list(v, "/projected/sources") {
            if let Some(s) = src.get("secret") {
                secrets.push((s, text(s, "/name").into()));
            }
        }
        for (s, name) in secrets {
            let items = list(s, "/items");
            if items.is_empty() {
                out.push((who.clone(), name.clone(), None, optional(s)));
            }
            for item in items {
                out.push((
                    who.clone(),
                    name.to_string(),
                    Some(text(item, "/key").into()),
                    optional(s),
                ));
            }
        }
    }
    out
}

/// The volume (by name) of a pod template, or None.
fn volume<'a>(w: &'a Value, name: &str) -> Option<&'a Value> {
    list(pod_spec(w), "/volumes")
        .iter()
        .find(|v| v["name"] == name)
}

/// The Secrets a volume projects (a `secret` or a `projected` volume).
fn volume_secrets(v: &Value) -> Vec<String> {
    let mut names = Vec::new();
    if let Some(n) = v.pointer("/secret/secretName").and_then(Value::as_str) {
        names.push(n.to_string());
    }
    for src in list(v, "/projected/sources") {
        if let Some(n) = src.pointer("/secret/name").and_then(Value::as_str) {
            names.push(n.to_string());
        }
    }
    names
}

/// The volume mount whose path holds `path` (the longest such mount path).
pub(crate) fn mount_of<'a>(c: &'a Value, path: &str) -> &'a Value {
    list(c, "/volumeMounts")
        .iter()
        .filter(|m| path.starts_with(&format!("{}/", text(m, "/mountPath"))))
        .max_by_key(|m| text(m, "/mountPath").len())
        .unwrap_or_else(|| panic!("{}: {path} is on no volume", short(c)))
}

/// The shell script a container runs (`sh -ec SCRIPT` as command, or command `sh -ec` and the
/// script as its first argument).
pub(crate) fn shell_script(c: &Value) -> String {
    let words: Vec<&str> = list(c, "/command")
        .iter()
        .chain(list(c, "/args"))
        .map(|a| a.as_str().expect("string command"))
        .collect();
    assert!(
        words.len() == 3 && words[0] == "sh" && words[1] == "-ec",
        "{}: not `sh -ec SCRIPT`: {words:?}",
        short(c)
    );
    words[2].to_string()
}

// ---------------------------------------------------------------------------------------------
// NATS, started as its pod starts it

/// The NATS pod's files laid out in a temporary directory: each volume mount of the nats
/// container at ROOT/<mountPath> (ConfigMaps written out, the users Secret from `users`,
/// emptyDirs made), and its start script with every mount path moved under ROOT.
pub(crate) struct NatsLayout {
    _root: tempfile::TempDir,
    pub(crate) script: String,
    pub(crate) config: PathBuf,
    /// The CA of the servers' certificate, when the pod mounts one (overlays/nats-tls).
    pub(crate) ca: Option<PathBuf>,
}

impl NatsLayout {
    pub(crate) fn new(m: &Manifests, users: Option<&str>) -> Self {
        let sts = m.get("StatefulSet", "nats");
        let c = container(sts, "nats");
        let root = tempfile::tempdir().unwrap();
        let under = |p: &str| root.path().join(p.trim_start_matches('/'));
        let mut mounts: Vec<String> = Vec::new();
        let mut users_path = None;
        let mut ca = None;
        for mount in list(c, "/volumeMounts") {
            let at = text(mount, "/mountPath");
            mounts.push(at.to_string());
            std::fs::create_dir_all(under(at)).unwrap();
            let v = volume(sts, text(mount, "/name")).expect("a mounted volume");
            if let Some(cm) = v.pointer("/configMap/name").and_then(Value::as_str) {
                let data = m.get("ConfigMap", cm)["data"].as_object().unwrap().clone();
                for (k, v) in data {
                    std::fs::write(under(at).join(k), v.as_str().unwrap()).unwrap();
                }
            } else if v.pointer("/secret/secretName") == Some(&json!(USERS_SECRET)) {
                let item = list(v, "/secret/items")
                    .iter()
                    .find(|i| i["key"] == USERS_KEY)
                    .expect("the users file's item");
                let path = under(at).join(text(item, "/path"));
                if let Some(u) = users {
                    std::fs::write(&path, u).unwrap();
                }
                users_path = Some(path);
            } else if v.pointer("/secret/secretName") == Some(&json!(TLS_SECRET)) {
                // A CA and a certificate for 127.0.0.1, as the Secret holds them.
                make_tls(&under(at));
                ca = Some(under(at).join("ca.crt"));
            }
        }
        // Longest first, so that a mount inside another moves as itself.
        mounts.sort_by_key(|p| std::cmp::Reverse(p.len()));
        let relocate = |s: &str| {
            let mut out = String::new();
            let mut rest = s;
            'scan: while !rest.is_empty() {
                for at in &mounts {
                    if rest.starts_with(&format!("{at}/")) {
                        out.push_str(under(at).to_str().unwrap());
                        rest = &rest[at.len()..];
                        continue 'scan;
                    }
                }
                let ch = rest.chars().next().unwrap();
                out.push(ch);
                rest = &rest[ch.len_utf8()..];
            }
            out
        };
        // The config's own absolute paths (the pid file) move with their volumes too.
        for at in &mounts {
            for entry in std::fs::read_dir(under(at)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "conf")
                    && Some(&path) != users_path.as_ref()
                {
                    let conf = std::fs::read_to_string(&path).unwrap();
                    std::fs::write(&path, relocate(&conf)).unwrap();
                }
            }
        }
        assert!(
            users_path.is_some(),
            "{}: the nats container does not mount the users Secret",
            m.dir
        );
        let original = shell_script(c);
        let config = original
            .split_whitespace()
            .skip_while(|a| *a != "--config")
            .nth(1)
            .expect("nats-server --config FILE");
        Self {
            script: relocate(&original),
            config: under(config),
            ca,
            _root: root,
        }
    }

    /// Starts NATS as its pod does ([`NatsLayout::command`]) on a free port, waiting until it
    /// listens; returns it (killed when dropped) and the client port.
    pub(crate) fn start(&self) -> (Proc, u16) {
        let port = free_port();
        let mut cmd = self.command(port);
        cmd.stderr(std::process::Stdio::null());
        let nats = spawn_proc("nats (as its pod starts it)", cmd);
        assert!(
            wait_until(Duration::from_secs(10), || std::net::TcpStream::connect((
                "127.0.0.1",
                port
            ))
            .is_ok()),
            "nats-server did not start from the rendered configuration"
        );
        (nats, port)
    }

    /// Runs the pod's start script (a real nats-server behind it, its ports moved to free
    /// loopback ones so tests do not collide), with SERVER_NAME as the pod's env gives it.
    fn command(&self, port: u16) -> Command {
        let real = which("nats-server");
        let bin = self._root.path().join("test-bin");
        std::fs::create_dir_all(&bin).unwrap();
        let wrapper = bin.join("nats-server");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nexec '{}' -a 127.0.0.1 -p {port} -m {} --cluster nats://127.0.0.1:{} \"$@\"\n",
                real.display(),
                free_port(),
                free_port()
            ),
        )
        .unwrap();
        let mut perms = std::fs::metadata(&wrapper).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&wrapper, perms).unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-ec", &self.script])
            .env("SERVER_NAME", "nats-0")
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin.display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            );
        cmd
    }
}

/// `ca.crt`, and `tls.crt` + `tls.key` signed by it for 127.0.0.1 (server and client auth,
/// as overlays/nats-tls asks), as the Secret holds them, in `dir`.
fn make_tls(dir: &Path) {
    let certs = kvrouter_testkit::TestCerts::generate(dir).expect("openssl makes certificates");
    for (from, to) in [
        (&certs.ca, "ca.crt"),
        (&certs.member_cert, "tls.crt"),
        (&certs.member_key, "tls.key"),
    ] {
        std::fs::copy(from, dir.join(to)).unwrap();
    }
}

fn which(program: &str) -> PathBuf {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} is not on PATH; {SETUP}"))
}

fn connect_as(port: u16, user: Option<(&str, &str)>, ca: Option<&Path>) -> Result<Bus, BusError> {
    let mut opts = NatsOptions::new(format!("nats://127.0.0.1:{port}"));
    if let Some(ca) = ca {
        opts.tls_ca_file = Some(ca.to_path_buf());
        opts.tls_required = true;
    }
    if let Some((u, p)) = user {
        opts.user = Some(u.into());
        opts.password = Some(p.into());
    }
    opts.connect_timeout = Duration::from_secs(2);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let bus = Bus::connect(&opts).await?;
            bus.flush().await?;
            Ok(bus)
        })
}

#[test]
fn nats_starts_only_with_its_users_and_admits_no_one_else() {
    for m in every() {
        let dir = m.dir;
        let sts = m.get("StatefulSet", "nats");

        // The users file comes from the Secret `kvrouter creds` writes, and not optionally:
        // without it the pod does not start.
        let refs = secret_refs(sts);
        assert!(
            refs.iter()
                .any(|(who, name, key, optional)| who.starts_with("volume ")
                    && name == USERS_SECRET
                    && key.as_deref() == Some(USERS_KEY)
                    && !optional),
            "{dir}: NATS does not mount {USERS_SECRET}/{USERS_KEY} (required): {refs:?}"
        );

        // With it, the server starts, admits a user of the file and refuses anyone else.
        let layout = NatsLayout::new(m, Some(USERS_SAMPLE));
        let ca = layout.ca.as_deref();
        let (_nats, port) = layout.start();
        assert!(
            connect_as(port, Some(("probe", "probe-pw")), ca).is_ok(),
            "{dir}: a user of the included users file is refused"
        );
        match connect_as(port, None, ca) {
            Err(BusError::Connect(msg)) => assert!(
                msg.to_lowercase().contains("authoriz"),
                "{dir}: an anonymous client refused for another reason: {msg}"
            ),
            Err(other) => panic!("{dir}: {other:?}"),
            Ok(_) => panic!("{dir}: an anonymous client got in: the users file is not enforced"),
        }
        assert!(
            connect_as(port, Some(("probe", "wrong")), ca).is_err(),
            "{dir}: a wrong password got in"
        );
        if ca.is_some() {
            // With TLS on, the server demands it, and a client that does not trust its CA
            // gets nowhere.
            assert!(
                connect_as(port, Some(("probe", "probe-pw")), None).is_err(),
                "{dir}: a client without the CA got in"
            );
            let mut plain = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            plain
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut info = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut plain), &mut info)
                .unwrap();
            assert!(info.contains("\"tls_required\":true"), "{dir}: {info}");
        }

        // Without users in it (an empty file, as a failed generation might leave), or without
        // the file, it refuses to start rather than run open.
        for (what, users) in [("an empty users file", Some("")), ("no users file", None)] {
            let layout = NatsLayout::new(m, users);
            let port = free_port();
            let log = tempfile::NamedTempFile::new().unwrap();
            let mut child = layout
                .command(port)
                .stdout(std::process::Stdio::null())
                .stderr(log.reopen().unwrap())
                .spawn()
                .unwrap();
            let exited = wait_until(Duration::from_secs(10), || {
                child.try_wait().unwrap().is_some()
            });
            let open = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            if !exited {
                let _ = child.kill();
                let _ = child.wait();
            }
            let err = std::fs::read_to_string(log.path()).unwrap();
            assert!(
                exited && !child.wait().unwrap().success() && !open,
                "{dir}: NATS started with {what} (listening: {open}): {err}"
            );
            if users.is_some() {
                assert!(
                    err.contains("refusing to start") && err.contains("kvrouter creds"),
                    "{dir}: with {what} the log should say why and what to do: {err}"
                );
            }
        }
    }
}

#[test]
fn the_nats_config_includes_the_users_file_and_nothing_grants_every_reply() {
    for m in every() {
        let dir = m.dir;
        let sts = m.get("StatefulSet", "nats");
        let c = container(sts, "nats");
        let conf = &m.data("nats-config")["nats.conf"];
        let active: Vec<&str> = conf
            .lines()
            .map(|l| l.split('#').next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .collect();
        // Authorization only through the included users file: none inline (an inline block
        // would be replaced, or merged, by the file's), and no user admitted without one.
        for l in &active {
            for banned in ["authorization", "no_auth_user", "accounts", "users"] {
                assert!(
                    !l.starts_with(banned),
                    "{dir}: nats.conf sets `{l}`; authorization comes from {USERS_SECRET} alone"
                );
            }
        }
        let includes: Vec<&str> = active
            .iter()
            .filter_map(|l| l.strip_prefix("include "))
            .map(str::trim)
            .collect();
        // Resolved as nats-server does, relative to the config file's directory: the users
        // file from its Secret, once; anything else from this ConfigMap (TLS, say), where
        // this test has read it.
        let script = shell_script(c);
        let config_path = script
            .split_whitespace()
            .skip_while(|a| *a != "--config")
            .nth(1)
            .expect("--config FILE");
        let config_dir = Path::new(config_path).parent().unwrap();
        let mut users_includes = Vec::new();
        for inc in &includes {
            let path = normalize(&config_dir.join(inc));
            let mount = mount_of(c, path.to_str().unwrap());
            let v = volume(sts, text(mount, "/name")).unwrap();
            if v.pointer("/secret/secretName") == Some(&json!(USERS_SECRET)) {
                users_includes.push((path, mount, v));
            } else {
                assert_eq!(
                    path.parent(),
                    Some(config_dir),
                    "{dir}: nats.conf includes {} from elsewhere than its ConfigMap",
                    path.display()
                );
                let name = path.file_name().unwrap().to_str().unwrap();
                let text_of = &m.data("nats-config")[name];
                for l in text_of.lines().map(|l| l.split('#').next().unwrap().trim()) {
                    for banned in [
                        "authorization",
                        "no_auth_user",
                        "accounts",
                        "users",
                        "include",
                    ] {
                        assert!(!l.starts_with(banned), "{dir}: {name} sets `{l}`");
                    }
                }
            }
        }
        assert_eq!(
            users_includes.len(),
            1,
            "{dir}: the users file, once: {includes:?}"
        );
        let (included, mount, v) = users_includes.remove(0);
        let item = list(v, "/secret/items")
            .iter()
            .find(|i| i["key"] == USERS_KEY)
            .expect("the users item");
        assert_eq!(
            included,
            Path::new(text(mount, "/mountPath")).join(text(item, "/path")),
            "{dir}: nats.conf includes another file than the users Secret's"
        );
        // The start script checks that very file.
        assert!(
            script.contains(included.to_str().unwrap()),
            "{dir}: {script}"
        );

        // No configuration anywhere grants the reply wildcard (every inbox: route answers,
        // worker state, sync exports).
        assert!(
            !m.yaml.contains("_INBOX.>"),
            "{dir}: the rendered manifests grant _INBOX.>"
        );
    }
}

/// `a/b/../c` → `a/c` (lexically, as nats-server joins include paths).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in p.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Each process holds its own seed, and only it

#[test]
fn every_secret_referenced_is_one_kvrouter_creds_writes_or_optional() {
    for m in every() {
        for w in m.workloads() {
            for (who, name, key, optional) in secret_refs(w) {
                let at = format!("{}: {} {who}", m.dir, short(w));
                match creds_secret_keys(&name) {
                    Some(keys) => {
                        let key = key.unwrap_or_else(|| {
                            assert_eq!(name, REPLICAS_SECRET, "{at}: all of {name}");
                            String::new()
                        });
                        match keys {
                            Some(k) => assert_eq!(key, k, "{at}: {name} has no key {key}"),
                            None => assert!(
                                key.is_empty()
                                    || (key.starts_with("replica-") && key.ends_with(".nk")),
                                "{at}: {name} has no key {key}"
                            ),
                        }
                    }
                    // The servers' certificate (overlays/nats-tls): only NATS holds its key;
                    // clients get the CA alone.
                    None if name == TLS_SECRET => {
                        if w["metadata"]["name"] != "nats" {
                            assert_eq!(key.as_deref(), Some("ca.crt"), "{at}: more than the CA");
                        }
                    }
                    // The picker's ext_proc certificate (overlays/gateway): its pods alone.
                    None if name == EPP_TLS_SECRET => {
                        assert_eq!(w["metadata"]["name"], "kvrouter-epp", "{at}");
                        assert!(
                            matches!(key.as_deref(), Some("tls.crt" | "tls.key" | "ca.crt")),
                            "{at}: {name} has no key {key:?}"
                        );
                    }
                    // Anything else (the Hub token) must not keep a pod from starting.
                    None => assert!(optional, "{at}: a required Secret {name} no tool writes"),
                }
            }
        }
    }
}

/// The path KVROUTER_NATS_NKEY_FILE names for a kvrouter container.
fn nkey_file(m: &Manifests, c: &Value) -> String {
    m.env(c)
        .get("KVROUTER_NATS_NKEY_FILE")
        .cloned()
        .unwrap_or_else(|| panic!("{}: no KVROUTER_NATS_NKEY_FILE", short(c)))
}

/// Runs an init container's script with its mounts moved under a temporary root: `secrets`
/// are written as the files of the volume that projects Secrets, and `env` as its env.
/// Returns the exit status, stderr, and the files of every other mount afterwards.
fn run_seed_init(
    w: &Value,
    init: &Value,
    secrets: &[(&str, &str)],
    env: &[(&str, &str)],
) -> (bool, String, BTreeMap<String, String>) {
    let root = tempfile::tempdir().unwrap();
    let under = |p: &str| root.path().join(p.trim_start_matches('/'));
    let mut script = shell_script(init);
    let mut outputs = Vec::new();
    for mount in list(init, "/volumeMounts") {
        let at = text(mount, "/mountPath");
        std::fs::create_dir_all(under(at)).unwrap();
        let v = volume(w, text(mount, "/name")).unwrap();
        if volume_secrets(v).is_empty() {
            outputs.push(under(at));
        } else {
            for (file, content) in secrets {
                std::fs::write(under(at).join(file), content).unwrap();
            }
        }
        script = script.replace(&format!("{at}/"), &format!("{}/", under(at).display()));
    }
    let mut cmd = Command::new("sh");
    cmd.args(["-ec", &script])
        .env_clear()
        .env("PATH", "/usr/bin:/bin");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("sh runs");
    let mut files = BTreeMap::new();
    for dir in outputs {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            let content = std::fs::read_to_string(&p).unwrap();
            files.insert(
                p.strip_prefix(root.path()).unwrap().display().to_string(),
                content,
            );
        }
    }
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        files,
    )
}

/// The init container of `w` that writes the volume holding `path`.
fn seed_writer<'a>(w: &'a Value, volume_name: &str) -> &'a Value {
    let writers: Vec<&Value> = list(pod_spec(w), "/initContainers")
        .iter()
        .filter(|c| {
            list(c, "/volumeMounts")
                .iter()
                .any(|m| m["name"] == volume_name && m["readOnly"] != true)
        })
        .collect();
    assert_eq!(
        writers.len(),
        1,
        "{}: one init container writes {volume_name}",
        short(w)
    );
    writers[0]
}

/// An env var's downward-API field path in a container.
fn field_ref<'a>(c: &'a Value, var: &str) -> &'a str {
    list(c, "/env")
        .iter()
        .find(|e| e["name"] == var)
        .and_then(|e| e.pointer("/valueFrom/fieldRef/fieldPath"))
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{}: {var} is not from the downward API", short(c)))
}

#[test]
fn each_kvrouter_process_holds_only_its_own_seed() {
    for m in every() {
        let dir = m.dir;
        for (w, c, sub) in m.kvrouter_containers() {
            let who = format!("{dir}: {} ({sub})", short(w));
            let path = nkey_file(m, c);
            let mount = mount_of(c, &path);
            assert_eq!(
                mount["readOnly"], true,
                "{who}: its seed's volume is writable"
            );
            let v = volume(w, text(mount, "/name")).unwrap();
            // No kvrouter container mounts a volume with another role's or process's seed.
            for m2 in list(c, "/volumeMounts") {
                let v2 = volume(w, text(m2, "/name")).unwrap();
                for s in volume_secrets(v2) {
                    assert!(
                        s != REPLICAS_SECRET && !s.starts_with("kvrouter-nats-bridge-"),
                        "{who}: mounts {s}, which holds other processes' seeds"
                    );
                }
            }
            match sub.as_str() {
                "frontend" | "epp" => {
                    // Its own role's Secret, directly, only its seed: the frontends' or an
                    // endpoint picker's (`kvrouter creds --epps N`: kvrouter-nats-epp-<i>).
                    let secrets = volume_secrets(v);
                    if sub == "frontend" {
                        assert_eq!(secrets, [FRONTEND_SECRET], "{who}");
                    } else {
                        assert!(
                            secrets.len() == 1
                                && creds_secret_keys(&secrets[0]).is_some()
                                && secrets[0].starts_with("kvrouter-nats-epp-"),
                            "{who}: {secrets:?}"
                        );
                    }
                    let items = list(v, "/secret/items");
                    assert_eq!(items.len(), 1, "{who}: {items:?}");
                    assert_eq!(items[0]["key"], SEED_KEY, "{who}");
                    assert!(
                        path.ends_with(&format!("/{}", text(&items[0], "/path"))),
                        "{who}: {path} is not the mounted seed"
                    );
                }
                "serve" => {
                    // An emptyDir its init container fills with replica-<its id>.nk, where its
                    // id is KVROUTER_REPLICA_ID: the pod name.
                    assert!(v.get("emptyDir").is_some(), "{who}: {v}");
                    assert_eq!(
                        field_ref(c, "KVROUTER_REPLICA_ID"),
                        "metadata.name",
                        "{who}"
                    );
                    let init = seed_writer(w, text(v, "/name"));
                    assert_eq!(field_ref(init, "POD_NAME"), "metadata.name", "{who}");
                    let other = "kvrouter-serve-1";
                    assert_ne!(other, POD_NAME);
                    let (ok, err, files) = run_seed_init(
                        w,
                        init,
                        &[
                            (&format!("replica-{POD_NAME}.nk"), "SEED-OF-0"),
                            (&format!("replica-{other}.nk"), "SEED-OF-1"),
                        ],
                        &[("POD_NAME", POD_NAME)],
                    );
                    assert!(ok, "{who}: {err}");
                    let in_volume = path.rsplit('/').next().unwrap();
                    assert_eq!(files.len(), 1, "{who}: {files:?}");
                    let (file, content) = files.iter().next().unwrap();
                    assert!(file.ends_with(&format!("/{in_volume}")), "{who}: {file}");
                    assert_eq!(content, "SEED-OF-0", "{who}: another replica's seed");
                    // A pod without credentials stops there, saying what to do.
                    let (ok, err, files) = run_seed_init(
                        w,
                        init,
                        &[(&format!("replica-{other}.nk"), "SEED-OF-1")],
                        &[("POD_NAME", POD_NAME)],
                    );
                    assert!(!ok && files.is_empty(), "{who}: started without its seed");
                    assert!(err.contains("kvrouter creds"), "{who}: {err}");
                }
                "bridge" => {
                    // An emptyDir its init container fills with the seed of the worker id the
                    // bridge registers as (its pod index), from Secret kvrouter-nats-bridge-<id>.
                    assert!(v.get("emptyDir").is_some(), "{who}: {v}");
                    let id_field = field_ref(c, "KVROUTER_WORKER_ID");
                    let init = seed_writer(w, text(v, "/name"));
                    assert_eq!(field_ref(init, "WORKER_ID"), id_field, "{who}");
                    assert_eq!(
                        id_field, "metadata.labels['apps.kubernetes.io/pod-index']",
                        "{who}"
                    );
                    assert_eq!(w["kind"], "StatefulSet", "{who}: pod indexes");
                    // The projected volume lists bridge-<id>.nk from kvrouter-nats-bridge-<id>
                    // for every pod index the StatefulSet has.
                    let all = list(init, "/volumeMounts")
                        .iter()
                        .map(|mm| volume(w, text(mm, "/name")).unwrap())
                        .find(|vv| !volume_secrets(vv).is_empty())
                        .expect("the bridges' seeds");
                    let mut listed = BTreeSet::new();
                    for src in list(all, "/projected/sources") {
                        let name = text(src, "/secret/name");
                        let id = name.strip_prefix("kvrouter-nats-bridge-").unwrap();
                        let items = list(src, "/secret/items");
                        assert_eq!(items.len(), 1, "{who}: {name}");
                        assert_eq!(items[0]["key"], SEED_KEY, "{who}: {name}");
                        assert_eq!(items[0]["path"], format!("bridge-{id}.nk"), "{who}");
                        listed.insert(id.parse::<u64>().unwrap());
                    }
                    let replicas = w["spec"]["replicas"].as_u64().unwrap();
                    for i in 0..replicas {
                        assert!(listed.contains(&i), "{who}: no seed listed for worker {i}");
                    }
                    let (ok, err, files) = run_seed_init(
                        w,
                        init,
                        &[("bridge-0.nk", "SEED-OF-0"), ("bridge-1.nk", "SEED-OF-1")],
                        &[("WORKER_ID", "1"), ("POD_NAME", "vllm-1")],
                    );
                    assert!(ok, "{who}: {err}");
                    assert_eq!(files.len(), 1, "{who}: {files:?}");
                    assert_eq!(files.values().next().unwrap(), "SEED-OF-1", "{who}");
                    let (ok, err, _) = run_seed_init(
                        w,
                        init,
                        &[("bridge-0.nk", "SEED-OF-0")],
                        &[("WORKER_ID", "1"), ("POD_NAME", "vllm-1")],
                    );
                    assert!(!ok && err.contains("kvrouter creds"), "{who}: {err}");
                }
                other => panic!("{who}: teach this test the NATS identity of `{other}`"),
            }
        }
        // The Secrets holding several processes' seeds are mounted by init containers only.
        for w in m.workloads() {
            for c in list(pod_spec(w), "/containers") {
                for mm in list(c, "/volumeMounts") {
                    let v = volume(w, text(mm, "/name")).unwrap();
                    for s in volume_secrets(v) {
                        assert!(
                            s != REPLICAS_SECRET && !s.starts_with("kvrouter-nats-bridge-"),
                            "{dir}: {} container {} mounts {s}",
                            short(w),
                            c["name"]
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// NetworkPolicies

/// A connection's source: a pod in the policies' namespace (`namespace: None`) or in another
/// namespace with these labels.
#[derive(Clone, Debug)]
pub(crate) struct Source {
    pub(crate) what: String,
    pub(crate) namespace: Option<Value>,
    pub(crate) labels: Value,
}

impl Source {
    fn pod(what: &str, labels: &Value) -> Self {
        Self {
            what: what.into(),
            namespace: None,
            labels: labels.clone(),
        }
    }
}

/// Whether a label selector (matchLabels and matchExpressions) picks these labels.
pub(crate) fn label_selector_picks(sel: &Value, labels: &Value) -> bool {
    let labels = labels.as_object().cloned().unwrap_or_default();
    let ok_labels = sel["matchLabels"]
        .as_object()
        .map(|ml| ml.iter().all(|(k, v)| labels.get(k) == Some(v)))
        .unwrap_or(true);
    let ok_exprs = list(sel, "/matchExpressions").iter().all(|e| {
        let key = text(e, "/key");
        let values: Vec<&Value> = list(e, "/values").iter().collect();
        match text(e, "/operator") {
            "In" => labels.get(key).is_some_and(|v| values.contains(&v)),
            "NotIn" => !labels.get(key).is_some_and(|v| values.contains(&v)),
            "Exists" => labels.contains_key(key),
            "DoesNotExist" => !labels.contains_key(key),
            op => panic!("unknown operator {op}"),
        }
    });
    ok_labels && ok_exprs
}

pub(crate) fn peer_admits(peer: &Value, src: &Source) -> bool {
    assert!(peer.get("ipBlock").is_none(), "teach this test ipBlock");
    match (peer.get("namespaceSelector"), &src.namespace) {
        // Pods of this namespace.
        (None, None) => label_selector_picks(&peer["podSelector"], &src.labels),
        (None, Some(_)) => false,
        (Some(ns), Some(ns_labels)) => {
            label_selector_picks(ns, ns_labels)
                && peer
                    .get("podSelector")
                    .is_none_or(|p| label_selector_picks(p, &src.labels))
        }
        // This namespace's own labels are the overlay's; the base has none to match.
        (Some(_), None) => false,
    }
}

/// Whether the NetworkPolicies admit `src` to the pods of workload `w` on `port` (a number
/// any of its containers may listen on).
pub(crate) fn admitted(m: &Manifests, w: &Value, port: u16, src: &Source) -> bool {
    let labels = pod_labels(w);
    let policies: Vec<&Value> = m
        .of_kind("NetworkPolicy")
        .filter(|p| label_selector_picks(&p["spec"]["podSelector"], labels))
        .filter(|p| list(p, "/spec/policyTypes").iter().any(|t| t == "Ingress"))
        .collect();
    if policies.is_empty() {
        return true; // no policy isolates the pod
    }
    let port_matches = |p: &Value| -> bool {
        match &p["port"] {
            Value::Null => true,
            Value::Number(n) => n.as_u64() == Some(port as u64),
            // Named ports resolve against the pod's (non-init) containers.
            Value::String(name) => list(pod_spec(w), "/containers").iter().any(|c| {
                list(c, "/ports")
                    .iter()
                    .any(|cp| cp["name"] == *name.as_str() && cp["containerPort"] == port)
            }),
            other => panic!("port {other}"),
        }
    };
    policies.iter().any(|p| {
        list(p, "/spec/ingress").iter().any(|rule| {
            let from_ok = rule.get("from").is_none()
                || list(rule, "/from")
                    .iter()
                    .any(|peer| peer_admits(peer, src));
            let port_ok =
                rule.get("ports").is_none() || list(rule, "/ports").iter().any(port_matches);
            from_ok && port_ok
        })
    })
}

/// A workload's container port by name.
fn port_named(w: &Value, name: &str) -> u16 {
    let c = all_containers(w)
        .find(|c| list(c, "/ports").iter().any(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("{}: no port {name}", short(w)));
    container_port(c, &json!(name))
}

/// Prometheus as network-policies.yaml names it (its namespace and pod labels).
fn prometheus(m: &Manifests) -> Source {
    let p = m.get("NetworkPolicy", "kvrouter-prometheus");
    let peer = &p["spec"]["ingress"][0]["from"][0];
    let ns = peer["namespaceSelector"]["matchLabels"].clone();
    let pod = peer["podSelector"]["matchLabels"].clone();
    Source {
        what: "Prometheus".into(),
        namespace: Some(ns),
        labels: pod,
    }
}

#[test]
fn every_workload_is_behind_a_default_deny_ingress_policy() {
    for m in every() {
        let dir = m.dir;
        let deny: Vec<&Value> = m
            .of_kind("NetworkPolicy")
            .filter(|p| {
                list(p, "/spec/policyTypes").iter().any(|t| t == "Ingress")
                    && list(p, "/spec/ingress").is_empty()
            })
            .collect();
        assert!(!deny.is_empty(), "{dir}: no default-deny ingress policy");
        for w in m.workloads() {
            assert!(
                deny.iter()
                    .any(|p| label_selector_picks(&p["spec"]["podSelector"], pod_labels(w))),
                "{dir}: the default deny does not select {}",
                short(w)
            );
            let own = m
                .of_kind("NetworkPolicy")
                .filter(|p| !deny.contains(p))
                .filter(|p| label_selector_picks(&p["spec"]["podSelector"], pod_labels(w)))
                .count();
            assert!(
                own > 0,
                "{dir}: no NetworkPolicy admits anything to {}",
                short(w)
            );
            // A stranger in the namespace reaches nothing but the frontends' port.
            let stranger = Source::pod("a stranger pod", &json!({"app": "stranger"}));
            for c in all_containers(w) {
                for p in list(c, "/ports") {
                    let port = p["containerPort"].as_u64().unwrap() as u16;
                    let open = admitted(m, w, port, &stranger);
                    let public =
                        w["metadata"]["name"] == "kvrouter-frontend" && p["name"] == "http";
                    assert_eq!(
                        open,
                        public,
                        "{dir}: {} port {port}: a stranger {}",
                        short(w),
                        if open {
                            "gets in"
                        } else {
                            "is kept out of a public port"
                        }
                    );
                }
            }
        }
    }
}

#[test]
fn network_policies_admit_only_who_needs_each_port() {
    for m in every() {
        let dir = m.dir;
        let nats = m.workload("nats");
        let serve = m.workload("kvrouter-serve");
        let frontend = m.workload("kvrouter-frontend");
        let (engine, bridge) = m.kvrouter("bridge");
        let pod = |w: &Value| Source::pod(&short(w), pod_labels(w));
        let prom = prometheus(m);
        let peer_ns = Source {
            what: "a peer router in an admitted namespace".into(),
            namespace: Some(json!({"kvrouter.io/peer-router": "true"})),
            labels: json!({"kvrouter.io/peer-router": "true"}),
        };
        let other_ns = Source {
            what: "any pod of another namespace".into(),
            namespace: Some(json!({"kubernetes.io/metadata.name": "elsewhere"})),
            labels: json!({"kvrouter.io/peer-router": "true", "app.kubernetes.io/name": "kvrouter"}),
        };
        let lookalike = Source::pod(
            "a pod with the part-of label only",
            &json!({"app.kubernetes.io/part-of": "kvrouter"}),
        );
        let all = [
            pod(nats),
            pod(serve),
            pod(frontend),
            pod(engine),
            prom.clone(),
            peer_ns.clone(),
            other_ns,
            lookalike,
        ];

        // Port, its workload, and who may connect (by `what`); everyone else is refused.
        let engine_env = m.env(bridge);
        // KV events on tcp:// ports (socket files have none).
        let tcp = |key: &str| {
            let e = &engine_env[key];
            e.starts_with("tcp://").then(|| host_port(e).1)
        };
        let (events, replay) = (
            tcp("KVROUTER_ZMQ_ENDPOINT"),
            tcp("KVROUTER_REPLAY_ENDPOINT"),
        );
        let dp: u16 = engine_env
            .get("KVROUTER_DP_SIZE")
            .map_or(1, |d| d.parse().unwrap());
        let (_, monitor) = host_port(
            m.data("nats-config")["nats.conf"]
                .lines()
                .find_map(|l| l.trim().strip_prefix("http:"))
                .unwrap()
                .trim(),
        );
        let mut table: Vec<(&Value, u16, &str, Vec<String>)> = vec![
            (
                nats,
                port_named(nats, "client"),
                "NATS clients",
                vec![short(serve), short(frontend), short(engine)],
            ),
            (
                nats,
                port_named(nats, "cluster"),
                "NATS routes",
                vec![short(nats)],
            ),
            (nats, monitor, "NATS monitoring", vec![]),
            (
                serve,
                port_named(serve, "api"),
                "replicas' JSON API",
                vec![short(frontend), peer_ns.what.clone()],
            ),
            (
                serve,
                port_named(serve, "admin"),
                "replicas' admin",
                vec![prom.what.clone()],
            ),
            (
                engine,
                port_named(engine, "http"),
                "vLLM's OpenAI port",
                vec![short(frontend), prom.what.clone()],
            ),
            (
                engine,
                port_named(engine, "bridge-admin"),
                "the bridge's admin",
                vec![prom.what.clone()],
            ),
        ];
        for r in 0..dp {
            if let Some(events) = events {
                table.push((engine, events + r, "vLLM's KV events", vec![]));
            }
            if let Some(replay) = replay {
                table.push((engine, replay + r, "vLLM's replay", vec![]));
            }
        }
        for (w, port, what, allowed) in &table {
            for src in &all {
                let want = allowed.contains(&src.what);
                assert_eq!(
                    admitted(m, w, *port, src),
                    want,
                    "{dir}: {what} ({} port {port}) from {}: {}",
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
        // The frontends' port is open to anyone (the ingress controller's users).
        for src in &all {
            assert!(
                admitted(m, frontend, port_named(frontend, "http"), src),
                "{dir}: {src:?}"
            );
        }
        // Nothing declares the engine's ZMQ ports for others to find.
        for c in all_containers(engine) {
            for p in list(c, "/ports") {
                let port = p["containerPort"].as_u64().unwrap() as u16;
                let zmq = |base: Option<u16>| base.is_some_and(|b| (b..b + dp).contains(&port));
                assert!(
                    !zmq(events) && !zmq(replay),
                    "{dir}: {} declares ZMQ port {port}",
                    short(engine)
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pinned images, packages and models

/// `workspace.package.version` of Cargo.toml.
fn workspace_version() -> String {
    let toml = std::fs::read_to_string(repo_file("Cargo.toml")).unwrap();
    let section = toml
        .split("[workspace.package]")
        .nth(1)
        .expect("[workspace.package]");
    let line = section
        .lines()
        .find(|l| l.trim_start().starts_with("version"))
        .expect("a version");
    line.split('"').nth(1).unwrap().to_string()
}

/// Whether an image reference names one build: a digest, or a tag with a full version
/// (major.minor.patch).
fn pinned(image: &str) -> bool {
    if let Some((_, digest)) = image.split_once('@') {
        return digest.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        });
    }
    let tag = image_tag(image);
    tag != "latest" && tag.matches('.').count() >= 2 && tag.chars().any(|c| c.is_ascii_digit())
}

#[test]
fn pinned_is_a_digest_or_a_full_version() {
    for good in [
        "nats:2.15.0-alpine",
        "kvrouter:0.1.0",
        "registry.example.com:5000/kvrouter:0.1.0",
        "vllm/vllm-openai:v0.11.0",
        "nats@sha256:ac8f88a6494bffc2c2a5289a0ca61cb28a9145c11ba5677cf24265d07f46d8d4",
    ] {
        assert!(pinned(good), "{good}");
    }
    for bad in [
        "kvrouter",
        "kvrouter:latest",
        "nats:2",
        "nats:2.11-alpine",
        "python:3.12-slim",
        "registry.example.com:5000/kvrouter",
        "nats@sha256:abc",
    ] {
        assert!(!pinned(bad), "{bad}");
    }
}

#[test]
fn every_image_is_pinned_and_kvrouter_is_this_version() {
    let version = workspace_version();
    for m in every() {
        for w in m.workloads() {
            for c in all_containers(w) {
                let image = text(c, "/image");
                assert!(
                    pinned(image),
                    "{}: {} container {}: {image} floats (pin a full version or a digest in \
                     kustomization.yaml `images:`)",
                    m.dir,
                    short(w),
                    c["name"]
                );
                if image_name(image) == "kvrouter" {
                    assert_eq!(
                        image_tag(image),
                        version,
                        "{}: the kvrouter image is not the workspace version",
                        m.dir
                    );
                }
            }
        }
    }
    // The base pins every image in one place: its kustomization's `images:`, so the
    // manifests themselves name none with a tag.
    for f in ["nats.yaml", "serve.yaml", "frontend.yaml", "vllm.yaml"] {
        let yaml =
            std::fs::read_to_string(repo_file(&format!("deploy/kubernetes/base/{f}"))).unwrap();
        for line in yaml.lines().map(str::trim) {
            if let Some(image) = line.strip_prefix("image:") {
                let image = image.trim();
                assert!(
                    !image.contains(':') && !image.contains('@'),
                    "base/{f}: {image}: pin it in kustomization.yaml instead"
                );
            }
        }
    }
}

#[test]
fn pip_installs_pin_every_package() {
    let mut seen = 0;
    for m in every() {
        for w in m.workloads() {
            for c in all_containers(w) {
                let script: String = list(c, "/command")
                    .iter()
                    .chain(list(c, "/args"))
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" ")
                    .replace("\\\n", " ");
                for install in script.split("pip install").skip(1) {
                    seen += 1;
                    let who = format!("{}: {} container {}", m.dir, short(w), c["name"]);
                    let line = install.lines().next().unwrap_or("");
                    let words: Vec<&str> = line.split_whitespace().collect();
                    assert!(
                        words.contains(&"--no-deps"),
                        "{who}: without --no-deps, dependencies resolve to whatever is newest"
                    );
                    let mut skip_value = false;
                    let mut packages = 0;
                    for word in words {
                        if skip_value {
                            skip_value = false;
                            continue;
                        }
                        if ["--target", "-t", "-c", "--constraint", "-r"].contains(&word) {
                            assert!(
                                !["-r", "-c", "--constraint"].contains(&word),
                                "{who}: {word}"
                            );
                            skip_value = true;
                            continue;
                        }
                        if word.starts_with('-') {
                            continue;
                        }
                        let spec = word.trim_matches(['\'', '"']);
                        let (name, version) = spec
                            .split_once("==")
                            .unwrap_or_else(|| panic!("{who}: {spec} is not pinned with =="));
                        assert!(
                            !name.is_empty()
                                && !version.is_empty()
                                && version
                                    .chars()
                                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '.'),
                            "{who}: {spec}"
                        );
                        packages += 1;
                    }
                    assert!(packages > 0, "{who}: pip install of nothing: {line}");
                }
            }
        }
    }
    assert!(
        seen > 0,
        "no pip install found: teach this test where it went"
    );
}

fn commit(rev: &str) -> bool {
    rev.len() == 40
        && rev
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

#[test]
fn models_are_fetched_at_a_pinned_commit_the_engines_share() {
    for m in every() {
        let dir = m.dir;
        let (fw, fc) = m.kvrouter("frontend");
        let init = container(fw, "fetch-tokenizer");
        let env = m.env(init);
        let revisions: BTreeMap<&str, &str> = env
            .get("MODEL_REVISIONS")
            .unwrap_or_else(|| panic!("{dir}: no MODEL_REVISIONS for fetch-tokenizer"))
            .split(',')
            .map(|s| s.split_once('=').expect("NAME=COMMIT"))
            .collect();
        for spec in m.env(fc)["KVROUTER_MODEL_DIRS"].split(',') {
            let (name, _) = spec.split_once('=').unwrap();
            let rev = revisions
                .get(name)
                .unwrap_or_else(|| panic!("{dir}: no revision for {name}"));
            assert!(commit(rev), "{dir}: {name} at {rev}, not a commit");
        }
        assert!(
            shell_script(init).contains("revision=revisions[name]"),
            "{dir}: the script does not download at the revision"
        );

        // vLLM serves the same commit (weights and tokenizer).
        let (w, bridge) = m.kvrouter("bridge");
        let model = m.env(bridge)["KVROUTER_MODEL"].clone();
        let engine = all_containers(w)
            .find(|c| image_name(text(c, "/image")) == "vllm-openai")
            .unwrap();
        let engine_env = m.env(engine);
        let args: Vec<String> = list(engine, "/args")
            .iter()
            .map(|a| crate::k8s_manifests::expand(a.as_str().unwrap(), &engine_env))
            .collect();
        for flag in ["--revision", "--tokenizer-revision"] {
            let at = args
                .iter()
                .position(|a| a == flag)
                .unwrap_or_else(|| panic!("{dir}: vLLM without {flag}"));
            assert_eq!(
                Some(&args[at + 1].as_str()),
                revisions.get(model.as_str()),
                "{dir}: vLLM's {flag} is not the frontend's revision of {model}"
            );
        }
    }
}
